"""The 1-D capped-partition DP behind the padded objective bound (`dynabatch.core.plan.bounds`).

`capped_partition_cost` (numba) and `capped_partition_cost_reference` (plain Python) compute the least
summed cost of cutting ascending per-row times into groups under a cap (seconds)."""

from __future__ import annotations

import math

import numpy as np
from .compile_once import njit


@njit(cache=True, nogil=True)
def capped_partition_cost(w, fixed, cap):
    """Least ``sum over groups (|G| * max_G w + fixed)`` over partitions of the ascending ``w`` into
    groups with ``|G| * max_G w + fixed <= cap`` (``inf`` when a single entry breaks the cap).

    `dynabatch.core.plan.bounds` bounds padded plans with it (each ``w`` a sample's padded per-row time).
    Groups may be taken contiguous in the sorted order: moving the ``s`` largest entries into the
    group of size ``s`` holding the largest keeps that group's size and maximum, and gives every
    other group entries no larger than those it gave away, so no group's cost rises or breaks the
    cap. O(n x largest group) time."""
    n = w.shape[0]
    f = np.empty(n + 1)
    f[0] = 0.0
    for i in range(1, n + 1):
        x = w[i - 1]  # the largest entry of any group ending here
        if x + fixed > cap:
            return np.inf
        best = np.inf
        for j in range(i - 1, -1, -1):
            c = (i - j) * x
            if c + fixed > cap:
                break  # larger groups break the cap too
            c += f[j]
            if c < best:
                best = c
        f[i] = best + fixed
    return f[n]


def capped_partition_cost_reference(w, fixed, cap):
    """Plain-Python `capped_partition_cost`: the same DP over contiguous groups of the sorted
    entries, by prefix (``best[i]``: the least cost of the ``i`` smallest entries)."""
    w = [float(x) for x in w]
    best = [0.0]
    for i in range(1, len(w) + 1):
        largest = w[i - 1]  # the group ending at entry i - 1 has it as its maximum
        if largest + fixed > cap:
            return math.inf
        options = [(i - j) * largest + best[j] for j in range(i) if (i - j) * largest + fixed <= cap]
        best.append(min(options) + fixed)
    return best[-1]
