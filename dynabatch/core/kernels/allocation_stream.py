"""The streamed step of a per-component allocation (`dynabatch.core.multitask.allocation.simulate_stream`): how
the multi-task executor (`dynabatch.pipeline.multitask.SpindleExecutor`) runs a step, micro-batch by
micro-batch, across component groups. `stream_kernel` (numba) beside `stream_reference` (plain Python, an
explicit op graph resolved by recursion), which ``tests/test_multitask_allocation.py`` compares on random
graphs and allocations. Times are seconds, memory bytes.
"""

from __future__ import annotations

import numpy as np
from .compile_once import njit

from .allocation import lpt_ordered, lpt_reference, stage_time

@njit(cache=True)
def stream_kernel(t, mem, p2p, xfer, prod, d, s, ranks, off, ff, ovh, state, ar, N, parent):
    """Simulated step of an allocation as the multi-task executor runs it (streaming micro-batches between
    component groups). Components ``k`` are listed in the executor's order (wave, then topological); every
    rank runs its forward items in that order (component by component, micro-batches ascending), then its
    backward items in the reverse order, each op as soon as its rank is free and its inputs have arrived:

    * the forward of micro-batch ``j`` in component ``k`` (stage 0) waits for the forward of ``j`` in every
      producer ``p`` of ``k`` on ``j``'s path (its last stage), plus ``xfer[p, j]`` seconds when on another
      rank; stage ``q > 0`` waits for stage ``q - 1`` of ``j`` plus ``p2p[k, j]``;
    * the backward of ``j`` in ``k``'s last stage waits for the backward of ``j`` in every consumer (its
      stage 0; a component no consumer of ``j`` reads, a head, starts it at once), plus ``xfer[k, j]`` when
      on another rank; stage ``q < s - 1`` waits for stage ``q + 1`` plus ``p2p[k, j]``;
    * a rank posts its stage's gradient all-reduce of group ``k`` (over the replicas' ranks of that stage,
      ``ar[k]`` seconds) as soon as it has finished its backward ops of ``k`` (where its backward loop passes
      ``k``), while it goes on with the backward of the components before ``k``: the all-reduce takes no
      compute, it starts once every rank of it has posted it and the links of all of them are free, and holds
      those links for ``ar[k]`` seconds (a device's link carries one all-reduce at a time, in the order they
      became ready; ties: lower ``k``, then lower stage); the step ends with the last compute op or
      all-reduce.

    Columns ``j`` are work items: micro-batch ``parent[j]`` (int64 [M], ascending: a micro-batch's columns
    side by side), whole or one piece of it. A component that splits a micro-batch into pieces (whole
    sequences of it, e.g. a ViT's tiles, each piece a column of its own, balanced over its replicas like
    micro-batches) runs each piece as an op; a consumer's op of micro-batch ``i`` waits for every column of
    ``i`` of its producers, a producer's backward of a column for every column of ``i`` of its consumers
    (without pieces: one column per micro-batch, ``parent[j] = j``).

    ``t`` [C, M]: forward+backward seconds of ``j`` on one device holding all of ``k`` (< 0: ``j`` does not
    reach ``k``); ``mem`` [C, M] activation bytes kept for backward; ``prod`` [C, C] bool: ``prod[k, p]``, ``p``
    feeds ``k``; ``d`` / ``s`` / ``off`` [C]: replicas, stages and where ``k``'s ranks start in ``ranks`` (int64:
    the groups' global ranks, `Placement.ranks` one after another; replica ``a``'s stage ``q`` is
    ``ranks[off + a * s + q]``); ``ff`` [C]: forward share; ``ovh``: per-stage launch seconds (each stage's
    time is `stage_time`'s); ``state`` [C]: model-state bytes per device of ``k``'s group. Micro-batches go
    to replicas by `lpt_kernel` on ``t`` (`route`'s rule). Returns (step seconds, busy [C]: the most compute
    seconds one device of ``k``'s group spends on ``k``, bytes [N]: each device's model state + every
    activation it keeps, since a rank holds all its forwards' activations until its backward loop)."""
    C, M = t.shape
    assign = np.empty((C, M), np.int64)
    loads = np.zeros(N + 1)
    free = np.zeros(N)
    bytes_ = np.zeros(N)
    cb = np.zeros((C, N))
    fend = np.zeros((C, M))   # forward end of j in k's last stage
    bfirst = np.zeros((C, M))  # backward end of j in k's stage 0
    cur = np.zeros(M)
    stt = np.zeros((C, M))
    first = np.zeros(parent[M - 1] + 2 if M else 1, np.int64)  # micro-batch i's columns: first[i]..first[i+1]-1
    for j in range(M):
        first[parent[j] + 1] = j + 1
    for i in range(1, first.shape[0]):
        if first[i] < first[i - 1]:
            first[i] = first[i - 1]
    smax = 1
    for k in range(C):
        if s[k] > smax:
            smax = s[k]
    posted = np.zeros((C, smax))  # when the last rank of k's stage q posted its all-reduce
    for k in range(C):
        if d[k] == 0:
            for j in range(M):
                assign[k, j] = -1
            continue
        row = np.empty(M, np.int64)
        lpt_ordered(t[k], np.argsort(-t[k], kind="mergesort"), d[k], row, loads)
        assign[k] = row
        stt[k] = stage_time(t[k], ovh, s[k])
        for q in range(s[k]):
            for a in range(d[k]):
                bytes_[ranks[off[k] + a * s[k] + q]] += state[k]
        for j in range(M):
            if row[j] >= 0:
                for q in range(s[k]):
                    bytes_[ranks[off[k] + row[j] * s[k] + q]] += mem[k, j] / s[k]
    # forward, in the executor's order
    for k in range(C):
        if d[k] == 0:
            continue
        _arrivals(k, np.bool_(True), prod, assign, ranks, off, s, xfer, fend, parent, first, cur)
        _stage_pass(k, np.bool_(True), assign, ranks, off, s, p2p, stt, ff[k], free, cb, cur)
        fend[k] = cur
    # backward, in the reverse order; each rank posts k's all-reduce once past k
    for k in range(C - 1, -1, -1):
        if d[k] == 0:
            continue
        _arrivals(k, np.bool_(False), prod, assign, ranks, off, s, xfer, bfirst, parent, first, cur)
        _stage_pass(k, np.bool_(False), assign, ranks, off, s, p2p, stt, 1.0 - ff[k], free, cb, cur)
        bfirst[k] = cur
        for x in range(d[k] * s[k]):
            r = ranks[off[k] + x]
            if free[r] > posted[k, x % s[k]]:
                posted[k, x % s[k]] = free[r]
    step = 0.0
    busy = np.zeros(C)
    for r in range(N):
        if free[r] > step:
            step = free[r]
    for k in range(C):
        for x in range(d[k] * s[k]):
            r = ranks[off[k] + x]
            if cb[k, r] > busy[k]:
                busy[k] = cb[k, r]
    # the all-reduces (one per component and stage) on the devices' links, in the order they became ready
    link = np.zeros(N)
    done = np.zeros((C, smax), np.bool_)
    for _ in range(C * smax):
        k, q = -1, -1
        for c in range(C):
            if d[c] == 0 or ar[c] <= 0:
                continue
            for y in range(s[c]):
                if not done[c, y] and (k < 0 or posted[c, y] < posted[k, q]):
                    k, q = c, y
        if k < 0:
            break
        done[k, q] = True
        st = posted[k, q]
        for a in range(d[k]):
            r = ranks[off[k] + a * s[k] + q]
            if link[r] > st:
                st = link[r]
        for a in range(d[k]):
            link[ranks[off[k] + a * s[k] + q]] = st + ar[k]
        if st + ar[k] > step:
            step = st + ar[k]
    return step, busy, bytes_


