"""Run a function on N local processes (one per rank) — for CPU/gloo experiments and tests.

``launch_local("path/to/file.py:worker", nprocs, args=...)`` starts ``nprocs`` Python processes,
each calling ``worker(rank, world_size, port, *args)`` with a shared free ``port`` on 127.0.0.1
(pass it to `dynabatch.pipeline.init_pipeline` as ``master_port``). A JSON-serializable return value
comes back in `ProcResult.result`; each process's exit code, stdout and stderr are kept.

Timeouts are **liveness** timeouts, not wall clocks: the ranks are killed (each by its own pid) and
marked ``timed_out`` only when *none* of them made progress for ``idle_timeout_s`` seconds (the
old keyword ``timeout_s`` means the same). Progress is anything a rank shows the outside world:
a byte written to its stdout or stderr, a rank exiting, or a call to `heartbeat` (which touches
the file named by the ``DYNABATCH_HEARTBEAT`` environment variable; a worker that computes for a
long time without printing calls it once per step). Outside the worker function (the interpreter's
start and the imports of torch and dynabatch before it, the interpreter's teardown after it: 30 s
and 19 s, silent, measured on a 2-core machine at load 14-20) a rank's CPU time is progress too:
CPU seconds of ``CPU_PROGRESS_SHARE x idle_timeout_s`` since the last sign of life count as one
(`process_cpu_s`, Linux). Inside the worker function CPU time is not progress, so a rank spinning
in a hung loop is killed.
A slow machine therefore only makes a run slower, never failed, while a hang (every rank blocked)
is still killed within about ``idle_timeout_s``. ``max_wall_s`` is an optional whole-run cap, a last resort only.

Liveness nests: while its ranks make progress, `launch_local` itself calls `heartbeat`, so a
process that runs ``launch_local`` under a parent watching ``DYNABATCH_HEARTBEAT`` (another
``launch_local``, or the test suite's ``tests/liveness.py``) looks alive exactly while its ranks do.

**Start methods** (``start_method``, default ``$DYNABATCH_LAUNCH_START``, else ``"spawn"``): ``"spawn"``
starts each rank as a fresh ``python -c`` interpreter (as torchrun does; ~4.9 s CPU per rank for the
imports of torch and dynabatch). ``"forkserver"`` forks each rank from a server process
(`multiprocessing`'s fork server) that imported torch, `dynabatch.pipeline`, the op-order kernels
(`dynabatch.pipeline.runtime.preload`) and the modules in ``preload`` once, when the first such launch of
this process started it. A forked rank gets the same environment (``os.environ`` is replaced by the one
a spawned rank would get), ``torch.set_num_threads(threads_per_proc)`` (torch read ``OMP_NUM_THREADS``
before it was set), the ``PYTHONPATH`` entries at the front of ``sys.path`` (the launcher's other
``sys.path`` entries stay after them), its stdout and stderr on fds 1 and 2 of the same files, written
through at once, the same exit codes and the same liveness rules. What it cannot honour makes the launch
fall back to spawn: an ``env`` that changes a variable read at interpreter start or import time
(`forked_ranks.IMPORT_TIME_ENV`), or a platform without fork servers. The servers are ``launch_local``'s own, one per
import-time environment of this process (a variable such as ``TOKENIZERS_PARALLELISM`` set since an
earlier launch gets a new server, as a fresh interpreter would see it), not the one `multiprocessing`
shares across a process, so other code that started that one first (a ``DataLoader`` with
``multiprocessing_context="forkserver"``) neither stops ranks forking nor gets ranks forked from a
server without torch. Differences that remain: a forked rank's stdin is ``/dev/null``; after the worker
it runs the ``atexit`` handlers and leaves with ``os._exit``, skipping the rest of the interpreter's
teardown (module and thread finalization); the caller's main script is imported as ``__mp_main__``
(as multiprocessing does; keep its work under ``if __name__ == "__main__"``); modules in ``preload``
that the running server did not import are imported by each rank itself. The machinery is in
`dynabatch.pipeline.runtime.forked_ranks`.

**A killed launcher takes its ranks with it** (`dynabatch.pipeline.runtime.orphans`): every rank, spawned
or forked, dies within about a second of the launcher's death, however it died (SIGKILL included: the
kernel's parent-death signal, and a watch of the launcher's pid and start time; measured in
``tests/test_launch_orphans.py``), and the next launch removes the folder a killed launch left under
the temp dir (``dynabatch-launch-PID-START-*``). Under ``torchrun`` (`run_ranks` with ``RANK`` and
``WORLD_SIZE`` set) none of this applies: torchrun starts and stops the ranks by its own rules (each
rank in its own session, stopped when torchrun gets SIGTERM, SIGINT, SIGHUP or SIGQUIT; a SIGKILLed
torchrun does not stop them), and dynabatch adds no watch.

**Which rank failed.** A rank whose worker raised records when (`ProcResult.failed_s`); `run_ranks`
names the rank that failed first by that time (else by its exit), not the lowest failing rank: when
one rank fails, the others usually fail after it, because of it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from .forked_ranks import ForkedRank, fork_server
from .rank_main import FAILED_SUFFIX, HEARTBEAT_ENV, RESULT_PREFIX, heartbeat, resolve_target  # noqa: F401 (heartbeat: public here)
from .orphans import LAUNCHER_ENV, PDEATHSIG_CODE, launcher_identity, make_launch_folder

DEFAULT_IDLE_TIMEOUT_S = 120.0
# a rank's first sign of life is its start (before the slow imports), the next ones its imports done;
# it dies with its launcher from before those imports on (`orphans`)
_CHILD = (PDEATHSIG_CODE + "p = os.environ.get('DYNABATCH_HEARTBEAT'); p and open(p, 'a').close()\n"
          "from dynabatch.pipeline.runtime.orphans import watch_launcher; watch_launcher()\n"
          "from dynabatch.pipeline.runtime.rank_main import rank_main; sys.exit(rank_main(sys.argv[1:]))")
# where CPU time is progress (see the module doc), this share of one core over the idle timeout is a
# sign of life: a process importing or tearing down torch uses 3%+ of a core even on a 2-core machine
# shared by 8 sessions (autogroup scheduling), a loop polling hung ranks 0.7% (launch_local, measured)
CPU_PROGRESS_SHARE = 0.01
START_ENV = "DYNABATCH_LAUNCH_START"  # launch_local's start method when the caller names none
START_METHODS = ("spawn", "forkserver")
PRELOAD_ENV = "DYNABATCH_LAUNCH_PRELOAD"  # launch_local's preload when the caller names none: "a,b"


@dataclass(frozen=True)
class ProcResult:
    """One launched rank: exit code (None if killed at the timeout), output, wall seconds (to its
    exit, or to the kill), and the worker's return value (None when it raised or returned nothing).
    ``timeout_reason`` says why a ``timed_out`` rank was killed: ``"idle"`` (no rank made progress
    for ``idle_timeout_s``) or ``"max_wall"``. ``failed_s``: seconds from the launch's start to when
    the worker raised (None when it did not: it returned, or its process died of a signal)."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool
    result: object = None
    timeout_reason: str | None = None
    failed_s: float | None = None


