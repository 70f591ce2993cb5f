"""Close the loop between measured step times and the planner's cost model.

`FeedbackLoop.record(plan, timings)` turns each executed micro-batch into an observation
``(features phi, measured seconds)``, forwards it to `CostModel.observe`, and keeps its own window;
`FeedbackLoop.maybe_refit()` refits the time coefficients every ``refit_every`` recorded steps and
writes them into the cost model the planner uses, so the next global batches are planned with
what was measured.

The refit is a robust, prior-regularized least squares on the analytic features:

* errors are *relative* (each observation is weighted by ``1 / measured**2``), because the planner
  needs every micro-batch right in percent, not the large ones in seconds;
* Huber weights by iteratively reweighted least squares (IRLS) on the relative residuals, scaled
  by their median absolute deviation, so a garbage-collection pause or a preempted step cannot
  drag the fit;
* exponential forgetting per recorded step (weight ``forgetting ** age``), so the fit follows drift
  (thermal throttling, a different node, a changed kernel) — the analytic features stay exact;
* a ridge pull towards the starting coefficients (solved as ``prior * (1 + delta)``, damping each
  ``delta`` relative to its feature's energy), so a few observations of similar shape cannot
  produce a wild model; features the model does not have stay 0.

Which time is "the" time of a micro-batch: the cost model predicts forward+backward seconds on one
stage, while a pipelined step measures it on every stage. ``stage_reduce="max"`` (the default) takes
the slowest stage's forward+backward — the stage that paces the pipeline, and what the planner's
simulation of equal stages must get right; ``"mean"`` averages the stages (total work / stages);
an integer observes one stage only. With a single `StepTiming` (one rank's view) its own stage is used.
Every rank must feed the loop the same data (``RunnerConfig(gather_timing=True)``) so that all ranks
refit identically and keep planning the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from .batchplan import BatchPlan
from .cost import NUM_FEATURES, CostModel, fit_relative
from .shapes import Shapes


@dataclass(frozen=True)
class FeedbackRow:
    """One refit: at recorded ``step``, with ``observations`` weighted observations in the fit,
    ``window`` of them new since the previous refit. ``mape_before_refit`` is the relative error (a
    fraction, 0.1 = 10%) of the predictions the planner used for those new observations (out of
    sample); ``mape_after_refit`` that of the refit coefficients on the same observations.
    ``time_coef`` are the new coefficients (seconds per feature unit, `dynabatch.core.cost.FEATURES`)."""

    step: int
    observations: int
    window: int
    mape_before_refit: float
    mape_after_refit: float
    time_coef: tuple[float, ...]


@dataclass(frozen=True)
class StepError:
    """Prediction error of one recorded step: MAPE (fraction) of the planner's predictions against the
    measured micro-batch times, before anything was learned from them."""

    step: int
    mape: float
    microbatches: int


def _mape(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - y) / np.maximum(y, 1e-12))) if len(y) else float("nan")


class FeedbackLoop:
    """Measured micro-batch times -> robust online refit of a `CostModel` (see the module docstring).

    ``cost_model`` is updated in place (give the same object to the planner, or read `cost_model`).
    ``refit_every``: recorded steps between refits. ``forgetting``: per-step weight decay of old
    observations (1.0 = never forget). ``huber_k``: Huber threshold in robust standard deviations.
    ``prior_strength``: ridge weight towards the starting coefficients (relative to each feature's energy).
    ``min_weight``: observations whose weight decayed below it are dropped.
    A `ProfiledTable` attached to the model is dropped at the first refit: the linear fit to the
    table is the starting point and measurements take over from there.
    """

    def __init__(self, cost_model: CostModel, *, refit_every: int = 5, forgetting: float = 0.9,
                 huber_k: float = 1.345, irls_iters: int = 10, prior_strength: float = 1e-3,
                 stage_reduce: str | int = "max", min_weight: float = 1e-4):
        if refit_every < 1:
            raise ValueError("refit_every must be >= 1")
        if not 0.0 < forgetting <= 1.0:
            raise ValueError("forgetting must be in (0, 1]")
        if not (stage_reduce in ("max", "mean") or isinstance(stage_reduce, int)):
            raise ValueError("stage_reduce must be 'max', 'mean' or a stage index")
        self._cost = cost_model
        self.refit_every = int(refit_every)
        self.forgetting = float(forgetting)
        self.huber_k = float(huber_k)
        self.irls_iters = int(irls_iters)
        self.prior_strength = float(prior_strength)
        self.stage_reduce = stage_reduce
        self.min_weight = float(min_weight)
        self.prior = cost_model.time_coef.copy()
        self.history: list[FeedbackRow] = []
        self.step_errors: list[StepError] = []
        self._phi = np.zeros((0, NUM_FEATURES))
        self._y = np.zeros(0)
        self._step = np.zeros(0, np.int64)
        self._pred = np.zeros(0)  # prediction at record time (the planner's), for the window score
        self._steps_recorded = 0
        self._since_refit = 0
        self._window_start = 0  # index into the buffers of the first observation since the last refit

    # -- what the planner reads ------------------------------------------------------------------
    @property
    def cost_model(self) -> CostModel:
        """The cost model with the latest coefficients (the same object that was passed in)."""
        return self._cost

    @property
    def num_observations(self) -> int:
        """Observations currently in the fit window (after dropping decayed ones)."""
        return len(self._y)

    def plan(self, shapes: Shapes, **kw) -> BatchPlan:
        """`dynabatch.core.plan.plan_microbatches` with the current cost model."""
        from .plan import plan_microbatches

        return plan_microbatches(shapes, self._cost, **kw)

    # -- features ----------------------------------------------------------------------------------
    def features(self, plan: BatchPlan, shapes: Shapes | None = None, rank: int | None = None) -> np.ndarray:
        """Feature rows [n, NUM_FEATURES] of the plan's micro-batches (all ranks, or ``rank``'s) in plan
        order. Packed (varlen) plans need the global batch's ``shapes`` for per-sample lengths."""
        sel = np.arange(plan.num_microbatches) if rank is None else np.flatnonzero(plan.mb_rank == rank)
        if plan.collation != "packed":
            return self._cost.padded_features(plan.mb_rows[sel], plan.mb_input_len[sel], plan.mb_target_len[sel],
                                              plan.mb_vision_tiles[sel])
        if shapes is None:
            raise ValueError("features of a packed plan need the global batch's Shapes (per-sample lengths)")
        main, dec, tiles = self._cost.sample_dims(shapes, plan.options.get("max_len"), plan.options.get("max_target_len"))
        pos = {int(s): i for i, s in enumerate(shapes.sample_id)}
        idx = np.array([pos[int(s)] for s in plan.sample_ids], np.int64)
        sizes = np.diff(plan.mb_offsets)
        group = np.repeat(np.arange(plan.num_microbatches), sizes)
        phi = self._cost.packed_features(main[idx], dec[idx], tiles[idx], group)
        return phi[sel]

    def _measured(self, plan: BatchPlan, timings) -> tuple[np.ndarray, np.ndarray]:
        """(micro-batch indices into the plan, measured seconds) from one or all ranks' StepTimings."""
        timings = [timings] if not isinstance(timings, (list, tuple)) else list(timings)
        by_replica: dict[int, list] = {}
        for t in timings:
            by_replica.setdefault(int(t.replica), []).append(t)
        idx, y = [], []
        for d, ts in sorted(by_replica.items()):
            mbs = np.flatnonzero(plan.mb_rank == d)
            per_stage = {int(t.stage): np.asarray(t.compute_s, np.float64) for t in ts}
            for st, v in per_stage.items():
                if len(v) != len(mbs):
                    raise ValueError(f"stage {st} of replica {d} timed {len(v)} micro-batches; the plan has {len(mbs)}")
            stack = np.array([per_stage[k] for k in sorted(per_stage)])
            if len(per_stage) == 1:
                vals = stack[0]
            elif self.stage_reduce == "max":
                vals = stack.max(axis=0)
            elif self.stage_reduce == "mean":
                vals = stack.mean(axis=0)
            else:
                if self.stage_reduce not in per_stage:
                    raise ValueError(f"stage_reduce={self.stage_reduce} but no timing of that stage was given")
                vals = per_stage[self.stage_reduce]
            idx.append(mbs)
            y.append(vals)
        return np.concatenate(idx), np.concatenate(y)

    # -- recording ---------------------------------------------------------------------------------
    def record(self, what, timings, *, shapes: Shapes | None = None, predicted_s=None) -> float:
        """Record one executed step and return the MAPE (fraction) of the planner's predictions on it.

        ``what`` is the step's `BatchPlan` (then ``timings`` is a `StepTiming` or a sequence of them,
        e.g. ``StepResult.all_timings``; predictions are the plan's ``mb_time_s``) or feature rows
        ``phi`` [n, NUM_FEATURES] (then ``timings`` are n measured seconds or a `StepTiming` whose
        ``compute_s`` has n entries; predictions are ``predicted_s`` or the current model's).
        """
        if isinstance(what, BatchPlan):
            idx, y = self._measured(what, timings)
            phi = self.features(what, shapes)[idx]
            pred = np.asarray(what.mb_time_s, np.float64)[idx] if predicted_s is None else np.asarray(predicted_s)
        else:
            phi = np.atleast_2d(np.asarray(what, np.float64))
            y = np.asarray(timings.compute_s if hasattr(timings, "compute_s") else timings, np.float64).ravel()
            pred = self._cost.time(phi) if predicted_s is None else np.asarray(predicted_s, np.float64)
        if phi.shape != (len(y), NUM_FEATURES):
            raise ValueError(f"{len(y)} measured times for feature rows of shape {phi.shape}")
        keep = np.isfinite(y) & (y > 0)
        phi, y, pred = phi[keep], y[keep], pred[keep]
        self._cost.observe(phi, y)
        step = self._steps_recorded
        self._phi = np.vstack([self._phi, phi])
        self._y = np.concatenate([self._y, y])
        self._step = np.concatenate([self._step, np.full(len(y), step, np.int64)])
        self._pred = np.concatenate([self._pred, pred])
        self._steps_recorded += 1
        self._since_refit += 1
        err = _mape(pred, y)
        self.step_errors.append(StepError(step, err, len(y)))
        return err

    # -- refitting ---------------------------------------------------------------------------------
    def maybe_refit(self) -> FeedbackRow | None:
        """Refit if ``refit_every`` steps were recorded since the last refit; returns the new history row."""
        if self._since_refit < self.refit_every or len(self._y) == 0:
            return None
        return self.refit()

    def refit(self) -> FeedbackRow:
        """Robust refit now (see the module docstring); updates the cost model and `history`."""
        if len(self._y) == 0:
            raise ValueError("refit() needs recorded observations")
        now = self._steps_recorded - 1
        w0 = self.forgetting ** (now - self._step).astype(np.float64)
        live = w0 >= self.min_weight
        # drop what has decayed away (keeps the buffers bounded under forgetting < 1)
        cut = int(np.argmax(live)) if live.any() else len(live)
        shift = min(cut, self._window_start)
        self._phi, self._y, self._step, self._pred, w0 = (a[shift:] for a in (self._phi, self._y, self._step,
                                                                               self._pred, w0))
        self._window_start -= shift
        coef = robust_fit(self._phi, self._y, w0, self.prior, self._cost.time_coef, huber_k=self.huber_k,
                          iters=self.irls_iters, prior_strength=self.prior_strength)
        win = slice(self._window_start, None)
        before = _mape(self._pred[win], self._y[win])
        after = _mape(self._phi[win] @ coef, self._y[win])
        self._cost.time_coef = coef
        self._cost.table = None  # measurements supersede a profiled table from here on
        row = FeedbackRow(now, int(live[shift:].sum()), len(self._y) - self._window_start, before, after,
                          tuple(float(c) for c in coef))
        self.history.append(row)
        self._window_start = len(self._y)
        self._since_refit = 0
        return row


