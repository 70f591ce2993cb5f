"""The baselines a per-component allocation is measured against: one pipeline over the whole model.

Every component's layers, in the graph's topological order, form one layer list, cut into ``S`` contiguous
stages (uniformly by layer count, or by a given partition search); the ``N`` devices hold ``N / S``
data-parallel copies of that pipeline, the step's micro-batches balanced over them (the same longest-first
rule as the allocation), each copy run in 1F1B order and simulated by the pipeline simulator
(`dynabatch.core.simulate.pipeline.simulate_kernel`), and the gradient all-reduce of each stage over the
copies, started as soon as that stage's last backward is done (Megatron's overlap-grad-reduce: a later stage's
all-reduce runs while the stages before it still work through their backward).
Every micro-batch passes every stage, paying each stage's launch overhead and the activation transfer, even
where it has no work; with ``bypass`` (`RunnerConfig(bypass_idle_stages=True)`) it skips the stages before
the first one that computes for it (a text-only micro-batch skips the encoder stages). The number of stages
is searched over the divisors of ``N`` whose memory fits. Also two lower bounds of any step of these
micro-batches: all the step's work over all devices (`lower_bound`), and the heaviest micro-batch's path
through its components, forward and back (`chain_bound`). Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..kernels.allocation import lpt_kernel
from ..kernels.cost import FEATURES
from ..simulate.pipeline import pipeline_schedule, simulate_kernel

_N_MAIN = FEATURES.index("n_main")

#: a partition search: (forward seconds [L, M], backward seconds [L, M], stages S) -> layer offsets (S + 1)
Partition = Callable[[np.ndarray, np.ndarray, int], Sequence[int]]


@dataclass(frozen=True)
class PipelineBaseline:
    """One pipeline over the whole model: ``num_stages`` stages cut at layer offsets ``bounds`` (over the
    components' layers in topological order), ``replicas`` data-parallel copies, the simulated step seconds
    and the largest per-device bytes (model state + 1F1B in-flight activations). ``name`` says how it was cut
    (``uniform`` / ``searched``) and whether idle leading stages are bypassed (``+bypass``)."""

    name: str
    num_stages: int
    replicas: int
    bounds: tuple[int, ...]
    step_seconds: float
    memory_bytes: float


def uniform_bounds(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Layer offsets of a cut into ``num_stages`` stages of (as nearly as possible) equal layer counts."""
    L, S = int(num_layers), int(num_stages)
    return tuple((k * L) // S for k in range(S + 1))


class LayerTable:
    """The whole model as one layer list for the step of ``workload`` priced by ``costs`` (a
    `dynabatch.core.multitask.workload.ComponentCosts`): per layer and micro-batch the forward and backward
    seconds without the per-stage launch overhead (``forward_s`` / ``backward_s`` [L, M]), activation bytes
    kept (``memory_bytes`` [L, M]), and per layer its component (``component`` [L]) and share of that
    component (``share`` [L], 1 / its layer count)."""

    def __init__(self, costs, workload):
        self.costs, self.workload = costs, workload
        g = costs.graph
        comp, share, fwd, bwd, mem = [], [], [], [], []
        for r, name in enumerate(workload.components):
            c = g.component(name)
            ff = costs.models[name].forward_fraction
            t = workload.time_s[r]
            work = np.where(t > 0, t - np.minimum(workload.overhead_s[r], t), 0.0) / c.layers
            for _ in range(c.layers):
                comp.append(r)
                share.append(1.0 / c.layers)
                fwd.append(work * ff)
                bwd.append(work * (1.0 - ff))
                mem.append(workload.memory_bytes[r] / c.layers)
        self.component = np.array(comp, np.int64)
        self.share = np.array(share)
        self.forward_s, self.backward_s, self.memory_bytes = np.array(fwd), np.array(bwd), np.array(mem)
        back = g.component("backbone") if "backbone" in g.names else g.component(g.order()[-1])
        row = workload.row(back.name)
        # the activation passed between stages: the backbone's hidden states of the micro-batch's sequence
        self.p2p_s = costs.models[back.name].transfer_time(workload.features[row][:, 0])

    @property
    def num_layers(self) -> int:
        """Layers of the whole model (L)."""
        return len(self.component)


def pipeline_time(table: LayerTable, bounds: Sequence[int], num_devices: int, *, bypass: bool,
                  allreduce_bandwidth: float | None = None) -> tuple[float, float]:
    """(simulated step seconds, largest per-device bytes) of one pipeline cut at ``bounds`` on
    ``num_devices`` devices (``len(bounds) - 1`` stages times ``num_devices / stages`` copies). The step ends
    with the last stage all-reduce: stage ``s``'s starts when its last backward (over the copies) ends and
    takes the ring all-reduce of its parameters' gradients over the copies."""
    costs, w = table.costs, table.workload
    dev = costs.device
    b = np.asarray(bounds, np.int64)
    S = len(b) - 1
    N = int(num_devices)
    if N % S:
        raise ValueError(f"{S} stages do not divide {N} devices")
    D = N // S
    M = w.num_microbatches
    pf = np.vstack([np.zeros((1, M)), np.cumsum(table.forward_s, axis=0)])
    pb = np.vstack([np.zeros((1, M)), np.cumsum(table.backward_s, axis=0)])
    pm = np.vstack([np.zeros((1, M)), np.cumsum(table.memory_bytes, axis=0)])
    f, bw, mem = pf[b[1:]] - pf[b[:-1]], pb[b[1:]] - pb[b[:-1]], pm[b[1:]] - pm[b[:-1]]
    busy = (f + bw) > 0
    if bypass:  # stages before the first that computes for the micro-batch run nothing for it
        first = np.where(busy.any(axis=0), np.argmax(busy, axis=0), S)
        visit = np.arange(S)[:, None] >= first[None, :]
    else:
        visit = np.ones((S, M), bool)
    o = dev.overhead_s
    f = f + visit * o / 3.0
    bw = bw + visit * o * 2.0 / 3.0
    # each stage's parameters (by layer share of each component) and model state with D copies
    params = np.zeros(S)
    state = np.zeros(S)
    for s in range(S):
        for r in range(len(w.components)):
            share = table.share[b[s]:b[s + 1]][table.component[b[s]:b[s + 1]] == r].sum()
            if share > 0:
                cm = costs.models[w.components[r]]
                params[s] += share * w.params[r] * w.dtype_bytes[r]
                state[s] += share * cm.state_bytes(D)
    assign = np.empty(M, np.int64)
    lpt_kernel(np.ascontiguousarray((f + bw).sum(axis=0)), D, assign)
    done, held = np.zeros(S), np.zeros(S)  # per stage: its last backward's end over the copies
    for d in range(D):
        sel = np.flatnonzero(assign == d)
        if len(sel) == 0:
            continue
        fs, bs = np.ascontiguousarray(f[:, sel]), np.ascontiguousarray(bw[:, sel])
        p2p = np.ascontiguousarray(table.p2p_s[sel])
        start, end = np.empty((S, len(sel), 2)), np.empty((S, len(sel), 2))
        if simulate_kernel(fs, bs, p2p, pipeline_schedule(S, len(sel), "1f1b"), start, end) != 0:
            raise RuntimeError(f"1F1B on {S} stages and {len(sel)} micro-batches did not finish in the simulator")
        done = np.maximum(done, end.max(axis=(1, 2)))
        # 1F1B: stage s holds at most S - s micro-batches' activations at once
        for s in range(S):
            held[s] = max(held[s], np.sort(mem[s, sel])[::-1][:S - s].sum())
    # each stage's gradient all-reduce over the copies starts once the stage's last backward is done
    # (Megatron's overlap-grad-reduce), on that stage's devices' links, while earlier stages still compute
    ar_bw = float(allreduce_bandwidth) if allreduce_bandwidth else float(dev.p2p_bandwidth)
    ar = (2.0 * (D - 1) / D * params / ar_bw + 2.0 * (D - 1) * dev.p2p_latency_s) if D > 1 else np.zeros(S)
    return float((done + ar).max()), float((state + held).max())


def one_pipeline(costs, workload, num_devices: int, *, bypass: bool, partition: Partition | None = None,
                 memory_limit: float | None = None, allreduce_bandwidth: float | None = None) -> PipelineBaseline:
    """The best one-pipeline layout: stages ``S`` over the divisors of ``num_devices`` (at most the model's
    layers), cut uniformly or by ``partition`` (e.g. `dynabatch.pipeline.balanced_partition`'s search), the
    fastest whose every device fits ``memory_limit`` (default the device's usable memory). ValueError when
    none fits."""
    table = LayerTable(costs, workload)
    dev = costs.device
    limit = float(memory_limit) if memory_limit is not None else dev.memory_bytes * dev.usable_memory_fraction
    N = int(num_devices)
    best = None
    for S in range(1, min(N, table.num_layers) + 1):
        if N % S:
            continue
        # the model state alone, spread perfectly over S stages, already overflows: skip the cut search
        if sum(costs.models[c].state_bytes(N // S) for c in workload.components) / S > limit:
            continue
        if partition is None:
            bounds = uniform_bounds(table.num_layers, S)
        else:
            bounds = tuple(int(x) for x in partition(table.forward_s, table.backward_s, S))
        t, m = pipeline_time(table, bounds, N, bypass=bypass, allreduce_bandwidth=allreduce_bandwidth)
        if m <= limit and (best is None or t < best.step_seconds):
            name = ("uniform" if partition is None else "searched") + ("+bypass" if bypass else "")
            best = PipelineBaseline(name, S, N // S, bounds, t, m)
    if best is None:
        raise ValueError(f"no one-pipeline layout of the model on {N} devices fits {limit / 2 ** 30:.1f} GiB per "
                         f"device")
    return best


def lower_bound(workload, num_devices: int) -> float:
    """The iteration lower bound (seconds): all the step's work (every component, every micro-batch it runs,
    without the per-stage launch overhead, which a stage holding several components pays once) spread
    perfectly over ``num_devices`` devices, with no communication."""
    t = workload.time_s
    work = np.where(t > 0, t - np.minimum(workload.overhead_s[:, None], t), 0.0)
    return float(work.sum()) / int(num_devices)


def chain_bound(graph, workload) -> float:
    """The longest micro-batch's chain (seconds): a micro-batch's forward runs through the components on its
    task's path one after another (a consumer waits for its producer) and its backward back the same way, and
    data or pipeline parallelism never runs one sequence's layers side by side; so no step of these
    micro-batches, under a per-component allocation or one pipeline, is shorter than the heaviest path's
    forward + backward (each component at its one-device time, without the per-stage launch overhead, no
    communication; a component attending independent sequences, `Component.seq_len` > 0, at one sequence's
    share, since its sequences may be split over replicas: `plan_allocation(split_sequences=True)`): the
    longest path of these weights through ``graph`` over the components the micro-batch reaches, the largest
    over the micro-batches."""
    t = workload.time_s
    work = np.where(t > 0, t - np.minimum(workload.overhead_s[:, None], t), 0.0)
    longest = np.zeros_like(work)  # the heaviest path ending in each component, per micro-batch
    for r, name in enumerate(workload.components):
        comp = graph.component(name)
        if comp.seq_len > 0:
            seqs = np.maximum(np.rint(workload.features[r][:, _N_MAIN] / comp.seq_len), 1.0)
            work[r] = work[r] / seqs
        before = np.zeros(workload.num_microbatches)
        for i in comp.inputs:
            before = np.maximum(before, longest[workload.row(i)])
        longest[r] = np.where(workload.reaches[r], before + work[r], 0.0)
    return float(longest.max()) if longest.size else 0.0
