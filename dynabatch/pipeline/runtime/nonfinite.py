"""Non-finite steps (`RunnerConfig.nonfinite`): a NaN or infinite loss or gradient stops training with an
error naming the step, the stage and the micro-batch (``"raise"``, the default), or the step is skipped
and counted (``"skip"``); ``"off"`` checks nothing.

Detection, per virtual micro-batch ``v``: the last stage's loss of ``v`` (one loss accumulator per
micro-batch: the interpreter's ``group(v) = v``), and on every stage whether its gradients are still finite
after ``v``'s backward (`GradWatch`: their largest magnitude, which cannot overflow: one fused pass over the
gradients per backward, kept on the device and read once when the step's update is due). Gradients
accumulate, so the first micro-batch whose flag drops is the one whose backward brought the NaN or infinity.

Agreement: a flushed step's decision is taken after one all-reduce over every rank that carries, beside
the loss and token sums, each rank's first bad micro-batch (`reduce_step`); every rank then decides the same
(`Verdict`): all raise `NonFiniteStep` with the same text, or none updates (no gradient all-reduce, no
optimizer step) and each counts the skip. A flush-free stream (and a multi-model step given ``num_tokens``)
updates a stage before the others finish the step, so no such agreement exists: there a stage whose
gradients are not finite raises at its update and the failure protocol stops every other rank with that
error (`check_update`); ``"skip"`` is refused for them.
"""

from __future__ import annotations

import numpy as np
import torch

MODES = ("raise", "skip", "off")
_HINT = ("lower the learning rate, check that micro-batch's data, or pass RunnerConfig(nonfinite='skip') to "
         "skip such steps")


class NonFiniteStep(FloatingPointError):
    """A step's loss or gradients hold a NaN or an infinity (`RunnerConfig(nonfinite="raise")`)."""


class GradWatch:
    """Whether this stage's gradients ``params()`` were finite after each of ``size`` virtual micro-batches'
    backward (flags on ``device``; no host synchronization until `first_bad`)."""

    def __init__(self, size: int, device, params):
        self.ok = torch.ones(size, dtype=torch.bool, device=device)
        self.params = params

    def after_backward(self, v: int) -> None:
        """Record the flag of ``v`` (its backward has just run on this stage)."""
        grads = [p.grad for p in self.params() if p.grad is not None]
        if grads:
            top = torch.stack([n.float() for n in torch._foreach_norm(grads, float("inf"))]).max()
            self.ok[v] = torch.isfinite(top)

    def first_bad(self, lo: int = 0, hi: int | None = None) -> int | None:
        """The first virtual micro-batch in ``lo..hi-1`` after whose backward the gradients were not finite."""
        bad = (~self.ok[lo:hi]).nonzero()
        return lo + int(bad[0, 0]) if len(bad) else None


def first_bad_loss(loss: torch.Tensor, lo: int = 0, hi: int | None = None) -> int | None:
    """The first of the per-micro-batch losses ``loss[lo:hi]`` that is not finite."""
    bad = (~torch.isfinite(loss[lo:hi])).nonzero()
    return lo + int(bad[0, 0]) if len(bad) else None