def robust_fit(phi, y, weight, prior, start, *, huber_k: float = 1.345, iters: int = 10,
               prior_strength: float = 1e-3) -> np.ndarray:
    """Huber-IRLS fit of time coefficients on relative errors, ridge-shrunk towards ``prior``.

    ``phi`` [n, NUM_FEATURES], ``y`` [n] seconds, ``weight`` [n] (forgetting), ``start`` the first
    iterate. Returns the coefficients (seconds per feature unit, non-negative; zero where the prior is).
    """
    phi = np.asarray(phi, np.float64)
    y = np.asarray(y, np.float64)
    base = np.asarray(weight, np.float64)
    prior = np.asarray(prior, np.float64)
    coef = np.asarray(start, np.float64).copy()
    hub = np.ones(len(y))
    for _ in range(max(iters, 1)):
        new = fit_relative(phi, y, base * hub, prior, prior_strength)
        r = (phi @ new - y) / np.maximum(y, 1e-12)
        mad = float(np.median(np.abs(r - np.median(r)))) * 1.4826
        scale = max(mad, 1e-3)  # below 0.1% relative error every point is an inlier
        u = np.abs(r) / scale
        hub = np.where(u <= huber_k, 1.0, huber_k / np.maximum(u, 1e-12))
        done = np.allclose(new, coef, rtol=1e-6, atol=0.0)
        coef = new
        if done:
            break
    return coef
