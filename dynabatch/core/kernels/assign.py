"""Spreading micro-batches over data-parallel ranks and ordering them within each rank.

Assignment minimizes the slowest rank's pipeline time, estimated as ``sum + (S-1) * max`` of
the rank's micro-batch times: longest-processing-time-first with an optional equal count per
rank (so every rank runs the same number of micro-batches and DDP never waits on a missing
one), then pairwise swaps (and, without the equal-count rule, moves) out of the slowest rank
while they help. The order within a rank is chosen by simulating the pipeline schedule for a
few candidate orders instead of trusting the closed form. The closed form balances ranks to a
fraction of a percent while their simulated makespans still differ by 2-3% (a rank's fill and
drain depend on its smallest micro-batches, not its largest), so `balance_simulated` finishes
with swaps judged by the simulation itself. Times are seconds.

==========================  ===============================
kernel                      reference
==========================  ===============================
`assign_ranks`              `assign_ranks_reference`
`simulate_rank`             `simulate_rank_reference`
`candidate_orders`         `candidate_orders_reference`
`balance_simulated`         `balance_simulated_reference`
`_rank_stats`,              helpers of `assign_ranks`, covered by its reference
`_max_without`
==========================  ===============================
"""

from __future__ import annotations

import numpy as np
from .compile_once import njit

from .objective import objective_kernel, objective_reference
from .simulate import makespan_kernel, makespan_reference, split_kernel, split_reference


@njit(cache=True)
def _rank_stats(times, rank_of, ranks):
    s = np.zeros(ranks)
    m1 = np.zeros(ranks)  # largest
    m2 = np.zeros(ranks)  # second largest
    for k in range(times.shape[0]):
        r = rank_of[k]
        t = times[k]
        s[r] += t
        if t > m1[r]:
            m2[r] = m1[r]
            m1[r] = t
        elif t > m2[r]:
            m2[r] = t
    return s, m1, m2


@njit(cache=True)
def _max_without(t, m1, m2):
    return m2 if t == m1 else m1


@njit(cache=True, nogil=True)
def assign_ranks(times, ranks, stages, equal_counts, max_rounds=200):
    """Rank of each micro-batch (int32 [M]) minimizing max over ranks of sum + (S-1)*max."""
    m = times.shape[0]
    rank_of = np.zeros(m, np.int32)
    cap = m // ranks if equal_counts else m
    order = np.argsort(-times, kind="mergesort")
    s = np.zeros(ranks)
    mx = np.zeros(ranks)
    cnt = np.zeros(ranks, np.int64)
    for idx in order:
        t = times[idx]
        best = -1
        best_v = np.inf
        for r in range(ranks):
            if cnt[r] >= cap:
                continue
            v = objective_kernel(s[r] + t, max(mx[r], t), 1, stages)
            if v < best_v:
                best_v = v
                best = r
        rank_of[idx] = best
        s[best] += t
        mx[best] = max(mx[best], t)
        cnt[best] += 1
    for _ in range(max_rounds):
        s, m1, m2 = _rank_stats(times, rank_of, ranks)
        obj = objective_kernel(s, m1, 1, stages)
        rmax = np.argmax(obj)
        cur = obj[rmax]
        best_gain = 1e-12 * cur
        best_a = -1
        best_b = -1
        for a in range(m):
            if rank_of[a] != rmax:
                continue
            ta = times[a]
            rest_max_a = _max_without(ta, m1[rmax], m2[rmax])
            for b in range(m):
                r = rank_of[b]
                if r == rmax:
                    continue
                tb = times[b]
                if tb >= ta:
                    continue
                o1 = objective_kernel(s[rmax] - ta + tb, max(rest_max_a, tb), 1, stages)
                o2 = objective_kernel(s[r] - tb + ta, max(_max_without(tb, m1[r], m2[r]), ta), 1, stages)
                gain = cur - max(o1, o2)
                if gain > best_gain:
                    best_gain = gain
                    best_a = a
                    best_b = b
            if not equal_counts:
                for r in range(ranks):
                    if r == rmax:
                        continue
                    o1 = objective_kernel(s[rmax] - ta, rest_max_a, 1, stages)
                    o2 = objective_kernel(s[r] + ta, max(m1[r], ta), 1, stages)
                    gain = cur - max(o1, o2)
                    if gain > best_gain:
                        best_gain = gain
                        best_a = a
                        best_b = -1 - r
        if best_a < 0:
            break
        if best_b >= 0:
            rank_of[best_a], rank_of[best_b] = rank_of[best_b], rank_of[best_a]
        else:
            rank_of[best_a] = -1 - best_b
    return rank_of


