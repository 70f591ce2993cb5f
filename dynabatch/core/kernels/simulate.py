"""Numba kernels of the pipeline simulator, each beside its plain-Python reference.

The simulator prices op tables (`dynabatch.core.kernels.op_codes`: int32 ``[S, L, 4]``, per rank its ops
with kind, micro-batch, chunk and model). Times are per *virtual stage*: ``fwd``/``bwd`` float64
``[Q, M]`` seconds with ``Q = v S`` (chunk ``c`` of rank ``s`` is virtual stage ``c S + s``; ``Q = S``
without chunks); a split backward's weight part takes ``wshare`` of ``bwd``, its input part the rest.
The dependency rules are documented in `dynabatch.core.simulate.pipeline`, which wraps these kernels with
validation. The plain op codes of one chunk (``j + 1`` forward, ``-(j + 1)`` backward; int ``[S, 2M]``)
are a table too (`dynabatch.core.kernels.op_tables.codes_table`): `simulate_kernel`, `makespan_kernel`,
`inflight_kernel` and `run_ops` take them for their callers (the planner's balancing and reordering, the
spill timing). Times are seconds, memory bytes; contiguous float64 / int32 arrays.

=========================  ===============================
kernel                     reference
=========================  ===============================
`simulate_table_kernel`    `simulate_table_reference`
`makespan_table_kernel`    `makespan_table_reference`
`inflight_table_kernel`    `inflight_table_reference`
`held_table_kernel`        `held_table_reference`
`simulate_kernel`          `simulate_reference`
`makespan_kernel`          `makespan_reference`
`inflight_kernel`          `inflight_reference`
`schedule_kernel`          `schedule_reference`
=========================  ===============================

`split_kernel` and `chunk_times` (the seconds of each op) live in `dynabatch.core.kernels.times`, the bytes
in flight under an order (`inflight_table_kernel`, `held_table_kernel`, `inflight_kernel`) in
`dynabatch.core.kernels.inflight`; both are imported here too.

`run_table` is the event loop of all of them and of `dynabatch.core.kernels.spill`'s kernel, whose ops
also wait for shard loads (`gated_start`); the references' `_sweep_table` takes a ``start_at`` hook for the
same purpose. `worklist`, `requeue` and `place` are also pieces of the flush-free event loop
(`dynabatch.core.kernels.flushfree`), `op_ready` its dependency rule.
"""

from __future__ import annotations

import numpy as np
from .compile_once import njit

from .op_codes import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, NOP, UPDATE
from .op_tables import codes_table, codes_table_reference, static_table, static_table_reference, table_codes
from .times import chunk_times, chunk_times_reference, split_kernel, split_reference  # noqa: F401 (their home)
from .inflight import (held_table_kernel, held_table_reference, inflight_kernel, inflight_reference,  # noqa: F401
                       inflight_table_kernel, inflight_table_reference)

#: Return codes of :func:`simulate_kernel`.
OK, DEADLOCK, BAD_INPUT = 0, 1, 2

#: Shard copy kinds of `gated_start` (``kind // 2``: 0 demand / 1 prefetch; ``kind % 2``: 0 spill / 1 load).
DEMAND_SPILL, DEMAND_LOAD, PREFETCH_SPILL, PREFETCH_LOAD = 0, 1, 2, 3


# --------------------------------------------------------------------------- the static plain orders


@njit(cache=True)
def schedule_kernel(S, M, kind_code):
    """int32 ``[S, 2M]`` plain op codes of static schedule ``kind_code`` 0 (GPipe) or 1 (1F1B), from its op
    table (`dynabatch.core.kernels.op_tables.static_table`); zeros for a code whose ops are not plain."""
    codes, _ = table_codes(static_table(kind_code, S, M))
    return codes


def schedule_reference(S, M, kind_code):
    """Plain-Python `schedule_kernel`: a list of ``S`` op-code lists."""
    return [[j + 1 if kind == FORWARD else -(j + 1) for kind, j, _, _ in row]
            for row in static_table_reference(kind_code, S, M)]


# --------------------------------------------------------------------------- event simulation


