"""The failure protocol every runner follows around a step (`dynabatch.pipeline.failure`): enter the
rank's monitor, run, publish a root-cause error or translate a consequence into `PipelineAborted`,
and time the waits on collectives and transfers (seconds) while the monitor watches them."""

from __future__ import annotations

import time


class GuardedSteps:
    """Mixin of `PipelineRunner` and `MultiModelRunner`: ``_guarded(run)`` runs one step under the
    rank's monitor (``self.ctx.monitor``), ``_wait(works, text, peers)`` blocks on async works and
    returns the seconds waited. Needs ``self.ctx``, ``self.step_index`` and ``self._in_comm``;
    ``_what`` names the runner in the monitor's idle state."""

    _what = "the runner"

    def _guarded(self, run):
        mon = self.ctx.monitor
        mon.raise_if_failed()
        mon.enter()
        try:
            return run()
        except BaseException as e:  # publish (root cause) or translate (consequence), then end the step
            out = mon.report(e, comm_error=self._in_comm)
            if out is e:
                raise
            raise out from e
        finally:
            self._in_comm = False
            mon.leave()
            mon.set_state("idle", f"outside {self._what} after step {self.step_index - 1} "
                                  f"(e.g. in the data loader or the training loop)")

    def _wait(self, works, text: str, peers) -> float:
        t0 = time.perf_counter()
        self._in_comm = True
        self.ctx.monitor.wait(works, text, peers)
        self._in_comm = False
        return time.perf_counter() - t0

    def _take_input(self, inbox, m, specs, what: str):
        """The activation message ``m`` from the previous stage: wait for it (``what`` names the work in
        the monitor's text) and mark the tensors that need a gradient. Returns ``(buffers, the stage's
        input, seconds waited)``."""
        bufs, works = inbox.pop(m)
        peer = self.ctx.global_rank(m.src)
        waited = self._wait(works, f"waiting for {m.describe()} from rank {peer} ({what})", [peer])
        for b, sp in zip(bufs, specs):
            if sp.requires_grad:
                b.requires_grad_(True)
        return bufs, (bufs[0] if len(bufs) == 1 else tuple(bufs)), waited
