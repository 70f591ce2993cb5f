import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from dynabatch.core.kernels.simulate import simulate_reference as _simulate_reference
from dynabatch.core.simulate.pipeline import (
    PipelineDeadlock,
    SimResult,
    makespan,
    makespan_kernel,
    pipeline_schedule,
    schedule_kernel,
    simulate_kernel,
    simulate_pipeline,
)

KINDS = ["gpipe", "1f1b"]
# Tight cases (S == 1, uniform times) make the bound equal the makespan, up to summation order.
RTOL = 1e-9


def random_order(rng, M):
    """A uniformly random stage order in which each F_j precedes its B_j (may deadlock across stages)."""
    seq = rng.permutation(np.repeat(np.arange(M), 2))
    seen = np.zeros(M, dtype=bool)
    out = np.empty(2 * M, dtype=np.int32)
    for k, j in enumerate(seq):
        out[k] = -(j + 1) if seen[j] else j + 1
        seen[j] = True
    return out


def random_case(seed):
    """Random per-stage times, per-micro-batch p2p, and a schedule (named or odd explicit order)."""
    rng = np.random.default_rng(seed)
    S, M = int(rng.integers(1, 6)), int(rng.integers(1, 13))
    fwd = rng.uniform(0.0, 2.0, (S, M))
    bwd = rng.uniform(0.0, 4.0, (S, M))
    p2p = rng.uniform(0.0, 0.5, M) * rng.integers(0, 2)
    choice = rng.integers(0, 4)
    if choice < 2:
        ops = pipeline_schedule(S, M, KINDS[choice])
    elif choice == 2:  # independent per-stage orders: mostly deadlock when S > 1
        ops = np.stack([random_order(rng, M) for _ in range(S)])
    else:  # one odd order shared by all stages: always finishes
        ops = np.tile(random_order(rng, M), (S, 1))
    return fwd, bwd, p2p, ops


# ----------------------------------------------------------------------------- schedules


def test_schedules_small_example():
    assert pipeline_schedule(2, 3, "gpipe").tolist() == [[1, 2, 3, -1, -2, -3]] * 2
    assert pipeline_schedule(2, 3, "1f1b").tolist() == [[1, 2, -1, 3, -2, -3], [1, -1, 2, -2, 3, -3]]
    assert pipeline_schedule(3, 1, "1f1b").tolist() == [[1, -1]] * 3
    assert pipeline_schedule(2, 3, "1F1B").dtype == np.int32


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("S,M", [(1, 1), (1, 5), (4, 1), (4, 2), (3, 3), (4, 8)])
def test_schedule_is_valid_permutation(kind, S, M):
    ops = pipeline_schedule(S, M, kind)
    assert ops.shape == (S, 2 * M)
    for row in ops.tolist():
        assert sorted(row) == list(range(-M, 0)) + list(range(1, M + 1))
        assert all(row.index(j + 1) < row.index(-(j + 1)) for j in range(M))


def test_unknown_kind_lists_valid_kinds():
    with pytest.raises(ValueError, match="1f1b.*gpipe|gpipe.*1f1b"):
        pipeline_schedule(2, 2, "zb-v")
    with pytest.raises(ValueError, match="no plain op codes"):  # chunks: see dynabatch.core.schedule.step_ops
        pipeline_schedule(2, 2, "interleaved")


# ----------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("S,M", [(1, 1), (1, 4), (2, 1), (3, 2), (4, 4), (4, 9), (6, 3)])
def test_uniform_makespan_and_bubble(kind, S, M):
    f, b = 1.0, 2.0
    r = simulate_pipeline(np.full(M, f), np.full(M, b), schedule=kind, num_stages=S)
    assert isinstance(r, SimResult)
    assert r.makespan_s == (M + S - 1) * (f + b)
    assert r.bubble_fraction == pytest.approx((S - 1) / (M + S - 1))
    assert r.lower_bound_s == pytest.approx(r.makespan_s)  # uniform times: the bound is tight
    expected_peak = min(S, M) if kind == "1f1b" else M
    assert r.peak_inflight[0] == expected_peak
    assert r.peak_inflight.dtype == np.int64


