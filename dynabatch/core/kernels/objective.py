"""The planner's pipeline objective, once: ``sum / R + (S - 1) x max`` seconds.

A step of micro-batches of times ``t`` (seconds) over ``R`` ranks of an ``S``-stage pipeline takes at
least each rank's share of the work plus the fill and drain of its largest micro-batch. The DP
(`dynabatch.core.kernels.dp`) minimizes it over cuts (on one stage with several ranks it ranks its
caps by it, a lower bound, and scores them by the slowest rank after assignment), rank assignment (`assign`, `stage_assign`:
one rank, ``R = 1``) balances it per rank, `BatchPlan.objective_s` reports it and
`dynabatch.core.plan.bounds` bounds it. `objective_kernel` is the numba form every kernel calls,
`objective_reference` its plain form (the same two operations).
"""

from __future__ import annotations

from .compile_once import njit


# Inlined into the kernels that call it (before typing): they pass ``ranks = 1`` as a constant, which numba
# types as a literal, so a dispatcher compiled one specialization per caller's mix of literals and ints.
# Python callers (scalars, arrays) still get one compiled dispatch each.
@njit(cache=True, inline="always")
def objective_kernel(total, largest, ranks, stages):
    """``total / ranks + (stages - 1) * largest``: ``total`` seconds of work shared by ``ranks`` plus the
    pipeline fill and drain of the ``largest`` micro-batch (seconds) over ``stages`` stages. Scalars or
    arrays of equal shape."""
    return total / ranks + (stages - 1) * largest


def objective_reference(total, largest, ranks, stages):
    """Plain `objective_kernel`."""
    return total / ranks + (stages - 1) * largest
