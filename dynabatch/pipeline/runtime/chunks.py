"""Model chunks: a rank holding ``v`` non-contiguous pieces of the model, for interleaved schedules.

A model cut into ``v S`` chunks (``bounds`` with ``v S + 1`` layer offsets) is assigned round-robin, as
Megatron does: rank ``s`` holds chunks ``s, S + s, 2 S + s, ...`` (virtual stage ``q = c S + s`` is its
chunk ``c``). `ChunkedStage` is what the runner keeps as its stage (its parameters are every chunk's);
`with_chunks` gives the interpreter each chunk's hooks (`dynabatch.pipeline.runtime.interpreter.Hooks.at`).
With one chunk per rank everything stays as it was.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from ..models.partition import PipelineStage
from ..models.spec import MicroBatchShape, TensorSpec
from .hooks import OneModel


class ChunkedStage(nn.Module):
    """This rank's ``v`` chunks (`PipelineStage` s, chunk ``c`` = virtual stage ``c S + s``). ``is_first``:
    it holds the model's first layer (chunk 0 of rank 0); ``is_last``: its last (the last chunk of rank
    ``S - 1``); ``recompute``: each chunk recomputes up to that many of its recomputable layers."""

    def __init__(self, chunks: Sequence[PipelineStage]):
        super().__init__()
        if len(chunks) < 2:
            raise ValueError("a chunked stage holds two chunks at least")
        self.chunks = nn.ModuleList(chunks)
        self.is_first = chunks[0].is_first
        self.is_last = chunks[-1].is_last
        self.first_layer = chunks[0].first_layer
        self.last_layer = chunks[-1].last_layer
        self.num_model_layers = chunks[0].num_model_layers
        self.meter = None
        self._recompute = 0

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def recomputable_layers(self) -> int:
        """The most layers one chunk may recompute."""
        return max(c.recomputable_layers for c in self.chunks)

    @property
    def recompute(self) -> int:
        return self._recompute

    @recompute.setter
    def recompute(self, k: int) -> None:
        self._recompute = int(k)
        for c in self.chunks:
            c.recompute = min(int(k), c.recomputable_layers)


def chunked(stages: Sequence[PipelineStage], num_stages: int, stage: int) -> PipelineStage | ChunkedStage:
    """Rank ``stage``'s share of ``stages`` (a model cut into ``v * num_stages`` pieces, in model order):
    the piece itself when ``v == 1``, else a `ChunkedStage` of pieces ``stage, num_stages + stage, ...``."""
    if len(stages) % num_stages:
        raise ValueError(f"a cut into {len(stages)} pieces does not give every one of {num_stages} stages the same "
                         "number of chunks")
    mine = list(stages[stage::num_stages])
    return mine[0] if len(mine) == 1 else ChunkedStage(mine)


class _Chunk(OneModel):
    """One chunk's hooks: a micro-batch starts here only on the model's first layer."""

    def starts(self, v: int) -> bool:
        return self.stage.is_first


def with_chunks(hooks, stage, stage_index: int, boundary: Callable[[MicroBatchShape, int], Sequence[TensorSpec]],
                shapes: Sequence[MicroBatchShape], batches: Sequence[dict] | None, device: torch.device,
                step: int = 0):
    """``hooks`` (a one-model step's) made to run a `ChunkedStage`: its ``chunks`` and ``at(c)``, chunk
    ``c``'s own hooks (its module, boundary specs, dictionaries; a micro-batch starts only on the model's
    first layer); the step's hooks keep the rest (losses, gradients, updates, names). ``hooks`` itself for
    one chunk per stage."""
    if not isinstance(stage, ChunkedStage):
        return hooks
    if getattr(hooks, "bypass", None) is not None:
        raise ValueError("bypassed stages need one model chunk per stage (RunnerConfig(bypass_idle_stages=True) "
                         "does not combine with an interleaved cut)")
    entry = np.zeros(len(shapes), np.int64)
    mine = [_Chunk(c, stage_index, boundary, shapes, batches if (c.is_first or c.is_last) else None, entry, device,
                   None, step) for c in stage.chunks]

    def at(chunk: int) -> OneModel:
        if not 0 <= chunk < len(mine):
            raise ValueError(f"this rank holds {len(mine)} model chunks; the program runs chunk {chunk}")
        return mine[chunk]

    hooks.chunks, hooks.at = len(mine), at
    return hooks


def chunk_ties(model, cut: Sequence[int]):
    """The `Ties` of an interleaved cut (``cut``: layer offsets of the ``v S`` chunks): none when every tied
    parameter's uses lie in one chunk (one parameter object there, its gradients accumulate in place);
    ValueError when a tie spans chunks (summing copies across chunks and ranks is not supported)."""
    from .tied import Ties, tie_stages

    spans = tie_stages(model.tied_parameters(), cut, getattr(model, "name", "the model"))
    if spans:
        names = sorted(n for ns in spans.values() for n in ns)
        raise ValueError(f"tied parameters {names} span chunks {sorted(spans)} of the interleaved cut: an interleaved "
                         "schedule needs every tie inside one chunk (untie them, or cut so that each tie's uses share "
                         "a chunk)")
    return Ties([])
