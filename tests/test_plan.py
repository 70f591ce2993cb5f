"""Planner core: the numba DP against its plain-Python reference and a brute force, and the
invariants of `plan_microbatches` (memory, exactly-once, equal counts, determinism, quality)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dynabatch import Shapes
from dynabatch.planfile import plan_to_arrow
from dynabatch.core.kernels.assign import assign_ranks_reference
from dynabatch.core.kernels.dp import (INFEASIBLE_SAMPLE, NO_EQUAL_SPLIT, TOO_FEW_SAMPLES, DPSearch, dp_kernel,
                                      dp_reference, segment_cost)
from dynabatch.core.plan.baselines import BASELINE_COLLATION, BASELINE_KNOBS
from dynabatch.core.cost.model import FEATURES, NUM_FEATURES, CostModel
from dynabatch.core.plan.planner import METHODS, PlanningError, plan_microbatches

DP_METHODS = ("dp", "dp_varlen")
BASELINE_METHODS = tuple(m for m in METHODS if m not in DP_METHODS)
TILE_PATCHES = 1025



# ----------------------------------------------------------------------------- helpers


def base_coefs():
    """Time/memory coefficients with every feature in use: t5's (main, decoder, cross terms)
    plus vlm's vision terms (t5 has none)."""
    t5, vlm = CostModel.preset("t5"), CostModel.preset("vlm")
    t = t5.time_coef.copy()
    m = t5.mem_coef.copy()
    for k in (5, 6, 8):
        t[k] = vlm.time_coef[k]
    m[5] = vlm.mem_coef[5]
    m[7] = 1e6  # a fixed per-micro-batch workspace
    t[FEATURES.index("q_pad")] = 0.5 * t[1]  # a padding mask's attention (analytic presets price it at 0)
    return t, m


BASE_T, BASE_M = base_coefs()