_handed_out: dict[int, float] = {}  # port -> when free_port returned it (monotonic seconds)
_handed_lock = threading.Lock()
PORT_RESERVE_S = 600.0  # how long free_port keeps a port it returned from being returned again


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, and not one this process got from
    `free_port` in the last `PORT_RESERVE_S` seconds: the kernel may hand a just-closed port out again
    (a few repeats in 300 calls, measured), and two launches started together (threads of one test
    process) that got the same port would share one coordination store."""
    with _handed_lock:
        now = time.monotonic()
        for p in [p for p, t in _handed_out.items() if now - t > PORT_RESERVE_S]:
            del _handed_out[p]
        for _ in range(256):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                break
        _handed_out[port] = now
        return port


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used so far, from ``/proc/PID/stat``; None
    where there is no such file (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name in parentheses may hold spaces
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def _beat_state(path: str) -> tuple[int, int]:
    """(mtime ns, size) of a rank's heartbeat file; (0, 0) before the rank made it."""
    try:
        st = os.stat(path)
    except OSError:
        return 0, 0
    return st.st_mtime_ns, st.st_size


def _resolve_start(start_method: str | None) -> str:
    method = start_method if start_method is not None else os.environ.get(START_ENV) or "spawn"
    if method not in START_METHODS:
        where = "start_method" if start_method is not None else f"${START_ENV}"
        raise ValueError(f"{where} must be one of {START_METHODS}, got {method!r}")
    return method


