"""Ending every rank when one rank fails, instead of hanging.

A rank blocked in a gloo receive cannot be interrupted (gloo has no abort: only the peer's process
exit or the process-group timeout wakes it), and a rank whose neighbour died may never learn why.
So failures travel on a side channel, the `torch.distributed` Store every rank already shares:

* the failing rank writes ``rank R (stage s, replica d): ExcType: message`` under one key (first
  writer wins) before it re-raises, so the root cause is never lost;
* a watchdog thread on every rank polls that key (``poll_s``) with its own store client and
  acknowledges it; the runner checks the flag between ops and raises `PipelineAborted` naming the
  root cause; a rank whose communication fails looks the root cause up before raising;
* a rank still stuck in a blocking call ``abort_after_s`` seconds after the flag appeared prints
  the root cause and leaves with ``os._exit(1)`` — the bound that makes "no hang" true on gloo;
* the rank hosting the store waits (up to ``timeout_s``) until every rank has acknowledged before it
  raises, so the store outlives everyone's look-up.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

MSG_KEY = "dynabatch/failure/message"
ACK_KEY = "dynabatch/failure/acks"
CLAIM_KEY = "dynabatch/failure/claim"
CLOSE_KEY = "dynabatch/closed"


class PipelineAborted(RuntimeError):
    """Another rank failed (its error text is this exception's message) or the ranks lost contact."""


class FailureMonitor:
    """Failure side channel of one rank over a Store (see the module docstring).

    ``store`` is used from the main thread, ``watch_store`` (a second client of the same store,
    e.g. ``store.clone()``) from the watchdog thread. ``where`` names this rank in messages.
    """

    def __init__(self, store, watch_store, *, rank: int, world_size: int, where: str, is_host: bool,
                 poll_s: float = 0.05, abort_after_s: float | None = 5.0, timeout_s: float = 60.0):
        self.store = store
        self.watch_store = watch_store
        self.rank = rank
        self.world_size = world_size
        self.where = where
        self.is_host = is_host
        self.poll_s = poll_s
        self.abort_after_s = abort_after_s
        self.timeout_s = timeout_s
        self._failure: str | None = None
        self._seen_at: float | None = None
        self._acked = False
        self._own = False
        self._active = 0  # >0 while the main thread is inside runner code
        self._handling = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # -- watchdog ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the watchdog thread (a daemon)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name=f"dynabatch-watchdog-{self.rank}", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the watchdog thread."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.poll_s + 1.0)
        self._thread = None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                if self._failure is None and self.watch_store.check([MSG_KEY]):
                    self._record(self.watch_store.get(MSG_KEY).decode(errors="replace"))
                if self._failure is not None and not self._acked:
                    self._ack(self.watch_store)
            except Exception as e:  # the store host is gone
                if self._stop.is_set():
                    return
                if self._active and self._failure is None:
                    self._record(f"rank {self.rank} lost contact with the coordination store ({type(e).__name__}: "
                                 f"{e}); the rank hosting it (rank 0) probably died")
            self._maybe_hard_exit()

    def _record(self, message: str) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = message
                self._seen_at = time.monotonic()

    def _ack(self, store) -> None:
        with self._lock:
            if self._acked:
                return
            self._acked = True
        try:
            store.add(ACK_KEY, 1)
        except Exception:
            pass

    def _maybe_hard_exit(self) -> None:
        if (self.abort_after_s is None or self._failure is None or self._own or not self._active or self._handling
                or time.monotonic() - self._seen_at < self.abort_after_s):
            return
        sys.stderr.write(f"dynabatch.pipeline: rank {self.rank} ({self.where}) aborting: still blocked "
                         f"{self.abort_after_s:.1f} s after a failure elsewhere: {self._failure}\n")
        sys.stderr.flush()
        self._ack(self.watch_store)
        if self.is_host:
            self._wait_for_acks(self.watch_store)
        os._exit(1)

    # -- main thread ---------------------------------------------------------------------------
    @property
    def failure(self) -> str | None:
        """The root-cause message once any rank has failed, else None."""
        return self._failure

    def enter(self) -> None:
        """Mark the main thread as inside runner code (a stuck rank may be ended after a failure)."""
        self._active += 1

    def leave(self) -> None:
        """Undo `enter`."""
        self._active -= 1

    def raise_if_failed(self) -> None:
        """Raise `PipelineAborted` if some rank (this one included, in an earlier step) has reported a
        failure (cheap: no store access)."""
        if self._failure is not None:
            raise PipelineAborted(self._failure)

    def _lookup(self, grace_s: float) -> str | None:
        deadline = time.monotonic() + grace_s
        while True:
            if self._failure is not None:
                return self._failure
            try:
                if self.store.check([MSG_KEY]):
                    self._record(self.store.get(MSG_KEY).decode(errors="replace"))
                    return self._failure
            except Exception:
                return self._failure
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(self.poll_s, 0.05))

    def report(self, exc: BaseException, *, comm_error: bool = False) -> BaseException:
        """Handle ``exc`` raised on this rank and return the exception the caller should raise.

        If another rank already failed (or fails within a short grace period when ``exc`` is a
        communication error, which is usually a consequence), return `PipelineAborted` with that
        root cause. Otherwise publish ``exc`` as the root cause and return ``exc`` itself. Either
        way this rank acknowledges, and the store host waits for every rank's acknowledgement.
        """
        self._handling = True
        try:
            if isinstance(exc, PipelineAborted):
                out = exc
            else:
                root = self._lookup(grace_s=min(2.0, self.timeout_s) if comm_error else 0.0)
                if root is None:
                    root = self._publish(exc)
                out = exc if self._own else PipelineAborted(root)
            self._ack(self.store)
            if self.is_host:
                self._wait_for_acks(self.store)
            return out
        finally:
            self._handling = False

    def _publish(self, exc: BaseException) -> str:
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
        msg = f"rank {self.rank} ({self.where}) failed: {type(exc).__name__}: {exc}{where}"
        try:
            first = self.store.add(CLAIM_KEY, 1) == 1
            if first:
                self.store.set(MSG_KEY, msg)
            else:  # someone else claimed first: theirs is the root cause
                got = self._lookup(grace_s=1.0)
                if got is not None:
                    return got
        except Exception:
            pass
        self._own = True
        self._record(msg)
        return msg

    def _wait_for_acks(self, store) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                if store.add(ACK_KEY, 0) >= self.world_size:
                    return
            except Exception:
                return
            time.sleep(0.02)

    def close(self, *, wait: bool = True) -> None:
        """Normal shutdown: every rank checks in; the store host waits (up to ``timeout_s``) for all of
        them so that no rank loses the store while finishing its last step."""
        self.stop()
        if self._failure is not None:
            return
        try:
            self.store.add(CLOSE_KEY, 1)
            if self.is_host and wait:
                deadline = time.monotonic() + self.timeout_s
                while time.monotonic() < deadline and self.store.add(CLOSE_KEY, 0) < self.world_size:
                    if self.store.check([MSG_KEY]):
                        break
                    time.sleep(0.02)
        except Exception:
            pass
