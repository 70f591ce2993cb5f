"""Close the loop between measured step times and the planner's cost model: the one refit path.

Online, with the loader (the first-class loop)::

    loader = DataLoader(..., costing=Costing(cost_model=cost), feedback=FeedbackLoop(cost))
    for step in loader.steps():                       # a Step: this rank's micro-batches + the plan
        result = runner.step(batch_shapes(step), step, optimizer=optimizer)
        loader.feedback(result)                       # record_step(step, result), then maybe_refit()

`FeedbackLoop.record_step(step, result)` takes the loader's step (its global `BatchPlan` and, for
packed plans, its `Shapes`) and the runner's `StepResult`, turns each executed micro-batch into an
observation ``(features phi, measured seconds)`` scored against the plan's own prediction, and
`FeedbackLoop.maybe_refit()` refits the time coefficients every ``refit_every`` recorded steps,
writing them in place into the cost model the planner uses (``CostModel.version`` + 1; after
``CostModel.share_memory()`` forked planner processes and DataLoader workers see them too), so the
next global batches are planned with what was measured. `record(plan_or_phi, timings)` is the same
for a plan or feature rows without a loader. `CostModel.observe`/`CostModel.refit` are deprecated
wrappers of this class; the math is `dynabatch.core.cost.fit`.

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
``stage_reduce="per_stage"`` keeps every stage: each micro-batch gives one observation per stage
(its features, that stage's measured forward+backward), the planner's prediction being the plan's
``stage_time_s`` (its ``mb_time_s`` on every stage for a stage-blind plan); each stage's row of
``CostModel.stage_time_coef`` is refit by the same robust fit on that stage's observations, its prior
that stage's row when the loop first saw the stages (`CostModel.stage_time_rows`), and written with
`CostModel.set_stage_time_coef` (``time_coef`` becomes the rows' mean; ``version`` + 1 per refit).
Fitted rows that differ make even a uniform-layout model stage-aware, so the planner prices every
stage (`dynabatch.core.cost.stages`). `FeedbackRow` and `StepError` then also report per-stage MAPE.
A stage's prior row is 0 where its layout holds none of a feature's layers (no main-stack cost on a
vision-only stage), and such a coefficient stays 0; ``fit_layout_zeros=True`` fits it too, from 0
(ridge-pulled towards 0 in units of the largest stage's prior coefficient of that feature), for a
stage that still pays for the feature: the vision stage of a VLM builds the language-side layout of
every micro-batch, ``[rows, length]`` index tensors, so its time grows with the micro-batch's tokens
although it holds no language layer. Features no stage prices stay 0 either way.
Every rank must feed the loop the same data (``RunnerConfig(gather_timing=True)``) so that all ranks
refit identically and keep planning the same plan.
A plan that recomputes activations (``options["recompute_layers"]``, `dynabatch.core.plan.recompute`) is
observed without its recomputation: the cost model prices a micro-batch without it and the planner
adds it, so the recomputed share of each stage's measured forward is taken off its measured time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

import numpy as np

from ..batchplan import BatchPlan
from ..cost.model import NUM_FEATURES, CostModel
from ..cost.features import plan_features
from ..cost.fit import MAX_OBSERVATIONS, fit_relative, mape as _mape, robust_fit  # noqa: F401  (re-exported)
from ..options import UNSET, PlanOptions, given
from ..shapes import Shapes
from .planner import plan_microbatches
from .feedback_state import feedback_state_dict, load_feedback_state
from ..cost.stage_memory import stage_memory_of


@dataclass(frozen=True)
class FeedbackRow:
    """One refit: at recorded ``step``, with ``observations`` weighted observations in the fit,
    ``window`` of them new since the previous refit. ``mape_before_refit`` is the relative error (a
    fraction, 0.1 = 10%) of the predictions the planner used for those new observations (out of
    sample); ``mape_after_refit`` that of the refit coefficients on the same observations.
    ``time_coef`` are the new coefficients (seconds per feature unit, `dynabatch.core.cost.model.FEATURES`),
    ``version`` the cost model's `CostModel.version` after writing them. With
    ``stage_reduce="per_stage"`` an observation is one (micro-batch, stage) pair, ``time_coef`` the
    mean of the new per-stage rows ``stage_time_coef``, and ``stage_mape_before``/``stage_mape_after``
    the two errors on each stage's observations (nan for a stage without any in the window)."""

    step: int
    observations: int
    window: int
    mape_before_refit: float
    mape_after_refit: float
    time_coef: tuple[float, ...]
    version: int = 0
    stage_mape_before: tuple[float, ...] | None = None
    stage_mape_after: tuple[float, ...] | None = None
    stage_time_coef: tuple[tuple[float, ...], ...] | None = None


