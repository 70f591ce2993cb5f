"""The seed techniques on real (tiny random) Hugging Face models, issue 24 items 8 and 6.

In this process: flush-free streams with weight prediction on one stage equal the synchronous run bit
for bit; `dynabatch profile --model hf:...` measures padded, packed and image-tile micro-batches into
one file that the DataLoader, the planner and the partition search read; the partition search on
the profiled layers. In one 2-rank gloo launch (`technique_worker`, run by `launch_local` by path):
adaptive recomputation under a device memory limit, `MultiModelRunner` with two Llamas of different
sizes and the LLaVA vision bypass.
"""

from __future__ import annotations

import copy
import itertools
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the worker runs this file by path
from hf_tiny import build, decoder_config, llava_config  # noqa: E402
from prelaunch import Prelaunch, part  # noqa: E402

from dynabatch.pipeline.models import MicroBatchShape  # noqa: E402
from dynabatch.pipeline import launch_local  # noqa: E402

LAUNCHES = Prelaunch(parallel=1)


@pytest.fixture(scope="module", autouse=True)
def _launches(request):
    yield from LAUNCHES.started(request)


@pytest.fixture
def one_thread():
    """Tiny kernels on a small shared CPU: one thread measures the model, not the contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps(model, steps: int, seed: int, dims=((3, 10), (2, 13), (1, 7))):
    """``steps`` steps of padded micro-batches of (rows, length) ``dims``: (shapes, dicts, target tokens)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        shapes = [MicroBatchShape("padded", r, L, time_s=1e-3 * r * L, memory_bytes=1e3 * r * L) for r, L in dims]
        batches = [model.random_batch(s, gen) for s in shapes]
        out.append((shapes, batches, sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)))
    return out


# ---------------------------------------------------------------------------------------------
# flush-free with weight prediction (one stage, in this process)


def test_one_stage_flush_free_with_prediction_equals_synchronous(one_thread):
    """A tied Llama on one stage, AdamW, 3 steps: the flush-free stream with weight prediction (and with
    stashing) gives the synchronous run's losses and weights bit for bit; no forward waits for an update
    on one stage, so prediction must change nothing."""
    from dynabatch.pipeline import PipelineRunner, RunnerConfig, init_pipeline
    from dynabatch.pipeline.models.hf import from_hf

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with init_pipeline(1, rank=0, world_size=1, master_port=_port(), timeout_s=60) as ctx:
            runs, start = {}, {}
            for mode in ("sync", "predict", "stash"):
                model = from_hf(build(decoder_config("llama", tie_word_embeddings=True), seed=2))
                cfg = RunnerConfig(schedule="1f1b", flush=mode == "sync",
                                   weight_prediction=None if mode == "sync" else mode)
                runner = PipelineRunner.from_model(model, ctx, [0, len(model.layers)], cfg)
                start[mode] = [p.detach().clone() for p in runner.parameters()]
                opt = torch.optim.AdamW(runner.parameters(), lr=1e-2, eps=1e-4)
                data = _steps(model, 3, seed=3)
                res = runner.run_steps([(s, b) for s, b, _ in data], optimizer=opt, num_tokens=[n for *_, n in data])
                runs[mode] = ([r.loss for r in res], [p.detach().clone() for p in runner.parameters()])
    finally:
        torch.set_default_dtype(old)
    sync_loss, sync_w = runs["sync"]
    assert not any(torch.equal(a, b) for a, b in zip(start["sync"], sync_w))  # every weight trained (the tie included)
    for mode in ("predict", "stash"):
        loss, w = runs[mode]
        assert loss == sync_loss, mode
        assert len(w) == len(sync_w) and all(torch.equal(a, b) for a, b in zip(w, sync_w)), mode


# ---------------------------------------------------------------------------------------------
# profiling a Hugging Face model (item 6) and the partition search on its layers


@pytest.fixture(scope="module")
def llama_profile(tmp_path_factory):
    """A tiny Llama ``save_pretrained`` folder profiled (`profile_model`, what ``dynabatch profile`` runs) on
    rows 1-2 x lengths 8-16 and written as the command writes it: (file, `Profile`, layered model)."""
    from dynabatch.pipeline.measure.profile import fitted_cost_model, profile_model, save_profile
    from dynabatch.pipeline.models.hf import from_hf

    tmp = tmp_path_factory.mktemp("profile")
    build(decoder_config("llama"), dtype=torch.float32).save_pretrained(tmp / "llama")
    model = from_hf(str(tmp / "llama"))
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prof = profile_model(model, rows=(1, 2), lengths=(8, 16), repeats=1)
    finally:
        torch.set_num_threads(n)
    save_profile(tmp / "llama.json", fitted_cost_model(prof, model), prof.layer_costs)
    return tmp / "llama.json", prof, model


