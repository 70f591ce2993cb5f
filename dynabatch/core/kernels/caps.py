"""Candidate caps on the largest micro-batch, the DP's outer search (`dynabatch.core.kernels.dp`), in seconds.

`pick_caps` takes up to ``count`` of the sorted distinct segment times from ``values[lo_index]`` up,
spread evenly in log space; `pick_caps_reference` mirrors it in plain Python. `pick_caps_between`
picks the same caps from the unsorted times in ``[lo, hi]`` without sorting them (tests check it
against `pick_caps` of the sorted times)."""

from __future__ import annotations

import math

import numpy as np
from .compile_once import njit


@njit(cache=True)
def pick_caps(values, lo_index, count):
    """Up to ``count`` entries of sorted unique ``values[lo_index:]`` (seconds) spread evenly in log space."""
    m = values.shape[0] - lo_index
    if m <= count:
        return values[lo_index:].copy()
    lo = np.log(values[lo_index])
    hi = np.log(values[-1])
    out = np.empty(count)
    used = 0
    pos = lo_index
    for k in range(count):
        target = np.exp(lo + (hi - lo) * k / (count - 1))
        while pos < values.shape[0] - 1 and values[pos] < target:
            pos += 1
        if used == 0 or values[pos] != out[used - 1]:
            out[used] = values[pos]
            used += 1
    return out[:used]


@njit(cache=True, nogil=True)
def pick_caps_between(times, lo, hi, count):
    """``pick_caps(v, 0, count)`` for ``v`` the sorted distinct entries of ``times`` in [lo, hi]
    (``lo`` and ``hi`` must occur in ``times``), without sorting ``times``.

    Up to ``count`` distinct entries in range are returned sorted, as `pick_caps` returns all of
    them. Otherwise `pick_caps` walks its log-spaced targets and keeps, for each, the smallest entry
    not below it (``hi`` where none is): each entry in range is filed under the last target not
    above it, and the smallest entry filed at or after a target is that target's pick. Same targets,
    same float operations, so the same caps; one pass over ``times`` instead of a sort (the DP's
    segment times number tens of thousands, the caps 2 x ``count``)."""
    few = np.empty(count + 1)
    nf = 0
    for v in times:
        if v >= lo and v <= hi:
            seen = False
            for q in range(nf):
                if few[q] == v:
                    seen = True
                    break
            if not seen:
                few[nf] = v
                nf += 1
                if nf > count:
                    break
    if nf <= count:
        return np.sort(few[:nf])
    lo_l = np.log(lo)
    hi_l = np.log(hi)
    target = np.empty(count)
    for k in range(count):
        target[k] = np.exp(lo_l + (hi_l - lo_l) * k / (count - 1))
        if k and target[k] < target[k - 1]:
            target[k] = target[k - 1]  # the walk never moves back: a smaller target picks what the last did
    low = np.full(count, np.inf)  # smallest entry filed under each target
    for v in times:
        if v < lo or v < target[0] or v > hi:
            continue
        a = 0  # the last target <= v
        b = count - 1
        while a < b:
            mid = (a + b + 1) >> 1
            if target[mid] <= v:
                a = mid
            else:
                b = mid - 1
        if v < low[a]:
            low[a] = v
    out = np.empty(count)
    used = 0
    run = np.inf
    picks = np.empty(count)
    for k in range(count - 1, -1, -1):
        run = min(run, low[k])
        picks[k] = run if run < np.inf else hi
    for k in range(count):
        if used == 0 or picks[k] != out[used - 1]:
            out[used] = picks[k]
            used += 1
    return out[:used]


def pick_caps_reference(values, lo_index, count):
    """Plain-Python `pick_caps`: walk ``count`` targets evenly spaced in log space from
    ``values[lo_index]`` to ``values[-1]`` and keep, for each, the first value not below it
    (never moving back, dropping repeats)."""
    values = [float(v) for v in values]
    if len(values) - lo_index <= count:
        return values[lo_index:]
    lo, hi = math.log(values[lo_index]), math.log(values[-1])
    picked, pos = [], lo_index
    for k in range(count):
        target = math.exp(lo + (hi - lo) * k / (count - 1))
        while pos < len(values) - 1 and values[pos] < target:
            pos += 1
        if not picked or values[pos] != picked[-1]:
            picked.append(values[pos])
    return picked