def seg_features(main, dec, tiles, j, i, varlen, pad):
    """Independent feature vector of samples j..i-1 (the cost module's documented definition).
    ``varlen``: False (padded), True (packed, attention per sample) or "dense" (packed, the row of N
    main / Nt decoder tokens attended whole with a mask: N**2, Nt**2, Nt * N, and q_pad = N**2 for a
    row of several samples)."""
    phi = np.zeros(NUM_FEATURES)
    if varlen:
        for s in range(j, i):
            L, T, v = float(main[s]), float(dec[s]), float(tiles[s]) * TILE_PATCHES
            phi[:7] += (L, L * L, T, T * T, T * L, v, v * TILE_PATCHES)
        phi[7] = 1.0
        phi[8] = float(phi[5] > 0)
        if varlen == "dense":
            n, t = phi[0], phi[2]
            phi[1], phi[3], phi[4] = n * n, t * t, t * n
            phi[FEATURES.index("q_pad")] = n * n if i - j > 1 else 0.0
        return phi
    r = i - j
    L = -(-int(max(main[j:i])) // pad) * pad
    T = -(-int(max(dec[j:i])) // pad) * pad
    v = float(sum(int(x) for x in tiles[j:i])) * TILE_PATCHES
    q_pad = r * L * L if min(main[j:i]) < L else 0.0  # some row shorter than the padded length
    return np.array([r * L, r * L * L, r * T, r * T * T, r * T * L, v, v * TILE_PATCHES, 1.0, float(v > 0), q_pad])


def _dot(coef, phi):
    """Left-to-right dot product: the summation order of the kernel and of the reference, so a
    limit equal to a segment's memory is compared bit-for-bit."""
    s = 0.0
    for c, p in zip(coef, phi):
        s += float(c) * float(p)
    return s


def seg_cost(main, dec, tiles, j, i, varlen, pad, tcoef, mcoef):
    phi = seg_features(main, dec, tiles, j, i, varlen, pad)
    return _dot(tcoef, phi), _dot(mcoef, phi)


def objective(times, ranks, stages):
    return sum(times) / ranks + (stages - 1) * max(times)


def slowest_rank(times, ranks, equal):
    """Seconds of the slowest rank once ``times`` are spread by the planner's assignment (one stage)."""
    per_rank = [0.0] * ranks
    for t, r in zip(times, assign_ranks_reference(times, ranks, 1, equal)):
        per_rank[r] += t
    return max(per_rank)


def dp_objective(times, ranks, stages, equal):
    """What the DP minimizes: on one stage with several ranks the slowest rank, else `objective`."""
    return slowest_rank(times, ranks, equal) if stages == 1 and ranks > 1 else objective(times, ranks, stages)


def partition_times(main, dec, tiles, starts, varlen, pad, tcoef, mcoef, limit):
    """Segment times of a partition, asserting it is a valid, memory-feasible cover."""
    n = len(main)
    starts = [int(x) for x in starts]
    assert starts[0] == 0
    assert all(a < b for a, b in zip(starts, starts[1:]))
    assert starts[-1] < n
    times = []
    for a, b in zip(starts, starts[1:] + [n]):
        t, m = seg_cost(main, dec, tiles, a, b, varlen, pad, tcoef, mcoef)
        assert m <= limit, f"segment {a}:{b} needs {m} bytes > limit {limit}"
        times.append(t)
    return times


def call_kernel(main, dec, tiles, varlen, pad, tcoef, mcoef, limit, ranks, stages, max_caps, equal=True):
    starts, status = dp_kernel(main, dec, tiles, segment_cost(bool(varlen), pad, TILE_PATCHES, tcoef, mcoef, limit,
                                                              dense=varlen == "dense"),
                               DPSearch(ranks, stages, max_caps, bool(equal)))
    return [int(x) for x in starts], int(status)


def call_reference(main, dec, tiles, varlen, pad, tcoef, mcoef, limit, ranks, stages, max_caps, equal=True):
    starts, status = dp_reference(main, dec, tiles, segment_cost(bool(varlen), pad, TILE_PATCHES, tcoef, mcoef,
                                                                 limit, dense=varlen == "dense"),
                                  DPSearch(ranks, stages, max_caps, bool(equal)))
    return (None if starts is None else [int(x) for x in starts]), int(status)


@st.composite
def dp_cases(draw, max_n=14, ranks=st.integers(1, 4)):
    n = draw(st.integers(1, max_n))
    main = np.array(draw(st.lists(st.integers(1, 300), min_size=n, max_size=n)), np.int64)
    dec = np.array(draw(st.lists(st.integers(0, 40), min_size=n, max_size=n)), np.int64)
    tiles = np.array(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), np.int64)
    scale_t = np.array(draw(st.lists(st.floats(0.25, 4.0), min_size=NUM_FEATURES, max_size=NUM_FEATURES)))
    scale_m = np.array(draw(st.lists(st.floats(0.25, 4.0), min_size=NUM_FEATURES, max_size=NUM_FEATURES)))
    tcoef = np.ascontiguousarray(BASE_T * scale_t)
    mcoef = np.ascontiguousarray(BASE_M * scale_m)
    varlen = draw(st.sampled_from([False, True, "dense"]))
    pad = draw(st.sampled_from([1, 8]))
    single = max(seg_cost(main, dec, tiles, i, i + 1, varlen, pad, tcoef, mcoef)[1] for i in range(n))
    whole = seg_cost(main, dec, tiles, 0, n, varlen, pad, tcoef, mcoef)[1]
    mode = draw(st.sampled_from(["exact", "tight", "tight2", "between", "loose", "infeasible"]))
    event(f"limit {mode}")
    limit = {
        "exact": single,  # the costliest sample fits with no slack at all
        "tight": single * 1.2,  # many cuts
        "tight2": single * 2.0,
        "between": single + draw(st.floats(0.0, 1.0)) * max(whole - single, 0.0),
        "loose": max(whole, single) * 1.01,  # no memory cut at all
        "infeasible": single * 0.9,  # some sample cannot fit alone
    }[mode]
    return dict(main=main, dec=dec, tiles=tiles, varlen=varlen, pad=pad, tcoef=tcoef, mcoef=mcoef, limit=limit,
                ranks=draw(ranks), stages=draw(st.integers(1, 4)), equal=draw(st.booleans()))


def case_args(case, ranks=None, max_caps=128):
    return (case["main"], case["dec"], case["tiles"], case["varlen"], case["pad"], case["tcoef"], case["mcoef"],
            case["limit"], case["ranks"] if ranks is None else ranks, case["stages"], max_caps, case["equal"])


# ----------------------------------------------------------------------------- 1. DP vs reference


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=dp_cases(), max_caps=st.sampled_from([4, 128]))
def test_dp_kernel_matches_reference(case, max_caps):
    args = case_args(case, max_caps=max_caps)
    k_starts, k_status = call_kernel(*args)
    r_starts, r_status = call_reference(*args)
    assert k_status == r_status
    n, ranks, stages, equal = len(case["main"]), case["ranks"], case["stages"], case["equal"]
    event(f"status {k_status}, ranks>1: {ranks > 1}, equal counts: {equal}")
    if k_status == INFEASIBLE_SAMPLE:
        assert k_starts == r_starts  # the same (first) sample that cannot fit alone
        bad = k_starts[0]
        _, m = seg_cost(case["main"], case["dec"], case["tiles"], bad, bad + 1, case["varlen"], case["pad"],
                        case["tcoef"], case["mcoef"])
        assert m > case["limit"]
        return
    if k_status == TOO_FEW_SAMPLES:
        assert n < ranks and equal
        return
    if k_status == NO_EQUAL_SPLIT:
        # only when even the finest split (one sample each) is short of the next multiple of R
        assert equal and ranks > 1 and n % ranks != 0
        assert not k_starts and not r_starts
        return
    assert k_status == 0
    kw = dict(varlen=case["varlen"], pad=case["pad"], tcoef=case["tcoef"], mcoef=case["mcoef"], limit=case["limit"])
    kt = partition_times(case["main"], case["dec"], case["tiles"], k_starts, **kw)
    rt = partition_times(case["main"], case["dec"], case["tiles"], r_starts, **kw)
    if equal:
        assert len(kt) % ranks == 0 and len(rt) % ranks == 0
    ko, ro = dp_objective(kt, ranks, stages, equal), dp_objective(rt, ranks, stages, equal)
    assert ko == pytest.approx(ro, rel=1e-12, abs=0)


