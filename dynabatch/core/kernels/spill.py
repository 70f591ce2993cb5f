"""Numba kernel timing a pipeline step whose ops wait for shard loads, beside its plain-Python reference.

The pipeline model of `dynabatch.core.kernels.simulate` (op codes over ``N`` micro-batches,
dependencies; its event loop `run_ops`, whose ops here also wait for shard loads: `gated_start`)
plus one copy engine per stage that moves shards between host memory and the stage device. Times
are seconds. `dynabatch.core.simulate.spill` plans the copies (the runner's residency policy)
and wraps this.

* **Uses.** A stage's uses are its ops (use ``i`` is position ``i`` of its op list; the op of
  micro-batch ``j`` uses shard ``j // M``), then ``L`` zero-second late updates (use ``2N + u``
  uses shard ``upd[s, u]``; ``L = 0`` when the updates need no use of their own).
* **Copies.** Stage ``s``'s copies ``c < ncopy[s]``, in issue order, each tied to use ``cuse[s, c]``
  with kind ``ckind[s, c]``: `DEMAND_SPILL` / `DEMAND_LOAD` are issued when the stage reaches the
  use (when it is free: the end of its previous use, 0 at first), `PREFETCH_SPILL` /
  `PREFETCH_LOAD` when the use starts. They run one at a time on the stage's copy engine in that
  order: copy ``c`` of shard ``cshard[s, c]`` starts at ``max(issue, engine free)`` and lasts
  ``cdur[s, c]`` seconds.
* **Starts.** A use of shard ``p`` starts at ``max(free, ready, avail[p])``: ``ready`` when its
  dependency's result arrives (op rules; for a late update the end of every stage's last op: the
  step's all-reduce), ``avail[p]`` the end of ``p``'s latest load (0 if none). ``stall[s]`` sums
  ``start - max(free, ready)``: compute time lost waiting for loads.

=======================  ==========================
kernel                   reference
=======================  ==========================
`spill_timing_kernel`    `spill_timing_reference`
=======================  ==========================

`pack_copies` turns the reference's copy lists into the kernel's arrays.
"""

from __future__ import annotations

import numpy as np
from .compile_once import njit

# the copy kinds (``ckind``) are defined beside `gated_start`, which reads them
from .simulate import (BAD_INPUT, DEMAND_LOAD, DEMAND_SPILL, OK, PREFETCH_LOAD, PREFETCH_SPILL, sweep_codes, gated_start,
                       run_ops)

__all__ = ["DEMAND_LOAD", "DEMAND_SPILL", "PREFETCH_LOAD", "PREFETCH_SPILL", "pack_copies", "spill_timing_kernel",
           "spill_timing_reference"]


def pack_copies(copies):
    """``(ncopy, cuse, ckind, cshard, cdur)`` kernel arrays of ``copies[s]`` lists of ``(use, kind,
    shard, seconds)`` (padded to the longest stage, at least one column)."""
    S = len(copies)
    C = max([1] + [len(c) for c in copies])
    ncopy = np.array([len(c) for c in copies], np.int64)
    cuse, ckind, cshard = (np.zeros((S, C), np.int64) for _ in range(3))
    cdur = np.zeros((S, C))
    for s, cs in enumerate(copies):
        for c, (use, kind, shard, seconds) in enumerate(cs):
            cuse[s, c], ckind[s, c], cshard[s, c], cdur[s, c] = use, kind, shard, seconds
    return ncopy, cuse, ckind, cshard, cdur


