"""Every numba kernel equals its plain-Python reference on random inputs.

One test per kernel / reference pair of `dynabatch.core.kernels` (the table in its docstring).
`dp_kernel` vs `dp_reference` is checked in ``test_plan.py``
(it needs that file's cost helpers); its cap picker is checked here. Inputs are drawn with ties
(times and lengths from small sets), empty parts (ranks without micro-batches, empty rows,
M = 0) and several stages and ranks, and outputs are compared exactly: the references perform the
same float operations in the same order.
"""

import os
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch.core.kernels.assign import (
    candidate_orders,
    assign_ranks,
    assign_ranks_reference,
    balance_simulated,
    balance_simulated_reference,
    candidate_orders_reference,
    simulate_rank,
    simulate_rank_reference,
)
from dynabatch.core.kernels.cost import (
    NUM_FEATURES,
    padded_features,
    padded_features_reference,
    profiled_lookup,
    profiled_lookup_reference,
)
from dynabatch.core.kernels.bounds import capped_partition_cost, capped_partition_cost_reference
from dynabatch.core.kernels.caps import pick_caps, pick_caps_between, pick_caps_reference
from dynabatch.core.kernels.packing import budget_cuts, budget_cuts_reference, pack_rows, pack_rows_reference
from dynabatch.core.kernels.rows import pad_rows, pad_rows_reference
from dynabatch.core.kernels.objective import objective_kernel, objective_reference
from dynabatch.core.kernels.schedules import order_ranks_schedule, order_ranks_schedule_reference
from dynabatch.core.kernels.simulate import (
    inflight_kernel,
    inflight_reference,
    makespan_kernel,
    makespan_reference,
    schedule_kernel,
    schedule_reference,
    simulate_kernel,
    simulate_reference,
    split_kernel,
    split_reference,
)
from dynabatch.core.kernels.global_batches import greedy_cuts, greedy_cuts_reference

# Times (seconds) from a few values or any float, so ties are common but not the rule.
time_st = st.sampled_from([0.25, 0.5, 1.0, 1.0, 2.0, 3.5]) | st.floats(0.001, 10.0)
times_st = st.lists(time_st, min_size=1, max_size=24)
tied_times_st = st.lists(time_st, max_size=12)
seeds = st.integers(0, 2**32 - 1)


def random_stage_order(rng, M):
    """One stage's op list with each forward before its backward, otherwise random (int32 codes)."""
    seen, ops = set(), []
    for j in rng.permutation(np.repeat(np.arange(M), 2)):
        ops.append(-(j + 1) if j in seen else j + 1)
        seen.add(j)
    return ops


def schedules_by_count(stages, kmax, kind):
    """``ops_by_count[k]``: the named schedule of k micro-batches, zero-padded, as the planner builds it."""
    ops = np.zeros((kmax + 1, stages, 2 * max(kmax, 1)), np.int32)
    for k in range(1, kmax + 1):
        ops[k, :, : 2 * k] = schedule_kernel(stages, k, kind)
    return ops


# ----------------------------------------------------------------------------- assign


def check_assign_ranks(times, ranks, stages, equal):
    if equal:
        times = times[: len(times) - len(times) % ranks] or times[:1] * ranks
    t = np.array(times)
    got = assign_ranks(t, ranks, stages, equal).tolist()
    assert got == assign_ranks_reference(t, ranks, stages, equal)
    if equal:
        assert set(np.bincount(got, minlength=ranks)) == {len(t) // ranks}


@settings(max_examples=60, deadline=None)
@given(times_st, st.integers(1, 5), st.integers(1, 6), st.booleans())
def test_assign_ranks_matches_reference(times, ranks, stages, equal):
    check_assign_ranks(times, ranks, stages, equal)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 5), st.integers(2, 6), st.booleans(), seeds)
def test_assign_ranks_improving_swaps_match_reference(ranks, stages, equal, seed):
    """Several micro-batches per rank and a bubble term (stages > 1): the only inputs on which the
    swap search's bookkeeping of the slowest rank's largest micro-batch changes the result."""
    rng = np.random.default_rng(seed)
    for _ in range(4):
        m = int(rng.integers(2 * ranks, 25))
        check_assign_ranks(rng.uniform(0.001, 10.0, m).tolist(), ranks, stages, equal)


@settings(max_examples=100, deadline=None)
@given(tied_times_st)
def test_candidate_orders_match_reference(times):
    if len(times) < 2:  # order_ranks only asks for candidates of two or more micro-batches
        times = times + [1.0, 1.0]
    got = candidate_orders(np.array(times)).tolist()
    assert got == candidate_orders_reference(times)
    assert all(sorted(order) == list(range(len(times))) for order in got)