def brute_force_min(main, dec, tiles, varlen, pad, tcoef, mcoef, limit, ranks, stages, divide_by=None):
    """min over every contiguous partition (all segments under the limit, a multiple of ``ranks``
    segments) of sum / divide_by (default ``ranks``) + (S-1) * max; inf when there is none."""
    divide_by = ranks if divide_by is None else divide_by
    n = len(main)
    best = np.inf
    for cuts in itertools.product((0, 1), repeat=n - 1):
        starts = [0] + [k + 1 for k, c in enumerate(cuts) if c]
        if len(starts) % ranks:
            continue
        times = []
        for a, b in zip(starts, starts[1:] + [n]):
            t, m = seg_cost(main, dec, tiles, a, b, varlen, pad, tcoef, mcoef)
            if m > limit:
                break
            times.append(t)
        else:
            best = min(best, objective(times, divide_by, stages))
    return best


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=dp_cases(max_n=10, ranks=st.just(1)))
def test_dp_kernel_is_exact_optimum_with_all_caps(case):
    # 10 samples have at most 55 segments, so 128 caps cover every distinct segment time.
    starts, status = call_kernel(*case_args(case, ranks=1))
    best = brute_force_min(case["main"], case["dec"], case["tiles"], case["varlen"], case["pad"], case["tcoef"],
                           case["mcoef"], case["limit"], 1, case["stages"])
    if status == INFEASIBLE_SAMPLE:
        assert best == np.inf
        return
    assert status == 0
    times = partition_times(case["main"], case["dec"], case["tiles"], starts, varlen=case["varlen"],
                            pad=case["pad"], tcoef=case["tcoef"], mcoef=case["mcoef"], limit=case["limit"])
    assert objective(times, 1, case["stages"]) == pytest.approx(best, rel=1e-12, abs=0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=dp_cases(max_n=10, ranks=st.integers(2, 4)))
def test_dp_kernel_is_exact_optimum_for_several_ranks_with_all_caps(case):
    """With every cap available the R > 1 search is exact too: with equal counts, the best
    partition whose number of micro-batches is a multiple of R (the cap equal to its largest
    micro-batch is never pruned, since that cap's unconstrained objective is no larger); without,
    the best partition of all."""
    ranks, equal = case["ranks"], case["equal"]
    starts, status = call_kernel(*case_args(case))
    best = brute_force_min(case["main"], case["dec"], case["tiles"], case["varlen"], case["pad"], case["tcoef"],
                           case["mcoef"], case["limit"], ranks if equal else 1, case["stages"], divide_by=ranks)
    if status != 0:
        assert best == np.inf
        assert status == INFEASIBLE_SAMPLE or (equal and status in (TOO_FEW_SAMPLES, NO_EQUAL_SPLIT))
        return
    times = partition_times(case["main"], case["dec"], case["tiles"], starts, varlen=case["varlen"],
                            pad=case["pad"], tcoef=case["tcoef"], mcoef=case["mcoef"], limit=case["limit"])
    assert not equal or len(times) % ranks == 0
    if case["stages"] > 1:
        assert objective(times, ranks, case["stages"]) == pytest.approx(best, rel=1e-12, abs=0)
        return
    # one stage: the slowest rank, no worse than that of any partition of the least sum, no better
    # than the best of all partitions
    parts = all_partitions(case, ranks if equal else 1)
    least = min(sum(t) for t in parts)
    assert sum(times) / ranks >= least / ranks * (1 - 1e-12)
    mine = slowest_rank(times, ranks, equal)
    assert mine <= max(slowest_rank(t, ranks, equal) for t in parts if sum(t) <= least * (1 + 1e-12)) * (1 + 1e-12)
    assert mine >= min(slowest_rank(t, ranks, equal) for t in parts) * (1 - 1e-12)


