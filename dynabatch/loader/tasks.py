"""Task-tagged data for multi-task training (Spindle, `dynabatch.core.multitask`): a `TaskMixture` is a
``loaders`` `Mixture` whose named sources are each one task of a component graph, mixed by weight; the
`DataLoader` reading it puts a ``tasks`` entry in every micro-batch dict (each sample's task, in
``sample_ids`` order), so the plan knows which components each sample reaches.

A sample's task follows from its ``sample_id`` alone: the mixture numbers each source's shards in a range of
its own (`Mixture.shard_ranges`; ``sample_id >> 32`` is the shard), so the tags are deterministic and the same
after a resume from `DataLoader.state_dict`, without any state of their own. `step_samples` turns a loader
`Step` into the planner's `dynabatch.core.multitask.StepSamples`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from loaders import Mixture

from ..core.multitask.graph import ComponentGraph
from ..core.multitask.workload import StepSamples


class TaskMixture(Mixture):
    """A `loaders.Mixture` of named sources, each tagged with a task of ``graph``.

    ``sources``: name -> ``loaders`` source; ``weights``, ``caps``, ``seed``: as `loaders.Mixture` (weighted,
    capped, resumable). ``tasks``: source name -> task name (a source not named there is the task of its own
    name). ``graph``: when given, every task must be one of its tasks (ValueError naming the source and the
    graph's tasks otherwise); `check` does the same later."""

    def __init__(self, sources: Mapping[str, object], weights: Mapping[str, float] | None = None, *,
                 tasks: Mapping[str, str] | None = None, graph: ComponentGraph | None = None,
                 caps: Mapping[str, int] | None = None, seed: int = 0):
        super().__init__(dict(sources), None if weights is None else dict(weights),
                         None if caps is None else dict(caps), seed=seed)
        tasks = dict(tasks or {})
        unknown = sorted(set(tasks) - set(self.names))
        if unknown:
            raise ValueError(f"TaskMixture: tasks names sources {unknown}, which are not sources of the mixture "
                             f"(sources: {', '.join(self.names)})")
        self.tasks: dict[str, str] = {n: tasks.get(n, n) for n in self.names}
        if graph is not None:
            self.check(graph)

    def check(self, graph: ComponentGraph) -> None:
        """ValueError when a source's task is not a task of ``graph`` (naming the source and the graph's tasks)."""
        for src, task in self.tasks.items():
            if task not in graph.task_names:
                raise ValueError(f"TaskMixture: source {src!r} is tagged with task {task!r}, which is not a task of "
                                 f"the graph (tasks: {', '.join(graph.task_names)}); name the source after one or "
                                 f"pass tasks={{{src!r}: <task>}}")

    def source_of(self, sample_id: int) -> str:
        """The name of the source ``sample_id`` came from (by its shard, `Mixture.shard_ranges`)."""
        shard = int(sample_id) >> 32
        for name, (lo, hi) in self.shard_ranges.items():
            if lo <= shard < hi:
                return name
        raise ValueError(f"sample id {int(sample_id)} (shard {shard}) is from none of this mixture's sources "
                         f"(shard ranges: {self.shard_ranges})")

    def tasks_of(self, sample_ids: Sequence[int]) -> tuple[str, ...]:
        """The task of each of ``sample_ids``."""
        return tuple(self.tasks[self.source_of(int(s))] for s in np.asarray(sample_ids).ravel())


def tag_tasks(source, batch: dict) -> dict:
    """``batch`` with ``batch["tasks"]`` (its samples' tasks, in ``sample_ids`` order) when ``source`` is a
    `TaskMixture`; ``batch`` unchanged otherwise (the `DataLoader` calls this on every micro-batch it yields)."""
    if isinstance(source, TaskMixture) and "sample_ids" in batch:
        batch["tasks"] = source.tasks_of(batch["sample_ids"].tolist())
    return batch


def step_samples(step, mixture: TaskMixture, graph: ComponentGraph, *, microbatch_tokens: int,
                 audio_tokens: Mapping[str, int] | None = None) -> StepSamples:
    """The planner's `StepSamples` of a loader `Step` (its whole plan, every rank's samples, from
    ``step.shapes``): each sample's task from ``mixture``, text tokens = input + target tokens, vision tokens from
    its shapes, audio tokens ``audio_tokens[task]`` per sample of that task (the loader's shapes hold no audio),
    re-packed per task into micro-batches of ``microbatch_tokens`` backbone tokens (`StepSamples.pack`)."""
    shapes = step.shapes
    if shapes is None:
        raise ValueError("step_samples needs the step's shapes (a DataLoader Step carries them as step.shapes)")
    mixture.check(graph)
    tasks = mixture.tasks_of(shapes.sample_id)
    audio = np.array([int((audio_tokens or {}).get(t, 0)) for t in tasks], np.int64)
    text = shapes.input_tokens.astype(np.int64) + shapes.target_tokens.astype(np.int64)
    return StepSamples.pack(graph, tasks, text, shapes.vision_tokens.astype(np.int64), audio,
                            microbatch_tokens=microbatch_tokens)
