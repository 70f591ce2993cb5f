"""Flush-free (asynchronous, cross-step) 1F1B: kernels vs references, hand-computed schedules,
consistency with the flushed simulator and plans, bounds, and the bench (`dynabatch.core.simulate.flushfree`)."""

import numpy as np
import pytest

from dynabatch.bench.flushfree import format_flushfree, run_flushfree_bench
from dynabatch.core.cost.model import CostModel
from dynabatch.core.simulate.flushfree import (
    flushfree_bound,
    flushfree_objective,
    flushfree_report,
    simulate_flushfree,
    update_lag,
)
from dynabatch.core.kernels import op_codes as oc
from dynabatch.core.kernels.flushfree import (
    flushfree_kernel,
    flushfree_reference,
    stage_loads,
    stage_loads_reference,
)
from dynabatch.core.kernels.op_tables import stream_row_reference
from dynabatch.core.schedule.build import stream_ops
from dynabatch.core.options import PlanOptions
from dynabatch.core.schedule.orders import plan_stage_times
from dynabatch.shape_sources import synthetic_shapes
from dynabatch.core.simulate.pipeline import simulate_pipeline
from dynabatch.core.cost.features import microbatch_features
from dynabatch.core.plan.steps import global_batches, plan_step


def random_stream(rng, zero_counts=True):
    S, R, K = int(rng.integers(1, 6)), int(rng.integers(1, 4)), int(rng.integers(1, 5))
    counts = rng.integers(0 if zero_counts else 1, 5, (R, K))
    if counts.sum() == 0:
        counts[0, 0] = 1
    N = int(counts.sum())
    return (S, counts, rng.uniform(0, 2, (S, N)), rng.uniform(0, 4, (S, N)), rng.uniform(0, 0.5, N),
            rng.uniform(0, 0.5, S))


def layout(counts):
    roff = np.concatenate(([0], np.cumsum(counts.sum(axis=1)))).astype(np.int64)
    return roff, np.ascontiguousarray(np.cumsum(counts, axis=1), np.int64)


def flushfree_ops(S, s, ends):
    """Stage ``s``'s stream ops (`stream_ops`) as codes: ``j + 1`` forward, ``-(j + 1)`` backward, ``n + 1 + k``
    step ``k``'s update."""
    ops = stream_ops(S, ends)
    n = ops.num_microbatches
    return np.array([op.microbatch + 1 if op.kind == oc.FORWARD else -(op.microbatch + 1) if op.kind == oc.BACKWARD
                     else n + 1 + op.microbatch for op in ops.rank(s)], np.int64)


# --------------------------------------------------------------------------- kernels vs references


def test_ops_kernel_matches_reference():
    rng = np.random.default_rng(0)
    for _ in range(300):
        S, K = int(rng.integers(1, 7)), int(rng.integers(1, 5))
        ends = np.cumsum(rng.integers(0, 5, K)).astype(np.int64)
        table = stream_ops(S, ends).table
        for s in range(S):
            ops = flushfree_ops(S, s, ends)
            assert [tuple(r) for r in table[s].tolist()] == stream_row_reference(s, S, ends.tolist())
            n = int(ends[-1])
            assert sorted(ops.tolist()) == sorted(list(range(-n, 0)) + list(range(1, n + 1 + K)))


def test_ops_are_1f1b_over_the_stream_with_updates_after_each_step():
    # 3 stages, steps of 2 and 2 micro-batches: stage 0 warms up with 2 forwards once
    assert flushfree_ops(3, 0, np.array([2, 4])).tolist() == [1, 2, 3, -1, 4, -2, 5, -3, -4, 6]
    assert flushfree_ops(3, 2, np.array([2, 4])).tolist() == [1, -1, 2, -2, 5, 3, -3, 4, -4, 6]
    # a rank without micro-batches in step 0 applies that update first
    assert flushfree_ops(2, 0, np.array([0, 2])).tolist() == [3, 1, 2, -1, -2, 4]