def test_cli_profile_of_a_hugging_face_folder_writes_packed_and_layer_costs(llama_profile, capsys, one_thread):
    """``dynabatch profile --model hf:FOLDER``: the padded grid plus packed micro-batches, and the per-layer
    costs of every measured micro-batch in the same file as the cost model."""
    from dynabatch import CostModel
    from dynabatch.cli import main
    from dynabatch.pipeline.measure.profile import load_layer_costs

    folder = llama_profile[0].parent
    out = folder / "cli.json"
    assert main(["profile", "--model", f"hf:{folder / 'llama'}", "--out", str(out), "--rows", "1", "2", "--lengths",
                 "8", "--repeats", "1"]) == 0
    assert "5 shapes (2 padded, 1 packed, 2 padded with a padded row)" in capsys.readouterr().out
    assert CostModel.load(out).table.time_s.shape == (2, 1, 1)
    layers = load_layer_costs(out)
    assert (layers.num_layers, layers.num_microbatches) == (5, 5)
    assert (layers.memory_bytes > 0).all() and (layers.boundary_bytes > 0).all()
    CostModel.load(out).save(folder / "plain.json")
    with pytest.raises(ValueError, match="no per-layer costs"):
        load_layer_costs(folder / "plain.json")


def test_profile_of_a_hugging_face_llama_prices_packed_from_packed_measurements(llama_profile):
    """The packed micro-batches measured have the shapes asked for (r samples in r x L tokens), and the file's
    packed prices come from them: their activation bytes (deterministic) are predicted closer than a fit
    to the padded table alone predicts them; the padded table is the measured grid; the seconds are one
    fit to every measured micro-batch in the packed attention whose fit prices the packed ones better (the
    choice on noise-free measurements: test_cost_packed_attention.py). The grid's longer half is measured
    again with a padded row (its mask's cost, ``q_pad``), not as packed."""
    from dynabatch import CostModel
    from dynabatch.pipeline.measure.profile import load_layer_costs

    path, prof, _ = llama_profile
    cost = CostModel.load(path)
    packed = [k for k in prof.extra if not prof.padding[k]]
    assert [prof.shapes[k].packed for k in packed] == [True, True]
    assert [sum(prof.lengths[k]) for k in packed] == [2 * 8, 2 * 16]
    assert all(len(prof.lengths[k]) == prof.shapes[k].rows for k in packed)
    ragged = [k for k in prof.extra if prof.padding[k]]
    assert [(prof.shapes[k].rows, prof.shapes[k].input_len, prof.shapes[k].packed) for k in ragged] == [
        (1, 16, False), (2, 16, False)]
    assert np.array_equal(cost.table.time_s.ravel(), prof.time_s[:4])
    assert np.array_equal(prof.memory_bytes, load_layer_costs(path).memory_bytes.sum(axis=0))  # one stage: all layers
    table_only = CostModel.profiled(prof.table, cost.model, cost.device)

    def packed_bytes(cm):
        out = []
        for k in packed:
            lens = np.array(prof.lengths[k])
            out.append(float(cm.packed(lens, 0 * lens, 0 * lens, 0 * lens)[1][0]))
        return np.array(out)

    err = np.abs(packed_bytes(cost) / prof.memory_bytes[packed] - 1).max()
    assert err < np.abs(packed_bytes(table_only) / prof.memory_bytes[packed] - 1).max() and err < 0.25, err

    from dynabatch.pipeline.measure.profile import _fit

    other = "varlen" if cost.packed_attention == "dense" else "dense"
    chosen = _fit(cost, prof, cost.packed_attention)
    assert np.allclose(cost.time_coef[:-1], chosen[0][:-1], rtol=1e-12, atol=0)  # q_pad: the table's surplus
    assert chosen[2] <= _fit(cost, prof, other)[2]


