"""The rank side of `dynabatch.pipeline.launch_local`: what a launched process runs (`rank_main`: resolve the
``module:function`` target, call ``worker(rank, world_size, port, *args)``, print its JSON result) and how it
shows it is alive (`heartbeat`, the phase bytes of its heartbeat file, the time its worker raised). Both start
methods run it: a spawned interpreter (``launch._CHILD``) and a rank forked from the fork server
(`dynabatch.pipeline.runtime.forked_ranks`); the launcher reads what it writes."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

RESULT_PREFIX = "DYNABATCH_RESULT "
HEARTBEAT_ENV = "DYNABATCH_HEARTBEAT"
FAILED_SUFFIX = ".failed"  # beside a rank's heartbeat file: when its worker raised (time.monotonic)
_last_beat = [0.0]
_compile_beat: list = []  # the numba listener of `beat_while_compiling`, once registered


def heartbeat(min_interval_s: float = 0.2) -> None:
    """Report progress to whoever launched this process (`launch_local`, ``tests/liveness.py``):
    touch the file named by ``$DYNABATCH_HEARTBEAT``; a no-op when it is not set. Cheap (at most one
    touch per ``min_interval_s``): call it once per step of a loop that prints nothing."""
    path = os.environ.get(HEARTBEAT_ENV)
    now = time.monotonic()
    if not path or now - _last_beat[0] < min_interval_s:
        return
    _last_beat[0] = now
    try:
        with open(path, "a"):
            pass
        os.utime(path)
    except OSError:
        pass


def beat_while_compiling() -> None:
    """Make every numba compiler pass a `heartbeat` in this process (once per process). A kernel's first
    call compiles it when numba's on-disk cache is cold (a fresh clone or install: 65 s of CPU for the
    kernels one ``bench train`` rank calls, measured), silently and inside the worker function where CPU
    time is no progress; a pass is short (well under a second), so a rank that compiles stays alive
    while a hung one (no pass, no step) is still killed."""
    if _compile_beat:
        return
    try:
        from numba.core import event
    except ImportError:  # no numba: nothing compiles
        return

    class _Beat(event.Listener):
        def on_start(self, ev):
            heartbeat()

        def on_end(self, ev):
            heartbeat()

    _compile_beat.append(_Beat())
    event.register("numba:run_pass", _compile_beat[0])


def mark_phase(path: str | None) -> None:
    """Append one byte to the heartbeat file: its size is the rank's phase for the launcher (0: starting,
    1: in the worker function, 2: done with it), its mtime the last heartbeat."""
    if path:
        with open(path, "ab") as f:
            f.write(b".")


def resolve_target(target: str):
    """The function a ``module:function`` or ``path/file.py:function`` target names (its module imported)."""
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


def rank_main(argv: list[str]) -> int:
    """Run the worker of ``argv`` (target, rank, world size, port, JSON args) and print its result; the exit code."""
    target, rank, world, port, payload = argv
    heartbeat(0.0)  # dynabatch (torch) imported
    fn = resolve_target(target)
    heartbeat(0.0)  # the target's module imported
    beat_while_compiling()  # a cold numba cache compiles inside the worker: each pass is progress
    mark_phase(os.environ.get(HEARTBEAT_ENV))  # in the worker function: CPU time is no progress
    try:
        value = fn(int(rank), int(world), int(port), *json.loads(payload))
    except BaseException as e:
        failed_at = time.monotonic()  # system-wide on Linux, macOS and Windows: the launcher compares them
        beat = os.environ.get(HEARTBEAT_ENV)
        mark_phase(beat)
        if beat and not (isinstance(e, SystemExit) and e.code in (0, None)):
            with open(beat + FAILED_SUFFIX, "w") as f:
                f.write(repr(failed_at))
        waits = sys.modules.get("dynabatch.pipeline.runtime.waits")
        if waits is not None and waits.abandoned():  # see waits.exit_if_abandoned
            import traceback

            traceback.print_exc()
            waits.exit_if_abandoned(1)
        raise
    mark_phase(os.environ.get(HEARTBEAT_ENV))  # done: the teardown's CPU time is progress again
    if value is not None:
        sys.stdout.write(RESULT_PREFIX + json.dumps(value) + "\n")
        sys.stdout.flush()
    return 0


__all__ = ["FAILED_SUFFIX", "HEARTBEAT_ENV", "RESULT_PREFIX", "beat_while_compiling", "heartbeat", "mark_phase", "rank_main", "resolve_target"]
