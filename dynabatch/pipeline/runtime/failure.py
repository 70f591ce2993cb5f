"""Ending every rank when one rank fails, stalls or dies, instead of hanging.

A rank blocked in a gloo receive cannot be interrupted (gloo has no abort: only the peer's process
exit or the process-group timeout wakes it), and a rank whose neighbour died may never learn why.
So failures and liveness travel on a side channel, the `torch.distributed` Store every rank already
shares:

* **errors**: the failing rank writes ``rank R (stage s, replica d) failed: ExcType: message at
  file:line`` and the tail of its traceback (`failure_text.root_cause`) under one key (first writer
  wins) before it re-raises, so the root cause is never lost, also where only another rank's output
  is shown; set-up (weights, runner, tied groups) follows the same protocol (`setup_guard`);
* **liveness**: the main thread records what it is doing (``set_state``: busy in a forward, waiting
  for a message from rank P, outside the runner, ...) and a progress counter that moves with every
  change; a watchdog thread publishes them with a heartbeat counter under ``dynabatch/live/R`` every
  ``heartbeat_s`` and whenever the state changed (checked every ``poll_s``);
* **waits**: `FailureMonitor.wait` waits for communication handles in a helper thread while the main
  thread watches: it raises `PipelineAborted` as soon as any failure is published, and every
  ``heartbeat_s`` it follows the wait-for chain from the ranks it waits on (a rank waiting on
  another points at it) to the first rank that is not waiting. That rank is blamed when it has made
  no progress for ``timeout_s`` (``stalled for N s in forward of micro-batch j of step k``), when its
  heartbeat stopped for ``dead_after_s`` (``died (no heartbeat for N s)``; sooner when its
  connection closed), or when it already closed its context; if everyone on the chain only waits,
  the ranks are deadlocked (idle time: `progress_clock`, which counts the CPU seconds of a rank busy
  or outside the runner while it computes, however slowly). The verdict is published like an error, so every rank raises it;
* the watchdog polls the error key (``poll_s``) with its own store client and acknowledges it; the
  runner checks the flag between ops and raises `PipelineAborted` naming the root cause;
* a rank still stuck in a blocking call (or the blamed rank itself) ``abort_after_s`` seconds after
  the flag appeared prints the root cause and leaves with ``os._exit(1)``;
* the rank hosting the store waits (a few seconds at most) until every rank has acknowledged before
  it raises, so the store outlives everyone's look-up; a rank found dead is acknowledged for. When
  the store itself stops answering, its host (rank 0) died, and the others say so.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from .failure_text import root_cause, short as _short
from .progress_clock import ProgressClock
from .verdict import LIVE_PREFIX, Peers, StoreGone
from .waits import Waiter, abandon_wait, note_daemon_calls

MSG_KEY = "dynabatch/failure/message"
ACK_KEY = "dynabatch/failure/acks"
CLAIM_KEY = "dynabatch/failure/claim"
CULPRIT_KEY = "dynabatch/failure/culprit"
CLOSE_KEY = "dynabatch/closed"

#: ``set_state`` kinds: ``busy`` (computing, posting), ``wait`` (blocked on peers), ``idle`` (outside
#: the runner), ``closed`` (the context was closed: this rank will post nothing more).
KINDS = ("busy", "wait", "idle", "closed")


class PipelineAborted(RuntimeError):
    """Another rank failed, stalled or died (this exception's message names it and what it was doing)."""


class FailureMonitor:
    """Failure and liveness side channel of one rank over a Store (see the module docstring).

    ``store`` is used from the main thread, ``watch_store`` (a second client of the same store,
    e.g. ``store.clone()``) from the watchdog thread. ``where`` names this rank in messages;
    ``num_stages`` names the others (``rank r (stage r % S, replica r // S)``). ``timeout_s``: no
    progress for that long is a stall. ``heartbeat_s`` (default ``min(1, timeout_s / 10)``): how
    often the heartbeat is published and a waiting rank checks the ranks it waits on.
    ``dead_after_s`` (default ``min(timeout_s, max(5, 10 * heartbeat_s))``): a heartbeat silent that
    long is a dead rank. ``threaded_waits``: wait in a helper thread (gloo); False waits in place
    (NCCL, whose waits do not block the host).
    """

    def __init__(self, store, watch_store, *, rank: int, world_size: int, where: str, is_host: bool,
                 poll_s: float = 0.05, abort_after_s: float | None = 5.0, timeout_s: float = 60.0,
                 num_stages: int = 1, heartbeat_s: float | None = None, dead_after_s: float | None = None,
                 threaded_waits: bool = True):
        # the main thread's own client: gloo's rendezvous (new_group in set-up) blocks in the process group's
        # client, holding its lock, while the main thread must still read the other ranks' heartbeats
        self.store = _own_client(store)
        self.watch_store = watch_store
        self.rank = rank
        self.world_size = world_size
        self.where = where
        self.is_host = is_host
        self.poll_s = poll_s
        self.abort_after_s = abort_after_s
        self.timeout_s = float(timeout_s)
        self.num_stages = max(int(num_stages), 1)
        self.heartbeat_s = float(heartbeat_s) if heartbeat_s else max(poll_s, min(1.0, self.timeout_s / 10))
        self.dead_after_s = float(dead_after_s) if dead_after_s else \
            min(self.timeout_s, max(5.0, 10 * self.heartbeat_s))
        self.threaded_waits = threaded_waits
        self._failure: str | None = None
        self._seen_at: float | None = None
        self._acked = False
        self._own = False
        self._blamed = False
        self._active = 0  # >0 while the main thread is inside runner code
        self._handling = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # liveness: written by the main thread, published by the watchdog
        self._state: tuple[str, str, tuple[int, ...]] = ("idle", "outside the runner before its first step", ())
        self._progress = 0
        self._clock = ProgressClock()  # the main thread's last progress
        self._beat = 0
        self._published = -1
        self._next_beat = 0.0
        self._peers = Peers(self.store, rank, world_size, self.name, self.timeout_s)  # what it saw of the others
        self._waiter: Waiter | None = None

    def name(self, rank: int) -> str:
        """``rank r (stage s, replica d)``."""
        return f"rank {rank} (stage {rank % self.num_stages}, replica {rank // self.num_stages})"

    # -- watchdog ------------------------------------------------------------------------------
    def start(self) -> None:
        """Publish the first heartbeat and start the watchdog thread (a daemon)."""
        if self._thread is None:
            try:
                self._heartbeat(self.watch_store, time.monotonic())
            except Exception:
                pass
            self._thread = threading.Thread(target=self._watch, name=f"dynabatch-watchdog-{self.rank}", daemon=True)
            note_daemon_calls()
            self._thread.start()

    def stop(self, *, join_s: float | None = None) -> None:
        """Stop the watchdog thread and an idle waiter thread, waiting ``join_s`` seconds for them
        (default ``2 * poll_s + 1``: after a failure the watchdog may be stuck in a call to a dead
        store host). A normal close waits until they are gone: a daemon thread whose store call (or
        gloo wait) returns while the interpreter exits ends in pthread_exit through C++ frames,
        which aborts the process (SIGABRT, "terminate called without an active exception")."""
        join_s = 2 * self.poll_s + 1.0 if join_s is None else join_s
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=join_s)
        self._thread = None
        if self._waiter is not None and self._waiter.current is None:
            self._waiter.close(join_s=join_s)
            self._waiter = None

    def _heartbeat(self, store, now: float) -> None:
        kind, text, peers = self._state
        self._published = self._progress
        self._beat += 1
        store.set(f"{LIVE_PREFIX}{self.rank}", json.dumps(
            {"n": self._beat, "p": self._progress, "k": kind, "t": text, "w": list(peers),
             "i": round(self._clock.idle(kind in ("busy", "idle"), now), 3)}))

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                now = time.monotonic()
                if now >= self._next_beat or self._progress != self._published:
                    self._next_beat = now + self.heartbeat_s
                    self._heartbeat(self.watch_store, now)
                if self._failure is None and self.watch_store.check([MSG_KEY]):
                    blamed = self.watch_store.check([CULPRIT_KEY]) and \
                        self.watch_store.get(CULPRIT_KEY).decode() == str(self.rank)
                    self._record(self.watch_store.get(MSG_KEY).decode(errors="replace"))
                    self._blamed = bool(blamed)
                if self._failure is not None and not self._acked:
                    self._ack(self.watch_store)
            except Exception as e:  # the store host is gone
                if self._stop.is_set():
                    return
                if self._active and self._failure is None:
                    self._record(self._store_lost(e))
            self._maybe_hard_exit()

    def _store_lost(self, e: BaseException) -> str:
        if self.is_host:
            return f"rank {self.rank} ({self.where}) lost its own coordination store ({type(e).__name__}: {e})"
        seen = self._peers.seen.get(0)
        last = f"; last seen {seen.info['t']}" if seen is not None and seen.info else ""
        return (f"{self.name(0)} died: the coordination store it hosts stopped answering "
                f"{self.name(self.rank)} ({type(e).__name__}: {_short(str(e))}){last}")

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
        if (self.abort_after_s is None or self._failure is None or self._own
                or not (self._active or self._blamed) or self._handling
                or time.monotonic() - self._seen_at < self.abort_after_s):
            return
        what = "blamed for" if self._blamed else "still blocked"
        sys.stderr.write(f"dynabatch.pipeline: rank {self.rank} ({self.where}) aborting: {what} "
                         f"{self.abort_after_s:.1f} s after a failure: {self._failure}\n")
        sys.stderr.flush()
        self._ack(self.watch_store)
        if self.is_host:
            self._wait_for_acks(self.watch_store)
        os._exit(1)

    # -- main thread: state ----------------------------------------------------------------------
    @property
    def failure(self) -> str | None:
        """The root-cause message once any rank has failed, else None."""
        return self._failure

    @property
    def state(self) -> tuple[str, str, tuple[int, ...]]:
        """What the main thread does now: (kind, text, peers) as `set_state` took them."""
        return self._state

    @property
    def active(self) -> bool:
        """Whether the main thread is inside runner or set-up code (between `enter` and `leave`)."""
        return self._active > 0

    def set_state(self, kind: str, text: str, peers=()) -> None:
        """Record what the main thread does now (one of `KINDS`; ``text`` reads after "stalled for N s",
        e.g. ``in forward of micro-batch 3 of step 7``; ``peers``: the ranks a ``wait`` waits on).
        Every call counts as progress. Cheap: no store access (the watchdog publishes it)."""
        self._state = (kind, text, tuple(peers))
        self._progress += 1
        self._clock.mark()

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

    # -- main thread: waiting with liveness checks -----------------------------------------------
    def wait(self, works, text: str, peers=()) -> None:
        """Wait for the communication handles ``works`` (state ``wait``: ``text``, on ``peers``).

        Raises `PipelineAborted` as soon as a failure is published anywhere, or when the wait-for
        chain from ``peers`` ends at a rank that stalled for ``timeout_s``, died or closed (this rank
        then publishes the verdict). A communication error is explained the same way when it can be
        (a dead peer); otherwise it is re-raised."""
        works = [w for w in works if w is not None]
        if not works:
            return
        self.set_state("wait", text, peers)
        if not self.threaded_waits:
            for w in works:
                w.wait()
            return
        if self._waiter is None:
            self._waiter = Waiter(self.rank)
        job = self._waiter.submit(works)
        next_check = time.monotonic() + self.heartbeat_s
        while not job.done.wait(self.poll_s):
            if self._failure is not None:
                self._waiter = None  # it may never come back from this wait
                abandon_wait()
                raise PipelineAborted(self._failure)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + self.heartbeat_s
                verdict = self._verdict(peers, now)
                if verdict is not None:
                    self._waiter = None
                    abandon_wait()
                    raise PipelineAborted(self._declare(*verdict))
        if job.error is not None:
            raise self.explain(job.error, peers)

    def explain(self, exc: BaseException, peers=()) -> BaseException:
        """The exception to raise for communication error ``exc`` (raised while talking to ``peers``):
        `PipelineAborted` with the root cause when another rank published one, or when a peer is dead
        (its heartbeat stays silent for a short confirmation period); else ``exc`` itself."""
        if isinstance(exc, PipelineAborted):
            return exc
        confirm = min(self.dead_after_s, max(3 * self.heartbeat_s, 1.5))
        deadline = time.monotonic() + confirm + self.heartbeat_s
        while True:
            root = self._lookup(grace_s=0.0)
            if root is not None:
                return PipelineAborted(root)
            now = time.monotonic()
            verdict = self._verdict(peers, now, dead_after_s=confirm, cause=f"{type(exc).__name__}: {exc}")
            if self._failure is not None:
                return PipelineAborted(self._failure)
            if verdict is not None:
                return PipelineAborted(self._declare(*verdict))
            if now >= deadline:
                return exc
            time.sleep(min(self.heartbeat_s / 2, 0.25))

    def _verdict(self, peers, now: float, *, dead_after_s: float | None = None, cause: str = ""):
        """Follow the wait-for chain from ``peers`` (`Peers.verdict`); return (culprit, message, dead) or None."""
        try:
            return self._peers.verdict(peers, now, self.dead_after_s if dead_after_s is None else dead_after_s,
                                       cause, self._clock.at, self._state[1])
        except StoreGone as gone:
            if self._failure is None:
                self._record(self._store_lost(gone.error))
            return None

    def _declare(self, culprit: int, message: str, dead: bool) -> str:
        """Publish a liveness verdict as the root cause (unless someone published one first)."""
        try:
            if self.store.add(CLAIM_KEY, 1) == 1:
                if dead:
                    self.store.add(ACK_KEY, 1)  # the dead rank cannot acknowledge
                self.store.set(CULPRIT_KEY, str(culprit))
                message = f"{message} [detected by {self.name(self.rank)}]"
                self.store.set(MSG_KEY, message)
                self._record(message)
                return self._failure
            got = self._lookup(grace_s=1.0)
            if got is not None:
                return got
        except Exception:
            pass
        self._record(message)
        return self._failure

    # -- main thread: errors ---------------------------------------------------------------------
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
        msg = root_cause(f"rank {self.rank} ({self.where})", exc)
        try:
            first = self.store.add(CLAIM_KEY, 1) == 1
            if first:
                self.store.set(CULPRIT_KEY, str(self.rank))
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
        # every live rank's watchdog acknowledges within a poll; a dead one was acknowledged for
        deadline = time.monotonic() + min(self.timeout_s, 10.0)
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
        if self._failure is None:
            self.set_state("closed", "after a normal end")
            try:
                self._heartbeat(self.store, time.monotonic())
            except Exception:
                pass
        # the store host waits for every rank's check-in below, so the watchdog's calls still return
        self.stop(join_s=self.timeout_s if self._failure is None else None)
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


def _own_client(store):
    try:
        return store.clone()
    except Exception:  # stores without clone(): share the client
        return store
