"""The op order a plan records: which op each pipeline stage of a rank runs next, as the planner priced it.

The order is derived in one place, `dynabatch.core.schedule.build.step_ops` (the numba kernel
`rank_ops_kernel`, which the planner's ordering search also calls for every candidate it simulates),
recorded with the plan by `record_orders` (`BatchPlan.op_slots`, written to plan files), and read back by
`plan_orders` for the runner, inspect and recompute. So the order a pipeline executes is the order the
planner simulated and priced: for the static schedules it is fixed by the stage and micro-batch counts
(a plan of a schedule with chunks or split backwards records only its name: the order follows from it
exactly), for ``adaptive`` it depends on the predicted per-stage seconds, transfer seconds and activation
bytes, which a runner does not have.

``op_slots`` ``[S, M, 2]`` holds the position of each micro-batch's forward and backward in its rank's
list (plain op codes: ``j + 1`` forward of a rank's ``j``-th micro-batch in execution order, ``-(j + 1)``
its backward). The plan's other inputs of a simulation are here too, each defined once: its stage times
(`plan_stage_times`), its transfer times (`plan_p2p_s`) and the in-flight budget of its adaptive order
(`stage_limit`). Times are seconds, memory bytes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..kernels.arrays import kernel_array
from ..kernels.schedules import OK, record_slots_kernel
from ..kernels.simulate import split_kernel
from .build import DEFAULT_FORWARD_FRACTION, step_ops
from .ops import StepOps
from .registry import concrete

__all__ = ["DEFAULT_FORWARD_FRACTION", "ops_of", "plan_orders", "plan_p2p_s", "plan_stage_times", "rank_ops",
           "record_orders", "slots_of", "split_times", "stage_limit"]


def split_times(st, forward_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds ``[S, k]`` of stage times ``st`` ``[S, k]``: the forward takes
    ``forward_fraction`` of each, the backward the rest (`split_kernel`, the split every simulation of
    a plan uses)."""
    return split_kernel(kernel_array(np.atleast_2d(st), np.float64), float(forward_fraction))


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
    """int32 ``[S, 2k]``: the plain op codes of one rank running the ``k`` micro-batches of stage times
    ``st`` ``[S, k]`` (execution order) under ``schedule`` (`step_ops`; adaptive's list scheduling uses
    ``p2p`` ``[k]`` seconds, ``mem`` ``[k]`` bytes and ``limit`` bytes in flight per stage; an oversize
    micro-batch runs alone). ValueError for a schedule whose ops are not plain (chunks, split backwards)."""
    st = np.atleast_2d(np.asarray(st, np.float64))
    return step_ops(schedule, st.shape[0], st.shape[1], stage_times=st, p2p_s=p2p, mem_bytes=mem,
                    forward_fraction=forward_fraction, memory_limit=limit).codes()


def _plain(schedule: str) -> bool:
    info = concrete(schedule)
    return info.chunks == 1 and not info.split


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
    """``plan`` with the op order of every rank (`step_ops` on its micro-batches in execution order, its
    stage times, ``p2p`` ``[M]`` seconds in plan order, its ``mem_bytes`` and `stage_limit`) recorded in
    ``op_slots``: the order the planner simulated for ``rank_time_s`` (one numba call,
    `record_slots_kernel`). A schedule with chunks or split backwards is static: its plan records the name,
    from which `plan_orders` rebuilds the order exactly, and ``op_slots`` of ``-1`` (no positions; the column
    stays in the plan file, whose steps may mix schedules under ``auto``)."""
    info = concrete(plan.schedule)
    if not _plain(plan.schedule):
        return dataclasses.replace(plan, op_slots=np.full((plan.num_stages, plan.num_microbatches, 2), -1, np.int32))
    slots = np.zeros((plan.num_stages, plan.num_microbatches, 2), np.int32)
    rank_order = np.lexsort((plan.mb_order, plan.mb_rank)).astype(np.int64)  # rank by rank, execution order
    counts = np.bincount(plan.mb_rank, minlength=plan.num_ranks).astype(np.int64)
    # kernel_array: a plan's columns may be read-only (read zero-copy from a plan file)
    status = record_slots_kernel(np.int64(info.code), kernel_array(plan_stage_times(plan), np.float64),
                                 kernel_array(p2p, np.float64), kernel_array(plan.mb_memory_bytes, np.float64),
                                 rank_order, counts, float(forward_fraction), stage_limit(plan), slots)
    if status != OK:
        raise RuntimeError("adaptive order construction stalled (internal error)")
    return dataclasses.replace(plan, op_slots=slots)


def plan_orders(plan, rank: int, cost=None) -> StepOps:
    """The ops of ``rank``'s micro-batches of ``plan`` (local indices in the rank's execution order,
    `BatchPlan.rank_indices`), as the planner recorded them. A plan without a record (a static schedule with
    chunks or split backwards, or an older plan file) gets `step_ops` of its recorded figures, the transfer
    times and forward share of ``cost`` (without one: no transfer time and `DEFAULT_FORWARD_FRACTION`; exact
    for every static schedule, whose order only depends on the counts)."""
    if not 0 <= rank < plan.num_ranks:
        raise ValueError(f"rank {rank} is not in the plan of step {plan.step} ({plan.num_ranks} ranks)")
    idx = plan.rank_indices(rank)
    if plan.op_slots is not None and _plain(plan.schedule):
        codes = ops_of(plan.op_slots[:, idx], where=f"the plan of step {plan.step}, rank {rank}")
        return StepOps(plan.schedule, plan.num_stages, len(idx), 1, StepOps.from_codes(codes).table)
    ff = DEFAULT_FORWARD_FRACTION if cost is None else cost.forward_fraction
    return step_ops(plan.schedule, plan.num_stages, len(idx), stage_times=plan_stage_times(plan)[:, idx],
                    p2p_s=plan_p2p_s(plan, cost)[idx], mem_bytes=np.asarray(plan.mb_memory_bytes, np.float64)[idx],
                    forward_fraction=ff, memory_limit=stage_limit(plan))
