"""Numba kernels of the memory-aware adaptive order and of per-rank ordering for any schedule, each
beside its plain-Python reference.

`adaptive_kernel` writes plain op codes (``j + 1`` forward of micro-batch ``j``, ``-(j + 1)`` its
backward; int32 ``[S, 2M]``); `rank_ops_kernel` gives any schedule's op table of one rank
(`dynabatch.core.kernels.op_codes`: the static ones from `dynabatch.core.kernels.op_tables.static_table`),
which the ordering search prices. Times are seconds, memory bytes.

=========================  ==============================
kernel                     reference
=========================  ==============================
`adaptive_kernel`          `adaptive_reference`
`order_ranks_schedule`     `order_ranks_schedule_reference`
`chunks_of`                (a constant per code)
`order_ranks_stages`       `order_ranks_stages_reference`
`stage_candidates`         `stage_candidates_reference`
`rank_ops_kernel`          `rank_ops_reference`
`record_slots_kernel`      `record_slots_reference`
=========================  ==============================
"""

from __future__ import annotations

import numpy as np
from .compile_once import njit

from .arrays import kernel_array
from .assign import candidate_orders, candidate_orders_reference
from .op_codes import ADAPTIVE, INTERLEAVED, INTERLEAVED_CHUNKS, WEIGHT_SHARE
from .op_tables import codes_table, codes_table_reference, static_table, static_table_reference
from .simulate import (chunk_times, chunk_times_reference, inflight_table_kernel, inflight_table_reference,
                       makespan_table_kernel, makespan_table_reference, split_kernel, split_reference)

#: Return codes of :func:`adaptive_kernel`.
OK, STALL, OVERSIZE = 0, 1, 2


@njit(cache=True)
def adaptive_kernel(fwd, bwd, p2p, mem, limit, alone, ops):
    """Fill ``ops`` (int32 ``[S, 2M]``) with the memory-aware adaptive order; returns 0 (OK), 1 (stall,
    an internal error) or 2 (a micro-batch's ``mem`` exceeds ``limit`` and ``alone`` is False).

    List scheduling on ``fwd``/``bwd`` float64 ``[S, M]`` seconds, ``p2p`` float64 ``[M]`` seconds,
    ``mem`` float64 ``[M]`` activation bytes, ``limit`` bytes in flight per stage: whenever a stage is
    free it runs the earliest-ready ready backward (ties: lowest micro-batch), otherwise the next forward
    in micro-batch order if its input has arrived and the stage's in-flight bytes (forwarded, not yet
    backwarded) stay within ``limit`` after adding it, or the stage holds nothing (with ``alone``, a
    micro-batch larger than ``limit`` runs by itself). Deadlock-free: the last stage always drains.
    """
    S, M = fwd.shape
    if not alone:
        for j in range(M):
            if mem[j] > limit:
                return OVERSIZE
    inf = np.inf
    fwd_end = np.full((S, M), inf)
    bwd_end = np.full((S, M), inf)
    free = np.zeros(S)
    held = np.zeros(S)
    next_f = np.zeros(S, np.int64)
    npend = np.zeros(S, np.int64)
    pending = np.zeros((S, M), np.bool_)
    pos = np.zeros(S, np.int64)
    t = 0.0
    done = 0
    total = 2 * S * M
    while done < total:
        progressed = False
        for s in range(S):
            if free[s] > t:
                continue
            best_b = -1
            best_ready = inf
            for j in range(M):
                if pending[s, j]:
                    ready = fwd_end[s, j] if s == S - 1 else bwd_end[s + 1, j] + p2p[j]
                    if ready <= t and ready < best_ready:
                        best_b = j
                        best_ready = ready
            if best_b >= 0:
                j = best_b
                bwd_end[s, j] = t + bwd[s, j]
                free[s] = bwd_end[s, j]
                pending[s, j] = False
                npend[s] -= 1
                held[s] -= mem[j]
                ops[s, pos[s]] = -(j + 1)
                pos[s] += 1
                done += 1
                progressed = True
                continue
            j = next_f[s]
            if j < M:
                ready = 0.0 if s == 0 else fwd_end[s - 1, j] + p2p[j]
                if ready <= t and (npend[s] == 0 or held[s] + mem[j] <= limit):
                    fwd_end[s, j] = t + fwd[s, j]
                    free[s] = fwd_end[s, j]
                    next_f[s] += 1
                    pending[s, j] = True
                    npend[s] += 1
                    held[s] += mem[j]
                    ops[s, pos[s]] = j + 1
                    pos[s] += 1
                    done += 1
                    progressed = True
        if done == total:
            break
        nt = inf  # the next instant something can change: a stage frees up or an input arrives
        for s in range(S):
            if t < free[s] < nt:
                nt = free[s]
            for j in range(M):
                if s > 0:
                    a = fwd_end[s - 1, j] + p2p[j]
                    if t < a < nt:
                        nt = a
                if s < S - 1:
                    a = bwd_end[s + 1, j] + p2p[j]
                    if t < a < nt:
                        nt = a
        if nt == inf:
            if progressed:
                continue  # zero-length ops finished at t: look again
            return STALL
        t = nt
    return OK


