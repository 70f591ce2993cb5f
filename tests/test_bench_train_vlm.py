"""``bench train --model vlm-tiny``'s per-stage MAPE: which micro-batches a stage computes on, the split
figures, their noise floor, the table lines, and dp's per-stage feedback keywords."""

import math

import numpy as np
import pytest

from dynabatch.bench.train_vlm import (VLM_SIZES, feedback_kwargs, modality_bounds, stage_computes,
                                       stage_mape_floor, stage_split, stage_step_mape, uniform_vlm_bounds,
                                       vlm_stats)
from dynabatch.core.plan.feedback import FeedbackLoop
from dynabatch.pipeline import make_model, stage_cost_model


@pytest.fixture(scope="module")
def vlm():
    m = make_model("vlm-tiny", **VLM_SIZES, seed=0)
    return m, stage_cost_model(m, 2, "cpu")


def test_the_vision_stage_passes_text_only_microbatches_through(vlm):
    m, cost = vlm
    phi = cost.padded_features([4, 4, 2], [64, 64, 128], 0, [0, 3, 0])
    split = stage_computes(m, modality_bounds(m, 2), phi)
    assert split.tolist() == [[False, True, False], [True, True, True]]
    # 3 uniform stages: the merge embedding joins the last ViT blocks and the projector on stage 1,
    # which then computes on every micro-batch; stage 0 (patch embedding, 2 ViT blocks) does not
    assert uniform_vlm_bounds(m, 3) == [0, 3, 7, 10]
    assert stage_computes(m, [0, 3, 7, 10], phi).tolist() == [[False, True, False], [True] * 3, [True] * 3]


def test_stage_split_and_its_shares():
    pred = [np.array([[1.0, 2.0, 1.0], [10.0, 10.0, 10.0]])]
    meas = [np.array([[2.0, 2.0, 0.5], [10.0, 8.0, 10.0]])]
    comp = [np.array([[False, True, False], [True, True, True]])]
    out = stage_split(pred, meas, comp)
    assert out["compute"] == [0.0, pytest.approx(0.25 / 3)]
    assert out["passthrough"][0] == pytest.approx((0.5 + 1.0) / 2) and math.isnan(out["passthrough"][1])
    assert out["passthrough_share"] == [pytest.approx(2 / 3), 0.0]
    assert out["passthrough_time_share"] == [pytest.approx(2.5 / 4.5), 0.0]
    assert stage_split([], [], [])["compute"] == []


def test_per_step_stage_mape_scores_each_steps_sums():
    # stage 0: step sums 3 vs 4.5 (|3 - 4.5| / 4.5) and 2 vs 2; stage 1: 30 vs 28, 4 vs 5
    pred = [np.array([[1.0, 2.0, 0.0], [10.0, 10.0, 10.0]]), np.array([[1.0, 1.0], [2.0, 2.0]])]
    meas = [np.array([[2.0, 2.0, 0.5], [10.0, 8.0, 10.0]]), np.array([[0.5, 1.5], [3.0, 2.0]])]
    assert stage_step_mape(pred, meas) == [pytest.approx((1.5 / 4.5 + 0) / 2), pytest.approx((2 / 28 + 1 / 5) / 2)]
    assert stage_step_mape([], []) == []
    # per micro-batch, the same steps score differently: the sums average the micro-batch errors out
    comp = [np.ones((2, 3), bool), np.ones((2, 2), bool)]
    phis = [np.eye(3), np.eye(3)[:2]]
    out = vlm_stats(pred, meas, comp, phis, first=1, last=1, warmup=0)
    assert out["stage_step_mape_start"] == [pytest.approx(1.5 / 4.5), pytest.approx(2 / 28)]
    assert out["stage_step_mape_end"] == [0.0, pytest.approx(1 / 5)]
    assert out["stage_mape_end"] == [pytest.approx((1 + 1 / 3) / 2), pytest.approx((1 / 3 + 0) / 2)]
    assert out["stage_measured_s"] == [6.5, 33.0]


def test_bypassed_microbatches_are_not_observations():
    """A measured 0 s is a micro-batch the stage never ran (bypassed): left out of every per-stage
    figure (no prediction to score), counted in ``bypassed_share``."""
    from dynabatch.bench.train_vlm import stage_mape

    pred = [np.array([[1.0, 0.2, 2.0, 0.2], [4.0, 4.0, 4.0, 4.0]])]
    meas = [np.array([[2.0, 0.0, 2.0, 0.0], [4.0, 5.0, 4.0, 2.0]])]
    comp = [np.array([[True, False, True, False], [True] * 4])]
    assert stage_mape(pred, meas) == [pytest.approx(0.25), pytest.approx((0.2 + 1.0) / 4)]
    out = stage_split(pred, meas, comp)
    assert out["compute"][0] == pytest.approx(0.25) and math.isnan(out["passthrough"][0])
    assert out["bypassed_share"] == [0.5, 0.0] and out["passthrough_share"] == [0.0, 0.0]
    assert stage_step_mape(pred, meas) == [pytest.approx(1 / 4), pytest.approx(1 / 15)]  # 3 vs 4; 16 vs 15
    floor = stage_mape_floor([np.zeros((4, 2))], meas, comp)  # one feature row: the ran ones repeat
    assert math.isnan(floor["compute"][0]) and math.isnan(floor["passthrough"][0])  # 2 < 3 repeats