@dataclass(frozen=True)
class StepError:
    """Prediction error of one recorded step: MAPE (fraction) of the planner's predictions against the
    measured micro-batch times, before anything was learned from them; ``predicted_s`` and
    ``measured_s`` are their sums over the step's recorded micro-batches (seconds, one stage each);
    ``global_step`` the loader's step number when recorded with `FeedbackLoop.record_step`. With
    ``stage_reduce="per_stage"`` the observations are (micro-batch, stage) pairs (``microbatches``
    counts them, the sums are over every stage) and ``stage_mape`` is the MAPE of each stage."""

    step: int
    mape: float
    microbatches: int
    predicted_s: float = 0.0
    measured_s: float = 0.0
    global_step: int | None = None
    stage_mape: tuple[float, ...] | None = None


@dataclass(frozen=True)
class StepObservations:
    """What one recorded step contributed: feature rows ``phi`` [n, NUM_FEATURES], ``measured_s`` [n]
    and the planner's ``predicted_s`` [n] (seconds), in plan order; ``stage`` [n]: the stage of each
    observation with ``stage_reduce="per_stage"`` (stage by stage), else None."""

    phi: np.ndarray
    measured_s: np.ndarray
    predicted_s: np.ndarray
    stage: np.ndarray | None = None


def _scaled_results(result) -> list:
    """``[(seconds per plan second, result)]``: one entry per model of a multi-model step (anything with
    ``.results`` and ``.time_scale``, a `dynabatch.pipeline.runtime.MultiStepResult`), else ``[(1.0, result)]``."""
    scales = getattr(result, "time_scale", None)
    models = getattr(result, "results", None)
    if scales is None or models is None:
        return [(1.0, result)]
    if len(scales) != len(models) or not all(float(x) > 0 for x in scales):
        raise ValueError(f"a multi-model result needs one positive time scale per model, got {scales!r} for "
                         f"{len(models)} models")
    return [(float(x), r) for x, r in zip(scales, models)]


def _timings_of(result) -> list:
    """StepTimings of a `StepResult` (every rank's when gathered, else its own) or of a sequence."""
    if hasattr(result, "timing") and hasattr(result, "all_timings"):
        return list(result.all_timings) if result.all_timings is not None else [result.timing]
    return [result] if not isinstance(result, (list, tuple)) else list(result)


