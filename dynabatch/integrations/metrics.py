"""`StepMetrics`: what one data-parallel step did, from every rank's gathered figures, the same on
every rank: the figures the planner is judged by (padding efficiency, rank imbalance predicted and
measured, micro-batches, tokens), the cost model's error, and the share of the step the loop waited
for data. `dynabatch.integrations.feedback.StepFeedback` makes one per step; the Trainer logs them
(`dynabatch.integrations.hf_metrics`), an ``accelerate`` loop gets them from `StepFeedback.backward`.

Seconds, tokens, fractions (0.1 = 10%); ``nan`` where a figure is undefined for the step (no
micro-batch observed, the first step of an epoch for the data wait).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

#: Per-rank head of the gathered row (then forward_s[M], backward_s[M], predicted_s[M], features).
HEAD = ("microbatches", "real_microbatches", "loss", "wait_s", "interval_s", "tokens", "computed_tokens")


@dataclass(frozen=True)
class StepMetrics:
    """One step over all ranks (see the module docstring).

    step: the loader's global step number. loss: the step's mean loss per target token (nats; every
        rank's share summed). microbatches: micro-batches each rank ran (placeholders included, the
        same on every rank); real_microbatches: the plan's over all ranks. tokens / computed_tokens:
        real and computed (padded) tokens of the step over all ranks; target_tokens: its loss tokens;
        padding_efficiency: tokens / computed_tokens.
    predicted_imbalance / measured_imbalance: slowest rank over the mean rank (1.0 = balanced) of the
        plan's predicted seconds and of the measured forward+backward seconds (the synchronizing
        micro-batch's backward, which also waits for the slowest rank, counted as its forward times the
        backward/forward ratio of the step's other micro-batches: `dynabatch.integrations.feedback`),
        placeholders included. rank_compute_s: each rank's measured seconds so counted; compute_s
        their maximum; step_s: the slowest rank's wall seconds since its previous step (optimizer,
        logging and data wait included; nan on the first).
    data_wait_share: mean over ranks of the share of the last step interval the loop waited for the
        loader (planning and loading included; nan on an epoch's first step).
    cost_mape: the plan's predictions against the measured micro-batches (out of sample: made before
        they ran); observations: how many real micro-batches that scored.
    refit: whether the cost model was refit after this step; refit_mape_before / refit_mape_after:
        that refit's error on its window before and after (nan without a refit); cost_version: the
        cost model's `version` after this step.
    """

    step: int
    loss: float
    microbatches: int
    real_microbatches: int
    tokens: int
    computed_tokens: int
    target_tokens: int
    padding_efficiency: float
    predicted_imbalance: float
    measured_imbalance: float
    rank_compute_s: tuple[float, ...]
    compute_s: float
    step_s: float
    data_wait_share: float
    cost_mape: float
    observations: int
    refit: bool = False
    refit_mape_before: float = math.nan
    refit_mape_after: float = math.nan
    cost_version: int = 0

    def as_dict(self) -> dict:
        """The fields as a plain dict (``rank_compute_s`` a list)."""
        d = asdict(self)
        d["rank_compute_s"] = list(self.rank_compute_s)
        return d


def _imbalance(per_rank: np.ndarray) -> float:
    mean = float(np.mean(per_rank)) if len(per_rank) else 0.0
    return float(np.max(per_rank)) / mean if mean > 0 else math.nan


def step_metrics(step, rows: np.ndarray, fwd: np.ndarray, bwd: np.ndarray, pred: np.ndarray,
                 valid: np.ndarray) -> StepMetrics:
    """The `StepMetrics` of ``step`` from every rank's gathered ``rows`` [ranks, len(HEAD)] and per
    micro-batch ``fwd``/``bwd``/``pred`` [ranks, M] (seconds, this rank's execution order; the
    synchronizing micro-batch's backward already estimated); ``valid`` [ranks, M]: the micro-batches
    that score the cost model (real ones with a time)."""
    h = {name: rows[:, i] for i, name in enumerate(HEAD)}
    per_rank = fwd.sum(axis=1) + bwd.sum(axis=1)
    real = np.arange(fwd.shape[1])[None, :] < h["real_microbatches"][:, None]
    predicted = np.where(real, pred, 0.0).sum(axis=1)
    y, p = (fwd + bwd)[valid], pred[valid]
    wait, interval = h["wait_s"], h["interval_s"]
    shares = np.where(interval > 0, wait / np.where(interval > 0, interval, 1.0), np.nan)
    tokens, computed = int(h["tokens"].sum()), int(h["computed_tokens"].sum())
    return StepMetrics(
        step=int(getattr(step, "step", -1)), loss=float(h["loss"].sum() / max(len(rows), 1)),
        microbatches=int(h["microbatches"][0]) if len(rows) else 0, real_microbatches=int(h["real_microbatches"].sum()),
        tokens=tokens, computed_tokens=computed, target_tokens=int(getattr(step, "target_tokens", 0) or 0),
        padding_efficiency=tokens / computed if computed else math.nan,
        predicted_imbalance=_imbalance(predicted), measured_imbalance=_imbalance(per_rank),
        rank_compute_s=tuple(float(x) for x in per_rank), compute_s=float(per_rank.max()) if len(per_rank) else 0.0,
        step_s=float(np.max(interval)) if len(interval) and np.all(interval > 0) else math.nan,
        data_wait_share=float(np.mean(shares)) if np.all(np.isfinite(shares)) else math.nan,
        cost_mape=float(np.mean(np.abs(p - y) / np.maximum(y, 1e-12))) if len(y) else math.nan,
        observations=int(len(y)))


__all__ = ["HEAD", "StepMetrics", "step_metrics"]
