"""Executed == simulated, for every registered schedule, on 2 and 3 gloo stages.

Each case runs one step of variable-shape micro-batches through a real pipeline: gpt-tiny from a plan
(padded and packed; the runner follows the schedule the plan records) and a Hugging Face Llama from bare
shapes (padded and packed; the runner's configured schedule), in float64. Per rank the test checks that
the ops the interpreter executed, in order, are the ops of the `StepOps` the simulator prices for that
rank (`plan_orders` / `stage_orders`: the one derivation), and that the loss and every gradient equal one
process's (`sequential_step` for gpt-tiny; the plain Hugging Face model's logits and the loss written in
the test for Llama). Interleaved cuts give each stage two chunks; zero-bubble runs split backwards
(input part, then weight part), also with recomputed layers and with Llama's tied embeddings summed over
their stages. Every case of one stage count runs in one launch.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_tiny import build, decoder_config, grad_gap  # noqa: E402
from prelaunch import Prelaunch, part  # noqa: E402

from dynabatch.core.schedule import REGISTRY  # noqa: E402
from dynabatch.pipeline.models import MicroBatchShape  # noqa: E402
from dynabatch.pipeline import launch_local  # noqa: E402

SCHEDULES = [n for n, info in REGISTRY.items() if info.concrete]
GPT = dict(vocab=64, hidden=16, layers=6, heads=2, max_positions=128)  # 8 layers: embedding, 6 blocks, head
LAUNCHES = Prelaunch(parallel=2)


@pytest.fixture(scope="module", autouse=True)
def _launches(request):
    yield from LAUNCHES.started(request)


def _bounds(model: str, schedule: str, stages: int) -> list[int]:
    """A cut of the model for ``schedule`` on ``stages`` stages (its chunks x stages pieces)."""
    n = 8 if model == "gpt-tiny" else 6
    pieces = stages * REGISTRY[schedule].chunks
    sizes = [n // pieces + (1 if p < n % pieces else 0) for p in range(pieces)]
    return [0] + np.cumsum(sizes).tolist()


def _my_layers(stage) -> list[int]:
    """Model layer indices this rank holds (every chunk's)."""
    parts = getattr(stage, "chunks", [stage])
    return [p.first_layer + i for p in parts for i in range(len(p.layers))]


def _hf_reference(hf, batches) -> tuple[float, int]:
    """The plain model's logits, summed token cross-entropy (each packed sample alone) over the step's target
    tokens; gradients left in ``hf``."""
    from conformance_ref import summed_ce

    hf.zero_grad(set_to_none=True)
    parts = []
    for b in batches:
        if "cu_seqlens" in b:
            cu = b["cu_seqlens"].tolist()
            parts += [summed_ce(hf(input_ids=b["input_ids"][:, i:j], use_cache=False).logits, b["labels"][:, i:j],
                                shift=True) for i, j in zip(cu[:-1], cu[1:])]
        else:
            parts.append(summed_ce(hf(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                                      use_cache=False).logits, b["labels"], shift=True))
    n = sum(k for _, k in parts)
    (sum(s for s, _ in parts) / n).backward()
    return float(sum(float(s.detach()) for s, _ in parts) / n), n


def _hf_shapes(collation: str) -> list[MicroBatchShape]:
    if collation == "packed":
        dims = [(3, 9, 17), (2, 8, 11), (1, 6, 6), (4, 5, 14), (2, 7, 9)]
        return [MicroBatchShape("packed", r, L, 0, tok, time_s=1e-4 * tok, memory_bytes=1e2 * tok)
                for r, L, tok in dims]
    dims = [(3, 10), (2, 13), (1, 7), (4, 6), (2, 9)]
    return [MicroBatchShape("padded", r, L, time_s=1e-3 * r * L, memory_bytes=1e3 * r * L) for r, L in dims]


def schedules_worker(rank, world, port, cases):
    """Rank side: every ``[model, schedule, collation, recompute, tied]`` case; per case the ops this rank
    executed and the ones its order lists, the loss and the reference's, and the largest gradient gap."""
    from test_pipeline_workers import replica_batches, synthetic_plan

    from dynabatch.core.schedule.orders import plan_orders
    from dynabatch.pipeline import PipelineRunner, RunnerConfig, init_pipeline, make_model, sequential_step
    from dynabatch.pipeline.models.hf import from_hf
    from dynabatch.pipeline.runtime.schedule import stage_orders

    torch.set_default_dtype(torch.float64)
    ctx = init_pipeline(world, rank=rank, world_size=world, master_port=port, timeout_s=300, abort_after_s=30)
    out = []
    llamas = {}  # (tied, collation) -> the Llama case's model, reference, shapes, batches and reference loss
    with ctx:
        for model_name, schedule, collation, recompute, tied in cases:
            bounds = _bounds(model_name, schedule, world)
            config = RunnerConfig(schedule="auto" if model_name == "gpt-tiny" else schedule, recompute=recompute)
            if model_name == "gpt-tiny":
                rng = np.random.default_rng(len(out))
                plan = dataclasses.replace(synthetic_plan(rng, collation=collation, num_ranks=1, num_stages=world,
                                                          mbs=(5, 5), step=0), schedule=schedule)
                model, ref = make_model("gpt-tiny", **GPT, seed=1), make_model("gpt-tiny", **GPT, seed=1)
                batches = replica_batches(model, plan, 0, seed=len(out))
                planned = plan_orders(plan, 0)
            else:
                # one model and one reference per (tied, collation), shared by its schedules: a step without an
                # optimizer keeps the weights and starts from no gradients on this rank's layers (the ones
                # compared), and the reference does not depend on the schedule or the cut
                if (tied, collation) not in llamas:
                    hf = build(decoder_config("llama", num_hidden_layers=4, tie_word_embeddings=tied), seed=1)
                    ref, model = copy.deepcopy(hf), from_hf(hf)
                    plan = _hf_shapes(collation)
                    gen = torch.Generator().manual_seed(5)
                    batches = [model.random_batch(s, gen) for s in plan]
                    llamas[(tied, collation)] = (model, ref, plan, batches, _hf_reference(ref, batches)[0])
                model, ref, plan, batches, hf_ref_loss = llamas[(tied, collation)]
                planned = stage_orders(schedule, world, len(plan), time_s=[s.time_s for s in plan],
                                       memory_bytes=[s.memory_bytes for s in plan])
            runner = PipelineRunner.from_model(model, ctx, bounds, config)
            runs = []
            run = runner.run
            runner.run = lambda *a, **k: runs.append(run(*a, **k)) or runs[-1]  # keep what the interpreter ran
            res = runner.step(plan, batches if ctx.stage in (0, world - 1) else None)
            mine = _my_layers(runner.stage)
            if model_name == "gpt-tiny":
                ref_loss, _ = sequential_step(ref.layers, batches)
                diff = scale = 0.0
                for i in mine:
                    for p, q in zip(model.layers[i].parameters(), ref.layers[i].parameters()):
                        diff = max(diff, float((p.grad - q.grad).abs().max()))
                        scale = max(scale, float(q.grad.abs().max()))
            else:
                ref_loss = hf_ref_loss
                diff, scale = grad_gap(model, ref, mine)
            out.append({"case": [model_name, schedule, collation, recompute, tied], "loss": res.loss,
                        "ref_loss": ref_loss, "diff": diff, "scale": scale, "layers": mine,
                        "executed": [op.name for op in runs[-1].executed],
                        "planned": [op.name for op in planned.rank(ctx.stage)],
                        "chunks": planned.num_chunks, "split": planned.split,
                        "ties": sorted(t.name for t in runner.ties.ties)})
    return out


def _launch(cases):
    """One launch of ``cases`` (all of one stage count); per case, every rank's result."""
    stages = cases[0][0]
    res = launch_local(f"{__file__}:schedules_worker", stages, args=([c[1:] for c in cases],), idle_timeout_s=600)
    for r in res:
        assert not r.timed_out, f"rank {r.rank} hung:\n{r.stderr[-3000:]}"
        assert r.returncode == 0, f"rank {r.rank} failed:\n{r.stderr[-3000:]}"
    return [[r.result[k] for r in res] for k in range(len(cases))]


def _cases(stages: int) -> list:
    cases = [(stages, "gpt-tiny", s, c, "none", False) for s in SCHEDULES for c in ("padded", "packed")]
    cases += [(stages, "gpt-tiny", s, "padded", "full", False) for s in ("zb-h1", "interleaved")]
    cases += [(stages, "llama", s, c, "none", False) for s in ("1f1b", "interleaved", "zb-h1", "zb-h2")
              for c in ("padded", "packed")]
    cases += [(stages, "llama", "zb-h1", "padded", "none", True)]
    return [part(("schedules", stages), c, _launch, weight=2.0) for c in cases]


def _check(results) -> None:
    for per_rank in results:
        everything = sorted(i for r in per_rank for i in r["layers"])
        for r in per_rank:
            model, schedule, _, _, tied = r["case"]
            # the ops this rank ran, in order, are the ops of the order the simulator prices
            assert r["executed"] == r["planned"] and r["executed"], r["case"]
            assert r["chunks"] == REGISTRY[schedule].chunks and r["split"] == REGISTRY[schedule].split
            assert any(n.startswith("W") for n in r["executed"]) == REGISTRY[schedule].split
            assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-12), r["case"]
            # float64 gpt-tiny: the pipeline scales after the backward, the reference before (rounding only);
            # Llama's RMSNorms compute in float32 inside a float64 model (measured <= 1e-7 of the largest)
            tol = 1e-10 if model == "gpt-tiny" else 1e-6
            assert r["scale"] > 0 and r["diff"] <= tol * r["scale"], r["case"]
            if tied:  # the embedding and the head hold the tie: their stages sum its gradient
                assert (r["ties"] == ["model.embed_tokens.weight"]) == bool({0, everything[-1]} & set(r["layers"]))
        assert everything == list(range(len(everything)))  # the ranks together hold every layer once


TWO, THREE = _cases(2), _cases(3)


@LAUNCHES.plan(lambda: TWO)
def test_every_schedule_executes_its_simulated_order_on_two_stages():
    """gpipe, 1f1b, adaptive, interleaved (2 chunks per stage), zb-h1 and zb-h2 (split backwards) on 2 gloo stages,
    gpt-tiny from a plan and Llama from shapes, padded and packed, recomputed and tied: executed == priced
    order on every rank, loss and gradients == one process (float64)."""
    _check([LAUNCHES.result(c) for c in TWO])


@LAUNCHES.plan(lambda: THREE)
def test_every_schedule_executes_its_simulated_order_on_three_stages():
    """The same on 3 gloo stages (interleaved: 6 chunks, the ring wrapping from stage 2 back to stage 0)."""
    _check([LAUNCHES.result(c) for c in THREE])