def all_partitions(case, multiple):
    """Segment times of every contiguous partition of ``case`` under its memory limit with a multiple of
    ``multiple`` segments."""
    main, n = case["main"], len(case["main"])
    out = []
    for cuts in itertools.product((0, 1), repeat=n - 1):
        starts = [0] + [k + 1 for k, c in enumerate(cuts) if c]
        if len(starts) % multiple:
            continue
        costs = [seg_cost(main, case["dec"], case["tiles"], a, b, case["varlen"], case["pad"], case["tcoef"],
                          case["mcoef"]) for a, b in zip(starts, starts[1:] + [n])]
        if all(m <= case["limit"] for _, m in costs):
            out.append([t for t, _ in costs])
    return out


def test_one_stage_plans_balance_the_ranks():
    """On one stage the step waits for the slowest rank: a FLAN-like step of mostly truncated long
    samples and a few short ones on 2 ranks (the bench trainer's shape). The sum alone is least with the
    long ones in one micro-batch (its rank 1.77x the mean rank, as the bench measured); the planner cuts
    more micro-batches where that shortens the slowest rank, so its slowest rank is the mean within 5%
    and a fifth below the least-sum plan's, though its sum is larger (more per-micro-batch overheads)."""
    cost = CostModel.preset("gpt", "cpu")
    rng = np.random.default_rng(0)
    lengths = np.concatenate([np.full(14, 512), rng.integers(150, 320, 5)])
    shapes = Shapes.from_lengths(lengths)
    plan = plan_microbatches(shapes, cost, num_stages=1, num_ranks=2, max_len=512)
    per_rank = np.array([plan.mb_time_s[plan.mb_rank == r].sum() for r in range(2)])
    assert per_rank.max() / per_rank.mean() < 1.05, per_rank
    main, dec, tiles = cost.sample_dims(shapes, 512, None)
    main = np.sort(main)
    least = least_sum_times(lambda a, b: seg_cost(main, dec, tiles, a, b, False, cost.pad_multiple, cost.time_coef,
                                                  cost.mem_coef)[0], len(main), 2)
    assert slowest_rank(least, 2, True) / (sum(least) / 2) > 1.5, least
    assert per_rank.max() < 0.8 * slowest_rank(least, 2, True)
    assert plan.mb_time_s.sum() > sum(least)


def least_sum_times(price, n, multiple):
    """Segment times of the contiguous partition of ``n`` ordered samples with the least summed
    ``price(a, b)`` (samples a..b-1) among those with a multiple of ``multiple`` segments (a plain DP)."""
    best = {(0, 0): (0.0, [])}
    for i in range(1, n + 1):
        for j in range(i):
            t = price(j, i)
            for c in range(multiple):
                if (j, c) in best:
                    v, times = best[(j, c)]
                    key = (i, (c + 1) % multiple)
                    if key not in best or v + t < best[key][0]:
                        best[key] = (v + t, times + [t])
    return best[(n, 0)][1]


def test_dp_kernel_with_few_caps_can_miss_the_optimum_but_all_caps_cannot():
    """Guards the brute-force test's premise: the kernel is only approximate with few caps."""
    rng = np.random.default_rng(3)
    missed = 0
    for _ in range(40):
        n = 10
        main = rng.integers(1, 300, n).astype(np.int64)
        dec = rng.integers(0, 40, n).astype(np.int64)
        tiles = np.zeros(n, np.int64)
        single = max(seg_cost(main, dec, tiles, i, i + 1, False, 8, BASE_T, BASE_M)[1] for i in range(n))
        limit = single * 3
        best = brute_force_min(main, dec, tiles, False, 8, BASE_T, BASE_M, limit, 1, 4)
        s_all, _ = call_kernel(main, dec, tiles, False, 8, BASE_T, BASE_M, limit, 1, 4, 128)
        t_all = partition_times(main, dec, tiles, s_all, varlen=False, pad=8, tcoef=BASE_T, mcoef=BASE_M, limit=limit)
        assert objective(t_all, 1, 4) == pytest.approx(best, rel=1e-12)
        s2, _ = call_kernel(main, dec, tiles, False, 8, BASE_T, BASE_M, limit, 1, 4, 2)
        t2 = partition_times(main, dec, tiles, s2, varlen=False, pad=8, tcoef=BASE_T, mcoef=BASE_M, limit=limit)
        assert objective(t2, 1, 4) >= best * (1 - 1e-12)
        missed += objective(t2, 1, 4) > best * (1 + 1e-9)
    assert missed > 0