def adaptive_reference(fwd, bwd, p2p, mem, limit, alone):
    """Plain-Python `adaptive_kernel`: the op lists (one list per stage), or raise ValueError for an
    oversize micro-batch without ``alone`` / RuntimeError on a stall."""
    S, M = len(fwd), len(fwd[0])
    if not alone and any(float(m) > limit for m in mem):
        raise ValueError("a micro-batch exceeds the memory limit")
    fwd_end, bwd_end = {}, {}  # (stage, micro-batch) -> end time, once scheduled
    free, held = [0.0] * S, [0.0] * S
    next_f = [0] * S
    pending = [[] for _ in range(S)]  # forwarded on the stage, not yet backwarded
    orders = [[] for _ in range(S)]
    t = 0.0
    while sum(len(o) for o in orders) < 2 * S * M:
        progressed = False
        for s in range(S):
            if free[s] > t:
                continue
            ready_b = [((fwd_end[(s, j)] if s == S - 1 else bwd_end.get((s + 1, j), np.inf) + p2p[j]), j)
                       for j in sorted(pending[s])]
            ready_b = [(r, j) for r, j in ready_b if r <= t]
            if ready_b:
                _, j = min(ready_b)  # earliest ready, then lowest micro-batch
                bwd_end[(s, j)] = free[s] = t + float(bwd[s][j])
                pending[s].remove(j)
                held[s] -= float(mem[j])
                orders[s].append(-(j + 1))
                progressed = True
                continue
            j = next_f[s]
            if j < M:
                ready = 0.0 if s == 0 else fwd_end.get((s - 1, j), np.inf) + p2p[j]
                if ready <= t and (not pending[s] or held[s] + float(mem[j]) <= limit):
                    fwd_end[(s, j)] = free[s] = t + float(fwd[s][j])
                    next_f[s] += 1
                    pending[s].append(j)
                    held[s] += float(mem[j])
                    orders[s].append(j + 1)
                    progressed = True
        arrivals = [fwd_end[(s - 1, j)] + p2p[j] for s in range(1, S) for j in range(M) if (s - 1, j) in fwd_end]
        arrivals += [bwd_end[(s + 1, j)] + p2p[j] for s in range(S - 1) for j in range(M) if (s + 1, j) in bwd_end]
        later = [x for x in free + arrivals if x > t]
        if later:
            t = min(later)
        elif not progressed and sum(len(o) for o in orders) < 2 * S * M:
            raise RuntimeError("adaptive order construction stalled")
    return orders


# --------------------------------------------------------------------------- per-rank ordering


def order_ranks_schedule(times, p2p, mem, rank_of, ranks, fwd_fraction, stages, code, limit, optimize):
    """Execution order within each rank for schedule ``code`` (`dynabatch.core.kernels.op_codes`; adaptive
    with ``limit`` bytes in flight per stage, an oversize micro-batch alone).

    Returns (perm, rank_time, peak): ``perm`` lists micro-batch indices rank by rank in execution
    order; ``rank_time`` each rank's simulated makespan (seconds; the best of `candidate_orders`
    with ``optimize``, else the given order); ``peak`` each rank's largest in-flight activation bytes
    on any stage. Every stage spends ``fwd_fraction`` of a micro-batch's ``times`` in its forward.
    The kernel `_order_ranks` on ``times`` repeated per stage (`_ordering_args`).
    """
    times = kernel_array(times, np.float64)
    st = np.repeat(times[None, :], int(stages), axis=0)
    return _order_ranks(st, *_ordering_args(p2p, mem, rank_of, ranks, fwd_fraction, code, limit, optimize), False)


