"""Numba kernels that build op tables (the layout of `dynabatch.core.kernels.op_codes`), each beside its
plain-Python reference. `dynabatch.core.schedule` registers and documents the schedules; this is where
their orders are written, once.

=============================  ==================================
kernel                         reference
=============================  ==================================
`static_table`                 `static_table_reference`
`stream_row`                   `stream_row_reference`
`multimodel_table`             `multimodel_table_reference`
`codes_table`                  `codes_table_reference`
`table_codes`                  `table_codes_reference`
=============================  ==================================

`warmup_forwards` is the one statement of 1F1B's warm-up (``S - s - 1`` forwards, at most ``M``); every order built on
1F1B (the plain one, zero-bubble, flush-free streams, many models) takes it from there. The references
state each order in plain loops over lists of ``(kind, micro-batch, chunk, model)`` tuples.
"""

from __future__ import annotations

import numpy as np
from .compile_once import njit

from .op_codes import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, COLUMNS, FORWARD, GPIPE, INTERLEAVED,
                       INTERLEAVED_CHUNKS, INVALID, NOP, ONE_F_ONE_B, UPDATE, ZB_H1, ZB_H2)

@njit(cache=True)
def warmup_forwards(S, s, M):
    """Forwards stage ``s`` of ``S`` runs before its first backward under 1F1B with ``M`` micro-batches:
    the last stage starts backward right after its first forward, each earlier stage runs one more."""
    return min(S - s - 1, M)


# Inlined (untyped IR, before numba types the caller): its callers pass constant kinds and columns, which
# numba types as literals, so a dispatcher would compile one specialization per combination (24 of them).
@njit(cache=True, inline="always")
def _put(table, s, i, kind, j, c, model):
    table[s, i, 0] = kind
    table[s, i, 1] = j
    table[s, i, 2] = c
    table[s, i, 3] = model
    return i + 1


@njit(cache=True, inline="always")  # callers pass constant slots and columns: see `_put`
def one_f_one_b_row(table, r, i, S, s, M, first, model):
    """Write stage ``s``'s 1F1B ops of micro-batches ``first .. first + M - 1`` into row ``r`` of ``table``
    from slot ``i``; returns the next free slot."""
    w = warmup_forwards(S, s, M)
    for j in range(w):
        i = _put(table, r, i, FORWARD, first + j, 0, model)
    for k in range(M - w):
        i = _put(table, r, i, FORWARD, first + w + k, 0, model)
        i = _put(table, r, i, BACKWARD, first + k, 0, model)
    for k in range(M - w, M):
        i = _put(table, r, i, BACKWARD, first + k, 0, model)
    return i


@njit(cache=True)
def zb_h2_warmup(S, s, M):
    """Forwards stage ``s`` of ``S`` runs before its first backward under ZB-H2 with ``M`` micro-batches: as
    many as fit before the first input-gradient part comes back (``2 (S - s) - 1`` of equal ops), at most ``M``."""
    return min(2 * (S - s) - 1, M)


@njit(cache=True)
def _zb_row(table, s, S, M, w, input_first):
    """Zero bubble on stage ``s``: ``w`` warm-up forwards, then per backward its input-gradient part (after the
    next forward, or before it with ``input_first``), each weight-gradient part ``s`` backwards late (the later
    stages pass gradients on sooner and fill their idle tail with the deferred parts), the rest at the end.
    ZB-H1 (``w`` = 1F1B's warm-up): at most ``S`` micro-batches in flight (forward begun, weight part not done)
    on any stage, 1F1B's stage-0 depth; ZB-H2 (`zb_h2_warmup`): about twice that, no warm-up bubble."""
    i = 0
    for j in range(w):
        i = _put(table, s, i, FORWARD, j, 0, 0)
    nf, nw = w, 0
    for b in range(M):
        if input_first:
            i = _put(table, s, i, BACKWARD_INPUT, b, 0, 0)
        if nf < M:
            i = _put(table, s, i, FORWARD, nf, 0, 0)
            nf += 1
        if not input_first:
            i = _put(table, s, i, BACKWARD_INPUT, b, 0, 0)
        if b + 1 - nw > s:
            i = _put(table, s, i, BACKWARD_WEIGHT, nw, 0, 0)
            nw += 1
    while nw < M:
        i = _put(table, s, i, BACKWARD_WEIGHT, nw, 0, 0)
        nw += 1


