"""Waiting for communication handles off the main thread: gloo waits cannot be interrupted, so a
helper thread waits and the main thread keeps watching for failures (`FailureMonitor.wait`).

A process that abandoned such a wait after a failure leaves with ``os._exit(1)`` at interpreter exit
(see `_exit_after_abandoned_wait`)."""

from __future__ import annotations

import atexit
import logging
import os
import queue
import sys
import threading

_abandoned_waits = False
_daemon_calls = False  # a daemon thread of ours may sit in a blocking C++ call (store, gloo) at exit


def _exit_after_abandoned_wait() -> None:
    """At interpreter exit after a failure, a helper thread may still be blocked in a gloo wait. If that
    wait ends during finalization (its peer exits), CPython 3.11 ends the thread with pthread_exit, whose
    unwinding through C++ frames aborts the process (SIGABRT, "terminate called without an active
    exception"); so does a daemon thread caught in a blocking store call. So a process that is exiting
    on an uncaught exception (status 1) after abandoning a wait, or while such a daemon thread may be
    running, leaves right away, with its output flushed. Registered at import: runs after handlers
    registered later."""
    if (_abandoned_waits or _daemon_calls) and getattr(sys, "last_value", None) is not None:
        _leave(1)


def _leave(code: int) -> None:
    """Flush logging and the standard streams, then end the process with ``code`` at once."""
    try:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


atexit.register(_exit_after_abandoned_wait)


def note_daemon_calls() -> None:
    """A daemon thread that makes blocking C++ calls (the failure watchdog's store look-ups) started:
    exiting on an uncaught error then leaves at once too (see `_exit_after_abandoned_wait`)."""
    global _daemon_calls
    _daemon_calls = True


def abandon_wait() -> None:
    global _abandoned_waits
    _abandoned_waits = True


def abandoned() -> bool:
    """Whether this process gave up waiting on a communication handle (after a failure)."""
    return _abandoned_waits


def exit_if_abandoned(code: int) -> None:
    """Leave now with ``code`` (output flushed) when a wait was abandoned: a process that handled its
    failure itself (e.g. a launcher that prints the error and returns 1) would otherwise meet the
    same abort at interpreter exit that `_exit_after_abandoned_wait` avoids for uncaught errors."""
    if _abandoned_waits:
        _leave(code)


class _Job:
    __slots__ = ("works", "done", "error")

    def __init__(self, works):
        self.works = works
        self.done = threading.Event()
        self.error: BaseException | None = None


class Waiter:
    """A daemon thread that waits for communication handles, so that the main thread never blocks in
    an uninterruptible gloo wait. After a failure it may stay stuck in a wait forever (harmless)."""

    def __init__(self, rank: int):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.current: _Job | None = None
        self.thread = threading.Thread(target=self._run, name=f"dynabatch-waiter-{rank}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self.current = job
            try:
                for w in job.works:
                    w.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                job.error = e
            finally:
                self.current = None
                job.done.set()

    def submit(self, works) -> _Job:
        job = _Job(works)
        self.jobs.put(job)
        return job

    def close(self, join_s: float = 0.0) -> None:
        """End the thread (idle: no wait in progress), waiting up to ``join_s`` seconds for it."""
        self.jobs.put(None)
        if join_s > 0:
            self.thread.join(timeout=join_s)
