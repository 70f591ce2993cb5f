"""Rank assignment of micro-batches with per-stage times ``st`` ``[S, M]`` (seconds).

`assign_stages` (numba) and `assign_stages_reference` (plain Python, numpy) compute the same
ranks with the same float operations in the same order:

1. greedy: micro-batches in ``order`` (bottleneck stage time, longest first, given by the caller),
   each to the first rank minimising ``max_s (load[r, s] + st[s, j]) + (S - 1) * max(mx[r], own[j])``
   among ranks with fewer than ``cap`` micro-batches (``own``: each micro-batch's stage-mean time,
   ``mx[r]``: the largest ``own`` on rank ``r``);
2. local search, at most ``max_rounds`` rounds: on the rank with the largest estimate
   ``max_s load[r, s] + (S - 1) * mx[r]`` (the first of equals), the swap with another rank's
   micro-batch (and, without equal counts, the move to another rank) that lowers the larger of the
   two ranks' new estimates most; a round without a gain of more than ``1e-12`` of the estimate ends
   it. Swaps keep every rank's count.
"""

from __future__ import annotations

import numpy as np
from .compile_once import njit

from .assign import apply_move_reference
from .objective import objective_kernel, objective_reference


@njit(cache=True)
def _stats(st, rank_of, own, ranks, load, m1, m2):
    """Per-rank stage loads (summed in micro-batch order) and the largest / second largest ``own``."""
    S, M = st.shape
    load[:, :] = 0.0
    m1[:] = 0.0
    m2[:] = 0.0
    for j in range(M):
        r = rank_of[j]
        for s in range(S):
            load[r, s] += st[s, j]
        t = own[j]
        if t > m1[r]:
            m2[r] = m1[r]
            m1[r] = t
        elif t > m2[r]:
            m2[r] = t


@njit(cache=True)
def assign_stages(st, own, order, ranks, cap, equal_counts, max_rounds):
    """Rank (int32 ``[M]``) of each micro-batch (see the module docstring)."""
    S, M = st.shape
    rank_of = np.zeros(M, np.int32)
    load = np.zeros((ranks, S))
    mx = np.zeros(ranks)
    cnt = np.zeros(ranks, np.int64)
    for jj in range(M):
        j = order[jj]
        best, r_best = np.inf, 0
        for r in range(ranks):
            if cnt[r] >= cap:
                v = np.inf
            else:
                hi = -np.inf
                for s in range(S):
                    x = load[r, s] + st[s, j]
                    if x > hi:
                        hi = x
                v = objective_kernel(hi, max(mx[r], own[j]), 1, S)
            if v < best or (r == 0 and not v > best):
                best, r_best = v, r
        rank_of[j] = r_best
        for s in range(S):
            load[r_best, s] += st[s, j]
        mx[r_best] = max(mx[r_best], own[j])
        cnt[r_best] += 1

    m1 = np.zeros(ranks)
    m2 = np.zeros(ranks)
    for _ in range(max_rounds):
        _stats(st, rank_of, own, ranks, load, m1, m2)
        rmax, cur = 0, -np.inf
        for r in range(ranks):
            hi = -np.inf
            for s in range(S):
                if load[r, s] > hi:
                    hi = load[r, s]
            o = objective_kernel(hi, m1[r], 1, S)
            if o > cur:
                rmax, cur = r, o
        best_gain = 1e-12 * cur
        move_a, move_b = -1, 0
        for a in range(M):
            if rank_of[a] != rmax:
                continue
            rest_a = m2[rmax] if own[a] == m1[rmax] else m1[rmax]
            q_gain, q_b = -np.inf, -1
            for b in range(M):
                rb = rank_of[b]
                if rb == rmax:
                    continue
                hi = -np.inf
                lo = -np.inf
                for s in range(S):
                    x = load[rmax, s] - st[s, a] + st[s, b]
                    if x > hi:
                        hi = x
                    y = load[rb, s] - st[s, b] + st[s, a]
                    if y > lo:
                        lo = y
                new_hi = objective_kernel(hi, max(rest_a, own[b]), 1, S)
                mx_wo = m2[rb] if own[b] == m1[rb] else m1[rb]
                new_lo = objective_kernel(lo, max(mx_wo, own[a]), 1, S)
                gain = cur - max(new_hi, new_lo)
                if gain > q_gain:
                    q_gain, q_b = gain, b
            if q_b >= 0 and q_gain > best_gain:
                best_gain, move_a, move_b = q_gain, a, q_b
            if not equal_counts:
                for r in range(ranks):
                    if r == rmax:
                        continue
                    h1 = -np.inf
                    h2 = -np.inf
                    for s in range(S):
                        x = load[rmax, s] - st[s, a]
                        if x > h1:
                            h1 = x
                        y = load[r, s] + st[s, a]
                        if y > h2:
                            h2 = y
                    o1 = objective_kernel(h1, rest_a, 1, S)
                    o2 = objective_kernel(h2, max(m1[r], own[a]), 1, S)
                    gain = cur - max(o1, o2)
                    if gain > best_gain:
                        best_gain, move_a, move_b = gain, a, -1 - r
        if move_a < 0:
            break
        if move_b >= 0:
            t = rank_of[move_a]
            rank_of[move_a] = rank_of[move_b]
            rank_of[move_b] = t
        else:
            rank_of[move_a] = -1 - move_b
    return rank_of