def assign_ranks_reference(times, ranks, stages, equal_counts, max_rounds=200):
    """Plain-Python version of `assign_ranks` for tests (same greedy start, same swaps)."""
    times = [float(t) for t in times]
    m = len(times)
    cap = m // ranks if equal_counts else m
    rank_of = [0] * m
    s, mx, cnt = [0.0] * ranks, [0.0] * ranks, [0] * ranks
    for idx in sorted(range(m), key=lambda k: -times[k]):
        t = times[idx]
        options = [(objective_reference(s[r] + t, max(mx[r], t), 1, stages), r) for r in range(ranks) if cnt[r] < cap]
        best = min(options)[1]
        rank_of[idx] = best
        s[best] += t
        mx[best] = max(mx[best], t)
        cnt[best] += 1

    def stats():
        # rank sums accumulated in micro-batch order, largest and second largest, as the kernel does
        s, m1, m2 = [0.0] * ranks, [0.0] * ranks, [0.0] * ranks
        for k in range(m):
            r, t = rank_of[k], times[k]
            s[r] += t
            if t > m1[r]:
                m1[r], m2[r] = t, m1[r]
            elif t > m2[r]:
                m2[r] = t
        return s, m1, m2

    for _ in range(max_rounds):
        s, m1, m2 = stats()
        obj = [objective_reference(s[r], m1[r], 1, stages) for r in range(ranks)]
        rmax = obj.index(max(obj))
        cur = obj[rmax]
        best_gain, move = 1e-12 * cur, None
        for a in range(m):
            if rank_of[a] != rmax:
                continue
            ta = times[a]
            rest_a = m2[rmax] if ta == m1[rmax] else m1[rmax]
            for b in range(m):
                r, tb = rank_of[b], times[b]
                if r == rmax or tb >= ta:
                    continue
                rest_b = m2[r] if tb == m1[r] else m1[r]
                gain = cur - max(objective_reference(s[rmax] - ta + tb, max(rest_a, tb), 1, stages),
                                 objective_reference(s[r] - tb + ta, max(rest_b, ta), 1, stages))
                if gain > best_gain:
                    best_gain, move = gain, (a, b)
            if not equal_counts:
                for r in range(ranks):
                    if r == rmax:
                        continue
                    gain = cur - max(objective_reference(s[rmax] - ta, rest_a, 1, stages),
                                     objective_reference(s[r] + ta, max(m1[r], ta), 1, stages))
                    if gain > best_gain:
                        best_gain, move = gain, (a, -1 - r)
        if move is None:
            break
        apply_move_reference(rank_of, *move)
    return rank_of


def apply_move_reference(rank_of: list, a: int, b: int) -> None:
    """Apply a move of the assignment references in place: ``b >= 0`` swaps the ranks of micro-batches
    ``a`` and ``b``, ``b < 0`` moves ``a`` to rank ``-1 - b``."""
    if b >= 0:
        rank_of[a], rank_of[b] = rank_of[b], rank_of[a]
    else:
        rank_of[a] = -1 - b


@njit(cache=True)
def candidate_orders(times):
    """The four candidate execution orders of a rank's micro-batches, given their ``times`` (seconds,
    ``[k]``): int64 ``[4, k]``, one order of positions per row (the planner's ordering search and the
    rank balancer score each and keep the best)."""
    k = times.shape[0]
    asc = np.argsort(times, kind="mergesort")
    out = np.empty((4, k), np.int64)
    for q in range(k):
        out[0, q] = asc[k - 1 - q]  # longest first
        out[1, q] = asc[q]  # shortest first
    # shortest first, then longest to shortest
    out[2, 0] = asc[0]
    for q in range(1, k):
        out[2, q] = asc[k - q]
    # shortest first, second shortest last, the rest longest first (short fill and drain)
    out[3, 0] = asc[0]
    if k > 1:
        out[3, k - 1] = asc[1]
        for q in range(1, k - 1):
            out[3, q] = asc[k - q]
    return out


