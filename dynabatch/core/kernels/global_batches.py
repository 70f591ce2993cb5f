"""Cutting a shuffled stream of samples into global batches by a token budget: `greedy_cuts`, the
numba kernel `dynabatch.core.plan.planner.split_global_batches` runs over every epoch's
permutation (millions of samples: a Python loop would cost seconds per epoch), beside
`greedy_cuts_reference`, the same loop in plain Python that ``tests/test_kernels_reference.py``
compares it with. Tokens are integers; the result is end positions (exclusive) into the stream.
"""

from __future__ import annotations

import numpy as np
from .compile_once import njit


@njit(cache=True)
def greedy_cuts(tokens, budget):
    """End positions (int64) of consecutive groups of ``tokens`` (int64 per sample, in stream order),
    each closed by the sample that brings its sum to ``budget`` or more; the rest, if any, is the last
    group (one group when nothing reaches the budget)."""
    ends = []
    acc = 0
    for i in range(tokens.shape[0]):
        acc += tokens[i]
        if acc >= budget:
            ends.append(i + 1)
            acc = 0
    if acc > 0 or len(ends) == 0:
        ends.append(tokens.shape[0])
    return np.array(ends, np.int64)


def greedy_cuts_reference(tokens, budget) -> list:
    """Plain-Python `greedy_cuts` (a list of end positions)."""
    ends, acc = [], 0
    for i, t in enumerate(tokens):
        acc += int(t)
        if acc >= budget:
            ends.append(i + 1)
            acc = 0
    if acc > 0 or not ends:
        ends.append(len(tokens))
    return ends


__all__ = ["greedy_cuts", "greedy_cuts_reference"]
