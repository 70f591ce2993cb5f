"""Per-stage peak of held activation bytes under an op order, for the recompute choice.

`stage_peaks` (numba) and `stage_peaks_reference` (plain Python) give the same floats: for every
stage ``s`` of one pipeline replica running op lists ``ops`` (int ``[S, 2k]``, ``+j`` forward and
``-j`` backward of micro-batch ``j - 1``), the most bytes held at once, where micro-batch ``j``
holds ``mem[s, j]`` bytes on stage ``s`` from the start of its forward to the end of its backward
(`dynabatch.core.kernels.simulate.inflight_kernel` with one memory row per stage).
"""

from __future__ import annotations

import numpy as np
from .compile_once import njit


@njit(cache=True)
def stage_peaks(ops, mem, out):
    """Fill ``out`` (float64 ``[S]``) with each stage's peak held bytes (see the module docstring)."""
    S, n = ops.shape
    for s in range(S):
        held = 0.0
        best = 0.0
        for k in range(n):
            op = ops[s, k]
            if op > 0:
                held += mem[s, op - 1]
                if held > best:
                    best = held
            else:
                held -= mem[s, -op - 1]
        out[s] = best


def stage_peaks_reference(ops, mem):
    """Plain-Python `stage_peaks`: a list of each stage's peak held bytes."""
    peaks = []
    for s, row in enumerate(ops):
        held, best = 0.0, 0.0
        for op in row:
            j = abs(int(op)) - 1
            held += float(mem[s][j]) if op > 0 else -float(mem[s][j])
            best = max(best, held)
        peaks.append(best)
    return peaks
