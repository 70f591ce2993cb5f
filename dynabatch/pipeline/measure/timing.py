"""What a runner step reports and how it times it: `StepTiming` (one rank's measured seconds and
activation bytes), `StepResult` (a step's loss, tokens and timings) and the clock behind them
(CUDA events on GPU, ``perf_counter`` on CPU). Seconds, bytes, tokens."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class StepTiming:
    """Measured times of one step on one rank (seconds; CUDA events on GPU, ``perf_counter`` on CPU).

    ``forward_s``/``backward_s`` [M]: this stage's forward and backward of each of its replica's
    micro-batches (in plan order); ``wait_s``: host time blocked on receives; ``step_s``: wall time
    of the whole step on this rank, gradient all-reduce and optimizer included. ``saved_bytes`` [M]:
    activation bytes each micro-batch kept for backward on this stage (None when not metered);
    ``peak_saved_bytes``: the most its in-flight micro-batches held at once; ``recompute_layers``:
    layers this stage recomputed.
    """

    step: int
    rank: int
    stage: int
    replica: int
    forward_s: np.ndarray
    backward_s: np.ndarray
    wait_s: float
    step_s: float
    saved_bytes: np.ndarray | None = None
    peak_saved_bytes: float = 0.0
    recompute_layers: int = 0

    @property
    def compute_s(self) -> np.ndarray:
        """Forward + backward seconds per micro-batch on this stage (what a cost model predicts)."""
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class StepResult:
    """Outcome of `PipelineRunner.step`: ``loss`` is the sum of token losses over the global batch
    divided by ``num_tokens`` (real target tokens over all ranks), identical on every rank.
    ``planned_peak_bytes``: the plan's predicted peak of held activation bytes on this rank's stage
    (``options["stage_peak_bytes"]``; None when the plan has none), beside the measured
    ``timing.peak_saved_bytes``. ``weight_extra_bytes`` (flush-free runs): the most bytes the weight
    handling held beyond the weights (stashed versions, the backup of a predicted swap, a gradient
    copy; `WeightPredictor.peak_bytes`)."""

    step: int
    loss: float
    num_tokens: int
    timing: StepTiming
    all_timings: tuple[StepTiming, ...] | None = None
    planned_peak_bytes: float | None = None
    weight_extra_bytes: float | None = None


class Clock:
    """Times regions with CUDA events on GPU (resolved once per step) or ``perf_counter`` on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[np.ndarray, int, object, object]] = []

    def start(self):
        """A start mark (a CUDA event or ``perf_counter`` seconds)."""
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, t0, out: np.ndarray, j: int) -> None:
        """``out[j]`` = seconds since ``t0`` (on GPU once `resolve` runs)."""
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.pending.append((out, j, t0, e))
        else:
            out[j] = time.perf_counter() - t0

    def resolve(self) -> None:
        """Fill in the pending GPU times (one device synchronization)."""
        if self.pending:
            torch.cuda.synchronize()
            for out, j, a, b in self.pending:
                out[j] = a.elapsed_time(b) / 1e3
            self.pending.clear()