@njit(cache=True)
def op_ready(fwd, bwd, wshare, p2p, end, S, s, kind, j, c):
    """``(slot, dur, ready)`` of op ``kind`` of micro-batch ``j`` on chunk ``c`` of stage ``s``: the slot of
    ``end``'s last axis it fills (0 forward, 1 backward or its input part, 2 the weight part in its own
    array, 3 an update), its seconds and when its dependency's result is there (``-inf`` while that
    dependency has not finished in ``end``). Forwards follow the previous virtual stage's forward plus
    ``p2p[j]``; a backward (or its input part) the next virtual stage's backward plus ``p2p[j]`` (on the
    last virtual stage its own forward); the weight part its input part; an update nothing. Transfers
    between chunks of one stage (``S = 1``) take no time. ``slot = -1``: not an op (bad input)."""
    Q, M = fwd.shape
    if kind == UPDATE:
        return 3, 0.0, 0.0
    if kind < FORWARD or kind > BACKWARD_WEIGHT or j < 0 or j >= M or c < 0 or c * S + s >= Q:
        return -1, 0.0, -np.inf
    q = c * S + s
    hop = p2p[j] if S > 1 else 0.0
    if kind == FORWARD:
        return 0, fwd[q, j], 0.0 if q == 0 else end[q - 1, j, 0] + hop  # -inf stays -inf
    if kind == BACKWARD_WEIGHT:
        return 2, bwd[q, j] * wshare, end[q, j, 1]
    dur = bwd[q, j] if kind == BACKWARD else bwd[q, j] - bwd[q, j] * wshare
    return 1, dur, end[q, j, 0] if q == Q - 1 else end[q + 1, j, 1] + hop


@njit(cache=True)
def _run_copies(s, use, phase, issue, copies, state):
    """Run stage ``s``'s next copies of ``use`` in ``phase`` (0 demand, 1 prefetch) issued at ``issue``
    (s) one after another on its copy engine; a load makes its shard available at its end."""
    ncopy, cuse, ckind, cshard, cdur = copies
    cptr, engine, avail, cstart, cend, _ = state
    c = cptr[s]
    while c < ncopy[s] and cuse[s, c] == use and ckind[s, c] // 2 == phase:
        t = max(engine[s], issue)
        cstart[s, c] = t
        engine[s] = t + cdur[s, c]
        cend[s, c] = engine[s]
        if ckind[s, c] % 2 == 1:
            avail[s, cshard[s, c]] = engine[s]
        c += 1
    cptr[s] = c


@njit(cache=True)
def gated_start(s, use, shard, free, ready, copies, state):
    """When stage ``s``'s ``use`` of ``shard`` starts, given when the stage is free and when the use's
    dependency is ready (s): its demand copies run first (issued at ``free``), it waits for
    ``shard``'s latest load, adds the wait to ``state``'s stall, then issues its prefetch copies."""
    # np.int64, not literals: numba compiles a kernel once per literal argument value
    _run_copies(s, use, np.int64(0), free, copies, state)
    base = max(free, ready)
    t0 = max(base, state[2][s, shard])
    state[5][s] += t0 - base
    _run_copies(s, use, np.int64(1), t0, copies, state)
    return t0


@njit(cache=True, inline="always")
def worklist(n):
    """``(stack, queued, top)`` of an event loop over ``n`` op lists: every list queued, popped in
    order ``0, 1, ...``. A list only unblocks when another finishes an op, so re-queueing just the
    lists that op feeds (`requeue`) keeps a simulation O(ops) instead of re-sweeping to a fixpoint."""
    stack = np.empty(n, dtype=np.int64)
    queued = np.ones(n, dtype=np.bool_)
    for i in range(n):
        stack[i] = n - 1 - i
    return stack, queued, n


@njit(cache=True, inline="always")
def requeue(stack, top, queued, q):
    """Push op list ``q`` onto the `worklist` unless it is queued already; returns the new top."""
    if queued[q]:
        return top
    stack[top] = q
    queued[q] = True
    return top + 1


@njit(cache=True, inline="always")
def place(start, end, q, j, k, t0, dur):
    """Record op slot ``k`` (0 forward / 1 backward) of micro-batch ``j`` on virtual stage ``q`` as running
    from ``t0`` for ``dur`` seconds; returns its end (when the stage is free again)."""
    start[q, j, k] = t0
    end[q, j, k] = t0 + dur
    return t0 + dur


@njit(cache=True)
def table_lengths(table):
    """int64 ``[S]``: each rank's ops in ``table``, up to its first `NOP`."""
    S, L = table.shape[0], table.shape[1]
    n = np.full(S, L, np.int64)
    for s in range(S):
        for i in range(L):
            if table[s, i, 0] == NOP:
                n[s] = i
                break
    return n


