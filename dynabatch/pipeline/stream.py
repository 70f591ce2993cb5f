"""Flush-free streams of steps on one stage (`PipelineRunner.run_steps` with ``RunnerConfig(flush=False)``):
the steps' micro-batches as one 1F1B program, each stage's update at the end of its part of a step,
the weights each forward computes with (`dynabatch.pipeline.weight_prediction.WeightPredictor`) and
the per-step results. Seconds, tokens, bytes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .timing import StepResult, StepTiming


@dataclass
class _Stream:
    """A flush-free stream of steps on this stage (see `PipelineRunner.run_steps`): each step's exclusive
    end in the concatenated micro-batches, the update lag of every micro-batch on every stage, each
    step's global real target tokens, the stage's `WeightPredictor`, this rank's loss sums per step,
    how many updates are done and when (``perf_counter``)."""

    ends: np.ndarray
    lags: np.ndarray
    tokens: np.ndarray
    predictor: object
    loss: np.ndarray
    done: int = 0
    update_t: list = field(default_factory=list)


def run_stream(runner, steps, optimizer, num_tokens, collation) -> list[StepResult]:
    """`PipelineRunner.run_steps` with ``flush=False`` (see there)."""
    if optimizer is None:
        raise ValueError("run_steps with flush=False needs the stage's optimizer (it updates inside the stream)")
    if num_tokens is None or len(num_tokens) != len(steps):
        raise ValueError(f"run_steps with flush=False needs num_tokens: the real target tokens of each of the "
                         f"{len(steps)} steps over all ranks")
    if not steps:
        return []
    shapes, batches, ends = [], [], []
    for plan, b in steps:
        sh = runner._shapes(plan, collation)
        if not sh:
            raise ValueError(f"replica {runner.ctx.replica} has no micro-batches in step {len(ends)} of the stream")
        shapes += sh
        batches += list(b) if b is not None else [None] * len(sh)
        ends.append(len(shapes))
    from ..core.simulate.flushfree import update_lag

    ends = np.asarray(ends, np.int64)
    stream = _Stream(ends, update_lag(ends, runner.ctx.num_stages), np.asarray(num_tokens, np.float64),
                     predictor_for(runner, optimizer), np.zeros(len(ends)))
    needs_data = runner.stage.is_first or runner.stage.is_last
    return runner._guarded(lambda: runner._step(shapes, batches if needs_data else None, optimizer, None, None,
                                            stream))


def predictor_for(runner, optimizer):
    """The stage's `WeightPredictor` for ``optimizer`` (made once; ``none`` keeps only the aliasing)."""
    from .weight_prediction import WeightPredictor

    mode = runner.config.weight_prediction or "none"
    wp = getattr(runner, "_wp", None)
    if wp is None or wp.optimizer is not optimizer or wp.mode != mode:
        if wp is not None:
            wp.close()
        wp = WeightPredictor(optimizer, mode, gradient=runner.config.prediction_gradient)
        runner._wp = wp
    return wp


def stream_update(runner, stream, params, optimizer) -> None:
    """This stage's update at the end of step ``stream.done`` of a flush-free stream."""
    ctx, mon, k = runner.ctx, runner.ctx.monitor, stream.done
    s = ctx.stage
    mon.set_state("busy", f"updating stage {s} after step {runner.step_index + k} of the stream")
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    scale = 1.0 / max(float(stream.tokens[k]), 1.0)
    if grads and ctx.num_replicas > 1:
        flat = _flatten_dense_tensors(grads)
        runner._in_comm = True
        runner._wait([dist.all_reduce(flat, group=ctx.dp_group, async_op=True)],
                   f"in the gradient all-reduce of stream step {runner.step_index + k} (waiting for stage {s} "
                   f"of every replica)", [ctx.global_rank(s, d) for d in range(ctx.num_replicas)])
        runner._in_comm = False
        flat.mul_(scale)
        for g, r in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(r)
    elif grads:
        torch._foreach_mul_(grads, scale)
    optimizer.step()
    for p in params:
        p.grad = None
    stream.update_t.append(time.perf_counter())
    stream.done += 1


def stream_results(runner, stream, fwd_s, bwd_s, saved_b, wait_s, t_step) -> list[StepResult]:
    """One `StepResult` per step of a finished stream: the losses all-reduced once over every rank (the
    same everywhere), each step's slices of the stage's timings, ``step_s`` the time between updates."""
    ctx, K = runner.ctx, len(stream.ends)
    if stream.done != K:
        raise RuntimeError(f"internal error: the stream updated {stream.done} of its {K} steps")
    losses = torch.tensor(stream.loss, dtype=torch.float64, device=ctx.device)
    runner._in_comm = True
    runner._wait([dist.all_reduce(losses, async_op=True)], "in the loss all-reduce at the end of a flush-free "
                                                           "stream (waiting for every rank)", range(ctx.world_size))
    runner._in_comm = False
    losses = losses.cpu().numpy()
    starts = np.concatenate(([0], stream.ends[:-1]))
    marks = [t_step] + stream.update_t
    out = []
    for k, (a, b) in enumerate(zip(starts, stream.ends)):
        timing = StepTiming(runner.step_index + k, ctx.rank, ctx.stage, ctx.replica, fwd_s[a:b].copy(),
                            bwd_s[a:b].copy(), wait_s / K, marks[k + 1] - marks[k],
                            None if saved_b is None else saved_b[a:b].copy(), 0.0, int(runner.stage.recompute))
        n = float(stream.tokens[k])
        out.append(StepResult(runner.step_index + k, float(losses[k]) * (1.0 / max(n, 1.0)), int(round(n)), timing,
                              None, None, float(stream.predictor.peak_bytes)))
    runner.step_index += K
    return out