@njit(cache=True)
def spill_timing_kernel(fwd, bwd, p2p, ops, M, upd, ncopy, cuse, ckind, cshard, cdur, start, end, upd_t, cstart, cend,
                        stall):
    """Time op lists ``ops`` (int32 ``[S, 2N]``) with shard copies (module doc).

    ``fwd``/``bwd`` float64 ``[S, N]`` s, ``p2p`` ``[N]`` s, ``M`` micro-batches per shard, ``upd``
    int64 ``[S, L]`` late updates' shards; copies: ``ncopy`` int64 ``[S]``, ``cuse``/``ckind``/
    ``cshard`` int64 ``[S, C]``, ``cdur`` float64 ``[S, C]`` s. Fills ``start``/``end`` (``[S, N, 2]``,
    as `simulate_kernel`), ``upd_t`` (``[S, L]``, when each late update runs), ``cstart``/``cend``
    (``[S, C]``, each copy) and ``stall`` (``[S]``), all seconds. Returns 0 (OK), 1 on deadlock, 2 on
    malformed input (shapes, op codes, shards out of range, copies tied to no use in order)."""
    S, N = fwd.shape
    n_ops = 2 * N
    if ops.shape[0] != S or ops.shape[1] != n_ops or upd.shape[0] != S or M < 1 or N % M != 0:
        return BAD_INPUT
    K = N // M
    for s in range(S):
        if ncopy[s] < 0 or ncopy[s] > cuse.shape[1]:
            return BAD_INPUT
        for c in range(ncopy[s]):
            if cshard[s, c] < 0 or cshard[s, c] >= K or ckind[s, c] < 0 or ckind[s, c] > 3:
                return BAD_INPUT
        for u in range(upd.shape[1]):
            if upd[s, u] < 0 or upd[s, u] >= K:
                return BAD_INPUT
    start[:] = -np.inf
    end[:] = -np.inf
    upd_t[:] = -np.inf
    cstart[:] = -np.inf
    cend[:] = -np.inf
    stall[:] = 0.0
    copies = (ncopy, cuse, ckind, cshard, cdur)
    state = (np.zeros(S, dtype=np.int64), np.zeros(S), np.zeros((S, K)), cstart, cend, stall)
    code = run_ops(fwd, bwd, p2p, ops, start, end, M, copies, state)
    if code != OK:
        return code
    barrier = end.max() if end.size else 0.0  # every stage's last op has ended: the all-reduce, then late updates
    for s in range(S):
        t = barrier
        for u in range(upd.shape[1]):
            t = gated_start(s, n_ops + u, upd[s, u], t, barrier, copies, state)
            upd_t[s, u] = t
        if state[0][s] != ncopy[s]:
            return BAD_INPUT  # a copy tied to no use, or out of order
    return OK


def spill_timing_reference(fwd, bwd, p2p, ops, M, upd, copies):
    """Plain-Python `spill_timing_kernel`. ``copies[s]``: stage ``s``'s copies in issue order as
    ``(use, kind, shard, seconds)``. Returns ``(start, end, upd_t, copy_times, stall)``: the kernel's
    ``start``/``end`` and ``upd_t`` arrays, ``copy_times[s]`` a list of ``(start, end)`` per copy and
    ``stall`` a list, all seconds; None on deadlock."""
    S, N = np.shape(fwd)
    engine = [0.0] * S             # when each stage's copy engine is free
    avail = [{} for _ in range(S)]  # shard -> end of its latest load on that stage
    todo = [list(c) for c in copies]
    copy_times = [[] for _ in range(S)]
    stall = [0.0] * S

    def run_copies(s, use, prefetch, issue):
        while todo[s] and todo[s][0][0] == use and (todo[s][0][1] in (PREFETCH_SPILL, PREFETCH_LOAD)) == prefetch:
            _, kind, shard, seconds = todo[s].pop(0)
            begin = max(engine[s], issue)
            engine[s] = begin + seconds
            copy_times[s].append((begin, engine[s]))
            if kind in (DEMAND_LOAD, PREFETCH_LOAD):
                avail[s][shard] = engine[s]

    def start_use(s, use, shard, free, ready):
        run_copies(s, use, False, free)   # a shard missing at its turn is loaded now
        t0 = max(max(free, ready), avail[s].get(shard, 0.0))
        stall[s] += t0 - max(free, ready)
        run_copies(s, use, True, t0)      # the next window's shard is fetched as this use starts
        return t0

    start, end, pos = sweep_codes(fwd, bwd, p2p, ops,
                             start_at=lambda s, i, j, free, ready: start_use(s, i, j // M, free, ready))
    if any(p < 2 * N for p in pos):
        return None
    barrier = max(float(t) for t in end.ravel())
    upd_t = np.full(np.shape(upd), -np.inf)
    for s in range(S):
        t = barrier
        for u, shard in enumerate(upd[s]):
            t = upd_t[s, u] = start_use(s, 2 * N + u, int(shard), t, barrier)
    return start, end, upd_t, copy_times, stall