@njit(cache=True)
def _interleaved_rows(table, S, M, v):
    """Megatron's interleaved 1F1B (as torch's ``ScheduleInterleaved1F1B`` groups it): rank ``s`` holds chunks
    ``c`` (virtual stages ``c * S + s``); the micro-batches go in ``max(1, M // S)`` rounds of consecutive
    micro-batches (sizes as equal as they can be, the larger first), each round through chunk 0, 1, ..
    forward and back through the chunks in reverse; rank ``s`` warms up with ``2 (S - s - 1) + (v - 1) g``
    forwards (``g``: the first round's size), then alternates one forward and one backward."""
    n = M * v
    fseq = np.empty((n, 2), np.int64)
    bseq = np.empty((n, 2), np.int64)
    rounds = max(1, M // S)
    k = 0
    g0 = 0
    for r in range(rounds):
        size = M // rounds + (1 if r < M % rounds else 0)
        for c in range(v):
            for q in range(size):
                fseq[k, 0], fseq[k, 1] = g0 + q, c
                bseq[k, 0], bseq[k, 1] = g0 + q, v - 1 - c
                k += 1
        g0 += size
    first = M // rounds + (1 if M % rounds else 0)
    for s in range(S):
        w = min(2 * (S - s - 1) + (v - 1) * first, n)
        i = 0
        for k in range(w):
            i = _put(table, s, i, FORWARD, fseq[k, 0], fseq[k, 1], 0)
        for k in range(n - w):
            i = _put(table, s, i, FORWARD, fseq[w + k, 0], fseq[w + k, 1], 0)
            i = _put(table, s, i, BACKWARD, bseq[k, 0], bseq[k, 1], 0)
        for k in range(n - w, n):
            i = _put(table, s, i, BACKWARD, bseq[k, 0], bseq[k, 1], 0)


@njit(cache=True)
def static_table(code, S, M):
    """int32 ``[S, L, 4]``: the op table of static schedule ``code`` (`GPIPE`, `ONE_F_ONE_B`, `INTERLEAVED`,
    `ZB_H1`, `ZB_H2`) for ``S`` stages and ``M`` micro-batches; ``L`` = ops per rank. Any other code: every row
    `INVALID` (the simulator refuses it)."""
    per = 3 if code == ZB_H1 or code == ZB_H2 else 2
    v = INTERLEAVED_CHUNKS if code == INTERLEAVED else 1
    table = np.full((S, per * M * v, COLUMNS), 0, np.int32)
    if code == GPIPE:
        for s in range(S):
            i = 0
            for j in range(M):
                i = _put(table, s, i, FORWARD, j, 0, 0)
            for j in range(M):
                i = _put(table, s, i, BACKWARD, j, 0, 0)
    elif code == ONE_F_ONE_B:
        for s in range(S):
            one_f_one_b_row(table, s, 0, S, s, M, 0, 0)
    elif code == ZB_H1 or code == ZB_H2:
        h2 = code == ZB_H2  # a typed bool, not a literal: `_zb_row` compiles once, not once per constant
        for s in range(S):
            _zb_row(table, s, S, M, zb_h2_warmup(S, s, M) if h2 else warmup_forwards(S, s, M), h2)
    elif code == INTERLEAVED:
        _interleaved_rows(table, S, M, v)
    else:
        table[:, :, 0] = INVALID
    return table


def _one_f_one_b_reference(S, s, M, first=0, model=0):
    w = min(S - s - 1, M)  # the reference states the rule again, in its plain form
    fwd = [(FORWARD, first + j, 0, model) for j in range(M)]
    bwd = [(BACKWARD, first + j, 0, model) for j in range(M)]
    row = fwd[:w]
    for f, b in zip(fwd[w:], bwd):
        row += [f, b]
    return row + bwd[M - w:]


def static_table_reference(code, S, M):
    """Plain `static_table`: ``S`` lists of ``(kind, micro-batch, chunk, model)``."""
    if code == GPIPE:
        return [[(FORWARD, j, 0, 0) for j in range(M)] + [(BACKWARD, j, 0, 0) for j in range(M)] for _ in range(S)]
    if code == ONE_F_ONE_B:
        return [_one_f_one_b_reference(S, s, M) for s in range(S)]
    if code == ZB_H1:
        rows = []
        for s in range(S):
            row = []
            for op in _one_f_one_b_reference(S, s, M):
                if op[0] == FORWARD:
                    row.append(op)
                    continue
                row.append((BACKWARD_INPUT, op[1], 0, 0))
                done_w = sum(1 for o in row if o[0] == BACKWARD_WEIGHT)
                if op[1] + 1 - done_w > s:  # the weight part of the backward s places back
                    row.append((BACKWARD_WEIGHT, done_w, 0, 0))
            done_w = sum(1 for o in row if o[0] == BACKWARD_WEIGHT)
            rows.append(row + [(BACKWARD_WEIGHT, j, 0, 0) for j in range(done_w, M)])
        return rows
    if code == ZB_H2:
        rows = []
        for s in range(S):
            w = min(2 * (S - s) - 1, M)
            row = [(FORWARD, j, 0, 0) for j in range(w)]
            later = list(range(w, M))  # forwards still to run
            for b in range(M):
                row.append((BACKWARD_INPUT, b, 0, 0))
                if later:
                    row.append((FORWARD, later.pop(0), 0, 0))
                done_w = sum(1 for o in row if o[0] == BACKWARD_WEIGHT)
                if b + 1 - done_w > s:
                    row.append((BACKWARD_WEIGHT, done_w, 0, 0))
            done_w = sum(1 for o in row if o[0] == BACKWARD_WEIGHT)
            rows.append(row + [(BACKWARD_WEIGHT, j, 0, 0) for j in range(done_w, M)])
        return rows
    if code == INTERLEAVED:
        v = INTERLEAVED_CHUNKS
        rounds = max(1, M // S)
        sizes = [M // rounds + (1 if r < M % rounds else 0) for r in range(rounds)]
        groups = [list(range(sum(sizes[:r]), sum(sizes[:r + 1]))) for r in range(rounds)]
        fseq = [(j, c) for g in groups for c in range(v) for j in g]
        bseq = [(j, c) for g in groups for c in reversed(range(v)) for j in g]
        rows = []
        for s in range(S):
            w = min(2 * (S - s - 1) + (v - 1) * sizes[0], M * v)
            row = [(FORWARD, j, c, 0) for j, c in fseq[:w]]
            for (fj, fc), (bj, bc) in zip(fseq[w:], bseq):
                row += [(FORWARD, fj, fc, 0), (BACKWARD, bj, bc, 0)]
            rows.append(row + [(BACKWARD, j, c, 0) for j, c in bseq[M * v - w:]])
        return rows
    return [[(INVALID, 0, 0, 0)] * (2 * M) for _ in range(S)]


# --------------------------------------------------------------------------- flush-free streams


@njit(cache=True)
def stream_row(table, s, S, ends):
    """Fill ``table[s]`` (``[2 n + K, 4]``) with stage ``s``'s flush-free stream of one rank whose step ends
    are ``ends`` (int64 ``[K]``, exclusive, non-decreasing; ``n = ends[-1]``): 1F1B over the whole stream
    (`one_f_one_b_row`: one warm-up for all steps), with step ``k``'s `UPDATE` right after the backward of
    its last micro-batch (at the start when the step has none)."""
    K = ends.shape[0]
    n = ends[K - 1] if K > 0 else 0
    plain = np.zeros((1, 2 * n, COLUMNS), np.int32)
    one_f_one_b_row(plain, 0, 0, S, s, n, 0, 0)
    i = 0
    k = 0
    while k < K and ends[k] == 0:
        i = _put(table, s, i, UPDATE, k, 0, 0)
        k += 1
    for p in range(2 * n):
        i = _put(table, s, i, plain[0, p, 0], plain[0, p, 1], 0, 0)
        if plain[0, p, 0] == BACKWARD:
            while k < K and ends[k] == plain[0, p, 1] + 1:
                i = _put(table, s, i, UPDATE, k, 0, 0)
                k += 1


def stream_row_reference(s, S, ends):
    """Plain `stream_row`: the 1F1B list of the whole stream, then each update placed after the backward
    that ends its step (a list of ``(kind, micro-batch or step, 0, 0)``)."""
    ends = [int(e) for e in ends]
    out = [(UPDATE, k, 0, 0) for k, e in enumerate(ends) if e == 0]
    for op in _one_f_one_b_reference(S, s, ends[-1] if ends else 0):
        out.append(op)
        if op[0] == BACKWARD:
            out += [(UPDATE, k, 0, 0) for k, e in enumerate(ends) if e == op[1] + 1]
    return out


# --------------------------------------------------------------------------- many models


@njit(cache=True)
def multimodel_table(S, K, M, interleave):
    """int32 ``[S, 2KM, 4]`` over the ``K * M`` virtual micro-batches ``p * M + j`` (model position ``p`` in
    the `MODEL` column): 1F1B over all of them when ``interleave``, else each position's own 1F1B after the
    previous one's."""
    table = np.zeros((S, 2 * K * M, COLUMNS), np.int32)
    for s in range(S):
        if interleave:
            one_f_one_b_row(table, s, 0, S, s, K * M, 0, 0)
            for i in range(2 * K * M):
                table[s, i, 3] = table[s, i, 1] // M
        else:
            i = 0
            for p in range(K):
                i = one_f_one_b_row(table, s, i, S, s, M, p * M, p)
    return table


def multimodel_table_reference(S, K, M, interleave):
    """Plain `multimodel_table` (``S`` lists of tuples)."""
    if interleave:
        return [[(k, j, c, j // M) for k, j, c, _ in _one_f_one_b_reference(S, s, K * M)] for s in range(S)]
    return [sum((_one_f_one_b_reference(S, s, M, p * M, p) for p in range(K)), []) for s in range(S)]


# --------------------------------------------------------------------------- the plain op codes


@njit(cache=True)
def codes_table(ops, M):
    """The op table of plain op codes ``ops`` (int ``[S, L]``: ``j + 1`` forward, ``-(j + 1)`` backward of
    micro-batch ``j`` on chunk 0); a code outside ``±1..±M`` becomes an `INVALID` row."""
    S, L = ops.shape
    table = np.zeros((S, L, COLUMNS), np.int32)
    for s in range(S):
        for i in range(L):
            op = ops[s, i]
            if 0 < op <= M:
                table[s, i, 0], table[s, i, 1] = FORWARD, op - 1
            elif -M <= op < 0:
                table[s, i, 0], table[s, i, 1] = BACKWARD, -op - 1
            else:
                table[s, i, 0] = INVALID
    return table


def codes_table_reference(ops, M):
    """Plain `codes_table` (lists of tuples)."""
    out = []
    for row in ops:
        out.append([(FORWARD, int(op) - 1, 0, 0) if 0 < op <= M else (BACKWARD, -int(op) - 1, 0, 0)
                    if -M <= op < 0 else (INVALID, 0, 0, 0) for op in row])
    return out


@njit(cache=True)
def table_codes(table):
    """(codes int32 ``[S, L]``, ok): plain op codes of a table of forwards and backwards on chunk 0 (up to
    each rank's first `NOP`, zero-padded after it); ``ok`` is False when it holds another kind or chunk."""
    S, L = table.shape[0], table.shape[1]
    out = np.zeros((S, L), np.int32)
    for s in range(S):
        for i in range(L):
            kind = table[s, i, 0]
            if kind == NOP:
                break
            if table[s, i, 2] != 0 or (kind != FORWARD and kind != BACKWARD):
                return out, False
            out[s, i] = table[s, i, 1] + 1 if kind == FORWARD else -(table[s, i, 1] + 1)
    return out, True


def table_codes_reference(table):
    """Plain `table_codes` (lists, or None when the table is not plain)."""
    out = []
    for row in table:
        codes = []
        for kind, j, c, _ in (tuple(int(x) for x in r) for r in row):
            if kind == NOP:
                break
            if c != 0 or kind not in (FORWARD, BACKWARD):
                return None
            codes.append(j + 1 if kind == FORWARD else -(j + 1))
        out.append(codes)
    return out