def _start_rank(forked: tuple | None, argv: list[str], env: dict, out, err, threads: int):
    """Rank ``argv[1]``: a fresh interpreter (``forked`` None) or a child of the fork server whose key
    is ``forked`` (`fork_server`), output to the files ``out`` and ``err`` (open for reading here)."""
    if forked is None:
        return subprocess.Popen([sys.executable, "-c", _CHILD, *argv], stdout=out, stderr=err, text=True, env=env)
    return ForkedRank(forked, argv, env, out.name, err.name, threads)


def default_preload() -> tuple[str, ...]:
    """The modules a fork server imports besides its own when the launch names none:
    ``$DYNABATCH_LAUNCH_PRELOAD`` (names separated by commas), else none."""
    return tuple(m for m in os.environ.get(PRELOAD_ENV, "").split(",") if m)


def launch_local(target: str, nprocs: int, *, args: tuple = (), idle_timeout_s: float | None = None,
                 timeout_s: float | None = None, max_wall_s: float | None = None, env: dict | None = None,
                 threads_per_proc: int = 1, poll_s: float = 0.05, start_method: str | None = None,
                 preload: tuple[str, ...] | None = None) -> list[ProcResult]:
    """Run ``target`` on ``nprocs`` local processes and collect their results (see the module doc).

    ``idle_timeout_s`` (default 120; ``timeout_s`` is its old name and means the same): kill every
    rank still running once no rank has made progress (output, exit, `heartbeat`) for that many
    seconds. ``max_wall_s`` (default None: no cap): kill them after that many seconds whatever
    they do. ``threads_per_proc`` sets ``OMP_NUM_THREADS`` (small tensors on few cores: 1 is
    fastest). An exception in the caller while waiting (KeyboardInterrupt, a signal handler's
    exception) kills the ranks before it propagates. ``start_method``: ``"spawn"`` or ``"forkserver"``
    (default ``$DYNABATCH_LAUNCH_START``, else spawn), ``preload``: modules the fork server imports
    when this call starts it (e.g. ``("transformers",)``; default: ``$DYNABATCH_LAUNCH_PRELOAD``, names
    separated by commas); see the module doc."""
    if idle_timeout_s is not None and timeout_s is not None and idle_timeout_s != timeout_s:
        raise ValueError("pass idle_timeout_s or its old name timeout_s, not both")
    idle = float(idle_timeout_s if idle_timeout_s is not None else
                 timeout_s if timeout_s is not None else DEFAULT_IDLE_TIMEOUT_S)
    port = free_port()
    payload = json.dumps(list(args))
    base_env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_proc), **(env or {})}
    base_env.setdefault("PYTHONUNBUFFERED", "1")  # a print is progress as soon as it is made
    if preload is None:
        preload = default_preload()
    base_env[LAUNCHER_ENV] = launcher_identity()  # the ranks die with this process (`orphans`)
    forked = fork_server(tuple(preload), base_env) if _resolve_start(start_method) == "forkserver" else None
    beat_dir = make_launch_folder()
    beats = [os.path.join(beat_dir, f"rank{r}.beat") for r in range(nprocs)]
    procs = []
    t0 = time.monotonic()
    ended: dict[int, float] = {}
    reason = None
    try:
        for r in range(nprocs):
            argv = [target, str(r), str(nprocs), str(port), payload]
            # files, not pipes: a rank blocked on a full pipe while we wait on another would look hung
            out, err = (open(os.path.join(beat_dir, f"rank{r}.{s}"), "w+") for s in ("out", "err"))
            procs.append((_start_rank(forked, argv, {**base_env, HEARTBEAT_ENV: beats[r]}, out, err,
                                      threads_per_proc), out, err))
        seen = [(0, 0, 0, 0)] * nprocs
        cpu_seen = [0.0] * nprocs  # CPU seconds of each rank at the last progress
        last_progress = time.monotonic()
        while len(ended) < nprocs:
            now = time.monotonic()
            progress = False
            for r, (p, out, err) in enumerate(procs):
                if r not in ended and p.poll() is not None:
                    ended[r] = now - t0
                    progress = True
                state = (os.fstat(out.fileno()).st_size, os.fstat(err.fileno()).st_size, *_beat_state(beats[r]))
                if state != seen[r]:
                    seen[r] = state
                    progress = True
                elif r not in ended and state[3] != 1:  # starting or tearing down: CPU time is progress
                    cpu = process_cpu_s(p.pid)
                    progress |= cpu is not None and cpu - cpu_seen[r] >= CPU_PROGRESS_SHARE * idle
            if progress:
                last_progress = now
                cpu_seen = [process_cpu_s(p.pid) or 0.0 for p, _, _ in procs]
                heartbeat()  # our own launcher sees us alive while our ranks are
            elif now - last_progress > idle:
                reason = "idle"
                break
            if max_wall_s is not None and now - t0 > max_wall_s:
                reason = "max_wall"
                break
            time.sleep(poll_s)
    finally:
        killed_at = time.monotonic() - t0
        for r, (p, _, _) in enumerate(procs):
            if r in ended:
                continue
            if p.poll() is not None:  # exited since the last look: not a timeout
                ended[r] = killed_at
            else:
                p.kill()
                p.wait()
        failed = [_failed_at(b, t0) for b in beats]
        shutil.rmtree(beat_dir, ignore_errors=True)
        if sys.exc_info()[0] is not None:  # interrupted: the ranks are gone, let the exception through
            for _, out, err in procs:
                out.close()
                err.close()
    results = []
    for r, (p, out, err) in enumerate(procs):
        timed_out = r not in ended
        out.seek(0)
        err.seek(0)
        text_out, text_err = out.read(), err.read()
        out.close()
        err.close()
        value = None
        for line in text_out.splitlines():
            if line.startswith(RESULT_PREFIX):
                value = json.loads(line[len(RESULT_PREFIX):])
        results.append(ProcResult(r, None if timed_out else p.returncode, text_out, text_err,
                                  ended.get(r, killed_at), timed_out, value, reason if timed_out else None,
                                  failed[r]))
    return results


