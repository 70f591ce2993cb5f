"""Numba kernels of the pipeline simulator, each beside its plain-Python reference.

Op encoding (int32): ``j + 1`` is the forward of micro-batch ``j``, ``-(j + 1)`` its backward; a
schedule is an ``[S, 2M]`` array holding one op list per stage. Times are seconds, memory bytes.
The dependency rules are documented in `dynabatch.core.simulate.pipeline`, which wraps these kernels with
validation. The kernels take contiguous float64 / int32 arrays so other numba code can call them.

=====================  ==========================
kernel                 reference
=====================  ==========================
`schedule_kernel`      `schedule_reference`
`simulate_kernel`      `simulate_reference`
`makespan_kernel`      `makespan_reference`
`inflight_kernel`      `inflight_reference`
`split_kernel`         `split_reference`
=====================  ==========================

`run_ops` is the event loop of `simulate_kernel` and of `dynabatch.core.kernels.spill`'s kernel,
whose ops also wait for shard loads (`gated_start`; `op_ready` is the dependency rule); the
reference's `_sweep` takes a ``start_at`` hook for the same purpose. `op_ready`, `worklist`,
`requeue` and `place` are also the pieces of the flush-free event loop
(`dynabatch.core.kernels.flushfree`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

#: Return codes of :func:`simulate_kernel`.
OK, DEADLOCK, BAD_INPUT = 0, 1, 2

#: Shard copy kinds of `gated_start` (``kind // 2``: 0 demand / 1 prefetch; ``kind % 2``: 0 spill / 1 load).
DEMAND_SPILL, DEMAND_LOAD, PREFETCH_SPILL, PREFETCH_LOAD = 0, 1, 2, 3


# --------------------------------------------------------------------------- forward / backward split


@njit(cache=True)
def split_kernel(st, fwd_fraction):
    """(fwd, bwd) float64 ``[S, k]``: each stage runs a micro-batch's forward for ``fwd_fraction`` of its
    stage time ``st`` (seconds) and its backward for the rest. The one split every simulation of a
    plan uses (planner, recompute, inspect, flush-free); `split_reference` is its plain form."""
    S, k = st.shape
    fwd = np.empty((S, k))
    bwd = np.empty((S, k))
    for s in range(S):
        for j in range(k):
            fwd[s, j] = st[s, j] * fwd_fraction
            bwd[s, j] = st[s, j] - fwd[s, j]
    return fwd, bwd


def split_reference(st, fwd_fraction):
    """Plain `split_kernel` (numpy arrays, the same two operations per element)."""
    st = np.asarray(st, np.float64)
    fwd = st * fwd_fraction
    return fwd, st - fwd


# --------------------------------------------------------------------------- schedules


@njit(cache=True)
def schedule_kernel(S, M, kind_code):
    """int32 ``[S, 2M]`` op lists for ``kind_code`` 0 (GPipe) or 1 (Megatron 1F1B).

    GPipe: every stage runs ``F_0 .. F_{M-1}`` then ``B_0 .. B_{M-1}`` (FIFO backwards).
    1F1B: stage ``s`` runs ``min(S-s-1, M)`` warm-up forwards, then alternates one forward
    and one backward, then drains the remaining backwards.
    """
    ops = np.empty((S, 2 * M), dtype=np.int32)
    for s in range(S):
        warmup = M if kind_code == 0 else min(S - s - 1, M)
        k = 0
        for j in range(warmup):
            ops[s, k] = j + 1
            k += 1
        for i in range(M - warmup):
            ops[s, k] = warmup + i + 1
            ops[s, k + 1] = -(i + 1)
            k += 2
        for i in range(M - warmup, M):
            ops[s, k] = -(i + 1)
            k += 1
    return ops


def schedule_reference(S, M, kind_code):
    """Plain-Python `schedule_kernel`: a list of ``S`` op lists (codes as in the module doc)."""
    schedule = []
    for s in range(S):
        forwards = [j + 1 for j in range(M)]
        backwards = [-(j + 1) for j in range(M)]
        if kind_code == 0:  # GPipe: all forwards, then all backwards
            schedule.append(forwards + backwards)
            continue
        # 1F1B: the last stage starts its first backward right after its first forward; each
        # earlier stage runs one more forward first, so stage s warms up with S-s-1 forwards.
        warmup = min(S - s - 1, M)
        ops = forwards[:warmup]
        for f, b in zip(forwards[warmup:], backwards):
            ops += [f, b]
        ops += backwards[M - warmup:]
        schedule.append(ops)
    return schedule


# --------------------------------------------------------------------------- event simulation


@njit(cache=True)
def op_ready(fwd, bwd, p2p, end, s, op):
    """``(j, k, dur, ready)`` of op code ``op`` on stage ``s``: micro-batch ``j``, ``k`` 0 forward / 1
    backward, its duration (s) and when its dependency's result arrives on ``s`` (s; ``-inf`` while
    that dependency has not finished in ``end``). ``k = -1`` for a code outside ``±1..±M``."""
    S, M = fwd.shape
    if op > 0 and op <= M:
        j = op - 1
        return j, 0, fwd[s, j], 0.0 if s == 0 else end[s - 1, j, 0] + p2p[j]  # -inf stays -inf
    if op < 0 and op >= -M:
        j = -op - 1
        return j, 1, bwd[s, j], end[s, j, 0] if s == S - 1 else end[s + 1, j, 1] + p2p[j]
    return 0, -1, 0.0, -np.inf


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
def place(start, end, s, j, k, t0, dur):
    """Record op ``k`` (0 forward / 1 backward) of micro-batch ``j`` on stage ``s`` as running from
    ``t0`` for ``dur`` seconds; returns its end (when the stage is free again)."""
    start[s, j, k] = t0
    end[s, j, k] = t0 + dur
    return t0 + dur


@njit(cache=True, inline="always")
def run_ops(fwd, bwd, p2p, ops, start, end, M, copies, state):
    """The event loop of `simulate_kernel` and `dynabatch.core.kernels.spill.spill_timing_kernel` over op
    lists ``ops`` (int32 ``[S, 2N]``, shape checked by the caller); fills ``start``/``end`` (float64
    ``[S, N, 2]``, s; the caller sets them to ``-inf``). An op starts when its stage is free and its
    dependency has arrived; when ``copies`` (``ncopy, cuse, ckind, cshard, cdur``) has a row per stage,
    also not before its shard's load (`gated_start`; shard ``j // M`` of micro-batch ``j``), with
    ``state`` = ``(cptr, engine, avail, cstart, cend, stall)`` carried along. Returns `OK`, `DEADLOCK`
    or `BAD_INPUT` (an op code outside ``±1..±N``). Each op is examined O(1) times: O(S*N)."""
    S, N = fwd.shape
    n_ops = 2 * N
    gated = copies[0].shape[0] == S
    ptr = np.zeros(S, dtype=np.int64)
    free = np.zeros(S)
    stack, queued, top = worklist(S)  # the stages that may be able to advance
    remaining = S * n_ops
    while top > 0:
        top -= 1
        s = stack[top]
        queued[s] = False
        advanced = False
        while ptr[s] < n_ops:
            j, k, dur, ready = op_ready(fwd, bwd, p2p, end, s, ops[s, ptr[s]])
            if k < 0:
                return BAD_INPUT
            if ready == -np.inf:
                break
            t0 = gated_start(s, ptr[s], j // M, free[s], ready, copies, state) if gated else max(free[s], ready)
            free[s] = place(start, end, s, j, k, t0, dur)
            ptr[s] += 1
            remaining -= 1
            advanced = True
        if advanced:  # the op's result may unblock a neighbour
            for nb in (s - 1, s + 1):
                if nb >= 0 and nb < S and ptr[nb] < n_ops:
                    top = requeue(stack, top, queued, nb)
    return DEADLOCK if remaining > 0 else OK


@njit(cache=True)
def simulate_kernel(fwd, bwd, p2p, ops, start, end):
    """Simulate op lists ``ops`` (int32 ``[S, 2M]``); fill ``start``/``end`` (float64 ``[S, M, 2]``, s).

    ``fwd``/``bwd`` are float64 ``[S, M]`` seconds, ``p2p`` float64 ``[M]`` seconds.
    Returns 0 when every op ran, 1 on deadlock (unfinished ops keep ``-inf`` in both
    arrays), 2 when ``ops`` has the wrong shape or an op code outside ``±1..±M``.
    Each op is examined O(1) times, so the cost is O(S*M).
    """
    S, M = fwd.shape
    if ops.shape[0] != S or ops.shape[1] != 2 * M:
        return BAD_INPUT
    start[:] = -np.inf
    end[:] = -np.inf  # -inf marks "not finished yet"; real times are finite
    ints, flat, table, sheet = np.empty(0, np.int64), np.empty(0), ops[:0, :0], start[:0, :0, 0]  # no copies
    return run_ops(fwd, bwd, p2p, ops, start, end, 1, (ints, table, table, table, sheet),
                   (ints, flat, sheet, sheet, sheet, flat))


def simulate_reference(fwd, bwd, p2p, ops):
    """Plain-Python `simulate_kernel` for op lists in which every stage lists each op once:
    sweep all stages until nothing moves.

    Returns ``(start, end, deadlocked)``: float64 ``[S, M, 2]`` arrays (seconds, ``-inf`` for ops
    that never ran) and whether some op never ran.
    """
    start, end, pos = _sweep(fwd, bwd, p2p, ops)
    return start, end, any(p < 2 * np.shape(fwd)[1] for p in pos)


def _sweep(fwd, bwd, p2p, ops, start_at=None):
    """`simulate_reference` plus where each stage stopped (``2M`` when it ran every op); a stage
    also stops at an op code outside ``±1..±M``, as the kernel does. ``start_at(s, i, j, free, ready)``,
    when given, returns when stage ``s``'s ``i``-th op (of micro-batch ``j``) starts, given when the
    stage is free and when its dependency's result is there (default: the later of the two)."""
    S, M = np.shape(fwd)
    start = np.full((S, M, 2), -np.inf)
    end = np.full((S, M, 2), -np.inf)
    finished = {}  # (stage, micro-batch, 0 fwd / 1 bwd) -> end time
    pos = [0] * S
    free = [0.0] * S
    moved = True
    while moved:
        moved = False
        for s in range(S):
            while pos[s] < 2 * M:
                op = int(ops[s][pos[s]])
                if not 1 <= abs(op) <= M:
                    break
                j, k = abs(op) - 1, int(op < 0)
                if k == 0:
                    dep, delay = ((s - 1, j, 0), float(p2p[j])) if s > 0 else (None, 0.0)
                elif s == S - 1:
                    dep, delay = (s, j, 0), 0.0
                else:
                    dep, delay = (s + 1, j, 1), float(p2p[j])
                if dep is not None and dep not in finished:
                    break
                ready = 0.0 if dep is None else finished[dep] + delay
                t0 = max(free[s], ready) if start_at is None else start_at(s, pos[s], j, free[s], ready)
                t1 = t0 + float(fwd[s][j] if k == 0 else bwd[s][j])
                start[s, j, k], end[s, j, k] = t0, t1
                finished[(s, j, k)] = t1
                free[s] = t1
                pos[s] += 1
                moved = True
    return start, end, pos