@settings(max_examples=60, deadline=None)
@given(tied_times_st.filter(len), st.integers(1, 5), st.sampled_from([0, 1]), st.floats(0.1, 0.9), seeds)
def test_simulate_rank_matches_reference(times, stages, kind, fwd_fraction, seed):
    rng = np.random.default_rng(seed)
    k = len(times)
    p2p = rng.choice([0.0, 0.01, 0.3], k)
    ops = schedule_kernel(stages, k, kind)
    got = simulate_rank(np.array(times), p2p, fwd_fraction, stages, ops)
    assert got == simulate_rank_reference(times, p2p, fwd_fraction, stages, ops)


@settings(max_examples=60, deadline=None)
@given(tied_times_st, st.integers(1, 4), st.integers(1, 4), st.sampled_from([0, 1]), st.booleans(), seeds)
def test_order_ranks_matches_reference(times, ranks, stages, kind, optimize, seed):
    rng = np.random.default_rng(seed)
    m = len(times)
    t = np.array(times, np.float64)
    p2p = rng.choice([0.0, 0.05, 0.2], m)
    rank_of = rng.integers(0, ranks, m).astype(np.int32)  # some ranks may get nothing
    mem = np.ones(m)
    perm, rank_time, _ = order_ranks_schedule(t, p2p, mem, rank_of, ranks, 1.0 / 3.0, stages, kind, np.inf, optimize)
    ref_perm, ref_time, _ = order_ranks_schedule_reference(t, p2p, mem, rank_of, ranks, 1.0 / 3.0, stages, kind,
                                                           np.inf, optimize)
    assert (perm.tolist(), rank_time.tolist()) == (ref_perm, ref_time)
    assert sorted(ref_perm) == list(range(m))


@settings(max_examples=60, deadline=None)
@given(tied_times_st, st.integers(1, 4), st.integers(1, 4), st.sampled_from([0, 1]), st.integers(1, 6), seeds)
def test_balance_simulated_matches_reference(times, ranks, stages, kind, top, seed):
    rng = np.random.default_rng(seed)
    m = len(times)
    t = np.array(times, np.float64)
    p2p = rng.choice([0.0, 0.05, 0.2], m)
    rank_of = rng.integers(0, ranks, m).astype(np.int32)  # some ranks may get nothing
    counts = np.bincount(rank_of, minlength=ranks)
    ops = schedules_by_count(stages, int(counts.max(initial=0)), kind)
    got = balance_simulated(t, p2p, rank_of, ranks, 1.0 / 3.0, stages, ops, 8, top)
    ref = balance_simulated_reference(t, p2p, rank_of, ranks, 1.0 / 3.0, stages, ops, 8, top)
    assert got.tolist() == ref
    assert np.array_equal(np.bincount(got, minlength=ranks), counts)  # swaps only: counts kept


# ----------------------------------------------------------------------------- simulate


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(0, 12), st.sampled_from([0, 1]))
def test_schedule_matches_reference(S, M, kind):
    assert schedule_kernel(S, M, kind).tolist() == schedule_reference(S, M, kind)


def random_pipeline(seed):
    """Stage times with ties, transfers and independent random stage orders (often deadlocked)."""
    rng = np.random.default_rng(seed)
    S, M = int(rng.integers(1, 5)), int(rng.integers(1, 7))
    fwd = rng.choice([0.5, 1.0, 1.5], (S, M)) if rng.random() < 0.5 else rng.exponential(1.0, (S, M))
    bwd = 2 * fwd if rng.random() < 0.5 else rng.exponential(2.0, (S, M))
    p2p = rng.choice([0.0, 0.1], M)
    if rng.random() < 0.5:
        ops = schedule_kernel(S, M, int(rng.integers(0, 2)))
    else:
        ops = np.array([random_stage_order(rng, M) for _ in range(S)], np.int32)
    return fwd, bwd, p2p, ops, rng


@settings(max_examples=150, deadline=None)
@given(seeds)
def test_simulate_and_makespan_match_reference(seed):
    fwd, bwd, p2p, ops, _ = random_pipeline(seed)
    S, M = fwd.shape
    start, end = np.empty((S, M, 2)), np.empty((S, M, 2))
    code = simulate_kernel(fwd, bwd, p2p, ops, start, end)
    ref_start, ref_end, dead = simulate_reference(fwd, bwd, p2p, ops)
    assert code == int(dead)
    np.testing.assert_array_equal(start, ref_start)
    np.testing.assert_array_equal(end, ref_end)
    assert makespan_kernel(fwd, bwd, p2p, ops) == makespan_reference(fwd, bwd, p2p, ops)


