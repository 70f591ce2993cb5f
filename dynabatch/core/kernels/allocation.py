"""The per-component allocation search of `dynabatch.core.multitask.allocation` (Spindle), as numba kernels,
each beside a plain-Python reference that `tests/test_multitask_allocation.py` compares on random graphs.

* `lpt_kernel`: a component's micro-batches balanced over its data-parallel replicas (longest first, each to
  the least-loaded replica; ties to the lower index): the rule `dynabatch.core.multitask.routing.route` uses.
* `options_kernel`: every (devices ``n``, pipeline depth ``s``) a component can run on, its simulated seconds
  (the heaviest replica: summed micro-batch times, or the pipeline simulator's makespan of a GPipe order
  inside the group when ``s > 1``, plus receiving its inputs and the gradient all-reduce) and peak bytes per
  device; options another one beats in devices, seconds and bytes at once are dropped.
* `block_frontier_kernel`: the components of one wave share the devices (sum of ``n`` <= ``N``): the Pareto
  frontier of (wave seconds = the slowest component's, bytes = the largest per-device peak) over all
  combinations of their options.
* `pareto_sum_kernel`: waves run one after another on the same devices: the frontier of summed seconds and
  summed bytes (each device holds one component per wave) of two frontiers, under a memory limit.

Times are seconds, memory bytes. Imports nothing from dynabatch but the simulator kernels.
"""

from __future__ import annotations

import itertools

import numpy as np
from .compile_once import njit

from .simulate import makespan_kernel, makespan_reference


# --------------------------------------------------------------------------- balancing


@njit(cache=True)
def lpt_kernel(cost, d, assign):
    """Longest-processing-time balancing of ``cost`` (float64 [M] seconds; entries < 0 are skipped and get
    ``assign`` -1) over ``d`` replicas: writes each entry's replica into ``assign`` (int64 [M]) and returns
    the replicas' loads (float64 [d]). Longest first (ties: lower index first), each to the least-loaded
    replica (ties: lower replica)."""
    loads = np.zeros(d)
    lpt_ordered(cost, np.argsort(-cost, kind="mergesort"), d, assign, loads)
    return loads


@njit(cache=True)
def lpt_ordered(cost, order, d, assign, loads):
    """`lpt_kernel` given the longest-first ``order`` (the stream model sorts once and reuses it), into
    ``assign`` (item -> replica) and ``loads[:d]`` (seconds per replica; zeroed here)."""
    for r in range(d):
        loads[r] = 0.0
    for k in range(cost.shape[0]):
        j = order[k]
        if cost[j] < 0:
            assign[j] = -1
            continue
        best = 0
        for r in range(1, d):
            if loads[r] < loads[best]:
                best = r
        assign[j] = best
        loads[best] += cost[j]


def lpt_reference(cost, d):
    """Plain-Python `lpt_kernel`: (assign [M] int64, loads [d] float64)."""
    cost = [float(c) for c in cost]
    order = sorted(range(len(cost)), key=lambda j: (-cost[j], j))
    loads = [0.0] * int(d)
    assign = [-1] * len(cost)
    for j in order:
        if cost[j] < 0:
            continue
        best = min(range(int(d)), key=lambda r: (loads[r], r))
        assign[j] = best
        loads[best] += cost[j]
    return np.array(assign, np.int64), np.array(loads)


# --------------------------------------------------------------------------- one component on n devices


@njit(cache=True)
def gpipe_codes(S, M):
    """Plain op codes int32 [S, 2M] of GPipe (every forward, then every backward, on each stage): the order
    inside a component's group under wavefront execution (its backward runs in a later, backward wave)."""
    ops = np.empty((S, 2 * M), np.int32)
    for s in range(S):
        for j in range(M):
            ops[s, j] = j + 1
            ops[s, M + j] = -(j + 1)
    return ops


@njit(cache=True)
def gpipe_makespan_kernel(stage_s, ff, p2p, sel, m, s, fend, bend):
    """Makespan (seconds) of GPipe on ``s`` stages for micro-batches ``sel[:m]`` whose every stage takes
    ``stage_s[j]`` (forward ``ff`` of it, backward the rest) with ``p2p[j]`` between stages: the pipeline
    simulator's recurrence (`dynabatch.core.kernels.simulate.makespan_kernel` on `gpipe_codes`, which the
    tests compare) specialised to this order, with no allocation (``fend`` / ``bend``: float64 scratch >= m)."""
    # forward: stage q runs F_1..F_m; F(q, j) waits for F(q-1, j) and its transfer
    for k in range(m):
        fend[k] = 0.0
    for q in range(s):
        free = 0.0
        for k in range(m):
            j = sel[k]
            ready = fend[k] + (p2p[j] if q > 0 else 0.0)
            st = free if free > ready else ready
            free = st + stage_s[j] * ff
            fend[k] = free
    last_f = free
    # backward: the last stage starts after its own forwards; stage q runs B_1..B_m, each after B(q+1, j)
    # (a stage above the last needs B(q+1, 1), which ends after the last stage's forwards, so after its own:
    # its backwards need no earlier start than 0)
    span = 0.0
    for k in range(m):
        bend[k] = fend[k]
    for q in range(s - 1, -1, -1):
        free = last_f if q == s - 1 else 0.0
        for k in range(m):
            j = sel[k]
            ready = bend[k] + (p2p[j] if q < s - 1 else 0.0)
            st = free if free > ready else ready
            free = st + stage_s[j] * (1.0 - ff)
            bend[k] = free
        if free > span:
            span = free
    return span