def assign_stages_reference(st, own, order, ranks, cap, equal_counts, max_rounds):
    """Plain-Python `assign_stages` (numpy reductions where the kernel loops)."""
    S, M = st.shape
    rank_of = np.zeros(M, np.int32)
    # per rank: seconds on each stage, the largest own time, micro-batches
    load, mx, cnt = np.zeros((ranks, S)), np.zeros(ranks), np.zeros(ranks, np.int64)
    for j in order:
        v = objective_reference((load + st[:, j]).max(axis=1), np.maximum(mx, own[j]), 1, S) if S \
            else np.full(ranks, -np.inf)
        v[cnt >= cap] = np.inf
        r = int(np.argmin(v))
        rank_of[j] = r
        load[r] += st[:, j]
        mx[r] = max(mx[r], own[j])
        cnt[r] += 1
    for _ in range(max_rounds):
        load = np.zeros((ranks, S))
        m1, m2 = np.zeros(ranks), np.zeros(ranks)
        for j in range(M):
            r, t = rank_of[j], own[j]
            load[r] += st[:, j]
            if t > m1[r]:
                m1[r], m2[r] = t, m1[r]
            elif t > m2[r]:
                m2[r] = t
        obj = objective_reference(load.max(axis=1), m1, 1, S)
        rmax = int(np.argmax(obj))
        cur = obj[rmax]
        best_gain, move = 1e-12 * cur, None
        others = np.flatnonzero(rank_of != rmax)
        for a in np.flatnonzero(rank_of == rmax):
            rest_a = m2[rmax] if own[a] == m1[rmax] else m1[rmax]
            if len(others):
                rb = rank_of[others]
                new_hi = objective_reference((load[rmax][None, :] - st[:, a][None, :] + st[:, others].T).max(axis=1),
                                   np.maximum(rest_a, own[others]), 1, S)
                new_lo_load = (load[rb] - st[:, others].T + st[:, a][None, :]).max(axis=1)
                mx_wo = np.where(own[others] == m1[rb], m2[rb], m1[rb])
                new_lo = objective_reference(new_lo_load, np.maximum(mx_wo, own[a]), 1, S)
                gain = cur - np.maximum(new_hi, new_lo)
                q = int(np.argmax(gain))
                if gain[q] > best_gain:
                    best_gain, move = float(gain[q]), (int(a), int(others[q]))
            if not equal_counts:
                for r in range(ranks):
                    if r == rmax:
                        continue
                    o1 = objective_reference((load[rmax] - st[:, a]).max(), rest_a, 1, S)
                    o2 = objective_reference((load[r] + st[:, a]).max(), max(m1[r], own[a]), 1, S)
                    gain = cur - max(o1, o2)
                    if gain > best_gain:
                        best_gain, move = gain, (int(a), -1 - r)
        if move is None:
            break
        apply_move_reference(rank_of, *move)
    return rank_of


__all__ = ["assign_stages", "assign_stages_reference"]