@njit(cache=True)
def _arrivals(k, forward, prod, assign, ranks, off, s, xfer, done, parent, first, cur):
    """Into ``cur[j]``: when column ``j``'s inputs reach component ``k``: forward, the latest forward end
    (``done`` = the forward ends, last stage) of a column of the same micro-batch in a producer of ``k``;
    backward, the latest backward end (``done`` = the backward ends, stage 0) of such a column in a consumer
    of ``k``; each plus the transfer (``xfer`` of the producer's output) when the two ops sit on different
    ranks."""
    C, M = assign.shape
    sk = s[k]
    for j in range(M):
        a = assign[k, j]
        if a < 0:
            continue
        mine = ranks[off[k] + a * sk + (0 if forward else sk - 1)]
        ready = 0.0
        for o in range(C):
            if not (prod[k, o] if forward else prod[o, k]):
                continue
            for c in range(first[parent[j]], first[parent[j] + 1]):
                if assign[o, c] < 0:
                    continue
                ro = ranks[off[o] + assign[o, c] * s[o] + (s[o] - 1 if forward else 0)]
                x = done[o, c]
                if ro != mine:
                    x += xfer[o, c] if forward else xfer[k, j]
                if x > ready:
                    ready = x
        cur[j] = ready


@njit(cache=True)
def _stage_pass(k, forward, assign, ranks, off, s, p2p, stt, share, free, cb, cur):
    """Component ``k``'s forward (stages and micro-batches ascending) or backward ops (both descending): each
    op, ``share`` of its stage time, starts when its rank is free and ``cur[j]`` (its input's arrival; then
    ``p2p`` per stage hop) has come; ``cur[j]`` ends as the micro-batch's end on the last stage visited."""
    sk, M = s[k], cur.shape[0]
    for qq in range(sk):
        q = qq if forward else sk - 1 - qq
        for jj in range(M):
            j = jj if forward else M - 1 - jj
            a = assign[k, j]
            if a < 0:
                continue
            r = ranks[off[k] + a * sk + q]
            ready = cur[j] + (p2p[k, j] if qq > 0 else 0.0)
            st = free[r] if free[r] > ready else ready
            dur = stt[k, j] * share
            free[r] = st + dur
            cb[k, r] += dur
            cur[j] = free[r]


