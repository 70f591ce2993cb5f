"""Rank-side workers for the multi-process pipeline tests (run through `dynabatch.pipeline.runtime.launch`).

Each worker is ``fn(rank, world_size, port, *args)`` and returns a JSON-serializable summary that
the test process checks. No tests are defined here.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import torch

from dynabatch.core.batchplan import BatchPlan
from dynabatch.pipeline.runtime import CommRecorder
from dynabatch.pipeline.models import MicroBatchShape, plan_shapes
from dynabatch.pipeline import PipelineRunner, RunnerConfig, init_pipeline, make_model, sequential_step

TINY = {"gpt-tiny": dict(vocab=64, hidden=16, layers=3, heads=2, max_positions=128),
        "t5-tiny": dict(vocab=64, hidden=16, encoder_layers=2, decoder_layers=2, heads=2, max_positions=128)}


def synthetic_plan(rng: np.random.Generator, *, collation: str, num_ranks: int, num_stages: int, mbs=(1, 2),
                   max_rows: int = 3, max_len: int = 24, max_target: int = 0, step: int = 0,
                   equal: bool = False) -> BatchPlan:
    """A plan of random micro-batch shapes (what a planner would hand every rank)."""
    counts = [int(rng.integers(mbs[0], mbs[1] + 1))] * num_ranks if equal else \
        [int(rng.integers(mbs[0], mbs[1] + 1)) for _ in range(num_ranks)]
    rank, order, rows, L, T, tok, tgt, t, mem = [], [], [], [], [], [], [], [], []
    for r, c in enumerate(counts):
        for k in range(c):
            n = int(rng.integers(1, max_rows + 1))
            ln = int(rng.integers(2, max_len + 1))
            tl = int(rng.integers(1, max_target + 1)) if max_target else 0
            if collation == "packed":  # the planner's packed tokens count both rows of an encoder-decoder
                dec = int(rng.integers(max(n, tl), n * tl + 1)) if tl else 0
                total = int(rng.integers(max(n, ln), n * ln + 1)) + dec
            else:
                dec, total = n * tl, n * (ln + tl)
            rank.append(r), order.append(k), rows.append(n), L.append(ln), T.append(tl), tok.append(total)
            tgt.append(dec), t.append(float(total) * 1e-5), mem.append(float(total) * 100.0)
    sizes = np.array(rows)
    m = len(rows)
    return BatchPlan(
        method="synthetic", collation=collation, num_ranks=num_ranks, num_stages=num_stages, schedule="1f1b",
        sample_ids=np.arange(sizes.sum(), dtype=np.int64),
        sample_row=np.concatenate([np.arange(n) for n in rows]).astype(np.int32),
        mb_offsets=np.concatenate(([0], np.cumsum(sizes))).astype(np.int64), mb_rank=np.array(rank, np.int32),
        mb_order=np.array(order, np.int32), mb_rows=sizes.astype(np.int64), mb_input_len=np.array(L, np.int64),
        mb_target_len=np.array(T, np.int64), mb_vision_tiles=np.zeros(m, np.int64), mb_tokens=np.array(tok, np.int64),
        mb_real_tokens=np.array(tok, np.int64), mb_target_tokens=np.array(tgt, np.int64),
        mb_time_s=np.array(t), mb_memory_bytes=np.array(mem),
        rank_time_s=np.zeros(num_ranks), step=step)


def replica_batches(model, plan: BatchPlan, replica: int, seed: int) -> list[dict]:
    """Deterministic micro-batch dictionaries of one replica (the same on every rank)."""
    out = []
    for j, sh in enumerate(plan_shapes(plan, replica)):
        gen = torch.Generator().manual_seed(seed * 1000 + replica * 100 + j)
        out.append(model.random_batch(sh, gen))
    return out


def _ctx(rank, world, port, num_stages):
    """The process group of the correctness, soak, feedback and partition workers."""
    return init_pipeline(num_stages, rank=rank, world_size=world, master_port=port, timeout_s=30, abort_after_s=10)


def several(rank, world, port, num_stages, calls):
    """``calls`` (``[worker name, args]`` of the workers below that take a context) one after the other
    in one process group of ``num_stages`` stages; their results in order. Each call is a sign of
    life to the launcher when it ends (a call itself prints nothing, as when it runs alone)."""
    from dynabatch.pipeline.runtime.launch import heartbeat

    out = []
    with _ctx(rank, world, port, num_stages) as ctx:
        for name, args in calls:
            out.append(BODIES[name](ctx, *args))
            heartbeat(0.0)
    return out


def correctness(rank, world, port, num_stages, cases, schedules, steps, use_planner):
    """Pipeline loss and gradients vs a single-process run of the same model and batches.

    ``cases`` are ``[model_name, bounds, collation, debug_shapes]``; every case runs every schedule
    for ``steps`` steps of random (or, with ``use_planner``, dynabatch-planned) micro-batches."""
    with _ctx(rank, world, port, num_stages) as ctx:
        return _correctness(ctx, cases, schedules, steps, use_planner)


def _correctness(ctx, cases, schedules, steps, use_planner):
    num_stages = ctx.num_stages
    out = {"cases": [], "comm": {}}
    rng = np.random.default_rng(7)
    for model_name, bounds, collation, debug in cases:
        for schedule in schedules:
            model = make_model(model_name, **TINY[model_name], seed=1)
            ref = make_model(model_name, **TINY[model_name], seed=1)
            rec = CommRecorder()
            runner = PipelineRunner.from_model(model, ctx, bounds,
                                               RunnerConfig(schedule=schedule, debug_shapes=debug), recorder=rec)
            for step in range(steps):
                if use_planner:
                    plan = _planned(model, ctx, rng, step)
                else:
                    plan = synthetic_plan(rng, collation=collation, num_ranks=ctx.num_replicas,
                                          num_stages=num_stages, mbs=(1, 4),
                                          max_target=10 if model_name == "t5-tiny" else 0, step=step)
                every = [replica_batches(model, plan, d, seed=step) for d in range(ctx.num_replicas)]
                mine = every[ctx.replica] if ctx.stage in (0, num_stages - 1) else None
                res = runner.step(plan, mine)
                ref_loss, ref_n = sequential_step(ref.layers, [b for bs in every for b in bs])
                lo = runner.stage.first_layer
                diff, scale = 0.0, 0.0
                for i, layer in enumerate(runner.stage.layers):
                    for p, q in zip(layer.parameters(), ref.layers[lo + i].parameters()):
                        diff = max(diff, float((p.grad - q.grad).abs().max()))
                        scale = max(scale, float(q.grad.abs().max()))
                out["cases"].append({"model": model_name, "collation": collation, "schedule": schedule,
                                     "step": step, "loss": res.loss, "ref_loss": ref_loss,
                                     "tokens": res.num_tokens, "ref_tokens": ref_n, "max_grad_diff": diff,
                                     "grad_scale": scale, "orders": runner.orders(plan).codes().tolist(),
                                     "microbatches": len(plan_shapes(plan, ctx.replica))})
            out["comm"][f"{model_name}/{collation}/{schedule}"] = {str(k): v for k, v in rec.per_peer().items()}
    return out


def _planned(model, ctx, rng, step):
    """A real dynabatch plan for the tiny model's cost model."""
    from dynabatch import CostModel, Shapes, plan_microbatches
    from dynabatch.core.cost.model import device_preset

    cost = CostModel(model.config, device_preset("cpu"))
    n = int(rng.integers(4, 9))
    shapes = Shapes.from_lengths(input_tokens=rng.integers(2, 40, n), target_tokens=rng.integers(1, 12, n))
    one = cost.padded(1, 48, 16)[1][0]
    return plan_microbatches(shapes, cost, num_stages=ctx.num_stages, num_ranks=ctx.num_replicas, method="dp",
                             memory_limit=float(one) * 4, step=step, max_len=48, max_target_len=16)