def test_dataloader_and_planner_read_the_profile_file(llama_profile):
    """A DataLoader planning with the profiled file predicts each packed micro-batch from the file's
    packed coefficients and each padded one from its measured table."""
    from dynabatch import CostModel, DataLoader, datagen
    from dynabatch.loader.settings import records_from_keywords

    cost = CostModel.load(llama_profile[0])
    records = datagen.text_records(40, seed=3)
    seen = {"packed": 0, "padded": 0}
    for collate in seen:
        loader = DataLoader(records, **records_from_keywords(dict(tokenizer="bytes", collate=collate, global_batch_tokens=100,
                                                             max_len=16, num_stages=1, cost_model=cost, rank=0,
                                                             world_size=1, seed=0, progress=False)))
        for step in list(loader)[:3]:
            for mb in step:
                if collate == "packed":
                    lens = np.diff(mb["cu_seqlens"].numpy())
                    want = cost.packed(lens, 0 * lens, 0 * lens, 0 * lens)[0][0]
                else:
                    rows, L = mb["input_ids"].shape
                    want = cost.table.lookup(rows, np.ceil(L / 8) * 8, 0)[0]
                assert float(mb["predicted_time_s"]) == pytest.approx(float(want), rel=1e-9), collate
                seen[collate] += 1
    assert min(seen.values()) >= 3


def test_partition_search_on_the_profiled_layers(llama_profile):
    """`balanced_partition` on the per-layer costs of the profile file: a valid 2- and 3-stage split of
    the Llama's 5 layers whose per-stage busy seconds are the profiled layers' sums, and no split of the
    same costs simulates faster."""
    from dynabatch.pipeline import balanced_partition  # noqa: E402
    from dynabatch.pipeline.models import partition_makespan  # noqa: E402
    from dynabatch.pipeline.measure.profile import load_layer_costs

    costs = load_layer_costs(llama_profile[0])
    per_layer = (costs.forward_s + costs.backward_s).sum(axis=1)
    for stages in (2, 3):
        split = balanced_partition(costs, stages)
        b = split.bounds
        assert len(b) == stages + 1 and b[0] == 0 and b[-1] == 5 and all(x < y for x, y in zip(b[:-1], b[1:]))
        want = [per_layer[b[s]:b[s + 1]].sum() for s in range(stages)]
        assert np.allclose(split.stage_busy_s, want, rtol=1e-12), (split, want)
        assert split.makespan_s == pytest.approx(partition_makespan(costs, b))
        others = [partition_makespan(costs, (0, *c, 5)) for c in itertools.combinations(range(1, 5), stages - 1)]
        assert split.makespan_s <= min(others) + 1e-15


def test_profile_of_llava_measures_image_tiles(one_thread, tmp_path, capsys):
    """A LLaVA model is profiled on micro-batches with 1 and 2 image tiles too; its cost model (no table:
    a table has no tile axis) prices tiles from them: the activation bytes of every measured micro-batch,
    with and without tiles, within 10% (saved bytes are deterministic; times are not, so they are not
    compared), a micro-batch with tiles above the same text alone. Tiles that fit no length are refused."""
    from dynabatch.cli import main
    from dynabatch.pipeline.measure.profile import fitted_cost_model, profile_model
    from dynabatch.pipeline.models.hf import from_hf

    model = from_hf(build(llava_config(), dtype=torch.float32))
    prof = profile_model(model, rows=(1, 2), lengths=(8, 16), tiles=(1, 2), repeats=1)
    tiles = [prof.shapes[k].tiles for k in prof.extra]
    assert sorted(set(tiles)) == [1, 2] and all(prof.shapes[k].tiles == 0 for k in range(4))
    cost = fitted_cost_model(prof, model)
    assert cost.table is None and cost.kind == "vision_language"
    shapes = prof.shapes
    args = [np.array([getattr(s, f) for s in shapes]) for f in ("rows", "input_len", "target_len", "tiles")]
    m = cost.padded(*args)[1]
    assert np.abs(m / prof.memory_bytes - 1).max() < 0.1, m / prof.memory_bytes
    assert np.all(m[prof.extra] > cost.padded(args[0], args[1], 0, 0)[1][prof.extra])  # the tiles' own bytes
    model.hf_config.save_pretrained(tmp_path / "llava")
    out = tmp_path / "llava.json"
    assert main(["profile", "--model", f"hf:{tmp_path / 'llava' / 'config.json'}", "--out", str(out), "--rows", "1",
                 "--lengths", "4", "--tiles", "1"]) == 2
    assert "no length of (4,) holds 1 image tile(s) of 4 tokens" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# 2 gloo stages, one launch: adaptive recomputation, two Llamas in one MultiModelRunner, LLaVA bypass


def _grads(runner) -> list:
    return [None if p.grad is None else p.grad.detach().clone() for p in runner.parameters()]


