"""Each kernel compiles once per machine, not once per process that starts while its cache is empty.

Numba's on-disk cache (``cache=True``) saves a kernel once one process has compiled it, but processes that
start together on a fresh install (the ranks of a launch, DataLoader workers, a fork server and its
parent, Ray workers) all find it empty and each compile the same kernels: measured over a fresh clone's test
suite, the two test workers and a fork server compiled the planner's kernels side by side, 113 of 262 kernel
signatures two or three times (71 of 195 compile CPU-s). `install` wraps numba's compile step for
dynabatch's cached kernels in an exclusive file lock beside the kernel's cache index: the first process
compiles and saves; one that arrives meanwhile waits on the lock, then numba's own compile step finds
the saved kernel and loads it. Locks are `fcntl.flock` locks, which the operating system drops with
the process that held them, so a killed compiler leaves no stale lock. Where the lock cannot be taken
(no ``fcntl``, an unwritable cache folder) numba compiles as before.

Every dynabatch kernel module takes ``njit`` from here (numba's own, re-exported once `install` has run).

A process about to compile a kernel that no process has saved yet says so once on a terminal
(`announce_compile`): a fresh install's first plan otherwise sat silent for ~45 s.

Order: a process takes numba's own compiler lock first, then file locks in the order its compiles nest
(a kernel before the kernels it calls), so two processes wait on each other only along the call graph,
which has no cycles. A kernel that calls itself with other types finds its lock already held here.
"""

from __future__ import annotations

import contextlib
import os
import sys

from numba import njit
from numba.core import sigutils
from numba.core.caching import NullCache
from numba.core.compiler_lock import global_compiler_lock
from numba.core.dispatcher import Dispatcher

try:
    import fcntl
except ImportError:  # not POSIX: numba compiles as it would without this module
    fcntl = None

#: Modules whose cached kernels compile under the lock (other libraries' numba code is left alone).
PACKAGE = "dynabatch."

#: A kernel's lock file is its cache index's path plus this (`lock_path`; `announce_compile` strips it again).
LOCK_SUFFIX = ".lock"

_held: set[str] = set()  # lock files this process holds (numba's compiler lock makes this one thread's set)
_announced = False  # whether this process has said that it compiles kernels (`announce_compile`)

#: The line `announce_compile` writes: a first run on a fresh install spends ~45 s (2 cores, measured for the
#: planner's kernels) compiling before it prints anything else.
COMPILE_NOTICE = ("dynabatch: compiling its numba kernels into their on-disk cache (first run of this install "
                  "only: about a minute on 2 cores; later runs load them)\n")


def lock_path(dispatcher) -> str | None:
    """The lock file of a cached dynabatch kernel (its cache index's path + ``.lock``), else None."""
    cache = getattr(dispatcher, "_cache", None)
    if fcntl is None or cache is None or isinstance(cache, NullCache):
        return None
    if not getattr(dispatcher.py_func, "__module__", "").startswith(PACKAGE):
        return None
    index = getattr(getattr(cache, "_cache_file", None), "_index_path", None)
    return None if index is None else index + LOCK_SUFFIX


@contextlib.contextmanager
def compiling(path: str | None):
    """Hold the exclusive lock ``path`` (from `lock_path`) while this process compiles; re-entrant, and a
    no-op when ``path`` is None or the lock file cannot be opened."""
    if path is None or path in _held:
        yield
        return
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _held.add(path)
        try:
            yield
        finally:
            _held.discard(path)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def announce_compile(lock: str, stream=None) -> bool:
    """Before this process compiles the kernel whose `lock_path` is ``lock``: if its cache index is missing
    (no process compiled it on this machine yet), write `COMPILE_NOTICE` once per process to ``stream``
    (default stderr) when that is a terminal, so a first run does not sit silent for a minute; logs and pipes
    get nothing, as with the progress bars. Returns whether it wrote."""
    global _announced
    stream = sys.stderr if stream is None else stream
    if _announced or os.path.exists(lock[:-len(LOCK_SUFFIX)]):
        return False
    try:
        if not stream.isatty():
            return False
        stream.write(COMPILE_NOTICE)
        stream.flush()
    except (AttributeError, OSError, ValueError):  # no stream, or a closed one: compiling matters more
        return False
    _announced = True
    return True


def install() -> None:
    """Wrap `numba.core.dispatcher.Dispatcher.compile` (once per process) so that a dynabatch kernel missing
    from this process compiles under its `lock_path` lock, after which numba loads what another process
    saved meanwhile."""
    if getattr(Dispatcher.compile, "_dynabatch_once", False):
        return
    numba_compile = Dispatcher.compile

    def compile(self, sig):
        path = lock_path(self)
        if path is None:
            return numba_compile(self, sig)
        with global_compiler_lock:  # numba's lock before the file lock, as every compile in this process takes them
            args, _ = sigutils.normalize_signature(sig)
            if tuple(args) in self.overloads:  # already here: numba returns it without compiling
                return numba_compile(self, sig)
            with compiling(path):
                # under the lock (a kernel another process just saved is not news), in a writable cache
                if path in _held:
                    announce_compile(path)
                return numba_compile(self, sig)

    compile._dynabatch_once = True
    compile.__doc__, compile.__wrapped__ = numba_compile.__doc__, numba_compile
    Dispatcher.compile = compile


install()

__all__ = ["COMPILE_NOTICE", "PACKAGE", "announce_compile", "compiling", "install", "lock_path", "njit"]
