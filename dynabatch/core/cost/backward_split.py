"""`BackwardSplit`: the measured share of a backward its weight part takes when the backward is split.

A zero-bubble schedule runs each backward as an input part (``Bi``: input gradients) and a weight part
(``W``: weight gradients). How the backward's seconds divide between them depends on the model and the
stage (attention and the loss are input-side work, the embedding lookup weight-side) and on how the
runtime splits it, so the simulator should not assume halves (`dynabatch.core.kernels.op_codes.WEIGHT_SHARE`,
the prior). `BackwardSplit` holds one share per stage, fitted from measured split backwards and refit by
feedback: each `observe` pools the new seconds with the old, the old weighed down by ``decay`` so the
share follows the runtime. Seconds in, dimensionless shares out; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels.op_codes import WEIGHT_SHARE


@dataclass(frozen=True)
class BackwardSplit:
    """Per stage: ``input_s`` and ``weight_s``, the (decayed) sums of measured input-part and weight-part
    seconds; ``prior``: the share of a stage with no measurement yet."""

    input_s: tuple[float, ...]
    weight_s: tuple[float, ...]
    prior: float = WEIGHT_SHARE
    #: Per stage, the (decayed) seconds of whole backwards of the micro-batches whose split parts were measured
    #: (0: none given); `split_factor` compares the two.
    whole_s: tuple[float, ...] = ()
    #: Per stage, the (decayed) split seconds (input + weight part) of those same micro-batches.
    paired_s: tuple[float, ...] = ()

    @classmethod
    def unmeasured(cls, num_stages: int, prior: float = WEIGHT_SHARE) -> "BackwardSplit":
        """No measurement yet: every stage at ``prior``."""
        if num_stages < 1 or not 0.0 <= prior <= 1.0:
            raise ValueError(f"need num_stages >= 1 and a prior share in [0, 1], got {num_stages} and {prior}")
        zero = (0.0,) * num_stages
        return cls(zero, zero, float(prior), zero, zero)

    @property
    def num_stages(self) -> int:
        return len(self.input_s)

    def observe(self, input_s, weight_s, decay: float = 0.5, whole_s=None) -> "BackwardSplit":
        """The split refit with measured seconds ``input_s`` and ``weight_s`` (``[S, k]`` or ``[S]``: per stage,
        the input and weight parts of its split backwards; NaN entries are left out); the old sums count
        ``decay`` (0: forget them, 1: keep them whole). ``whole_s`` (same shape): the same micro-batches' whole
        backwards, when measured, for `split_factor`."""
        bi, w = (np.asarray(x, np.float64) for x in (input_s, weight_s))
        bi, w = (x.reshape(x.shape[0], -1) for x in (bi, w))
        whole = np.full(bi.shape, np.nan) if whole_s is None else np.asarray(whole_s, np.float64).reshape(bi.shape)
        if bi.shape != w.shape or bi.shape[0] != self.num_stages:
            raise ValueError(f"input_s and weight_s must both be [{self.num_stages}, k] seconds, got {bi.shape} and "
                             f"{w.shape}")
        ok = np.isfinite(bi) & np.isfinite(w)
        if np.any((bi < 0) & ok) or np.any((w < 0) & ok):
            raise ValueError("measured seconds must be >= 0")
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        new_bi = decay * np.asarray(self.input_s) + np.where(ok, bi, 0.0).sum(axis=1)
        new_w = decay * np.asarray(self.weight_s) + np.where(ok, w, 0.0).sum(axis=1)
        both = ok & np.isfinite(whole)
        zero = np.zeros(self.num_stages)
        new_whole = decay * np.asarray(self.whole_s or zero) + np.where(both, whole, 0.0).sum(axis=1)
        new_paired = decay * np.asarray(self.paired_s or zero) + np.where(both, bi + w, 0.0).sum(axis=1)
        return BackwardSplit(*(tuple(float(x) for x in a) for a in (new_bi, new_w)), self.prior,
                             *(tuple(float(x) for x in a) for a in (new_whole, new_paired)))

    @property
    def split_factor(self) -> float:
        """A split backward's seconds (input + weight part) over a whole backward's of the same micro-batches,
        pooled over the stages (1.0 when no whole backward was measured): what splitting costs on top of the
        products themselves (autograd calls, the kept gradients)."""
        whole = sum(self.whole_s) if self.whole_s else 0.0
        return float(sum(self.paired_s) / whole) if whole > 0 else 1.0

    @property
    def weight_shares(self) -> np.ndarray:
        """float64 ``[S]``: each stage's weight part over its whole split backward (``prior`` unmeasured)."""
        bi, w = np.asarray(self.input_s), np.asarray(self.weight_s)
        tot = bi + w
        return np.where(tot > 0, w / np.where(tot > 0, tot, 1.0), self.prior)

    @property
    def weight_share(self) -> float:
        """One share for every stage (what a simulation of one share prices): the stages' weight seconds over
        their backward seconds, pooled (``prior`` unmeasured)."""
        tot = sum(self.input_s) + sum(self.weight_s)
        return float(sum(self.weight_s) / tot) if tot > 0 else self.prior
