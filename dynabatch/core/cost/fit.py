"""The one place the cost model's time coefficients are fitted to measurements.

`fit_relative` is one weighted least-squares solve on *relative* residuals around a prior;
`robust_fit` wraps it in Huber iteratively reweighted least squares. `dynabatch.core.plan.feedback.FeedbackLoop`
(the one refit path of a running job) and `CostModel.profiled` (a fit to a profiled table) call
them; nothing else fits coefficients. Times are seconds, coefficients seconds per feature unit
(`dynabatch.core.cost.model.FEATURES`).
"""

from __future__ import annotations

import numpy as np

#: Observations a `FeedbackLoop` keeps at most (the oldest go first), whatever its forgetting.
MAX_OBSERVATIONS = 100_000


def fit_relative(phi, y, w, prior, strength, scale=None) -> np.ndarray:
    """Weighted least squares on *relative* residuals with a Gaussian prior on the relative
    deviation from ``prior``.

    Solving for c = prior * (1 + delta) keeps features of wildly different scale comparable;
    dividing each row by its measured time makes the fit minimize percentage error (what MAPE
    reports) instead of letting the longest micro-batches dominate; ``strength`` is the prior's
    weight on every ``delta`` (the noise-to-prior variance ratio), so coefficients the data
    cannot pin down stay near the prior instead of absorbing the others' residuals.
    Coefficients whose prior is 0 stay 0 (the feature does not apply to this model) unless
    ``scale`` (seconds per feature unit, [NUM_FEATURES]) is positive there: such a coefficient is
    fitted from 0 as ``scale * x`` with the same ``strength`` on ``x`` (pulled towards 0, in units
    of ``scale``): a per-stage fit uses it for a feature the stage's layout prices at 0 although the
    stage may still pay for it. No coefficient is negative (a cost cannot shrink with more work): one
    the solution puts below 0 is held at 0 and the others are solved again (the most negative first,
    until none is), instead of clipping it afterwards, which would bias every prediction.
    """
    phi = np.asarray(phi, np.float64)
    y = np.asarray(y, np.float64)
    w = np.asarray(w, np.float64)
    prior = np.asarray(prior, np.float64)
    active = prior > 0
    units = np.zeros_like(prior) if scale is None else np.asarray(scale, np.float64)
    extra = ~active & (units > 0)  # fitted from 0 in units of ``scale``
    X = phi[:, active] * prior[active]  # columns in units of the prior's prediction
    w_rel = np.sqrt(w) / np.maximum(y, 1e-30)
    b = (y - X.sum(axis=1)) * w_rel
    if extra.any():
        X = np.concatenate([X, phi[:, extra] * units[extra]], axis=1)
    A = X * w_rel[:, None]
    n = int(active.sum())
    zero = np.where(np.arange(A.shape[1]) < n, -1.0, 0.0)  # each unknown's value at a zero coefficient
    free = np.ones(A.shape[1], bool)
    delta = zero.copy()
    while free.any():
        rhs = b - A[:, ~free] @ zero[~free]
        Af = A[:, free]
        delta = zero.copy()
        delta[free] = np.linalg.solve(Af.T @ Af + strength * np.eye(Af.shape[1]), Af.T @ rhs)
        below = np.where(free, delta - zero, 0.0)
        if below.min() >= 0.0:
            break
        free[int(np.argmin(below))] = False  # held at 0 from now on
    c = prior.copy()
    c[active] = np.maximum(prior[active] * (1.0 + delta[:n]), 0.0)
    c[extra] = np.maximum(units[extra] * delta[n:], 0.0)
    return c


def robust_fit(phi, y, weight, prior, start, *, huber_k: float = 1.345, iters: int = 10,
               prior_strength: float = 1e-3, scale=None) -> np.ndarray:
    """Huber-IRLS fit of time coefficients on relative errors, ridge-shrunk towards ``prior``.

    ``phi`` [n, NUM_FEATURES], ``y`` [n] seconds, ``weight`` [n] (forgetting), ``start`` the first
    iterate. Residuals are scaled by their median absolute deviation (at least 0.1%), so a
    garbage-collection pause or a preempted step cannot drag the fit. ``scale``: units of the
    coefficients fitted from a zero prior (`fit_relative`). Returns the coefficients (seconds per
    feature unit, non-negative; zero where the prior is, unless ``scale`` frees them).
    """
    phi = np.asarray(phi, np.float64)
    y = np.asarray(y, np.float64)
    base = np.asarray(weight, np.float64)
    prior = np.asarray(prior, np.float64)
    coef = np.asarray(start, np.float64).copy()
    hub = np.ones(len(y))
    for _ in range(max(iters, 1)):
        new = fit_relative(phi, y, base * hub, prior, prior_strength, scale)
        r = (phi @ new - y) / np.maximum(y, 1e-12)
        mad = float(np.median(np.abs(r - np.median(r)))) * 1.4826
        spread = max(mad, 1e-3)  # below 0.1% relative error every point is an inlier
        u = np.abs(r) / spread
        hub = np.where(u <= huber_k, 1.0, huber_k / np.maximum(u, 1e-12))
        done = np.allclose(new, coef, rtol=1e-6, atol=0.0)
        coef = new
        if done:
            break
    return coef


def mape(pred, y) -> float:
    """Mean absolute percentage error of ``pred`` against measured ``y`` (a fraction; nan when empty)."""
    pred, y = np.asarray(pred, np.float64), np.asarray(y, np.float64)
    return float(np.mean(np.abs(pred - y) / np.maximum(y, 1e-12))) if len(y) else float("nan")
