"""Run a function on N local processes (one per rank) — for CPU/gloo experiments and tests.

``launch_local("path/to/file.py:worker", nprocs, args=...)`` starts ``nprocs`` Python processes,
each calling ``worker(rank, world_size, port, *args)`` with a shared free ``port`` on 127.0.0.1
(pass it to `dynabatch.pipeline.init_pipeline` as ``master_port``). A JSON-serializable return value
comes back in `ProcResult.result`; each process's exit code, stdout and stderr are kept, and every
process still running at ``timeout_s`` is killed (by its own pid) and marked ``timed_out``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

RESULT_PREFIX = "DYNABATCH_RESULT "
_CHILD = "import sys; from dynabatch.pipeline.launch import _main; sys.exit(_main(sys.argv[1:]))"


@dataclass(frozen=True)
class ProcResult:
    """One launched rank: exit code (None if killed at the timeout), output, wall seconds, and the
    worker's return value (None when it raised or returned nothing)."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool
    result: object = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(target: str):
    where, _, name = target.rpartition(":")
    if not where or not name:
        raise ValueError(f"target must be 'module:function' or 'path/file.py:function', got {target!r}")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(where)
    return getattr(mod, name)


def launch_local(target: str, nprocs: int, *, args: tuple = (), timeout_s: float = 120.0, env: dict | None = None,
                 threads_per_proc: int = 1) -> list[ProcResult]:
    """Run ``target`` on ``nprocs`` local processes and collect their results (see the module doc).
    ``threads_per_proc`` sets ``OMP_NUM_THREADS`` (small tensors on few cores: 1 is fastest)."""
    port = free_port()
    payload = json.dumps(list(args))
    base_env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_proc), **(env or {})}
    procs = []
    t0 = time.monotonic()
    for r in range(nprocs):
        cmd = [sys.executable, "-c", _CHILD, target, str(r), str(nprocs), str(port), payload]
        # files, not pipes: a rank blocked on a full pipe while we wait on another would look hung
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        procs.append((subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=base_env), out, err))
    ended: dict[int, float] = {}
    while len(ended) < nprocs and time.monotonic() - t0 < timeout_s:
        for r, (p, _, _) in enumerate(procs):
            if r not in ended and p.poll() is not None:
                ended[r] = time.monotonic() - t0
        time.sleep(0.02)
    results = []
    for r, (p, out, err) in enumerate(procs):
        timed_out = r not in ended
        if timed_out:
            p.kill()
            p.wait()
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
                                  ended.get(r, timeout_s), timed_out, value))
    return results


def _main(argv: list[str]) -> int:
    target, rank, world, port, payload = argv
    fn = _resolve(target)
    value = fn(int(rank), int(world), int(port), *json.loads(payload))
    if value is not None:
        sys.stdout.write(RESULT_PREFIX + json.dumps(value) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