def test_dp_kernel_status_codes():
    main = np.array([10, 20, 30], np.int64)
    z = np.zeros(3, np.int64)
    # two ranks, one sample: too few (unless equal counts are not required)
    s, status = call_kernel(main[:1], z[:1], z[:1], False, 8, BASE_T, BASE_M, 1e30, 2, 1, 8)
    assert status == TOO_FEW_SAMPLES
    s, status = call_kernel(main[:1], z[:1], z[:1], False, 8, BASE_T, BASE_M, 1e30, 2, 1, 8, False)
    assert status == 0 and s == [0]
    # the middle sample alone needs more than the limit
    big = np.array([10, 2000, 30], np.int64)
    limit = seg_cost(big, z, z, 2, 3, False, 8, BASE_T, BASE_M)[1] * 1.5
    s, status = call_kernel(big, z, z, False, 8, BASE_T, BASE_M, limit, 1, 1, 8)
    assert status == INFEASIBLE_SAMPLE and s == [1]
    # 3 samples that must each be alone cannot make a multiple of 2 micro-batches
    same = np.array([500, 500, 500], np.int64)
    one = seg_cost(same, z, z, 0, 1, False, 8, BASE_T, BASE_M)[1]
    s, status = call_kernel(same, z, z, False, 8, BASE_T, BASE_M, one * 1.5, 2, 4, 8)
    assert status == NO_EQUAL_SPLIT and s == []
    s, status = call_kernel(same, z, z, False, 8, BASE_T, BASE_M, one * 1.5, 2, 4, 8, False)
    assert status == 0 and s == [0, 1, 2]
    s, status = call_kernel(same, z, z, False, 8, BASE_T, BASE_M, one * 1.5, 3, 4, 8)
    assert status == 0 and s == [0, 1, 2]


@pytest.mark.parametrize("equal", [True, False])
@pytest.mark.parametrize("method", DP_METHODS)
def test_dp_without_equal_count_partition_keeps_every_sample(method, equal):
    """Regression: 7 samples that must each be alone and 2 ranks used to give a plan with zero
    micro-batches (every sample silently dropped)."""
    cm = CostModel.preset("gpt")
    shapes = Shapes.from_lengths(np.full(7, 1000), sample_id=np.arange(100, 107))
    one = float(cm.memory(cm.padded_features(1, 1000, 0, 0))[0])
    kw = dict(num_ranks=2, num_stages=2, memory_limit=one * 1.5, method=method, equal_microbatches=equal)
    if equal:
        with pytest.raises(PlanningError, match="equal_microbatches=False"):
            plan_microbatches(shapes, cm, **kw)
        return
    plan = plan_microbatches(shapes, cm, **kw)
    assert sorted(plan.sample_ids.tolist()) == list(range(100, 107))
    assert plan.num_microbatches == 7
    assert sorted(plan.microbatches_per_rank().tolist()) == [3, 4]