@settings(max_examples=100, deadline=None)
@given(seeds, st.sampled_from(["zero", "too_big", "too_small", "short", "extra_stage"]))
def test_makespan_of_malformed_ops_matches_reference(seed, defect):
    """NaN for a bad op code a stage reaches, +inf when the stage deadlocks before reaching it."""
    fwd, bwd, p2p, ops, rng = random_pipeline(seed)
    S, M = fwd.shape
    ops = ops.copy()
    s, q = int(rng.integers(S)), int(rng.integers(2 * M))
    if defect == "short":
        ops = np.ascontiguousarray(ops[:, :-1])  # contiguous, as the library passes ops (one compile)
    elif defect == "extra_stage":
        ops = np.concatenate([ops, ops[:1]])
    else:
        ops[s, q] = {"zero": 0, "too_big": M + 1, "too_small": -(M + 1)}[defect]
    got, want = makespan_kernel(fwd, bwd, p2p, ops), makespan_reference(fwd, bwd, p2p, ops)
    assert got == want or (np.isnan(got) and np.isnan(want))


def test_makespan_of_nothing_matches_reference():
    for S in (1, 3):
        fwd = np.zeros((S, 0))
        ops = np.zeros((S, 0), np.int32)
        assert makespan_kernel(fwd, fwd, np.zeros(0), ops) == makespan_reference(fwd, fwd, np.zeros(0), ops) == 0.0


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5), st.integers(0, 8), seeds)
def test_inflight_matches_reference(S, M, seed):
    rng = np.random.default_rng(seed)
    ops = np.array([random_stage_order(rng, M) for _ in range(S)], np.int32).reshape(S, 2 * M)
    mem = rng.choice([0.0, 1e9, 1e9, 3.3e8], M) if rng.random() < 0.5 else rng.exponential(1e9, M)
    peak_n, peak_b = np.empty(S, np.int64), np.empty(S)
    inflight_kernel(ops, mem, peak_n, peak_b)
    assert (peak_n.tolist(), peak_b.tolist()) == inflight_reference(ops, mem)


# ----------------------------------------------------------------------------- cost


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 64), st.integers(0, 4096), st.integers(0, 512), st.integers(0, 6), st.sampled_from([0, 1025]),
       st.booleans())
def test_padded_features_match_reference(rows, main_len, dec_len, tiles, tile_patches, padding):
    out = np.full(NUM_FEATURES, np.nan)
    padded_features(rows, main_len, dec_len, tiles, tile_patches, out, padding)
    assert out.tolist() == padded_features_reference(rows, main_len, dec_len, tiles, tile_patches, padding)


grid_st = st.lists(st.integers(0, 600), min_size=1, max_size=4, unique=True).map(sorted)


@settings(max_examples=150, deadline=None)
@given(grid_st, grid_st, grid_st, st.integers(-20, 700), st.integers(-20, 700), st.integers(-20, 700),
       st.booleans(), seeds)
def test_profiled_lookup_matches_reference(gr, gl, gd, rows, main_len, dec_len, extrapolate, seed):
    rng = np.random.default_rng(seed)
    grids = [np.array(g, np.float64) for g in (gr, gl, gd)]
    # Some negative entries, so extrapolation can hit the clip at zero; some points on grid nodes.
    values = rng.choice([-1.0, 0.0, 0.5, 2.0], (len(gr), len(gl), len(gd))) * rng.exponential(1.0, (len(gr), len(gl),
                                                                                                       len(gd)))
    if rng.random() < 0.3:
        rows, main_len, dec_len = (int(rng.choice(g)) for g in (gr, gl, gd))
    got = profiled_lookup(*grids, values, rows, main_len, dec_len, extrapolate)
    assert got == profiled_lookup_reference(*grids, values, rows, main_len, dec_len, extrapolate)


# ----------------------------------------------------------------------------- dp


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(1e-4, 1e4, allow_nan=False, allow_infinity=False), min_size=1, max_size=200),
       st.integers(0, 10), st.integers(2, 64))
def test_pick_caps_matches_reference(values, lo, count):
    v = np.unique(np.array(values))
    lo = min(lo, len(v) - 1)
    assert pick_caps(v, lo, count).tolist() == pick_caps_reference(v, lo, count)


