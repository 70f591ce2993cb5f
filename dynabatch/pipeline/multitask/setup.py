"""Set-up of the multi-task executor: the checks an `Allocation` must pass against its `ComponentGraph` and
the world before any rank connects (`check_allocation`), and the ranks' process groups (`init_spindle`): one
``torch.distributed`` process group per component group of two or more ranks (the gradient all-reduce inside
the component), created by every rank in the allocation's order under the failure monitor, on top of
`dynabatch.pipeline.init_pipeline`'s world (its store, liveness side channel and close protocol)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch.distributed as dist

from ...core.multitask.allocation import Allocation
from ...core.multitask.graph import ComponentGraph
from ..runtime.comm import DistContext, init_pipeline
from ..runtime.setup_guard import setup_call


class AllocationError(ValueError):
    """An `Allocation` the executor cannot run on this graph and world (the message names the component)."""


def check_allocation(allocation: Allocation, graph: ComponentGraph, world_size: int) -> None:
    """Raise `AllocationError` unless ``allocation`` places every component of ``graph`` (and nothing else) on
    ranks ``0 .. world_size - 1``, for exactly ``world_size`` devices, each component in a later wave than every
    component it reads, and with one pipeline stage per group (``stages=1``: a pipeline inside a component is not
    run by this executor; plan with one stage per component, or use `dynabatch.pipeline.PipelineRunner` for
    one model cut into stages) and whole micro-batches (``pieces=1``)."""
    placed = {p.component for p in allocation.placements}
    for c in graph.names:
        if c not in placed:
            raise AllocationError(f"the allocation gives component {c!r} no ranks (placed: {', '.join(sorted(placed))}); "
                                  f"every component of the graph needs a device group")
    for p in allocation.placements:
        if p.component not in graph.names:
            raise AllocationError(f"the allocation places {p.component!r}, which is no component of the graph "
                                  f"(components: {', '.join(graph.names)})")
        bad = [r for r in p.ranks if not 0 <= r < world_size]
        if bad:
            raise AllocationError(f"component {p.component!r} is placed on ranks {list(p.ranks)}, but rank(s) {bad} "
                                  f"are outside the world of {world_size} ranks (0..{world_size - 1}); plan the "
                                  f"allocation for {world_size} devices")
        if p.stages != 1:
            raise AllocationError(f"component {p.component!r} is placed with stages={p.stages}: the multi-task "
                                  f"executor runs each component data-parallel inside its group (stages=1), a pipeline "
                                  f"inside a component is not implemented; plan it with one stage (more devices or "
                                  f"memory per device)")
        if p.pieces != 1:
            raise AllocationError(f"component {p.component!r} is placed with pieces={p.pieces}: the multi-task "
                                  f"executor runs whole micro-batches (splitting a micro-batch's sequences over a "
                                  f"group's replicas is simulated only); plan with split_sequences=False")
        for i in graph.component(p.component).inputs:
            if allocation.placement(i).wave >= p.wave:
                raise AllocationError(f"component {p.component!r} (wave {p.wave}) reads {i!r}, which runs in wave "
                                      f"{allocation.placement(i).wave}: an input must run in an earlier wave")
    if allocation.num_devices != world_size:
        raise AllocationError(f"the allocation is planned for {allocation.num_devices} devices but the world has "
                              f"{world_size} ranks")


@dataclass
class SpindleContext:
    """This rank's place in a multi-task run: ``dist`` (the world's `DistContext`: store, failure monitor,
    close protocol), the ``allocation`` it runs, and ``groups`` (component name -> its process group, for
    the components this rank holds whose group has two or more ranks). Use as a context manager (or call
    `close`) as `DistContext`."""

    dist: DistContext
    allocation: Allocation
    groups: dict[str, object] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        """This rank's global rank."""
        return self.dist.rank

    @property
    def world_size(self) -> int:
        """Ranks in the world."""
        return self.dist.world_size

    @property
    def monitor(self):
        """The world's failure monitor (`dynabatch.pipeline.runtime.failure.FailureMonitor`)."""
        return self.dist.monitor

    @property
    def device(self):
        """Where this rank's tensors live."""
        return self.dist.device

    def held(self) -> tuple[str, ...]:
        """The components this rank runs, in wave order."""
        return self.allocation.components_on(self.rank)

    def close(self) -> None:
        """Finish (`DistContext.close`)."""
        self.dist.close()

    def __enter__(self) -> "SpindleContext":
        return self

    def __exit__(self, exc_type, exc, tb):
        return self.dist.__exit__(exc_type, exc, tb)


def init_spindle(allocation: Allocation, graph: ComponentGraph, *, rank: int | None = None,
                 world_size: int | None = None, master_addr: str | None = None, master_port: int | None = None,
                 backend: str = "gloo", device=None, timeout_s: float = 120.0,
                 abort_after_s: float | None = 5.0) -> SpindleContext:
    """Start ``torch.distributed`` for running ``allocation`` (`init_pipeline`'s arguments: the ``RANK``/
    ``WORLD_SIZE``/``MASTER_*`` environment by default, ``timeout_s`` seconds of no progress is a stall; the
    backend is gloo: `SpindleExecutor` matches its messages by tag, which NCCL ignores) and
    create the component groups' process groups (`attach_allocation`). The allocation is checked first
    (`check_allocation`), on every rank before it connects: a wrong allocation fails each rank alone with the
    same `AllocationError`."""
    world = int(world_size if world_size is not None else os.environ.get("WORLD_SIZE", 1))
    check_allocation(allocation, graph, world)
    ctx = init_pipeline(1, rank=rank, world_size=world, master_addr=master_addr, master_port=master_port,
                        backend=backend, device=device, timeout_s=timeout_s, abort_after_s=abort_after_s)
    return attach_allocation(ctx, allocation, graph)


def attach_allocation(ctx: DistContext, allocation: Allocation, graph: ComponentGraph) -> SpindleContext:
    """A `SpindleContext` for ``allocation`` on an initialized world ``ctx`` (`init_pipeline`'s, or an earlier
    `SpindleContext.dist`: a later step's new allocation reuses the world): checks it (`check_allocation`) and
    creates its component groups' process groups, every rank every group in the allocation's order, under the
    failure monitor. Every rank calls it with the same allocation."""
    check_allocation(allocation, graph, ctx.world_size)
    me = ctx.rank

    def make() -> dict[str, object]:
        groups = {}
        for p in allocation.placements:
            if len(p.ranks) > 1:
                g = dist.new_group(list(p.ranks))
                if me in p.ranks:
                    groups[p.component] = g
        return groups

    groups = setup_call(SimpleNamespace(monitor=ctx.monitor, rank=me), make,
                        "in the creation of the component groups' process groups", range(ctx.world_size))
    return SpindleContext(ctx, allocation, groups)


__all__ = ["AllocationError", "SpindleContext", "attach_allocation", "check_allocation", "init_spindle"]
