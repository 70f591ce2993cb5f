"""Numba kernels of the flush-free (asynchronous, cross-step) 1F1B simulator, each beside its
plain-Python reference. `dynabatch.core.simulate.flushfree` wraps them; the model is documented there.

Layout. ``R`` data-parallel ranks, ``S`` stages, ``K`` consecutive steps. Every rank runs its own
stream of micro-batches, the steps one after the other; the streams of all ranks are concatenated
rank by rank into one flat axis of ``N`` micro-batches: rank ``r`` owns ``[roff[r], roff[r+1])``.
``ends`` (int64 ``[R, K]``) holds, for each rank, the exclusive end (index *within the rank's
stream*) of each step: step ``k`` of rank ``r`` is local micro-batches ``[ends[r, k-1], ends[r, k])``
(``ends[r, -1] = 0``); it is non-decreasing and ``ends[r, K-1] = roff[r+1] - roff[r]``.

Op lists: one op-table row per stage of a rank (`dynabatch.core.kernels.op_tables.stream_row`, ``2 n + K``
ops for a rank of ``n`` micro-batches): Megatron's 1F1B order over the rank's whole stream (one warm-up,
at the start) with step ``k``'s `UPDATE` right after the backward of its last micro-batch (at the very
start, before the warm-up forwards, when the rank has no micro-batch up to step ``k``).

Dependencies: as in `dynabatch.core.kernels.simulate` (``F(s, j)`` after ``F(s-1, j)`` + ``p2p[j]``;
``B(S-1, j)`` after ``F(S-1, j)``; ``B(s, j)`` after ``B(s+1, j)`` + ``p2p[j]``), plus the update
barrier: ``U_k`` on stage ``s`` starts on every rank at once, when the last rank's stage ``s`` has
reached it (the data-parallel gradient all-reduce of that stage), and lasts ``upd[s]`` seconds.
Times are seconds.

Each kernel has its plain-Python reference, named with ``_reference`` (`flushfree_reference`,
`stage_loads_reference`); the event loop is built from the pieces of `dynabatch.core.kernels.simulate`'s
(`op_ready`, `worklist`, `requeue`, `place`).
"""

from __future__ import annotations

import numpy as np
from .compile_once import njit

from .op_codes import COLUMNS, FORWARD, UPDATE
from .op_tables import stream_row, stream_row_reference
from .simulate import op_ready, place, requeue, worklist

#: Return codes of :func:`flushfree_kernel`.
OK, DEADLOCK = 0, 1


# --------------------------------------------------------------------------- simulation


@njit(cache=True)
def flushfree_kernel(fwd, bwd, p2p, roff, ends, upd, start, end, upd_end):
    """Simulate the flush-free schedule of every rank (layout and rules in the module doc).

    ``fwd``/``bwd`` float64 ``[S, N]`` seconds, ``p2p`` float64 ``[N]`` seconds, ``roff`` int64
    ``[R + 1]``, ``ends`` int64 ``[R, K]``, ``upd`` float64 ``[S]`` seconds per update. Fills
    ``start``/``end`` (float64 ``[S, N, 2]``: ``[..., 0]`` forward, ``[..., 1]`` backward) and
    ``upd_end`` (float64 ``[S, K]``: when stage ``s`` finished applying step ``k``'s update, the same
    on every rank). Returns 0, or 1 when some op never ran (``-inf`` left in the outputs).
    """
    S, N = fwd.shape
    R, K = ends.shape
    start[:] = -np.inf
    end[:] = -np.inf
    upd_end[:] = -np.inf
    # the op list of every (rank, stage): one table row each
    lens = np.zeros(R * S, dtype=np.int64)
    for r in range(R):
        for s in range(S):
            lens[r * S + s] = 2 * (roff[r + 1] - roff[r]) + K
    ops = np.zeros((R * S, lens.max() if R * S else 0, COLUMNS), np.int32)
    for r in range(R):
        rows = np.zeros((S, lens[r * S], COLUMNS), np.int32)
        for s in range(S):
            stream_row(rows, s, S, ends[r])
            ops[r * S + s, :lens[r * S]] = rows[s]
    ptr = np.zeros(R * S, dtype=np.int64)
    free = np.zeros(R * S)
    waiting = np.zeros(R * S, dtype=np.bool_)  # registered at the barrier of its current update
    arrived = np.zeros((S, K), dtype=np.int64)
    latest = np.zeros((S, K))
    stack, queued, top = worklist(R * S)  # the (rank, stage) op lists that may be able to advance
    remaining = lens.sum()
    while top > 0:
        top -= 1
        q = stack[top]
        queued[q] = False
        r = q // S
        s = q - r * S
        base = roff[r]
        advanced = False
        released = -1
        while ptr[q] < lens[q]:
            kind, j = ops[q, ptr[q], 0], ops[q, ptr[q], 1]
            if kind == UPDATE:  # update of step k: a barrier over the ranks' stage s
                k = j
                if upd_end[s, k] == -np.inf:
                    if not waiting[q]:
                        waiting[q] = True
                        arrived[s, k] += 1
                        latest[s, k] = max(latest[s, k], free[q])
                    if arrived[s, k] < R:
                        break
                    upd_end[s, k] = latest[s, k] + upd[s]
                    released = k
                waiting[q] = False
                free[q] = upd_end[s, k]
                ptr[q] += 1
                remaining -= 1
                advanced = True
                continue
            # a local micro-batch, shifted to the flat axis, has simulate's dependency rule
            slot, dur, ready = op_ready(fwd, bwd, 0.0, p2p, end, S, s, kind, base + j, np.int64(0))
            if ready == -np.inf:
                break
            free[q] = place(start, end, s, base + j, slot, max(free[q], ready), dur)
            ptr[q] += 1
            remaining -= 1
            advanced = True
        if advanced:  # the op's result may unblock this rank's neighbouring stages
            if s > 0 and ptr[q - 1] < lens[q - 1]:
                top = requeue(stack, top, queued, q - 1)
            if s < S - 1 and ptr[q + 1] < lens[q + 1]:
                top = requeue(stack, top, queued, q + 1)
        if released >= 0:  # every rank's stage s may pass the barrier now
            for r2 in range(R):
                nb = r2 * S + s
                if nb != q and ptr[nb] < lens[nb]:
                    top = requeue(stack, top, queued, nb)
    return DEADLOCK if remaining > 0 else OK


