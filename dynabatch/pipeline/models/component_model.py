"""A model as named components (Spindle's component graph, `dynabatch.core.multitask.graph`) for the
multi-task executor (`dynabatch.pipeline.multitask`): `TaskShape`, a micro-batch's shape as every rank
knows it from the plan, and `ComponentModel`, the modules by component name plus what the executor needs
to know about them without running them (each component's output spec, each head's target count).

Component contract: ``module(inputs, batch)`` where ``inputs`` maps the names of the components it reads
*on this micro-batch's task path* to their output tensors (an encoder that reads the batch gets ``{}``),
and ``batch`` is the micro-batch dictionary (every rank holds the step's micro-batches: ids, masks, labels
and pixels are read where they are needed, only activations and their gradients cross between ranks).
A component with consumers on the path returns one tensor (its output, of exactly
``output_spec(name, shape)``); a terminal component (a task head) returns ``(loss_sum, target_count)``,
the **sum** of its token losses (the executor normalizes by the step's targets).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .spec import TensorSpec


@dataclass(frozen=True)
class TaskShape:
    """A micro-batch's shape for a component model: ``task`` (its task's name), ``rows``, ``input_len``
    (tokens per row of the backbone's sequence: text plus the modality tokens placed before it),
    ``text_len`` (columns of ``input_ids``), ``tiles`` (image tiles of the micro-batch) and
    ``audio_frames`` (padded audio frames per row; 0: no audio)."""

    task: str
    rows: int
    input_len: int
    text_len: int
    tiles: int = 0
    audio_frames: int = 0

    def __post_init__(self) -> None:
        if self.rows < 1 or self.input_len < 1 or self.text_len < 1 or min(self.tiles, self.audio_frames) < 0:
            raise ValueError(f"a micro-batch needs rows, input_len and text_len >= 1 and tiles, audio_frames >= 0, "
                             f"got {self}")


@dataclass
class ComponentModel:
    """Named component modules and what the executor knows of them from a micro-batch's shape alone.

    ``modules``: component name -> `torch.nn.Module` (the component contract in the module doc).
    ``output_spec(name, shape)``: the `TensorSpec` of component ``name``'s output on a micro-batch of
    `TaskShape` ``shape`` (what its consumers allocate to receive it); None for a terminal component.
    ``shape_of(batch, task)``: the `TaskShape` of a micro-batch dictionary. ``targets(name, batch)``: the
    target tokens (or rows) head ``name`` counts in ``batch``'s loss: the step's loss is normalized by
    their sum over the step, known before any forward. ``random_batch(path, rows, text_len, generator,
    tiles, audio_frames)``: a synthetic micro-batch for a task through the components ``path``.
    ``sample_tokens(batch)``: per row, its (text, vision, audio) tokens in backbone tokens (int lists), what
    `step_samples` gives the planner."""

    name: str
    modules: dict[str, nn.Module]
    output_spec: Callable[[str, TaskShape], TensorSpec | None]
    shape_of: Callable[[dict, str], TaskShape]
    targets: Callable[[str, dict], int]
    random_batch: Callable[..., dict] | None = None
    sample_tokens: Callable[[dict], tuple[list, list, list]] | None = None

    def component(self, name: str) -> nn.Module:
        """The module of component ``name`` (KeyError naming the model's components otherwise)."""
        try:
            return self.modules[name]
        except KeyError:
            raise KeyError(f"{self.name} has no component {name!r} (components: {', '.join(self.modules)})") from None

    def parameters(self, names=None):
        """The parameters of the components ``names`` (default: all), in component then module order."""
        for n in (self.modules if names is None else names):
            yield from self.component(n).parameters()

    def step_samples(self, batches, tasks):
        """The `dynabatch.core.multitask.workload.StepSamples` of a step's micro-batch dicts (``tasks[j]``: micro-batch
        j's task): each row a sample of its micro-batch's task with its `sample_tokens`; what
        `dynabatch.core.multitask.ComponentCosts.workload` and `plan_allocation` price."""
        from ...core.multitask.workload import StepSamples

        if self.sample_tokens is None:
            raise ValueError(f"{self.name} has no sample_tokens: build the StepSamples from the loader's shapes")
        if len(batches) != len(tasks):
            raise ValueError(f"{len(batches)} micro-batches but {len(tasks)} tasks")
        names, text, vision, audio, mb = [], [], [], [], []
        for j, (b, t) in enumerate(zip(batches, tasks)):
            tx, vi, au = self.sample_tokens(b)
            names += [t] * len(tx)
            text += list(tx)
            vision += list(vi)
            audio += list(au)
            mb += [j] * len(tx)
        return StepSamples(tuple(names), text, vision, audio, mb)

    def to(self, dtype: torch.dtype) -> "ComponentModel":
        """Cast every component to ``dtype`` (in place); returns self."""
        for m in self.modules.values():
            m.to(dtype)
        return self


__all__ = ["ComponentModel", "TaskShape"]