def candidate_orders_reference(times):
    """Plain-Python `candidate_orders`, as a list of the four orders (lists of positions)."""
    asc = sorted(range(len(times)), key=lambda q: times[q])  # stable, as the kernel's mergesort
    longest_first = asc[::-1]
    shortest_first = asc[:]
    # The shortest first so the pipeline fills fast, then longest to shortest.
    short_then_longest = asc[:1] + asc[:0:-1]
    # As above with the second shortest moved last, so the pipeline also drains fast.
    short_fill_and_drain = asc[:1] + asc[:1:-1] + asc[1:2]
    return [longest_first, shortest_first, short_then_longest, short_fill_and_drain]


@njit(cache=True, nogil=True)
def simulate_rank(times, p2p, fwd_fraction, stages, ops):
    """Pipeline makespan (seconds) of one rank running micro-batches in the given order on
    ``stages`` identical stages."""
    st = np.empty((stages, times.shape[0]))
    for s in range(stages):
        st[s] = times
    fwd, bwd = split_kernel(st, fwd_fraction)
    return makespan_kernel(fwd, bwd, p2p, ops)


def simulate_rank_reference(times, p2p, fwd_fraction, stages, ops):
    """Plain-Python `simulate_rank`: every stage spends ``fwd_fraction`` of a micro-batch's time
    (seconds) in its forward and the rest in its backward."""
    fwd, bwd = split_reference([[float(t) for t in times]] * stages, fwd_fraction)
    return makespan_reference(fwd, bwd, p2p, ops)


@njit(cache=True, nogil=True)
def _rank_span(times, p2p, rank_of, r, fwd_fraction, stages, ops_by_count):
    """Simulated makespan of rank ``r``: the best of `candidate_orders`, as the planner's ordering
    (`dynabatch.core.kernels.schedules.order_ranks_schedule`) picks it for a static schedule."""
    idx = np.flatnonzero(rank_of == r)
    k = idx.shape[0]
    if k == 0:
        return 0.0
    ops = np.ascontiguousarray(ops_by_count[k][:, : 2 * k])
    t = times[idx]
    p = p2p[idx]
    if k == 1:
        return simulate_rank(t, p, fwd_fraction, stages, ops)
    cands = candidate_orders(t)
    best = np.inf
    for c in range(cands.shape[0]):
        o = cands[c]
        v = simulate_rank(t[o], p[o], fwd_fraction, stages, ops)
        if v < best:
            best = v
    return best


#: The planner's `balance_simulated` search: at most this many rounds, simulating this many best estimates
#: a round. (The kernel takes them as arguments, with no defaults: a call that left them out would compile
#: the whole search again for the omitted arguments' types.)
BALANCE_ROUNDS, BALANCE_TOP = 16, 8


