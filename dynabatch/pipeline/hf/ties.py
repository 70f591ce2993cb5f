"""Summing the gradients of parameters held by several stages (`HFLayeredModel.tied_parameters`).

Each stage keeps its own copy of a tied parameter (Llama's embedding used by the head, T5's shared
embedding and relative bias tables). Their gradient is the sum of every holder's contribution, so
before an optimizer step each copy gets the sum over the stages that hold it, and the copies stay
equal. `TiedGradients` makes one process group per set of holder stages (per data-parallel
replica) once, and sums in place; the runner's pre-optimizer hook calls `TiedGradients.all_reduce`
(a flushed step without that hook: ``runner.step(plan, batches)`` without the optimizer, then
``ties.all_reduce()``, then ``optimizer.step()``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..partition import StagePartition


def stage_of(bounds: Sequence[int], layer: int) -> int:
    """The stage holding global layer ``layer`` when stages are cut at ``bounds``."""
    for s in range(len(bounds) - 1):
        if bounds[s] <= layer < bounds[s + 1]:
            return s
    raise ValueError(f"layer {layer} is outside bounds {list(bounds)}")


def tie_stages(ties: dict[str, list[tuple[int, str]]], bounds: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """Tie name -> the stages holding it (sorted), for the ties that span more than one stage."""
    out = {}
    for name in sorted(ties):
        stages = tuple(sorted({stage_of(bounds, i) for i, _ in ties[name]}))
        if len(stages) > 1:
            out[name] = stages
    return out


class TiedGradients:
    """Sums the gradients of the parameters ``model`` ties across the stages of ``bounds`` (every rank
    of ``ctx`` constructs it in the same order: it creates process groups)."""

    def __init__(self, model, bounds: Sequence[int] | StagePartition, ctx):
        b = tuple(bounds.bounds if isinstance(bounds, StagePartition) else bounds)
        self.ctx, self.spans = ctx, tie_stages(model.tied_parameters(), b)
        self._groups: dict[tuple[int, ...], object] = {}
        for stages in sorted(set(self.spans.values())):
            for d in range(ctx.num_replicas):
                group = dist.new_group([ctx.global_rank(s, d) for s in stages])
                if d == ctx.replica and ctx.stage in stages:
                    self._groups[stages] = group
        self._params = {}
        for name, stages in self.spans.items():
            if ctx.stage in stages:
                i, path = next((i, p) for i, p in model.tied_parameters()[name] if stage_of(b, i) == ctx.stage)
                self._params[name] = model.layers[i].get_parameter(path)

    def all_reduce(self) -> None:
        """Replace each tied parameter's gradient here by the sum over the stages holding it (a missing
        gradient counts as zeros)."""
        for name, p in self._params.items():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self._groups[self.spans[name]])
