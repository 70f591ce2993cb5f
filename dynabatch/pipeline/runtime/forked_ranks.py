"""`launch_local`'s ``"forkserver"`` start method: ranks forked from a fork server of this module's own.

Each server (`fork_server`) is a `multiprocessing.forkserver.ForkServer` that imported torch,
`dynabatch.pipeline` and the op-order kernels (`dynabatch.pipeline.runtime.preload`) once, one per
import-time environment of the launching process; `ForkedRank` is a rank forked from it and
`forked_rank` what that rank runs (what ``python -c`` does in a fresh interpreter). What is honoured
and what makes a launch fall back to spawn: see `dynabatch.pipeline.runtime.launch`.
"""

from __future__ import annotations

import atexit
import gc
import io
import multiprocessing
import os
import sys
import threading
import traceback
import types
from dataclasses import dataclass

from .orphans import watch_launcher
from .rank_main import heartbeat, rank_main

# prefixes of environment variables that Python, torch, numba, the BLAS/OpenMP runtimes or the HF
# libraries read when the interpreter starts or a module is imported: a forked rank cannot honour a
# change of one. Excepted: OMP_NUM_THREADS and PYTHONPATH (set explicitly, see the launch module doc), and
# variables read only when used, which a forked rank honours as it is: TORCHINDUCTOR_CACHE_DIR (torch reads
# it whenever inductor uses its cache, and sets it to its default the first time, e.g. on importing
# transformers' Trainer) and PYTHONBREAKPOINT (read at each breakpoint(); ray.init sets it). Each gave the
# suite's test workers a second server, a second preload of torch and transformers.
IMPORT_TIME_ENV = ("PYTHON", "TORCH", "PYTORCH", "NUMBA_", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_",
                   "LD_", "MALLOC_", "CUDA_", "CUBLAS_", "HF_", "TRANSFORMERS_", "TOKENIZERS_")
_HONOURED_ENV = ("OMP_NUM_THREADS", "PYTHONPATH", "PYTHONUNBUFFERED", "TORCHINDUCTOR_CACHE_DIR", "PYTHONBREAKPOINT")
# this module's fork servers by import-time environment (`_server_for`): "server", "popen", once
# started "pid"
_servers: dict = {}
_server_lock = threading.Lock()


def _import_env(env) -> tuple:
    """The variables of ``env`` a forked rank cannot change (`IMPORT_TIME_ENV`, less the honoured ones)."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k not in _HONOURED_ENV))


def _server_for(key: tuple) -> dict:
    """This module's fork server for the import-time environment ``key`` (made on first use): a
    `multiprocessing.forkserver.ForkServer` of its own and the `Popen` class that asks it."""
    if key not in _servers:
        from multiprocessing import forkserver, popen_forkserver

        server = forkserver.ForkServer()
        # popen_forkserver.Popen._launch as it is, run with a `forkserver` that names our server: the
        # stdlib one asks the module's process-wide server (its code reads no other name of ours)
        launch_code = popen_forkserver.Popen._launch.__code__
        assert not launch_code.co_freevars, "popen_forkserver.Popen._launch changed: re-check this rebinding"
        names = {**vars(popen_forkserver), "forkserver": _ServerModule(server, forkserver.read_signed)}
        popen = type("Popen", (popen_forkserver.Popen,), {"_launch": types.FunctionType(launch_code, names)})
        _servers[key] = {"server": server, "popen": popen}
    return _servers[key]


@dataclass(frozen=True)
class _ServerModule:
    """What `popen_forkserver.Popen._launch` uses of the `multiprocessing.forkserver` module, on one server."""

    server: object
    read_signed: object

    def connect_to_new_process(self, fds):
        return self.server.connect_to_new_process(fds)


class _ServerProcess(getattr(multiprocessing.context, "ForkServerProcess", multiprocessing.Process)):
    """A process forked by one of this module's fork servers (``server_key``, see `_server_for`); a
    module-level class, since the server unpickles it. (Windows has no fork servers: the base is only
    there to import.)"""

    server_key: tuple = ()

    @staticmethod
    def _Popen(process_obj):  # noqa: N802 - multiprocessing's name
        return _servers[process_obj.server_key]["popen"](process_obj)


def fork_server(preload: tuple[str, ...], rank_env: dict) -> tuple | None:
    """The key (`_server_for`) of the fork server started with today's import-time environment
    (importing ``preload``; again if it died), to fork ranks with ``rank_env`` from; None where
    ``rank_env`` changes a variable read at import time or the platform has no fork servers."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    key = _import_env(os.environ)
    if _import_env(rank_env) != key:
        return None
    with _server_lock:
        entry = _server_for(key)
        server = entry["server"]
        if server._forkserver_pid is None:  # noqa: SLF001 - a server already running keeps its imports
            server.set_forkserver_preload(["dynabatch.pipeline.runtime.preload", *preload])
        server.ensure_running()  # (re)starts it now, with today's os.environ, if it is not running
        entry["pid"] = server._forkserver_pid  # noqa: SLF001
    return key


class ForkedRank:
    """A rank forked from the fork server, with the parts of `subprocess.Popen` `launch_local` uses."""

    def __init__(self, server_key: tuple, argv: list[str], env: dict, out: str, err: str, threads: int):
        self._p = _ServerProcess(target=forked_rank, args=(argv, env, out, err, threads), name="dynabatch-rank")
        self._p.server_key = server_key
        self._p.start()
        self.pid = self._p.pid

    def poll(self) -> int | None:
        """The rank's exit status, None while it runs (as `subprocess.Popen.poll`)."""
        return self._p.exitcode

    @property
    def returncode(self) -> int | None:
        """The rank's exit status, None while it runs."""
        return self._p.exitcode

    def kill(self) -> None:
        """SIGKILL the rank."""
        self._p.kill()

    def wait(self) -> int | None:
        """Wait for the rank to end; its exit status."""
        self._p.join()
        return self._p.exitcode


def _exit_code(code: object) -> int:
    """The exit status ``sys.exit(code)`` gives an interpreter (a message is printed to stderr)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def forked_rank(argv: list[str], env: dict, out: str, err: str, threads: int) -> None:
    """A rank in a child of the fork server: what ``python -c _CHILD`` does in a fresh interpreter, on
    the server's imports (see the launch module doc for what is honoured)."""
    # the server's heap (torch, transformers, the kernels: ~0.5 million objects) lives as long as the
    # rank: out of the collector's sight, a full collection walks only what the rank made (walking that
    # heap took 0.27 s, measured), and collections no longer write to the pages shared with the server
    gc.freeze()
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    # written through at once (PYTHONUNBUFFERED): a print is progress as soon as it is made
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                                   errors="backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    watch_launcher(forked=True)  # before anything slow: a rank of a killed launcher dies at once
    heartbeat(0.0)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = ["", *paths, *(p for p in sys.path if p and p not in paths)]
    import torch

    torch.set_num_threads(threads)
    try:
        code = _exit_code(rank_main(argv))
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:  # as an interpreter does: die of the signal
        traceback.print_exc()
        code = -2
    except BaseException:  # noqa: BLE001 - an uncaught error: traceback, status 1
        sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()  # as the interpreter sets them
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # noqa: SLF001 - the part of an interpreter's teardown a worker may rely on
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        import signal

        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


