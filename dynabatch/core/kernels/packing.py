"""Numba kernels of the baselines' grouping (`dynabatch.core.plan.baselines`), each beside its
plain-Python reference. Lengths and capacities are in tokens.

=================  ===========================
kernel             reference
=================  ===========================
`budget_cuts`      `budget_cuts_reference`
`pack_rows`        `pack_rows_reference`
=================  ===========================
"""

from __future__ import annotations

import numpy as np
from .compile_once import njit


@njit(cache=True)
def budget_cuts(sorted_len, max_tokens, pad_multiple):
    """Starts (int64) of consecutive groups of an ascending int64 length list (tokens) such that
    rows * padded longest length <= ``max_tokens``; a sample longer than the budget is alone."""
    n = sorted_len.shape[0]
    starts = []
    a = 0
    while a < n:
        b = a + 1
        while b < n:
            L = sorted_len[b]
            if pad_multiple > 1:
                L = ((L + pad_multiple - 1) // pad_multiple) * pad_multiple
            if (b - a + 1) * L > max_tokens:
                break
            b += 1
        starts.append(a)
        a = b
    return np.array(starts, np.int64)


def budget_cuts_reference(sorted_len, max_tokens, pad_multiple):
    """Plain-Python `budget_cuts`: group starts as a list."""
    def padded(length):
        return -(-length // pad_multiple) * pad_multiple if pad_multiple > 1 else length

    starts, a, n = [], 0, len(sorted_len)
    while a < n:
        # Lengths ascend, so the group's padded length is that of its last sample.
        b = a + 1
        while b < n and (b - a + 1) * padded(int(sorted_len[b])) <= max_tokens:
            b += 1
        starts.append(a)
        a = b
    return starts


@njit(cache=True)
def pack_rows(order, main, dec, cap_main, cap_dec, best_fit):
    """Row of each sample (by position in ``order``) packing into rows of ``cap_main`` main and
    ``cap_dec`` decoder tokens: first fit (best_fit=False) or best fit on the main length; a
    sample longer than a row is truncated to it. Returns (int64 row per position, number of rows)."""
    n = order.shape[0]
    row = np.empty(n, np.int64)
    free_m = np.empty(n, np.int64)
    free_d = np.empty(n, np.int64)
    nrows = 0
    for q in range(n):
        s = order[q]
        lm = min(main[s], cap_main)
        ld = min(dec[s], cap_dec)
        chosen = -1
        best = cap_main + 1
        for r in range(nrows):
            if free_m[r] >= lm and free_d[r] >= ld:
                if not best_fit:
                    chosen = r
                    break
                if free_m[r] - lm < best:
                    best = free_m[r] - lm
                    chosen = r
        if chosen < 0:
            chosen = nrows
            free_m[nrows] = cap_main
            free_d[nrows] = cap_dec
            nrows += 1
        free_m[chosen] -= lm
        free_d[chosen] -= ld
        row[q] = chosen
    return row, nrows


def pack_rows_reference(order, main, dec, cap_main, cap_dec, best_fit):
    """Plain-Python `pack_rows`: (row per position as a list, number of rows)."""
    free, row = [], []  # free[r] = (main tokens, decoder tokens) still free in row r
    for s in order:
        lm, ld = min(int(main[s]), cap_main), min(int(dec[s]), cap_dec)
        fits = [r for r, (fm, fd) in enumerate(free) if fm >= lm and fd >= ld]
        if not fits:
            free.append((cap_main, cap_dec))
            chosen = len(free) - 1
        elif best_fit:  # the tightest row; the first one among equally tight rows
            chosen = min(fits, key=lambda r: (free[r][0] - lm, r))
        else:
            chosen = fits[0]
        free[chosen] = (free[chosen][0] - lm, free[chosen][1] - ld)
        row.append(chosen)
    return row, len(free)
