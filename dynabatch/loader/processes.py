"""Child processes of the loader: forked safely, and dying with their parent.

The loader forks two kinds of children: ``torch.utils.data.DataLoader`` workers (indexed and
streaming modes with ``num_workers > 0``) and its own planning processes (`ProcessAhead`,
``plan_processes``). Two things can go wrong with them:

* **A fork while numba compiles.** numba compiles (or loads from its on-disk cache) a kernel on
  its first call with new argument types, holding one process-wide lock. A child forked while
  another thread holds that lock (say the planning thread of another rank running in the same
  process) inherits it held, by a thread that does not exist in the child: the child's first
  kernel call then waits forever. So every fork of the loader happens inside `fork_lock`, which
  holds numba's compiler lock (no thread compiles while it forks) and releases the child's copy
  right after the fork. `warm_kernels` plans a tiny batch with the loader's cost model and options
  once per process, under the same lock, before the indexed mode forks: the children inherit
  every planning kernel compiled and never compile one themselves.
* **Orphans.** A SIGKILLed training process cannot shut its workers down; a worker blocked on a
  pipe that a sibling keeps open would then live (and hold its memory) forever. Every child calls
  `watch_parent` first thing: on Linux, when it was forked from the main thread, the kernel kills
  it when its parent dies (``prctl(PR_SET_PDEATHSIG, SIGKILL)``; the signal follows the *thread*
  that forked, hence main thread only); in every case a daemon thread polls whether the parent
  (its pid and start time) is still alive and kills the child once it is not (the portable
  fallback, the guard for children forked from other threads, and the only watch under
  ``forkserver``, whose workers are children of the fork server).
* **spawn and forkserver.** Workers started that way get the loader's objects pickled (the
  `PlanOptions`, the planner, the tokenizer, `WorkerInit`), import the packages afresh and compile
  (or load from numba's cache) their kernels themselves; nothing here relies on forked memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

import numpy as np

from ..process_identity import process_alive as _alive, process_start

_LOCK = threading.RLock()  # serializes forks, kernel warm-up and compiles (with numba's lock)
_held = threading.local()  # how deep this thread is in `fork_lock` (released in a forked child)
_warmed: set = set()
_PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 0.5


def _numba_lock():
    try:
        from numba.core.compiler_lock import global_compiler_lock
    except Exception:  # numba missing or reorganized: nothing to hold
        return None
    return global_compiler_lock


@contextlib.contextmanager
def fork_lock():
    """Hold the loader's process-wide lock and numba's compiler lock: no thread of this process
    compiles a kernel meanwhile. Fork children (or compile kernels meant for them) inside it."""
    nl = _numba_lock()
    with _LOCK:
        if nl is not None:
            nl.acquire()
        _held.depth = getattr(_held, "depth", 0) + 1
        try:
            yield
        finally:
            _held.depth -= 1
            if nl is not None:
                nl.release()


def _after_fork_in_child() -> None:
    """The child of a fork made inside `fork_lock`: its copies of the locks are held by the thread
    that forked (the child's only thread); release them so the child can compile."""
    depth = getattr(_held, "depth", 0)
    if not depth:
        return
    _held.depth = 0
    nl = _numba_lock()
    for _ in range(depth):
        for lock in ((nl, _LOCK) if nl is not None else (_LOCK,)):
            try:
                lock.release()
            except RuntimeError:  # not ours after all: start over with free locks
                if lock is _LOCK:
                    globals()["_LOCK"] = threading.RLock()
                elif hasattr(lock, "_lock"):
                    lock._lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# -- kernel warm-up --------------------------------------------------------------------------------
def _tiny_shapes(n: int = 12):
    from ..core.shapes import Shapes

    rng = np.random.default_rng(0)
    inp = rng.integers(4, 48, n).astype(np.int64)
    tgt = rng.integers(1, 16, n).astype(np.int64)
    vis = np.zeros(n, np.int64)
    return Shapes.from_lengths(inp, tgt, vis, sample_id=np.arange(n, dtype=np.int64))


def warm_kernels(cost, options) -> None:
    """Compile (or load from numba's cache) every kernel planning with ``cost`` and ``options``
    calls, by planning a tiny batch once per process, under `fork_lock`. Best effort: a tiny batch
    the options cannot plan compiles what it reached."""
    import dataclasses

    key = (type(cost).__qualname__, repr(options))
    if key in _warmed:
        return
    with fork_lock():
        if key in _warmed:
            return
        from ..core.plan.planner import plan_microbatches
        from ..core.plan.steps import global_batches, plan_step

        shapes = _tiny_shapes()
        tries = [lambda: global_batches(shapes, cost, options, 0),
                 lambda: plan_step(shapes, cost, options, np.arange(len(shapes)), 0),
                 lambda: plan_microbatches(shapes, cost, dataclasses.replace(
                     options, num_ranks=1, equal_microbatches=False,
                     memory_limit=options.memory_limit if options.memory_limit is not None
                     else cost.memory_limit(options.num_stages, options.num_ranks)), step=0)]
        for fn in tries:
            try:
                fn()
            except Exception:  # noqa: BLE001 - warm-up only; the real call reports real errors
                pass
        _warmed.add(key)


# -- parent death ------------------------------------------------------------------------------------
def _set_pdeathsig() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except Exception:  # noqa: BLE001 - no prctl: the watch thread still runs
        return False


def _die() -> None:
    try:
        os.kill(os.getpid(), signal.SIGKILL)
    finally:
        os._exit(1)


def watch_parent(parent_pid: int, forked_from_main: bool = False, parent_start: str | None = None) -> None:
    """Make this child process die when ``parent_pid`` (the process that started it) does (see the
    module docstring). Under ``forkserver`` the child's OS parent is the fork server, not
    ``parent_pid``: then only the poll of ``parent_pid`` (and ``parent_start``, its
    `process_start`) tells, not ``os.getppid()`` nor the kernel's parent-death signal."""
    direct = os.getppid() == parent_pid
    if forked_from_main and direct:
        _set_pdeathsig()
    if not _alive(parent_pid, parent_start):  # the parent died before we got here
        _die()

    def poll():
        import time

        while True:
            time.sleep(PARENT_POLL_S)
            if (direct and os.getppid() != parent_pid) or not _alive(parent_pid, parent_start):
                _die()

    threading.Thread(target=poll, name="dynabatch-parent-watch", daemon=True).start()


def in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class WorkerInit:
    """``worker_init_fn`` of the loader's torch DataLoaders: `watch_parent`, then the user's
    ``worker_init_fn`` (if any). Picklable, for the ``spawn``/``forkserver`` contexts."""

    def __init__(self, user_fn=None):
        self.user_fn = user_fn
        self.parent_pid = os.getpid()
        self.parent_start = process_start(self.parent_pid)
        self.from_main = in_main_thread()

    def __call__(self, worker_id: int) -> None:
        watch_parent(self.parent_pid, self.from_main, self.parent_start)
        if self.user_fn is not None:
            self.user_fn(worker_id)


def collate_as_is(item):
    """``collate_fn`` of the loader's torch DataLoaders: the worker's item unchanged (a worker delivers a whole
    chunk or step, collated already). A module-level function, picklable for ``spawn``/``forkserver``."""
    return item


def start_workers(make_iter):
    """``make_iter()`` (what forks: ``iter(torch DataLoader)``, starting a process) inside `fork_lock`."""
    with fork_lock():
        return make_iter()