@njit(cache=True)
def options_kernel(t, mem, p2p, recv, ovh, ff, layers, N, state_by_d, grad_bytes, ar_bw, ar_lat, limit):
    """A component's options on 1..``N`` devices: arrays (n int64, s int64, seconds, bytes per device), sorted
    by n then s, without options another beats (no more devices, seconds and bytes, one of them fewer).

    ``t`` / ``mem`` / ``p2p`` / ``recv`` (float64 [M]): each micro-batch's forward+backward seconds on one device
    holding the whole component (< 0: it does not reach the component), activation bytes kept for backward,
    seconds to pass its activations between two stages inside the component, seconds to receive its inputs
    and send their gradients back. ``ovh``: per-stage launch seconds; ``ff``: forward share of a micro-batch's
    time; ``layers``: most pipeline stages; ``state_by_d[d]``: model-state bytes of the whole component with
    ``d`` data-parallel replicas (`CostModel.state_bytes`); ``grad_bytes``: its gradient bytes; the ring
    all-reduce over ``d`` replicas takes ``2 (d - 1) / d * grad_bytes / s / ar_bw + 2 (d - 1) ar_lat`` seconds.
    A replica's time: its micro-batches' summed seconds (``s == 1``) or GPipe's simulated makespan with every
    stage ``(t - ovh) / s + ovh`` (a uniform cut), plus its ``recv``. Options above ``limit`` bytes per device
    are dropped."""
    M = t.shape[0]
    cap = 0
    for n in range(1, N + 1):
        for s in range(1, min(n, layers) + 1):
            if n % s == 0:
                cap += 1
    on = np.empty(cap, np.int64)
    os_ = np.empty(cap, np.int64)
    ot = np.empty(cap)
    om = np.empty(cap)
    assign = np.empty(M, np.int64)
    loads = np.zeros(N)
    held = np.zeros(N)
    rx = np.zeros(N)
    count = np.zeros(N + 1, np.int64)
    grouped = np.empty(M, np.int64)
    fend = np.empty(M)
    bend = np.empty(M)
    order = np.argsort(-t, kind="mergesort")  # longest first, ties by index: `lpt_kernel`'s order
    active = 0
    for j in range(M):
        if t[j] >= 0:
            active += 1
    cnt = 0
    for n in range(1, N + 1):
        for s in range(1, min(n, layers) + 1):
            if n % s != 0:
                continue
            d = n // s
            lpt_ordered(t, order, d, assign, loads)
            for r in range(d):
                held[r] = 0.0
                rx[r] = 0.0
            for j in range(M):
                if assign[j] >= 0:
                    held[assign[j]] += mem[j]
                    rx[assign[j]] += recv[j]
            peak = 0.0
            for r in range(d):
                if held[r] > peak:
                    peak = held[r]
            bytes_ = state_by_d[d] / s + peak / s
            if bytes_ > limit:
                continue
            worst = 0.0
            if s == 1:
                for r in range(d):
                    if loads[r] + rx[r] > worst:
                        worst = loads[r] + rx[r]
            else:
                # micro-batches grouped by replica, in index order (counting sort)
                for r in range(d + 1):
                    count[r] = 0
                for j in range(M):
                    if assign[j] >= 0:
                        count[assign[j] + 1] += 1
                for r in range(d):
                    count[r + 1] += count[r]
                for j in range(M):
                    a = assign[j]
                    if a >= 0:
                        grouped[count[a]] = j
                        count[a] += 1
                st = stage_time(t, ovh, s)
                lo = 0
                for r in range(d):
                    hi = count[r]
                    m = hi - lo
                    if m > 0:
                        span = gpipe_makespan_kernel(st, ff, p2p, grouped[lo:hi], m, s, fend, bend)
                        if span + rx[r] > worst:
                            worst = span + rx[r]
                    lo = hi
            if active > 0 and d > 1:
                worst += 2.0 * (d - 1) / d * grad_bytes / s / ar_bw + 2.0 * (d - 1) * ar_lat
            on[cnt], os_[cnt], ot[cnt], om[cnt] = n, s, worst, bytes_
            cnt += 1
    return _undominated(on[:cnt], os_[:cnt], ot[:cnt], om[:cnt])


