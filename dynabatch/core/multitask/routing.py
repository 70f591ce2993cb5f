"""Which rank of each component's group runs which micro-batch (the contract between the planner and the
torch.distributed executor, `dynabatch.pipeline.multitask`).

`route` gives, per component, for each rank of its group (in `Placement.ranks` order) the indices of the
step's micro-batches that rank processes for that component: only micro-batches whose task reaches the
component, balanced over the group's data-parallel replicas longest first (each to the least-loaded
replica, ties to the lower one: `dynabatch.core.kernels.allocation.lpt_reference`, the rule the planner
simulates), every pipeline stage of a replica listing the same micro-batches. Deterministic: every rank
computes the same routes from the same plan. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..kernels.allocation import lpt_reference
from .allocation import Allocation
from .graph import ComponentGraph


def route(allocation: Allocation, graph: ComponentGraph, tasks_of_microbatches: Sequence[str], *,
          cost_s: Mapping[str, Sequence[float]] | None = None) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Per component, per rank of its group (``Placement.ranks`` order), the ascending indices of the
    micro-batches that rank runs for it. ``tasks_of_microbatches[j]``: micro-batch ``j``'s task.
    ``cost_s[component][j]``: its predicted seconds there (`dynabatch.core.multitask.workload.Workload.time_s`
    rows); without it every micro-batch costs the same (plain round-robin). Unknown task names raise
    ValueError naming the graph's tasks."""
    tasks = tuple(tasks_of_microbatches)
    graph.check_tasks(tasks, "micro-batch")
    out: dict[str, tuple[tuple[int, ...], ...]] = {}
    for name in graph.order():
        p = allocation.placement(name)
        if p.pieces != 1:
            raise ValueError(f"route: component {name!r} splits each micro-batch into {p.pieces} pieces "
                             f"(plan_allocation(split_sequences=True)), which is simulated only; routes give whole "
                             f"micro-batches: plan with split_sequences=False to run the allocation")
        reach = [name in graph.reaches(t) for t in tasks]
        if cost_s is not None and name in cost_s:
            given = [float(c) for c in cost_s[name]]
            if len(given) != len(tasks):
                raise ValueError(f"route: cost_s[{name!r}] has {len(given)} entries for {len(tasks)} micro-batches")
        else:
            given = [1.0] * len(tasks)
        cost = [c if r else -1.0 for c, r in zip(given, reach)]
        assign, _ = lpt_reference(cost, p.replicas)
        per_replica = [tuple(j for j in range(len(tasks)) if assign[j] == d) for d in range(p.replicas)]
        out[name] = tuple(per_replica[k // p.stages] for k in range(len(p.ranks)))
    return out
