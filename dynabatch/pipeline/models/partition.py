"""Split an ordered list of layers into pipeline stages.

The split is searched, not uniform: per-layer forward/backward seconds on a representative set of
micro-batches (measured by `dynabatch.pipeline.measure.layers.profile_layers`, or given) are summed
per candidate stage and the candidate's step is simulated with the pipeline simulator
(`dynabatch.core.simulate.pipeline`); the partition with the smallest simulated makespan wins (OmniBal-style). Small problems are enumerated
exhaustively; large ones start from the min-max (bottleneck) partition found by binary search and
move stage boundaries while the simulated makespan improves.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn

from ...core.kernels.op_codes import WEIGHT_SHARE
from ...core.kernels.simulate import held_table_kernel, makespan_table_kernel
from ...core.schedule.build import step_ops
from ...core.schedule.ops import StepOps
from ...core.schedule.registry import schedule_info
from .contract import check_bounds


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer costs on ``M`` representative micro-batches: ``forward_s``/``backward_s`` are
    [n_layers, M] seconds, ``memory_bytes`` [n_layers, M] activation bytes each layer keeps for its
    backward, ``boundary_bytes`` [M] bytes of the state passed between layers."""

    forward_s: np.ndarray
    backward_s: np.ndarray
    memory_bytes: np.ndarray | None = None
    boundary_bytes: np.ndarray | None = None

    def __post_init__(self) -> None:
        f = np.atleast_2d(np.asarray(self.forward_s, np.float64))
        b = np.atleast_2d(np.asarray(self.backward_s, np.float64))
        if f.shape != b.shape or f.size == 0:
            raise ValueError(f"forward_s and backward_s must both be [n_layers, M], got {f.shape} and {b.shape}")
        if not (np.all(np.isfinite(f)) and np.all(np.isfinite(b))) or f.min() < 0 or b.min() < 0:
            raise ValueError("layer times must be finite, non-negative seconds")
        object.__setattr__(self, "forward_s", f)
        object.__setattr__(self, "backward_s", b)

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return self.forward_s.shape[0]

    @property
    def num_microbatches(self) -> int:
        """Number of representative micro-batches."""
        return self.forward_s.shape[1]

    def stage_times(self, bounds: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward seconds [S, M] of the stages cut at layer offsets ``bounds``."""
        b = np.asarray(bounds, np.int64)
        pf = np.vstack([np.zeros((1, self.num_microbatches)), np.cumsum(self.forward_s, axis=0)])
        pb = np.vstack([np.zeros((1, self.num_microbatches)), np.cumsum(self.backward_s, axis=0)])
        return pf[b[1:]] - pf[b[:-1]], pb[b[1:]] - pb[b[:-1]]


@dataclass(frozen=True)
class StagePartition:
    """Contiguous layer ranges per stage: stage ``s`` holds layers ``bounds[s]:bounds[s+1]``.
    ``makespan_s`` is the simulated step time (seconds) on the representative micro-batches and
    ``stage_busy_s`` each stage's total forward+backward seconds."""

    bounds: tuple[int, ...]
    makespan_s: float
    stage_busy_s: tuple[float, ...]
    schedule: str

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.bounds) - 1

    def layers_of(self, stage: int) -> range:
        """Layer indices of ``stage``."""
        return range(self.bounds[stage], self.bounds[stage + 1])


