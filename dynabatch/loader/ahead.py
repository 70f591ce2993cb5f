"""`Ahead`: run a generator in a background thread, up to ``depth`` items ahead of its consumer.

The loaders use it to plan the next steps while the current one trains. The thread computes item
``i`` only once the consumer has taken item ``i - depth``: how far it runs ahead depends on what
the consumer took, never on timing. That matters when producing an item involves a collective
with other ranks (the streaming planner): when every rank's consumer stops after the same step,
every rank's producer has entered exactly the same collectives, and `close` with ``drain=True``
lets the producer finish that window instead of abandoning a collective its peers are in.
Errors raised by the generator are re-raised in the consumer.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

_ITEM, _END, _ERROR = 0, 1, 2


class Ahead:
    """Iterator over ``make_iter()``'s items, produced by a daemon thread up to ``depth`` ahead
    (``depth <= 0``: no thread, items are produced on demand in the consumer's thread).

    ``drain``: on `close`, keep producing until the window (items taken + ``depth``) is full
    rather than stopping at the next item (see the module docstring).
    """

    def __init__(self, make_iter: Callable[[], Iterator], depth: int, name: str = "dynabatch-planner",
                 drain: bool = False):
        self._depth = int(depth)
        self._drain = drain
        self._closing = False
        self._hard_stop = False
        self._taken = 0
        self._produced = 0
        self._done = False
        self._cond = threading.Condition()
        if self._depth <= 0:
            self._it = iter(make_iter())
            self._thread = None
            return
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(make_iter,), name=name, daemon=True)
        self._thread.start()

    def _may_produce(self) -> bool:
        """Wait until the window has room; False when the thread should stop instead."""
        with self._cond:
            while True:
                if self._hard_stop or (self._closing and not self._drain):
                    return False
                if self._produced < self._taken + self._depth:
                    return True
                if self._closing:  # draining, and the window is full: done
                    return False
                self._cond.wait(0.1)

    def _run(self, make_iter) -> None:
        try:
            it = iter(make_iter())
            while self._may_produce():
                try:
                    item = next(it)
                except StopIteration:
                    self._q.put((_END, None))
                    return
                with self._cond:
                    self._produced += 1
                self._q.put((_ITEM, item))
        except BaseException as e:  # handed to the consumer, which re-raises it
            self._q.put((_ERROR, e))

    def __iter__(self):
        return self

    def __next__(self):
        if self._thread is None:
            return next(self._it)
        if self._done:
            raise StopIteration
        kind, value = self._q.get()
        if kind == _ITEM:
            with self._cond:
                self._taken += 1
                self._cond.notify_all()
            return value
        self._done = True
        if kind == _ERROR:
            raise value
        raise StopIteration

    def close(self, wait: float = 0.0) -> None:
        """Stop producing (after the current window when draining); with ``wait`` seconds, also
        wait for the thread, and stop it outright if it is not done by then."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None and wait:
            self._thread.join(wait)
            if self._thread.is_alive():
                with self._cond:
                    self._hard_stop = True
                    self._cond.notify_all()


def fork_available() -> bool:
    """Whether `ProcessAhead` can run: the ``fork`` start method and more than one CPU."""
    import multiprocessing
    import os

    if "fork" not in multiprocessing.get_all_start_methods():
        return False
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return cpus > 1


def _process_main(make_iter, depth, conn, parent_pid=None, from_main=False) -> None:
    if parent_pid is not None:
        from .processes import watch_parent

        watch_parent(parent_pid, from_main)  # die with the parent, even when it is SIGKILLed
    credits = 2 * max(int(depth), 1)
    try:
        for item in make_iter():
            while credits <= 0:
                msg = conn.recv()
                if msg is None:
                    return
                credits += msg
            conn.send((_ITEM, item))
            credits -= 1
        conn.send((_END, None))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
    except BaseException as e:  # handed to the consumer, which re-raises it
        try:
            conn.send((_ERROR, e))
        except Exception:
            conn.send((_ERROR, RuntimeError(f"{type(e).__name__}: {e}")))
    finally:
        conn.close()


class ProcessAhead:
    """`Ahead` in a forked child process instead of a thread: the items are produced without
    holding the consumer's GIL (the indexed planner is pure Python/numpy and needs no collective).
    The child gets the generator by ``fork`` (nothing is pickled on the way in); items come back
    pickled through a pipe, at most ``2 * depth`` (``depth`` >= 1) ahead of the consumer (the
    consumer hands out credits ``depth`` items at a time to keep the pipe traffic low). `close`
    terminates the child. The fork happens under `dynabatch.loader.processes.fork_lock` (never
    while numba compiles) and the child dies with its parent (`processes.watch_parent`)."""

    def __init__(self, make_iter: Callable[[], Iterator], depth: int, name: str = "dynabatch-planner"):
        import multiprocessing
        import os

        from .processes import fork_lock, in_main_thread

        ctx = multiprocessing.get_context("fork")
        self._conn, child = ctx.Pipe(duplex=True)
        self._done = False
        self._depth = max(int(depth), 1)
        self._taken = 0
        self._proc = ctx.Process(target=_process_main, args=(make_iter, depth, child, os.getpid(), in_main_thread()),
                                 name=name, daemon=True)
        with fork_lock():
            self._proc.start()
        child.close()

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self._done = True
            raise RuntimeError(f"the planning process exited unexpectedly (exit code {self._proc.exitcode})") from None
        if kind == _ITEM:
            self._taken += 1
            if self._taken % self._depth == 0:  # credits in batches: one write per `depth` items
                try:
                    self._conn.send(self._depth)
                except OSError:
                    pass
            return value
        self._done = True
        self.close()
        if kind == _ERROR:
            raise value
        raise StopIteration

    def close(self, wait: float = 0.0) -> None:
        """Stop the child process (terminated when it does not stop within ``wait`` seconds)."""
        if self._proc is None:
            return
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(min(wait, 1.0) if wait else 0.05)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(1.0)
        self._conn.close()
        self._proc = None
