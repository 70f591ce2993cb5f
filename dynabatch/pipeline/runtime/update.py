"""The pieces every way of running ends a step (or a stream's step) with, written once: the update of a
stage's parameters (shared parameters summed over the stages holding them, the data-parallel all-reduce,
the scaling by ``1 / tokens``, the optimizer step) and the all-gather of every rank's `StepTiming` (the
loss/token all-reduce, which carries the non-finite verdict too: `nonfinite.reduce_step`). Seconds, tokens."""

from __future__ import annotations

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..measure.timing import StepTiming


def update_stage(guard, params: list, n_tokens: float, optimizer, label: str, *, ties=None,
                 free_grads: bool = False) -> None:
    """Update this stage's trainable ``params`` after their last backward of a step (``label``:
    ``step 3``). A parameter without a gradient gets zeros (the flattened layout must match across
    replicas); then the gradients of parameters shared with other stages are summed over those stages
    (``ties``: a `dynabatch.pipeline.runtime.tied.Ties`; before anything else, so the sum is the one
    process's), averaged over the data-parallel replicas and scaled by ``1 / max(n_tokens, 1)``, and
    ``optimizer.step()`` runs (when given). ``free_grads``: drop the spent gradients afterwards."""
    ctx, mon = guard.ctx, guard.ctx.monitor
    s = ctx.stage
    mon.set_state("busy", f"scaling the gradients of {label}")
    scale = 1.0 / max(float(n_tokens), 1.0)
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    if ties is not None:
        ties.reduce(guard, label)
    if grads and ctx.num_replicas > 1:
        flat = _flatten_dense_tensors(grads)
        guard.all_reduce(flat, f"in the gradient all-reduce of {label} (waiting for stage {s} of every replica)",
                         [ctx.global_rank(s, d) for d in range(ctx.num_replicas)], group=ctx.replica_group)
        flat.mul_(scale)
        for g, r in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(r)
    elif grads:
        torch._foreach_mul_(grads, scale)
    if optimizer is not None:
        mon.set_state("busy", f"in optimizer.step() of {label}")
        optimizer.step()
    if free_grads:
        for p in params:
            p.grad = None


def gather_timings(guard, timing: StepTiming, counts: np.ndarray) -> tuple[StepTiming, ...]:
    """Every rank's `StepTiming` of this step (one all-gather; what a `FeedbackLoop` refits from on
    every rank alike). ``counts[d]``: the micro-batches replica ``d`` ran."""
    import torch.distributed as dist

    ctx = guard.ctx
    M = len(timing.forward_s)
    width = int(counts.max())
    mine = torch.zeros(4, max(width, 3) + 1, dtype=torch.float64)
    mine[0, :M] = torch.from_numpy(timing.forward_s)
    mine[1, :M] = torch.from_numpy(timing.backward_s)
    mine[2, 0], mine[2, 1] = timing.wait_s, timing.step_s
    mine[2, 2], mine[2, 3] = timing.peak_saved_bytes, timing.recompute_layers
    if timing.saved_bytes is not None:
        mine[3, :M] = torch.from_numpy(timing.saved_bytes)
    mine = mine.to(ctx.device)
    out = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    with guard.communicating():
        work = dist.all_gather(out, mine, async_op=True)
    guard.wait([work], f"gathering the timings of step {timing.step} (waiting for every rank)", guard.everyone())
    res = []
    for r, t in enumerate(out):
        t = t.cpu().numpy()
        d, st = r // ctx.num_stages, r % ctx.num_stages
        k = int(counts[d])
        res.append(StepTiming(timing.step, r, st, d, t[0, :k].copy(), t[1, :k].copy(), float(t[2, 0]), float(t[2, 1]),
                              t[3, :k].copy() if timing.saved_bytes is not None else None, float(t[2, 2]),
                              int(t[2, 3])))
    return tuple(res)