def test_uniform_p2p_hand_computed():
    # S=2, M=2, f=1, b=2, p2p=0.5 (1F1B). Stage 0: F0 F1 B0 B1, stage 1: F0 B0 F1 B1.
    #   s0: F0 0-1, F1 1-2               B0 5-7 (B(1,0) ends 4.5 + 0.5)  B1 8-10
    #   s1: F0 1.5-2.5, B0 2.5-4.5, F1 4.5-5.5, B1 5.5-7.5
    r = simulate_pipeline([1.0, 1.0], [2.0, 2.0], schedule="1f1b", num_stages=2, p2p_s=0.5)
    assert r.start_s[0].tolist() == [[0.0, 5.0], [1.0, 8.0]]
    assert r.end_s[0].tolist() == [[1.0, 7.0], [2.0, 10.0]]
    assert r.start_s[1].tolist() == [[1.5, 2.5], [4.5, 5.5]]
    assert r.makespan_s == 10.0
    assert r.bubble_fraction == pytest.approx(1 - 12 / 20)
    assert r.lower_bound_s == 10.0  # head 1.5 + busy 6 + tail 2.5 on stage 1
    # GPipe reaches the same makespan here: stage 1 runs F0 F1 B0 B1 from 1.5 to 7.5.
    assert simulate_pipeline([1.0, 1.0], [2.0, 2.0], schedule="gpipe", num_stages=2, p2p_s=0.5).makespan_s == 10.0


def test_inflight_bytes():
    mem = np.array([10.0, 20.0, 30.0])
    r = simulate_pipeline(np.ones(3), np.ones(3), schedule="1f1b", num_stages=2, mem_bytes=mem)
    # stage 0 order F0 F1 B0 F2 B1 B2 -> holds {0,1} then {1,2}; stage 1 holds one at a time.
    assert r.peak_inflight.tolist() == [2, 1]
    assert r.peak_inflight_bytes.tolist() == [50.0, 30.0]
    g = simulate_pipeline(np.ones(3), np.ones(3), schedule="gpipe", num_stages=2, mem_bytes=mem)
    assert g.peak_inflight_bytes.tolist() == [60.0, 60.0]
    assert simulate_pipeline(np.ones(3), np.ones(3), num_stages=2).peak_inflight_bytes.tolist() == [0.0, 0.0]


# ----------------------------------------------------------------------------- kernel vs reference


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_kernel_matches_reference(seed):
    fwd, bwd, p2p, ops = random_case(seed)
    S, M = fwd.shape
    start = np.empty((S, M, 2))
    end = np.empty((S, M, 2))
    code = simulate_kernel(fwd, bwd, p2p, ops, start, end)
    ref_start, ref_end, ref_dead = _simulate_reference(fwd, bwd, p2p, ops)
    assert code == int(ref_dead)
    # Both reach the same (unique) set of runnable ops, with bit-identical times.
    np.testing.assert_array_equal(start, ref_start)
    np.testing.assert_array_equal(end, ref_end)
    span = makespan(fwd, bwd, ops, p2p)
    if ref_dead:
        assert span == np.inf
        with pytest.raises(PipelineDeadlock):
            simulate_pipeline(fwd, bwd, schedule=ops, p2p_s=p2p)
    else:
        r = simulate_pipeline(fwd, bwd, schedule=ops, p2p_s=p2p)
        assert span == r.makespan_s == ref_end.max()
        assert r.lower_bound_s <= r.makespan_s * (1 + RTOL)
        if S == 1:
            assert r.lower_bound_s == pytest.approx(r.makespan_s, rel=RTOL)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(KINDS))
def test_lower_bound_named_schedules(seed, kind):
    rng = np.random.default_rng(seed)
    S, M = int(rng.integers(1, 7)), int(rng.integers(1, 16))
    fwd = rng.exponential(1.0, (S, M))
    bwd = rng.exponential(2.0, (S, M))
    p2p = rng.exponential(0.2, M)
    r = simulate_pipeline(fwd, bwd, schedule=kind, p2p_s=p2p)
    assert 0.0 <= r.bubble_fraction < 1.0
    assert r.lower_bound_s <= r.makespan_s * (1 + RTOL)
    # Each stage runs its list in order, one op at a time.
    for s, row in enumerate(pipeline_schedule(S, M, kind)):
        j, k = np.abs(row) - 1, (row < 0).astype(int)
        assert np.all(r.start_s[s, j[1:], k[1:]] >= r.end_s[s, j[:-1], k[:-1]])


def test_kernels_callable_from_njit():
    @njit
    def best_of_two(fwd, bwd, p2p):
        S, M = fwd.shape  # typed codes, as the library's kernels pass them (a literal 0 would compile a second
        # schedule_kernel and static_table on every fresh clone)
        a = makespan_kernel(fwd, bwd, p2p, schedule_kernel(S, M, np.int64(0)))
        b = makespan_kernel(fwd, bwd, p2p, schedule_kernel(S, M, np.int64(1)))
        return min(a, b)

    fwd = np.ones((3, 4))
    assert best_of_two(fwd, 2 * fwd, np.zeros(4)) == (4 + 3 - 1) * 3.0


