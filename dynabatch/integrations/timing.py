"""`MicroBatchTimer`: the forward and backward seconds of each micro-batch of one step on this rank,
as `dynabatch.integrations.accumulation.step_backward` runs them.

On a GPU each region is bracketed by two CUDA events recorded on the current stream: recording an
event does not wait for the device, so the hot path gains no synchronization; the times are read
once per step (`MicroBatchTimer.resolve`), after ``step_backward``'s non-finite check has already
waited for the step's last kernel (its ``.item()``), so reading them waits for nothing more. On a
CPU, ``time.perf_counter`` marks the region's ends: the CPU runs the work synchronously, so the
difference is the region's time.

What a time includes: ``forward_s[i]`` is the call of the loss function on micro-batch ``i`` (the
model's forward and the loss); ``backward_s[i]`` its ``backward()``. The backward of the micro-batch
that synchronizes gradients (the step's last, under DDP/FSDP with more than one rank) also holds
the gradient all-reduce and the wait for the slowest rank: `MicroBatchTimer.synced` names it so
that feedback counts its backward from its forward instead (`dynabatch.integrations.feedback`). Under FSDP every
micro-batch all-gathers parameters, so each waits for the other ranks (``lockstep``).
"""

from __future__ import annotations

import numpy as np
import torch

from ..pipeline.measure.timing import Clock


class MicroBatchTimer:
    """Forward/backward seconds of the micro-batches of one step (see the module docstring), on the
    pipeline runner's clock (`dynabatch.pipeline.measure.timing.Clock`).

    Args:
        num_microbatches: micro-batches of the step on this rank (placeholders included).
        device: where the model runs; CUDA events on a CUDA device, ``perf_counter`` elsewhere.
        synced: index of the micro-batch whose backward synchronizes gradients across ranks (its
            time includes communication and waiting), or None (one rank: every time is compute).
        lockstep: every micro-batch communicates with the other ranks (FSDP all-gathers the
            parameters in each forward and backward), so no time is this rank's own compute alone.
    """

    def __init__(self, num_microbatches: int, device: torch.device, synced: int | None = None,
                 lockstep: bool = False):
        self.num_microbatches = int(num_microbatches)
        self.synced = synced
        self.lockstep = bool(lockstep)
        self.forward_s = np.zeros(self.num_microbatches)
        self.backward_s = np.zeros(self.num_microbatches)
        self._clock = Clock(torch.device(device))

    def start(self):
        """A start mark: a recorded CUDA event, else ``perf_counter`` seconds."""
        return self._clock.start()

    def forward_done(self, i: int, mark) -> None:
        """Micro-batch ``i``'s forward (and loss) ran since ``mark``."""
        self._clock.stop(mark, self.forward_s, i)

    def backward_done(self, i: int, mark) -> None:
        """Micro-batch ``i``'s backward ran since ``mark``."""
        self._clock.stop(mark, self.backward_s, i)

    def resolve(self) -> tuple[np.ndarray, np.ndarray]:
        """(``forward_s``, ``backward_s``) [num_microbatches] seconds; on a GPU it synchronizes the
        device once (the step's kernels are done by then: the non-finite check read its losses)."""
        self._clock.resolve()
        return self.forward_s, self.backward_s


__all__ = ["MicroBatchTimer"]
