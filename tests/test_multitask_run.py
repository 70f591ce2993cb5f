"""The multi-task executor (`dynabatch.pipeline.multitask`, Spindle's execution half): mtmm-tiny's components
on the device groups of an `Allocation`, 4 gloo ranks, padded micro-batches of mixed tasks (text-only,
image+text, audio+text): loss, every parameter's gradient and the SGD update equal one process running the
plain components on the same samples with a loss written here (float64; gradients within 1e-10 of the
largest reference gradient); a micro-batch never touches a component its task skips; wrong allocations are
refused by name; the LLaVA adapter as two components equals the Hugging Face model.

One launch of 4 ranks (`multitask_worker`, in this file, run by `launch_local`) runs every distributed case.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from dynabatch.core.multitask.allocation import Allocation, Placement
from dynabatch.core.multitask.zoo import mtmm_tiny_graph
from dynabatch.pipeline import launch_local
from dynabatch.pipeline.models.contract import IGNORE_INDEX
from dynabatch.pipeline.models.mtmm import mtmm_tiny
from dynabatch.pipeline.multitask import AllocationError, check_allocation

SMALL = dict(vocab=96, hidden=32, heads=2, ffn=64, vision_hidden=16, classes=5)
TOL = 1e-10  # |grad - reference grad| <= TOL x the largest reference gradient (float64)
LR = 0.1

#: wave 0: vit on 0, 1 and audio on 2; wave 1: projector on 1, 3; wave 2: backbone on all four; wave 3: the LM
#: head on 0, 2 and the classifier on 3 (groups of 1, 2 and 4 ranks, hand-offs on one rank and across ranks)
MIXED = [("vit", (0, 1), 0), ("audio", (2,), 0), ("projector", (1, 3), 1), ("backbone", (0, 1, 2, 3), 2),
         ("head_caption", (0, 2), 3), ("head_cls", (3,), 3)]
#: micro-batches: (task, rows, text length, tiles, audio frames)
STEP = [("image_text", 3, 7, 4, 0), ("text", 2, 9, 0, 0), ("audio_text", 3, 5, 0, 8), ("text", 4, 6, 0, 0),
        ("image_text", 2, 5, 2, 0), ("audio_text", 2, 4, 0, 6), ("image_text", 1, 6, 1, 0), ("text", 1, 3, 0, 0)]


def allocation(spec, num_devices: int = 4) -> Allocation:
    """An `Allocation` from ``(component, ranks, wave)`` triples."""
    placements = tuple(Placement(c, tuple(r), wave=w) for c, r, w in spec)
    waves = tuple(tuple(c for c, _, w in spec if w == k) for k in range(max(w for _, _, w in spec) + 1))
    return Allocation(placements, waves, num_devices, 0.0, {})


def step_batches(model, step, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    graph = mtmm_tiny_graph()
    batches = [model.random_batch(graph.reaches(t), r, n, gen, tiles=k, audio_frames=f) for t, r, n, k, f in step]
    for b in batches:  # padding labels and a label past a row's text never count
        b["labels"][0, -1] = IGNORE_INDEX
    return batches, [s[0] for s in step]


def reference_step(model, graph, batches, tasks):
    """One process: each micro-batch through its task's components in path order, the loss written here (the
    LM head's next-token cross-entropy on the text positions, found from the modality tokens before the text;
    the classifier's cross-entropy on ``class_labels``), summed, backward, gradients / target count."""
    pool, tt = 2, 4
    total, terms = torch.zeros((), dtype=torch.float64), 0
    for b, t in zip(batches, tasks):
        out = {}
        for c in graph.reaches(t)[:-1]:
            ins = {i: out[i] for i in graph.component(c).inputs if i in out}
            out[c] = model.component(c)(ins, b)
        h = out["backbone"]
        head = graph.reaches(t)[-1]
        if head == "head_cls":
            logits = model.component(head).logits(h, b)
            y = b["class_labels"]
            total = total + torch.nn.functional.cross_entropy(logits, y, reduction="sum")
            terms += len(y)
            continue
        logits = model.component(head).logits(h)
        n = b["attention_mask"].sum(1)
        before = (b["image_tiles"] * tt if "image_tiles" in b else
                  (b["audio_frames"] + pool - 1) // pool if "audio_frames" in b else torch.zeros_like(n))
        for r in range(len(n)):
            for k in range(int(n[r])):
                col = int(before[r]) + k
                y = int(b["labels"][r, k])
                if col == 0 or y == IGNORE_INDEX:
                    continue
                total = total - torch.log_softmax(logits[r, col - 1], -1)[y]
                terms += 1
    total.backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(terms)
    return float(total) / terms, terms


def _gap(held, model, ref) -> tuple[float, float, int]:
    diff = scale = 0.0
    missing = 0
    for c in held:
        for p, q in zip(model.component(c).parameters(), ref.component(c).parameters()):
            if q.grad is None:
                missing += p.grad is not None and bool(p.grad.abs().max() > 0)
                continue
            if p.grad is None:
                missing += 1
                continue
            diff = max(diff, float((p.grad - q.grad).abs().max()))
            scale = max(scale, float(q.grad.abs().max()))
    return diff, scale, missing


def _events(res) -> list:
    return [(e.kind, e.component, e.microbatch, e.direction, e.peer) for e in res.events]


def multitask_worker(rank, world, port, cases, outdir):
    """Rank side: one world, each case an allocation of mtmm-tiny (or the LLaVA graph) run for one step; per case
    the loss, target count, gradient gap against `reference_step`, the SGD update's gap, and what the rank did,
    written to ``outdir/rank{rank}.json``. Then a last step in which rank 2's backbone raises: every rank ends
    with an error (the others' naming rank 2), which the launch returns as their exit codes and stderr."""
    from dynabatch.pipeline.multitask import SpindleExecutor, attach_allocation, init_spindle

    torch.set_default_dtype(torch.float64)
    graph = mtmm_tiny_graph()
    ctx = None
    out = []
    for case in cases:
        alloc = allocation(case["allocation"])
        if case.get("llava"):
            graph_l, model, ref_hf, hf = _llava()
            g = graph_l
        else:
            g = graph
            model = mtmm_tiny(**SMALL, dtype=torch.float64, seed=3)
            ref = mtmm_tiny(**SMALL, dtype=torch.float64, seed=3)
        ctx = init_spindle(alloc, g, rank=rank, world_size=world, master_port=port, timeout_s=60) if ctx is None \
            else attach_allocation(ctx.dist, alloc, g)
        if case.get("llava"):
            batches = case_batches_llava(model, g)
            tasks = [t for t, _ in batches]
            batches = [b for _, b in batches]
        else:
            batches, tasks = step_batches(model, case["step"], seed=case.get("seed", 0))
        ex = SpindleExecutor(model, g, ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
        before = {c: [p.detach().clone() for p in model.component(c).parameters()] for c in ex.held}
        if case.get("tags"):  # the DataLoader's per-sample task tags instead of a task list
            for b, t in zip(batches, tasks):
                b["tasks"] = (t,) * len(b["input_ids"])
            res = ex.step(batches)
        else:
            res = ex.step(batches, tasks)
        if case.get("llava"):
            from dynabatch.pipeline.models.hf import hf_reference_step

            ref_loss, ref_n = hf_reference_step(ref_hf, batches)
            diff, scale = _hf_gap(hf, ref_hf, ex.held, model)
            upd = 0.0
            missing = 0
        else:
            ref_loss, ref_n = reference_step(ref, g, batches, tasks)
            diff, scale, missing = _gap(ex.held, model, ref)
            upd = max((float((p - (b - LR * q.grad)).abs().max()) for c in ex.held
                       for p, b, q in zip(model.component(c).parameters(), before[c], ref.component(c).parameters())
                       if q.grad is not None), default=0.0)
        out.append({"loss": res.loss, "ref_loss": ref_loss, "tokens": res.num_tokens, "ref_tokens": ref_n,
                    "diff": diff, "scale": scale, "missing": missing, "update": upd, "held": list(ex.held),
                    "microbatches": {c: list(v) for c, v in res.microbatches.items()}, "events": _events(res),
                    "seconds": res.component_seconds, "tasks": tasks})
    import json
    import time
    from pathlib import Path

    Path(outdir, f"rank{rank}.json").write_text(json.dumps(out))
    model = mtmm_tiny(**SMALL, dtype=torch.float64, seed=3)
    ctx = attach_allocation(ctx.dist, allocation(MIXED), graph)
    ex = SpindleExecutor(model, graph, ctx)
    if rank == 2:
        def broken(inputs, batch):
            raise RuntimeError("injected failure in the backbone")
        model.modules["backbone"].forward = broken
    batches, tasks = step_batches(model, STEP)
    t0 = time.monotonic()
    try:
        ex.step(batches, tasks)
    finally:
        print(f"failed after {time.monotonic() - t0:.2f} s", flush=True)


def _llava():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from hf_tiny import build, llava_config

    from dynabatch.pipeline.models.hf.llava_graph import llava_graph

    hf = build(llava_config())
    ref = copy.deepcopy(hf)
    graph, model = llava_graph(hf)
    return graph, model, ref, hf


def case_batches_llava(model, graph):
    gen = torch.Generator().manual_seed(5)
    spec = [("image_text", 3, 8, 3), ("text", 2, 6, 0), ("image_text", 1, 5, 1), ("text", 3, 4, 0)]
    return [(t, model.random_batch(graph.reaches(t), r, n, gen, tiles=k)) for t, r, n, k in spec]


def _hf_gap(hf, ref, held, model):
    """Gradient gap over the parameters of the held components, matched by their Hugging Face names."""
    mine = {id(p) for c in held for p in model.component(c).parameters()}
    named = dict(ref.named_parameters())
    diff = scale = 0.0
    for name, p in hf.named_parameters():
        if id(p) not in mine or named[name].grad is None:
            continue
        q = named[name]
        diff = max(diff, float((p.grad - q.grad).abs().max()))
        scale = max(scale, float(q.grad.abs().max()))
    return diff, scale


@pytest.fixture(scope="module")
def launched():
    cases = [{"allocation": MIXED, "step": STEP},
             {"allocation": MIXED, "step": [s for s in STEP if s[0] == "text"], "seed": 1, "tags": True},
             {"allocation": [("vit", (0, 1), 0), ("backbone", (0, 1, 2, 3), 1)], "llava": True}]
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as outdir:
        res = launch_local(f"{__file__}:multitask_worker", 4, args=(cases, outdir), idle_timeout_s=120)
        for r in res:
            assert not r.timed_out, f"rank {r.rank} hung:\n{r.stderr[-3000:]}"
            assert Path(outdir, f"rank{r.rank}.json").exists(), f"rank {r.rank} failed:\n{r.stderr[-3000:]}"
        return [json.loads(Path(outdir, f"rank{r.rank}.json").read_text()) for r in res], res


def test_a_failing_rank_stops_its_peers_with_its_error(launched):
    """Rank 2's backbone raises in the last step: rank 2 fails with its own error, the three others stop within
    seconds (not at the 60 s liveness timeout) with an error naming rank 2 and its exception."""
    import re

    from dynabatch.pipeline.runtime.launch import first_failure

    res = launched[1]
    assert all(r.returncode not in (0, None) for r in res), [r.returncode for r in res]
    assert "injected failure in the backbone" in res[2].stderr
    assert first_failure(res).rank == 2
    for r in res:
        if r.rank != 2:
            assert "rank 2" in r.stderr and "injected failure in the backbone" in r.stderr, r.stderr[-2000:]
        took = re.findall(r"failed after ([\d.]+) s", r.stdout)
        assert took and float(took[-1]) < 30.0, (r.rank, took, r.stderr[-1500:])


def test_four_gloo_ranks_equal_one_process(launched):
    """Mixed tasks on MIXED: the world's loss and target count, every held parameter's gradient and its SGD
    update equal the one-process reference; every component that a micro-batch reached has its gradient."""
    for rank, cases in enumerate(launched[0]):
        c = cases[0]
        assert c["tokens"] == c["ref_tokens"] > 0
        assert c["loss"] == pytest.approx(c["ref_loss"], rel=1e-12)
        assert c["scale"] > 0 and c["diff"] <= TOL * c["scale"], (rank, c["diff"], c["scale"])
        assert c["missing"] == 0, rank
        assert c["update"] <= TOL * max(1.0, LR * c["scale"]), (rank, c["update"])
        assert set(c["held"]) == {n for n, ranks, _ in MIXED if rank in ranks}
        assert all(s > 0 for s in c["seconds"].values()), c["seconds"]
    # the routes split each group's micro-batches over its ranks: together they ran each reached one once
    for name, ranks, _ in MIXED:
        ran = sorted(i for r in ranks for i in launched[0][r][0]["microbatches"][name])
        want = [i for i, s in enumerate(STEP) if name in mtmm_tiny_graph().reaches(s[0])]
        assert ran == want, name


def test_a_microbatch_never_touches_the_components_its_task_skips(launched):
    """No compute and no message of any rank names a component for a micro-batch whose task skips it; a step of
    text-only micro-batches leaves the vit, audio, projector and classifier groups without any op (no
    all-reduce either) and still equals one process (its tasks read from the micro-batches' ``tasks`` tags)."""
    graph = mtmm_tiny_graph()
    for cases in launched[0]:
        c = cases[0]
        for kind, comp, mb, direction, peer in c["events"]:
            if mb >= 0:
                assert comp in graph.reaches(c["tasks"][mb]), (kind, comp, mb)
        text = cases[1]
        assert text["loss"] == pytest.approx(text["ref_loss"], rel=1e-12)
        assert text["diff"] <= TOL * text["scale"]
        idle = {"vit", "audio", "projector", "head_cls"}
        assert not [e for e in text["events"] if e[1] in idle], text["events"]
    # ranks 1 and 3 hold the projector; on the mixed step its image and audio micro-batches came from vit and
    # audio, crossing ranks: both directions of each such edge were posted
    sends = [e for cases in launched[0] for e in cases[0]["events"] if e[0] == "send"]
    assert {e[3] for e in sends} == {"forward", "backward"}


def test_llava_as_two_components_on_four_ranks(launched):
    """The LLaVA adapter as ``vit`` (ranks 0, 1) and ``backbone`` (all four): loss and gradients equal the
    Hugging Face model's own forward/backward (`hf_reference_step`)."""
    for rank, cases in enumerate(launched[0]):
        c = cases[2]
        assert c["tokens"] == c["ref_tokens"] > 0
        assert c["loss"] == pytest.approx(c["ref_loss"], rel=1e-12)
        assert c["scale"] > 0 and c["diff"] <= 1e-8 * c["scale"], (rank, c["diff"], c["scale"])
        text = [i for i, t in enumerate(c["tasks"]) if t == "text"]
        assert not [e for e in c["events"] if e[1] == "vit" and e[2] in text]


def test_each_allreduce_is_posted_when_its_components_backward_ends(launched):
    """On every rank, the backward computes and all-reduce posts come in the plan's order: each held component's
    backward items (last micro-batch first), its group's all-reduce right after them (groups of two or more
    ranks), then the next component's backward, as the stream model assumes. On MIXED, rank 0 posts the LM
    head's all-reduce (group 0, 2) before its backbone backward and the backbone's (all four) before its vit
    backward: an all-reduce is in flight while another component's backward runs."""
    groups = {c: ranks for c, ranks, _ in MIXED}
    overlapped = 0
    for rank, cases in enumerate(launched[0]):
        c = cases[0]
        seen = [(e[0], e[1], e[2]) for e in map(tuple, c["events"])
                if (e[0] == "compute" and e[3] == "backward") or e[0] == "all_reduce"]
        want = []
        for comp in reversed(c["held"]):
            want += [("compute", comp, mb) for mb in reversed(c["microbatches"][comp])]
            if len(groups[comp]) > 1:
                want.append(("all_reduce", comp, -1))
        assert seen == want, (rank, seen)
        kinds = [k for k, _, _ in seen]
        overlapped += sum(1 for x, k in enumerate(kinds) if k == "all_reduce" and "compute" in kinds[x + 1:])
    assert overlapped >= 3, overlapped  # rank 0: head_caption's and backbone's; rank 1: backbone's, at least


def test_wrong_allocations_are_refused_by_name():
    """A component without ranks, ranks outside the world, a pipeline inside a component, split micro-batches,
    an input in a later wave, or a device count other than the world's: `AllocationError` naming the
    component."""
    graph = mtmm_tiny_graph()
    check_allocation(allocation(MIXED), graph, 4)
    with pytest.raises(AllocationError, match="component 'audio' no ranks"):
        check_allocation(allocation([s for s in MIXED if s[0] != "audio"]), graph, 4)
    wide = [(c, tuple(r + 4 for r in ranks) if c == "backbone" else ranks, w) for c, ranks, w in MIXED]
    with pytest.raises(AllocationError, match=r"'backbone' is placed on ranks \[4, 5, 6, 7\].*outside the world of 4"):
        check_allocation(allocation(wide, num_devices=8), graph, 4)
    piped = allocation(MIXED)
    piped = Allocation(tuple(Placement(p.component, p.ranks, 2 if p.component == "backbone" else 1, p.wave)
                             for p in piped.placements), piped.waves, 4, 0.0, {})
    with pytest.raises(AllocationError, match="'backbone' is placed with stages=2"):
        check_allocation(piped, graph, 4)
    split = allocation(MIXED)
    split = Allocation(tuple(Placement(p.component, p.ranks, 1, p.wave, 2 if p.component == "vit" else 1)
                             for p in split.placements), split.waves, 4, 0.0, {})
    with pytest.raises(AllocationError, match="'vit' is placed with pieces=2.*whole micro-batches"):
        check_allocation(split, graph, 4)
    late = [(c, (3,), 0) if c == "projector" else (c, r, w) for c, r, w in MIXED]
    with pytest.raises(AllocationError, match="'projector' \\(wave 0\\) reads 'vit'"):
        check_allocation(allocation(late), graph, 4)
    with pytest.raises(AllocationError, match="planned for 4 devices but the world has 8"):
        check_allocation(allocation(MIXED), graph, 8)


def test_task_tags_of_a_microbatch():
    """A micro-batch's task is its samples' one ``tasks`` tag; none, or a mix, is refused naming the micro-batch."""
    from dynabatch.pipeline.multitask import task_of

    assert task_of({"tasks": ("audio_text", "audio_text")}, 0) == "audio_text"
    with pytest.raises(ValueError, match="micro-batch 3 has no 'tasks' entry"):
        task_of({"input_ids": torch.zeros(1, 1)}, 3)
    with pytest.raises(ValueError, match=r"micro-batch 1 mixes tasks \['image_text', 'text'\]"):
        task_of({"tasks": ("text", "image_text")}, 1)


def test_components_match_the_graph_and_their_specs():
    """mtmm-tiny has the graph's components with the zoo's widths; on each task every component's output has
    exactly the shape its spec computes from the micro-batch, and the heads' target counts are their losses'."""
    graph = mtmm_tiny_graph()
    model = mtmm_tiny(dtype=torch.float64)
    assert set(model.modules) == set(graph.names)
    assert len(model.component("backbone").blocks) == graph.component("backbone").layers
    assert len(model.component("vit").blocks) == graph.component("vit").layers
    assert len(model.component("audio").blocks) == graph.component("audio").layers
    batches, tasks = step_batches(model, STEP)
    for b, t in zip(batches, tasks):
        shape = model.shape_of(b, t)
        out = {}
        for c in graph.reaches(t):
            ins = {i: out[i] for i in graph.component(c).inputs if i in out}
            y = model.component(c)(ins, b)
            spec = model.output_spec(c, shape)
            if spec is None:
                assert int(y[1]) == model.targets(c, b) and math.isfinite(float(y[0].detach()))
            else:
                assert spec.matches(y), (t, c, list(y.shape), spec)
                out[c] = y


def test_measure_bench_plumbing_without_ranks():
    """`bench spindle --measure`'s parts without a launch: its micro-batches hold exactly their samples' token
    counts (text, tiles, frames), and fed measured times equal to the cost model's own predictions (each
    micro-batch on the rank `route` gives it), the comparison refits nothing away and reports ratios of 1."""
    import dataclasses

    import numpy as np

    from dynabatch.bench.spindle_measure import SpindleMeasureConfig, compare, microbatches, step_samples
    from dynabatch.core.multitask.allocation import plan_allocation
    from dynabatch.core.multitask.routing import route
    from dynabatch.core.multitask.workload import ComponentCosts

    cfg = SpindleMeasureConfig(samples=18, warmup=1, calibrate=2, evaluate=2)
    graph = mtmm_tiny_graph()
    costs = ComponentCosts(graph, "cpu")
    samples = [step_samples(cfg, graph, k) for k in range(5)]
    model = mtmm_tiny(vocab=cfg.vocab)
    for b, t in zip(microbatches(samples[0], 56, 16, cfg.vocab, 16, 0), samples[0].microbatch_tasks):
        shape = model.shape_of(b, t)
        assert shape.text_len == int(b["attention_mask"].sum(1).max())
        assert shape.tiles == (int(b["image_tiles"].sum()) if t == "image_text" else 0)
        assert (shape.audio_frames > 0) == (t == "audio_text")
    for j, b in enumerate(microbatches(samples[1], 56, 16, cfg.vocab, 16, 1)):
        rows = np.flatnonzero(samples[1].microbatch == j)
        assert b["attention_mask"].sum(1).tolist() == samples[1].text[rows].tolist()
        if "image_tiles" in b:
            assert (b["image_tiles"] * 4).tolist() == samples[1].vision[rows].tolist()
        if "audio_frames" in b:
            assert (b["audio_frames"] // 2).tolist() == samples[1].audio[rows].tolist()
    # ComponentModel.step_samples reads the same counts back from the dicts
    back = model.step_samples(microbatches(samples[1], 56, 16, cfg.vocab, 16, 1), samples[1].microbatch_tasks)
    order = np.argsort(samples[1].microbatch, kind="stable")
    for name in ("text", "vision", "audio", "microbatch"):
        assert getattr(back, name).tolist() == getattr(samples[1], name)[order].tolist(), name
    assert back.tasks == tuple(np.array(samples[1].tasks)[order])
    alloc = plan_allocation(costs, costs.workload(samples[0]), cfg.world)
    payload = {"steps": [{"cost_s": None} for _ in samples]}
    measured = []
    for s in samples:
        w = costs.workload(s)
        routes = route(alloc, graph, s.microbatch_tasks)
        ranks = [dict() for _ in range(cfg.world)]
        for c in graph.names:
            for r, mbs in zip(alloc.placement(c).ranks, routes[c]):
                ranks[r][c] = {str(j): float(w.time_s[w.row(c)][j]) for j in mbs}
        measured.append(ranks)
    rows = compare(dataclasses.replace(cfg), graph, ComponentCosts(graph, "cpu"), samples, alloc, measured, payload)
    assert {r.component for r in rows} == set(graph.names)
    for r in rows:
        assert r.measured_s > 0 and r.ratio == pytest.approx(1.0, rel=0.02), r
        assert r.total_ratio == pytest.approx(1.0, rel=0.02), r
