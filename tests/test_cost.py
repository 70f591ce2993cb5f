"""CostModel: features by hand, presets, memory limits, ProfiledTable, refit, persistence."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dynabatch import Shapes
from dynabatch.core.cost.model import (
    DEVICE_PRESETS,
    FEATURES,
    MODEL_PRESETS,
    NUM_FEATURES,
    CostModel,
    ProfiledTable,
    device_preset,
    model_preset,
)
from dynabatch.core.plan.planner import PlanningError, plan_microbatches
from dynabatch.core.plan.feedback import FeedbackLoop

F = {name: k for k, name in enumerate(FEATURES)}


# ----------------------------------------------------------------------------- features by hand


def test_feature_names():
    assert FEATURES == ("n_main", "q_main", "n_dec", "q_dec", "x_dec", "n_vis", "q_vis", "one", "has_vis", "q_pad")
    assert NUM_FEATURES == 10


def test_padded_vs_packed_features_two_samples():
    cm = CostModel.preset("gpt")  # pad_multiple 8
    assert cm.pad_multiple == 8
    padded = cm.padded_features(2, 30, 0, 0)[0]  # 2 rows padded to the longest (30 -> 32)
    assert padded[F["n_main"]] == 2 * 32
    assert padded[F["q_main"]] == 2 * 32 * 32
    assert padded[F["one"]] == 1 and padded[F["has_vis"]] == 0
    assert np.all(padded[[F["n_dec"], F["q_dec"], F["x_dec"], F["n_vis"], F["q_vis"]]] == 0)
    packed = cm.packed_features(np.array([10, 30]), np.zeros(2), np.zeros(2), np.zeros(2, np.int64))[0]
    assert packed[F["n_main"]] == 40
    assert packed[F["q_main"]] == 10 * 10 + 30 * 30
    assert packed[F["one"]] == 1
    # costs are the coefficient dot products, and packing is cheaper than padding
    t_pad, m_pad = cm.padded(2, 30)
    t_pack, m_pack = cm.packed(np.array([10, 30]), np.zeros(2), np.zeros(2), np.zeros(2, np.int64))
    assert t_pad[0] == pytest.approx(cm.time_coef @ padded, rel=1e-15)
    assert m_pad[0] == pytest.approx(cm.mem_coef @ padded, rel=1e-15)
    assert t_pack[0] == pytest.approx(cm.time_coef @ packed, rel=1e-15)
    assert t_pack[0] < t_pad[0] and m_pack[0] < m_pad[0]
    # pad_multiple 1: no rounding
    raw = CostModel.preset("gpt", pad_multiple=1).padded_features(2, 30, 0, 0)[0]
    assert raw[F["n_main"]] == 60 and raw[F["q_main"]] == 2 * 900


def test_packed_features_group_by_id():
    cm = CostModel.preset("t5")
    phi = cm.packed_features(np.array([3, 5, 7]), np.array([1, 2, 4]), np.zeros(3), np.array([1, 0, 1]))
    assert phi.shape == (2, NUM_FEATURES)
    np.testing.assert_array_equal(phi[0, :5], [5, 25, 2, 4, 10])
    np.testing.assert_array_equal(phi[1, :5], [10, 9 + 49, 5, 1 + 16, 3 * 1 + 7 * 4])


def test_t5_sample_dims_and_cross_term():
    cm = CostModel.preset("t5")
    assert cm.kind == "encoder_decoder"
    sh = Shapes.from_lengths(np.array([10, 33]), np.array([5, 20]))
    main, dec, tiles = cm.sample_dims(sh)
    np.testing.assert_array_equal(main, [10, 33])  # encoder = input
    np.testing.assert_array_equal(dec, [5, 20])  # decoder = target
    np.testing.assert_array_equal(tiles, [0, 0])
    padded = cm.padded_features(2, 33, 20, 0)[0]  # L 33 -> 40, T 20 -> 24
    assert padded[F["n_main"]] == 2 * 40 and padded[F["n_dec"]] == 2 * 24
    assert padded[F["q_dec"]] == 2 * 24 * 24
    assert padded[F["x_dec"]] == 2 * 24 * 40
    packed = cm.packed_features(main, dec, tiles, np.zeros(2, np.int64))[0]
    assert packed[F["x_dec"]] == 10 * 5 + 33 * 20
    assert packed[F["q_dec"]] == 25 + 400
    # the cross term is priced: doubling the decoder length of a long input costs more than the
    # decoder self-attention alone would explain
    assert cm.time_coef[F["x_dec"]] > 0 and cm.mem_coef[F["n_dec"]] > 0
    # decoder-only: target tokens join the main stack
    g_main, g_dec, _ = CostModel.preset("gpt").sample_dims(sh)
    np.testing.assert_array_equal(g_main, [15, 53])
    np.testing.assert_array_equal(g_dec, [0, 0])


def test_vlm_tiles_are_ceil_of_vision_tokens_over_256():
    cm = CostModel.preset("vlm")
    assert cm.model.tile_tokens == 256 and cm.model.tile_patches == 1025
    vis = np.array([0, 1, 255, 256, 257, 512, 513, 2048])
    sh = Shapes.from_lengths(np.full(len(vis), 20), np.full(len(vis), 3), vis)
    main, dec, tiles = cm.sample_dims(sh)
    np.testing.assert_array_equal(tiles, [0, 1, 1, 1, 2, 2, 3, 8])
    np.testing.assert_array_equal(main, 23 + vis)  # the LLM sees text and vision tokens
    np.testing.assert_array_equal(dec, 0)
    phi = cm.padded_features(1, 23, 0, 3)[0]
    assert phi[F["n_vis"]] == 3 * 1025 and phi[F["q_vis"]] == 3 * 1025 * 1025 and phi[F["has_vis"]] == 1
    assert cm.padded_features(1, 23, 0, 0)[0][F["has_vis"]] == 0
    # the ViT's fixed cost is only paid with tiles
    assert cm.padded(1, 23, 0, 1)[0][0] - cm.padded(1, 23, 0, 0)[0][0] >= cm.time_coef[F["has_vis"]]


def test_max_len_truncates_main_and_target():
    cm = CostModel.preset("t5")
    sh = Shapes.from_lengths(np.array([10, 3000]), np.array([700, 5]))
    main, dec, _ = cm.sample_dims(sh, max_len=512, max_target_len=128)
    np.testing.assert_array_equal(main, [10, 512])
    np.testing.assert_array_equal(dec, [128, 5])


@pytest.mark.parametrize("preset", MODEL_PRESETS)
def test_time_and_memory_monotone_in_rows_and_length(preset):
    cm = CostModel.preset(preset)
    rows = np.arange(1, 33)
    lens = np.arange(1, 4097, 37)
    dec = 64 if preset == "t5" else 0
    tiles = 2 if preset == "vlm" else 0
    t, m = cm.padded(rows[:, None], lens[None, :], dec, tiles)
    t = t.reshape(len(rows), len(lens))
    m = m.reshape(len(rows), len(lens))
    assert np.all(np.diff(t, axis=0) > 0)  # strictly more time with more rows
    assert np.all(np.diff(t, axis=1) >= 0)  # never less with a longer sequence
    assert t[0, -1] > t[0, 0]
    assert np.all(np.diff(m, axis=0) >= 0) and np.all(np.diff(m, axis=1) >= 0)
    assert np.all(np.isfinite(t)) and np.all(t > 0)
    if preset == "t5":
        td, _ = cm.padded(4, 512, np.arange(0, 1024, 8))
        assert np.all(np.diff(td) > 0)
    if preset == "vlm":
        tv, _ = cm.padded(4, 512, 0, np.arange(0, 12))
        assert np.all(np.diff(tv) > 0)


# ----------------------------------------------------------------------------- presets


def test_preset_names():
    assert set(MODEL_PRESETS) == {"gpt", "t5", "vlm"}
    assert set(DEVICE_PRESETS) == {"a100-80gb", "a100-40gb", "h100", "h200", "cpu"}
    for name in MODEL_PRESETS:
        assert model_preset(name).name == name
        for dev in DEVICE_PRESETS:
            cm = CostModel.preset(name, dev)
            assert cm.model.name == name and cm.device.name == dev
            assert np.all(cm.time_coef >= 0) and np.all(cm.mem_coef >= 0)
    assert CostModel.preset("gpt").kind == "decoder"
    assert CostModel.preset("t5").kind == "encoder_decoder"
    assert CostModel.preset("vlm").kind == "vision_language"
    # a faster device is faster
    assert CostModel.preset("gpt", "h100").padded(8, 1024)[0][0] < CostModel.preset("gpt", "a100-80gb").padded(8, 1024)[0][0]


def test_unknown_names_raise_value_error_listing_valid_ones():
    with pytest.raises(ValueError) as e:
        model_preset("bert")
    assert "bert" in str(e.value) and all(n in str(e.value) for n in MODEL_PRESETS)
    with pytest.raises(ValueError) as e:
        device_preset("tpu-v5")
    assert "tpu-v5" in str(e.value) and all(n in str(e.value) for n in DEVICE_PRESETS)
    with pytest.raises(ValueError, match="bert"):
        CostModel.preset("bert")
    with pytest.raises(ValueError, match="h100"):
        CostModel.preset("gpt", "v100")


@pytest.mark.parametrize("preset", MODEL_PRESETS)
def test_default_memory_limit_is_positive(preset):
    cm = CostModel.preset(preset, "a100-80gb", num_stages=4)
    limit = cm.memory_limit(4, 8)
    assert 0 < limit < cm.device.memory_bytes / 4
    # more ranks shard the optimizer state: more room; more stages in flight: less per micro-batch
    assert cm.memory_limit(4, 16) > limit > cm.memory_limit(8, 8)
    # a single ordinary sample fits
    assert cm.padded(1, 2048, 256 if preset == "t5" else 0, 1 if preset == "vlm" else 0)[1][0] < limit


def test_memory_limit_refuses_when_state_does_not_fit():
    cm = CostModel.preset("vlm", "a100-80gb", num_stages=1)
    with pytest.raises(ValueError, match="does not fit"):
        cm.memory_limit(1, 1)


# ----------------------------------------------------------------------------- ProfiledTable


def make_table(extrapolate=False):
    rows = np.array([1.0, 2.0, 4.0])
    main = np.array([8.0, 16.0, 32.0])
    dec = np.array([0.0])
    r, l = np.meshgrid(rows, main, indexing="ij")
    t = (0.5 + r * l + 0.01 * r * l * l)[:, :, None]  # deliberately non-linear in the grid
    m = (1000.0 * r * l)[:, :, None]
    return ProfiledTable(rows, main, dec, t, m, extrapolate=extrapolate)


def test_profiled_table_exact_at_grid_points():
    tab = make_table()
    for i, r in enumerate(tab.rows):
        for j, l in enumerate(tab.main_len):
            t, m = tab.lookup(r, l, 0)
            assert t == tab.time_s[i, j, 0] and m == tab.memory_bytes[i, j, 0]


def test_profiled_table_linear_between_grid_points():
    tab = make_table()
    # along main_len between 16 and 32 at rows=2
    for l in (17, 20, 24, 31):
        w = (l - 16) / 16
        t, _ = tab.lookup(2, l, 0)
        assert t == pytest.approx((1 - w) * tab.time_s[1, 1, 0] + w * tab.time_s[1, 2, 0], rel=1e-12)
    # along rows between 2 and 4 at main_len=8
    t, m = tab.lookup(3, 8, 0)
    assert t == pytest.approx(0.5 * (tab.time_s[1, 0, 0] + tab.time_s[2, 0, 0]), rel=1e-12)
    assert m == pytest.approx(0.5 * (tab.memory_bytes[1, 0, 0] + tab.memory_bytes[2, 0, 0]), rel=1e-12)
    # bilinear in the middle of a cell
    t, _ = tab.lookup(3, 24, 0)
    assert t == pytest.approx(tab.time_s[1:3, 1:3, 0].mean(), rel=1e-12)
    # vectorized
    t, m = tab.lookup(np.array([1, 3]), np.array([8, 24]), 0)
    assert t.shape == (2,) and t[0] == tab.time_s[0, 0, 0]


def test_profiled_table_outside_grid_is_infeasible_unless_extrapolate():
    tab = make_table()
    for r, l, d in ((8, 16, 0), (2, 64, 0), (2, 4, 0), (0, 16, 0), (2, 16, 8)):
        t, m = tab.lookup(r, l, d)
        assert t == np.inf and m == np.inf, (r, l, d)
    ext = make_table(extrapolate=True)
    t, m = ext.lookup(8, 16, 0)  # linear from the rows 2..4 edge cell, at least the edge's time in proportion
    linear = ext.time_s[2, 1, 0] + 2 * (ext.time_s[2, 1, 0] - ext.time_s[1, 1, 0])
    proportional = ext.time_s[2, 1, 0] * 8 / ext.rows[-1]
    assert np.isfinite(t) and t == pytest.approx(max(linear, proportional), rel=1e-12)
    t, _ = ext.lookup(2, 64, 0)  # linear, but never below the edge's time in proportion to the length
    linear = ext.time_s[1, 2, 0] + 2 * (ext.time_s[1, 2, 0] - ext.time_s[1, 1, 0])
    proportional = ext.time_s[1, 2, 0] * 64 / ext.main_len[-1]
    assert t == pytest.approx(max(linear, proportional), rel=1e-12)


def test_profiled_table_validates_grid():
    tab = make_table()
    with pytest.raises(ValueError, match="increasing"):
        ProfiledTable(np.array([2.0, 1.0]), tab.main_len, tab.dec_len, tab.time_s[:2], tab.memory_bytes[:2])
    with pytest.raises(ValueError, match="shape"):
        ProfiledTable(tab.rows, tab.main_len, tab.dec_len, tab.time_s[:2], tab.memory_bytes)


def analytic_table(cm, max_rows=64, max_len=4096):
    rows = np.array([1, 2, 4, 8, 16, 32, 64], float)
    rows = rows[rows <= max_rows]
    main = 2.0 ** np.arange(3, int(np.log2(max_len)) + 1)
    dec = np.array([0.0])
    r, l = np.meshgrid(rows, main, indexing="ij")
    t, m = cm.padded(r.ravel(), l.ravel(), 0)
    return ProfiledTable(rows, main, dec, t.reshape(r.shape)[:, :, None], m.reshape(r.shape)[:, :, None])


def test_profiled_cost_model_plans_with_dp():
    ana = CostModel.preset("gpt")
    tab = analytic_table(ana)
    cm = CostModel.profiled(tab, model_preset("gpt"), device_preset("a100-80gb"))
    assert cm.table is tab and "profiled" in repr(cm)
    # the packed fit reproduces the (linear) analytic model it was measured from
    np.testing.assert_allclose(cm.time_coef, ana.time_coef, rtol=1e-3, atol=0)
    rng = np.random.default_rng(0)
    sh = Shapes.from_lengths(np.clip(rng.lognormal(5.5, 1.0, 200), 1, 4096).astype(int))
    limit = ana.memory_limit(4, 4)
    plan = plan_microbatches(sh, cm, num_stages=4, num_ranks=4, method="dp", memory_limit=limit)
    np.testing.assert_array_equal(np.sort(plan.sample_ids), np.sort(sh.sample_id))
    assert np.all(plan.mb_rows <= 64) and np.all(plan.mb_input_len <= 4096)
    t, m = tab.lookup(plan.mb_rows, plan.mb_input_len, plan.mb_target_len)
    np.testing.assert_array_equal(plan.mb_time_s, t)  # costs come from the table
    np.testing.assert_array_equal(plan.mb_memory_bytes, m)
    assert np.all(np.isfinite(plan.mb_time_s)) and np.all(plan.mb_memory_bytes <= limit)
    assert plan.microbatches_per_rank().min() == plan.microbatches_per_rank().max()
    # interpolating a convex cost over-estimates it: never cheaper than the analytic plan
    ref = plan_microbatches(sh, ana, num_stages=4, num_ranks=4, method="dp", memory_limit=limit)
    assert plan.objective_s >= ref.objective_s * (1 - 1e-9)
    # varlen planning uses the fitted linear coefficients
    pv = plan_microbatches(sh, cm, num_stages=4, num_ranks=4, method="dp_varlen", memory_limit=limit)
    np.testing.assert_array_equal(np.sort(pv.sample_ids), np.sort(sh.sample_id))


def _beyond_grid():
    cm = CostModel.profiled(analytic_table(CostModel.preset("gpt"), max_len=1024), model_preset("gpt"),
                            device_preset("a100-80gb"))
    sh = Shapes.from_lengths(np.array([100, 200, 5000, 300]), sample_id=np.array([7, 8, 9, 10]))
    return cm, sh


def test_profiled_sample_beyond_the_grid_is_a_planning_error():
    cm, sh = _beyond_grid()
    with pytest.raises(PlanningError, match=r"sample_id 9\b"):
        plan_microbatches(sh, cm, num_stages=2, method="dp", memory_limit=1e15)


def test_profiled_sample_beyond_the_grid_error_says_why():
    cm, sh = _beyond_grid()
    with pytest.raises(PlanningError) as e:
        plan_microbatches(sh, cm, num_stages=2, method="dp", memory_limit=1e15)
    msg = str(e.value).lower()
    assert "sample_id 9" in msg and "profiled" in msg
    assert "over the memory limit" not in msg  # the fitted memory is far below 1e15


# ----------------------------------------------------------------------------- observe / refit


def random_microbatches(cm, rng, n, spread):
    """Feature rows of padded micro-batches: ``large`` (8-64 rows of 512-4096 tokens) or ``wide``
    (1-64 rows of 8-4096 tokens, log-uniform: the small micro-batches dynamic batching makes too)."""
    if spread == "large":
        rows = rng.integers(8, 65, n)
        L = rng.integers(512, 4097, n)
    else:
        rows = np.exp(rng.uniform(0, np.log(64), n)).astype(int)
        L = np.exp(rng.uniform(np.log(8), np.log(4096), n)).astype(int)
    T = rng.integers(0, 512, n) if cm.kind == "encoder_decoder" else 0
    return cm.padded_features(rows, L, T, 0)


def true_coef(cm):
    c = cm.prior_time_coef.copy()
    c[F["n_main"]] *= 1.5
    c[F["one"]] *= 0.7
    return c


def _refit_mape(preset, spread, seed=0):
    cm = CostModel.preset(preset)
    rng = np.random.default_rng(seed)
    true = true_coef(cm)
    train = random_microbatches(cm, rng, 300, spread)
    held = random_microbatches(cm, rng, 200, spread)
    prior_mape = cm.mape(held, held @ true)
    fb = FeedbackLoop(cm, forgetting=cm.forgetting)  # the one refit path
    for k in range(0, 300, 30):  # ten steps of observations
        fb.record(train[k:k + 30], train[k:k + 30] @ true)
    assert fb.num_observations == 300
    row = fb.refit()
    np.testing.assert_array_equal(row.time_coef, cm.time_coef)
    assert cm.version == row.version == 1
    return cm, prior_mape, cm.mape(held, held @ true)


@pytest.mark.parametrize("preset", ["gpt", "t5"])
def test_refit_learns_a_different_true_model(preset):
    cm, prior_mape, refit_mape = _refit_mape(preset, "large")
    assert prior_mape > 0.1
    assert refit_mape < 0.02
    assert "refit" in repr(cm)
    assert cm.time_coef[F["n_main"]] == pytest.approx(1.5 * cm.prior_time_coef[F["n_main"]], rel=0.1)


@pytest.mark.parametrize("preset", ["gpt", "t5"])
def test_refit_learns_the_fixed_cost_from_small_and_large_micro_batches(preset):
    cm, prior_mape, refit_mape = _refit_mape(preset, "wide")
    assert prior_mape > 0.1
    assert refit_mape < 0.02
    assert cm.time_coef[F["one"]] == pytest.approx(0.7 * cm.prior_time_coef[F["one"]], rel=0.1)


@pytest.mark.parametrize("preset", ["gpt", "t5"])
def test_refit_on_large_micro_batches_does_not_spoil_small_ones(preset):
    cm, _, refit_mape = _refit_mape(preset, "large")
    assert refit_mape < 0.02  # the observed regime is fitted well ...
    small = cm.padded_features(1, np.arange(8, 257, 8), 16 if preset == "t5" else 0, 0)
    truth = small @ true_coef(cm)
    prior_small = float(np.mean(np.abs(small @ cm.prior_time_coef - truth) / truth))
    assert cm.mape(small, truth) <= prior_small  # ... and extrapolation is no worse than the prior
    ratio = cm.time_coef / np.where(cm.prior_time_coef > 0, cm.prior_time_coef, 1)
    assert np.all(ratio[cm.prior_time_coef > 0] < 3) and np.all(ratio[cm.prior_time_coef > 0] > 0.3)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_deprecated_observe_validates_and_refit_needs_observations():
    cm = CostModel.preset("gpt")
    with pytest.raises(ValueError, match="observe"):
        cm.refit()
    phi = cm.padded_features(2, 128, 0, 0)
    with pytest.raises(ValueError):
        cm.observe(phi, [1.0, 2.0])  # shape mismatch
    with pytest.raises(ValueError):
        cm.observe(phi, [-1.0])
    with pytest.raises(ValueError):
        cm.observe(phi, [np.nan])
    assert cm.num_observations == 0
    with pytest.raises(ValueError, match="observations"):
        FeedbackLoop(cm).refit()


def test_deprecated_observe_and_refit_warn_and_match_the_feedback_loop():
    old, new = CostModel.preset("t5"), CostModel.preset("t5")
    fb = FeedbackLoop(new, forgetting=new.forgetting, prior_strength=new.prior_strength, min_weight=1e-6)
    rng = np.random.default_rng(3)
    for _ in range(4):
        phi = random_microbatches(old, rng, 30, "wide")
        with pytest.warns(DeprecationWarning, match="FeedbackLoop"):
            old.observe(phi, phi @ true_coef(old))
        fb.record(phi, phi @ true_coef(new))
    with pytest.warns(DeprecationWarning, match="FeedbackLoop"):
        coef = old.refit()
    fb.refit()
    np.testing.assert_array_equal(coef, new.time_coef)
    assert old.version == new.version == 1 and "refit" in repr(old)


def test_refit_follows_drift():
    """Observations are discounted by `forgetting` per call: after the truth changes, new
    observations dominate."""
    cm = CostModel.preset("gpt")
    fb = FeedbackLoop(cm, forgetting=0.5)
    rng = np.random.default_rng(1)
    old = cm.prior_time_coef * 1.3
    new = cm.prior_time_coef * 0.8
    for _ in range(5):
        phi = random_microbatches(cm, rng, 20, "large")
        fb.record(phi, phi @ old)
    for _ in range(10):
        phi = random_microbatches(cm, rng, 20, "large")
        fb.record(phi, phi @ new)
    fb.refit()
    held = random_microbatches(cm, rng, 50, "large")
    assert cm.mape(held, held @ new) < 0.03


# ----------------------------------------------------------------------------- save / load


@pytest.mark.parametrize("kind", ["analytic", "refit", "profiled"])
def test_save_load_round_trip(tmp_path, kind):
    if kind == "profiled":
        cm = CostModel.profiled(make_table(), model_preset("gpt"), device_preset("h100"), pad_multiple=4)
    else:
        cm = CostModel.preset("t5", "h200", pad_multiple=16)
    if kind == "refit":
        rng = np.random.default_rng(0)
        phi = random_microbatches(cm, rng, 50, "large")
        fb = FeedbackLoop(cm)
        fb.record(phi, phi @ true_coef(cm))
        fb.refit()
        assert not np.array_equal(cm.time_coef, cm.prior_time_coef)
    path = tmp_path / "cost.json"
    cm.save(path)
    back = CostModel.load(path)
    assert back.model == cm.model and back.device == cm.device
    assert back.pad_multiple == cm.pad_multiple
    np.testing.assert_array_equal(back.time_coef, cm.time_coef)
    np.testing.assert_array_equal(back.mem_coef, cm.mem_coef)
    rng = np.random.default_rng(5)
    phi = random_microbatches(cm, rng, 40, "wide")
    np.testing.assert_array_equal(back.time(phi), cm.time(phi))
    np.testing.assert_array_equal(back.memory(phi), cm.memory(phi))
    rows, L = rng.integers(1, 5, 20), rng.integers(1, 40, 20)
    for a, b in zip(back.padded(rows, L, 0), cm.padded(rows, L, 0)):
        np.testing.assert_array_equal(a, b)
    if kind == "profiled":
        np.testing.assert_array_equal(back.table.time_s, cm.table.time_s)
        assert back.table.extrapolate == cm.table.extrapolate


@pytest.mark.parametrize("content", [b"hello, not json", b"{\"format\": \"dynabatch.cost_model\"}", b"{"])
def test_load_garbage_raises_value_error_naming_path(tmp_path, content):
    path = tmp_path / "garbage.json"
    path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        CostModel.load(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n\x00\xff\xfe", b"[1, 2, 3]", b"{\"format\": \"other\"}"],
                         ids=["binary", "json-list", "other-format"])
def test_load_other_garbage_raises_value_error_naming_path(tmp_path, content):
    path = tmp_path / "garbage.json"
    path.write_bytes(content)
    with pytest.raises(ValueError) as e:
        CostModel.load(path)
    assert str(path) in str(e.value)


def test_to_dict_is_json_and_tagged():
    d = CostModel.preset("vlm").to_dict()
    assert d["format"] == "dynabatch.cost_model" and d["version"] == 1
    json.dumps(d)
    with pytest.raises(ValueError, match="format"):
        CostModel.from_dict({**d, "format": "x"})
