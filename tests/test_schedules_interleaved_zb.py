"""Interleaved 1F1B (two model chunks per stage) and zero-bubble ZB-H1 (split backwards) in the simulator,
the planner, the plan file and the stage-partition search: closed forms on uniform times, memory, the
lower bound, and plans whose recorded rank times are the simulated makespans of the orders they run."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch import CostModel, Shapes, plan_microbatches
from dynabatch.core.kernels.op_codes import WEIGHT_SHARE
from dynabatch.core.schedule import REGISTRY, StepOps, plan_orders, plan_p2p_s, plan_stage_times, split_times, step_ops
from dynabatch.core.simulate.pipeline import PipelineDeadlock, makespan, simulate_pipeline
from dynabatch.pipeline.models.partition import LayerCosts, balanced_partition, partition_makespan
from dynabatch.planfile import plan_from_arrow, plan_to_arrow

NEW = ("interleaved", "zb-h1", "zb-h2")


@pytest.mark.parametrize("S,M", [(2, 2), (2, 8), (3, 6), (4, 8), (4, 16)])
def test_uniform_closed_forms(S, M):
    """F = 1, B = 2 on every stage: 1F1B (M + S - 1)(F + B); interleaved (v = 2, M a multiple of S)
    M (F + B) + (S - 1)(F + B) / v (Megatron's bubble / v); ZB-H1 (M >= S) M (F + B) + (S - 1)(F + Bi - W),
    a third of 1F1B's bubble with Bi = W = 1."""
    f, b = np.ones(M), 2 * np.ones(M)
    one = simulate_pipeline(f, b, schedule="1f1b", num_stages=S).makespan_s
    inter = simulate_pipeline(f, b, schedule="interleaved", num_stages=S)
    zb = simulate_pipeline(f, b, schedule="zb-h1", num_stages=S)
    assert one == 3 * (M + S - 1)
    assert inter.makespan_s == pytest.approx(3 * M + 3 * (S - 1) / 2)
    assert zb.makespan_s == pytest.approx(3 * M + (S - 1) * (1 + (1 - WEIGHT_SHARE) * 2 - WEIGHT_SHARE * 2))
    assert inter.start_s.shape == (2 * S, M, 2) and zb.weight_end_s.shape == (S, M)
    assert np.all(zb.weight_start_s >= zb.end_s[:, :, 1])  # each weight part after its input part
    for r in (inter, zb):
        assert r.lower_bound_s <= r.makespan_s + 1e-9


def test_zero_bubble_holds_one_f_one_b_stage_zero_memory_and_interleaving_holds_more():
    S, M = 4, 12
    mem = np.full(M, 10.0)
    peaks = {s: simulate_pipeline(np.ones(M), 2 * np.ones(M), schedule=s, num_stages=S, mem_bytes=mem).peak_inflight_bytes
             for s in ("1f1b", "zb-h1", "interleaved")}
    assert peaks["1f1b"].tolist() == [40.0, 30.0, 20.0, 10.0]
    assert peaks["zb-h1"].max() == peaks["1f1b"].max()  # later stages hold more, none more than stage 0 of 1F1B
    assert np.all(peaks["zb-h1"] >= peaks["1f1b"])
    # interleaving: each chunk holds half a micro-batch's bytes, Megatron's warm-up holds more of them
    assert peaks["interleaved"][0] == 10.0 * (2 * (S - 1) + S + 1) / 2 > peaks["1f1b"][0]


@settings(max_examples=40, deadline=None)
@given(S=st.integers(1, 5), M=st.integers(1, 12), seed=st.integers(0, 10_000), name=st.sampled_from(NEW))
def test_random_times_never_deadlock_and_respect_the_lower_bound(S, M, seed, name):
    rng = np.random.default_rng(seed)
    fwd, bwd, p2p = rng.uniform(0.0, 1.0, (S, M)), rng.uniform(0.0, 2.0, (S, M)), rng.uniform(0, 0.2, M)
    r = simulate_pipeline(fwd, bwd, schedule=name, p2p_s=p2p)
    assert r.lower_bound_s <= r.makespan_s * (1 + 1e-9) + 1e-12
    ops = step_ops(name, S, M)
    assert makespan(fwd, bwd, ops, p2p) == r.makespan_s == simulate_pipeline(fwd, bwd, schedule=ops, p2p_s=p2p).makespan_s
    v = REGISTRY[name].chunks
    per_chunk = np.concatenate([fwd / v] * v), np.concatenate([bwd / v] * v)  # [v S, M] virtual-stage times
    assert simulate_pipeline(*per_chunk, schedule=name, num_stages=S, p2p_s=p2p).makespan_s == pytest.approx(
        r.makespan_s, rel=1e-12)


def test_an_explicit_order_that_cannot_finish_names_the_stuck_ops():
    ops = step_ops("zb-h1", 2, 2)
    table = ops.table.copy()
    table[1] = table[1][[1, 0, 2, 3, 4, 5]]  # stage 1 starts with its input part of micro-batch 0
    with pytest.raises(PipelineDeadlock, match="stage 1 waits forever at Bi0"):
        simulate_pipeline(np.ones(2), np.ones(2), schedule=StepOps("", 2, 2, 1, table))


def _plan(schedule, **kw):
    rng = np.random.default_rng(4)
    shapes = Shapes.from_lengths(input_tokens=np.minimum(rng.lognormal(5.4, 0.9, 400).astype(int) + 1, 2048))
    cost = CostModel.preset("gpt", num_stages=4)
    return plan_microbatches(shapes, cost, num_stages=4, num_ranks=2, method="dp", max_len=2048, schedule=schedule,
                             **kw), cost


@pytest.mark.parametrize("schedule", NEW)
def test_plans_record_the_makespan_of_the_order_they_run(schedule):
    plan, cost = _plan(schedule)
    assert plan.schedule == schedule and np.all(plan.op_slots == -1)  # a static order: its name determines it
    st, p2p = plan_stage_times(plan), plan_p2p_s(plan, cost)
    for r in range(plan.num_ranks):
        idx = plan.rank_indices(r)
        ops = plan_orders(plan, r, cost)
        assert ops == step_ops(schedule, plan.num_stages, len(idx))
        fwd, bwd = split_times(st[:, idx], cost.forward_fraction)
        assert makespan(fwd, bwd, ops, p2p[idx]) == plan.rank_time_s[r]
    back = plan_from_arrow(plan_to_arrow(plan))
    assert back.schedule == schedule and all(plan_orders(back, r) == plan_orders(plan, r)
                                             for r in range(plan.num_ranks))
    one, _ = _plan("1f1b")
    assert plan.iteration_time_s < one.iteration_time_s  # the bubble these orders cut is there in a dp plan


def test_partition_search_cuts_chunks_for_the_interleaved_order():
    rng = np.random.default_rng(0)
    costs = LayerCosts(rng.uniform(0.5, 1.5, (8, 6)), rng.uniform(1.0, 3.0, (8, 6)))
    best = balanced_partition(costs, 4, schedule="interleaved")  # 2 stages x 2 chunks
    assert len(best.bounds) == 5 and best.schedule == "interleaved"
    assert best.makespan_s == partition_makespan(costs, best.bounds, schedule="interleaved")
    with pytest.raises(ValueError, match="multiple of 2 pieces"):
        partition_makespan(costs, [0, 3, 5, 8], schedule="interleaved")
    zb = balanced_partition(costs, 2, schedule="zb-h1")
    assert zb.makespan_s < balanced_partition(costs, 2, schedule="1f1b").makespan_s


def test_auto_picks_the_fastest_one_chunk_order_that_fits_and_inspect_says_why():
    from dynabatch.core.schedule import AUTO_PREFERENCE
    from dynabatch.core.schedule.search import compare_orders

    assert set(AUTO_PREFERENCE) == {n for n, i in REGISTRY.items() if i.concrete and i.chunks == 1}
    auto, cost = _plan("auto")
    plans = {s: _plan(s)[0] for s in AUTO_PREFERENCE}
    assert auto.schedule == min(plans, key=lambda s: (plans[s].iteration_time_s, AUTO_PREFERENCE.index(s)))
    why = compare_orders(auto, cost)
    assert list(why) == list(AUTO_PREFERENCE) + ["interleaved"] and why[auto.schedule]["fits"]
    assert [n for n, c in why.items() if c["per_run"]] == ["interleaved"]  # a cut of its own, for the whole run
    assert why[auto.schedule]["makespan_s"] == pytest.approx(auto.iteration_time_s, rel=1e-12)
    assert why["zb-h1"]["peak_bytes"] == why["1f1b"]["peak_bytes"]  # the same depth as 1F1B's stage 0


def test_held_bytes_kernel_equals_its_reference_and_the_plain_peaks():
    from dynabatch.core.kernels.recompute import stage_peaks
    from dynabatch.core.kernels.simulate import held_table_kernel, held_table_reference

    rng = np.random.default_rng(1)
    for name in ("1f1b", "gpipe", "interleaved", "zb-h1"):
        S, M = 3, 5
        ops = step_ops(name, S, M)
        held = rng.uniform(1, 5, (ops.num_virtual_stages, M))
        out = np.empty(S)
        held_table_kernel(ops.kernel_table, held, out)  # the writable table the library hands kernels
        assert np.allclose(out, held_table_reference(ops.table.tolist(), held), rtol=0, atol=1e-12)
        if not ops.split and ops.num_chunks == 1:
            plain = np.empty(S)
            stage_peaks(ops.codes(), held, plain)
            assert np.array_equal(out, plain)


def test_zb_h2_fills_the_warm_up_with_forwards_at_about_twice_one_f_one_b_memory():
    """ZB-H2: stage s warms up with 2 (S - s) - 1 forwards, so stage 0 holds 2 S micro-batches (1F1B: S); on
    uniform times it is as fast as ZB-H1 (both at the last stage's bound 3 M + S - 1), on variable ones
    faster (its longer look-ahead absorbs the uneven micro-batches)."""
    S, M = 4, 12
    mem = np.full(M, 10.0)
    run = {s: simulate_pipeline(np.ones(M), 2 * np.ones(M), schedule=s, num_stages=S, mem_bytes=mem)
           for s in ("1f1b", "zb-h1", "zb-h2")}
    assert run["zb-h2"].peak_inflight_bytes.tolist() == [80.0, 70.0, 60.0, 50.0]
    assert run["zb-h2"].makespan_s == run["zb-h1"].makespan_s == 3 * M + S - 1
    rng = np.random.default_rng(3)
    gain = []
    for _ in range(10):
        base = rng.lognormal(0, 0.6, M)
        st = np.outer(np.linspace(1, 1.3, S), base)
        f = st / 3
        p2p = np.full(M, 0.05 * base.mean())
        gain.append(makespan(f, st - f, step_ops("zb-h1", S, M), p2p) / makespan(f, st - f, step_ops("zb-h2", S, M), p2p))
    assert np.mean(gain) > 1.05 and min(gain) >= 1.0 - 1e-12


def test_auto_under_a_memory_limit_leaves_out_the_order_that_does_not_fit():
    from dynabatch.core.schedule.search import pick_auto

    span = {"1f1b": 10.0, "zb-h1": 8.0, "zb-h2": 7.0, "adaptive": 9.0, "gpipe": 12.0}
    peak = {"1f1b": 4.0, "zb-h1": 4.0, "zb-h2": 8.0, "adaptive": 4.0, "gpipe": 12.0}
    assert pick_auto(span, peak, 8.0) == "zb-h2"
    assert pick_auto(span, peak, 4.0) == "zb-h1"  # zb-h2 would hold twice the bytes


def test_run_choice_weighs_the_interleaved_cut_against_the_per_step_picks():
    """Per run: interleaved (its own cut for every step) is chosen only when it fits on every step and its
    summed simulated seconds beat the sum of auto's per-step picks; the figures are the steps' own."""
    from dynabatch.core.schedule.search import compare_orders, run_choice

    plans = [_plan("auto")[0] for _ in range(2)]
    cost = _plan("auto")[1]
    got = run_choice(plans, cost)
    cmp = [compare_orders(p, cost) for p in plans]
    assert got["seconds"]["interleaved"] == pytest.approx(sum(c["interleaved"]["makespan_s"] for c in cmp), rel=1e-12)
    best = sum(min(c[n]["makespan_s"] for n in c if not c[n]["per_run"] and c[n]["fits"]) for c in cmp)
    assert got["seconds"]["auto"] == pytest.approx(best, rel=1e-12)
    want = "interleaved" if got["fits"]["interleaved"] and got["seconds"]["interleaved"] < best else "auto"
    assert got["choice"] == want
