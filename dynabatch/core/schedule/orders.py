"""The one op order of a step: which forward or backward each pipeline stage of a rank runs next.

It is derived in one place, `rank_ops` (the numba kernel `rank_ops_kernel`, which the planner's
ordering search also calls for every candidate it simulates), recorded with the plan by
`record_orders` (`BatchPlan.op_slots`, written to plan files), and read back by `plan_orders` for
the runner, inspect and recompute. So the order a pipeline executes is the order the planner
simulated and priced: for ``gpipe``/``1f1b`` it is fixed by the stage and micro-batch counts, for
``adaptive`` it depends on the predicted per-stage seconds, transfer seconds and activation bytes,
which a runner does not have.

Op encoding as in `dynabatch.core.simulate.pipeline`: ``j + 1`` is the forward of a rank's ``j``-th micro-batch
(execution order), ``-(j + 1)`` its backward; a rank's order is int32 ``[S, 2k]``. The plan's other
inputs of a simulation are here too, each defined once: its stage times (`plan_stage_times`), its
transfer times (`plan_p2p_s`) and the in-flight budget of its adaptive order (`stage_limit`).
Times are seconds, memory bytes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..kernels.schedules import OK, rank_ops_kernel, record_slots_kernel
from ..kernels.simulate import split_kernel
from ..options import SCHEDULE_CODES

#: Forward share of a stage time for plans that record no order and are read without a cost model.
DEFAULT_FORWARD_FRACTION = 1.0 / 3.0


def split_times(st, forward_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds ``[S, k]`` of stage times ``st`` ``[S, k]``: the forward takes
    ``forward_fraction`` of each, the backward the rest (`split_kernel`, the split every simulation of
    a plan uses)."""
    return split_kernel(np.ascontiguousarray(np.atleast_2d(st), np.float64), float(forward_fraction))


def plan_stage_times(plan) -> np.ndarray:
    """Forward+backward seconds ``[S, M]`` of a plan's micro-batches (plan order) on each stage: its
    ``stage_time_s``, or ``mb_time_s`` on every stage for a plan without per-stage predictions."""
    if plan.stage_time_s is not None:
        return np.asarray(plan.stage_time_s, np.float64)
    return np.repeat(np.asarray(plan.mb_time_s, np.float64)[None, :], plan.num_stages, axis=0)


def plan_p2p_s(plan, cost) -> np.ndarray:
    """Seconds ``[M]`` to send each micro-batch of ``plan`` between two stages, as the planner priced
    them: ``cost.transfer_time`` of the tokens it computes (the same for every collation, so packed
    plans need no per-sample shapes); zeros without a cost model."""
    if cost is None:
        return np.zeros(plan.num_microbatches)
    return np.asarray(cost.transfer_time(plan.mb_tokens), np.float64)


def stage_limit(plan) -> float:
    """In-flight activation bytes per stage the plan's adaptive order keeps to (``inf`` if it records none)."""
    return float((plan.options or {}).get("stage_memory_bytes", np.inf))


def rank_ops(schedule: str, st, p2p, mem, forward_fraction: float, limit: float) -> np.ndarray:
    """int32 ``[S, 2k]``: the op order of one rank running the ``k`` micro-batches of stage times
    ``st`` ``[S, k]`` (execution order) under ``schedule`` (``gpipe``, ``1f1b`` or ``adaptive``, whose
    list scheduling uses ``p2p`` ``[k]`` seconds, ``mem`` ``[k]`` bytes and ``limit`` bytes in flight per
    stage; an oversize micro-batch runs alone)."""
    if schedule not in ("gpipe", "1f1b", "adaptive"):
        raise ValueError(f"a rank's op order needs a concrete schedule (gpipe, 1f1b, adaptive), got {schedule!r}")
    st = np.ascontiguousarray(np.atleast_2d(st), np.float64)
    k = st.shape[1]
    p2p = np.ascontiguousarray(np.broadcast_to(np.asarray(p2p, np.float64), (k,)))
    mem = np.ascontiguousarray(np.broadcast_to(np.asarray(mem, np.float64), (k,)))
    ops, _, _, status = rank_ops_kernel(SCHEDULE_CODES[schedule], st, p2p, mem, float(forward_fraction),
                                        float(limit))
    if status != OK:
        raise RuntimeError("adaptive order construction stalled (internal error)")
    return ops