def _ordering_args(p2p, mem, rank_of, ranks, fwd_fraction, code, limit, optimize):
    """The arguments of `_order_ranks` after its stage times, each of one type whoever calls: the two
    orderings are Python faces of the one kernel, so numba compiles the search (and the op tables and
    simulations it runs) once for both and for every caller, not once per numba wrapper and argument mix."""
    return (kernel_array(p2p, np.float64), kernel_array(mem, np.float64), kernel_array(rank_of, np.int32),
            int(ranks), float(fwd_fraction), np.int64(code), float(limit), bool(optimize))


def order_ranks_schedule_reference(times, p2p, mem, rank_of, ranks, fwd_fraction, stages, code, limit, optimize):
    """Plain-Python `order_ranks_schedule`: (perm, rank_time, peak) as lists."""
    return _order_ranks_reference([list(times)] * stages, p2p, mem, rank_of, ranks, fwd_fraction, code, limit,
                                  optimize, lambda sub: candidate_orders_reference(sub[0]))


# --------------------------------------------------------------------------- per-rank ordering, stage times


@njit(cache=True)
def stage_candidates(st):
    """Candidate execution orders (rows, positions) of one rank's micro-batches with stage times
    ``st`` float64 ``[S, k]``: `candidate_orders` of the bottleneck (largest stage) time and of the
    mean stage time, Johnson's two-machine rule on (front half, back half) of the stages, and an
    alternation of the most front-heavy and most back-heavy micro-batches. 10 rows."""
    S, k = st.shape
    top = np.empty(k)
    mean = np.empty(k)
    h = max(S // 2, 1)
    front = np.zeros(k)
    back = np.zeros(k)
    for j in range(k):
        m = st[0, j]
        acc = 0.0
        for s in range(S):
            m = max(m, st[s, j])
            acc += st[s, j]
            if s < h:
                front[j] += st[s, j]
            else:
                back[j] += st[s, j]
        top[j] = m
        mean[j] = acc / S
    out = np.empty((10, k), np.int64)
    out[0:4] = candidate_orders(top)
    out[4:8] = candidate_orders(mean)
    first = np.flatnonzero(front < back)
    last = np.flatnonzero(front >= back)
    a = first[np.argsort(front[first], kind="mergesort")]
    b = last[np.argsort(-back[last], kind="mergesort")]
    for q in range(a.shape[0]):
        out[8, q] = a[q]
    for q in range(b.shape[0]):
        out[8, a.shape[0] + q] = b[q]
    by = np.argsort(front - back, kind="mergesort")
    for q in range((k + 1) // 2):
        out[9, 2 * q] = by[q]
    for q in range(k // 2):
        out[9, 2 * q + 1] = by[k - 1 - q]
    return out


def stage_candidates_reference(st):
    """Plain-Python `stage_candidates`: the 10 orders as lists of positions."""
    S, k = len(st), len(st[0])
    cols = [[float(st[s][j]) for s in range(S)] for j in range(k)]
    top = [max(c) for c in cols]
    mean = [sum(c) / S for c in cols]
    h = max(S // 2, 1)
    front = [sum(c[:h]) for c in cols]
    back = [sum(c[h:]) for c in cols]
    # Johnson's rule: micro-batches lighter in front first (ascending front time), then the others
    # (descending back time): the first stages start early, the last stages finish soon after
    johnson = (sorted((j for j in range(k) if front[j] < back[j]), key=lambda j: front[j])
               + sorted((j for j in range(k) if front[j] >= back[j]), key=lambda j: -back[j]))
    by = sorted(range(k), key=lambda j: front[j] - back[j])  # most back-heavy first
    alternation = [by[q // 2] if q % 2 == 0 else by[k - 1 - q // 2] for q in range(k)]
    return candidate_orders_reference(top) + candidate_orders_reference(mean) + [johnson, alternation]


@njit(cache=True)
def chunks_of(code):
    """Model chunks per rank of schedule ``code``."""
    return INTERLEAVED_CHUNKS if code == INTERLEAVED else 1


@njit(cache=True)
def rank_ops_kernel(code, st, p2p, mem, fwd_fraction, limit):
    """(table, fwd, bwd, status) of one rank running the micro-batches of ``st`` ``[S, k]`` (seconds per
    stage, columns in execution order) under schedule ``code``: the one derivation of a rank's op
    table (adaptive: `adaptive_kernel` on the split stage times, ``p2p`` ``[k]`` seconds, ``mem`` ``[k]``
    bytes and ``limit`` bytes in flight per stage, an oversize micro-batch alone; every other code: its
    static table, fixed by ``S`` and ``k``). ``fwd``/``bwd``: the split times per virtual stage (each of a
    stage's chunks a ``1 / v`` share). ``status`` as `adaptive_kernel` returns it (0 OK)."""
    S, k = st.shape
    fwd, bwd = split_kernel(st, fwd_fraction)
    if code == ADAPTIVE:
        ops = np.zeros((S, 2 * k), np.int32)
        # np.bool_, not a literal True: numba compiles a kernel once per literal argument value
        status = adaptive_kernel(fwd, bwd, p2p, mem, limit, np.bool_(True), ops)
        return codes_table(ops, k), fwd, bwd, status
    v = chunks_of(code)
    if v > 1:
        fwd, bwd = chunk_times(fwd, v), chunk_times(bwd, v)
    return static_table(code, S, k), fwd, bwd, OK


def rank_ops_reference(code, st, p2p, mem, fwd_fraction, limit):
    """Plain `rank_ops_kernel`: (table as lists per stage, fwd, bwd); raises RuntimeError on a stall."""
    S, k = len(st), len(st[0])
    fwd, bwd = split_reference(st, fwd_fraction)
    if code == ADAPTIVE:
        ops = adaptive_reference(fwd, bwd, [float(x) for x in p2p], [float(x) for x in mem], limit, True)
        return codes_table_reference(ops, k), fwd, bwd
    v = INTERLEAVED_CHUNKS if code == INTERLEAVED else 1
    if v > 1:
        fwd, bwd = chunk_times_reference(fwd, v), chunk_times_reference(bwd, v)
    return static_table_reference(code, S, k), fwd, bwd


@njit(cache=True)
def record_slots_kernel(code, st, p2p, mem, rank_order, counts, fwd_fraction, limit, slots):
    """Fill ``slots`` int32 ``[S, M, 2]`` with the position of each micro-batch's forward (``[..., 0]``) and
    backward (``[..., 1]``) in its rank's op table of `rank_ops_kernel` (schedules of one chunk without a
    split backward). ``rank_order`` int64 ``[M]``: micro-batch indices rank by rank in execution order,
    ``counts`` int64 ``[R]`` per rank; ``st`` ``[S, M]`` seconds, ``p2p``/``mem`` ``[M]``. Returns 0 (OK) or
    the first rank's stall status."""
    S = st.shape[0]
    pos = 0
    for r in range(counts.shape[0]):
        k = counts[r]
        if k == 0:
            continue
        idx = rank_order[pos:pos + k]
        sub = np.empty((S, k))
        for s in range(S):
            for q in range(k):
                sub[s, q] = st[s, idx[q]]
        table, _, _, status = rank_ops_kernel(code, sub, p2p[idx], mem[idx], fwd_fraction, limit)
        if status != OK:
            return status
        for s in range(S):
            for i in range(2 * k):
                slots[s, idx[table[s, i, 1]], table[s, i, 0]] = i  # kinds: 0 forward, 1 backward
        pos += k
    return OK


def record_slots_reference(code, st, p2p, mem, rank_order, counts, fwd_fraction, limit):
    """Plain `record_slots_kernel`: the slots as a nested list ``[S][M][2]``."""
    S, M = len(st), len(st[0])
    slots = [[[0, 0] for _ in range(M)] for _ in range(S)]
    pos = 0
    for k in counts:
        idx = [int(x) for x in rank_order[pos:pos + k]]
        pos += k
        if not idx:
            continue
        table, _, _ = rank_ops_reference(code, [[float(st[s][j]) for j in idx] for s in range(S)],
                                         [p2p[j] for j in idx], [mem[j] for j in idx], fwd_fraction, limit)
        for s in range(S):
            for i, (kind, j, _, _) in enumerate(table[s]):
                slots[s][idx[j]][kind] = i
    return slots


@njit(cache=True, nogil=True)
def _order_ranks(st, p2p, mem, rank_of, ranks, fwd_fraction, code, limit, optimize, per_stage):
    """The kernel of `order_ranks_schedule` and `order_ranks_stages` (their arguments; ``rank_of`` int32,
    ``code`` int64): each rank's candidates (of `stage_candidates` when ``per_stage``, else `candidate_orders`
    of stage 0's times) simulated, the first of the lowest makespans kept."""
    S, M = st.shape
    perm = np.empty(M, np.int64)
    rank_time = np.zeros(ranks)
    peak = np.zeros(ranks)
    pn = np.empty(S, np.int64)
    pb = np.empty(S)
    pos = 0
    for r in range(ranks):
        idx = np.flatnonzero(rank_of == r)
        k = idx.shape[0]
        if k == 0:
            continue
        if not (optimize and k > 1):
            cands = np.arange(k).reshape(1, k)
        elif per_stage:
            cands = stage_candidates(np.ascontiguousarray(st[:, idx]))
        else:
            cands = candidate_orders(st[0][idx])
        best = np.inf
        best_c = 0
        for c in range(cands.shape[0]):
            sel = idx[cands[c]]
            o_p, o_m = p2p[sel], mem[sel]
            table, fwd, bwd, status = rank_ops_kernel(code, np.ascontiguousarray(st[:, sel]), o_p, o_m,
                                                      fwd_fraction, limit)
            v = makespan_table_kernel(fwd, bwd, WEIGHT_SHARE, o_p, table) if status == OK else np.inf  # stall
            if c == 0 or v < best:  # the first of equals
                best = v
                best_c = c
                inflight_table_kernel(table, o_m, chunks_of(code), pn, pb)
                peak[r] = pb.max()
        rank_time[r] = best
        chosen = cands[best_c]
        for q in range(k):
            perm[pos + q] = idx[chosen[q]]
        pos += k
    return perm, rank_time, peak


def order_ranks_stages(st, p2p, mem, rank_of, ranks, fwd_fraction, code, limit, optimize):
    """`order_ranks_schedule` on stage times ``st`` float64 ``[S, M]`` (seconds per stage and
    micro-batch): each rank's best of `stage_candidates` (with ``optimize``, else the given order) by
    simulated makespan under schedule ``code`` (`dynabatch.core.kernels.op_codes`; adaptive with ``limit``
    bytes in flight per stage, an oversize micro-batch alone); ties: the first candidate.

    Returns (perm, rank_time, peak): micro-batch indices rank by rank in execution order, each rank's
    makespan (seconds) and its largest in-flight activation bytes (``mem`` ``[M]``) on any stage. The kernel
    `_order_ranks` (`_ordering_args`)."""
    return _order_ranks(kernel_array(st, np.float64),
                        *_ordering_args(p2p, mem, rank_of, ranks, fwd_fraction, code, limit, optimize), True)


def order_ranks_stages_reference(st, p2p, mem, rank_of, ranks, fwd_fraction, code, limit, optimize):
    """Plain-Python `order_ranks_stages`: (perm, rank_time, peak) as lists."""
    return _order_ranks_reference(st, p2p, mem, rank_of, ranks, fwd_fraction, code, limit, optimize,
                                  stage_candidates_reference)


def _order_ranks_reference(st, p2p, mem, rank_of, ranks, fwd_fraction, code, limit, optimize, candidates):
    """Plain-Python `_order_ranks`: each rank's ``candidates(its [S, k] stage times)`` simulated (every
    stage runs a micro-batch's forward for ``fwd_fraction`` of its time, its backward for the rest),
    the first of the lowest makespans kept. (perm, rank_time, peak) as lists."""
    S = len(st)
    perm, rank_time, peak = [], [0.0] * ranks, [0.0] * ranks
    for r in range(ranks):
        mine = [q for q in range(len(rank_of)) if rank_of[q] == r]
        k = len(mine)
        if k == 0:
            continue

        def run(order):
            cols = [mine[q] for q in order]
            pp, mo = [float(p2p[j]) for j in cols], [float(mem[j]) for j in cols]
            try:
                table, fwd, bwd = rank_ops_reference(code, [[float(st[s][j]) for j in cols] for s in range(S)], pp,
                                                     mo, fwd_fraction, limit)
            except RuntimeError:  # a stall: never the best
                return float("inf"), 0.0
            v = INTERLEAVED_CHUNKS if code == INTERLEAVED else 1
            return (makespan_table_reference(fwd, bwd, WEIGHT_SHARE, pp, table),
                    max(inflight_table_reference(table, mo, v)[1]))

        sub = [[float(st[s][j]) for j in mine] for s in range(S)]
        cands = candidates(sub) if optimize and k > 1 else [list(range(k))]
        runs = [run(o) for o in cands]
        best = min(range(len(cands)), key=lambda c: runs[c][0])  # the first of equals
        rank_time[r], peak[r] = runs[best]
        perm += [mine[q] for q in cands[best]]
    return perm, rank_time, peak
