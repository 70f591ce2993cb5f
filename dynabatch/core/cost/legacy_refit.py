"""The deprecated ``CostModel.observe``/``refit``: kept for one release, they delegate to the one refit path,
`dynabatch.core.plan.feedback.FeedbackLoop`, held per cost model (``tests/test_cost.py`` checks that the old
calls still refit as the loop does).

`FeedbackLoop` sits above the cost model (it plans), so this module imports nothing of it: the loop class
registers itself as ``CostModel.legacy_loop_class`` when `dynabatch.core.plan.feedback` is imported.
"""

from __future__ import annotations

import warnings

import numpy as np

from ..kernels.cost import NUM_FEATURES


def loop_of(cost):
    """The loop behind ``cost``'s deprecated observe/refit (``cost.legacy_loop``), built on first use:
    forgetting ``cost.forgetting`` per call, prior the analytic coefficients, ridge ``cost.prior_strength``."""
    if cost.legacy_loop_class is None:
        raise RuntimeError("CostModel.observe/refit need dynabatch.core.plan.feedback (import dynabatch)")
    if cost.legacy_loop is None:
        cost.legacy_loop = cost.legacy_loop_class(cost, refit_every=1, forgetting=cost.forgetting,
                                                  prior=cost.prior_time_coef, prior_strength=cost.prior_strength,
                                                  min_weight=1e-6)
    return cost.legacy_loop


def observe(cost, phi, measured_s, weight: float = 1.0) -> None:
    """Record measured stage times (seconds) of micro-batches with features ``phi`` in ``cost``'s loop."""
    warnings.warn("CostModel.observe is deprecated: record measured times with "
                  "dynabatch.core.plan.feedback.FeedbackLoop(cost).record(...) or record_step(...), the one "
                  "refit path", DeprecationWarning, stacklevel=3)
    phi = np.atleast_2d(np.asarray(phi, np.float64))
    y = np.atleast_1d(np.asarray(measured_s, np.float64))
    if phi.shape != (len(y), NUM_FEATURES):
        raise ValueError(f"observe needs phi of shape [n, {NUM_FEATURES}] matching {len(y)} times")
    if np.any(~np.isfinite(y)) or np.any(y < 0):
        raise ValueError("observed times must be finite and non-negative seconds")
    loop_of(cost).record(phi, y, weight=weight)


def refit(cost) -> np.ndarray:
    """Refit ``cost`` from what `observe` recorded; the new coefficients (a copy)."""
    warnings.warn("CostModel.refit is deprecated: refit with dynabatch.core.plan.feedback.FeedbackLoop "
                  "(maybe_refit/refit), the one refit path", DeprecationWarning, stacklevel=3)
    if cost.legacy_loop is None or cost.legacy_loop.num_observations == 0:
        raise ValueError("refit() needs observations: call observe(phi, measured_seconds) first")
    cost.legacy_loop.refit()
    return cost.time_coef.copy()