def _zero(runner) -> None:
    for p in runner.parameters():
        p.grad = None


def _recompute_case(ctx, fractions=(0.5,)) -> dict:
    """A Llama (byte vocabulary) on 2 stages, DataLoader steps planned with the measured stage memory under
    device limits (``fractions`` of the largest peak the same steps reach without recomputation): per step
    the metered peak and the gradients with the plan's recomputation and with none."""
    from dynabatch import DataLoader, datagen
    from dynabatch.loader.settings import records_from_keywords
    from dynabatch.pipeline import PipelineRunner, RunnerConfig, stage_cost_model
    from dynabatch.pipeline.measure.memory import measured_stage_memory
    from dynabatch.pipeline.models.hf import from_hf

    bounds = [0, 2, 5]
    model = from_hf(build(decoder_config("llama", vocab_size=320), seed=1, dtype=torch.float32))
    cost = stage_cost_model(model, 2, "cpu")
    cost.stage_memory_model = measured_stage_memory(model, bounds, cost)
    records = datagen.text_records(32, seed=3)
    common = dict(tokenizer="bytes", collate="padded", global_batch_tokens=2000, max_len=128, num_stages=2,
                  cost_model=cost, rank=0, world_size=1, seed=0, progress=False)
    base = list(DataLoader(records, **records_from_keywords(dict(**common, device_memory_limit=1e15))))[:2]
    top = max(max(s.plan.options["stage_peak_bytes"]) for s in base)
    runner = PipelineRunner.from_model(model, ctx, bounds, RunnerConfig(schedule="1f1b"))
    out = []
    for frac in fractions:
        limit = frac * top
        loader = DataLoader(records, **records_from_keywords(dict(**common, recompute="adaptive", device_memory_limit=limit)))
        for step in list(loader)[:2]:
            _zero(runner)
            ada = runner.step(step.plan, list(step))
            g_ada = _grads(runner)
            _zero(runner)
            none = runner.step(step.plan, list(step), recompute=[0, 0])
            g_none = _grads(runner)
            out.append({"limit": limit, "k": step.plan.options["recompute_layers"], "ran_k": ada.timing.recompute_layers,
                        "peak": ada.timing.peak_saved_bytes, "planned": ada.planned_peak_bytes,
                        "none_peak": none.timing.peak_saved_bytes, "loss": ada.loss, "none_loss": none.loss,
                        "same_grads": all(torch.equal(a, b) for a, b in zip(g_ada, g_none)),
                        "grad_gap": max(float((a - b).abs().max()) for a, b in zip(g_ada, g_none))})
    return {"steps": out}


LLAMAS = ({"bounds": [0, 2, 5]},  # 3 decoder layers, hidden 16 (hf_tiny.TEXT)
          {"bounds": [0, 3, 6], "hidden_size": 24, "intermediate_size": 48, "num_hidden_layers": 4,
           "num_attention_heads": 6, "num_key_value_heads": 3, "tie_word_embeddings": True})


def _llama(k: int):
    from dynabatch.pipeline.models.hf import from_hf

    over = {key: v for key, v in LLAMAS[k].items() if key != "bounds"}
    return from_hf(build(decoder_config("llama", **over), seed=10 + k, dtype=torch.float32))


