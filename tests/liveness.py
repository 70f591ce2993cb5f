"""Run a subprocess under a liveness timeout instead of a wall clock (shared by the tests).

``run_live(cmd, idle_s=...)`` kills the child (and everything it started: it runs in its own
session) only after ``idle_s`` seconds without progress, that is without a new byte on its stdout
or stderr, without a touch of its heartbeat file (``$DYNABATCH_HEARTBEAT``, set for the child:
`dynabatch.pipeline.launch_local` touches it while its ranks make progress, and
`dynabatch.pipeline.runtime.launch.heartbeat` touches it from any loop) and without using
``CPU_PROGRESS_SHARE x idle_s`` seconds of CPU time (the child itself: importing torch, tearing
it down, 30 s and 19 s of silence on a loaded 2-core machine; the rule of
`dynabatch.pipeline.runtime.launch_local`). ``max_s`` is a generous overall
cap, a last resort against a child that is busy forever. A loaded machine makes a test slower,
never failed; a hang still fails within about ``idle_s``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time

from dynabatch.pipeline.runtime.launch import CPU_PROGRESS_SHARE, HEARTBEAT_ENV, PRELOAD_ENV, process_cpu_s

DEFAULT_IDLE_S = 120.0
DEFAULT_MAX_S = 1800.0


def tiny_models_env() -> dict:
    """This process's environment with no fork-server preload, for a command whose ranks build only
    dynabatch's tiny models: the suite's preload (transformers, conftest.py) would cost each such
    process's fork server seconds of CPU for nothing."""
    return {**os.environ, PRELOAD_ENV: ""}


class LivenessTimeout(subprocess.TimeoutExpired):
    """The child made no progress for ``idle_s`` seconds (or ran past ``max_s``) and was killed."""

    def __init__(self, cmd, timeout, reason: str, output: str, stderr: str):
        super().__init__(cmd, timeout, output, stderr)
        self.reason = reason

    def __str__(self) -> str:
        return (f"{self.reason}: {' '.join(map(str, self.cmd))[:300]}\n--- stdout (tail)\n{(self.output or '')[-2000:]}"
                f"\n--- stderr (tail)\n{(self.stderr or '')[-3000:]}")


def _pump(stream, chunks: list, last: list) -> None:
    fd = stream.fileno()
    while True:
        data = os.read(fd, 65536)
        if not data:
            break
        chunks.append(data)
        last[0] = time.monotonic()


def run_live(cmd, *, idle_s: float = DEFAULT_IDLE_S, max_s: float = DEFAULT_MAX_S, env: dict | None = None,
             cwd=None, poll_s: float = 0.1) -> subprocess.CompletedProcess:
    """Run ``cmd`` to completion and return its `subprocess.CompletedProcess` (text stdout/stderr),
    like ``subprocess.run(cmd, capture_output=True, text=True)``; raise `LivenessTimeout` after
    killing the child's whole process group when it made no progress for ``idle_s`` seconds, or
    ran past ``max_s``."""
    beat_dir = tempfile.mkdtemp(prefix="liveness-")
    beat = os.path.join(beat_dir, "heartbeat")
    child_env = {**(os.environ if env is None else env), HEARTBEAT_ENV: beat}
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env, cwd=cwd,
                            start_new_session=True)
    out, err = [], []
    t0 = time.monotonic()
    last = [t0]
    pumps = [threading.Thread(target=_pump, args=(s, c, last), daemon=True)
             for s, c in ((proc.stdout, out), (proc.stderr, err))]
    for t in pumps:
        t.start()
    reason, seen_beat, seen_cpu, seen_last = None, 0, 0.0, t0
    try:
        while proc.poll() is None:
            now = time.monotonic()
            try:
                mtime = os.stat(beat).st_mtime_ns
            except OSError:
                mtime = 0
            cpu = process_cpu_s(proc.pid) or 0.0
            if mtime != seen_beat or cpu - seen_cpu >= CPU_PROGRESS_SHARE * idle_s:
                seen_beat, last[0] = mtime, now
            if last[0] != seen_last:  # progress since the last look: CPU time counts from here
                seen_cpu, seen_last = cpu, last[0]
            if now - last[0] > idle_s:
                reason = f"no progress (output or heartbeat) for {idle_s:g} s"
                break
            if now - t0 > max_s:
                reason = f"still running after the {max_s:g} s cap"
                break
            time.sleep(poll_s)
    finally:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        else:  # the child is done; grandchildren it left behind would hold the pipes open
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for t in pumps:
            t.join(10)
        proc.stdout.close()
        proc.stderr.close()
        try:
            os.remove(beat)
        except OSError:
            pass
        os.rmdir(beat_dir)
    stdout = b"".join(out).decode("utf-8", "replace")
    stderr = b"".join(err).decode("utf-8", "replace")
    if reason is not None:
        raise LivenessTimeout(cmd, idle_s, reason, stdout, stderr)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)