def _ops(pieces: int, m: int, schedule: str) -> StepOps:
    """The order a split into ``pieces`` is searched under: ``schedule``'s own for a static one (``pieces`` =
    stages x its chunks, the chunks of a stage assigned round-robin), else its registered ``balance`` order
    (adaptive and auto depend on the micro-batches' times: they are searched as 1F1B). Unknown names raise."""
    info = schedule_info(schedule)
    order = schedule_info(info.name if info.static else info.balance)
    if pieces % order.chunks:
        raise ValueError(f"{schedule} runs {order.chunks} chunks per stage: the split needs a multiple of "
                         f"{order.chunks} pieces, got {pieces}")
    return step_ops(order.name, pieces // order.chunks, m)


def _span(ops: StepOps, f, bw, p2p) -> float:
    """Makespan of ``ops`` with ``f``/``bw`` seconds per piece (virtual stage)."""
    return float(makespan_table_kernel(np.ascontiguousarray(f), np.ascontiguousarray(bw), WEIGHT_SHARE, p2p,
                                       ops.kernel_table))


def _p2p(p2p_s, m: int) -> np.ndarray:
    arr = np.asarray(p2p_s, np.float64)
    return np.ascontiguousarray(np.full(m, float(arr)) if arr.ndim == 0 else arr)


def partition_makespan(costs: LayerCosts, bounds: Sequence[int], *, schedule: str = "1f1b", p2p_s=0.0) -> float:
    """Simulated makespan (seconds) of one step over the representative micro-batches with the
    stages cut at ``bounds``; ``p2p_s`` is the per-hop transfer time (scalar or [M] seconds)."""
    b = check_bounds(bounds, costs.num_layers)
    f, bw = costs.stage_times(b)
    ops = _ops(len(b) - 1, costs.num_microbatches, schedule)
    return _span(ops, f, bw, _p2p(p2p_s, costs.num_microbatches))


def _result(costs, bounds, schedule, p2p_s) -> StagePartition:
    f, bw = costs.stage_times(bounds)
    return StagePartition(tuple(int(x) for x in bounds), partition_makespan(costs, bounds, schedule=schedule, p2p_s=p2p_s),
                          tuple(float(x) for x in (f + bw).sum(axis=1)), schedule)


def uniform_partition(costs: LayerCosts, num_stages: int, *, schedule: str = "1f1b", p2p_s=0.0) -> StagePartition:
    """Equal layer counts per stage (the first stages get one more when it does not divide) — the
    baseline a searched partition is compared with."""
    n = costs.num_layers
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} stages")
    sizes = [n // num_stages + (1 if s < n % num_stages else 0) for s in range(num_stages)]
    return _result(costs, np.concatenate(([0], np.cumsum(sizes))), schedule, p2p_s)


def _minmax_bounds(weights: np.ndarray, num_stages: int) -> list[int]:
    """Contiguous partition minimizing the largest stage weight (binary search on the cap with a
    greedy feasibility check; exact for non-negative weights up to float resolution)."""
    n = len(weights)

    def cuts(cap: float):
        bounds, acc = [0], 0.0
        for i, w in enumerate(weights):
            if i > bounds[-1] and acc + w > cap:
                bounds.append(i)
                acc = 0.0
            acc += w
        bounds.append(n)
        return bounds

    lo, hi = float(weights.max()), float(weights.sum())
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if len(cuts(mid)) - 1 <= num_stages:
            hi = mid
        else:
            lo = mid
    b = cuts(hi)
    # the greedy may use fewer stages than allowed: split the largest stages until S stages exist
    while len(b) - 1 < num_stages:
        sizes = np.diff(b)
        s = int(np.argmax(np.where(sizes > 1, [weights[b[k]:b[k + 1]].sum() for k in range(len(sizes))], -1)))
        b.insert(s + 1, b[s] + sizes[s] // 2)
    return b


def balanced_partition(costs: LayerCosts, num_stages: int, *, schedule: str = "1f1b", p2p_s=0.0,
                       exhaustive_limit: int = 20000, max_rounds: int = 200,
                       memory_limit: float | None = None) -> StagePartition:
    """The contiguous split of the layers into ``num_stages`` stages with the smallest simulated
    makespan on the representative micro-batches of ``costs``.

    Every partition is simulated when there are at most ``exhaustive_limit`` of them; otherwise the
    search starts from the min-max partition of per-layer busy time and moves single boundaries
    (by up to 2 layers) while the makespan improves, for at most ``max_rounds`` rounds.
    ``memory_limit`` (bytes a device may hold for backward): only partitions whose every stage's peak
    of kept activation bytes (``costs.memory_bytes`` summed over the stage's layers (its chunks'), held from
    each micro-batch's forward to its backward, or to its weight part when split, in the schedule's order)
    stays within it are taken;
    ValueError when none does.
    """
    n, m = costs.num_layers, costs.num_microbatches
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} stages")
    if memory_limit is not None and costs.memory_bytes is None:
        raise ValueError("memory_limit needs LayerCosts with memory_bytes (profile_layers measures them)")
    ops = _ops(num_stages, m, schedule)
    p2p = _p2p(p2p_s, m)
    pf = np.vstack([np.zeros((1, m)), np.cumsum(costs.forward_s, axis=0)])
    pb = np.vstack([np.zeros((1, m)), np.cumsum(costs.backward_s, axis=0)])
    pm = None if memory_limit is None else np.vstack([np.zeros((1, m)), np.cumsum(costs.memory_bytes, axis=0)])
    peaks = np.empty(ops.num_stages)
    total = (costs.forward_s + costs.backward_s).sum(axis=1)

    def score(bounds) -> tuple[float, float]:
        b = np.asarray(bounds, np.int64)
        if pm is not None:
            held_table_kernel(ops.kernel_table, np.ascontiguousarray(pm[b[1:]] - pm[b[:-1]]), peaks)
            if peaks.max() > memory_limit:
                return math.inf, math.inf
        f = np.ascontiguousarray(pf[b[1:]] - pf[b[:-1]])
        bw = np.ascontiguousarray(pb[b[1:]] - pb[b[:-1]])
        # ties in makespan go to the partition with the smaller bottleneck stage
        return _span(ops, f, bw, p2p), float((f + bw).sum(axis=1).max())

    def fits(best):
        if best is None or score(best)[0] == math.inf:
            raise ValueError(f"no split of {n} layers into {num_stages} stages keeps every stage's activations "
                             f"within memory_limit={memory_limit:.4g} bytes under {schedule}")
        return best

    if math.comb(n - 1, num_stages - 1) <= exhaustive_limit:
        best, best_score = None, (math.inf, math.inf)
        for inner in itertools.combinations(range(1, n), num_stages - 1):
            b = (0, *inner, n)
            sc = score(b)
            if sc < best_score:
                best, best_score = b, sc
        return _result(costs, fits(best), schedule, p2p_s)

    best = _minmax_bounds(total, num_stages)
    best_score = score(best)
    for _ in range(max_rounds):
        improved = False
        for k in range(1, num_stages):
            for d in (-2, -1, 1, 2):
                cand = list(best)
                cand[k] += d
                if not cand[k - 1] < cand[k] < cand[k + 1]:
                    continue
                sc = score(cand)
                if sc < best_score:
                    best, best_score, improved = cand, sc, True
        if not improved:
            break
    return _result(costs, fits(best), schedule, p2p_s)


# ---------------------------------------------------------------------------------------------
# stages as modules


class PipelineStage(nn.Module):
    """The layers ``first_layer .. first_layer + len(layers) - 1`` of a model, run as one stage.

    The first stage feeds the micro-batch dictionary to the model's embedding; the last stage calls
    the head with ``(state, batch)`` and returns ``(loss_sum, num_tokens)``; the others map state to
    state. A one-tensor state may be passed bare. A layer may carry values in the state that only
    the stage's later layers use (T5's relative bias, computed once per stage): when the stage's last
    layer has a ``stage_output(state)`` method, the stage returns (sends) what it gives.

    ``recompute``: the first ``recompute`` of the stage's `recomputable_layers` (its layers less the
    embedding and the head) run under ``torch.utils.checkpoint`` (non-reentrant): they keep only their
    input for backward and run their forward again inside it (`dynabatch.core.plan.recompute`). A
    ``meter`` (a `dynabatch.pipeline.measure.memory.SavedBytes`, set by the runner for one forward) is told
    the inputs such a layer keeps, which autograd's saved-tensor hooks do not see.
    """

    def __init__(self, layers: Sequence[nn.Module], first_layer: int, num_model_layers: int, *, recompute: int = 0):
        super().__init__()
        if not layers:
            raise ValueError("a pipeline stage needs at least one layer")
        self.layers = nn.ModuleList(layers)
        self.first_layer = int(first_layer)
        self.num_model_layers = int(num_model_layers)
        self.is_first = self.first_layer == 0
        self.is_last = self.first_layer + len(layers) == self.num_model_layers
        self.recompute = int(recompute)
        self.meter = None

    @property
    def last_layer(self) -> int:
        """Index (in the whole model) of this stage's last layer."""
        return self.first_layer + len(self.layers) - 1

    @property
    def recomputable_layers(self) -> int:
        """Layers recomputation may take: all but the embedding (first stage) and the head (last stage)."""
        return len(self.layers) - int(self.is_first) - int(self.is_last)

    def forward(self, x, batch: dict | None = None):
        layers = list(self.layers)
        if self.is_first:
            x = layers.pop(0)(batch)
        head = layers.pop() if self.is_last else None
        for i, layer in enumerate(layers):
            x = self._checkpointed(layer, x) if i < self.recompute else layer(x)
        if head is not None:
            return head(x, batch)
        local = getattr(self.layers[-1], "stage_output", None)
        return local(x) if local is not None else x

    def _checkpointed(self, layer: nn.Module, x):
        from torch.utils.checkpoint import checkpoint

        if self.meter is not None:
            self.meter.keep(x)
        if isinstance(x, tuple):
            return checkpoint(_call_with_tuple, layer, *x, use_reentrant=False)
        return checkpoint(layer, x, use_reentrant=False)


def _call_with_tuple(layer, *state):
    return layer(tuple(state))


def split_model(layers: Sequence[nn.Module], bounds: Sequence[int] | StagePartition) -> list[PipelineStage]:
    """Cut ``layers`` (a list or ``nn.Sequential``; embedding first, head last) into stages at
    ``bounds`` (layer offsets, or a `StagePartition`)."""
    layers = list(layers)
    b = check_bounds(bounds.bounds if isinstance(bounds, StagePartition) else bounds, len(layers))
    return [PipelineStage(layers[b[s]:b[s + 1]], b[s], len(layers)) for s in range(len(b) - 1)]