def test_simulation_kernel_matches_reference():
    rng = np.random.default_rng(1)
    for _ in range(200):
        S, counts, fwd, bwd, p2p, upd = random_stream(rng)
        roff, ends = layout(counts)
        N, K = fwd.shape[1], counts.shape[1]
        start, end, upd_end = np.empty((S, N, 2)), np.empty((S, N, 2)), np.empty((S, K))
        assert flushfree_kernel(fwd, bwd, p2p, roff, ends, upd, start, end, upd_end) == 0
        rs, re, ru, dead = flushfree_reference(fwd, bwd, p2p, roff, ends, upd)
        assert not dead
        np.testing.assert_allclose(start, rs, rtol=1e-12)
        np.testing.assert_allclose(end, re, rtol=1e-12)
        np.testing.assert_allclose(upd_end, ru, rtol=1e-12)


def test_stage_loads_kernel_matches_reference():
    rng = np.random.default_rng(2)
    for _ in range(100):
        S, M, R = int(rng.integers(1, 6)), int(rng.integers(1, 20)), int(rng.integers(1, 4))
        st, p2p, rank_of = rng.uniform(0, 3, (S, M)), rng.uniform(0, 0.5, M), rng.integers(0, R, M)
        load, cyc = np.empty((R, S)), np.empty((R, S))
        stage_loads(st, p2p, rank_of.astype(np.int64), R, load, cyc)
        rl, rc = stage_loads_reference(st, p2p, rank_of, R)
        np.testing.assert_allclose(load, rl, rtol=1e-12)
        np.testing.assert_allclose(cyc, rc, rtol=1e-12)


# --------------------------------------------------------------------------- hand-computed schedules


def test_hand_computed_two_stage_example():
    # Two steps of micro-batches A (f=1, b=2) and B (f=2, b=4) on 2 stages, 0.5 s per transfer.
    # stage 1: F0 [1.5,2.5] B0 [2.5,4.5] F1 [4.5,6.5] B1 [6.5,10.5] U0 | F2 [10.5,11.5] B2 [11.5,13.5]
    #          F3 [17.5,19.5] B3 [19.5,23.5] U1
    # stage 0: F0 [0,1] F1 [1,3] B0 [5,7] F2 [7,8] B1 [11,15] U0 | F3 [15,17] B2 [17,19] B3 [24,28] U1
    f = np.tile([1.0, 2.0, 1.0, 2.0], (2, 1))
    sim = simulate_flushfree(f, 2 * f, [[2, 2]], p2p_s=0.5)
    np.testing.assert_allclose(sim.update_end_s, [[15.0, 28.0], [10.5, 23.5]])
    np.testing.assert_allclose(sim.step_time_s, [15.0, 13.0])
    np.testing.assert_allclose(sim.start_s[0, :, 0], [0, 1, 7, 15])    # stage 0 forwards
    np.testing.assert_allclose(sim.start_s[0, :, 1], [5, 11, 17, 24])  # stage 0 backwards
    np.testing.assert_allclose(sim.start_s[1, :, 0], [1.5, 4.5, 10.5, 17.5])
    # flushed, each step takes the 1F1B makespan of its own: 15 s; flush-free the second takes 13 s
    flushed = simulate_pipeline(f[0, :2], 2 * f[0, :2], num_stages=2, p2p_s=0.5).makespan_s
    assert flushed == 15.0


@pytest.mark.parametrize("S,M", [(2, 3), (4, 4), (4, 8), (8, 3)])
def test_uniform_steady_state_is_the_stage_load(S, M):
    # uniform f=1, b=2, no transfer: the first step pays the fill (M+S-1)(f+b), every later one M(f+b)
    K = 6
    sim = simulate_flushfree(np.ones((S, M * K)), np.full((S, M * K), 2.0), [[M] * K])
    flushed = simulate_pipeline(np.ones(M), np.full(M, 2.0), num_stages=S).makespan_s
    assert sim.step_time_s[0] == pytest.approx(flushed) == pytest.approx((M + S - 1) * 3.0)
    np.testing.assert_allclose(sim.step_time_s[1:], M * 3.0)


def test_update_barrier_and_update_time():
    # two ranks, one stage: each step waits for the slower rank, then pays the update time
    fwd = np.array([[1.0, 1.0, 3.0, 1.0]])  # rank 0: 1, 1 ; rank 1: 3, 1
    sim = simulate_flushfree(fwd, 2 * fwd, [[1, 1], [1, 1]], update_s=0.5)
    np.testing.assert_allclose(sim.update_end_s, [[9.5, 13.0]])  # max(3, 9) + .5 ; 9.5 + max(3, 3) + .5
    np.testing.assert_allclose(sim.step_time_s, [9.5, 3.5])