class FeedbackLoop:
    """Measured micro-batch times -> robust online refit of a `CostModel` (see the module docstring).

    ``cost_model`` is updated in place (give the same object to the planner or the `DataLoader`, or
    read `cost_model`). ``refit_every``: recorded steps between refits. ``forgetting``: per-step
    weight decay of old observations (1.0 = never forget). ``huber_k``: Huber threshold in robust
    standard deviations. ``prior``: coefficients the fit is pulled towards (default: the model's
    ``time_coef`` when the loop is built); ``prior_strength``: the pull (relative to each feature's
    energy). ``stage_reduce``: which stage's time a micro-batch is observed with (``"max"``,
    ``"mean"``, a stage index) or ``"per_stage"`` (every stage's, refitting each stage's coefficients;
    ``prior`` then ``[S, NUM_FEATURES]``, default the model's `CostModel.stage_time_rows` when the loop
    first sees ``S`` stages); ``fit_layout_zeros`` (per-stage only): also fit the coefficients a stage's
    prior row has at 0 while another stage's has not (see the module docstring). ``min_weight``:
    observations whose weight decayed below it are dropped;
    ``max_observations``: at most this many are kept (the oldest go first).
    A `ProfiledTable` attached to the model is dropped at the first refit: the linear fit to the
    table is the starting point and measurements take over from there.
    """

    def __init__(self, cost_model: CostModel, *, refit_every: int = 5, forgetting: float = 0.9,
                 huber_k: float = 1.345, irls_iters: int = 10, prior=None, prior_strength: float = 1e-3,
                 stage_reduce: str | int = "max", min_weight: float = 1e-4,
                 max_observations: int = MAX_OBSERVATIONS, fit_layout_zeros: bool = False):
        if refit_every < 1:
            raise ValueError("refit_every must be >= 1")
        if not 0.0 < forgetting <= 1.0:
            raise ValueError("forgetting must be in (0, 1]")
        if not (stage_reduce in ("max", "mean", "per_stage") or isinstance(stage_reduce, int)):
            raise ValueError("stage_reduce must be 'max', 'mean', 'per_stage' or a stage index")
        if max_observations < 1:
            raise ValueError("max_observations must be >= 1")
        if fit_layout_zeros and stage_reduce != "per_stage":
            raise ValueError("fit_layout_zeros fits per-stage rows: it needs stage_reduce='per_stage'")
        self._cost = cost_model
        self.refit_every = int(refit_every)
        self.forgetting = float(forgetting)
        self.huber_k = float(huber_k)
        self.irls_iters = int(irls_iters)
        self.prior_strength = float(prior_strength)
        self.stage_reduce = stage_reduce
        self.min_weight = float(min_weight)
        self.max_observations = int(max_observations)
        self.per_stage = stage_reduce == "per_stage"
        self.fit_layout_zeros = bool(fit_layout_zeros)
        if self.per_stage:  # [S, NUM_FEATURES]; None until the loop sees how many stages there are
            self.prior = None if prior is None else np.array(prior, np.float64)
            if self.prior is not None and (self.prior.ndim != 2 or self.prior.shape[1] != NUM_FEATURES):
                raise ValueError(f"a per-stage prior must have shape [S, {NUM_FEATURES}]")
        else:
            self.prior = np.array(cost_model.time_coef if prior is None else prior, np.float64)
            if self.prior.shape != (NUM_FEATURES,):
                raise ValueError(f"prior must have {NUM_FEATURES} coefficients")
        self.history: list[FeedbackRow] = []
        self.step_errors: list[StepError] = []
        self.last: StepObservations | None = None  # the last recorded step's observations
        self._phi = np.zeros((0, NUM_FEATURES))
        self._y = np.zeros(0)
        self._w = np.zeros(0)  # base weight of each observation (before forgetting)
        self._step = np.zeros(0, np.int64)
        self._pred = np.zeros(0)  # prediction at record time (the planner's), for the window score
        self._sid = np.zeros(0, np.int64)  # stage of each observation (per_stage), else -1
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

    @property
    def steps_recorded(self) -> int:
        """Steps recorded so far."""
        return self._steps_recorded

    def state_dict(self) -> dict:
        """The refit state (buffers, counters, prior, history, the cost model's coefficients), JSON-able:
        `load_state_dict` of it makes a loop that refits and plans exactly as this one
        (`dynabatch.core.plan.feedback_state`)."""
        return feedback_state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict` (into this loop and its cost model, in place)."""
        load_feedback_state(self, state, FeedbackRow)

    def plan(self, shapes: Shapes, options: PlanOptions | None = None, *, step: int = 0,
             global_batch_tokens: int | None = UNSET, global_batch_size: int | None = UNSET,
             max_len: int | None = UNSET, max_target_len: int | None = UNSET, method: str = UNSET,
             method_options: Mapping[str, Any] = UNSET, num_stages: int = UNSET, num_ranks: int = UNSET,
             schedule: str = UNSET, memory_limit: float | None = UNSET, recompute: str = UNSET,
             device_memory_limit: float | None = UNSET, flush: bool = UNSET, seed: int = UNSET, shuffle: bool = UNSET,
             drop_last: bool = UNSET, equal_microbatches: bool = UNSET, max_caps: int = UNSET) -> BatchPlan:
        """`dynabatch.core.plan.planner.plan_microbatches` of ``shapes`` with the current cost model: ``options``
        and ``step`` as it takes them, each other keyword the `PlanOptions` field of its name (`UNSET`: from
        ``options``)."""
        fields = given({k: v for k, v in locals().items() if k not in ("self", "shapes", "options", "step")})
        return plan_microbatches(shapes, self._cost, options, step=step, **fields)

    # -- features ----------------------------------------------------------------------------------
    def features(self, plan: BatchPlan, shapes: Shapes | None = None, rank: int | None = None) -> np.ndarray:
        """`plan_features` under this loop's cost model."""
        return plan_features(self._cost, plan, shapes, rank)

    def _measured(self, plan: BatchPlan, timings, placeholders: bool = False):
        """(micro-batch indices into the plan, measured seconds, stage of each or -1) from one or all
        ranks' StepTimings (``per_stage``: one observation per micro-batch and timed stage).

        ``placeholders``: a rank may have timed more micro-batches than the plan gives it (the
        loader's trailing zero-token placeholders, or a rank the plan has none for); those are skipped."""
        by_replica: dict[int, list] = {}
        for t in _timings_of(timings):
            by_replica.setdefault(int(t.replica), []).append(t)
        if self.per_stage:
            self._stages_seen(plan.num_stages)
        rho = self._recomputed_share(plan)
        idx, y, sid = [], [], []
        for d, ts in sorted(by_replica.items()):
            mbs = np.flatnonzero(plan.mb_rank == d)
            per_stage = {}
            for t in ts:
                v = np.asarray(t.compute_s, np.float64)
                if rho is not None and rho[int(t.stage)] > 0:  # the recomputed forward ran in the backward
                    v = v - rho[int(t.stage)] * np.asarray(t.forward_s, np.float64)
                if len(v) != len(mbs) and not (placeholders and len(v) > len(mbs)):
                    raise ValueError(f"stage {int(t.stage)} of replica {d} timed {len(v)} micro-batches; "
                                     f"the plan has {len(mbs)}")
                per_stage[int(t.stage)] = v[:len(mbs)]
            if not len(mbs):
                continue
            if self.per_stage:
                for k in sorted(per_stage):
                    idx.append(mbs), y.append(per_stage[k]), sid.append(np.full(len(mbs), k, np.int64))
                continue
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
            idx.append(mbs), y.append(vals), sid.append(np.full(len(mbs), -1, np.int64))
        if not idx:
            return np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64)
        return np.concatenate(idx), np.concatenate(y), np.concatenate(sid)

    def _planned(self, plan: BatchPlan, idx, sid) -> np.ndarray:
        """The plan's own prediction of each observation: its stage's ``stage_time_s`` when the plan has
        them (and the observation a stage), else ``mb_time_s``; without the recomputation it priced."""
        rho = self._recomputed_share(plan)
        if rho is not None and plan.stage_time_s is not None:
            base = np.asarray(plan.stage_time_s, np.float64) / (1.0 + rho * self._cost.forward_fraction)[:, None]
            return base[sid, idx] if self.per_stage else base.max(axis=0)[idx]
        if self.per_stage and plan.stage_time_s is not None:
            return np.asarray(plan.stage_time_s, np.float64)[sid, idx]
        return np.asarray(plan.mb_time_s, np.float64)[idx]

    def _recomputed_share(self, plan: BatchPlan) -> np.ndarray | None:
        """Per stage, the share of its recomputable layers the plan recomputes (None without any).

        The loop fits the cost model's time *without* recomputation (the planner adds it, see
        `dynabatch.core.plan.recompute`): a stage that recomputed share ``rho`` ran ``rho`` of its forward a
        second time inside the backward, so ``rho x`` its measured forward seconds are taken off its
        measured time, and the plan's prediction is divided by ``1 + rho x forward share`` (the
        recomputed forward priced on the whole stage time: fixed per-micro-batch terms are small)."""
        ks = (plan.options or {}).get("recompute_layers")
        if not ks or not any(ks):
            return None
        n = np.asarray(stage_memory_of(self._cost, plan.num_stages).layers, np.float64)
        k = np.asarray(ks, np.float64)
        return np.where(n > 0, np.minimum(k, n) / np.where(n > 0, n, 1.0), 0.0)

    def _stages_seen(self, S: int) -> None:
        """Fix the per-stage prior (the model's rows) the first time ``S`` stages are seen."""
        if self.prior is None:
            self.prior = np.array(self._cost.stage_time_rows(S), np.float64)
        if len(self.prior) != S:
            raise ValueError(f"the per-stage prior has {len(self.prior)} stages; {S} were timed")

    # -- recording ---------------------------------------------------------------------------------
    def record_step(self, step, result) -> float:
        """Record one step the `DataLoader` yielded and the runner executed; returns the MAPE (fraction)
        of the plan's predictions on it.

        ``step``: the loader's `Step` (anything with ``.plan``, the step's global `BatchPlan`, and, for
        packed plans, ``.shapes``, the global batch's `Shapes`; ``.step`` is kept as the global step
        number). ``result``: the runner's `StepResult` (its ``all_timings``, every rank's, with
        ``RunnerConfig(gather_timing=True)``; else its own ``timing``) or a sequence of `StepTiming`,
        or a `dynabatch.pipeline.runtime.MultiStepResult` (K models on the same micro-batches): each model's
        times divided by its ``time_scale`` are observations of the same plan seconds (K per
        micro-batch and stage; the scales themselves are `MultiModelRunner.refit_time_scale`'s).
        Timings of trailing placeholder micro-batches (ranks padded to equal counts) are skipped. A
        one-rank plan (the streaming loader's own share) is matched with this replica's timings only
        (``step.rank``); a step without a plan raises TypeError.
        """
        plan = getattr(step, "plan", None)
        if not isinstance(plan, BatchPlan):
            raise TypeError("record_step needs the loader's step (with .plan, its BatchPlan); "
                            "use record(plan_or_phi, timings) otherwise")
        shapes = getattr(step, "shapes", None)
        parts = []  # (the model's seconds per plan second, its timings)
        for scale, res in _scaled_results(result):
            timings = _timings_of(res)
            if plan.num_ranks == 1 and any(int(t.replica) != 0 for t in timings):
                # a rank's own plan (the streaming loader): only this replica's timings belong to it
                mine = int(getattr(step, "rank", 0) or 0)
                timings = [replace(t, replica=0) for t in timings if int(t.replica) == mine]
            i, v, d = self._measured(plan, timings, placeholders=True)
            parts.append((i, v / scale, d))
        idx, y, sid = (np.concatenate(a) for a in zip(*parts))
        phi = self.features(plan, shapes)[idx]
        pred = self._planned(plan, idx, sid)
        gstep = getattr(step, "step", None)
        return self._add(phi, y, pred, 1.0, None if gstep is None else int(gstep), sid)

    def record(self, what, timings, *, shapes: Shapes | None = None, predicted_s=None, weight: float = 1.0) -> float:
        """Record one executed step and return the MAPE (fraction) of the planner's predictions on it.

        ``what`` is the step's `BatchPlan` (then ``timings`` is a `StepResult`, a `StepTiming` or a
        sequence of them, e.g. ``StepResult.all_timings``; predictions are the plan's ``mb_time_s``) or
        feature rows ``phi`` [n, NUM_FEATURES] (then ``timings`` are n measured seconds or a `StepTiming`
        whose ``compute_s`` has n entries; predictions are ``predicted_s`` or the current model's).
        ``weight`` scales the step's observations in the fit. With ``stage_reduce="per_stage"`` feature
        rows take ``timings`` as ``[S, n]`` seconds (every stage's time of each micro-batch) and
        ``predicted_s`` likewise (default: the current model's `CostModel.stage_times`).
        """
        if isinstance(what, BatchPlan):
            idx, y, sid = self._measured(what, timings)
            phi = self.features(what, shapes)[idx]
            pred = self._planned(what, idx, sid) if predicted_s is None else np.asarray(predicted_s)
        elif self.per_stage:
            phi = np.atleast_2d(np.asarray(what, np.float64))
            Y = np.asarray(timings, np.float64)
            if Y.ndim != 2 or Y.shape[1] != len(phi):
                raise ValueError(f"per-stage timings of {len(phi)} micro-batches must have shape [S, {len(phi)}]")
            self._stages_seen(len(Y))
            P = self._cost.stage_times(phi, len(Y)) if predicted_s is None else np.asarray(predicted_s, np.float64)
            sid = np.repeat(np.arange(len(Y)), len(phi))
            phi, y, pred = np.tile(phi, (len(Y), 1)), Y.ravel(), np.reshape(P, Y.shape).ravel()
        else:
            phi = np.atleast_2d(np.asarray(what, np.float64))
            y = np.asarray(timings.compute_s if hasattr(timings, "compute_s") else timings, np.float64).ravel()
            pred = self._cost.time(phi) if predicted_s is None else np.asarray(predicted_s, np.float64)
            sid = None
        return self._add(phi, y, pred, weight, None, sid)

    def _add(self, phi, y, pred, weight: float, global_step: int | None, sid=None) -> float:
        pred = np.asarray(pred, np.float64).ravel()
        if phi.shape != (len(y), NUM_FEATURES) or len(pred) != len(y):
            raise ValueError(f"{len(y)} measured times for feature rows of shape {phi.shape} "
                             f"and {len(pred)} predictions")
        sid = np.full(len(y), -1, np.int64) if sid is None else np.asarray(sid, np.int64)
        if self.per_stage and (sid < 0).any():
            raise ValueError("stage_reduce='per_stage' needs the stage of every observation")
        keep = np.isfinite(y) & (y > 0)
        phi, y, pred, sid = phi[keep], y[keep], pred[keep], sid[keep]
        self._sid = np.concatenate([self._sid, sid])
        step = self._steps_recorded
        self._phi = np.vstack([self._phi, phi])
        self._y = np.concatenate([self._y, y])
        self._w = np.concatenate([self._w, np.full(len(y), float(weight))])
        self._step = np.concatenate([self._step, np.full(len(y), step, np.int64)])
        self._pred = np.concatenate([self._pred, pred])
        self._steps_recorded += 1
        self._since_refit += 1
        self._trim(self._steps_recorded - 1)
        err = _mape(pred, y)
        self.last = StepObservations(phi, y, pred, sid if self.per_stage else None)
        self.step_errors.append(StepError(step, err, len(y), float(pred.sum()), float(y.sum()), global_step,
                                          self._per_stage_mape(pred, y, sid)))
        return err

    def _per_stage_mape(self, pred, y, sid) -> tuple[float, ...] | None:
        if not self.per_stage:
            return None
        return tuple(_mape(pred[sid == s], y[sid == s]) for s in range(len(self.prior)))

    def _trim(self, now: int) -> np.ndarray:
        """Drop observations whose weight decayed below ``min_weight`` (and the oldest beyond
        ``max_observations``); returns the remaining observations' forgetting weights."""
        w0 = self._w * self.forgetting ** (now - self._step).astype(np.float64)
        live = w0 >= self.min_weight * np.maximum(self._w, 1e-300)
        cut = int(np.argmax(live)) if live.any() else len(live)
        cut = max(cut, len(self._y) - self.max_observations)
        if cut > 0:
            self._phi, self._y, self._w, self._step, self._pred, self._sid, w0 = (
                a[cut:] for a in (self._phi, self._y, self._w, self._step, self._pred, self._sid, w0))
            self._window_start = max(self._window_start - cut, 0)
        return w0

    # -- refitting ---------------------------------------------------------------------------------
    def maybe_refit(self) -> FeedbackRow | None:
        """Refit if ``refit_every`` steps were recorded since the last refit; returns the new history row."""
        if self._since_refit < self.refit_every or len(self._y) == 0:
            return None
        return self.refit()

    def refit(self) -> FeedbackRow:
        """Robust refit now (see the module docstring): writes the coefficients into the cost model in
        place (``CostModel.version`` + 1) and appends to `history`."""
        if len(self._y) == 0:
            raise ValueError("refit() needs recorded observations")
        now = self._steps_recorded - 1
        w0 = self._trim(now)
        # one fit per group of observations: all of them, or (per_stage) each stage's own, with its prior
        units = None  # fit_layout_zeros: a stage's zero prior coefficients, fitted in these units
        if self.per_stage:
            rows = self._cost.stage_time_rows(len(self.prior))
            groups = [(self._sid == s, self.prior[s], rows[s]) for s in range(len(rows))]
            if self.fit_layout_zeros:
                units = self.prior.max(axis=0)
        else:
            rows = self._cost.time_coef.copy()[None, :]
            groups = [(np.ones(len(self._y), bool), self.prior, rows[0])]
        fitted = np.zeros(len(self._y))
        for s, (sel, prior, start) in enumerate(groups):
            if (w0[sel] > 0).any():
                rows[s] = robust_fit(self._phi[sel], self._y[sel], w0[sel], prior, start, huber_k=self.huber_k,
                                     iters=self.irls_iters, prior_strength=self.prior_strength, scale=units)
            fitted[sel] = self._phi[sel] @ rows[s]
        win = slice(self._window_start, None)
        before = _mape(self._pred[win], self._y[win])
        after = _mape(fitted[win], self._y[win])
        if self.per_stage:  # in place: shared memory and every holder of the model see it
            self._cost.set_stage_time_coef(rows)
        else:
            self._cost.time_coef = rows[0]
        self._cost.table = None  # measurements supersede a profiled table from here on
        stage = {}
        if self.per_stage:
            sid = self._sid[win]
            stage = dict(stage_mape_before=self._per_stage_mape(self._pred[win], self._y[win], sid),
                         stage_mape_after=self._per_stage_mape(fitted[win], self._y[win], sid),
                         stage_time_coef=tuple(tuple(float(c) for c in r) for r in rows))
        row = FeedbackRow(now, int((w0 > 0).sum()), len(self._y) - self._window_start, before, after,
                          tuple(float(c) for c in self._cost.time_coef), self._cost.version, **stage)
        self.history.append(row)
        self._window_start = len(self._y)
        self._since_refit = 0
        return row


CostModel.legacy_loop_class = FeedbackLoop  # the deprecated CostModel.observe/refit delegate to this loop