# --------------------------------------------------------------------------- makespan


@njit(cache=True)
def makespan_kernel(fwd, bwd, p2p, ops):
    """Makespan in seconds of op lists ``ops``; ``+inf`` on deadlock, NaN on malformed ``ops``.

    Same argument types as :func:`simulate_kernel`.
    """
    S, M = fwd.shape
    start = np.empty((S, M, 2))
    end = np.empty((S, M, 2))
    code = simulate_kernel(fwd, bwd, p2p, ops, start, end)
    if code == DEADLOCK:
        return np.inf
    if code != OK:
        return np.nan
    return end.max() if end.size else 0.0


def makespan_reference(fwd, bwd, p2p, ops):
    """Plain-Python `makespan_kernel`: the last op's end (seconds), ``inf`` on deadlock, NaN when
    ``ops`` is not ``[S, 2M]`` or a stage reaches an op code outside ``±1..±M``."""
    S, M = np.shape(fwd)
    if np.shape(ops) != (S, 2 * M):
        return float("nan")
    _, end, pos = _sweep(fwd, bwd, p2p, ops)
    stuck = [(s, p) for s, p in enumerate(pos) if p < 2 * M]
    if any(not 1 <= abs(int(ops[s][p])) <= M for s, p in stuck):
        return float("nan")  # the kernel stops at a malformed op as soon as a stage reaches it
    if stuck:
        return float("inf")
    return max((float(t) for t in end.ravel()), default=0.0)