def stream_reference(t, mem, p2p, xfer, prod, d, s, ranks, off, ff, ovh, state, ar, N, parent):
    """Plain-Python `stream_kernel` (same arguments and result), written as an explicit op graph: each rank's
    op list in the executor's order, each op's end = its duration after the later of its rank's previous op
    and its inputs' arrival, resolved by memoized recursion (an independent formulation of the same rules);
    a stage's all-reduce of a group is ready when the last of its ranks reaches the end of its backward ops
    of the component, then waits for its ranks' links."""
    import functools

    C, M = len(t), len(t[0])
    same = {j: [c for c in range(M) if int(parent[c]) == int(parent[j])] for j in range(M)}  # a micro-batch's columns
    assign = [list(lpt_reference(t[k], int(d[k]))[0]) if d[k] else [-1] * M for k in range(C)]

    def stage(k, j):
        tk, o = float(t[k][j]), min(float(ovh), float(t[k][j]))
        return (tk - o) / int(s[k]) + o if tk > 0 else 0.0

    def rank(k, j, q):
        return int(ranks[int(off[k]) + assign[k][j] * int(s[k]) + q])

    seq = {r: [] for r in range(int(N))}  # rank -> ops ("F"/"B", k, q, j) in the rank's order
    for k in range(C):
        for q in range(int(s[k]) if d[k] else 0):
            for j in range(M):
                if assign[k][j] >= 0:
                    seq[rank(k, j, q)].append(("F", k, q, j))
    for r in seq:
        seq[r] += [("B", k, q, j) for (_, k, q, j) in reversed(seq[r])]
    prev = {}
    for r, ops in seq.items():
        for a, b in zip([None] + ops, ops):
            prev[b] = (a, r)

    @functools.lru_cache(maxsize=None)
    def end(op):
        kind, k, q, j = op
        before, r = prev[op]
        deps = []  # (op, seconds it travels)
        if kind == "F":
            if q > 0:
                deps.append((("F", k, q - 1, j), float(p2p[k][j])))
            else:
                for p in range(C):
                    for c in same[j]:
                        if prod[k][p] and assign[p][c] >= 0:
                            last = int(s[p]) - 1
                            deps.append((("F", p, last, c), float(xfer[p][c]) if rank(p, c, last) != r else 0.0))
            dur = stage(k, j) * float(ff[k])
        else:
            if q < int(s[k]) - 1:
                deps.append((("B", k, q + 1, j), float(p2p[k][j])))
            else:
                for c in range(C):
                    for col in same[j]:
                        if prod[c][k] and assign[c][col] >= 0:
                            deps.append((("B", c, 0, col), float(xfer[k][j]) if rank(c, col, 0) != r else 0.0))
            dur = stage(k, j) * (1.0 - float(ff[k]))
        begin = max([end(before) if before else 0.0] + [end(o) + x for o, x in deps])
        return begin + dur

    import sys
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 10000 + 8 * sum(len(v) for v in seq.values())))
    try:
        finish = {r: (end(ops[-1]) if ops else 0.0) for r, ops in seq.items()}
        busy, bytes_ = np.zeros(C), np.zeros(int(N))
        step = max(finish.values(), default=0.0)
        groups = {k: [int(ranks[int(off[k]) + x]) for x in range(int(d[k]) * int(s[k]))] for k in range(C) if d[k]}

        def post(k, r):
            """When rank r posts k's all-reduce: the end of its last op up to its backward of k (every forward,
            the backwards of k and of the components after it)."""
            upto = [op for op in seq[r] if op[0] == "F" or op[1] >= k]
            return end(upto[-1]) if upto else 0.0

        # one all-reduce per component and stage, over that stage's ranks of every replica; each device's link
        # carries one at a time, taken in the order they became ready
        stage_ranks = {(k, q): g[q::int(s[k])] for k, g in groups.items() for q in range(int(s[k]))}
        ready = sorted((max(post(k, r) for r in g), k, q) for (k, q), g in stage_ranks.items() if float(ar[k]) > 0)
        link = [0.0] * int(N)
        for at, k, q in ready:
            begin = max([at] + [link[r] for r in stage_ranks[(k, q)]])
            for r in stage_ranks[(k, q)]:
                link[r] = begin + float(ar[k])
            step = max(step, begin + float(ar[k]))
        for k, group in groups.items():
            for r in group:
                mine = [op for op in seq[r] if op[1] == k]
                busy[k] = max(busy[k], sum(stage(k, op[3]) * (float(ff[k]) if op[0] == "F" else 1.0 - float(ff[k]))
                                           for op in mine))
                bytes_[r] += float(state[k]) + sum(float(mem[k][op[3]]) for op in mine if op[0] == "F") / int(s[k])
    finally:
        sys.setrecursionlimit(old)
    return step, busy, bytes_