def soak(rank, world, port, num_stages, steps, schedules, record):
    """Many variable-shape steps with a tiny model and no optimizer: must finish, no hang."""
    with _ctx(rank, world, port, num_stages) as ctx:
        return _soak(ctx, steps, schedules, record)


def _soak(ctx, steps, schedules, record):
    num_stages = ctx.num_stages
    out = {"steps": 0, "comm": {}}
    t0 = time.perf_counter()
    model = make_model("gpt-tiny", vocab=32, hidden=16, layers=num_stages - 1, heads=2, ffn=16, max_positions=64, seed=0)
    bounds = [0] + list(range(2, num_stages + 1)) + [num_stages + 1]
    rng = np.random.default_rng(123)
    rec = CommRecorder() if record else None
    runners = {s: PipelineRunner.from_model(model, ctx, bounds, RunnerConfig(schedule=s), recorder=rec)
               for s in schedules}
    losses = []
    for step in range(steps):
        schedule = schedules[step % len(schedules)]
        plan = synthetic_plan(rng, collation="padded", num_ranks=ctx.num_replicas, num_stages=num_stages,
                              mbs=(1, 2), max_rows=2, max_len=8, step=step)
        mine = replica_batches(model, plan, ctx.replica, seed=step) if ctx.stage in (0, num_stages - 1) else None
        res = runners[schedule].step(plan, mine)
        losses.append(res.loss)
        out["steps"] += 1
    out["wall_s"] = time.perf_counter() - t0
    out["finite"] = bool(np.all(np.isfinite(losses)))
    if rec is not None:
        out["comm"] = {str(k): v for k, v in rec.per_peer().items()}
    return out