class Verdict:
    """Every rank's first non-finite micro-batch of each group (model) of a step, the same on every rank:
    ``loss[g, r]`` and ``grad[g, r]`` (-1: none) for global rank ``r``; ``num_stages`` names the ranks."""

    def __init__(self, loss: np.ndarray, grad: np.ndarray, num_stages: int):
        self.loss, self.grad, self.S = loss, grad, num_stages

    def bad(self, g: int = 0) -> bool:
        """Whether group ``g``'s step is non-finite anywhere."""
        return bool((self.loss[g] >= 0).any() or (self.grad[g] >= 0).any())

    def message(self, what: str, g: int = 0, names=None, *,
                after: str = "no rank updated its weights") -> str:
        """The error text for group ``g`` of ``what`` (``step 3``): the first non-finite loss (lowest
        micro-batch, then replica) or else the first non-finite gradient (lowest micro-batch, then the highest
        stage: the backward's origin). ``names(v)``: how a micro-batch index reads (default ``micro-batch v``)."""
        names = names or (lambda v: f"micro-batch {v}")
        S = self.S
        losses = [(int(v), r // S, r) for r, v in enumerate(self.loss[g]) if v >= 0]
        grads = [(int(v), -(r % S), r) for r, v in enumerate(self.grad[g]) if v >= 0]
        if losses:
            v, d, r = min(losses)
            head = (f"{what}: the loss of {names(v)} (replica {d}) is not finite (NaN or infinity) on stage "
                    f"{r % S} (rank {r})")
        else:
            v, _, r = min(grads)
            head = (f"{what}: the gradients of stage {r % S} (rank {r}, replica {r // S}) are not finite (NaN or "
                    f"infinity) after the backward of {names(v)}")
        more = sorted({r % S for _, _, r in grads} - {r % S})
        also = f"; stage(s) {more} too" if more else ""
        return f"{head}{also}; {after}: {_HINT}"


def reduce_step(guard, loss: torch.Tensor, tokens: torch.Tensor, groups: list[tuple[int, int]], watches, text: str,
                check: bool):
    """Sum ``loss`` and ``tokens`` (float64 [V], one entry per virtual micro-batch) into one entry per group
    (``groups[g]``: its virtual range ``lo, hi``) over every rank with one all-reduce that also carries this
    rank's first non-finite loss and gradient micro-batch of each group (``watches[g]``: its `GradWatch`, or
    None; ``check``: False carries nothing) and how many micro-batches it ran. Returns (loss [G], tokens [G],
    `Verdict` or None, micro-batches [W] of every global rank) as numpy, the same on every rank."""
    ctx = guard.ctx
    G, W = len(groups), ctx.world_size
    sums = [torch.stack([loss[lo:hi].sum(), tokens[lo:hi].sum()]) for lo, hi in groups]
    counts = torch.zeros(W, dtype=torch.float64)
    counts[ctx.rank] = loss.numel()  # replicas may run different numbers (each its own plan)
    parts = [torch.stack(sums, 1).reshape(-1), counts.to(loss.device)]
    if check:
        codes = torch.zeros(2, G, W, dtype=torch.float64)
        for g, (lo, hi) in enumerate(groups):
            bad = first_bad_loss(loss, lo, hi) if ctx.stage == ctx.num_stages - 1 else None
            codes[0, g, ctx.rank] = 0 if bad is None else bad - lo + 1
            bad = watches[g].first_bad(lo, hi) if watches[g] is not None else None
            codes[1, g, ctx.rank] = 0 if bad is None else bad - lo + 1
        parts.append(codes.reshape(-1).to(loss.device))
    stats = torch.cat(parts)
    guard.all_reduce(stats, f"in the loss all-reduce of {text} (waiting for every rank)", guard.everyone())
    out = stats.cpu().numpy()
    verdict = None
    if check:
        codes = out[2 * G + W:].reshape(2, G, W) - 1
        verdict = Verdict(codes[0], codes[1], ctx.num_stages)
    return out[:G], out[G:2 * G], verdict, out[2 * G:2 * G + W].astype(np.int64)


def check_update(watch: GradWatch, lo: int, hi: int, what: str, stage: int, rank: int, names=None) -> None:
    """Before an update that no other rank agrees on (a stream's, an early multi-model one): raise
    `NonFiniteStep` when this stage's gradients of virtual micro-batches ``lo..hi-1`` are not finite."""
    bad = watch.first_bad(lo, hi)
    if bad is None:
        return
    name = names(bad - lo) if names else f"micro-batch {bad - lo}"
    raise NonFiniteStep(f"{what}: the gradients of stage {stage} (rank {rank}) are not finite (NaN or infinity) "
                        f"after the backward of {name}; this stage did not update its weights: {_HINT.split(', or')[0]}")