@njit(cache=True)
def stage_time(t, ovh, s):
    """Per micro-batch seconds on each of ``s`` stages of a uniform cut: the work splits, the launch does not."""
    out = np.empty(t.shape[0])
    for j in range(t.shape[0]):
        o = ovh if ovh < t[j] else t[j]
        out[j] = (t[j] - o) / s + o if t[j] > 0 else 0.0
    return out


@njit(cache=True)
def _undominated(on, os_, ot, om):
    cnt = on.shape[0]
    keep = np.ones(cnt, np.bool_)
    for a in range(cnt):
        for b in range(cnt):
            if a != b and on[b] <= on[a] and ot[b] <= ot[a] and om[b] <= om[a] and (
                    on[b] < on[a] or ot[b] < ot[a] or om[b] < om[a] or b < a):
                keep[a] = False
                break
    idx = np.flatnonzero(keep)
    return on[idx], os_[idx], ot[idx], om[idx]


def options_reference(t, mem, p2p, recv, ovh, ff, layers, N, state_by_d, grad_bytes, ar_bw, ar_lat, limit):
    """Plain-Python `options_kernel` (same arguments and result), on the simulator's plain-Python reference."""
    t, mem, p2p, recv = (list(map(float, a)) for a in (t, mem, p2p, recv))
    active = sum(1 for x in t if x >= 0)
    cands = []
    for n in range(1, int(N) + 1):
        for s in range(1, min(n, int(layers)) + 1):
            if n % s:
                continue
            d = n // s
            assign, _ = lpt_reference(t, d)
            worst = peak = 0.0
            for r in range(d):
                sel = [j for j in range(len(t)) if assign[j] == r]
                if not sel:
                    continue
                held = sum(mem[j] for j in sel) / s
                rx = sum(recv[j] for j in sel)
                if s == 1:
                    span = sum(t[j] for j in sel) + rx
                else:
                    stage = [(t[j] - min(ovh, t[j])) / s + min(ovh, t[j]) for j in sel]
                    fwd = np.array([[x * ff for x in stage]] * s)
                    bwd = np.array([[x * (1.0 - ff) for x in stage]] * s)
                    codes = np.array([list(range(1, len(sel) + 1)) + [-(k + 1) for k in range(len(sel))]] * s,
                                     np.int32)
                    span = makespan_reference(fwd, bwd, np.array([p2p[j] for j in sel]), codes) + rx
                worst, peak = max(worst, span), max(peak, held)
            if state_by_d[d] / s + peak > limit:
                continue
            if active and d > 1:
                worst += 2.0 * (d - 1) / d * grad_bytes / s / ar_bw + 2.0 * (d - 1) * ar_lat
            cands.append((n, s, worst, state_by_d[d] / s + peak))
    keep = []
    for a, (n, s, tt, m) in enumerate(cands):
        beaten = any(b != a and nb <= n and tb <= tt and mb <= m and (nb < n or tb < tt or mb < m or b < a)
                     for b, (nb, _, tb, mb) in enumerate(cands))
        if not beaten:
            keep.append((n, s, tt, m))
    cols = list(zip(*keep)) if keep else [(), (), (), ()]
    return (np.array(cols[0], np.int64), np.array(cols[1], np.int64), np.array(cols[2], np.float64),
            np.array(cols[3], np.float64))


# --------------------------------------------------------------------------- waves


@njit(cache=True)
def _pareto(t, m):
    """Indices of the Pareto-minimal (t, m) points, ascending t (ties: smaller m, then lower index)."""
    n = t.shape[0]
    o1 = np.argsort(m, kind="mergesort")
    o2 = np.argsort(t[o1], kind="mergesort")
    order = o1[o2]
    keep = np.empty(n, np.int64)
    k = 0
    best = np.inf
    for i in range(n):
        j = order[i]
        if m[j] < best:
            keep[k] = j
            k += 1
            best = m[j]
    return keep[:k]


def _pareto_reference(t, m):
    order = sorted(range(len(t)), key=lambda j: (t[j], m[j], j))
    out, best = [], float("inf")
    for j in order:
        if m[j] < best:
            out.append(j)
            best = m[j]
    return out