@njit(cache=True)
def run_table(fwd, bwd, wshare, p2p, table, start, end, wstart, wend, shard_m, copies, state):
    """The event loop over op table ``table`` (int32 ``[S, L, 4]``): fills ``start``/``end`` (float64
    ``[Q, M, 2]``, s; the caller sets them to ``-inf``) and, for split backwards, ``wstart``/``wend``
    (``[Q, M]``). An op starts when its stage is free and its dependency has arrived (`op_ready`); when
    ``copies`` (``ncopy, cuse, ckind, cshard, cdur``) has a row per stage, also not before its shard's
    load (`gated_start`; shard ``j // shard_m`` of micro-batch ``j``, use = the op's position), with
    ``state`` = ``(cptr, engine, avail, cstart, cend, stall)`` carried along. Returns `OK`, `DEADLOCK` or
    `BAD_INPUT` (a row that is not an op, reached). Each op is examined O(1) times."""
    S = table.shape[0]
    gated = copies[0].shape[0] == S
    n = table_lengths(table)
    ptr = np.zeros(S, dtype=np.int64)
    free = np.zeros(S)
    stack, queued, top = worklist(S)  # the stages that may be able to advance
    remaining = n.sum()
    while top > 0:
        top -= 1
        s = stack[top]
        queued[s] = False
        advanced = False
        while ptr[s] < n[s]:
            i = ptr[s]
            j, c = np.int64(table[s, i, 1]), np.int64(table[s, i, 2])  # as flushfree_kernel's: one op_ready
            slot, dur, ready = op_ready(fwd, bwd, wshare, p2p, end, S, s, table[s, i, 0], j, c)
            if slot < 0:
                return BAD_INPUT
            if ready == -np.inf:
                break
            t0 = gated_start(s, i, j // shard_m, free[s], ready, copies, state) if gated else max(free[s], ready)
            q = c * S + s
            if slot == 2:
                wstart[q, j] = t0
                wend[q, j] = t0 + dur
                free[s] = t0 + dur
            elif slot == 3:
                free[s] = t0
            else:
                free[s] = place(start, end, q, j, slot, t0, dur)
            ptr[s] += 1
            remaining -= 1
            advanced = True
        if advanced and S > 1:  # the op's result may unblock a neighbour (round the ring with chunks)
            for nb in ((s + S - 1) % S, (s + 1) % S):
                if ptr[nb] < n[nb]:
                    top = requeue(stack, top, queued, nb)
    return DEADLOCK if remaining > 0 else OK


@njit(cache=True)
def _no_copies(start):
    # C-contiguous empties, as the real copies' arrays are: a slice of ``start`` (layout 'A') compiled
    # `run_table` and what it calls a second time, for the same arithmetic
    ints, flat, sheet = np.empty(0, np.int64), np.empty(0), np.empty((0, 0))
    table = np.empty((0, 0), np.int64)
    return (ints, table, table, table, sheet), (ints, flat, sheet, sheet, sheet, flat)


@njit(cache=True)
def simulate_table_kernel(fwd, bwd, wshare, p2p, table, start, end, wstart, wend):
    """Simulate op table ``table`` (int32 ``[S, L, 4]``); fill ``start``/``end`` (float64 ``[Q, M, 2]``) and
    ``wstart``/``wend`` (``[Q, M]``, the weight parts of split backwards), seconds. ``fwd``/``bwd`` float64
    ``[Q, M]`` per virtual stage, ``p2p`` ``[M]``. Returns 0 when every op ran, 1 on deadlock (unfinished
    ops keep ``-inf``), 2 for a row that is not an op of these shapes (reached)."""
    Q, M = fwd.shape
    S = table.shape[0]
    if S < 1 or Q % S != 0 or start.shape[0] != Q or wend.shape[0] != Q:
        return BAD_INPUT
    start[:] = -np.inf
    end[:] = -np.inf  # -inf marks "not finished yet"; real times are finite
    wstart[:] = -np.inf
    wend[:] = -np.inf
    copies, state = _no_copies(start)
    return run_table(fwd, bwd, wshare, p2p, table, start, end, wstart, wend, np.int64(1), copies, state)


@njit(cache=True)
def makespan_table_kernel(fwd, bwd, wshare, p2p, table):
    """Makespan in seconds of op table ``table``; ``+inf`` on deadlock, NaN on malformed input."""
    Q, M = fwd.shape
    start = np.empty((Q, M, 2))
    end = np.empty((Q, M, 2))
    wstart = np.empty((Q, M))
    wend = np.empty((Q, M))
    code = simulate_table_kernel(fwd, bwd, wshare, p2p, table, start, end, wstart, wend)
    if code == DEADLOCK:
        return np.inf
    if code != OK:
        return np.nan
    span = 0.0
    for x in end.ravel():
        span = max(span, x)
    for x in wend.ravel():
        span = max(span, x)
    return span


def _sweep_table(fwd, bwd, wshare, p2p, table, start_at=None):
    """Plain-Python event loop over an op table (lists of ``(kind, micro-batch, chunk, model)`` rows per
    rank, up to each rank's first `NOP`): sweep every rank until nothing moves. Returns ``(start, end,
    wstart, wend, pos)``: arrays as `simulate_table_kernel` fills them and where each rank stopped (its op
    count when it ran them all); a rank also stops at a row that is not an op. ``start_at(s, i, j, free,
    ready)``, when given, returns when rank ``s``'s ``i``-th op (of micro-batch ``j``) starts, given when the
    rank is free and when its dependency's result is there (default: the later of the two)."""
    Q, M = np.shape(fwd)
    S = len(table)
    rows = [[tuple(int(x) for x in r) for r in row] for row in table]
    rows = [row[:[r[0] for r in row].index(NOP)] if NOP in [r[0] for r in row] else row for row in rows]
    start, end = np.full((Q, M, 2), -np.inf), np.full((Q, M, 2), -np.inf)
    wstart, wend = np.full((Q, M), -np.inf), np.full((Q, M), -np.inf)
    done = {}  # (virtual stage, micro-batch, "F" / "B" / "W") -> end time
    pos, free = [0] * S, [0.0] * S
    moved = True
    while moved:
        moved = False
        for s in range(S):
            while pos[s] < len(rows[s]):
                kind, j, c, _ = rows[s][pos[s]]
                if kind == UPDATE:  # no dependency, no time
                    pos[s] += 1
                    moved = True
                    continue
                q = c * S + s
                if kind not in (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) or not 0 <= j < M or not 0 <= q < Q:
                    break
                hop = float(p2p[j]) if S > 1 else 0.0
                b = float(bwd[q][j])
                if kind == FORWARD:  # after the previous virtual stage's forward, sent on
                    dep, delay, dur = ((q - 1, j, "F") if q > 0 else None), hop, float(fwd[q][j])
                elif kind == BACKWARD_WEIGHT:  # after its own input part
                    dep, delay, dur = (q, j, "B"), 0.0, b * wshare
                elif q == Q - 1:  # the last virtual stage turns its own forward around
                    dep, delay, dur = (q, j, "F"), 0.0, b if kind == BACKWARD else b - b * wshare
                else:  # after the next virtual stage's backward, sent back
                    dep, delay, dur = (q + 1, j, "B"), hop, b if kind == BACKWARD else b - b * wshare
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + delay
                t0 = max(free[s], ready) if start_at is None else start_at(s, pos[s], j, free[s], ready)
                if kind == BACKWARD_WEIGHT:
                    wstart[q, j], wend[q, j] = t0, t0 + dur
                    done[(q, j, "W")] = t0 + dur
                else:
                    k = 0 if kind == FORWARD else 1
                    start[q, j, k], end[q, j, k] = t0, t0 + dur
                    done[(q, j, "F" if k == 0 else "B")] = t0 + dur
                free[s] = t0 + dur
                pos[s] += 1
                moved = True
    return start, end, wstart, wend, pos, [len(r) for r in rows]


def simulate_table_reference(fwd, bwd, wshare, p2p, table):
    """Plain-Python `simulate_table_kernel`: ``(start, end, wstart, wend, deadlocked)``."""
    start, end, wstart, wend, pos, n = _sweep_table(fwd, bwd, wshare, p2p, table)
    return start, end, wstart, wend, any(p < k for p, k in zip(pos, n))


def makespan_table_reference(fwd, bwd, wshare, p2p, table):
    """Plain-Python `makespan_table_kernel`: the last op's end, ``inf`` on deadlock, NaN when a stuck rank's
    next row is not an op."""
    _, end, _, wend, pos, n = _sweep_table(fwd, bwd, wshare, p2p, table)
    Q, M = np.shape(fwd)
    S = len(table)
    for s in range(S):
        if pos[s] < n[s]:
            kind, j, c, _ = (int(x) for x in table[s][pos[s]])
            if kind not in (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, UPDATE) or (
                    kind != UPDATE and not (0 <= j < M and 0 <= c * S + s < Q)):
                return float("nan")
    if any(p < k for p, k in zip(pos, n)):
        return float("inf")
    return max([0.0] + [float(t) for t in end.ravel() if t > -np.inf] + [float(t) for t in wend.ravel() if t > -np.inf])


# --------------------------------------------------------------------------- plain op codes


@njit(cache=True)
def run_ops(fwd, bwd, p2p, ops, start, end, M, copies, state):
    """`run_table` over plain op codes ``ops`` (int32 ``[S, 2N]``, shape checked by the caller; ``start``/``end``
    ``[S, N, 2]``, set to ``-inf`` by the caller); shard ``j // M`` of micro-batch ``j``. Returns `OK`,
    `DEADLOCK` or `BAD_INPUT` (an op code outside ``±1..±N``, reached)."""
    w = np.empty((0, start.shape[1]))  # no weight parts; C-contiguous as `simulate_table_kernel`'s (one compile)
    return run_table(fwd, bwd, 0.0, p2p, codes_table(ops, fwd.shape[1]), start, end, w, w, M, copies, state)


@njit(cache=True)
def simulate_kernel(fwd, bwd, p2p, ops, start, end):
    """Simulate plain op codes ``ops`` (int32 ``[S, 2M]``); fill ``start``/``end`` (float64 ``[S, M, 2]``, s).

    ``fwd``/``bwd`` are float64 ``[S, M]`` seconds, ``p2p`` float64 ``[M]`` seconds.
    Returns 0 when every op ran, 1 on deadlock (unfinished ops keep ``-inf`` in both
    arrays), 2 when ``ops`` has the wrong shape or an op code outside ``±1..±M`` (reached).
    """
    S, M = fwd.shape
    if ops.shape[0] != S or ops.shape[1] != 2 * M:
        return BAD_INPUT
    w = np.empty((S, M))
    return simulate_table_kernel(fwd, bwd, 0.0, p2p, codes_table(ops, M), start, end, w, w.copy())


def simulate_reference(fwd, bwd, p2p, ops):
    """Plain-Python `simulate_kernel` for op codes in which every stage lists each op once.

    Returns ``(start, end, deadlocked)``: float64 ``[S, M, 2]`` arrays (seconds, ``-inf`` for ops
    that never ran) and whether some op never ran.
    """
    start, end, pos = sweep_codes(fwd, bwd, p2p, ops)
    return start, end, any(p < 2 * np.shape(fwd)[1] for p in pos)


def sweep_codes(fwd, bwd, p2p, ops, start_at=None):
    """The plain-Python sweep (`_sweep_table`) over plain op codes ``ops`` (``[S, L]``, ±1..±M: forward /
    backward of micro-batch j), with forward and backward seconds ``fwd``/``bwd`` ``[S, M]`` and the
    transfer seconds ``p2p``: ``(start, end, pos)``; a stage also stops at an op code outside ``±1..±M``.
    ``start_at`` as `_sweep_table` takes it. Shared by the references of the simulator and the spill
    kernels."""
    table = codes_table_reference(ops, np.shape(fwd)[1])
    start, end, _, _, pos, _ = _sweep_table(fwd, bwd, 0.0, p2p, table, start_at)
    return start, end, pos


@njit(cache=True)
def makespan_kernel(fwd, bwd, p2p, ops):
    """Makespan in seconds of plain op codes ``ops``; ``+inf`` on deadlock, NaN on malformed ``ops``.

    Same argument types as :func:`simulate_kernel`.
    """
    S, M = fwd.shape
    if ops.shape[0] != S or ops.shape[1] != 2 * M:
        return np.nan
    return makespan_table_kernel(fwd, bwd, 0.0, p2p, codes_table(ops, M))


def makespan_reference(fwd, bwd, p2p, ops):
    """Plain-Python `makespan_kernel`: the last op's end (seconds), ``inf`` on deadlock, NaN when
    ``ops`` is not ``[S, 2M]`` or a stage reaches an op code outside ``±1..±M``."""
    S, M = np.shape(fwd)
    if np.shape(ops) != (S, 2 * M):
        return float("nan")
    return makespan_table_reference(fwd, bwd, 0.0, p2p, codes_table_reference(ops, M))
