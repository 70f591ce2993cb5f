"""Simulation-guided reordering of one rank's micro-batches under a static schedule (stage times per stage).

`insertion_search` (numba) and `insertion_search_reference` (plain Python over
`dynabatch.core.kernels.simulate.makespan_reference`) make the same moves: for up to ``passes``
passes, each micro-batch marked ``movable`` (in order of its column) is taken out of the current
order and put back at the position whose simulated makespan is lowest (the first such position;
a move is kept only when it lowers the makespan by more than ``1e-12`` of it); a pass without a
kept move ends the search. Each stage runs micro-batch ``j`` as a forward of ``fwd_fraction *
st[s, j]`` and a backward of the rest, neighbouring stages pass it on after ``p2p[j]`` seconds,
``ops`` is the static op order (`dynabatch.core.kernels.simulate.schedule_kernel`).
"""

from __future__ import annotations

import numpy as np
from .compile_once import njit

from .simulate import OK, makespan_reference, simulate_kernel, split_kernel, split_reference


@njit(cache=True)
def _span(f_all, b_all, p2p, ops, order, fwd, bwd, pp, start, end):
    """Makespan of the columns of the split stage times ``f_all``/``b_all`` in ``order`` (into buffers)."""
    S, k = f_all.shape
    for i in range(k):
        j = order[i]
        for s in range(S):
            fwd[s, i] = f_all[s, j]
            bwd[s, i] = b_all[s, j]
        pp[i] = p2p[j]
    if simulate_kernel(fwd, bwd, pp, ops, start, end) != OK:
        return np.inf
    return end.max()


@njit(cache=True)
def insertion_search(st, p2p, fwd_fraction, ops, order, movable, passes):
    """Improve ``order`` (int64 ``[k]``, columns of ``st`` ``[S, k]`` seconds) in place; returns its
    simulated makespan (seconds). See the module docstring."""
    S, k = st.shape
    fwd = np.empty((S, k))
    bwd = np.empty((S, k))
    pp = np.empty(k)
    start = np.empty((S, k, 2))
    end = np.empty((S, k, 2))
    cand = np.empty(k, np.int64)
    f_all, b_all = split_kernel(st, fwd_fraction)
    best = _span(f_all, b_all, p2p, ops, order, fwd, bwd, pp, start, end)
    for _ in range(passes):
        moved = False
        for j in range(k):
            if not movable[j]:
                continue
            pos = 0
            while order[pos] != j:
                pos += 1
            best_q = -1
            for q in range(k):
                if q == pos:
                    continue
                # order without j, with j inserted at q
                w = 0
                for i in range(k):
                    if i == pos:
                        continue
                    if w == q:
                        w += 1
                    cand[w] = order[i]
                    w += 1
                cand[q] = j
                v = _span(f_all, b_all, p2p, ops, cand, fwd, bwd, pp, start, end)
                if v < best - 1e-12 * best:
                    best, best_q = v, q
            if best_q >= 0:
                w = 0
                for i in range(k):
                    if i != pos:
                        cand[w] = order[i]
                        w += 1
                for i in range(k - 1, best_q, -1):
                    cand[i] = cand[i - 1]
                cand[best_q] = j
                order[:] = cand
                moved = True
        if not moved:
            break
    return best


def insertion_search_reference(st, p2p, fwd_fraction, ops, order, movable, passes):
    """Plain-Python `insertion_search`: returns ``(new order list, makespan)``."""
    st = np.asarray(st, np.float64)

    def span(o):
        f, b = split_reference(st[:, o], fwd_fraction)
        return makespan_reference(f, b, np.asarray(p2p, np.float64)[o], ops)

    order = [int(x) for x in order]
    best = span(order)
    for _ in range(passes):
        moved = False
        for j in range(len(order)):
            if not movable[j]:
                continue
            rest = [x for x in order if x != j]
            pos = order.index(j)
            best_q = None
            for q in range(len(order)):
                if q == pos:
                    continue
                v = span(rest[:q] + [j] + rest[q:])
                if v < best - 1e-12 * best:
                    best, best_q = v, q
            if best_q is not None:
                order = rest[:best_q] + [j] + rest[best_q:]
                moved = True
        if not moved:
            break
    return order, best