def slots_of(ops) -> np.ndarray:
    """int32 ``[S, k, 2]``: the position of each micro-batch's forward (``[..., 0]``) and backward
    (``[..., 1]``) in each stage's op list ``ops`` ``[S, 2k]``."""
    ops = np.asarray(ops, np.int64)
    S, two_k = ops.shape
    slots = np.full((S, two_k // 2, 2), -1, np.int32)
    slots[np.arange(S)[:, None], np.abs(ops) - 1, (ops < 0).astype(np.int64)] = np.arange(two_k, dtype=np.int32)
    return slots


def ops_of(slots, where: str = "the plan") -> np.ndarray:
    """The op lists int32 ``[S, 2k]`` of ``slots`` ``[S, k, 2]`` (the inverse of `slots_of`); raises
    ValueError naming ``where`` unless every stage lists each op exactly once."""
    slots = np.asarray(slots, np.int64)
    S, k, _ = slots.shape
    ops = np.zeros((S, 2 * k), np.int32)
    if k == 0:
        return ops
    code = np.arange(1, k + 1, dtype=np.int32)
    ok = slots.min() >= 0 and slots.max() < 2 * k
    if ok:
        rows = np.arange(S)[:, None]
        ops[rows, slots[:, :, 0]] = code
        ops[rows, slots[:, :, 1]] = -code
        ok = bool(np.all(ops != 0))
    if not ok:
        raise ValueError(f"the op order recorded in {where} is not a permutation of each stage's {2 * k} ops; "
                         "the plan file is damaged: plan the step again")
    return ops


def record_orders(plan, p2p, forward_fraction: float):
    """``plan`` with the op order of every rank (`rank_ops` on its micro-batches in execution order, its
    stage times, ``p2p`` ``[M]`` seconds in plan order, its ``mb_memory_bytes`` and `stage_limit`)
    recorded in ``op_slots``: the order the planner simulated for ``rank_time_s`` (one numba call,
    `record_slots_kernel`)."""
    if plan.schedule not in ("gpipe", "1f1b", "adaptive"):
        raise ValueError(f"a plan records the op order of a concrete schedule, not {plan.schedule!r}")
    slots = np.zeros((plan.num_stages, plan.num_microbatches, 2), np.int32)
    rank_order = np.lexsort((plan.mb_order, plan.mb_rank)).astype(np.int64)  # rank by rank, execution order
    counts = np.bincount(plan.mb_rank, minlength=plan.num_ranks).astype(np.int64)
    status = record_slots_kernel(SCHEDULE_CODES[plan.schedule], np.ascontiguousarray(plan_stage_times(plan)),
                                 np.ascontiguousarray(p2p, np.float64),
                                 np.ascontiguousarray(plan.mb_memory_bytes, np.float64), rank_order, counts,
                                 float(forward_fraction), stage_limit(plan), slots)
    if status != OK:
        raise RuntimeError("adaptive order construction stalled (internal error)")
    return dataclasses.replace(plan, op_slots=slots)


def plan_orders(plan, rank: int, cost=None) -> np.ndarray:
    """int32 ``[S, 2k]``: the op order of ``rank``'s micro-batches of ``plan`` (local indices in the rank's
    execution order, `BatchPlan.rank_indices`), as the planner recorded it. A plan without a record (an
    older plan file) gets `rank_ops` of its recorded figures, the transfer times and forward share of
    ``cost`` (without one: no transfer time and `DEFAULT_FORWARD_FRACTION`; exact for ``gpipe`` and
    ``1f1b``, whose order only depends on the counts)."""
    if not 0 <= rank < plan.num_ranks:
        raise ValueError(f"rank {rank} is not in the plan of step {plan.step} ({plan.num_ranks} ranks)")
    idx = plan.rank_indices(rank)
    if plan.op_slots is not None:
        return ops_of(plan.op_slots[:, idx], where=f"the plan of step {plan.step}, rank {rank}")
    ff = DEFAULT_FORWARD_FRACTION if cost is None else cost.forward_fraction
    return rank_ops(plan.schedule, plan_stage_times(plan)[:, idx], plan_p2p_s(plan, cost)[idx],
                    np.asarray(plan.mb_memory_bytes, np.float64)[idx], ff, stage_limit(plan))
