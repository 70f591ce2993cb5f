"""Per-component device allocation: which ranks run each component, how deep a pipeline inside its group,
and in which wavefront (dependency-ordered wave) it runs.

`Placement` and `Allocation` are the records the planner (`plan_allocation`) returns and the torch.distributed
executor (`dynabatch.pipeline.multitask`) reads: component groups become process groups, and
`dynabatch.core.multitask.routing.route` says which rank of a group runs which micro-batch. The executor
has no barrier between waves: each rank runs its forward items in (wave, topological, micro-batch) order,
then its backward items in the reverse order, each as soon as its inputs arrive, so a consumer group works
on micro-batch k while its producer computes k + 1. `simulate_stream` (`StreamModel`) simulates exactly that
and scores the planner's candidates. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
import math
from dataclasses import dataclass, field

import numpy as np

from ..kernels.cost import FEATURES

_N_MAIN, _ONE = FEATURES.index("n_main"), FEATURES.index("one")

@dataclass(frozen=True)
class Placement:
    """Where one component runs: ``ranks`` (global ranks of its device group; data parallel inside it),
    ``stages`` (pipeline depth inside the group; ``len(ranks) % stages == 0``, ranks ``[d * stages + s]`` are
    data-parallel replica ``d``'s stage ``s``), ``wave`` (its wavefront index, dependency order) and
    ``pieces``: each micro-batch reaching the component is split into up to this many pieces of whole
    sequences (a component attending independent sequences, `Component.seq_len` > 0: a ViT's tiles), each
    piece balanced over the replicas like a micro-batch (1: whole micro-batches; more is simulated only, the
    executor and `route` run whole micro-batches)."""

    component: str
    ranks: tuple[int, ...]
    stages: int = 1
    wave: int = 0
    pieces: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if not self.ranks or len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
            raise ValueError(f"Placement {self.component!r}: ranks must be distinct ints >= 0, got {self.ranks}")
        if self.stages < 1 or len(self.ranks) % self.stages:
            raise ValueError(f"Placement {self.component!r}: {len(self.ranks)} ranks do not split into "
                             f"{self.stages} pipeline stages")
        if self.wave < 0:
            raise ValueError(f"Placement {self.component!r}: wave must be >= 0, got {self.wave}")
        if self.pieces < 1:
            raise ValueError(f"Placement {self.component!r}: pieces must be >= 1, got {self.pieces}")

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
    (``component_seconds``: `plan_allocation`'s default model gives the most compute seconds one device of
    the group spends on it; ``model="waves"`` its wave time, receives and all-reduce included).
    ``memory_bytes``: the simulated peak bytes of each device (empty when not computed); ``method``: the
    search that produced it."""

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


def _level_frontier(level, opts, N: int, limit: float, frontier, psum):
    """One dependency level on ``N`` devices: its frontier (seconds, bytes) and per point the waves it runs as
    (every partition of the level into consecutive waves; a wave's components side by side)."""
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
    return np.array(lt), np.array(lm), lw


def _best_waves(levels, limit: float, psum, min_sum):
    """The least summed seconds over the levels' frontiers (run one after another on the same devices, bytes
    summed within ``limit``): (seconds, waves) or None when nothing fits. A running point is dropped once its
    bytes leave no room for the least bytes each later level needs (exact)."""
    need = [float(m.min()) if len(m) else math.inf for _, m, _ in levels]
    run_t, run_m, run_w = np.zeros(1), np.zeros(1), [[]]
    for k, (lt, lm, lw) in enumerate(levels[:-1]):
        room = limit - sum(need[k + 1:])
        st, sm, ia, ib = psum(run_t, run_m, lt, lm, room) if room >= 0 else (np.zeros(0),) * 4
        run_w = [run_w[a] + lw[b] for a, b in zip(np.asarray(ia).tolist(), np.asarray(ib).tolist())]
        run_t, run_m = st, sm
        if len(run_t) == 0:
            return None
    lt, lm, lw = levels[-1]
    if len(lt) == 0:
        return None
    a, b = min_sum(run_t, run_m, lt, lm, limit)
    if a < 0:
        return None
    return float(run_t[a] + lt[b]), run_w[a] + lw[b]


#: `plan_allocation` ``model`` values: ``stream`` (what the executor does: micro-batches stream between
#: component groups) or ``waves`` (a barrier after every wave; the step is the sum of the waves).
MODELS = ("stream", "waves")


def plan_allocation(costs, workload, num_devices: int, *, memory_limit: float | None = None,
                    allreduce_bandwidth: float | None = None, method: str = "kernel",
                    model: str = "stream", split_sequences: bool = False) -> Allocation:
    """The allocation of least simulated step time: every component gets a device count and a pipeline
    depth inside them (`component_options`) and a wave (dependency order: its inputs in earlier waves).
    ``costs``: the `dynabatch.core.multitask.workload.ComponentCosts` that priced ``workload``.

    The space searched: the graph's dependency levels, in order, cut into at most two consecutive segments,
    each on its own block of devices (the first segment on ranks ``0 .. N_A - 1``, the second on the rest;
    one segment: every device). Inside a block each level is one wave with its components side by side on
    disjoint devices, or split into consecutive waves (every partition of the level is tried), the waves
    stacked on the block's devices (each wave's components from the block's first rank, largest bytes first:
    a device holds one component per wave). Each block's options are chosen exactly for the block's sum of
    wave times (per-wave Pareto frontiers of (seconds, bytes): a wave lasts as long as its slowest component,
    bytes summed over the waves a device holds within ``memory_limit``, default the device's usable memory).

    ``model="stream"`` (default) scores every candidate (one block; two blocks at each cut, ``N_A`` searched
    from the blocks' share of the work) by `simulate_stream`, the executor's own order: micro-batches flow
    from a producer group to its consumer groups as each is done, so blocks (and the groups of one block's
    waves on different devices) work at once; ``step_seconds``, ``component_seconds`` and ``memory_bytes``
    are that simulation's; the fastest candidate's waves may then each be mirrored inside their block (replica
    0 on the block's last devices, so the heaviest replicas of two waves need not share devices and hold up
    a group's all-reduce, which waits for all its ranks). ``split_sequences`` (stream model only; simulated:
    the executor runs whole micro-batches) then lets each component that attends independent sequences (a
    ViT's tiles) split every micro-batch into pieces of whole sequences over its replicas, the piece count
    chosen for its group (powers of two up to its replica count, and the count itself; kept where the
    streamed step gets shorter within the memory limit): a micro-batch of one many-tile image no longer
    waits for one replica to encode all its tiles. ``model="waves"``: one block, and a barrier after every
    wave (the step is the sum of its waves, each its slowest component's seconds); exact over its space.
    ValueError when no allocation fits."""
    from ..kernels import allocation as K

    if method not in METHODS:
        raise ValueError(f"method={method!r}: expected one of {METHODS}")
    if model not in MODELS:
        raise ValueError(f"model={model!r}: expected one of {MODELS}")
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
    min_sum = K.min_sum_reference if ref else K.min_sum_kernel
    levels = [tuple(level) for level in _levels(graph)]
    fronts: dict = {}

    def block(lo: int, hi: int, n: int):
        """The best waves of levels ``lo..hi-1`` on ``n`` devices (cached): (seconds, waves) or None."""
        for lv in levels[lo:hi]:
            if (lv, n) not in fronts:
                fronts[(lv, n)] = _level_frontier(list(lv), opts, n, limit, frontier, psum)
        return _best_waves([fronts[(lv, n)] for lv in levels[lo:hi]], limit, psum, min_sum)

    whole = block(0, len(levels), N)
    if model == "waves":
        if whole is None:
            raise ValueError(_no_fit(N, limit))
        return _placed([(0, N, whole[1])], opts, N, whole[0], method)
    sim = StreamModel(costs, workload, allreduce_bandwidth)
    best = None  # (seconds, allocation)

    def consider(blocks, mirror=()):
        nonlocal best
        alloc = _placed(blocks, opts, N, 0.0, method, mirror)
        step, busy, mem = sim.run(alloc, method)
        if max(mem) > limit * (1 + 1e-12):  # cannot happen: each block's waves sum their peaks
            raise RuntimeError(f"allocation search: a placement exceeds {limit:.4g} bytes per device ({max(mem):.4g})")
        if best is None or step < best[0]:
            best = (step, Allocation(alloc.placements, alloc.waves, N, step, busy, mem, method), blocks, mirror)
        return step

    if whole is not None:
        consider([(0, N, whole[1])])
    work = workload.time_s.sum(axis=1)
    level_work = [sum(float(work[workload.row(c)]) for c in lv) for lv in levels]
    for cut in range(1, len(levels)):
        seen: dict[int, float] = {}

        def score(na: int) -> float:
            if na not in seen:
                a, b = block(0, cut, na), block(cut, len(levels), N - na)
                seen[na] = math.inf if a is None or b is None else consider([(0, na, a[1]), (na, N - na, b[1])])
            return seen[na]

        if N < 2:
            break
        share = sum(level_work[:cut]) / max(sum(level_work), 1e-300)
        na = min(N - 1, max(1, int(round(share * N))))
        # descend on N_A from the work's share, one device at a time, both ways
        while True:
            here = score(na)
            moves = [m for m in (na - 1, na + 1) if 1 <= m <= N - 1]
            nxt = min(moves, key=score, default=na)
            if score(nxt) >= here:
                break
            na = nxt
    if best is None:
        raise ValueError(_no_fit(N, limit))
    # each wave's ranks from the block's first or from its last device: the longest-first balance gives every
    # group's replica 0 its heaviest micro-batches, and a group's all-reduce waits for all its ranks, so
    # mirroring a wave can keep the heaviest replicas of two waves off the same devices
    blocks = best[2]
    W = sum(len(b[2]) for b in blocks)
    if W <= 4:
        for mask in range(1, 2 ** W):
            consider(blocks, tuple(w for w in range(W) if mask >> w & 1))
    else:
        for _ in range(2):
            for w in range(W):
                consider(blocks, tuple(sorted(set(best[3]) ^ {w})))
    alloc = best[1]
    if split_sequences:
        for name in graph.order():
            reps = alloc.placement(name).replicas
            if not sim.splittable(name) or reps < 2:
                continue
            for pieces in sorted({2 ** e for e in range(1, reps.bit_length()) if 2 ** e <= reps} | {reps}):
                cand = _with_pieces(alloc, name, pieces)
                step, busy, mem = sim.run(cand, method)
                if step < alloc.step_seconds and max(mem) <= limit * (1 + 1e-12):
                    alloc = Allocation(cand.placements, cand.waves, N, step, busy, mem, method)
    return alloc


def _with_pieces(alloc: Allocation, name: str, pieces: int) -> Allocation:
    """``alloc`` with component ``name`` splitting its micro-batches into up to ``pieces`` pieces."""
    import dataclasses

    placements = tuple(dataclasses.replace(p, pieces=pieces) if p.component == name else p for p in alloc.placements)
    return Allocation(placements, alloc.waves, alloc.num_devices, alloc.step_seconds, alloc.component_seconds,
                      alloc.memory_bytes, alloc.method)


def _no_fit(N: int, limit: float) -> str:
    return (f"no allocation of the components on {N} devices keeps every device within {limit / 2 ** 30:.1f} GiB "
            f"(each device holds one component per wave); use more devices, a larger memory_limit or smaller "
            f"micro-batches")


class StreamModel:
    """`simulate_stream`'s inputs that do not depend on the allocation, for one step's ``workload`` priced by
    ``costs`` (per-component arrays in topological order, built once; `run` simulates an `Allocation`)."""

    def __init__(self, costs, workload, allreduce_bandwidth: float | None = None):
        graph, dev = costs.graph, costs.device
        self.costs, self.workload = costs, workload
        self.names = graph.order()
        self.topo = {n: i for i, n in enumerate(self.names)}
        ins = [component_inputs(costs, workload, n, allreduce_bandwidth) for n in self.names]
        self.t = np.array([a["t"] for a in ins])
        self.mem = np.array([a["mem"] for a in ins])
        self.p2p = np.array([a["p2p"] for a in ins])
        rows = [workload.row(n) for n in self.names]
        sent = workload.send_bytes[rows] * workload.reaches[rows]
        # a micro-batch's output to a consumer on another rank (its gradient comes back the same size)
        self.xfer = np.where(sent > 0, sent / dev.p2p_bandwidth + dev.p2p_latency_s, 0.0)
        self.prod = np.array([[p in graph.component(n).inputs for p in self.names] for n in self.names], np.bool_)
        self.ff = np.array([a["ff"] for a in ins])
        self.grad = np.array([a["grad_bytes"] / a["ar_bw"] for a in ins])
        self.active = (self.t >= 0).any(axis=1)
        self.ar_lat, self.ovh = float(dev.p2p_latency_s), float(dev.overhead_s)
        self._pieces: dict = {}  # (component row, pieces) -> per micro-batch its pieces' arrays
        self._columns: dict = {}  # pieces per component (topological order) -> the expanded arrays

    def splittable(self, name: str) -> bool:
        """Whether component ``name`` attends independent sequences (`Component.seq_len` > 0), so that a
        micro-batch's sequences can be split into pieces over its replicas."""
        return self.costs.graph.component(name).seq_len > 0

    def _split(self, k: int, pieces: int):
        """Component row ``k``'s micro-batches each in up to ``pieces`` pieces of whole sequences (sizes as even
        as can be, larger first; a micro-batch of fewer sequences gives one piece each), priced by its cost model
        on the pieces' features (the sequences' share of the micro-batch's, one launch each): (pieces per
        micro-batch [M], 0 where it stays whole; then the pieces' seconds, bytes, stage transfer seconds and
        output transfer seconds, one after another in micro-batch order)."""
        key = (k, pieces)
        if key not in self._pieces:
            name, w, dev = self.names[k], self.workload, self.costs.device
            comp, cm, r = self.costs.graph.component(name), self.costs.models[name], w.row(name)
            phi = w.features[r]
            seqs = np.rint(phi[:, _N_MAIN] / comp.seq_len).astype(np.int64)
            m = np.where((self.t[k] >= 0) & (seqs > 1), np.minimum(pieces, seqs), 0)
            j = np.repeat(np.arange(len(m)), m)                       # each piece's micro-batch
            at = np.arange(len(j)) - np.repeat(np.cumsum(m) - m, m)   # its index among the micro-batch's pieces
            size = seqs[j] // m[j] + (at < seqs[j] % m[j])
            frac = size / seqs[j]
            f = phi[j] * frac[:, None]
            f[:, _ONE] = 1.0
            sent = w.send_bytes[r, j] * frac
            self._pieces[key] = (m, cm.time(f), cm.memory(f), cm.transfer_time(f[:, 0]),
                                 np.where(sent > 0, sent / dev.p2p_bandwidth + dev.p2p_latency_s, 0.0))
        return self._pieces[key]

    def columns(self, pieces: tuple[int, ...]):
        """The kernel's per-column arrays (t, mem, p2p, xfer, parent) when component ``k`` (topological order)
        splits each micro-batch into up to ``pieces[k]`` pieces: micro-batch ``j``'s columns side by side, as
        many as its most pieces; a component that does not split it runs it whole in its first column."""
        pieces = tuple(int(x) for x in pieces)
        if all(x == 1 for x in pieces):
            return self.t, self.mem, self.p2p, self.xfer, np.arange(self.t.shape[1], dtype=np.int64)
        if pieces not in self._columns:
            C, M = self.t.shape
            split = {k: self._split(k, x) for k, x in enumerate(pieces) if x > 1}
            width = np.ones(M, np.int64)
            for m, *_ in split.values():
                width = np.maximum(width, m)
            U = int(width.sum())
            first = np.cumsum(width) - width
            out = [np.full((C, U), -1.0), np.zeros((C, U)), np.zeros((C, U)), np.zeros((C, U))]
            for a, whole in zip(out, (self.t, self.mem, self.p2p, self.xfer)):
                a[:, first] = whole
            for k, (m, *parts) in split.items():
                cols = np.repeat(first, m) + np.arange(int(m.sum())) - np.repeat(np.cumsum(m) - m, m)
                for a, part in zip(out, parts):
                    a[k, cols] = part  # piece 0 in the micro-batch's first column, over its whole value
            self._columns[pieces] = (*out, np.repeat(np.arange(M, dtype=np.int64), width))
        return self._columns[pieces]

    def run(self, allocation: "Allocation", method: str = "kernel"):
        """(step seconds, component -> busy seconds, bytes per device) of ``allocation``
        (`dynabatch.core.kernels.allocation_stream.stream_kernel`, or its reference with ``method="reference"``)."""
        from ..kernels.allocation_stream import stream_kernel, stream_reference

        N = int(allocation.num_devices)
        pl = [allocation.placement(n) for n in self.names]
        perm = np.array(sorted(range(len(pl)), key=lambda k: (pl[k].wave, k)), np.int64)
        d = np.array([pl[k].replicas for k in perm], np.int64)
        s = np.array([pl[k].stages for k in perm], np.int64)
        sizes = np.array([len(pl[k].ranks) for k in perm], np.int64)
        off = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        ranks = np.array([r for k in perm for r in pl[k].ranks], np.int64)
        state = np.array([self.costs.state_table(self.names[k], N)[pl[k].replicas] / pl[k].stages for k in perm])
        ar = np.where(self.active[perm] & (d > 1), 2.0 * (d - 1) / d * self.grad[perm] / s
                      + 2.0 * (d - 1) * self.ar_lat, 0.0)
        t, mem, p2p, xfer, parent = self.columns(tuple(p.pieces for p in pl))
        fn = stream_reference if method == "reference" else stream_kernel
        step, busy, byts = fn(t[perm], mem[perm], p2p[perm], xfer[perm],
                              np.ascontiguousarray(self.prod[perm][:, perm]), d, s, ranks, off, self.ff[perm],
                              self.ovh, state, ar, N, parent)
        return float(step), {self.names[k]: float(busy[i]) for i, k in enumerate(perm)}, tuple(float(b) for b in byts)


def simulate_stream(costs, workload, allocation: "Allocation", *, allreduce_bandwidth: float | None = None,
                    method: str = "kernel"):
    """The simulated step of ``allocation`` as the multi-task executor runs it
    (`dynabatch.core.kernels.allocation_stream.stream_kernel`): (step seconds, component -> the most compute seconds
    one device of its group spends on it, bytes per device)."""
    return StreamModel(costs, workload, allreduce_bandwidth).run(allocation, method)


def _placed(blocks, opts, N: int, step_s: float, method: str, mirror=()) -> Allocation:
    """Placements of the chosen blocks ``[(first rank, devices, waves)]``: waves numbered across the blocks in
    order, in each wave the components from the block's first rank on, most bytes first; a wave in ``mirror``
    is reflected inside its block (rank ``first + k`` becomes ``first + devices - 1 - k``: replica 0 on the
    block's last devices). ``component_seconds``: each option's (barrier-model) seconds, ``memory_bytes``:
    the options' bytes summed over each device's waves."""
    placements, names, secs = [], [], {}
    mem = np.zeros(N)
    for first, size, waves in blocks:
        for block, choice in waves:
            w = len(names)
            order = sorted(range(len(block)), key=lambda k: (-opts[block[k]].bytes[choice[k]], k))
            at = 0
            for k in order:
                o, i = opts[block[k]], choice[k]
                ranks = tuple(first + (size - 1 - x if w in mirror else x) for x in range(at, at + o.n[i]))
                placements.append(Placement(block[k], ranks, o.s[i], w))
                mem[list(ranks)] += o.bytes[i]
                secs[block[k]] = o.seconds[i]
                at += o.n[i]
            names.append(tuple(block))
    return Allocation(tuple(placements), tuple(names), N, step_s, secs, tuple(mem.tolist()), method)
