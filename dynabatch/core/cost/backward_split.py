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

    @classmethod
    def unmeasured(cls, num_stages: int, prior: float = WEIGHT_SHARE) -> "BackwardSplit":
        """No measurement yet: every stage at ``prior``."""
        if num_stages < 1 or not 0.0 <= prior <= 1.0:
            raise ValueError(f"need num_stages >= 1 and a prior share in [0, 1], got {num_stages} and {prior}")
        return cls((0.0,) * num_stages, (0.0,) * num_stages, float(prior))

    @property
    def num_stages(self) -> int:
        return len(self.input_s)

    def observe(self, input_s, weight_s, decay: float = 0.5) -> "BackwardSplit":
        """The split refit with measured seconds ``input_s`` and ``weight_s`` (``[S, k]`` or ``[S]``: per stage,
        the input and weight parts of its split backwards; NaN entries are left out); the old sums count
        ``decay`` (0: forget them, 1: keep them whole)."""
        bi, w = (np.asarray(x, np.float64) for x in (input_s, weight_s))
        bi, w = (x.reshape(x.shape[0], -1) for x in (bi, w))
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
        return BackwardSplit(tuple(float(x) for x in new_bi), tuple(float(x) for x in new_w), self.prior)

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