# ----------------------------------------------------------------------------- deadlocks


def test_cross_stage_deadlock():
    # Stage 0 wants B0 right after F0, but stage 1 first waits for F1, which stage 0 only
    # sends after B0: each waits on the other.
    ops = np.array([[1, -1, 2, -2], [2, -2, 1, -1]], dtype=np.int32)
    with pytest.raises(PipelineDeadlock, match=r"stage 0 waits forever at B0 \(needs B0 from stage 1\)") as ei:
        simulate_pipeline(np.ones(2), np.ones(2), schedule=ops)
    assert "stage 1 waits forever at F1" in str(ei.value)
    assert (ei.value.stage, ei.value.op) == (0, -1)
    assert makespan(np.ones((2, 2)), np.ones((2, 2)), ops, np.zeros(2)) == np.inf


def test_backward_before_forward_deadlocks():
    with pytest.raises(PipelineDeadlock, match=r"stage 0 waits forever at B0 \(needs F0 on this stage first\)"):
        simulate_pipeline([1.0], [1.0], schedule=[[-1, 1]])
    with pytest.raises(PipelineDeadlock, match="stage 0 waits forever at B0"):
        simulate_pipeline([1.0], [1.0], schedule=[[-1, 1], [1, -1]])


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(fwd_s=np.ones(3), bwd_s=np.ones(3)), "num_stages"),
        (dict(fwd_s=np.ones((2, 3)), bwd_s=np.ones((2, 4))), "disagree"),
        (dict(fwd_s=np.ones((2, 3)), bwd_s=np.ones((3, 3))), "inconsistent number of stages"),
        (dict(fwd_s=np.ones((2, 3)), bwd_s=np.ones(3), num_stages=3), "inconsistent number of stages"),
        (dict(fwd_s=np.ones((2, 2, 2)), bwd_s=np.ones(2)), r"\[M\] or \[S, M\]"),
        (dict(fwd_s=np.ones(0), bwd_s=np.ones(0), num_stages=2), "M >= 1"),
        (dict(fwd_s=-np.ones(2), bwd_s=np.ones(2), num_stages=2), "fwd_s must be finite and >= 0"),
        (dict(fwd_s=np.ones(2), bwd_s=[1.0, np.nan], num_stages=2), "bwd_s must be finite"),
        (dict(fwd_s=np.ones(2), bwd_s=np.ones(2), num_stages=2, p2p_s=-1.0), "p2p_s must be finite"),
        (dict(fwd_s=np.ones(2), bwd_s=np.ones(2), num_stages=2, p2p_s=[0.1] * 3), r"p2p_s .*shape \(2,\)"),
        (dict(fwd_s=np.ones(2), bwd_s=np.ones(2), num_stages=2, mem_bytes=[1.0]), "mem_bytes"),
        (dict(fwd_s=np.ones(2), bwd_s=np.ones(2), schedule=[[1, 2, -1, -1]]), "stage 0 must list every"),
        (dict(fwd_s=np.ones(2), bwd_s=np.ones(2), schedule=[[1, -1, 2, -2], [1, -1, 2, 3]]), "stage 1"),
        (dict(fwd_s=np.ones(2), bwd_s=np.ones(2), schedule=[[1, -1, 2]]), r"int array \[S, 4\]"),
        (dict(fwd_s=np.ones(2), bwd_s=np.ones(2), schedule=[[1.0, -1, 2, -2]]), "int array"),
        (dict(fwd_s=np.ones(2), bwd_s=np.ones(2), num_stages=2, schedule="zb"), "valid kinds"),
    ],
)
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate_pipeline(**kwargs)


def test_makespan_fast_path_validation():
    with pytest.raises(ValueError, match=r"fwd/bwd \[S, M\]"):
        makespan(np.ones((2, 2)), np.ones((2, 2)), pipeline_schedule(2, 2), np.zeros(3))
    with pytest.raises(ValueError, match="codes"):
        makespan(np.ones((2, 2)), np.ones((2, 2)), [[1, -1, 3, -2]] * 2, np.zeros(2))
    with pytest.raises(ValueError, match="codes"):
        makespan(np.ones((2, 2)), np.ones((2, 2)), pipeline_schedule(3, 2), np.zeros(2))
    with pytest.raises(ValueError):
        pipeline_schedule(0, 3)