def failing(rank, world, port, num_stages, fail_rank, fail_step, linger_s=0.0):
    """``fail_rank`` raises inside its stage's forward at step ``fail_step``; with ``linger_s`` its
    process then stays alive that long (a caught exception) before exiting non-zero."""
    ctx = init_pipeline(num_stages, rank=rank, world_size=world, master_port=port, timeout_s=20, abort_after_s=3)
    with ctx:
        model = make_model("gpt-tiny", **TINY["gpt-tiny"], seed=0)
        runner = PipelineRunner.from_model(model, ctx, [0, 2, len(model.layers)], RunnerConfig(schedule="1f1b"))
        state = {"step": 0}

        def boom(module, args):
            if rank == fail_rank and state["step"] == fail_step:
                raise ValueError(f"boom from rank {rank} at step {fail_step}")

        runner.stage.layers[-1].register_forward_pre_hook(boom)
        rng = np.random.default_rng(0)
        try:
            for step in range(fail_step + 5):
                state["step"] = step
                plan = synthetic_plan(rng, collation="padded", num_ranks=ctx.num_replicas, num_stages=num_stages,
                                      mbs=(2, 3), step=step)
                mine = replica_batches(model, plan, ctx.replica, seed=step) if ctx.stage in (0, num_stages - 1) else None
                runner.step(plan, mine)
        except ValueError:
            if rank == fail_rank:
                time.sleep(linger_s)
            raise
    return {"finished": True}


def wrong_plan(rank, world, port, wrong_rank):
    """``wrong_rank`` holds a plan whose first micro-batch is 8 tokens longer: debug headers catch it."""
    ctx = init_pipeline(2, rank=rank, world_size=world, master_port=port, timeout_s=20, abort_after_s=4)
    with ctx:
        model = make_model("gpt-tiny", **TINY["gpt-tiny"], seed=0)
        runner = PipelineRunner.from_model(model, ctx, [0, 2, len(model.layers)], RunnerConfig(debug_shapes=True))
        plan = synthetic_plan(np.random.default_rng(0), collation="padded", num_ranks=1, num_stages=2, mbs=(2, 2))
        shapes = plan_shapes(plan, 0)
        if rank == wrong_rank:
            s0 = shapes[0]
            shapes[0] = MicroBatchShape(s0.collation, s0.rows, s0.input_len + 8, s0.target_len, s0.tokens, s0.time_s,
                                        s0.memory_bytes)
        mine = [model.random_batch(sh, torch.Generator().manual_seed(j)) for j, sh in enumerate(shapes)] \
            if rank in (0, 1) else None
        runner.step(shapes, mine)
    return {"finished": True}


def fault(rank, world, port, num_stages, scenario, culprit, fault_step, timeout_s, abort_after_s=3.0):
    """Rank ``culprit`` misbehaves in step ``fault_step`` at micro-batch 1: ``stall_layer`` sleeps forever
    inside its stage's last layer, ``stall_send`` sleeps forever before posting its send of act F1,
    ``kill`` SIGKILLs itself inside a layer, ``raise`` raises a ValueError inside a layer (``raise_linger``:
    and its process stays alive 15 s more, as if it had caught the error), ``shape``
    holds a plan whose micro-batch 1 is 8 tokens longer (debug headers off). The culprit prints
    ``DYNABATCH_FAULT_AT <time.time()>`` to stderr when the fault starts."""
    ctx = init_pipeline(num_stages, rank=rank, world_size=world, master_port=port, timeout_s=timeout_s,
                        abort_after_s=abort_after_s)
    with ctx:
        model = make_model("gpt-tiny", **TINY["gpt-tiny"], seed=0)  # 5 layers: embedding, 3 blocks, head
        bounds = [0, 2, 5] if num_stages == 2 else [0, 2, 3, 4, 5]
        runner = PipelineRunner.from_model(model, ctx, bounds, RunnerConfig(schedule="1f1b"))
        state = {"step": -1, "forwards": 0}
        faulty = rank == culprit

        def mark():
            sys.stderr.write(f"DYNABATCH_FAULT_AT {time.time():.3f}\n")
            sys.stderr.flush()

        def in_layer(module, args):
            if not faulty or state["step"] != fault_step:
                return
            state["forwards"] += 1
            if state["forwards"] != 2:  # the forward of micro-batch 1
                return
            mark()
            if scenario == "stall_layer":
                time.sleep(10 ** 6)
            elif scenario == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif scenario in ("raise", "raise_linger"):
                raise ValueError(f"boom from rank {rank} at step {fault_step}")

        runner.stage.layers[-1].register_forward_pre_hook(in_layer)
        send = runner.p2p.send

        def stalling_send(msg, tensors, specs):
            if faulty and scenario == "stall_send" and state["step"] == fault_step and msg.kind == "act" \
                    and msg.microbatch == 1:
                mark()
                time.sleep(10 ** 6)
            return send(msg, tensors, specs)

        runner.p2p.send = stalling_send
        rng = np.random.default_rng(0)
        for step in range(fault_step + 3):
            state["step"], state["forwards"] = step, 0
            plan = synthetic_plan(rng, collation="padded", num_ranks=1, num_stages=num_stages, mbs=(2, 3), step=step)
            shapes = plan_shapes(plan, 0)
            if faulty and scenario == "shape" and step == fault_step:
                s1 = shapes[1]
                shapes[1] = MicroBatchShape(s1.collation, s1.rows, s1.input_len + 8, s1.target_len, s1.tokens,
                                            s1.time_s, s1.memory_bytes)
                mark()
            mine = [model.random_batch(sh, torch.Generator().manual_seed(step * 10 + j)) for j, sh in enumerate(shapes)] \
                if ctx.stage in (0, num_stages - 1) else None
            try:
                runner.step(shapes, mine)
            except ValueError:
                if faulty and scenario == "raise_linger":
                    time.sleep(15.0)
                raise
    return {"finished": True}