def _multimodel_case(ctx, steps: int = 3) -> dict:
    """Two Llamas of different sizes (the second with tied embeddings, so its tie spans both stages), AdamW
    each: trained alone with `PipelineRunner`, then together by `MultiModelRunner` on the same micro-batches
    (no budget, and a budget that makes them spill); whether each model's stage parameters and losses are
    bit-identical to its run alone."""
    from dynabatch.pipeline import PipelineRunner, RunnerConfig  # noqa: E402
    from dynabatch.pipeline.runtime.multimodel import MultiModelRunner, shard_bytes

    data = _steps(_llama(0), steps, seed=7)
    lrs = (1e-2, 3e-3)

    def runners():
        rs = [PipelineRunner.from_model(_llama(k), ctx, LLAMAS[k]["bounds"], RunnerConfig(schedule="1f1b"))
              for k in range(2)]
        return rs, [torch.optim.AdamW(r.parameters(), lr=lrs[k], eps=1e-4) for k, r in enumerate(rs)]

    alone_w, alone_l, trained = [], [], []
    rs, opts = runners()
    for r, o in zip(rs, opts):
        start = [p.detach().clone() for p in r.parameters()]
        alone_l.append([r.step(s, b, optimizer=o).loss for s, b, _ in data])
        alone_w.append([p.detach().clone() for p in r.parameters()])
        trained.append(not any(torch.equal(a, b) for a, b in zip(start, alone_w[-1])))
    out = []
    for factor in (None, 1.0):
        rs, opts = runners()
        budget = None if factor is None else int(factor * max(sum(shard_bytes(r.stage, o, ctx.device))
                                                                for r, o in zip(rs, opts)))
        multi = MultiModelRunner(rs, opts, memory_budget_bytes=budget, interleave=factor is None)
        losses, moves = [[], []], 0
        for s, b, n in data:
            res = multi.step(s, b, num_tokens=n)
            moves += res.spills + res.loads
            for k in range(2):
                losses[k].append(res.results[k].loss)
        for k in range(2):
            multi.store.make_room(multi.store.full_bytes(k), {k}, {})
            multi.store.load(k)
            got = [p.detach() for p in multi.runners[k].parameters()]
            out.append({"factor": factor, "k": k, "moves": moves, "loss_same": losses[k] == alone_l[k],
                        "same": len(got) == len(alone_w[k]) and all(torch.equal(a, b) for a, b in zip(got, alone_w[k]))})
    return {"models": out, "trained": trained, "tied": [sorted(t.name for t in r.ties.ties) for r in rs]}


def _llava_case(ctx) -> dict:
    """LLaVA on 2 stages cut after the projector, RunnerConfig(bypass_idle_stages=True), every rank holding
    the step's dictionaries: a step of text-only micro-batches, then a mixed one. Per step: each stage
    layer's forward calls, the point-to-point messages this rank posted, the loss and this stage's largest
    gradient gap to the Hugging Face model's own forward/backward in one process (float64)."""
    from dynabatch.pipeline.runtime import CommRecorder  # noqa: E402
    from dynabatch.pipeline import PipelineRunner, RunnerConfig  # noqa: E402
    from dynabatch.pipeline.models.hf import from_hf, hf_reference_step

    bounds = [0, 4, 8]
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        hf = build(llava_config(), seed=1)
        ref = copy.deepcopy(hf)
        model = from_hf(hf)
        rec = CommRecorder()
        runner = PipelineRunner.from_model(model, ctx, bounds, RunnerConfig(schedule="1f1b", bypass_idle_stages=True),
                                           recorder=rec)
        calls = [0] * len(runner.stage.layers)

        def counter(i):
            def hook(module, args, output):
                calls[i] += 1
            return hook

        for i, layer in enumerate(runner.stage.layers):
            layer.register_forward_hook(counter(i))
        gen = torch.Generator().manual_seed(5)
        out = []
        for dims in ([(2, 9, 0), (4, 7, 0)], [(3, 20, 4), (2, 9, 0), (1, 12, 2), (4, 7, 0)]):
            shapes = [MicroBatchShape("padded", r, L, tiles=t, time_s=1e-3 * r * L, memory_bytes=1e3 * r * L)
                      for r, L, t in dims]
            batches = [model.random_batch(s, gen) for s in shapes]
            calls[:] = [0] * len(calls)
            rec.clear()
            _zero(runner)
            res = runner.step(shapes, batches)
            ref_loss, _ = hf_reference_step(ref, batches)
            diff, scale = _grad_gap(model, ref, range(bounds[ctx.stage], bounds[ctx.stage + 1]))
            out.append({"tiles": [t for *_, t in dims], "calls": list(calls), "messages": len(rec.events),
                        "labels": sorted({e.label.split()[0] for e in rec.events}), "entry": runner.entries(shapes).tolist(),
                        "loss": res.loss, "ref_loss": ref_loss, "diff": diff, "scale": scale})
    finally:
        torch.set_default_dtype(old)
    return {"steps": out, "stage": ctx.stage}


def _grad_gap(model, ref, layers) -> tuple[float, float]:
    """`hf_tiny.grad_gap` where a missing gradient counts as zeros (a stage that ran no micro-batch may hold
    zero gradients, the reference none)."""
    named = dict(ref.named_parameters())
    diff = scale = 0.0
    for i in layers:
        for path, key in model.param_keys(i).items():
            p, q = model.layers[i].get_parameter(path), named[key]
            a = torch.zeros_like(p) if p.grad is None else p.grad
            b = torch.zeros_like(q) if q.grad is None else q.grad
            diff, scale = max(diff, float((a - b).abs().max())), max(scale, float(b.abs().max()))
    return diff, scale


