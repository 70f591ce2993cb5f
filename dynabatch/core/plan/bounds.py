"""Lower bounds for any plan of one global batch, by any method: on the planning objective
(`objective_lower_bound`; with ``collation="padded"`` a tighter one for padded plans) and on the
simulated iteration time (`iteration_lower_bound`).

Notation (times in seconds): ``S`` pipeline stages, ``R`` data-parallel ranks, ``f`` the
forward fraction of a micro-batch's stage time (`CostModel.forward_fraction`). For each sample
``i`` alone, at its varlen (packed) cost: ``v_i`` its variable time (no padding, attention over
itself only, the fixed terms left out), ``c_i`` its whole time as a micro-batch of one, ``p_i``
its stage-to-stage transfer time. ``W = sum_i v_i``; ``F`` is the fixed time every micro-batch
pays (``time_coef`` of ``one``, plus ``has_vis`` when every sample holds vision tiles).

Both bounds rest on one fact about the cost model: with non-negative coefficients, a
micro-batch costs at least the sum of its samples' varlen work plus ``F`` (padding only adds
rows x length, a packed row's attention ``(sum s)^2 >= sum s^2``), at least ``c_i`` for each of
its samples, its transfer at least ``p_i``, and its activation memory at least the sum of its
samples' variable memory. That holds for the analytic and any refit model with non-negative
coefficients; a `ProfiledTable`'s measured padded times are trusted to respect it too.

**Objective bound, any collation** (the *varlen* bound). The planner minimizes DynaPipe's
``sum(t)/R + (S-1)*max(t)``. A plan of ``K`` micro-batches in all (any ``K``: a multiple of ``R``
or not, fewer than ``R`` leaving ranks idle) sums to at least ``W + K*F + V1``; its largest
micro-batch is at least the mean and at least ``c_max = max_i c_i``; memory forces
``K >= K_min = ceil(sum of the samples' variable memory / limit)``::

    objective_LB = min over integers K_min <= K <= n of  (W + V1)/R + K*F/R + (S-1) * max((W + V1)/K + F, c_max)

``V1`` is the vision encoder's fixed time, paid at least once when only some samples hold
tiles. (Releases before this one minimized over ``M = K/R`` integer and ``M >= 1`` only, which
holds for plans giving every rank the same number of micro-batches but not for every plan: an
exhaustive search found plans of tiny batches up to 16% below it with ``K`` under ``R``.)

**Objective bound, padded collation** (the *padded* bound, ``collation="padded"``). In a padded
micro-batch every row is as long as its longest input and its longest target (rounded up to
``pad_multiple``): padding the varlen bound does not see, in two dimensions for an encoder-decoder. Let
``h_i`` be sample ``i``'s time per padded row at its *own* padded lengths (the ``rows`` features
of ``time_coef`` at ``rows = 1``) and ``u_i`` its vision time (additive, never padded). A
micro-batch ``G`` then costs at least ``|G| * max_{i in G} h_i + sum_{i in G} u_i + F`` (its rows
are padded at least to each member's own lengths, and the costs grow in both lengths), and its
``|G| * max h + F`` is at most its time, hence at most the plan's largest micro-batch ``t_max``.
So for a plan whose ``t_max`` lies in ``[a, b]``::

    objective >= (D(b) + U + V1) / R + (S-1) * a

with ``U = sum_i u_i`` and ``D(b)`` the least ``sum over groups (|G| * max_G h + F)`` over
partitions of the samples whose groups keep ``|G| * max_G h + F <= b``: a 1-D problem whose
optimal groups are contiguous in sorted ``h`` (`dynabatch.core.kernels.bounds.capped_partition_cost`,
an O(n x group) DP). Every plan has ``t_max >= c_max`` (the costliest sample's own padded time),
so splitting ``[c_max, inf)`` into intervals ``[a, b]`` (the last ``[a, inf)`` with the cap-free
``D``) and taking the least interval value bounds every padded plan. The intervals are refined
where that least value lies (branch and bound on ``a``) to a relative width of ``1e-3``; the
search stops where ``(D(inf) + U + V1)/R + (S-1)*a`` passes the best interval.

What this sees that the varlen bound does not: a padded micro-batch's every row costs at least
its costliest member's own row, so grouping samples of unequal cost wastes time; and a plan whose
largest micro-batch stays near ``c_max`` must keep ``rows x costliest row`` under it, cutting
the samples into many micro-batches that pay ``F`` each, while fewer, larger ones pay
``(S-1) * b``. What it still misses is the 2-D part of the padding (a member long in input
beside one long in target pads both; ``h`` orders by one cost) and the mean term. On the shared
FLAN/NIv2 batches (T5, 64k tokens, 8 ranks x 4 stages) it lies 4.4% above the varlen bound and
the DP's objective 1.043x above it.

Brute force over every grouping of tiny generated T5-like batches (``tests/test_bounds.py``)
finds no plan below it. The padded bound is the larger of this and the varlen bound (this part
uses no memory limit, so it holds for plans over the limit too). Like the
varlen one it treats the stage-mean ``time_coef`` as the micro-batch time (a stage-aware plan's
slowest stage is no faster); a `ProfiledTable` model has no per-row costs, so it gets the varlen
bound (`objective_bound_kind`).

Neither bounds the iteration time: a simulated 1F1B rank whose short micro-batches open and close
its schedule fills and drains faster than ``(S-1) * max(t)``, so a plan's iteration time can lie
*below* the objective bound.

**Iteration bound.** A plan's iteration time is its slowest rank's simulated makespan
(`BatchPlan.iteration_time_s`): every stage of a rank runs each of the rank's micro-batches
``k`` as a forward of ``f*t_k`` and a backward of ``(1-f)*t_k``; neighbouring stages pass it on
after ``p_k`` (the stages are identical in today's cost model: one stage time per micro-batch,
so nothing is per-stage). The simulator's own bound, valid for any op order, on the last stage:
nothing starts there before some micro-batch's forward crossed the ``S-1`` stages before it
(fill), the stage is busy for the sum of the rank's times, and its last op is a backward that
must still travel back through ``S-1`` stages (drain)::

    T_r >= (S-1) * min_k (f*t_k + p_k) + sum_k t_k + (S-1) * min_k ((1-f)*t_k + p_k)

Relaxing the plan: a micro-batch holds at least one sample, so the fill is at least
``a = min_i (f*c_i + p_i)`` and the drain ``b = min_i ((1-f)*c_i + p_i)``, whatever the grouping
and order. The busiest rank works at least the mean over ranks: with ``M`` micro-batches in
all, ``max_r sum_k t_k >= (W + M*F) / min(M, R)``, smallest at ``M = max(R, M_tot)`` where
``M_tot`` is the count memory forces on the whole batch (ranks left empty do not help), and at
least ``c_max`` (the rank holding the costliest sample). One micro-batch alone takes its whole
path through the pipeline, ``S * t_k + 2 * (S-1) * p_k >= S * c_max + 2 * (S-1) * p_max``::

    iteration_LB = max( max((W + max(R, M_tot)*F + V)/R, c_max) + (S-1)*(a + b),
                        S * c_max + 2*(S-1)*p(c_max sample) )

``V`` is the vision encoder's fixed time once when only some samples hold tiles. Nothing here
depends on the op order, so the bound holds for every schedule (gpipe, 1f1b, adaptive, auto).
The remaining gap to a plan is what these relaxations cannot see: fill/drain micro-batches
larger than one smallest sample, the 1F1B bubbles around large micro-batches, and rank
imbalance. (For 1F1B itself a rank's makespan is at least
``sum_k t_k + (S-1)*t_q + 2*(S-1)*p_q - (1-f)*P_q - f*N_q`` for every micro-batch ``q``, with
``P_q``/``N_q`` the summed times of the ``S-1`` micro-batches before/after it: the stage-0 and
last-stage op lists around ``q``. Turning that into a bound over all groupings needs an assignment
argument this module does not make yet.) The memory term assumes the plan respects ``memory_limit``; pass
``memory_limit=float("inf")`` to bound plans that exceed it (flagged ``over_memory_limit``).
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from ..cost.model import CostModel
from ..kernels.bounds import capped_partition_cost
from ..kernels.objective import objective_kernel
from ..schedule.orders import split_times
from ..shapes import Shapes

__all__ = ["iteration_lower_bound", "objective_bound_kind", "objective_lower_bound"]

#: Relative width to which `objective_lower_bound` refines the interval of ``t_max`` that gives the padded bound.
PADDED_BOUND_RTOL = 1e-3


def _per_sample(shapes: Shapes, cost: CostModel, max_len, max_target_len, num_stages, num_ranks, memory_limit):
    """Per-sample varlen terms: (variable time, whole time, transfer time) in seconds, the fixed
    time every micro-batch pays and that of the vision encoder paid once (s), variable memory (bytes)
    and the memory limit (bytes)."""
    main, dec, tiles = cost.sample_dims(shapes, max_len, max_target_len)
    phi = cost.packed_features(main, dec, tiles, np.arange(len(shapes)))
    variable = phi.copy()
    variable[:, 7:] = 0.0
    coef = cost.time_coef
    all_vis = bool(np.all(tiles > 0))
    fixed = float(coef[7] + (coef[8] if all_vis else 0.0))
    vis_once = float(coef[8]) if (np.any(tiles > 0) and not all_vis) else 0.0
    limit = cost.memory_limit(num_stages, num_ranks) if memory_limit is None else float(memory_limit)
    return (cost.time(variable), cost.time(phi), cost.p2p_time(phi), fixed, vis_once, cost.memory(variable), limit)


def objective_bound_kind(cost: CostModel, collation: str | None) -> str:
    """Which objective bound `objective_lower_bound` gives for plans of ``collation``: ``"padded"``
    for padded plans of a model with per-row costs, else ``"varlen"`` (valid for every plan)."""
    return "padded" if collation == "padded" and cost.table is None else "varlen"


def objective_lower_bound(shapes: Shapes, cost: CostModel, *, num_stages: int, num_ranks: int,
                          max_len: int | None = None, max_target_len: int | None = None,
                          memory_limit: float | None = None, collation: str | None = None) -> float:
    """Lower bound (seconds) on the planning objective ``sum(t)/R + (S-1)*max(t)``
    (`BatchPlan.objective_s`; module doc). ``collation=None`` (or ``"packed"``, ``"packed_rows"``)
    gives the varlen bound, valid for every plan by any method; ``"padded"`` the tighter padded
    bound, valid for plans whose micro-batches are padded (``dp``, ``pad``, ``token_budget``...;
    `objective_bound_kind` says which one a model gets). Not a bound on the iteration time: see
    `iteration_lower_bound`. ``memory_limit`` is bytes per micro-batch (default the cost model's)."""
    n = len(shapes)
    if n == 0:
        return 0.0
    var, whole, _, fixed, vis_once, mem, limit = _per_sample(shapes, cost, max_len, max_target_len, num_stages,
                                                             num_ranks, memory_limit)
    S, R = int(num_stages), int(num_ranks)
    work, c_max = float(var.sum()) + vis_once, float(whole.max())
    k_min = min(max(int(np.ceil(float(mem.sum()) / limit)), 1), n) if limit > 0 else n
    k = np.arange(k_min, n + 1, dtype=np.float64)
    bound = float(objective_kernel(work + k * fixed, np.maximum(work / k + fixed, c_max), R, S).min())
    if objective_bound_kind(cost, collation) == "padded":
        bound = max(bound, _padded_bound(shapes, cost, max_len, max_target_len, S, R, fixed, vis_once))
    return bound


def _padded_bound(shapes, cost, max_len, max_target_len, S, R, fixed, vis_once) -> float:
    """The capped-partition bound of padded plans (module doc): least over intervals [a, b] of the
    largest micro-batch's time of ``(D(b) + U + V1) / R + (S-1) * a``."""
    main, dec, tiles = cost.sample_dims(shapes, max_len, max_target_len)
    one = np.ones(len(main))
    phi = cost.padded_features(one, main, dec, tiles)  # each sample alone in its own padded row
    rows = phi.copy()
    rows[:, 5:] = 0.0  # the per-row features (n/q main, n/q/x dec)
    h = np.sort(rows @ cost.time_coef)
    vis = phi.copy()
    vis[:, :5] = 0.0
    vis[:, 7:] = 0.0
    extra = (float((vis @ cost.time_coef).sum()) + vis_once) / R  # U + V1, never padded
    c_max = float(cost.padded(one, main, dec, tiles)[0].max())
    slack = 1.0 + 1e-9  # float rounding of a plan's micro-batch times against |G| * max h + F

    def value(a, d_b):
        return objective_kernel(d_b, a, R, S) + extra

    d_inf = capped_partition_cost(h, fixed, np.inf)
    if S == 1:
        return d_inf / R + extra
    # coarse intervals [a, a * step) from c_max up, until even the cap-free D cannot beat the best
    step = 1.02
    heap, best_coarse, a = [], math.inf, c_max
    while value(a, d_inf) < best_coarse:
        b = a * step
        d_b = capped_partition_cost(h, fixed, b * slack)
        v = value(a, d_b)
        best_coarse = min(best_coarse, v)
        heapq.heappush(heap, (v, a, b, d_b))
        a = b
    heapq.heappush(heap, (value(a, d_inf), a, math.inf, d_inf))  # [a, inf): at least the cap-free D
    # branch and bound: split the interval of least value until it is narrow; every plan's largest
    # micro-batch lies in one of the intervals, each of which bounds the plans it holds
    while True:
        v, a, b, d_b = heapq.heappop(heap)
        if b == math.inf or b <= a * (1.0 + PADDED_BOUND_RTOL):
            return v
        points = np.linspace(a, b, 9)
        for lo, hi in zip(points[:-2], points[1:-1]):
            d_hi = capped_partition_cost(h, fixed, hi * slack)
            heapq.heappush(heap, (value(lo, d_hi), lo, hi, d_hi))
        heapq.heappush(heap, (value(points[-2], d_b), points[-2], b, d_b))


def iteration_lower_bound(shapes: Shapes, cost: CostModel, *, num_stages: int, num_ranks: int,
                          max_len: int | None = None, max_target_len: int | None = None,
                          memory_limit: float | None = None) -> float:
    """Lower bound (seconds) on the simulated iteration time (`BatchPlan.iteration_time_s`, the
    slowest rank's pipeline makespan) of any plan of ``shapes`` by any method under any schedule
    (op order): per-rank work over the ranks plus one smallest sample's pipeline fill and drain,
    or the costliest sample alone through the pipeline (module doc).
    ``memory_limit`` is bytes per micro-batch (default the cost model's; ``inf`` drops the
    memory-forced micro-batch count)."""
    n = len(shapes)
    if n == 0:
        return 0.0
    var, whole, p2p, fixed, vis_once, mem, limit = _per_sample(shapes, cost, max_len, max_target_len, num_stages,
                                                               num_ranks, memory_limit)
    S, R, f = int(num_stages), min(int(num_ranks), n), float(cost.forward_fraction)
    m_tot = max(int(np.ceil(float(mem.sum()) / limit)), 1) if np.isfinite(limit) and limit > 0 else 1
    mean_busy = (float(var.sum()) + max(R, m_tot) * fixed + vis_once) / R
    busy = max(mean_busy, float(whole.max()))
    fwd, bwd = split_times(whole, f)  # each sample's own forward / backward on one stage
    fill = float(np.min(fwd[0] + p2p))
    drain = float(np.min(bwd[0] + p2p))
    k = int(np.argmax(whole))
    alone = S * float(whole[k]) + 2 * (S - 1) * float(p2p[k])
    bound = max(busy + (S - 1) * (fill + drain), alone)
    return bound