def feedback_run(rank, world, port, steps):
    """Plan with FeedbackLoop's cost model, run, feed the gathered timings back, refit, plan again."""
    with _ctx(rank, world, port, 2) as ctx:
        return _feedback_run(ctx, steps)


def _feedback_run(ctx, steps):
    from dataclasses import asdict, replace

    from dynabatch import CostModel, Shapes
    from dynabatch.core.cost.model import device_preset
    from dynabatch.core.plan.feedback import FeedbackLoop

    model = make_model("gpt-tiny", vocab=64, hidden=32, layers=2, heads=2, max_positions=256, seed=0)
    cfg = replace(model.config, layers=model.config.layers / 2)
    fb = FeedbackLoop(CostModel(cfg, device_preset("cpu")), refit_every=4, forgetting=0.9)
    runner = PipelineRunner.from_model(model, ctx, [0, 2, 4], RunnerConfig(gather_timing=True))
    opt = torch.optim.SGD(runner.parameters(), lr=0.05)
    rng = np.random.default_rng(0)  # the same stream of global batches on every rank
    limit = float(fb.cost_model.padded(4, 128)[1][0])
    consistent = True
    for step in range(steps):
        shapes = Shapes.from_lengths(input_tokens=rng.integers(4, 128, 24), target_tokens=np.zeros(24, int))
        plan = fb.plan(shapes, num_stages=2, max_len=128, memory_limit=limit, step=step)
        # the plan's predictions come from the current (refit) coefficients
        consistent &= bool(np.allclose(plan.mb_time_s, fb.features(plan) @ fb.cost_model.time_coef))
        batches = replica_batches(model, plan, 0, seed=step)
        res = runner.step(plan, batches, optimizer=opt)
        fb.record(plan, res.all_timings)
        fb.maybe_refit()
    return {"coef": fb.cost_model.time_coef.tolist(), "history": [asdict(r) for r in fb.history],
            "errors": [e.mape for e in fb.step_errors], "prior": fb.prior.tolist(), "consistent": consistent}


class _Slow(torch.nn.Module):
    """A layer that also sleeps in its forward: makes one rank's profile of it disagree with the other's."""

    def __init__(self, inner, sleep_s):
        super().__init__()
        self.inner, self.sleep_s = inner, sleep_s

    def forward(self, *args):
        time.sleep(self.sleep_s)
        return self.inner(*args)


def partition_search(rank, world, port, mismatch):
    """search_partition with a different slow layer on each rank: alone, each rank would pick its own
    split; averaged over the ranks, both must pick the same one."""
    with _ctx(rank, world, port, 2) as ctx:
        return _partition_search(ctx, mismatch)


def _partition_search(ctx, mismatch):
    from dynabatch.pipeline import balanced_partition, profile_layers, search_partition

    rank = ctx.rank
    model = make_model("gpt-tiny", vocab=64, hidden=16, layers=4, heads=2, max_positions=64, seed=0)
    layers = list(model.layers)
    slow = 1 if rank == 0 else 4
    layers[slow] = _Slow(layers[slow], 0.02)
    gen = torch.Generator().manual_seed(rank)
    batches = [model.random_batch(MicroBatchShape("padded", 2, 16), gen) for _ in range(4 - (mismatch and rank))]
    alone = balanced_partition(profile_layers(layers, batches, repeats=1, warmup=0), 2).bounds
    part = search_partition(layers, batches, 2)
    return {"bounds": list(part.bounds), "alone": list(alone), "makespan": part.makespan_s}


BODIES = {"correctness": _correctness, "soak": _soak, "feedback_run": _feedback_run,
          "partition_search": _partition_search}
