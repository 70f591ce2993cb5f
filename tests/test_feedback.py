"""FeedbackLoop: measured times refit the cost model robustly, follow drift, and feed the planner."""

import numpy as np
import pytest

from dynabatch import CostModel, Shapes, plan_microbatches
from dynabatch.core.cost import device_preset
from dynabatch.core.feedback import FeedbackLoop, robust_fit
from dynabatch.pipeline.models import gpt_tiny, t5_tiny
from dynabatch.pipeline.runner import StepTiming

CFG = gpt_tiny(hidden=64, layers=2).config
# truth differs from the analytic CPU prior by factors 0.4..5 per feature
TRUE_A = np.array([3.0, 0.4, 1, 1, 1, 1, 1, 5.0, 1])
TRUE_B = np.array([1.5, 1.5, 1, 1, 1, 1, 1, 1.5, 1])


def model():
    return CostModel(CFG, device_preset("cpu"))


def measure(rng, cm, truth, n=6, outliers=0.05, fast_outliers=False):
    rows = rng.integers(1, 9, n)
    L = rng.integers(1, 33, n) * 8
    phi = cm.padded_features(rows, L, 0, 0)
    y = phi @ (cm.prior_time_coef * truth) * rng.lognormal(0.0, 0.03, n)
    bad = rng.random(n) < outliers
    # slow: a GC pause, a preempted step; fast: a timer that missed asynchronous work
    y[bad] *= np.where(rng.random(bad.sum()) < 0.5, 3.0, 0.3) if fast_outliers else 3.0
    return phi, y


def clean_mape(cm, truth, seed=99):
    rng = np.random.default_rng(seed)
    phi, _ = measure(rng, cm, truth, n=400, outliers=0.0)
    return cm.mape(phi, phi @ (cm.prior_time_coef * truth))


def test_refits_bring_mape_below_ten_percent():
    rng = np.random.default_rng(0)
    cm = model()
    fb = FeedbackLoop(cm, refit_every=3)
    assert clean_mape(cm, TRUE_A) > 0.3  # the analytic prior is far off
    for _ in range(12):
        fb.record(*measure(rng, cm, TRUE_A))
        fb.maybe_refit()
    assert len(fb.history) == 4
    assert fb.history[0].mape_before_refit > 0.3
    assert fb.history[-1].mape_before_refit < 0.15  # out of sample, outliers included
    assert clean_mape(fb.cost_model, TRUE_A) < 0.10
    assert fb.cost_model is cm and cm.num_observations == 72  # everything went through CostModel.observe
    assert [e.step for e in fb.step_errors] == list(range(12))


def test_forgetting_follows_drift():
    def run(forgetting):
        rng = np.random.default_rng(1)
        fb = FeedbackLoop(model(), refit_every=3, forgetting=forgetting)
        for step in range(60):
            fb.record(*measure(rng, fb.cost_model, TRUE_A if step < 30 else TRUE_B))
            fb.maybe_refit()
        return fb

    follow, stuck = run(0.8), run(1.0)
    assert clean_mape(follow.cost_model, TRUE_B) < 0.10
    assert clean_mape(stuck.cost_model, TRUE_B) > 0.15
    # the refit right after the drift saw it (high error before, lower after)
    drift_row = next(r for r in follow.history if r.step >= 30)
    assert drift_row.mape_before_refit > 0.3 and drift_row.mape_after_refit < drift_row.mape_before_refit
    assert follow.num_observations < stuck.num_observations  # decayed observations are dropped


def test_huber_resists_outliers_where_plain_least_squares_does_not():
    rng = np.random.default_rng(2)
    cm = model()
    phis, ys = [], []
    for _ in range(20):
        phi, y = measure(rng, cm, TRUE_A, outliers=0.15, fast_outliers=True)
        phis.append(phi), ys.append(y)
    phi, y = np.vstack(phis), np.concatenate(ys)
    robust = robust_fit(phi, y, np.ones(len(y)), cm.prior_time_coef, cm.time_coef)
    plain = model()
    plain.observe(phi, y)
    plain.refit()
    cm.time_coef = robust
    assert clean_mape(cm, TRUE_A) < 0.05
    assert clean_mape(plain, TRUE_A) > 2 * clean_mape(cm, TRUE_A)