# --------------------------------------------------------------------------- memory in flight


@njit(cache=True)
def inflight_kernel(ops, mem, peak_n, peak_bytes):
    """Fill ``peak_n`` (int64 ``[S]``) and ``peak_bytes`` (float64 ``[S]``, bytes) from ``ops``.

    ``mem`` is float64 ``[M]`` activation bytes per micro-batch. In flight on a stage: a
    micro-batch counts from the start of its forward to the end of its backward there, so the
    peak depends only on the order, not on the times.
    """
    for s in range(ops.shape[0]):
        n = 0
        held = 0.0
        best_n = 0
        best_b = 0.0
        for k in range(ops.shape[1]):
            op = ops[s, k]
            if op > 0:
                n += 1
                held += mem[op - 1]
                best_n = max(best_n, n)
                best_b = max(best_b, held)
            else:
                n -= 1
                held -= mem[-op - 1]
        peak_n[s] = best_n
        peak_bytes[s] = best_b


def inflight_reference(ops, mem):
    """Plain-Python `inflight_kernel`: per stage, the most micro-batches held at once and the most
    bytes held at once, as two lists (the kernel fills arrays instead)."""
    peak_n, peak_bytes = [], []
    for row in ops:
        held = []  # micro-batches whose forward started and whose backward has not ended
        held_bytes = 0.0
        most, most_bytes = 0, 0.0
        for op in row:
            j = abs(int(op)) - 1
            if op > 0:
                held.append(j)
                held_bytes += float(mem[j])
                most = max(most, len(held))
                most_bytes = max(most_bytes, held_bytes)
            else:
                held.remove(j)
                held_bytes -= float(mem[j])
        peak_n.append(most)
        peak_bytes.append(most_bytes)
    return peak_n, peak_bytes