@settings(max_examples=150, deadline=None)
@given(st.lists(time_st, min_size=1, max_size=300), st.integers(0, 400), st.integers(0, 400), st.integers(2, 64))
def test_pick_caps_between_matches_pick_caps_of_the_sorted_times(times, a, b, count):
    """The DP's caps without sorting its segment times: the same picks as `pick_caps` (and so as
    its reference) over the sorted distinct times between two of them, repeats included."""
    t = np.array(times)
    v = np.unique(t)
    lo, hi = sorted((v[a % len(v)], v[b % len(v)]))
    window = v[(v >= lo) & (v <= hi)]
    got = pick_caps_between(t, lo, hi, count).tolist()
    assert got == pick_caps(window, 0, count).tolist() == pick_caps_reference(window, 0, count)
    lo_index = int(np.searchsorted(v, lo))
    assert pick_caps_between(t, lo, v[-1], count).tolist() == pick_caps_reference(v, lo_index, count)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.0, 2.5]) | st.floats(0.0, 5.0), max_size=30),
       st.sampled_from([0.0, 0.75, 2.0]), st.sampled_from([np.inf, 3.0, 6.0]) | st.floats(0.5, 40.0))
def test_capped_partition_cost_matches_reference(w, fixed, cap):
    w = np.sort(np.array(w, np.float64))
    assert capped_partition_cost(w, fixed, cap) == capped_partition_cost_reference(w, fixed, cap)


# ----------------------------------------------------------------------------- packing


# Round lengths and capacities make equally tight rows (best-fit ties) and exact fits common.
round_len_st = st.sampled_from([50, 100, 100, 150, 200])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(round_len_st | st.integers(1, 300), st.integers(0, 60)), min_size=1, max_size=40),
       st.booleans(), st.sampled_from([200, 300, 400]) | st.integers(100, 400), st.integers(0, 80))
def test_pack_rows_matches_reference(samples, best_fit, cap_main, cap_dec):
    main = np.array([s[0] for s in samples], np.int64)
    dec = np.array([s[1] for s in samples], np.int64)
    order = np.argsort(-main, kind="stable")
    row, nrows = pack_rows(order, main, dec, cap_main, cap_dec, best_fit)
    ref_row, ref_n = pack_rows_reference(order, main, dec, cap_main, cap_dec, best_fit)
    assert (row.tolist(), nrows) == (ref_row, ref_n)
    for r in range(nrows):  # capacity holds (lengths beyond a row are truncated to it)
        assert np.minimum(main[order][row == r], cap_main).sum() <= cap_main


@settings(max_examples=80, deadline=None)
@given(st.lists(round_len_st | st.integers(1, 2048), min_size=1, max_size=60),
       st.sampled_from([400, 600, 1200]) | st.integers(64, 8192), st.sampled_from([1, 8]))
def test_budget_cuts_matches_reference(lengths, budget, multiple):
    s = np.sort(np.array(lengths, np.int64))
    assert budget_cuts(s, budget, multiple).tolist() == budget_cuts_reference(s, budget, multiple)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=80), st.integers(1, 2000))
def test_greedy_cuts_matches_reference(tokens, budget):
    t = np.array(tokens, np.int64)
    assert greedy_cuts(t, budget).tolist() == greedy_cuts_reference(t, budget)


# ----------------------------------------------------------------------------- collate rows


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=6), st.integers(0, 3), st.booleans(), seeds)
def test_pad_rows_matches_reference(lengths, extra, with_mask, seed):
    rng = np.random.default_rng(seed)
    lengths = np.array(lengths, np.int64)
    flat = rng.integers(0, 50_000, int(lengths.sum())).astype(np.int64)
    width = int(lengths.max(initial=0)) + extra
    out = np.empty((len(lengths), width), np.int64)
    mask = np.empty((len(lengths), width) if with_mask else (0, 0), np.int64)
    pad_rows(flat, lengths, -100, out, mask)
    rows, ref_mask = pad_rows_reference(flat, lengths, -100, width)
    assert out.tolist() == rows
    if with_mask:
        assert mask.tolist() == ref_mask


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(0, 30), st.integers(1, 4), st.booleans(), seeds)
def test_assign_stages_matches_reference(stages, m, ranks, equal, seed):
    from dynabatch.core.kernels.stage_assign import assign_stages, assign_stages_reference

    rng = np.random.default_rng(seed)
    times = rng.choice([0.5, 1.0, 1.5, 2.0, 3.25], size=(stages, m))  # ties on purpose
    own = times.mean(axis=0)
    order = np.argsort(-times.max(axis=0), kind="mergesort").astype(np.int64) if m else np.zeros(0, np.int64)
    cap = m // ranks if equal else m
    if equal and m % ranks:
        m2 = m - m % ranks
        times, own, order = times[:, :m2], own[:m2], np.argsort(-times[:, :m2].max(axis=0), kind="mergesort")
        cap = m2 // ranks
    got = assign_stages(np.ascontiguousarray(times), own, order.astype(np.int64), ranks, cap, equal, 50)
    want = assign_stages_reference(times, own, order, ranks, cap, equal, 50)
    assert np.array_equal(got, want)
    if equal and len(got):
        assert np.all(np.bincount(got, minlength=ranks) == cap)


