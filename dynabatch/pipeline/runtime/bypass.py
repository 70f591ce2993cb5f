"""Stages a micro-batch bypasses: those that hold only its idle leading layers (Spindle's
heterogeneity-aware execution; with ``RunnerConfig(bypass_idle_stages=True)``).

A model says how many of its leading layers return without computing for a micro-batch of a shape
(`LayeredModel.idle_layers`: vlm-tiny's vision layers for a text-only micro-batch). The micro-batch's
*entry* stage is the one holding its first layer that computes; the stages before it run no op and
pass no message for it (`dynabatch.pipeline.runtime.schedule.build_programs` with ``entry``), and the entry
stage starts it from its dictionary (`LayeredModel.enter`, timed as that stage's forward). Every rank
derives the same entries from the plan's shapes and the model's cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..models.spec import MicroBatchShape


@dataclass(frozen=True)
class Bypass:
    """What a runner needs to bypass idle stages: the model's cut ``bounds`` (layer offsets, one more
    than the stages), its ``idle_layers(shape)`` and ``enter(batch, layer)``."""

    bounds: tuple[int, ...]
    idle_layers: Callable[[MicroBatchShape], int]
    enter: Callable[[dict, int], object]

    @classmethod
    def of(cls, model, bounds: Sequence[int]) -> "Bypass":
        """The bypass of ``model`` (a `LayeredModel`) cut at ``bounds``."""
        b = tuple(int(x) for x in bounds)
        if len(b) < 2 or b[0] != 0 or b[-1] != len(model.layers) or any(y <= x for x, y in zip(b, b[1:])):
            raise ValueError(f"bounds must rise strictly from 0 to {len(model.layers)} (the model's layers), got {list(b)}")
        return cls(b, model.idle_layers, model.enter)

    def entries(self, shapes: Sequence[MicroBatchShape]) -> np.ndarray:
        """int64 ``[M]``: the entry stage of each micro-batch (0 when its first layer computes)."""
        b = np.asarray(self.bounds, np.int64)
        idle = np.array([int(self.idle_layers(sh)) for sh in shapes], np.int64)
        if len(idle) and (idle.min() < 0 or idle.max() >= b[-1]):
            raise ValueError(f"idle_layers must be in 0..{b[-1] - 1} (the last layer always computes), got "
                             f"{idle.min()}..{idle.max()}")
        return np.searchsorted(b, idle, side="right") - 1


__all__ = ["Bypass"]