def flushfree_reference(fwd, bwd, p2p, roff, ends, upd):
    """Plain-Python `flushfree_kernel`: sweep every (rank, stage) until nothing moves.

    Returns ``(start, end, upd_end, deadlocked)`` (arrays as the kernel fills them)."""
    S, N = np.shape(fwd)
    R, K = np.shape(ends)
    lists = {(r, s): stream_row_reference(s, S, ends[r]) for r in range(R) for s in range(S)}
    start = np.full((S, N, 2), -np.inf)
    end = np.full((S, N, 2), -np.inf)
    upd_end = np.full((S, K), -np.inf)
    pos = {q: 0 for q in lists}
    free = {q: 0.0 for q in lists}
    moved = True
    while moved:
        moved = False
        for (r, s), ops in lists.items():
            while pos[(r, s)] < len(ops):
                kind, j, _, _ = ops[pos[(r, s)]]
                if kind == UPDATE:
                    k = j
                    # the barrier: every rank's stage s has this update as its next op (or passed it)
                    at = []
                    for r2 in range(R):
                        i2 = lists[(r2, s)].index((UPDATE, k, 0, 0))
                        if pos[(r2, s)] < i2:
                            break
                        at.append(free[(r2, s)] if pos[(r2, s)] == i2 else None)
                    else:
                        if upd_end[s, k] == -np.inf:
                            upd_end[s, k] = max(t for t in at if t is not None) + float(upd[s])
                        free[(r, s)] = float(upd_end[s, k])
                        pos[(r, s)] += 1
                        moved = True
                        continue
                    break
                g = int(roff[r]) + j
                if kind == FORWARD:
                    ready = 0.0 if s == 0 else end[s - 1, g, 0] + p2p[g]
                    kk = 0
                else:
                    ready = end[s, g, 0] if s == S - 1 else end[s + 1, g, 1] + p2p[g]
                    kk = 1
                if ready == -np.inf:
                    break
                t0 = max(free[(r, s)], float(ready))
                start[s, g, kk] = t0
                end[s, g, kk] = t0 + float(fwd[s][g] if kk == 0 else bwd[s][g])
                free[(r, s)] = float(end[s, g, kk])
                pos[(r, s)] += 1
                moved = True
    deadlocked = any(pos[q] < len(lists[q]) for q in lists)
    return start, end, upd_end, deadlocked


# --------------------------------------------------------------------------- steady-state bounds


@njit(cache=True)
def stage_loads(st, p2p, rank_of, R, load, cycle):
    """Per-rank, per-stage lower bounds of the flush-free steady state (seconds per step).

    ``st`` float64 ``[S, M]`` forward+backward seconds of each micro-batch on each stage, ``p2p``
    float64 ``[M]`` seconds, ``rank_of`` int ``[M]``. Fills ``load`` (float64 ``[R, S]``): the busy
    seconds of stage ``s`` of rank ``r``, ``sum_j st[s, j]``; and ``cycle`` (float64 ``[R, S]``):
    ``sum_j (sum_{s' >= s} st[s', j] + 2 (S - 1 - s) p2p[j]) / (S - s)``, the 1F1B round-trip bound
    (stage ``s`` starts micro-batch ``j + S - s`` only after ``j``'s backward came back to it).
    """
    S, M = st.shape
    load[:] = 0.0
    cycle[:] = 0.0
    for j in range(M):
        r = rank_of[j]
        tail = 0.0
        for s in range(S - 1, -1, -1):
            tail += st[s, j]
            load[r, s] += st[s, j]
            cycle[r, s] += (tail + 2.0 * (S - 1 - s) * p2p[j]) / (S - s)


def stage_loads_reference(st, p2p, rank_of, R):
    """Plain-Python `stage_loads`: ``(load, cycle)`` as nested lists ``[R][S]``."""
    S, M = np.shape(st)
    load = [[0.0] * S for _ in range(R)]
    cycle = [[0.0] * S for _ in range(R)]
    for r in range(R):
        mine = [j for j in range(M) if rank_of[j] == r]
        for s in range(S):
            load[r][s] = sum(float(st[s][j]) for j in mine)
            trips = [sum(float(st[x][j]) for x in range(s, S)) + 2.0 * (S - 1 - s) * float(p2p[j]) for j in mine]
            cycle[r][s] = sum(trips) / (S - s)
    return load, cycle