@settings(max_examples=100, deadline=None)
@given(tied_times_st.filter(len), st.integers(1, 8), st.integers(1, 8))
def test_objective_matches_reference(times, ranks, stages):
    t = np.array(times, np.float64)
    got = objective_kernel(float(t.sum()), float(t.max()), ranks, stages)
    assert got == objective_reference(float(t.sum()), float(t.max()), ranks, stages)
    assert got == float(t.sum()) / ranks + (stages - 1) * float(t.max())
    arr = objective_kernel(t, t[::-1].copy(), 1, stages)  # element-wise, as the assignment kernels use it
    assert arr.tolist() == [objective_reference(a, b, 1, stages) for a, b in zip(t, t[::-1])]


@settings(max_examples=60, deadline=None)
@given(tied_times_st.filter(len), st.integers(1, 5), st.floats(0.1, 0.9))
def test_split_matches_reference(times, stages, fwd_fraction):
    stage_t = np.array([times] * stages, np.float64) * np.arange(1, stages + 1)[:, None]
    fwd, bwd = split_kernel(stage_t, fwd_fraction)
    rf, rb = split_reference(stage_t, fwd_fraction)
    assert fwd.tolist() == rf.tolist() and bwd.tolist() == rb.tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 300)), max_size=40), st.integers(0, 2**32 - 1))
def test_pread_ragged_matches_reference(ranges, seed):
    """Byte ranges of a 4 KiB file, some of them past its end (the first such range is reported)."""
    from dynabatch.index.reads import pread_ragged, pread_ragged_reference

    data = np.random.default_rng(seed).integers(0, 256, 4096, dtype=np.uint8)
    r, w = os.pipe()  # a pipe cannot pread: every range of it fails
    os.close(w)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "f.bin")
        data.tofile(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            offsets = np.array([o for o, _ in ranges], np.int64)
            nbytes = np.array([n for _, n in ranges], np.int64)
            for f in (fd, r):
                got, want = (np.full(int(nbytes.sum()), 7, np.uint8) for _ in range(2))
                bad = pread_ragged(f, offsets, nbytes, got)
                assert bad == pread_ragged_reference(f, offsets, nbytes, want)
                ok = len(ranges) if bad < 0 else bad
                assert got[:nbytes[:ok].sum()].tobytes() == want[:nbytes[:ok].sum()].tobytes()
                if f == fd:
                    assert bad == next((i for i, (o, n) in enumerate(ranges) if n and o + n > 4096), -1)
                    assert got[:nbytes[:ok].sum()].tobytes() == b"".join(
                        data[o:o + n].tobytes() for o, n in ranges[:ok])
                else:
                    assert bad == next((i for i, (_, n) in enumerate(ranges) if n), -1)
        finally:
            os.close(fd)
            os.close(r)


def test_extrapolation_above_the_grid_never_makes_a_larger_shape_cheaper():
    """A profile whose largest row count measured faster than the one before (timer noise on a busy
    machine) made the linear extrapolation fall to 0 s at 64 rows; above the grid a lookup is now never
    below the edge's value in proportion (16 rows -> 64 rows: 4x), in the kernel and its reference."""
    grids = (np.array([1.0, 4.0, 16.0]), np.array([32.0, 64.0]), np.array([0.0]))
    values = np.zeros((3, 2, 1))
    values[:, :, 0] = [[0.010, 0.012], [0.020, 0.030], [0.015, 0.025]]  # 16 rows noisily faster than 4
    for fn in (profiled_lookup, profiled_lookup_reference):
        t64, t16 = fn(*grids, values, 64, 64, 0, True), fn(*grids, values, 16, 64, 0, True)
        assert t16 == 0.025 and t64 == pytest.approx(4 * 0.025)  # the old lookup: max(0.025 - 0.005 * 8, 0) = 0
        assert fn(*grids, values, 16, 128, 0, True) >= 2 * 0.025  # 2x the longest profiled length
        assert fn(*grids, values, 2, 48, 0, True) == fn(*grids, values, 2, 48, 0, False)  # inside: unchanged
