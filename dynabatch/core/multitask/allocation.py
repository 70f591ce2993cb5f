"""Per-component device allocation: which ranks run each component, how deep a pipeline inside its group,
and in which wavefront (dependency-ordered wave) it runs.

`Placement` and `Allocation` are the records the planner (`plan_allocation`) returns and the torch.distributed
executor (`dynabatch.pipeline.multitask`) reads: component groups become process groups, waves run in order
(forward waves first to last, backward waves last to first), and `dynabatch.core.multitask.routing.route`
says which rank of a group runs which micro-batch. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Placement:
    """Where one component runs: ``ranks`` (global ranks of its device group; data parallel inside it),
    ``stages`` (pipeline depth inside the group; ``len(ranks) % stages == 0``, ranks ``[d * stages + s]`` are
    data-parallel replica ``d``'s stage ``s``) and ``wave`` (its wavefront index, dependency order)."""

    component: str
    ranks: tuple[int, ...]
    stages: int = 1
    wave: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if not self.ranks or len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
            raise ValueError(f"Placement {self.component!r}: ranks must be distinct ints >= 0, got {self.ranks}")
        if self.stages < 1 or len(self.ranks) % self.stages:
            raise ValueError(f"Placement {self.component!r}: {len(self.ranks)} ranks do not split into "
                             f"{self.stages} pipeline stages")
        if self.wave < 0:
            raise ValueError(f"Placement {self.component!r}: wave must be >= 0, got {self.wave}")

    @property
    def replicas(self) -> int:
        """Data-parallel replicas inside the group (``len(ranks) // stages``)."""
        return len(self.ranks) // self.stages

    def replica_ranks(self, replica: int) -> tuple[int, ...]:
        """The ranks of data-parallel replica ``replica``, stage 0 first."""
        s = self.stages
        return self.ranks[replica * s:(replica + 1) * s]


@dataclass(frozen=True)
class Allocation:
    """A planned step: one `Placement` per component, the components of each wave (``waves[w]``, dependency
    order: every input of a component sits in an earlier wave), the device count, the simulated step time
    (``step_seconds``, seconds) and each component's simulated busy seconds per device of its group
    (``component_seconds``). ``memory_bytes``: the simulated peak bytes of each device (empty when not
    computed); ``method``: the search that produced it."""

    placements: tuple[Placement, ...]
    waves: tuple[tuple[str, ...], ...]
    num_devices: int
    step_seconds: float
    component_seconds: Mapping[str, float]
    memory_bytes: tuple[float, ...] = ()
    method: str = ""
    _index: dict = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "placements", tuple(self.placements))
        object.__setattr__(self, "waves", tuple(tuple(w) for w in self.waves))
        object.__setattr__(self, "component_seconds", dict(self.component_seconds))
        object.__setattr__(self, "memory_bytes", tuple(float(b) for b in self.memory_bytes))
        index = {}
        for p in self.placements:
            if p.component in index:
                raise ValueError(f"Allocation: component {p.component!r} is placed twice")
            if max(p.ranks) >= self.num_devices:
                raise ValueError(f"Allocation: {p.component!r} uses rank {max(p.ranks)} of only "
                                 f"{self.num_devices} devices")
            index[p.component] = p
        object.__setattr__(self, "_index", index)
        for w, names in enumerate(self.waves):
            for n in names:
                if n not in index:
                    raise ValueError(f"Allocation: wave {w} names {n!r}, which has no placement")
                if index[n].wave != w:
                    raise ValueError(f"Allocation: {n!r} sits in wave {w} but its placement says {index[n].wave}")
        used = {}
        for p in self.placements:
            for r in p.ranks:
                other = used.setdefault((p.wave, r), p.component)
                if other != p.component:
                    raise ValueError(f"Allocation: rank {r} runs both {other!r} and {p.component!r} in wave {p.wave}")

    def placement(self, component: str) -> Placement:
        """The placement of ``component`` (KeyError naming the placed components otherwise)."""
        try:
            return self._index[component]
        except KeyError:
            raise KeyError(f"no placement for {component!r} (placed: {', '.join(self._index)})") from None

    def components_on(self, rank: int) -> tuple[str, ...]:
        """The components rank ``rank`` runs, in wave order."""
        return tuple(n for w in self.waves for n in w if rank in self._index[n].ranks)
