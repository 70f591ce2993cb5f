"""Shard residency under a many-model op order (numba kernel beside its plain-Python reference): on one
stage, the most shard bytes that must be resident at once (`dynabatch.core.simulate.multimodel.active_peak`).

=========================  ===============================
kernel                     reference
=========================  ===============================
`active_peak_kernel`       `active_peak_reference`
=========================  ===============================
"""

from __future__ import annotations

import numpy as np
from .compile_once import njit


@njit(cache=True)
def active_peak_kernel(row, M, shard_bytes, updates_at_end):
    """Peak bytes of shards that must be resident at once on one stage running op list ``row``
    (int32 [2KM], virtual codes; position ``p`` owns virtual micro-batches ``p*M .. p*M+M-1``).
    ``shard_bytes`` float64 [K] by position. A position is active from its first to its last op;
    with ``updates_at_end`` each position is also active alone for its update after the list (those
    come one at a time). Returns (peak bytes, position count at that peak)."""
    K = shard_bytes.shape[0]
    n = row.shape[0]
    first = np.full(K, n, dtype=np.int64)
    last = np.full(K, -1, dtype=np.int64)
    for i in range(n):
        op = row[i]
        v = op - 1 if op > 0 else -op - 1
        p = v // M
        if i < first[p]:
            first[p] = i
        if i > last[p]:
            last[p] = i
    delta = np.zeros(n + 1)
    count = np.zeros(n + 1, dtype=np.int64)
    for p in range(K):
        if last[p] >= 0:
            delta[first[p]] += shard_bytes[p]
            delta[last[p] + 1] -= shard_bytes[p]
            count[first[p]] += 1
            count[last[p] + 1] -= 1
    peak = 0.0
    peak_n = 0
    acc = 0.0
    acc_n = 0
    for i in range(n):
        acc += delta[i]
        acc_n += count[i]
        if acc > peak:
            peak = acc
            peak_n = acc_n
    if updates_at_end:
        for p in range(K):
            if shard_bytes[p] > peak:
                peak = shard_bytes[p]
                peak_n = 1
    return peak, peak_n


def active_peak_reference(row, M, shard_bytes, updates_at_end):
    """Plain-Python `active_peak_kernel`: at every op, sum the shards whose window holds it."""
    K = len(shard_bytes)
    spans = {}
    for i, op in enumerate(row):
        p = (abs(int(op)) - 1) // M
        a, b = spans.get(p, (i, i))
        spans[p] = (min(a, i), max(b, i))
    peak, peak_n = 0.0, 0
    for i in range(len(row)):
        acc, acc_n = 0.0, 0
        for p in range(K):
            if p in spans and spans[p][0] <= i <= spans[p][1]:
                acc += float(shard_bytes[p])
                acc_n += 1
        if acc > peak:
            peak, peak_n = acc, acc_n
    if updates_at_end:
        for p in range(K):
            if float(shard_bytes[p]) > peak:
                peak, peak_n = float(shard_bytes[p]), 1
    return peak, peak_n