@njit(cache=True)
def block_frontier_kernel(opt_n, opt_t, opt_m, starts, N):
    """Frontier of one wave: components ``k`` have options ``starts[k]:starts[k+1]`` of the flat ``opt_n``
    (devices), ``opt_t`` (seconds), ``opt_m`` (bytes per device). Over every combination (one option per
    component) with sum of devices <= ``N``: wave seconds = max, bytes = max. Returns (seconds, bytes,
    choice [F, K] flat option indices), ascending seconds, only combinations no other beats in both."""
    K = starts.shape[0] - 1
    total = 1
    for k in range(K):
        total *= starts[k + 1] - starts[k]
    if total == 0:
        return np.empty(0), np.empty(0), np.empty((0, K), np.int64)
    ct = np.empty(total)
    cm = np.empty(total)
    cc = np.empty((total, K), np.int64)
    idx = np.zeros(K, np.int64)
    cnt = 0
    while True:
        used = 0
        tt = 0.0
        mm = 0.0
        for k in range(K):
            o = starts[k] + idx[k]
            used += opt_n[o]
            if opt_t[o] > tt:
                tt = opt_t[o]
            if opt_m[o] > mm:
                mm = opt_m[o]
        if used <= N:
            ct[cnt] = tt
            cm[cnt] = mm
            for k in range(K):
                cc[cnt, k] = starts[k] + idx[k]
            cnt += 1
        k = K - 1  # odometer: the last component's option turns fastest
        while k >= 0:
            idx[k] += 1
            if idx[k] < starts[k + 1] - starts[k]:
                break
            idx[k] = 0
            k -= 1
        if k < 0:
            break
    keep = _pareto(ct[:cnt], cm[:cnt])
    return ct[keep], cm[keep], cc[keep]


def block_frontier_reference(opt_n, opt_t, opt_m, starts, N):
    """Plain-Python `block_frontier_kernel`."""
    K = len(starts) - 1
    pts = []
    for combo in itertools.product(*[range(starts[k], starts[k + 1]) for k in range(K)]):
        if sum(int(opt_n[o]) for o in combo) <= N:
            pts.append((max([float(opt_t[o]) for o in combo] + [0.0]), max([float(opt_m[o]) for o in combo] + [0.0]),
                        combo))
    keep = _pareto_reference([p[0] for p in pts], [p[1] for p in pts])
    return (np.array([pts[j][0] for j in keep], np.float64), np.array([pts[j][1] for j in keep], np.float64),
            np.array([pts[j][2] for j in keep], np.int64).reshape(len(keep), K))


@njit(cache=True)
def pareto_sum_kernel(t1, m1, t2, m2, limit):
    """Frontier of (t1[a] + t2[b], m1[a] + m2[b]) over pairs with summed bytes <= ``limit``: returns (seconds,
    bytes, a, b), ascending seconds."""
    n1, n2 = t1.shape[0], t2.shape[0]
    ct = np.empty(n1 * n2)
    cm = np.empty(n1 * n2)
    ca = np.empty(n1 * n2, np.int64)
    cb = np.empty(n1 * n2, np.int64)
    cnt = 0
    for a in range(n1):
        for b in range(n2):
            mm = m1[a] + m2[b]
            if mm <= limit:
                ct[cnt], cm[cnt], ca[cnt], cb[cnt] = t1[a] + t2[b], mm, a, b
                cnt += 1
    keep = _pareto(ct[:cnt], cm[:cnt])
    return ct[keep], cm[keep], ca[keep], cb[keep]


def pareto_sum_reference(t1, m1, t2, m2, limit):
    """Plain-Python `pareto_sum_kernel`."""
    pts = [(float(t1[a]) + float(t2[b]), float(m1[a]) + float(m2[b]), a, b)
           for a in range(len(t1)) for b in range(len(t2)) if float(m1[a]) + float(m2[b]) <= limit]
    keep = _pareto_reference([p[0] for p in pts], [p[1] for p in pts])
    return (np.array([pts[j][0] for j in keep], np.float64), np.array([pts[j][1] for j in keep], np.float64),
            np.array([pts[j][2] for j in keep], np.int64), np.array([pts[j][3] for j in keep], np.int64))


@njit(cache=True)
def min_sum_kernel(t1, m1, t2, m2, limit):
    """The pair (a, b) of least ``t1[a] + t2[b]`` with ``m1[a] + m2[b] <= limit`` (ties: smaller summed bytes,
    then lower a, then lower b); (-1, -1) when none fits. The last step of the allocation search, which needs
    the best point only, not a frontier."""
    best_a, best_b = -1, -1
    bt, bm = np.inf, np.inf
    for a in range(t1.shape[0]):
        for b in range(t2.shape[0]):
            mm = m1[a] + m2[b]
            if mm <= limit:
                tt = t1[a] + t2[b]
                if tt < bt or (tt == bt and mm < bm):
                    bt, bm, best_a, best_b = tt, mm, a, b
    return best_a, best_b


def min_sum_reference(t1, m1, t2, m2, limit):
    """Plain-Python `min_sum_kernel`."""
    pts = [(float(t1[a]) + float(t2[b]), float(m1[a]) + float(m2[b]), a, b)
           for a in range(len(t1)) for b in range(len(t2)) if float(m1[a]) + float(m2[b]) <= limit]
    if not pts:
        return -1, -1
    _, _, a, b = min(pts)
    return a, b

