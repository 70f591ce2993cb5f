"""The failure protocol every runner follows around a step (`dynabatch.pipeline.runtime.failure`): enter
the rank's monitor, run, publish a root-cause error or translate a consequence into `PipelineAborted`,
and time the waits on collectives and transfers (seconds) while the monitor watches them."""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch.distributed as dist


class StepGuard:
    """The failure protocol of one runner on one rank.

    ``ctx``: the rank's `DistContext` (its ``monitor`` watches every step); ``what`` names the runner
    in the monitor's idle state; ``steps()`` returns the runner's next step index. ``in_comm`` is True
    while the rank is inside a communication call, so that an error raised there is treated as a
    consequence of another rank's failure (`FailureMonitor.report`)."""

    def __init__(self, ctx, what: str, steps: Callable[[], int]):
        self.ctx = ctx
        self.what = what
        self.steps = steps
        self.in_comm = False

    def run(self, fn):
        """``fn()`` as one step under the rank's monitor; returns its result."""
        mon = self.ctx.monitor
        mon.raise_if_failed()
        mon.enter()
        try:
            return fn()
        except BaseException as e:  # publish (root cause) or translate (consequence), then end the step
            out = mon.report(e, comm_error=self.in_comm)
            if out is e:
                raise
            raise out from e
        finally:
            self.in_comm = False
            mon.leave()
            mon.set_state("idle", f"outside {self.what} after step {self.steps() - 1} "
                                  f"(e.g. in the data loader or the training loop)")

    @contextlib.contextmanager
    def communicating(self):
        """Mark the block as a communication call. Not reset when the block raises: the error is then
        judged as a communication error by `run`."""
        self.in_comm = True
        yield
        self.in_comm = False

    def wait(self, works, text: str, peers) -> float:
        """Block on async ``works`` (``text`` says what for, ``peers`` who is waited on); seconds waited."""
        t0 = time.perf_counter()
        with self.communicating():
            self.ctx.monitor.wait(works, text, peers)
        return time.perf_counter() - t0

    def all_reduce(self, tensor, text: str, peers, group=None) -> float:
        """Sum ``tensor`` in place over ``group`` (default: every rank); seconds waited."""
        self.ctx.monitor.raise_if_failed()
        with self.communicating():
            work = dist.all_reduce(tensor, group=group, async_op=True)
        return self.wait([work], text, peers)

    def everyone(self) -> range:
        """Every global rank (the peers of a collective over the world)."""
        return range(self.ctx.world_size)