def test_one_step_without_warmup_is_the_flushed_1f1b_makespan():
    rng = np.random.default_rng(3)
    for _ in range(50):
        S, R = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        counts = rng.integers(1, 7, (R, 1))
        N = int(counts.sum())
        fwd, bwd, p2p = rng.uniform(0, 2, (S, N)), rng.uniform(0, 4, (S, N)), rng.uniform(0, .5, N)
        sim = simulate_flushfree(fwd, bwd, counts, p2p_s=p2p)
        roff, _ = layout(counts)
        spans = [simulate_pipeline(fwd[:, a:b], bwd[:, a:b], p2p_s=p2p[a:b]).makespan_s
                 for a, b in zip(roff[:-1], roff[1:])]
        assert sim.completion_s[0] == pytest.approx(max(spans), rel=1e-12)


def test_whole_run_respects_the_busy_and_round_trip_bounds():
    rng = np.random.default_rng(4)
    for _ in range(100):
        S, counts, fwd, bwd, p2p, upd = random_stream(rng, zero_counts=False)
        sim = simulate_flushfree(fwd, bwd, counts, p2p_s=p2p)
        roff, _ = layout(counts)
        R = counts.shape[0]
        rank_of = np.repeat(np.arange(R), counts.sum(axis=1)).astype(np.int64)
        load, cyc = np.empty((R, S)), np.empty((R, S))
        stage_loads(fwd + bwd, p2p, rank_of, R, load, cyc)
        assert sim.makespan_s >= max(load.max(), cyc.max()) * (1 - 1e-12)
        np.testing.assert_allclose(sim.busy_s, load, rtol=1e-12)


def test_update_lag_counts_the_updates_between_forward_and_backward():
    rng = np.random.default_rng(5)
    for _ in range(100):
        S, K = int(rng.integers(1, 7)), int(rng.integers(1, 6))
        ends = np.cumsum(rng.integers(0, 5, K)).astype(np.int64)
        lag = update_lag(ends, S)
        n = int(ends[-1])
        assert lag.shape == (S, n)
        for s in range(S):
            ops = flushfree_ops(S, s, ends).tolist()
            is_update = np.array([op > n for op in ops])
            for j in range(n):
                f, b = ops.index(j + 1), ops.index(-(j + 1))
                assert lag[s, j] == is_update[f:b].sum()
    # steps of at least S-1 micro-batches: at most one update in flight; fewer: more
    assert update_lag([4, 8, 12], 4).max() == 1
    assert update_lag(np.arange(2, 21, 2), 8).max() == 4  # ceil(7 / 2) or one more
    assert update_lag([5, 10], 1).max() == 0


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="counts"):
        simulate_flushfree(np.ones((2, 3)), np.ones((2, 3)), [3])
    with pytest.raises(ValueError, match=r"\[S, counts.sum\(\)\]"):
        simulate_flushfree(np.ones((2, 3)), np.ones((2, 3)), [[2]])
    with pytest.raises(ValueError, match="finite"):
        simulate_flushfree(np.full((1, 2), np.nan), np.ones((1, 2)), [[2]])


# --------------------------------------------------------------------------- plans


SHAPES = synthetic_shapes("text", 3000, seed=0)[0]


def dp_plans(S, n=4, ranks=8):
    cost = CostModel.preset("gpt", "a100-80gb", num_stages=S)
    opts = PlanOptions(global_batch_tokens=65536, max_len=2048, max_target_len=512, num_stages=S, num_ranks=ranks)
    return [plan_step(SHAPES, cost, opts, p, k) for k, p in enumerate(global_batches(SHAPES, cost, opts, 0)[:n])], cost


def test_one_stage_flush_free_equals_flushed():
    plans, cost = dp_plans(1)
    rep = flushfree_report(plans, cost)
    np.testing.assert_allclose(rep.flushfree_s, rep.flushed_s, rtol=1e-12)
    np.testing.assert_allclose(rep.flushfree_s, rep.load_bound_s, rtol=1e-12)
    assert abs(rep.total_removed_share) < 1e-12 and rep.max_lag.max() == 0


def test_a_plan_alone_without_warmup_is_its_iteration_time():
    for S in (2, 4):
        plans, cost = dp_plans(S, n=2)
        for p in plans:
            assert p.schedule == "1f1b"
            rep = flushfree_report([p], cost, warm_steps=0)
            assert rep.flushfree_s[0] == pytest.approx(p.iteration_time_s, rel=1e-12)