CASES = {"recompute": _recompute_case, "multimodel": _multimodel_case, "llava": _llava_case}


def technique_worker(rank, world, port, cases):
    """Rank side: each case of ``cases`` (names of `CASES`) on 2 gloo stages, in one process group."""
    from dynabatch.pipeline import init_pipeline

    torch.set_num_threads(1)
    with init_pipeline(2, rank=rank, world_size=world, master_port=port, timeout_s=300, abort_after_s=60) as ctx:
        return [CASES[name](ctx) for name in cases]


def _launch(cases):
    res = launch_local(f"{__file__}:technique_worker", 2, args=(list(cases),), idle_timeout_s=600)
    for r in res:
        assert not r.timed_out, f"rank {r.rank} hung:\n{r.stderr[-3000:]}"
        assert r.returncode == 0, f"rank {r.rank} failed:\n{r.stderr[-3000:]}"
    return [[r.result[i] for r in res] for i in range(len(cases))]  # per case: every rank's result


def case(name: str):
    """The `prelaunch.Part` of case ``name`` in the module's one 2-rank launch."""
    return part("technique_worker", name, _launch, weight=60.0)


@LAUNCHES.plan(lambda: [case("recompute")])
def test_adaptive_recomputation_keeps_a_llama_under_the_memory_limit():
    """DataLoader steps of a Llama planned with `recompute="adaptive"` under a device limit half the peak
    the same steps reach without recomputation, 2 gloo stages: the bytes each stage's in-flight
    micro-batches keep (metered by saved-tensor hooks, as for the tiny models) stay within the limit and
    the plan's prediction; without recomputation they would not; loss and gradients are unchanged."""
    per_rank = LAUNCHES.result(case("recompute"))
    over = 0
    for rank, out in enumerate(per_rank):
        for s in out["steps"]:
            assert s["peak"] <= s["limit"], (rank, s)
            assert s["peak"] <= s["planned"] * (1 + 1e-9), (rank, s)
            assert s["ran_k"] == s["k"][rank], (rank, s)
            assert s["loss"] == s["none_loss"] and s["same_grads"], (rank, s)
            over += s["none_peak"] > s["limit"]
    assert over >= 1, "the limit must be tight enough that ignoring it breaks it"
    assert any(sum(s["k"]) > 0 for s in per_rank[0]["steps"])


@LAUNCHES.plan(lambda: [case("multimodel")])
def test_two_llamas_in_one_multimodel_runner_equal_each_alone():
    """Two Llama configurations (hidden 16 / 3 layers, hidden 24 / 4 layers with tied embeddings across
    the stages), 3 AdamW steps on the same micro-batches: together in one `MultiModelRunner`, interleaved
    without a budget and one shard at a time under a budget of one shard (spilling), each model's
    parameters and losses are bit-identical to the model trained alone."""
    per_rank = LAUNCHES.result(case("multimodel"))
    for rank, out in enumerate(per_rank):
        assert out["trained"] == [True, True], rank
        assert out["tied"] == [[], ["model.embed_tokens.weight"]], rank  # the second model's tie spans the stages
        for m in out["models"]:
            assert m["same"] and m["loss_same"], (rank, m)
            assert (m["moves"] > 0) == (m["factor"] is not None), (rank, m)


@LAUNCHES.plan(lambda: [case("llava")])
def test_llava_text_only_micro_batches_never_visit_the_vision_stage():
    """LLaVA cut after the projector with the bypass: a step of text-only micro-batches calls no layer of
    the vision stage and posts no message there; in a mixed step the vision stage's layers run exactly
    once per micro-batch with image tiles; loss and every gradient equal one process's."""
    per_rank = LAUNCHES.result(case("llava"))
    for out in per_rank:
        for s in out["steps"]:
            assert s["loss"] == pytest.approx(s["ref_loss"], rel=1e-12), s
            assert s["diff"] <= 1e-8 * max(s["scale"], 1e-300), s
            images = sum(t > 0 for t in s["tiles"])
            assert s["entry"] == [0 if t else 1 for t in s["tiles"]], s
            want = images if out["stage"] == 0 else len(s["tiles"])
            assert s["calls"] == [want] * len(s["calls"]), (out["stage"], s)
    vision_text_only, vision_mixed = per_rank[0]["steps"]
    assert vision_text_only["messages"] == 0, vision_text_only
    assert vision_mixed["messages"] > 0 and vision_mixed["scale"] > 0
    assert per_rank[1]["steps"][0]["scale"] > 0  # the language stage trained on the text-only step
