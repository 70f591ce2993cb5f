"""Activation bytes in flight under an op order (numba kernels beside their plain references): per stage,
what the in-flight micro-batches (or their chunks) hold at once, from each one's forward to its backward,
or to the backward's weight part when it is split. `held_table_kernel` prices per-stage bytes (the recompute
choice, the partition search); `inflight_table_kernel` per-micro-batch bytes and counts (the simulator's
peaks); `inflight_kernel` the same on plain op codes.

=========================  ===============================
kernel                     reference
=========================  ===============================
`held_table_kernel`        `held_table_reference`
`inflight_table_kernel`    `inflight_table_reference`
`inflight_kernel`          `inflight_reference`
=========================  ===============================
"""

from __future__ import annotations

import numpy as np
from .compile_once import njit

from .op_codes import BACKWARD, BACKWARD_WEIGHT, FORWARD, NOP
from .op_tables import codes_table, codes_table_reference


@njit(cache=True)
def inflight_table_kernel(table, mem, v, peak_n, peak_bytes):
    """Fill ``peak_n`` (int64 ``[S]``) and ``peak_bytes`` (float64 ``[S]``, bytes) from op table ``table``.

    ``mem`` is float64 ``[M]`` activation bytes per micro-batch on a stage; each of a stage's ``v`` chunks
    holds ``mem / v`` of it. In flight on a stage: a micro-batch's chunk counts from the start of its
    forward to the end of its backward there, or of the backward's weight part when it is split (the
    graph is kept for it), so the peak depends only on the order, not on the times (`held_table_kernel`
    of the same bytes on every virtual stage, and of ones for the count)."""
    Q = table.shape[0] * v
    held = np.empty((Q, mem.shape[0]))
    for q in range(Q):
        held[q] = mem / v
    held_table_kernel(table, held, peak_bytes)
    count = np.empty(table.shape[0])
    held_table_kernel(table, np.ones((Q, mem.shape[0])), count)
    for s in range(table.shape[0]):
        peak_n[s] = np.int64(count[s])


def inflight_table_reference(table, mem, v):
    """Plain-Python `inflight_table_kernel`: per stage, the most chunk activations held at once and the
    most bytes, as two lists."""
    peak_n, peak_bytes = [], []
    for row in table:
        held = []  # (micro-batch, chunk) whose forward started and whose last backward part has not ended
        held_bytes = 0.0
        most, most_bytes = 0, 0.0
        for kind, j, c, _ in (tuple(int(x) for x in r) for r in row):
            if kind == NOP:
                break
            if kind == FORWARD:
                held.append((j, c))
                held_bytes += float(mem[j]) / v
                most = max(most, len(held))
                most_bytes = max(most_bytes, held_bytes)
            elif kind in (BACKWARD, BACKWARD_WEIGHT):
                held.remove((j, c))
                held_bytes -= float(mem[j]) / v
        peak_n.append(most)
        peak_bytes.append(most_bytes)
    return peak_n, peak_bytes


@njit(cache=True)
def held_table_kernel(table, held, out):
    """Fill ``out`` (float64 ``[S]``) with each stage's peak held bytes under op table ``table``: micro-batch
    ``j`` holds ``held[q, j]`` bytes on virtual stage ``q = c S + s`` (float64 ``[Q, M]``; ``[S, M]`` without
    chunks) from the start of its forward there to the end of its backward, or of the backward's weight
    part when it is split (per-stage bytes, as the recompute choice and the partition search price them)."""
    S = table.shape[0]
    for s in range(S):
        now = 0.0
        best = 0.0
        for k in range(table.shape[1]):
            kind = table[s, k, 0]
            if kind == NOP:
                break
            q = table[s, k, 2] * S + s
            if kind == FORWARD:
                now += held[q, table[s, k, 1]]
                if now > best:
                    best = now
            elif kind == BACKWARD or kind == BACKWARD_WEIGHT:
                now -= held[q, table[s, k, 1]]
        out[s] = best


def held_table_reference(table, held):
    """Plain-Python `held_table_kernel`: a list of each stage's peak held bytes."""
    S, peaks = len(table), []
    for s, row in enumerate(table):
        now, best = 0.0, 0.0
        for kind, j, c, _ in (tuple(int(x) for x in r) for r in row):
            if kind == NOP:
                break
            if kind in (FORWARD, BACKWARD, BACKWARD_WEIGHT):
                now += float(held[c * S + s][j]) if kind == FORWARD else -float(held[c * S + s][j])
                best = max(best, now)
        peaks.append(best)
    return peaks


@njit(cache=True)
def inflight_kernel(ops, mem, peak_n, peak_bytes):
    """`inflight_table_kernel` of plain op codes ``ops`` (int32 ``[S, 2M]``; ``mem`` float64 ``[M]``)."""
    # np.int64, not a literal 1: numba compiles a kernel once per literal argument value
    inflight_table_kernel(codes_table(ops, mem.shape[0]), mem, np.int64(1), peak_n, peak_bytes)


def inflight_reference(ops, mem):
    """Plain-Python `inflight_kernel`: per stage, the most micro-batches held at once and the most
    bytes held at once, as two lists (the kernel fills arrays instead)."""
    return inflight_table_reference(codes_table_reference(ops, len(mem)), mem, 1)