def _failed_at(beat: str, t0: float) -> float | None:
    """Seconds from ``t0`` to when the rank with heartbeat file ``beat`` recorded its worker's raise."""
    try:
        with open(beat + FAILED_SUFFIX) as f:
            return float(f.read()) - t0
    except (OSError, ValueError):
        return None


def first_failure(results: list[ProcResult]) -> ProcResult | None:
    """The rank that failed first by time: the earliest raise (`ProcResult.failed_s`), else exit, of
    the ranks that exited with a non-zero status, before any rank killed at a timeout; None if none
    failed. (The other ranks of a pipeline fail after it, because of it.)"""
    bad = [r for r in results if r.timed_out or r.returncode != 0]
    return min(bad, key=lambda r: (r.timed_out, r.wall_s if r.failed_s is None else r.failed_s, r.rank),
               default=None)


def _what(r: ProcResult) -> str:
    return f"was killed ({r.timeout_reason} timeout)" if r.timed_out else f"exited with {r.returncode}"


def run_ranks(target: str, nprocs: int, *, args: tuple = (), idle_timeout_s: float | None = None):
    """Run ``target`` (``"file.py:function"``, called as ``function(rank, world_size, port, *args)``)
    as every rank of a job, the same script under ``torchrun`` or alone.

    Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) this process is one rank: the function runs
    here with the environment's rank, world size and ``MASTER_PORT``, and its value is returned.
    Otherwise `launch_local` starts ``nprocs`` local processes (``idle_timeout_s``: its liveness
    timeout); rank 0's output is written to stdout and its value returned, and a rank that failed or
    hung raises `RuntimeError` naming the rank that failed first by time (`first_failure`), with the
    end of its stderr (its traceback), and the other failed ranks."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return resolve_target(target)(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                                      int(os.environ.get("MASTER_PORT", 29500)), *args)
    results = launch_local(target, nprocs, args=args, idle_timeout_s=idle_timeout_s)
    sys.stdout.write("".join(line for line in results[0].stdout.splitlines(keepends=True)
                             if not line.startswith(RESULT_PREFIX)))
    sys.stdout.flush()
    first = first_failure(results)
    if first is not None:
        others = [f"rank {r.rank} {_what(r)} at {r.wall_s if r.failed_s is None else r.failed_s:.1f} s"
                  for r in results if r is not first and (r.timed_out or r.returncode)]
        when = first.wall_s if first.failed_s is None else first.failed_s
        note = f" the first to fail, {when:.1f} s after the launch (then {'; '.join(others)});" if others else ""
        raise RuntimeError(f"{target}: rank {first.rank} of {nprocs} {_what(first)}:{note} the end of its "
                           f"stderr:\n{first.stderr[-4000:]}")
    return results[0].result


