"""A multi-task multi-modal model as a graph of components, and its tasks as paths through them.

A `Component` is one layered part of the model (a vision encoder, a second encoder such as audio, a
projector, the language backbone, a task head) with its own `ModelConfig`, which prices its layers per
token shape; ``inputs`` are the components whose outputs it consumes. A `Task` is the path its samples
take through the components (text-only: backbone -> LM head; image+text: ViT -> projector -> backbone ->
LM head; ...). `ComponentGraph` holds both and checks them when built: names unique and known, no
dependency cycle, each task's path in dependency order. Torch-free (planning core).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..cost.presets import ModelConfig

#: `Component.kind` values.
COMPONENT_KINDS = ("encoder", "projector", "backbone", "head")
#: `Component.tokens` values: which of a sample's token counts drive a component's work. ``merged`` is
#: the backbone's sequence: text tokens plus the vision and audio tokens of the sample; ``encoded``: vision plus audio
#: tokens (a projector shared by the encoders). Counts are in backbone tokens (what an encoder emits).
TOKEN_KINDS = ("text", "vision", "audio", "merged", "encoded")


@dataclass(frozen=True)
class Component:
    """One part of a multi-task model, itself a layered model with its own cost model.

    ``layers``: its layer count (a pipeline inside the component cuts these). ``model``: prices those layers
    per token shape (`dynabatch.core.cost.CostModel.analytic`; a ``decoder``-kind config whose ``layers``
    equals ``layers``). ``inputs``: the components whose outputs it consumes (dependency edges). ``tokens``:
    which token count of a sample drives its work (`TOKEN_KINDS`; counts are in backbone tokens). ``token_ratio``:
    backbone tokens it emits per token it reads: an encoder with ``token_ratio=0.25`` (a ViT whose 2 x 2 pixel
    shuffle turns 16 patches into 4 tokens) reads 4 patches per backbone token of the sample. ``seq_len``: > 0
    when the tokens it reads are attended in independent sequences of this many (a ViT's tiles: patches per
    tile); 0 when a sample's tokens form one sequence. Its output (``model.hidden`` wide) per emitted token is
    the activation it sends on.
    """

    name: str
    kind: str
    layers: int
    model: ModelConfig
    inputs: tuple[str, ...] = ()
    tokens: str = "text"
    seq_len: int = 0
    token_ratio: float = 1.0

    def __post_init__(self) -> None:
        where = f"Component {self.name!r}"
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"a Component needs a non-empty name, got {self.name!r}")
        if self.kind not in COMPONENT_KINDS:
            raise ValueError(f"{where}: kind {self.kind!r} is not one of {COMPONENT_KINDS}")
        if self.tokens not in TOKEN_KINDS:
            raise ValueError(f"{where}: tokens {self.tokens!r} is not one of {TOKEN_KINDS}")
        if int(self.layers) < 1:
            raise ValueError(f"{where}: layers must be >= 1, got {self.layers}")
        if not isinstance(self.model, ModelConfig):
            raise TypeError(f"{where}: model must be a dynabatch.core.cost.ModelConfig, got {type(self.model).__name__}")
        if self.model.kind != "decoder" or float(self.model.layers) != float(self.layers):
            raise ValueError(f"{where}: model must be a decoder-kind ModelConfig of its {self.layers} layers, got kind "
                             f"{self.model.kind!r} with {self.model.layers} layers (split a vision_language config "
                             f"with dynabatch.core.multitask.vision_language_graph)")
        if self.seq_len < 0 or self.token_ratio <= 0:
            raise ValueError(f"{where}: seq_len must be >= 0 and token_ratio > 0, got {self.seq_len}, {self.token_ratio}")
        if self.name in self.inputs:
            raise ValueError(f"{where} lists itself among its inputs")
        object.__setattr__(self, "inputs", tuple(self.inputs))

    @property
    def param_count(self) -> float:
        """Parameters of the whole component (all its layers)."""
        return float(self.model.params_per_stage)

    @property
    def out_bytes_per_token(self) -> float:
        """Bytes of the activation it sends on per backbone token of a sample (hidden width x dtype)."""
        return float(self.model.hidden * self.model.dtype_bytes)


@dataclass(frozen=True)
class Task:
    """A task: the path its samples take through the components, in dependency order."""

    name: str
    path: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"a Task needs a non-empty name, got {self.name!r}")
        object.__setattr__(self, "path", tuple(self.path))
        if not self.path:
            raise ValueError(f"Task {self.name!r} has an empty path")
        if len(set(self.path)) != len(self.path):
            raise ValueError(f"Task {self.name!r} visits a component twice: {self.path}")


@dataclass(frozen=True)
class ComponentGraph:
    """Components (dependency edges from `Component.inputs`) and the tasks that flow through them.

    Checked when built: unique component and task names, every input and path entry a known component, no
    cycle, and each task's path in dependency order with every non-first entry fed by an earlier one."""

    components: tuple[Component, ...]
    tasks: tuple[Task, ...]
    _index: dict = field(default=None, init=False, repr=False, compare=False)
    _order: tuple = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "components", tuple(self.components))
        object.__setattr__(self, "tasks", tuple(self.tasks))
        index = {}
        for c in self.components:
            if c.name in index:
                raise ValueError(f"ComponentGraph: two components are named {c.name!r}")
            index[c.name] = c
        object.__setattr__(self, "_index", index)
        for c in self.components:
            for i in c.inputs:
                if i not in index:
                    raise ValueError(f"ComponentGraph: component {c.name!r} reads {i!r}, which is not a component "
                                     f"(components: {', '.join(index)})")
        object.__setattr__(self, "_order", self._topological())
        names = set()
        for t in self.tasks:
            if t.name in names:
                raise ValueError(f"ComponentGraph: two tasks are named {t.name!r}")
            names.add(t.name)
            self._check_path(t)

    def _topological(self) -> tuple[str, ...]:
        # Kahn's algorithm; ties in declaration order so the order is deterministic.
        pending = {c.name: len(set(c.inputs)) for c in self.components}
        order: list[str] = []
        ready = [c.name for c in self.components if pending[c.name] == 0]
        while ready:
            n = ready.pop(0)
            order.append(n)
            for c in self.components:
                if n in c.inputs:
                    pending[c.name] -= 1
                    if pending[c.name] == 0:
                        ready.append(c.name)
        if len(order) != len(self.components):
            stuck = [c.name for c in self.components if c.name not in order]
            raise ValueError(f"ComponentGraph: the inputs of {', '.join(stuck)} form a cycle")
        return tuple(order)

    def _check_path(self, t: Task) -> None:
        pos = {n: i for i, n in enumerate(self._order)}
        for n in t.path:
            if n not in self._index:
                raise ValueError(f"Task {t.name!r}: path entry {n!r} is not a component "
                                 f"(components: {', '.join(self._index)})")
        ranks = [pos[n] for n in t.path]
        if ranks != sorted(ranks) or any(a in self._index[b].inputs for i, b in enumerate(t.path)
                                         for a in t.path[i + 1:]):
            raise ValueError(f"Task {t.name!r}: path {t.path} is not in dependency order (a topological order: "
                             f"{self._order})")
        for i, n in enumerate(t.path[1:], 1):
            if not set(self._index[n].inputs) & set(t.path[:i]):
                raise ValueError(f"Task {t.name!r}: {n!r} reads {self._index[n].inputs or 'nothing'}, none of "
                                 f"which is earlier on the path {t.path}")

    def component(self, name: str) -> Component:
        """The component called ``name`` (KeyError naming the graph's components otherwise)."""
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"no component {name!r} in this graph (components: {', '.join(self._index)})") from None

    def task(self, name: str) -> Task:
        """The task called ``name`` (KeyError naming the graph's tasks otherwise)."""
        for t in self.tasks:
            if t.name == name:
                return t
        raise KeyError(f"no task {name!r} in this graph (tasks: {', '.join(self.task_names)})")

    def check_tasks(self, tasks, what: str = "sample") -> None:
        """ValueError naming the first entry of ``tasks`` (one per ``what``: sample, micro-batch) that is not a
        task of this graph, and the graph's tasks."""
        known = set(self.task_names)
        for i, t in enumerate(tasks):
            if t not in known:
                raise ValueError(f"{what} {i} has task {t!r}, which is not a task of the graph "
                                 f"(tasks: {', '.join(self.task_names)})")

    @property
    def task_names(self) -> tuple[str, ...]:
        """The tasks' names, in declaration order."""
        return tuple(t.name for t in self.tasks)

    @property
    def names(self) -> tuple[str, ...]:
        """The components' names, in declaration order."""
        return tuple(c.name for c in self.components)

    def order(self) -> tuple[str, ...]:
        """A topological order of the components (inputs first; ties in declaration order)."""
        return self._order

    def reaches(self, task: str) -> tuple[str, ...]:
        """The components a sample of ``task`` runs through, in dependency order (its path)."""
        return self.task(task).path

    def tasks_through(self, component: str) -> tuple[str, ...]:
        """The tasks whose path holds ``component``."""
        self.component(component)
        return tuple(t.name for t in self.tasks if component in t.path)

    def consumers(self, component: str) -> tuple[str, ...]:
        """The components that read ``component``'s output, in topological order."""
        self.component(component)
        return tuple(n for n in self._order if component in self._index[n].inputs)
