"""Per-stage costs (`dynabatch.core.cost.stages`) and the planner's per-stage path
(`dynabatch.core.plan.stage_plan`)."""

import dataclasses

import numpy as np
import pytest

from dynabatch.core.cost.model import CostModel
from dynabatch.core.plan.planner import plan_microbatches
from dynabatch.shape_sources import synthetic_shapes
from dynabatch.core.shapes import Shapes
from dynabatch.core.simulate.pipeline import simulate_pipeline
from dynabatch.core.plan.stage_plan import evaluate_plan
from dynabatch.core.cost.stages import StageLayout, stage_scale

S = 4


@pytest.fixture(scope="module")
def vis():
    return synthetic_shapes("vision", 300, seed=1)[0]


@pytest.fixture(scope="module")
def mix(vis):
    txt = synthetic_shapes("text", 300, seed=2)[0]
    txt = Shapes(txt.sample_id + 10**6, txt.input_tokens, txt.target_tokens, txt.vision_tokens, txt.task_id)
    return Shapes.concat([vis, txt])


@pytest.fixture(scope="module")
def costs():
    return CostModel.preset("vlm", num_stages=S), CostModel.preset("vlm", num_stages=S, layout="contiguous")


def _phi(cost, shapes):
    main, dec, tiles = cost.sample_dims(shapes)
    return cost.packed_features(main, dec, tiles, np.arange(len(main)) // 4)


def test_uniform_layout_is_todays_model(costs, vis):
    uni, _ = costs
    assert uni.layout is None and not uni.stage_aware
    ts, ms = stage_scale(uni.model, StageLayout.uniform(uni.model, S))
    assert np.all(ts == 1.0) and np.all(ms == 1.0)
    assert CostModel.preset("vlm", num_stages=S).set_layout(StageLayout.uniform(uni.model, S)).layout is None
    phi = _phi(uni, vis)
    st = uni.stage_times(phi)
    assert st.shape == (S, len(phi)) and np.all(st == uni.time(phi)[None, :])
    kw = dict(num_stages=S, num_ranks=4, max_len=8192)
    for method in ("dp", "dp_varlen", "token_budget"):
        a = plan_microbatches(vis, CostModel.preset("vlm", num_stages=S), method=method, **kw)
        b = plan_microbatches(vis, CostModel.preset("vlm", num_stages=S, layout="uniform"), method=method, **kw)
        assert a.stage_time_s is None and a.fingerprint() == b.fingerprint()
        assert np.array_equal(a.rank_time_s, b.rank_time_s) and a.options == b.options


def test_contiguous_layout_vision_first(costs):
    uni, con = costs
    lay = con.layout
    assert lay.num_stages == S and sum(lay.vision_layers) == 45 and sum(lay.main_layers) == 48
    vis_stages = np.flatnonzero(np.array(lay.vision_layers) > 0)
    assert vis_stages[0] == 0 and np.all(np.diff(vis_stages) == 1)  # contiguous, first
    assert lay.embedding[0] and lay.lm_head[-1]
    d = con.to_dict()
    assert CostModel.from_dict(d).layout == lay
    assert CostModel.from_dict(uni.to_dict()).layout is None


def test_contiguous_costs_redistribute_the_same_work(costs, mix):
    uni, con = costs
    phi = _phi(con, mix)
    st = con.stage_times(phi)
    # the same total work, redistributed over the stages
    np.testing.assert_allclose(st.sum(axis=0), S * uni.time(phi), rtol=1e-12)
    text_only = phi[:, 5] == 0
    assert text_only.any() and (~text_only).any()
    no_vit = np.array(con.layout.vision_layers) == 0
    no_llm = np.array(con.layout.main_layers) == 0
    # text-only micro-batches cost only the fixed overhead on stages holding only vision layers
    np.testing.assert_allclose(st[np.ix_(no_llm, text_only)], con.device.overhead_s, rtol=1e-9)
    # vision features are priced only on the vision stages
    vis_only = phi.copy()
    vis_only[:, [0, 1, 7]] = 0.0
    assert np.all(con.stage_times(vis_only)[no_vit] == 0.0)
    assert np.all(con.stage_times(vis_only)[~no_vit][:, ~text_only] > 0.0)


def test_plan_records_stage_predictions_and_simulation_matches(costs, mix):
    _, con = costs
    for schedule in ("1f1b", "gpipe"):
        plan = plan_microbatches(mix, con, num_stages=S, num_ranks=2, method="dp_varlen", max_len=8192,
                                 schedule=schedule)
        assert plan.stage_time_s.shape == (S, plan.num_microbatches)
        np.testing.assert_array_equal(plan.mb_time_s, plan.stage_time_s.max(axis=0))
        assert plan.options["layout"]["name"] == "contiguous"
        ff = con.forward_fraction
        for r in range(plan.num_ranks):
            sel = plan.mb_rank == r
            st = plan.stage_time_s[:, sel]
            p2p = con.p2p_time(con.padded_features(0, 0, 0, 0))[0] * 0  # p2p checked through evaluate_plan
            res = simulate_pipeline(st * ff, st - st * ff, schedule=schedule, p2p_s=_p2p(con, plan, mix, sel) + p2p)
            assert res.makespan_s == pytest.approx(plan.rank_time_s[r], rel=1e-12)
        again = evaluate_plan(plan, con, mix)
        np.testing.assert_allclose(again.rank_time_s, plan.rank_time_s, rtol=1e-12)
        np.testing.assert_allclose(again.stage_time_s, plan.stage_time_s, rtol=1e-12)


def _p2p(cost, plan, shapes, sel):
    from dynabatch.core.cost.features import microbatch_features

    return cost.p2p_time(microbatch_features(plan, cost, shapes))[sel]


def test_evaluate_uniform_plan_under_its_own_model_reproduces_it(costs, vis):
    uni, _ = costs
    plan = plan_microbatches(vis, uni, num_stages=S, num_ranks=2, method="dp", max_len=8192)
    again = evaluate_plan(plan, uni)
    np.testing.assert_allclose(again.rank_time_s, plan.rank_time_s, rtol=1e-12)
    np.testing.assert_allclose(again.stage_time_s, np.repeat(plan.mb_time_s[None, :], S, axis=0), rtol=1e-12)


@pytest.mark.parametrize("method", ["dp", "dp_varlen"])
def test_stage_aware_beats_stage_blind_on_a_mix(costs, mix, method):
    uni, con = costs
    kw = dict(num_stages=S, num_ranks=2, method=method, max_len=8192)
    blind = evaluate_plan(plan_microbatches(mix, uni, **kw), con, mix)
    aware = plan_microbatches(mix, con, **kw)
    assert blind.stage_time_s is not None
    # the stage-blind plan looks much faster than it runs under the contiguous layout
    assert plan_microbatches(mix, uni, **kw).iteration_time_s < 0.9 * blind.iteration_time_s
    assert aware.iteration_time_s < 0.97 * blind.iteration_time_s


def test_stage_aware_never_much_worse_on_images(costs, vis):
    uni, con = costs
    kw = dict(num_stages=S, num_ranks=2, method="dp_varlen", max_len=8192)
    blind = evaluate_plan(plan_microbatches(vis, uni, **kw), con, vis)
    aware = plan_microbatches(vis, con, **kw)
    assert aware.iteration_time_s <= 1.01 * blind.iteration_time_s


def test_deterministic_and_plan_file_round_trip(costs, mix):
    from dynabatch.planfile.arrow import plan_from_arrow, plan_to_arrow, plans_to_arrow

    _, con = costs
    kw = dict(num_stages=S, num_ranks=2, method="dp", max_len=8192, schedule="auto")
    a = plan_microbatches(mix, con, **kw)
    b = plan_microbatches(mix, CostModel.preset("vlm", num_stages=S, layout="contiguous"), **kw)
    assert a.fingerprint() == b.fingerprint()
    back = plan_from_arrow(plan_to_arrow(a))
    np.testing.assert_array_equal(back.stage_time_s, a.stage_time_s)
    np.testing.assert_array_equal(back.stage_memory_bytes, a.stage_memory_bytes)
    assert back.fingerprint() == a.fingerprint()
    two = plans_to_arrow([a, dataclasses.replace(a, step=3)])
    np.testing.assert_array_equal(plan_from_arrow(two, step=3).stage_time_s, a.stage_time_s)
    # a uniform plan's file has no per-stage columns, and reads back without them
    uni_plan = plan_microbatches(mix, costs[0], **kw)
    t = plan_to_arrow(uni_plan)
    assert "stage_time_s" not in t.column_names and plan_from_arrow(t).stage_time_s is None


def test_layout_validation(costs):
    uni, con = costs
    with pytest.raises(ValueError, match="layout"):
        CostModel.preset("vlm", num_stages=S, layout="diagonal")
    with pytest.raises(ValueError):
        StageLayout((1.0, 2.0), (0.0,), (0.0, 0.0))
    with pytest.raises(ValueError, match="stages"):
        plan_microbatches(synthetic_shapes("vision", 50, seed=0)[0], con, num_stages=2, num_ranks=1)
    gpt = CostModel.preset("gpt", num_stages=S, layout="contiguous")  # one layer kind: all even, uniform
    assert gpt.layout is None


def test_bench_reports_stage_blind_rows(mix):
    from dynabatch.bench.plan import PlanBenchConfig, format_table, mix_text, run_plan_bench
    from dynabatch.core.options import PlanOptions

    vis = synthetic_shapes("vision", 400, seed=3)[0]
    mixed = mix_text(vis, synthetic_shapes("text", 50, seed=4)[0], 0.5, seed=0)
    assert len(mixed) == 800 and (mixed.vision_tokens == 0).sum() >= 400
    assert len(np.unique(mixed.sample_id)) == len(mixed)
    cost = CostModel.preset("vlm", num_stages=S, layout="contiguous")
    opts = PlanOptions(global_batch_tokens=200_000, max_len=8192, num_stages=S, num_ranks=2)
    cfg = PlanBenchConfig(opts, model="vlm", num_batches=2, layout="contiguous")
    result, _ = run_plan_bench(mixed, cost, cfg, methods=("dp", "token_budget"), progress=False)
    assert "dp (stage-blind)" in result["methods"] and "vs_stage_blind" in result["methods"]["dp"]
    assert "/stage-blind" in format_table(result) and "contiguous" in format_table(result)