@pytest.mark.parametrize("S", [4, 8])
def test_flush_free_on_dp_plans_removes_the_fill_and_drain(S):
    plans, cost = dp_plans(S)
    rep = flushfree_report(plans, cost)
    assert np.all(rep.flushfree_s >= rep.load_bound_s) and np.all(rep.bound_s >= rep.load_bound_s)
    assert np.all(rep.flushfree_s <= rep.flushed_s)
    np.testing.assert_allclose(rep.removed_share, 1 - rep.flushfree_s / rep.flushed_s)
    assert rep.total_removed_share == pytest.approx(1 - rep.flushfree_s.sum() / rep.flushed_s.sum())
    # the flush costs a sizeable share of a 4-stage step and more of an 8-stage one
    assert 0.1 < rep.total_removed_share < 0.6
    assert rep.max_lag.min() >= 1
    print(f"{S} stages: flush-free removes {rep.total_removed_share:.1%} of the flushed step time "
          f"({rep.flushed_s.mean() * 1e3:.1f} -> {rep.flushfree_s.mean() * 1e3:.1f} ms per step)")
    if S == 8:
        four, _ = dp_plans(4)
        assert rep.total_removed_share > flushfree_report(four, cost).total_removed_share


def test_warm_steps_remove_the_fill_of_the_first_step():
    plans, cost = dp_plans(4, n=4)
    cold = flushfree_report(plans, cost, warm_steps=0)
    warm = flushfree_report(plans, cost, warm_steps=1)
    # cold, the first step pays the pipeline's fill (and runs step 1's first forwards): more than warm
    assert cold.flushfree_s[0] > warm.flushfree_s[0] >= warm.load_bound_s[0]
    assert cold.flushfree_s[0] >= plans[0].iteration_time_s
    # in between, the steps barely notice (the last one, cold, has no next step's forwards to run)
    np.testing.assert_allclose(cold.flushfree_s[1:-1], warm.flushfree_s[1:-1], rtol=0.05)
    assert warm.warm_steps == 1 and cold.warm_steps == 0


def test_flush_free_bound_and_objective():
    plans, cost = dp_plans(4, n=1)
    p = plans[0]
    p2p = cost.p2p_time(microbatch_features(p, cost))
    st = plan_stage_times(p)
    S, R = p.num_stages, p.num_ranks
    by_hand = 0.0
    for r in range(R):
        mine = p.mb_rank == r
        for s in range(S):
            trips = st[s:, mine].sum(axis=0) + 2 * (S - 1 - s) * p2p[mine]
            by_hand = max(by_hand, st[s, mine].sum(), trips.sum() / (S - s))
    assert flushfree_bound(p, cost) == pytest.approx(by_hand, rel=1e-12)
    assert flushfree_report([p], cost).bound_s[0] == pytest.approx(by_hand, rel=1e-12)
    # the balanced objective: no (S-1) * max term; equal to the bound for perfectly balanced ranks
    assert flushfree_objective([1.0, 2.0, 3.0, 4.0], 2, 4, 0.1) == pytest.approx((10 + 2 * 3 / 4 * 0.4) / 2)
    assert flushfree_objective(p.mb_time_s, R, S, p2p) <= flushfree_bound(p, cost) * (1 + 1e-12)
    assert flushfree_objective(p.mb_time_s, R, S, p2p) < p.objective_s


def test_report_needs_transfer_times():
    plans, _ = dp_plans(2, n=1)
    with pytest.raises(ValueError, match="p2p_s"):
        flushfree_report(plans)
    rep = flushfree_report(plans, p2p_s=0.0)
    assert rep.flushfree_s[0] > 0


def test_bench_reports_flush_and_flush_free_per_depth():
    res = run_flushfree_bench(SHAPES, label="synthetic", stages=(2, 4), num_batches=3)
    assert set(res["stages"]) == {2, 4}
    for S, r in res["stages"].items():
        assert r["steps"] == 3 and len(r["flushfree_s"]) == 3
        assert r["mean_flushfree_s"] <= r["mean_flushed_s"]
    assert res["stages"][4]["total_removed_share"] > res["stages"][2]["total_removed_share"]
    text = format_flushfree(res)
    assert "flush-free" in text and len(text.splitlines()) == 4
