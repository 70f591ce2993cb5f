"""Per-component device allocation: which ranks run each component, how deep a pipeline inside its group,
and in which wavefront (dependency-ordered wave) it runs.

`Placement` and `Allocation` are the records the planner (`plan_allocation`) returns and the torch.distributed
executor (`dynabatch.pipeline.multitask`) reads: component groups become process groups, waves run in order
(forward waves first to last, backward waves last to first), and `dynabatch.core.multitask.routing.route`
says which rank of a group runs which micro-batch. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
import math
from dataclasses import dataclass, field

import numpy as np


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


# --------------------------------------------------------------------------- the planner

#: `plan_allocation` ``method`` values: the numba kernels or their plain-Python references (same result).
METHODS = ("kernel", "reference")


def _levels(graph) -> list[list[str]]:
    """Components by dependency level (longest path from a source), each level in topological order."""
    level: dict[str, int] = {}
    for n in graph.order():
        level[n] = 1 + max((level[i] for i in graph.component(n).inputs), default=-1)
    out: list[list[str]] = [[] for _ in range(max(level.values()) + 1)]
    for n in graph.order():
        out[level[n]].append(n)
    return out


def _set_partitions(items: list[str]) -> list[list[list[str]]]:
    """Every partition of ``items`` into blocks (blocks keep ``items``' order; the first block holds items[0])."""
    if not items:
        return [[]]
    head, rest = items[0], items[1:]
    out = []
    for part in _set_partitions(rest):
        out.append([[head], *part])
        for k in range(len(part)):
            out.append([*part[:k], [head, *part[k]], *part[k + 1:]])
    return out


@dataclass(frozen=True)
class ComponentOptions:
    """The ways one component can run this step: ``n`` devices, ``s`` pipeline stages inside them, the
    simulated ``seconds`` (the heaviest replica's, with its input transfers and gradient all-reduce) and the
    peak ``bytes`` per device (model state + the activations its heaviest replica keeps for backward)."""

    component: str
    n: tuple[int, ...]
    s: tuple[int, ...]
    seconds: tuple[float, ...]
    bytes: tuple[float, ...]


def component_inputs(costs, workload, name: str, allreduce_bandwidth: float | None = None) -> dict:
    """The arrays `dynabatch.core.kernels.allocation.options_kernel` takes for component ``name`` (see there):
    a micro-batch that does not reach it has time -1; transfers priced by the device's link
    (``allreduce_bandwidth``, bytes/s: the gradient all-reduce's per-device bandwidth; default the link's)."""
    graph, dev = costs.graph, costs.device
    r = workload.row(name)
    comp = graph.component(name)
    cm = costs.models[name]
    reach = workload.reaches[r] & (workload.time_s[r] > 0)
    t = np.where(reach, workload.time_s[r], -1.0)
    p2p = np.where(reach, cm.transfer_time(workload.features[r][:, 0]), 0.0)
    rx = np.zeros(workload.num_microbatches)
    for i in comp.inputs:
        ri = workload.row(i)
        sent = workload.send_bytes[ri] * workload.reaches[ri]
        # activations in, their gradients back out: twice the bytes over the link
        rx += np.where(reach & (sent > 0), 2.0 * (sent / dev.p2p_bandwidth + dev.p2p_latency_s), 0.0)
    bw = float(allreduce_bandwidth) if allreduce_bandwidth else float(dev.p2p_bandwidth)
    return dict(t=np.ascontiguousarray(t), mem=np.ascontiguousarray(workload.memory_bytes[r], np.float64),
                p2p=np.ascontiguousarray(p2p), recv=np.ascontiguousarray(rx), ovh=float(dev.overhead_s),
                ff=float(cm.forward_fraction), layers=int(comp.layers),
                grad_bytes=float(workload.params[r] * workload.dtype_bytes[r]), ar_bw=bw,
                ar_lat=float(dev.p2p_latency_s))


def component_options(costs, workload, name: str, num_devices: int, memory_limit: float, *,
                      allreduce_bandwidth: float | None = None, method: str = "kernel") -> ComponentOptions:
    """`ComponentOptions` of component ``name`` on 1..``num_devices`` devices within ``memory_limit`` bytes per
    device (`options_kernel`, or its reference with ``method="reference"``)."""
    from ..kernels.allocation import options_kernel, options_reference

    a = component_inputs(costs, workload, name, allreduce_bandwidth)
    N = int(num_devices)
    state = costs.state_table(name, N)
    fn = options_kernel if method == "kernel" else options_reference
    n, s, t, m = fn(a["t"], a["mem"], a["p2p"], a["recv"], a["ovh"], a["ff"], a["layers"], N, state,
                    a["grad_bytes"], a["ar_bw"], a["ar_lat"], float(memory_limit))
    return ComponentOptions(name, tuple(int(x) for x in n), tuple(int(x) for x in s), tuple(float(x) for x in t),
                            tuple(float(x) for x in m))


def plan_allocation(costs, workload, num_devices: int, *, memory_limit: float | None = None,
                    allreduce_bandwidth: float | None = None, method: str = "kernel") -> Allocation:
    """The allocation of minimal simulated step time: every component gets a device count and a pipeline
    depth inside them (`component_options`), components run in waves (each dependency level of the graph
    either as one wave, its components side by side on disjoint devices, or split into consecutive waves;
    every partition of a level is tried), a wave lasts as long as its slowest component (forward+backward),
    and the step is the sum of its waves. ``costs``: the `dynabatch.core.multitask.workload.ComponentCosts`
    that priced ``workload``. Memory: a device holds one component per wave, and the search keeps the sum over
    waves of each wave's largest per-device bytes within ``memory_limit`` (default: the device's usable
    memory), which the placement (each wave's components from rank 0, largest first) meets on every device.
    Exact over this space: per-wave Pareto frontiers of (seconds, bytes) summed wave by wave. ValueError when
    no allocation fits."""
    from ..kernels import allocation as K

    if method not in METHODS:
        raise ValueError(f"method={method!r}: expected one of {METHODS}")
    ref = method == "reference"
    graph, dev = costs.graph, costs.device
    N = int(num_devices)
    if N < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    limit = float(memory_limit) if memory_limit is not None else dev.memory_bytes * dev.usable_memory_fraction
    opts = {n: component_options(costs, workload, n, N, limit, allreduce_bandwidth=allreduce_bandwidth,
                                 method=method) for n in graph.order()}
    for name, o in opts.items():
        if not o.n:
            raise ValueError(f"component {name!r} fits on none of 1..{N} devices within {limit / 2 ** 30:.1f} GiB "
                             f"per device at any pipeline depth <= its {graph.component(name).layers} layers; "
                             f"use more devices, a larger memory_limit or smaller micro-batches")
    frontier = K.block_frontier_reference if ref else K.block_frontier_kernel
    psum = K.pareto_sum_reference if ref else K.pareto_sum_kernel

    levels = []  # per level: its frontier (seconds, bytes) and per point the waves it runs as
    for level in _levels(graph):
        lt, lm, lw = [], [], []
        for part in _set_partitions(level):
            pt, pm, pw = np.zeros(1), np.zeros(1), [[]]
            for block in part:
                flat_n = np.concatenate([np.array(opts[c].n, np.int64) for c in block])
                flat_t = np.concatenate([np.array(opts[c].seconds) for c in block])
                flat_m = np.concatenate([np.array(opts[c].bytes) for c in block])
                starts = np.cumsum([0] + [len(opts[c].n) for c in block]).astype(np.int64)
                bt, bm, bc = frontier(flat_n, flat_t, flat_m, starts, N)
                if len(bt) == 0:
                    pt = np.zeros(0)
                    break
                st, sm, ia, ib = psum(pt, pm, np.asarray(bt), np.asarray(bm), limit)
                pw = [pw[a] + [(tuple(block), tuple(int(bc[b][k] - starts[k]) for k in range(len(block))))]
                      for a, b in zip(ia.tolist(), ib.tolist())]
                pt, pm = st, sm
            lt.extend(np.asarray(pt).tolist())
            lm.extend(np.asarray(pm).tolist())
            lw.extend(pw[:len(pt)])
        levels.append((np.array(lt), np.array(lm), lw))
    # the levels' frontiers summed in order (running frontier: seconds, bytes, the waves of each point); a
    # point is dropped once its bytes leave no room for the least bytes each later level needs (exact)
    need = [float(m.min()) if len(m) else math.inf for _, m, _ in levels]
    run_t, run_m, run_w = np.zeros(1), np.zeros(1), [[]]
    for k, (lt, lm, lw) in enumerate(levels[:-1]):
        room = limit - sum(need[k + 1:])
        st, sm, ia, ib = psum(run_t, run_m, lt, lm, room) if room >= 0 else (np.zeros(0),) * 4
        run_w = [run_w[a] + lw[b] for a, b in zip(np.asarray(ia).tolist(), np.asarray(ib).tolist())]
        run_t, run_m = st, sm
        if len(run_t) == 0:
            break
    lt, lm, lw = levels[-1]
    a, b = (K.min_sum_reference if ref else K.min_sum_kernel)(run_t, run_m, lt, lm, limit)
    if a < 0:
        raise ValueError(f"no allocation of the components on {N} devices keeps every device within "
                         f"{limit / 2 ** 30:.1f} GiB (each device holds one component per wave); use more "
                         f"devices, a larger memory_limit or smaller micro-batches")
    return _placed(run_w[a] + lw[b], opts, N, float(run_t[a] + lt[b]), method)


def _placed(waves, opts, N: int, step_s: float, method: str) -> Allocation:
    """Placements of the chosen waves: in each wave the components from rank 0 on, most bytes first."""
    placements, names, secs = [], [], {}
    mem = np.zeros(N)
    for w, (block, choice) in enumerate(waves):
        order = sorted(range(len(block)), key=lambda k: (-opts[block[k]].bytes[choice[k]], k))
        at = 0
        wave_mem = np.zeros(N)
        for k in order:
            o, i = opts[block[k]], choice[k]
            placements.append(Placement(block[k], tuple(range(at, at + o.n[i])), o.s[i], w))
            wave_mem[at:at + o.n[i]] = o.bytes[i]
            secs[block[k]] = o.seconds[i]
            at += o.n[i]
        mem += wave_mem
        names.append(tuple(block[k] for k in sorted(range(len(block)))))
    return Allocation(tuple(placements), tuple(names), N, step_s, secs, tuple(mem.tolist()), method)
