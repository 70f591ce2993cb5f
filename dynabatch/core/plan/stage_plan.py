"""The planner's per-stage path: rank assignment, ordering and evaluation on ``[S, M]`` stage times.

`plan_microbatches` takes this path when its cost model has a non-uniform `StageLayout`
(`dynabatch.core.cost.stages`); with the uniform layout it keeps its scalar path, unchanged.

* `assign_ranks_stages`: longest (bottleneck stage time) first, each micro-batch to the rank whose
  estimated time ``max_s load[r, s] + (S - 1) * max_j mean_s t[s, j]`` grows least (with the uniform
  layout this is `assign_ranks`' ``sum + (S-1) * max``), then pairwise swaps (and moves, without equal
  counts) out of the slowest rank while they lower the largest estimate.
* `assign_and_order_stages`: each candidate assignment ordered by `dynabatch.core.schedule.search.order_step`
  (each rank's candidate orders: `assign`'s four on the bottleneck and on the mean stage time,
  Johnson's two-machine rule on the front and back halves of the stages and an alternation of
  front-heavy and back-heavy micro-batches, simulated with their ``[S, k]`` stage times).
* `evaluate_plan`: a plan's micro-batches re-priced and re-simulated (same ranks, order and
  schedule) under another cost model, e.g. a stage-blind plan under the real layout.

Times are seconds, memory bytes, forward share per stage ``cost.forward_fraction``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..kernels.stage_assign import assign_stages
from ..kernels.schedules import order_ranks_stages
from ..kernels.simulate import schedule_kernel
from ..kernels.stage_order import insertion_search
from ..options import SCHEDULE_CODES
from ..cost.features import microbatch_features
from ..schedule.orders import record_orders
from ..schedule.search import order_step


def assign_ranks_stages(st: np.ndarray, ranks: int, equal_counts: bool, max_rounds: int = 200) -> np.ndarray:
    """Rank (int32 ``[M]``) of each micro-batch of stage times ``st`` ``[S, M]`` (see the module doc;
    the numba kernel `dynabatch.core.kernels.stage_assign.assign_stages`)."""
    st = np.ascontiguousarray(st, np.float64)
    M = st.shape[1]
    order = np.argsort(-st.max(axis=0), kind="mergesort").astype(np.int64)
    return assign_stages(st, st.mean(axis=0), order, int(ranks), M // ranks if equal_counts else M,
                         bool(equal_counts), int(max_rounds))


def assign_and_order_stages(schedule: str, st, p2p, mem, candidates, ranks: int, fwd_fraction: float,
                            stage_limit: float, optimize: bool):
    """The best (simulated) of the candidate rank assignments ``candidates`` (int32 ``[M]`` arrays),
    each ordered by `order_step` on stage times ``st`` ``[S, M]``; ties: the first.
    Returns ``(rank_of, perm, rank_time_s, schedule)``."""
    best = None
    for r in candidates:
        r = np.asarray(r, np.int32)
        res = order_step(schedule, st, p2p, mem, r, ranks, fwd_fraction, stage_limit, optimize)
        if best is None or res[1].max(initial=0.0) < best[2].max(initial=0.0):
            best = (r, *res)
    return best


def refine_orders(plan, cost, shapes=None, passes: int = 2):
    """``plan`` with each rank's back-heavy micro-batches (more time on the back half of the stages
    than on the front half: say, text-only ones that skip the vision stages) moved, one at a time,
    to the place in the rank's order with the lowest simulated makespan (`insertion_search`, a numba
    kernel), for the static schedules (``gpipe``/``1f1b``) of a per-stage plan. Such micro-batches
    keep the back stages busy while the front stages work on vision-heavy ones; the candidate orders
    of `order_step` (`dynabatch.core.kernels.schedules.stage_candidates`) place them only as
    blocks. Ranks, micro-batches and samples are unchanged; a rank's order changes only where its makespan falls. Ranks are refined slowest first
    and only while they can still set the step's time."""
    if plan.schedule not in ("gpipe", "1f1b") or plan.stage_time_s is None or plan.num_stages < 2:
        return plan
    S, st = plan.num_stages, np.ascontiguousarray(plan.stage_time_s, np.float64)
    p2p = np.ascontiguousarray(cost.p2p_time(microbatch_features(plan, cost, shapes)), np.float64)
    h = S // 2
    heavy = st[h:].sum(axis=0) > st[:h].sum(axis=0)
    new, rank_time = np.arange(st.shape[1]), plan.rank_time_s.copy()
    done = 0.0  # the slowest refined rank: a rank no slower cannot set the step's time, nor can the rest
    for r in np.argsort(-rank_time, kind="stable"):
        if rank_time[r] <= done:
            break
        block = plan.rank_indices(r)
        if len(block) < 2 or not heavy[block].any():
            done = max(done, rank_time[r])
            continue
        order = np.arange(len(block), dtype=np.int64)
        ops = schedule_kernel(S, len(block), SCHEDULE_CODES[plan.schedule])
        t = insertion_search(np.ascontiguousarray(st[:, block]), np.ascontiguousarray(p2p[block]),
                             cost.forward_fraction, ops, order, heavy[block], passes)
        if t < rank_time[r]:
            new[block] = block[order]
            rank_time[r] = t
        done = max(done, rank_time[r])
    if np.array_equal(new, np.arange(len(new))):
        return plan
    return record_orders(_permuted(plan, new, rank_time), p2p[new], cost.forward_fraction)


