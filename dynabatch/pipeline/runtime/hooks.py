"""The interpreter hooks of one model's stage (`OneModel`): a flushed step of `PipelineRunner`, and the
base of a flush-free stream's hooks (`dynabatch.pipeline.runtime.stream`)."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ..models.spec import MicroBatchShape, TensorSpec
from .interpreter import Feed, Hooks


class OneModel(Hooks):
    """One model's stage running micro-batches ``0..M-1`` (virtual micro-batch = micro-batch).

    ``stage``: this rank's `PipelineStage` (stage index ``stage_index``); ``boundary(shape, layer)``:
    the model's boundary specs; ``shapes``: the micro-batches' `MicroBatchShape` s; ``batches``: their
    dictionaries (None on stages that read none); ``entry[j]``: the stage micro-batch ``j`` starts on
    (bypass; 0 without); ``bypass``: the model's `Bypass` (None without); ``step``: the step index the
    monitor's texts name."""

    def __init__(self, stage, stage_index: int, boundary: Callable[[MicroBatchShape, int], Sequence[TensorSpec]],
                 shapes: Sequence[MicroBatchShape], batches: Sequence[dict] | None, entry: np.ndarray,
                 device: torch.device, bypass=None, step: int = 0):
        self.stage = stage
        self.s = stage_index
        self.spec_in = None if stage.is_first else [tuple(boundary(sh, stage.first_layer - 1)) for sh in shapes]
        self.spec_out = None if stage.is_last else [tuple(boundary(sh, stage.last_layer)) for sh in shapes]
        self.entry = entry
        self.feed = Feed(batches, device)
        self.bypass = bypass
        self.step = step

    def module(self, v: int):
        return self.stage

    def specs(self, v: int):
        return (None if self.spec_in is None else self.spec_in[v], None if self.spec_out is None else self.spec_out[v])

    def describe(self, v: int) -> str:
        return f"micro-batch {v} of step {self.step}"

    def starts(self, v: int) -> bool:
        return bool(self.entry[v] == self.s)

    def batch(self, v: int) -> dict | None:
        st = self.stage
        return self.feed.get(v) if st.is_first or st.is_last or self.starts(v) else None

    def release(self, v: int, forward: bool) -> None:
        self.feed.drop(v)

    def enter(self, v: int, batch: dict):
        return self.bypass.enter(batch, self.stage.first_layer)
