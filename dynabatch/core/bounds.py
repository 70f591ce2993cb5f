"""Lower bounds for any plan of one global batch, by any method: on the planning objective
(`objective_lower_bound`) and on the simulated iteration time (`iteration_lower_bound`).

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

**Objective bound.** The planner minimizes DynaPipe's ``sum(t)/R + (S-1)*max(t)``. With ``M``
micro-batches per rank the sum is at least ``W + R*M*F``, the largest micro-batch at least the
mean ``W/(R*M) + F`` and at least ``c_max = max_i c_i``; memory forces ``M >= M_min``::

    objective_LB = min over M >= M_min of  W/R + M*F + (S-1) * max(W/(R*M) + F, c_max)

It bounds the objective only: a simulated 1F1B rank whose short micro-batches open and close
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

import numpy as np

from .cost import CostModel
from .shapes import Shapes

__all__ = ["iteration_lower_bound", "objective_lower_bound"]


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


def objective_lower_bound(shapes: Shapes, cost: CostModel, *, num_stages: int, num_ranks: int,
                          max_len: int | None = None, max_target_len: int | None = None,
                          memory_limit: float | None = None) -> float:
    """Lower bound (seconds) on the planning objective ``sum(t)/R + (S-1)*max(t)`` of any plan of
    ``shapes`` (`BatchPlan.objective_s`; module doc). Not a bound on the iteration time: see
    `iteration_lower_bound`. ``memory_limit`` is bytes per micro-batch (default the cost model's)."""
    n = len(shapes)
    if n == 0:
        return 0.0
    var, whole, _, fixed, _, mem, limit = _per_sample(shapes, cost, max_len, max_target_len, num_stages,
                                                      num_ranks, memory_limit)
    work, c_max = float(var.sum()), float(whole.max())
    m_min = max(int(np.ceil(float(mem.sum()) / num_ranks / limit)), 1)
    per_rank = work / num_ranks
    m = np.arange(m_min, max(-(-n // num_ranks), m_min) + 1, dtype=np.float64)
    bound = per_rank + m * fixed + (num_stages - 1) * np.maximum(per_rank / m + fixed, c_max)
    return float(bound.min())


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
    fill = float(np.min(f * whole + p2p))
    drain = float(np.min((1.0 - f) * whole + p2p))
    k = int(np.argmax(whole))
    alone = S * float(whole[k]) + 2 * (S - 1) * float(p2p[k])
    bound = max(busy + (S - 1) * (fill + drain), alone)
    return bound
