"""Parameters shared between pipeline stages (tied input/output embeddings, T5's relative-attention
bias table): each stage holding a use keeps its own copy, and before every update the copies'
gradients are summed over exactly the stages holding one, so every copy takes the same step and the
result is the one process's (where the model's layers share one parameter).

A model declares its ties with ``tied_parameters() -> {name: [(global layer index, parameter path
inside that layer), ...]}`` (`dynabatch.pipeline.models.LayeredModel.tied_parameters`). `tie_stages`
works out, from the model's cut alone (the same on every rank), which stages hold each tie; `Ties.of`
creates one process group per set of stages and replica, collectively on every rank in the same
order, and checks that the copies start equal (both under the failure monitor: `setup_guard`); `Ties.reduce` all-reduces the gradients (called by
`dynabatch.pipeline.runtime.update.update_stage`). A tie held by one stage needs no communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors

from .setup_guard import setup_all_reduce, setup_call


def tie_stages(ties: dict, bounds: Sequence[int], model_name: str = "the model") -> dict[tuple[int, ...], list[str]]:
    """Stage set -> the names of the ties held by exactly those stages (sets of 2+ stages only, in
    sorted order) for a model cut at ``bounds`` (layer offsets, one more than the stages)."""
    b = [int(x) for x in bounds]
    n = b[-1]
    out: dict[tuple[int, ...], list[str]] = {}
    for name in sorted(ties):
        stages = set()
        for layer, path in ties[name]:
            if not 0 <= int(layer) < n:
                raise ValueError(f"{model_name}: tie {name!r} names layer {layer} ({path!r}) but the model has "
                                 f"{n} layers (0..{n - 1}); fix its tied_parameters()")
            stages.add(next(s for s in range(len(b) - 1) if b[s] <= int(layer) < b[s + 1]))
        if len(stages) > 1:
            out.setdefault(tuple(sorted(stages)), []).append(name)
    return dict(sorted(out.items()))


@dataclass
class _Tie:
    """One tie on this stage: its name, the stages holding it, their process group, and this stage's
    distinct parameter objects of its uses."""

    name: str
    stages: tuple[int, ...]
    group: object
    params: list


class Ties:
    """The ties of one model on this rank's stage (module doc); ``ties`` as `_Tie` records."""

    def __init__(self, ties: list[_Tie]):
        self.ties = ties

    def __bool__(self) -> bool:
        return bool(self.ties)

    @classmethod
    def of(cls, model, stage, bounds: Sequence[int], ctx) -> "Ties":
        """The ties of ``model`` (a `LayeredModel`; a model without ``tied_parameters`` has none) on
        ``stage`` (this rank's `PipelineStage`) for the cut ``bounds``. Collective when some tie spans
        stages: every rank of the world must call it for the same model and cut, in the same order."""
        declared = model.tied_parameters() if hasattr(model, "tied_parameters") else {}
        if not declared:
            return cls([])
        name = getattr(model, "name", "the model")
        sets = tie_stages(declared, bounds, name)
        S, s = ctx.num_stages, ctx.stage
        groups = {}
        for d in range(ctx.num_replicas):  # every rank creates every group, in the same order
            for stages, names in sets.items():
                ranks = [d * S + t for t in stages]
                # gloo's rendezvous blocks until every member arrives: watched, so a member that failed or
                # died in its set-up stops this rank with its error (non-members pass at once)
                g = setup_call(ctx, lambda r=ranks: dist.new_group(r), f"in the creation of the process group of "
                               f"tied parameters {names} of stages {list(stages)} (replica {d})",
                               ranks if ctx.rank in ranks else ())
                if d == ctx.replica and s in stages:
                    groups[stages] = g
        ties = []
        for tie in sorted(declared):
            uses = [(int(i), p) for i, p in declared[tie] if stage.first_layer <= int(i) <= stage.last_layer]
            held = next((st for st, names in sets.items() if tie in names), (s,))
            params = _distinct(stage, uses, name, tie)
            if len(params) > 1 or len(held) > 1:
                ties.append(_Tie(tie, held, groups.get(held) if len(held) > 1 else None, params))
        out = cls([t for t in ties if t.params])
        out.check_equal(ctx)
        return out

    def check_equal(self, ctx) -> None:
        """Raise ValueError unless every copy of every tie holds the same values (collective over each
        tie's stages): copies loaded or initialized differently would train apart."""
        for t in self.ties:
            flat = _flatten_dense_tensors([p.detach().to(torch.float64) for p in t.params])
            if any(not torch.equal(p, t.params[0]) for p in t.params[1:]):
                raise ValueError(f"tie {t.name!r}: the copies on stage {ctx.stage} differ")
            if t.group is None:
                continue
            hi, lo = flat.clone(), flat.clone()
            peers = [ctx.global_rank(x) for x in t.stages]
            for x, op in ((hi, dist.ReduceOp.MAX), (lo, dist.ReduceOp.MIN)):
                setup_all_reduce(ctx, x, f"in the check that the copies of tied parameter {t.name!r} agree", peers,
                                 op=op, group=t.group)
            if not (torch.equal(hi, flat) and torch.equal(lo, flat)):
                raise ValueError(f"tie {t.name!r}: the copies on stages {list(t.stages)} differ (stage {ctx.stage}, "
                                 f"rank {ctx.rank}); build or load every stage's copy from the same weights")

    def reduce(self, guard, label: str) -> None:
        """Sum each tie's gradients over its stages (and its uses on this stage) in place; every
        gradient must exist (`update_stage` fills missing ones with zeros first)."""
        ctx = guard.ctx
        for t in self.ties:
            grads = [p.grad for p in t.params]
            total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
            if not total.is_contiguous():
                total = total.contiguous()
            if t.group is not None:
                guard.all_reduce(total, f"in the all-reduce of tied parameter {t.name!r} of {label} (waiting for "
                                        f"stages {list(t.stages)})", [ctx.global_rank(x) for x in t.stages],
                                 group=t.group)
            for g in grads:
                if g is not total:
                    g.copy_(total)


def _distinct(stage, uses: list[tuple[int, str]], model: str, tie: str) -> list:
    """This stage's distinct parameter objects of ``uses`` (layers shared in one process are one)."""
    seen, out = set(), []
    for i, path in uses:
        layer = stage.layers[i - stage.first_layer]
        try:
            p = layer.get_parameter(path)
        except AttributeError as e:
            raise ValueError(f"{model}: tie {tie!r} names parameter {path!r} of layer {i} "
                             f"({type(layer).__name__}), which has none: {e}") from None
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    shapes = {(tuple(p.shape), p.dtype) for p in out}
    if len(shapes) > 1:
        raise ValueError(f"{model}: tie {tie!r} joins parameters of different shapes or dtypes "
                         f"{sorted(map(str, shapes))}; a tie shares one tensor")
    return out
