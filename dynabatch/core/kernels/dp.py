"""The DynaPipe-style dynamic program that cuts an ordered global batch into micro-batches.

Given samples in a fixed order, choose cut points so that contiguous segments become
micro-batches, minimizing the pipeline objective ``sum(t) / R + (S - 1) * max(t)`` (the sum is
shared by ``R`` data-parallel ranks, the bubble is paid once per rank) subject to each segment's
activation memory staying under the limit. For a fixed cap ``T`` on the largest micro-batch the
minimal sum is a 1-D DP; the kernel enumerates candidate caps (the distinct segment times, coarse
on a log grid and then refined around the best coarse cap: `pick_caps_between` picks them in one
pass over the segment times, no sort; a cap at or above the largest micro-batch a larger cap's
partition used gets that partition unevaluated, `_objectives_for_caps`) and keeps the best
objective. Finally the DP is rerun with the number of micro-batches tracked modulo ``R`` so every
rank can receive the same count, over caps in order of their unconstrained objective until none
can win.

On one stage with several ranks nothing waits for a pipeline, but the step waits for its slowest
rank, which ``sum / R`` does not see (a few large micro-batches cannot be spread evenly):
`_one_stage_search` scores each candidate cap's partition by the slowest rank's seconds once
`dynabatch.core.kernels.assign.assign_ranks` (the planner's own assignment) has spread it
(`_slowest_rank_s`), caps in order of their ``sum / R`` (a lower bound) until none can win.

Costs are evaluated inside the kernel from the cost model's linear coefficients (or its profiled
table), so there is no Python callback per candidate (`dynabatch.core.kernels.segments`). `dp_reference` is the same algorithm in
plain Python (`pick_caps_reference` mirrors `pick_caps`); tests check that both reach the same
optimum. The other kernels here are steps of `dp_kernel` and are covered by that comparison;
`pick_caps_between` is also checked against `pick_caps` of the sorted times. (The 1-D DP behind
the padded objective bound of `dynabatch.core.plan.bounds` is `dynabatch.core.kernels.bounds`.)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from .compile_once import njit

from .assign import assign_ranks, assign_ranks_reference
from .caps import pick_caps_between, pick_caps_reference
from .cost import NUM_FEATURES, Q_PAD
from .objective import objective_kernel, objective_reference
from .segments import SegmentCost, enumerate_segments, segment_cost  # noqa: F401  (the DP's segment prices)

INFEASIBLE_SAMPLE = -1
TOO_FEW_SAMPLES = -2
NO_EQUAL_SPLIT = -3


class DPSearch(NamedTuple):
    """What the DP optimizes: ``ranks`` data-parallel ranks, ``stages`` pipeline stages, at most
    ``max_caps`` candidate caps per pass, ``equal_counts``: a multiple of ``ranks`` micro-batches."""

    ranks: int
    stages: int
    max_caps: int
    equal_counts: bool


@njit(cache=True, nogil=True)
def dp_for_cap(offset, count, seg_time, cap, n, f, back, mx):
    """Minimal sum of micro-batch times over partitions whose largest micro-batch is <= cap.
    Fills f (best sum of prefix), back (start of last segment) and mx (largest time on the path)."""
    f[0] = 0.0
    mx[0] = 0.0
    for i in range(1, n + 1):
        best = np.inf
        arg = -1
        bmx = 0.0
        o = offset[i]
        for k in range(count[i]):
            t = seg_time[o + k]
            if t > cap:
                break  # times grow with the segment (more rows, larger maxima)
            j = i - 1 - k
            c = f[j] + t
            if c < best:
                best = c
                arg = j
                bmx = max(mx[j], t)
        f[i] = best
        back[i] = arg
        mx[i] = bmx
    return f[n]


@njit(cache=True, nogil=True)
def _objectives_for_caps(offset, count, seg_time, caps, n, ranks, stages, f, back, mx, objs, maxes,
                         above_cap, above_obj, above_max):
    """``objs[k] = s / ranks + (stages - 1) * mx`` of `dp_for_cap` at each of the ascending
    ``caps`` (``maxes[k]`` its largest micro-batch ``mx``), evaluated from the largest cap down.

    A cap whose nearest larger evaluated cap (or ``above_cap``, whose results are ``above_obj``,
    ``above_max``) found a partition with largest micro-batch ``<= cap`` takes that result
    unevaluated: `dp_for_cap` at ``cap`` returns it exactly. Every segment on that partition fits
    under ``cap``, so each prefix of it costs the same float sum under both caps, while any other
    candidate costs no less under the smaller cap (fewer segments), and the strict ``<`` keeps the
    same first minimum at every position of the path."""
    prev_cap = above_cap
    prev_obj = above_obj
    prev_max = above_max
    for k in range(caps.shape[0] - 1, -1, -1):
        cap = caps[k]
        if prev_cap < np.inf and cap <= prev_cap and prev_max <= cap:
            objs[k] = prev_obj
            maxes[k] = prev_max
        else:
            s = dp_for_cap(offset, count, seg_time, cap, n, f, back, mx)
            objs[k] = objective_kernel(s, mx[n], ranks, stages)
            maxes[k] = mx[n]
        prev_cap = cap
        prev_obj = objs[k]
        prev_max = maxes[k]


@njit(cache=True, nogil=True)
def dp_mod_ranks(offset, count, seg_time, cap, n, ranks):
    """The capped DP with the number of micro-batches tracked modulo ``ranks``; returns the
    segment starts of the best partition whose count is a multiple of ``ranks`` (empty if none)."""
    g = np.full((n + 1, ranks), np.inf)
    back = np.full((n + 1, ranks), -1, np.int64)
    g[0, 0] = 0.0
    for i in range(1, n + 1):
        o = offset[i]
        for k in range(count[i]):
            t = seg_time[o + k]
            if t > cap:
                break
            j = i - 1 - k
            for c in range(ranks):
                if g[j, c] < np.inf:
                    c2 = (c + 1) % ranks
                    v = g[j, c] + t
                    if v < g[i, c2]:
                        g[i, c2] = v
                        back[i, c2] = j
    if not g[n, 0] < np.inf:
        return np.empty(0, np.int64)
    starts = []
    i = n
    c = 0
    while i > 0:
        j = back[i, c]
        starts.append(j)
        i = j
        c = (c - 1) % ranks
    out = np.empty(len(starts), np.int64)
    for k in range(len(starts)):
        out[k] = starts[len(starts) - 1 - k]
    return out


def dp_kernel(main, dec, tiles, cost: SegmentCost, search: DPSearch):
    """`dp_search` of the ordered samples for ``cost`` and ``search``. The records cross into numba as
    their fields: numba types a namedtuple argument in Python on every call (about 2 ms), so
    `_dp_entry` rebuilds them inside compiled code."""
    return _dp_entry(main, dec, tiles, *cost, *search)


@njit(cache=True, nogil=True)
def _dp_entry(main, dec, tiles, varlen, pad_multiple, tile_patches, time_coef, mem_coef, mem_limit, use_table,
              grid_rows, grid_len, grid_dec, table_time, table_mem, extrapolate, dense, ranks, stages, max_caps,
              equal_counts):
    """`dp_search` with the fields of `SegmentCost` and `DPSearch` in their order."""
    return dp_search(main, dec, tiles,
                     SegmentCost(varlen, pad_multiple, tile_patches, time_coef, mem_coef, mem_limit, use_table,
                                 grid_rows, grid_len, grid_dec, table_time, table_mem, extrapolate, dense),
                     DPSearch(ranks, stages, max_caps, equal_counts))


@njit(cache=True, nogil=True)
def dp_search(main, dec, tiles, cost, search):
    """Best partition of the ordered samples (int64 ``main``/``dec`` tokens and ``tiles`` per sample),
    each segment priced by ``cost`` (`SegmentCost`), for ``search`` (`DPSearch`). Returns (starts,
    status): the first position of each micro-batch, and 0, or INFEASIBLE_SAMPLE with starts=[position
    of the sample that cannot fit], TOO_FEW_SAMPLES when fewer samples than ranks make equal counts
    impossible, or NO_EQUAL_SPLIT when no partition under the memory limit has a multiple of ``ranks``
    micro-batches. ``search.equal_counts=False`` drops the multiple-of-``ranks`` requirement."""
    ranks, stages, max_caps, equal_counts = search.ranks, search.stages, search.max_caps, search.equal_counts
    n = main.shape[0]
    offset, count, seg_time, bad = enumerate_segments(main, dec, tiles, cost)
    if bad >= 0:
        out = np.empty(1, np.int64)
        out[0] = bad
        return out, INFEASIBLE_SAMPLE
    if equal_counts and n < ranks:
        return np.empty(0, np.int64), TOO_FEW_SAMPLES
    # The cap can never be below the costliest single sample.
    floor = 0.0
    top = 0.0
    for i in range(1, n + 1):
        floor = max(floor, seg_time[offset[i]])
    for k in range(seg_time.shape[0]):
        top = max(top, seg_time[k])
    if stages == 1 and ranks > 1 and n > 0:
        return _one_stage_search(offset, count, seg_time, n, floor, top, ranks, max_caps, equal_counts)
    if stages == 1:
        # One rank, no pipeline bubble: the objective is the sum alone, minimal without any cap, so
        # only the largest segment time is needed (no sort of every segment time).
        coarse = np.full(1, top)
    else:
        # the caps of `pick_caps` over the sorted distinct segment times from ``floor`` up
        coarse = pick_caps_between(seg_time, floor, top, max_caps)
    f = np.empty(n + 1)
    back = np.empty(n + 1, np.int64)
    mx = np.empty(n + 1)
    objs = np.empty(coarse.shape[0])
    maxes = np.empty(coarse.shape[0])
    _objectives_for_caps(offset, count, seg_time, coarse, n, ranks, stages, f, back, mx, objs, maxes,
                         np.inf, np.inf, 0.0)
    best_obj = np.inf
    best_k = 0
    for k in range(coarse.shape[0]):
        if objs[k] < best_obj:
            best_obj = objs[k]
            best_k = k
    # Refine between the coarse neighbours of the best cap.
    lo_v = coarse[best_k - 1] if best_k > 0 else coarse[0]
    hi_v = coarse[best_k + 1] if best_k + 1 < coarse.shape[0] else coarse[-1]
    fine = pick_caps_between(seg_time, lo_v, hi_v, max_caps) if stages > 1 else coarse[:0].copy()
    caps = np.concatenate((coarse, fine))
    cobj = np.concatenate((objs, np.full(fine.shape[0], np.inf)))
    fine_objs = np.empty(fine.shape[0])
    fine_maxes = np.empty(fine.shape[0])
    # the coarse cap nearest above the fine ones (hi_v) seeds the reuse of `_objectives_for_caps`
    k_hi = best_k + 1 if best_k + 1 < coarse.shape[0] else coarse.shape[0] - 1
    _objectives_for_caps(offset, count, seg_time, fine, n, ranks, stages, f, back, mx, fine_objs, fine_maxes,
                         coarse[k_hi], objs[k_hi], maxes[k_hi])
    cobj[coarse.shape[0]:] = fine_objs
    order = np.argsort(cobj, kind="mergesort")
    if ranks == 1 or not equal_counts:
        dp_for_cap(offset, count, seg_time, caps[order[0]], n, f, back, mx)
        starts = []
        i = n
        while i > 0:
            starts.append(back[i])
            i = back[i]
        out = np.empty(len(starts), np.int64)
        for k in range(len(starts)):
            out[k] = starts[len(starts) - 1 - k]
        return out, 0
    # Equal micro-batch counts per rank: rerun caps, best unconstrained objective first, with the
    # count tracked mod R. A cap's constrained optimum is never below its unconstrained one, so
    # the search stops once no remaining cap can beat the best constrained plan found.
    best_starts = np.empty(0, np.int64)
    best_val = np.inf
    for idx in order:
        if not cobj[idx] < best_val:
            break
        st = dp_mod_ranks(offset, count, seg_time, caps[idx], n, ranks)
        if st.shape[0] == 0:
            continue
        total = 0.0
        big = 0.0
        for q in range(st.shape[0]):
            end = st[q + 1] if q + 1 < st.shape[0] else n
            t = seg_time[offset[end] + (end - 1 - st[q])]
            total += t
            big = max(big, t)
        val = objective_kernel(total, big, ranks, stages)
        if val < best_val:
            best_val = val
            best_starts = st
    if best_starts.shape[0] == 0:
        # No candidate cap admits a multiple of R; the largest segment time admits every split.
        best_starts = dp_mod_ranks(offset, count, seg_time, top, n, ranks)
        if best_starts.shape[0] == 0:
            return best_starts, NO_EQUAL_SPLIT
    return best_starts, 0


@njit(cache=True, nogil=True)
def _backtrack(back, n):
    """Segment starts of the partition `dp_for_cap` left in ``back`` (ascending)."""
    k = 0
    i = n
    while i > 0:
        i = back[i]
        k += 1
    out = np.empty(k, np.int64)
    i = n
    while i > 0:
        k -= 1
        out[k] = back[i]
        i = back[i]
    return out


@njit(cache=True, nogil=True)
def _partition_times(offset, count, seg_time, starts, n):
    """Seconds of each segment of the partition ``starts`` (segment prices of `enumerate_segments`)."""
    out = np.empty(starts.shape[0])
    for q in range(starts.shape[0]):
        end = starts[q + 1] if q + 1 < starts.shape[0] else n
        out[q] = seg_time[offset[end] + (end - 1 - starts[q])]
    return out


@njit(cache=True, nogil=True)
def _slowest_rank_s(times, ranks, equal_counts):
    """Seconds of the slowest rank once ``times`` are spread over ``ranks`` by `assign_ranks` (one
    stage): the step time a one-stage data-parallel plan of these micro-batches waits for."""
    rank_of = assign_ranks(times, ranks, np.int64(1), equal_counts)  # typed: a literal 1 compiles a second assign_ranks
    per_rank = np.zeros(ranks)
    for k in range(times.shape[0]):
        per_rank[rank_of[k]] += times[k]
    return per_rank.max()


@njit(cache=True, nogil=True)
def _caps_by_makespan(offset, count, seg_time, caps, n, ranks, equal_counts, f, back, mx, best_val, best_starts):
    """Score every cap of ``caps`` by `_slowest_rank_s` of its partition (`dp_for_cap`, or `dp_mod_ranks`
    with ``equal_counts``), smallest unconstrained sum / ranks first; returns the best (value, starts)
    found, starting from (``best_val``, ``best_starts``). A cap is skipped once its sum / ranks (a
    lower bound of its slowest rank: the constrained sum is no smaller) cannot win."""
    lower = np.empty(caps.shape[0])
    for k in range(caps.shape[0]):
        lower[k] = dp_for_cap(offset, count, seg_time, caps[k], n, f, back, mx) / ranks
    for idx in np.argsort(lower, kind="mergesort"):
        if not lower[idx] < best_val:
            break
        if equal_counts:
            st = dp_mod_ranks(offset, count, seg_time, caps[idx], n, ranks)
            if st.shape[0] == 0:
                continue
        else:
            dp_for_cap(offset, count, seg_time, caps[idx], n, f, back, mx)
            st = _backtrack(back, n)
        val = _slowest_rank_s(_partition_times(offset, count, seg_time, st, n), ranks, equal_counts)
        if val < best_val:
            best_val = val
            best_starts = st
    return best_val, best_starts


@njit(cache=True, nogil=True)
def _one_stage_search(offset, count, seg_time, n, floor, top, ranks, max_caps, equal_counts):
    """`dp_search` on one stage with several ranks: the step waits for the slowest rank, so each
    candidate cap's partition is scored by `_slowest_rank_s` (sum / ranks alone ignores that a few large
    micro-batches cannot be spread evenly: on FLAN-like steps of 2 ranks it gave one micro-batch per
    rank, the slowest rank 1.6-1.8x the mean). Caps: `pick_caps_between` on a log grid, then refined
    between the neighbours of the best one; the uncapped partition (the sum's optimum) is among them."""
    f = np.empty(n + 1)
    back = np.empty(n + 1, np.int64)
    mx = np.empty(n + 1)
    coarse = pick_caps_between(seg_time, floor, top, max_caps)
    best_val, best_starts = _caps_by_makespan(offset, count, seg_time, coarse, n, ranks, equal_counts, f, back, mx,
                                              np.inf, np.empty(0, np.int64))
    if best_starts.shape[0] == 0:
        # No candidate cap admits a multiple of R; the largest segment time admits every split.
        best_starts = dp_mod_ranks(offset, count, seg_time, top, n, ranks)
        return best_starts, (0 if best_starts.shape[0] else NO_EQUAL_SPLIT)
    largest = _partition_times(offset, count, seg_time, best_starts, n).max()
    k = np.searchsorted(coarse, largest)  # the best partition's largest micro-batch is at most its cap
    lo_v = coarse[k - 1] if k > 0 else coarse[0]
    hi_v = coarse[k + 1] if k + 1 < coarse.shape[0] else coarse[-1]
    fine = pick_caps_between(seg_time, lo_v, hi_v, max_caps)
    best_val, best_starts = _caps_by_makespan(offset, count, seg_time, fine, n, ranks, equal_counts, f, back, mx,
                                              best_val, best_starts)
    return best_starts, 0


def dp_reference(main, dec, tiles, cost: SegmentCost, search: DPSearch):
    """Plain-Python version of `dp_kernel` (analytic costs only) for tests: same caps, same DP."""
    if cost.use_table:
        raise ValueError("dp_reference prices segments with the linear coefficients only, not a profiled table")
    varlen, pad_multiple, tile_patches = cost.varlen, cost.pad_multiple, cost.tile_patches
    tcoef, mcoef, mem_limit = cost.time_coef, cost.mem_coef, cost.mem_limit
    ranks, stages, max_caps, equal_counts = search
    main = [int(x) for x in main]
    dec = [int(x) for x in dec]
    tiles = [int(x) for x in tiles]
    n = len(main)

    def price(j, i):
        if varlen:
            phi = [0.0] * NUM_FEATURES
            for s in range(j, i):
                L, T, v = float(main[s]), float(dec[s]), float(tiles[s]) * tile_patches
                for k, x in enumerate((L, L * L, T, T * T, T * L, v, v * tile_patches)):
                    phi[k] += x
            phi[7] = 1.0
            phi[8] = 1.0 if phi[5] > 0 else 0.0
            if cost.dense:  # the whole row, as `CostModel.packed_features` prices it
                n, t = phi[0], phi[2]
                phi[1], phi[3], phi[4] = n * n, t * t, t * n
                phi[Q_PAD] = n * n if i - j > 1 else 0.0
        else:
            def up(x):
                return -(-x // pad_multiple) * pad_multiple if pad_multiple > 1 else x
            r = i - j
            L, T = up(max(main[j:i])), up(max(dec[j:i]))
            v = float(sum(tiles[j:i])) * tile_patches
            q_pad = r * L * L if min(main[j:i]) < L else 0.0
            phi = [r * L, r * L * L, r * T, r * T * T, r * T * L, v, v * tile_patches, 1.0, 1.0 if v > 0 else 0.0,
                   q_pad]
        return sum(c * p for c, p in zip(tcoef, phi)), sum(c * p for c, p in zip(mcoef, phi))

    seg = {}  # (j, i) -> time, for feasible segments (contiguous starts per end, as in the kernel)
    for i in range(1, n + 1):
        for j in range(i - 1, -1, -1):
            t, m = price(j, i)
            if m > mem_limit:
                break
            seg[(j, i)] = t
        if (i - 1, i) not in seg:
            return [i - 1], INFEASIBLE_SAMPLE
    if equal_counts and n < ranks:
        return [], TOO_FEW_SAMPLES

    def best_for_cap(cap, mod):
        g = {(0, 0): (0.0, None)}
        for i in range(1, n + 1):
            for j in range(i - 1, -1, -1):
                t = seg.get((j, i))
                if t is None or t > cap:
                    break
                for c in range(mod):
                    if (j, c) in g:
                        c2 = (c + 1) % mod
                        v = g[(j, c)][0] + t
                        if (i, c2) not in g or v < g[(i, c2)][0]:
                            g[(i, c2)] = (v, j)
        if (n, 0) not in g:
            return None
        starts, i, c = [], n, 0
        while i > 0:
            j = g[(i, c)][1]
            starts.append(j)
            i, c = j, (c - 1) % mod
        starts.reverse()
        return starts

    def objective(starts):
        ends = starts[1:] + [n]
        times = [seg[(a, b)] for a, b in zip(starts, ends)]
        return objective_reference(sum(times), max(times), ranks, stages)

    floor = max(seg[(i - 1, i)] for i in range(1, n + 1))
    values = np.unique(np.array(list(seg.values())))
    if stages == 1 and ranks > 1:  # `_one_stage_search`: each cap's partition scored by its slowest rank
        def slowest(starts):
            times = [seg[(a, b)] for a, b in zip(starts, starts[1:] + [n])]
            per_rank = [0.0] * ranks
            for t, r in zip(times, assign_ranks_reference(times, ranks, 1, equal_counts)):
                per_rank[r] += t
            return max(per_rank)

        def by_makespan(caps, best, best_val):
            lower = [sum(seg[(a, b)] for a, b in zip(st, st[1:] + [n])) / ranks
                     for st in (best_for_cap(c, 1) for c in caps)]
            for idx in np.argsort(np.array(lower), kind="mergesort"):
                if not lower[idx] < best_val:
                    break
                st = best_for_cap(caps[idx], ranks if equal_counts else 1)
                if st is not None and slowest(st) < best_val:
                    best, best_val = st, slowest(st)
            return best, best_val

        coarse = pick_caps_reference(values, int(np.searchsorted(values, floor)), max_caps)
        best, best_val = by_makespan(list(coarse), None, np.inf)
        if best is None:
            best = best_for_cap(values[-1], ranks)
            return (best, 0) if best is not None else ([], NO_EQUAL_SPLIT)
        largest = max(seg[(a, b)] for a, b in zip(best, best[1:] + [n]))
        k = int(np.searchsorted(coarse, largest))
        lo_v, hi_v = coarse[max(k - 1, 0)], coarse[min(k + 1, len(coarse) - 1)]
        window = values[np.searchsorted(values, lo_v): np.searchsorted(values, hi_v, side="right")]
        best, _ = by_makespan(list(pick_caps_reference(window, 0, max_caps)), best, best_val)
        return best, 0
    if stages == 1:  # no bubble: the uncapped partition minimizes the sum
        caps = [values[-1]]
    else:
        caps = pick_caps_reference(values, int(np.searchsorted(values, floor)), max_caps)
    objs = [objective(best_for_cap(c, 1)) for c in caps]
    k = int(np.argmin(objs))
    lo_v, hi_v = caps[max(k - 1, 0)], caps[min(k + 1, len(caps) - 1)]
    window = values[np.searchsorted(values, lo_v): np.searchsorted(values, hi_v, side="right")]
    fine = pick_caps_reference(window, 0, max_caps) if stages > 1 else []
    caps += fine
    objs += [objective(best_for_cap(c, 1)) for c in fine]
    order = np.argsort(np.array(objs), kind="mergesort")
    if ranks == 1 or not equal_counts:
        return best_for_cap(caps[order[0]], 1), 0
    best, best_val = None, np.inf
    for idx in order:
        if not objs[idx] < best_val:
            break
        st = best_for_cap(caps[idx], ranks)
        if st is not None and objective(st) < best_val:
            best, best_val = st, objective(st)
    if best is None:
        best = best_for_cap(values[-1], ranks)
        if best is None:
            return [], NO_EQUAL_SPLIT
    return best, 0