@njit(cache=True, nogil=True)
def balance_simulated(times, p2p, rank_of, ranks, fwd_fraction, stages, ops_by_count, max_rounds, top):
    """Swap micro-batches out of the slowest rank while its simulated makespan drops (int32 ranks).

    Each round takes the rank ``a`` with the largest simulated makespan (the first of equals,
    as `_rank_span` computes it for ``ops_by_count``) and ranks every swap of one of its
    micro-batches ``i`` with a shorter one ``j`` of another rank ``b`` by the linear estimate
    ``max(span_a - d, span_b + d)``, ``d = t_i - t_j`` (ties: first ``i``, then first ``j``). The
    ``top`` best estimates below ``span_a`` are simulated in that order and the first whose two
    new makespans both lie below ``span_a`` is kept; a round that keeps none ends the search.
    Swaps keep every rank's micro-batch count, so equal counts stay equal.
    """
    m = times.shape[0]
    rank_of = rank_of.copy()
    span = np.zeros(ranks)
    for r in range(ranks):
        span[r] = _rank_span(times, p2p, rank_of, r, fwd_fraction, stages, ops_by_count)
    cand_e = np.empty(top)
    cand_i = np.empty(top, np.int64)
    cand_j = np.empty(top, np.int64)
    for _ in range(max_rounds):
        a = np.int64(0)  # not the literal 0: numba would compile _rank_span for it as well
        for r in range(1, ranks):
            if span[r] > span[a]:
                a = r
        cur = span[a]
        if not np.isfinite(cur):
            break
        used = 0
        for i in range(m):
            if rank_of[i] != a:
                continue
            for j in range(m):
                b = rank_of[j]
                if b == a:
                    continue
                d = times[i] - times[j]
                if not d > 0.0:
                    continue
                est = max(cur - d, span[b] + d)
                if not est < cur:
                    continue
                # insert after every candidate with an estimate <= est (stable), keep the top ones
                pos = used
                while pos > 0 and est < cand_e[pos - 1]:
                    pos -= 1
                if pos >= top:
                    continue
                last = used if used < top else top - 1
                for q in range(last, pos, -1):
                    cand_e[q] = cand_e[q - 1]
                    cand_i[q] = cand_i[q - 1]
                    cand_j[q] = cand_j[q - 1]
                cand_e[pos] = est
                cand_i[pos] = i
                cand_j[pos] = j
                if used < top:
                    used += 1
        kept = False
        for q in range(used):
            i = cand_i[q]
            j = cand_j[q]
            b = np.int64(rank_of[j])  # one type for _rank_span's rank (int32 here, int64 above): one compile
            rank_of[i] = b
            rank_of[j] = a
            sa = _rank_span(times, p2p, rank_of, a, fwd_fraction, stages, ops_by_count)
            sb = _rank_span(times, p2p, rank_of, b, fwd_fraction, stages, ops_by_count)
            if sa < cur and sb < cur:
                span[a] = sa
                span[b] = sb
                kept = True
                break
            rank_of[i] = a
            rank_of[j] = b
        if not kept:
            break
    return rank_of


def balance_simulated_reference(times, p2p, rank_of, ranks, fwd_fraction, stages, ops_by_count,
                                max_rounds=BALANCE_ROUNDS, top=BALANCE_TOP):
    """Plain-Python `balance_simulated`: the same rounds of estimated, then simulated, swaps out of
    the slowest rank (a list of ranks)."""
    times = [float(t) for t in times]
    rank_of = [int(r) for r in rank_of]
    m = len(times)

    def rank_span(r):
        mine = [q for q in range(m) if rank_of[q] == r]
        k = len(mine)
        if k == 0:
            return 0.0
        ops = ops_by_count[k][:, : 2 * k]
        t, p = [times[q] for q in mine], [float(p2p[q]) for q in mine]
        orders = candidate_orders_reference(t) if k > 1 else [[0]]
        return min(simulate_rank_reference([t[q] for q in o], [p[q] for q in o], fwd_fraction, stages, ops)
                   for o in orders)

    span = [rank_span(r) for r in range(ranks)]
    for _ in range(max_rounds):
        a = span.index(max(span))
        cur = span[a]
        if not np.isfinite(cur):
            break
        cands = []
        for i in range(m):
            if rank_of[i] != a:
                continue
            for j in range(m):
                b = rank_of[j]
                d = times[i] - times[j]
                if b == a or not d > 0.0:
                    continue
                est = max(cur - d, span[b] + d)
                if est < cur:
                    cands.append((est, i, j))
        cands.sort(key=lambda c: c[0])  # stable: ties keep the (i, j) scan order
        for _, i, j in cands[:top]:
            b = rank_of[j]
            rank_of[i], rank_of[j] = b, a
            sa, sb = rank_span(a), rank_span(b)
            if sa < cur and sb < cur:
                span[a], span[b] = sa, sb
                break
            rank_of[i], rank_of[j] = a, b
        else:
            break
    return rank_of