def test_stage_mape_floor_is_the_spread_of_identical_microbatches():
    # 4 identical micro-batches (feature row a) and 2 of row b (too few repeats for a floor)
    a, b = np.r_[1.0, 2.0], np.r_[3.0, 4.0]
    phis = [np.array([a, a, b]), np.array([a, b, a])]
    meas = [np.array([[1.0, 1.2, 5.0], [1.0, 1.0, 1.0]]), np.array([[0.9, 7.0, 1.1], [2.0, 9.0, 1.0]])]
    comp = [np.array([[True, True, True], [True, True, True]])] * 2
    floor = stage_mape_floor(phis, meas, comp)
    med = np.median([1.0, 1.2, 0.9, 1.1])
    want = np.mean([abs(med - v) / v for v in (1.0, 1.2, 0.9, 1.1)])
    assert floor["compute"][0] == pytest.approx(want)
    assert floor["compute"][1] == pytest.approx(np.mean([0, 0, 1 / 2, 0]))  # median 1.0 of 1, 1, 2, 1
    assert all(math.isnan(x) for x in floor["passthrough"])  # no pass-through micro-batch at all


def test_dp_refits_per_stage_with_the_layouts_zeros_free(vlm):
    kw, mode = feedback_kwargs("dp")
    assert mode == "per_stage" and kw == {"stage_reduce": "per_stage", "fit_layout_zeros": True}
    assert feedback_kwargs("dp-blind") == ({"stage_reduce": "max"}, "max")
    FeedbackLoop(vlm[1], **kw)  # the loop takes them


def test_the_table_prints_the_split_per_stage():
    from dynabatch.bench.train_report import _stage_lines

    m = {"stage_compute_mape_start": [0.6, 0.7], "stage_compute_mape_end": [0.12, 0.05],
         "stage_compute_mape_floor": [0.1, float("nan")], "stage_passthrough_share": [0.7, 0.0],
         "stage_passthrough_time_share": [0.05, 0.0], "stage_passthrough_mape_start": [4.0, float("nan")],
         "stage_passthrough_mape_end": [0.2, float("nan")], "stage_passthrough_mape_floor": [0.17, float("nan")]}
    (line,) = _stage_lines("dp", m)
    assert "s0 computing 60.0% -> 12.0% (floor 10.0%)" in line
    assert "pass-through (70% of its micro-batches, 5.0% of its seconds) 400.0% -> 20.0% (floor 17.0%)" in line
    assert "s1 computing 70.0% -> 5.0% (floor -)" in line and line.count("pass-through") == 1
    assert "per-step" not in line
    (line,) = _stage_lines("dp", {**m, "stage_step_mape_start": [0.5, 0.4], "stage_step_mape_end": [0.03, 0.02]})
    assert line.endswith("; per-step sums 50.0%/40.0% -> 3.0%/2.0%")
    assert _stage_lines("pack", {"stage_mape_end": [0.1, 0.1]}) == []


def test_size_overrides_name_the_models_keywords():
    """``bench train --size NAME=INT``: the model's constructor sizes only (vlm-tiny's tiling is the
    loader's vision policy), integers >= 1; a bad one is an error naming what the model takes."""
    from dynabatch.bench.train_command import model_size_overrides
    from dynabatch.cli import main

    assert model_size_overrides("vlm-tiny", ["vision_hidden=128", "vision_layers=8"]) == \
        {"vision_hidden": 128, "vision_layers": 8}
    assert model_size_overrides("t5-tiny", ["encoder_layers=3"]) == {"encoder_layers": 3}
    assert model_size_overrides("gpt-tiny", []) == {}
    for bad, text in ((["tile_size=28"], "vision_layers"), (["layers=two"], "not an integer"),
                      (["layers"], "NAME=INT"), (["layers=0"], "at least 1")):
        with pytest.raises(ValueError, match=text):
            model_size_overrides("vlm-tiny" if "tile" in bad[0] else "gpt-tiny", bad)
    with pytest.raises(ValueError, match="decoder_layers"):
        model_size_overrides("t5-tiny", ["vision_layers=2"])
    assert main(["bench", "train", "--model", "vlm-tiny", "--size", "bogus=3", "--steps", "1"]) == 1
    assert main(["bench", "multimodel", "--size", "vision_layers=2"]) == 2  # gpt-tiny has no vision tower
    assert main(["bench", "train", "--bypass-idle-stages", "--flush-free", "--steps", "1"]) == 1