@pytest.mark.parametrize("max_caps", [0, 1])
def test_tiny_max_caps_is_refused(max_caps):
    """Regression: max_caps=0 segfaulted the interpreter and max_caps=1 raised ZeroDivisionError
    (run in a subprocess so that a crash fails this test instead of the session)."""
    code = textwrap.dedent(f"""
        import numpy as np
        from dynabatch import Shapes
        from dynabatch.core.cost.model import CostModel
        from dynabatch.core.plan.planner import plan_microbatches
        sh = Shapes.from_lengths(np.random.default_rng(0).integers(1, 3000, 50))
        try:
            plan_microbatches(sh, CostModel.preset("gpt"), num_stages=4, max_caps={max_caps})
        except ValueError as e:
            print("REFUSED", "max_caps" in str(e))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert "REFUSED True" in out.stdout


def test_small_max_caps_still_plans():
    sh = random_shapes(0, 60)
    for max_caps in (2, 3):
        plan = plan_microbatches(sh, CostModel.preset("gpt"), num_stages=4, num_ranks=2, max_caps=max_caps)
        np.testing.assert_array_equal(np.sort(plan.sample_ids), np.sort(sh.sample_id))


# ----------------------------------------------------------------------------- plan helpers


def random_shapes(seed, n, preset="gpt", id_offset=1000):
    rng = np.random.default_rng(seed)
    inp = np.clip(rng.lognormal(5.0, 1.0, n), 1, 3000).astype(np.int32)
    tgt = np.clip(rng.lognormal(3.5, 1.0, n), 1, 600).astype(np.int32) if preset == "t5" else None
    vis = (rng.integers(0, 4, n) * 256 - rng.integers(0, 100, n)).clip(0) if preset == "vlm" else None
    ids = rng.permutation(n).astype(np.int64) * 7 + id_offset  # not positions
    return Shapes.from_lengths(inp, tgt, vis, sample_id=ids)


def plan_kwargs(method, preset):
    # pack/pack_varlen need capacities that hold the longest sample
    if method in ("pack", "pack_varlen"):
        return {"max_len": 4096, "max_target_len": 1024 if preset == "t5" else None}
    return {}


def single_sample_memory(cm, shapes, varlen):
    main, dec, tiles = cm.sample_dims(shapes)
    if varlen:
        phi = cm.packed_features(main, dec, tiles, np.arange(len(main)))
    else:
        phi = cm.padded_features(1, main, dec, tiles)
    return cm.memory(phi)


# ----------------------------------------------------------------------------- 2. memory limit


@pytest.mark.parametrize("preset", ["gpt", "t5", "vlm"])
@pytest.mark.parametrize("seed", [0, 1])
def test_dp_micro_batches_never_exceed_memory_limit(preset, seed):
    cm = CostModel.preset(preset)
    shapes = random_shapes(seed, 60, preset)
    for method in DP_METHODS:
        single = single_sample_memory(cm, shapes, method == "dp_varlen").max()
        for factor in (1.0, 1.7, 4.0):
            limit = single * factor
            plan = plan_microbatches(shapes, cm, num_stages=4, num_ranks=2, memory_limit=limit, method=method)
            assert np.all(plan.mb_memory_bytes <= limit)
            if factor == 1.0:
                assert plan.mb_memory_bytes.max() > 0.5 * limit  # the limit binds, the test is not vacuous
        # The default limit too.
        plan = plan_microbatches(shapes, cm, num_stages=4, num_ranks=8, method=method)
        assert np.all(plan.mb_memory_bytes <= cm.memory_limit(4, 8))


@pytest.mark.parametrize("method", BASELINE_METHODS)
def test_baselines_flag_plans_over_the_memory_limit(method):
    cm = CostModel.preset("gpt")
    shapes = random_shapes(0, 80)
    single = single_sample_memory(cm, shapes, False).max()
    for limit in (single * 1.01, 1e18):
        plan = plan_microbatches(shapes, cm, num_stages=4, num_ranks=2, memory_limit=limit, method=method,
                                 **plan_kwargs(method, "gpt"))
        over = bool(np.any(plan.mb_memory_bytes > limit))
        assert plan.options.get("over_memory_limit", False) == over
        if limit == 1e18:
            assert not over


@pytest.mark.parametrize("method", DP_METHODS)
@pytest.mark.parametrize("preset", ["gpt", "t5"])
def test_sample_too_large_alone_raises_planning_error_naming_it(method, preset):
    cm = CostModel.preset(preset)
    shapes = random_shapes(2, 40, preset)
    main, _, _ = cm.sample_dims(shapes)
    victim = int(np.argsort(main)[len(main) // 2])  # a middle-length sample, not the first/last in any order
    inp = shapes.input_tokens.copy()
    inp[victim] = 100_000
    shapes = Shapes(shapes.sample_id, inp, shapes.target_tokens, shapes.vision_tokens, shapes.task_id)
    mem = single_sample_memory(cm, shapes, method == "dp_varlen")
    limit = float(np.sort(mem)[-2]) * 2  # everything else fits alone
    assert mem[victim] > limit
    with pytest.raises(PlanningError, match=rf"sample_id {int(shapes.sample_id[victim])}\b"):
        plan_microbatches(shapes, cm, num_stages=4, num_ranks=2, memory_limit=limit, method=method)


@pytest.mark.parametrize("method", BASELINE_METHODS)
def test_baseline_sample_too_large_alone_raises(method):
    cm = CostModel.preset("gpt")
    shapes = Shapes.from_lengths(np.array([100, 200, 300, 100_000, 150]), sample_id=np.arange(50, 55))
    limit = float(single_sample_memory(cm, shapes, False)[2]) * 3
    kw = {"max_len": 100_000} if method in ("pack", "pack_varlen") else {}
    with pytest.raises(PlanningError, match=r"sample_id 53\b"):
        plan_microbatches(shapes, cm, num_stages=4, num_ranks=1, memory_limit=limit, method=method, **kw)


# ----------------------------------------------------------------------------- 3. exactly once


LAYOUTS = [(1, 1), (1, 4), (2, 3), (4, 4), (7, 2), (8, 4)]


@pytest.mark.parametrize("preset", ["gpt", "t5", "vlm"])
@pytest.mark.parametrize("method", METHODS)
def test_every_sample_exactly_once(method, preset):
    cm = CostModel.preset(preset)
    for ranks, stages in LAYOUTS:
        for n in (23, 64):
            shapes = random_shapes(ranks * 100 + n, n, preset)
            # a binding limit: several samples per micro-batch, but not many (the default limit of
            # the vlm preset does not exist for 1 stage and 1 rank: its model state does not fit)
            limit = float(single_sample_memory(cm, shapes, False).max()) * 3
            plan = plan_microbatches(shapes, cm, num_stages=stages, num_ranks=ranks, method=method,
                                     memory_limit=limit, **plan_kwargs(method, preset))
            assert plan.sample_ids.dtype == np.int64
            np.testing.assert_array_equal(np.sort(plan.sample_ids), np.sort(shapes.sample_id))
            assert plan.num_ranks == ranks and len(plan.rank_time_s) == ranks
            assert np.all((plan.mb_rank >= 0) & (plan.mb_rank < ranks))
            assert np.all(np.diff(plan.mb_offsets) > 0)
            # micro-batches stored rank by rank, mb_order 0..k-1 within each rank
            assert np.all(np.diff(plan.mb_rank) >= 0)
            for r, k in enumerate(plan.microbatches_per_rank()):
                np.testing.assert_array_equal(plan.mb_order[plan.mb_rank == r], np.arange(k))
            assert plan.collation == ("padded" if method == "dp" else "packed" if method == "dp_varlen"
                                      else BASELINE_COLLATION[method])


@pytest.mark.parametrize("method", DP_METHODS)
@pytest.mark.parametrize("ranks,n", [(7, 23), (3, 10), (5, 5), (8, 61), (4, 7)])
def test_dp_gives_every_rank_the_same_number_of_micro_batches(method, ranks, n):
    for preset in ("gpt", "t5"):
        cm = CostModel.preset(preset)
        shapes = random_shapes(n * 31 + ranks, n, preset)
        for limit in (None, float(single_sample_memory(cm, shapes, method == "dp_varlen").max()) * 2.5):
            plan = plan_microbatches(shapes, cm, num_stages=4, num_ranks=ranks, method=method, memory_limit=limit)
            counts = plan.microbatches_per_rank()
            assert len(counts) == ranks
            assert counts.min() == counts.max() >= 1, counts
            np.testing.assert_array_equal(np.sort(plan.sample_ids), np.sort(shapes.sample_id))


def test_fewer_samples_than_ranks_is_a_planning_error():
    shapes = Shapes.from_lengths(np.array([10, 20, 30]))
    for method in METHODS:
        with pytest.raises(PlanningError):
            plan_microbatches(shapes, CostModel.preset("gpt"), num_ranks=4, method=method)


# ----------------------------------------------------------------------------- 4. determinism


DET_CASES = [("gpt", "dp", 4, 8), ("t5", "dp_varlen", 4, 3), ("vlm", "dp", 2, 2), ("t5", "kk", 4, 2),
             ("gpt", "pack", 4, 2)]

_FINGERPRINT_SCRIPT = """
import numpy as np, sys, json
from dynabatch import Shapes
from dynabatch.core.cost.model import CostModel
from dynabatch.core.plan.planner import plan_microbatches
out = []
for preset, method, stages, ranks in json.loads(sys.argv[1]):
    rng = np.random.default_rng(12345)
    n = 97
    inp = np.clip(rng.lognormal(5.0, 1.0, n), 1, 3000).astype(np.int32)
    tgt = np.clip(rng.lognormal(3.5, 1.0, n), 1, 600).astype(np.int32)
    vis = rng.integers(0, 4, n) * 256
    sh = Shapes.from_lengths(inp, tgt, vis, sample_id=rng.permutation(n) + 10)
    kw = {"max_len": 4096, "max_target_len": 1024} if method in ("pack", "pack_varlen") else {}
    p = plan_microbatches(sh, CostModel.preset(preset), num_stages=stages, num_ranks=ranks, method=method, step=3, **kw)
    out.append(p.fingerprint())
print(json.dumps(out))
"""


def _fingerprint_plans():
    plans = []
    for preset, method, stages, ranks in DET_CASES:
        rng = np.random.default_rng(12345)
        n = 97
        inp = np.clip(rng.lognormal(5.0, 1.0, n), 1, 3000).astype(np.int32)
        tgt = np.clip(rng.lognormal(3.5, 1.0, n), 1, 600).astype(np.int32)
        vis = rng.integers(0, 4, n) * 256
        sh = Shapes.from_lengths(inp, tgt, vis, sample_id=rng.permutation(n) + 10)
        kw = plan_kwargs(method, "t5")
        plans.append(plan_microbatches(sh, CostModel.preset(preset), num_stages=stages, num_ranks=ranks,
                                       method=method, step=3, **kw))
    return plans


def test_same_inputs_give_identical_plans():
    a, b = _fingerprint_plans(), _fingerprint_plans()
    for pa_, pb in zip(a, b):
        assert pa_.fingerprint() == pb.fingerprint()
        ta, tb = plan_to_arrow(pa_), plan_to_arrow(pb)
        assert ta.equals(tb, check_metadata=True)
        assert ta.schema.metadata == tb.schema.metadata
    # and the fingerprint does tell different plans apart
    assert len({p.fingerprint() for p in a}) == len(a)


def test_fingerprint_is_the_same_in_a_fresh_process():
    import json

    here = [p.fingerprint() for p in _fingerprint_plans()]
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", _FINGERPRINT_SCRIPT, json.dumps(DET_CASES)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


# ----------------------------------------------------------------------------- 8. quality sanity


def heavy_tailed(preset, seed, n=512):
    rng = np.random.default_rng(seed)
    inp = np.clip(rng.lognormal(5.5, 1.0, n), 1, 4096).astype(np.int32)
    tgt = np.clip(rng.lognormal(4.0, 1.0, n), 1, 1024).astype(np.int32) if preset == "t5" else None
    return Shapes.from_lengths(inp, tgt)


@pytest.mark.parametrize("preset", ["gpt", "t5"])
def test_dp_beats_every_feasible_baseline_setting(preset):
    cm = CostModel.preset(preset)
    S, R = 4, 8
    limit = cm.memory_limit(S, R)
    for seed in (0, 1):
        shapes = heavy_tailed(preset, seed)
        dp = plan_microbatches(shapes, cm, num_stages=S, num_ranks=R, method="dp")
        dpv = plan_microbatches(shapes, cm, num_stages=S, num_ranks=R, method="dp_varlen")
        assert dp.rank_imbalance <= 1.05
        assert np.all(dp.mb_memory_bytes <= limit) and np.all(dpv.mb_memory_bytes <= limit)
        compared = 0
        for method in ("pad", "group_by_length", "token_budget", "rebalance", "pack", "pack_varlen"):
            knob, values = BASELINE_KNOBS[method]
            for v in values:
                base = plan_microbatches(shapes, cm, num_stages=S, num_ranks=R, method=method,
                                         method_options={knob: v}, **plan_kwargs(method, preset))
                if base.options.get("over_memory_limit"):
                    continue  # an infeasible configuration is no competitor
                compared += 1
                if method == "pack_varlen":
                    assert dpv.iteration_time_s <= base.iteration_time_s, (method, v)
                else:
                    assert dp.iteration_time_s <= base.iteration_time_s, (method, v)
        assert compared >= 15


# ----------------------------------------------------------------------------- 9. deprecated names


def test_deprecated_forms_still_work_and_warn():
    """The names of earlier releases give the same result as the new ones, with a DeprecationWarning
    naming the new name (the one test that uses them; everything else uses the new names)."""
    import warnings

    from dynabatch import PlanOptions, split_global_batches
    from dynabatch.offline import RunPlanConfig

    cm = CostModel.preset("gpt")
    rng = np.random.default_rng(7)
    sh = Shapes.from_lengths(rng.integers(16, 1500, 200), sample_id=np.arange(200) + 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        new = plan_microbatches(sh, cm, num_stages=2, num_ranks=2, method="pad", method_options={"rows": 4})
        new_split = split_global_batches(sh, 20000, seed=3)
        new_opts = PlanOptions(global_batch_tokens=4096, num_ranks=4)
    # a method knob as a bare keyword moves into method_options
    with pytest.warns(DeprecationWarning, match=r"method_options=\{'rows': 4\}"):
        old = plan_microbatches(sh, cm, num_stages=2, num_ranks=2, method="pad", rows=4)
    assert old.fingerprint() == new.fingerprint() and old.options == new.options
    # split_global_batches(tokens_per_batch=)
    with pytest.warns(DeprecationWarning, match="tokens_per_batch= is deprecated, use global_batch_tokens="):
        old_split = split_global_batches(sh, seed=3, tokens_per_batch=20000)
    assert [p.tolist() for p in old_split] == [p.tolist() for p in new_split]
    # PlanOptions.replace(batch_tokens=)
    with pytest.warns(DeprecationWarning, match="batch_tokens= is deprecated, use global_batch_tokens="):
        assert PlanOptions(num_ranks=4).replace(batch_tokens=4096) == new_opts
    # RunPlanConfig(num_ranks=..., ...): the flat keywords of earlier releases
    with pytest.warns(DeprecationWarning, match=r"RunPlanConfig\(PlanOptions\(...\), epochs=...\)"):
        cfg = RunPlanConfig(num_ranks=4, global_batch_tokens=4096, epochs=2)
    assert cfg.options == new_opts and cfg.epochs == 2 and cfg.num_ranks == 4
