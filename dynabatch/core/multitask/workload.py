"""A step's per-component workload: which micro-batches reach each component and what each costs there.

A step's samples (`StepSamples`: each with its task, its text / vision / audio token counts in backbone
tokens, and its micro-batch; every micro-batch holds samples of one task) reach the components on their
task's path. `ComponentCosts` prices them with one `dynabatch.core.cost.CostModel` per component (the
analytic model of the component's `ModelConfig` on a `DeviceProfile`): `Workload` holds, per component and
micro-batch, the forward+backward seconds on one device holding the whole component, the activation bytes it
keeps for backward, and the bytes of the output it sends on. Measured per-component times refit each
component's cost model through its own `dynabatch.core.plan.feedback.FeedbackLoop` (the library's one refit
path). Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..cost.model import CostModel
from ..cost.presets import DeviceProfile, device_preset
from ..kernels.cost import FEATURES, NUM_FEATURES
from ..plan.feedback import FeedbackLoop, FeedbackRow
from .graph import Component, ComponentGraph

_N, _Q, _ONE = FEATURES.index("n_main"), FEATURES.index("q_main"), FEATURES.index("one")


@dataclass(frozen=True)
class StepSamples:
    """A step's samples: ``tasks[i]`` (a task of the graph), token counts ``text[i]``, ``vision[i]``,
    ``audio[i]`` (int64, in backbone tokens: an image becomes ``vision`` tokens of the backbone's sequence)
    and ``microbatch[i]`` (0..M-1; every micro-batch holds samples of one task, every id in 0..M-1 is used)."""

    tasks: tuple[str, ...]
    text: np.ndarray
    vision: np.ndarray
    audio: np.ndarray
    microbatch: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))
        n = len(self.tasks)
        for name in ("text", "vision", "audio", "microbatch"):
            a = np.asarray(getattr(self, name), np.int64).ravel()
            if len(a) != n:
                raise ValueError(f"StepSamples: {name} has {len(a)} entries for {n} samples")
            if (a < 0).any():
                raise ValueError(f"StepSamples: {name} must be >= 0 (sample {int(np.argmax(a < 0))})")
            object.__setattr__(self, name, a)
        M = int(self.microbatch.max()) + 1 if n else 0
        if n and len(np.unique(self.microbatch)) != M:
            raise ValueError(f"StepSamples: micro-batch ids must be 0..{M - 1} with none empty")
        first: dict[int, str] = {}
        for i, (t, j) in enumerate(zip(self.tasks, self.microbatch.tolist())):
            if first.setdefault(j, t) != t:
                raise ValueError(f"StepSamples: micro-batch {j} mixes tasks {first[j]!r} and {t!r} (sample {i}); "
                                 f"a micro-batch holds samples of one task")

    @property
    def num_microbatches(self) -> int:
        """Micro-batches of the step (M)."""
        return int(self.microbatch.max()) + 1 if len(self.tasks) else 0

    @property
    def microbatch_tasks(self) -> tuple[str, ...]:
        """The task of each micro-batch (what `dynabatch.core.multitask.routing.route` takes)."""
        out = [""] * self.num_microbatches
        for t, j in zip(self.tasks, self.microbatch.tolist()):
            out[j] = t
        return tuple(out)

    @property
    def merged(self) -> np.ndarray:
        """Each sample's backbone sequence length (text + vision + audio tokens)."""
        return self.text + self.vision + self.audio

    @classmethod
    def pack(cls, graph: ComponentGraph, tasks: Sequence[str], text, vision, audio, *,
             microbatch_tokens: int) -> "StepSamples":
        """Samples grouped into micro-batches: per task (in the graph's task order), longest backbone sequence
        first, each micro-batch filled up to ``microbatch_tokens`` backbone tokens (a longer sample gets one of
        its own). Deterministic. Unknown task names raise ValueError naming the graph's tasks."""
        tasks = tuple(tasks)
        graph.check_tasks(tasks)
        text, vision, audio = (np.asarray(a, np.int64).ravel() for a in (text, vision, audio))
        merged = text + vision + audio
        cap = int(microbatch_tokens)
        if cap < 1:
            raise ValueError(f"microbatch_tokens must be >= 1, got {microbatch_tokens}")
        mb = np.zeros(len(tasks), np.int64)
        nxt = 0
        for t in graph.task_names:
            idx = [i for i, ti in enumerate(tasks) if ti == t]
            idx.sort(key=lambda i: (-int(merged[i]), i))
            fill = None
            for i in idx:
                if fill is None or fill + merged[i] > cap:
                    nxt, fill = nxt + 1, 0
                mb[i] = nxt - 1
                fill += merged[i]
        return cls(tasks, text, vision, audio, mb)


@dataclass(frozen=True)
class Workload:
    """A step's work per component (rows in ``components`` order, the graph's topological order) and
    micro-batch (columns): ``time_s`` forward+backward seconds on one device holding the whole component
    (0 where the micro-batch does not reach it), ``memory_bytes`` activation bytes it keeps for backward,
    ``send_bytes`` bytes of the output it sends to each consumer (gradients come back the same size),
    ``features`` the cost-model features ``[C, M, NUM_FEATURES]`` the times were priced from, ``reaches``
    [C, M] bool, ``overhead_s`` [C] the fixed seconds a micro-batch pays per pipeline stage (launch), ``state``
    [C] parameters of each component, ``dtype_bytes`` [C] and ``microbatch_tasks`` each micro-batch's task."""

    components: tuple[str, ...]
    time_s: np.ndarray
    memory_bytes: np.ndarray
    send_bytes: np.ndarray
    features: np.ndarray
    reaches: np.ndarray
    overhead_s: np.ndarray
    params: np.ndarray
    dtype_bytes: np.ndarray
    layers: np.ndarray
    microbatch_tasks: tuple[str, ...]

    @property
    def num_microbatches(self) -> int:
        """Micro-batches of the step (M)."""
        return self.time_s.shape[1]

    def row(self, component: str) -> int:
        """Row of ``component`` in the arrays."""
        try:
            return self.components.index(component)
        except ValueError:
            raise KeyError(f"no component {component!r} in this workload ({', '.join(self.components)})") from None

    def total_seconds(self) -> float:
        """Seconds of all the step's work on one device, launch overheads included."""
        return float(self.time_s.sum())


def token_counts(component: Component, samples: StepSamples) -> np.ndarray:
    """Per sample, the backbone tokens that drive ``component``'s work (`Component.tokens`)."""
    k = component.tokens
    if k == "text":
        return samples.text
    if k == "vision":
        return samples.vision
    if k == "audio":
        return samples.audio
    if k == "encoded":
        return samples.vision + samples.audio
    return samples.merged


def component_features(component: Component, samples: StepSamples, reach: np.ndarray) -> np.ndarray:
    """Feature rows ``[M, NUM_FEATURES]`` of ``component`` for each micro-batch: the tokens it reads
    (backbone tokens / ``token_ratio``), attended per sample (or per ``seq_len`` sequence), varlen."""
    M = samples.num_microbatches
    phi = np.zeros((M, NUM_FEATURES))
    counts = token_counts(component, samples).astype(np.float64)
    read = np.ceil(counts / component.token_ratio - 1e-9)
    if component.seq_len > 0:
        seqs = np.ceil(read / component.seq_len)
        n, q = seqs * component.seq_len, seqs * float(component.seq_len) ** 2
    else:
        n, q = read, read * read
    on = reach[samples.microbatch]
    np.add.at(phi[:, _N], samples.microbatch[on], n[on])
    np.add.at(phi[:, _Q], samples.microbatch[on], q[on])
    phi[:, _ONE] = (phi[:, _N] > 0) & reach
    return phi


class ComponentCosts:
    """One `CostModel` per component of ``graph`` on ``device`` (a `DeviceProfile` or a preset name), and one
    `FeedbackLoop` per component refitting it from measured per-component times (`observe`, `refit`)."""

    def __init__(self, graph: ComponentGraph, device: DeviceProfile | str = "a100-80gb", *,
                 cost_models: Mapping[str, CostModel] | None = None, refit_every: int = 1,
                 forgetting: float = 0.9):
        self.graph = graph
        self.device = device_preset(device) if isinstance(device, str) else device
        given = dict(cost_models or {})
        unknown = sorted(set(given) - set(graph.names))
        if unknown:
            raise ValueError(f"ComponentCosts: cost models for {unknown}, which are not components "
                             f"(components: {', '.join(graph.names)})")
        self.models: dict[str, CostModel] = {
            c.name: given.get(c.name) or CostModel.analytic(c.model, self.device) for c in graph.components}
        self.loops: dict[str, FeedbackLoop] = {
            n: FeedbackLoop(m, refit_every=refit_every, forgetting=forgetting) for n, m in self.models.items()}
        self._state: dict[tuple[str, int], np.ndarray] = {}

    def state_table(self, component: str, num_devices: int) -> np.ndarray:
        """Model-state bytes of the whole ``component`` with ``d`` data-parallel replicas, for d in
        0..``num_devices`` (`CostModel.state_bytes`; entry 0 unused), memoized (it depends on shapes only)."""
        key = (component, int(num_devices))
        if key not in self._state:
            cm = self.models[component]
            self._state[key] = np.array([0.0] + [cm.state_bytes(d) for d in range(1, int(num_devices) + 1)])
        return self._state[key]

    def workload(self, samples: StepSamples) -> Workload:
        """The step's `Workload` under the current cost models."""
        g = self.graph
        order = g.order()
        mb_tasks = samples.microbatch_tasks
        M = len(mb_tasks)
        C = len(order)
        g.check_tasks(samples.tasks)
        feats = np.zeros((C, M, NUM_FEATURES))
        time = np.zeros((C, M))
        mem = np.zeros((C, M))
        send = np.zeros((C, M))
        reach = np.zeros((C, M), bool)
        ovh = np.zeros(C)
        params, dtb, layers = np.zeros(C), np.zeros(C), np.zeros(C)
        paths = {t.name: set(t.path) for t in g.tasks}
        for r, name in enumerate(order):
            comp = g.component(name)
            reach[r] = [name in paths[t] for t in mb_tasks]
            phi = component_features(comp, samples, reach[r])
            cm = self.models[name]
            feats[r] = phi
            time[r] = np.where(phi[:, _ONE] > 0, cm.time(phi), 0.0)
            mem[r] = np.where(phi[:, _ONE] > 0, cm.memory(phi), 0.0)
            emitted = np.zeros(M)
            np.add.at(emitted, samples.microbatch, token_counts(comp, samples).astype(np.float64))
            send[r] = np.where(reach[r], emitted * comp.out_bytes_per_token, 0.0)
            ovh[r] = self.device.overhead_s
            params[r], dtb[r], layers[r] = comp.param_count, comp.model.dtype_bytes, comp.layers
        return Workload(order, time, mem, send, feats, reach, ovh, params, dtb, layers, mb_tasks)

    def observe(self, workload: Workload, measured_s: Mapping[str, Sequence[float]]) -> dict[str, float]:
        """Record measured forward+backward seconds per component and micro-batch (``measured_s[name][j]``,
        one device holding the whole component; NaN or 0 for a micro-batch it did not run) into each
        component's `FeedbackLoop`; returns each component's MAPE (fraction) of the prediction on them."""
        out = {}
        for name, y in measured_s.items():
            r = workload.row(name)
            y = np.asarray(y, np.float64).ravel()
            if len(y) != workload.num_microbatches:
                raise ValueError(f"observe: {len(y)} times for component {name!r}, the step has "
                                 f"{workload.num_microbatches} micro-batches")
            keep = workload.reaches[r] & np.isfinite(y) & (y > 0)
            if keep.any():
                out[name] = self.loops[name].record(workload.features[r][keep], y[keep],
                                                    predicted_s=workload.time_s[r][keep])
        return out

    def refit(self) -> dict[str, FeedbackRow]:
        """Refit every component whose loop is due (`FeedbackLoop.maybe_refit`); the new history rows."""
        rows = {}
        for name, loop in self.loops.items():
            row = loop.maybe_refit()
            if row is not None:
                rows[name] = row
        return rows