def _permuted(plan, new, rank_time):
    """``plan`` with micro-batch ``new[i]`` at position ``i`` (each rank's positions kept, so ranks and
    per-rank order indices stay) and the given rank times."""
    sizes = np.diff(plan.mb_offsets)
    take = np.concatenate([np.arange(plan.mb_offsets[k], plan.mb_offsets[k + 1]) for k in new])
    changes = {f.name: getattr(plan, f.name)[new] for f in dataclasses.fields(plan)
               if f.name.startswith("mb_") and f.name not in ("mb_offsets", "mb_rank", "mb_order")}
    for name in ("stage_time_s", "stage_memory_bytes"):
        if getattr(plan, name) is not None:
            changes[name] = getattr(plan, name)[:, new]
    return dataclasses.replace(plan, sample_ids=plan.sample_ids[take], sample_row=plan.sample_row[take],
                               mb_offsets=np.concatenate(([0], np.cumsum(sizes[new]))).astype(np.int64),
                               rank_time_s=rank_time, op_slots=None, **changes)


def evaluate_plan(plan, cost, shapes=None):
    """``plan`` re-priced under ``cost`` (any layout): per-stage times and memory, bottleneck
    ``mb_time_s``, largest-stage ``mb_memory_bytes`` and ``rank_time_s`` re-simulated with the plan's
    ranks, order and schedule (adaptive: the recorded ``stage_memory_bytes`` limit). Returns a new
    `BatchPlan`; ``shapes`` as `microbatch_features` needs them."""
    S = plan.num_stages
    phi = microbatch_features(plan, cost, shapes)
    st = cost.stage_times(phi, S)
    sm = cost.stage_memory(phi, S)
    mem = sm.max(axis=0)
    p2p = cost.p2p_time(phi)
    code = SCHEDULE_CODES[plan.schedule]
    limit = float(plan.options.get("stage_memory_bytes", S * mem.max(initial=1.0)))
    # every rank's micro-batches in execution order, simulated as given (no reordering)
    sel = np.concatenate([plan.rank_indices(r) for r in range(plan.num_ranks)]).astype(np.int64)
    rank_of = np.asarray(plan.mb_rank, np.int32)[sel]
    _, rank_time, _ = order_ranks_stages(np.ascontiguousarray(st[:, sel], np.float64),
                                         np.ascontiguousarray(p2p[sel], np.float64),
                                         np.ascontiguousarray(mem[sel], np.float64), rank_of, int(plan.num_ranks),
                                         float(cost.forward_fraction), code, limit, False)
    new = dataclasses.replace(plan, mb_time_s=st.max(axis=0), mb_memory_bytes=mem, rank_time_s=rank_time,
                              stage_time_s=st, stage_memory_bytes=sm)
    return record_orders(new, p2p, cost.forward_fraction)