def fake_timings(plan, stage_scale):
    out = []
    for d in range(plan.num_ranks):
        t = plan.mb_time_s[plan.mb_rank == d]
        for s, k in enumerate(stage_scale):
            out.append(StepTiming(0, d * len(stage_scale) + s, s, d, 0.25 * k * t, 0.75 * k * t, 0.0, 1.0))
    return out


def test_record_plan_with_all_stage_timings_and_plan_again():
    """A plan + every rank's StepTiming: the slowest stage (default) or the mean is observed, the plan's
    predictions are scored, and after a refit the planner's predicted times follow the measurements."""
    rng = np.random.default_rng(3)
    cm = CostModel(t5_tiny(hidden=64).config, device_preset("cpu"))
    shapes = Shapes.from_lengths(input_tokens=rng.integers(4, 200, 64), target_tokens=rng.integers(1, 40, 64))
    plan = plan_microbatches(shapes, cm, num_stages=2, num_ranks=2, max_len=256, max_target_len=64)
    fb = FeedbackLoop(cm, refit_every=2)
    err = fb.record(plan, fake_timings(plan, [1.0, 2.0]))  # stage 1 twice as slow as predicted
    assert err == pytest.approx(0.5)  # |pred - 2 pred| / (2 pred)
    assert fb.num_observations == plan.num_microbatches
    mean = FeedbackLoop(CostModel(t5_tiny(hidden=64).config, device_preset("cpu")), stage_reduce="mean")
    assert mean.record(plan, fake_timings(plan, [1.0, 2.0])) == pytest.approx(1 / 3)  # 1.5x
    one_rank = FeedbackLoop(CostModel(t5_tiny(hidden=64).config, device_preset("cpu")))
    one_rank.record(plan, fake_timings(plan, [1.0, 2.0])[1])  # only rank 1's own view (replica 0, stage 1)
    assert one_rank.num_observations == int((plan.mb_rank == 0).sum())
    fb.record(plan, fake_timings(plan, [1.0, 2.0]))
    row = fb.maybe_refit()
    assert row is not None and row.mape_after_refit < 0.05
    again = fb.plan(shapes, num_stages=2, num_ranks=2, max_len=256, max_target_len=64)
    phi = fb.features(again)
    assert np.allclose(again.mb_time_s, phi @ fb.cost_model.time_coef)  # planned with the refit model
    ratio = again.mb_time_s / (phi @ fb.prior)
    assert 1.5 < float(np.median(ratio)) < 2.5  # ~2x slower than the prior, as measured


def test_packed_plans_need_shapes_for_features():
    rng = np.random.default_rng(4)
    cm = CostModel(CFG, device_preset("cpu"))
    shapes = Shapes.from_lengths(input_tokens=rng.integers(4, 200, 32), target_tokens=np.zeros(32, int))
    plan = plan_microbatches(shapes, cm, num_stages=2, method="dp_varlen", max_len=256)
    fb = FeedbackLoop(cm)
    with pytest.raises(ValueError, match="Shapes"):
        fb.features(plan)
    phi = fb.features(plan, shapes)
    assert np.allclose(cm.time(phi), plan.mb_time_s)


def test_profiled_table_is_superseded_by_measurements():
    from dynabatch import ProfiledTable

    cm = model()
    table = ProfiledTable(np.array([1, 8]), np.array([8, 256]), np.array([0]), np.full((2, 2, 1), 1e-3),
                          np.full((2, 2, 1), 1e6), extrapolate=True)
    prof = CostModel.profiled(table, CFG, device_preset("cpu"))
    fb = FeedbackLoop(prof, refit_every=1)
    rng = np.random.default_rng(5)
    fb.record(*measure(rng, cm, TRUE_A))
    fb.maybe_refit()
    assert prof.table is None
    with pytest.raises(ValueError):
        FeedbackLoop(cm, forgetting=0.0)
