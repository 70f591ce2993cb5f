"""A SIGKILLed `launch_local` takes its ranks with it (issue 37 A): the ranks (and the fork server)
are gone within seconds, not left training, and the next launch removes the folder it left.

A launcher subprocess runs a 2-rank launch of a worker that loops forever with heartbeats; the
test SIGKILLs the launcher once both ranks run and polls their pids. Waits are liveness-bounded
(the launcher's heartbeat file, which `launch_local` touches while its ranks make progress) or
generous bounds on what must happen within seconds, never targets.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dynabatch.process_identity import process_alive, process_start
from dynabatch.pipeline.runtime.launch import HEARTBEAT_ENV, launch_local
from dynabatch.pipeline.runtime.orphans import FOLDER_PREFIX, reclaim_launch_folders

LINUX = sys.platform.startswith("linux") and os.path.isdir("/proc")
linux_only = pytest.mark.skipif(not LINUX, reason="reads processes from /proc")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STALL_S = 120.0  # the launcher's heartbeat unchanged this long while its ranks start: it hangs
GONE_BOUND_S = 60.0  # a bound on "within seconds" (the watch polls every 0.5 s), not a target

WORKER = """\
import os, time
from dynabatch.pipeline.runtime.launch import heartbeat

def loop(rank, world_size, port, folder):
    tmp = os.path.join(folder, f".rank{rank}.pid")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(folder, f"rank{rank}.pid"))  # whole, or not there
    while True:  # trains forever: only its launcher's death may end it
        heartbeat()
        time.sleep(0.05)
"""

LAUNCHER = """\
import sys
from dynabatch.pipeline.runtime.launch import launch_local

if __name__ == "__main__":  # the fork server imports this script as __mp_main__
    worker, folder, method = sys.argv[1:]
    launch_local(worker + ":loop", 2, args=(folder,), start_method=method, preload=(), idle_timeout_s=120)
"""


def _children(pid: int) -> set[int]:
    """The direct children of ``pid`` (spawned ranks, or the fork server and its helper); empty where
    the kernel does not list them."""
    out: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out |= {int(c) for c in f.read().split()}
        except OSError:  # no CONFIG_PROC_CHILDREN, or the thread ended
            pass
    return out


def _wait_for_ranks(proc: subprocess.Popen, folder: str, beat: str) -> list[int]:
    """The pids of both ranks once they run; fails when the launcher exits or stalls first."""
    last, seen = time.monotonic(), None
    paths = [os.path.join(folder, f"rank{r}.pid") for r in range(2)]
    while not all(os.path.exists(p) for p in paths):
        if proc.poll() is not None:
            pytest.fail(f"the launcher exited with {proc.returncode} before its ranks ran:\n"
                        f"{proc.stderr.read()[-3000:]}")
        mtime = os.stat(beat).st_mtime_ns if os.path.exists(beat) else None
        if mtime != seen:
            last, seen = time.monotonic(), mtime
        elif time.monotonic() - last > STALL_S:
            pytest.fail(f"the launcher made no progress for {STALL_S:.0f} s before its ranks ran")
        time.sleep(0.1)
    return [int(open(p).read()) for p in paths]


@linux_only
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_ranks_die_with_a_sigkilled_launcher_and_its_folder_is_reclaimed(tmp_path, monkeypatch, method):
    folder = tmp_path / "pids"
    folder.mkdir()
    # the launch folders' TMPDIR, short: the fork server's socket lives there, and an AF_UNIX path has at most
    # 107 bytes (pytest's tmp_path under xdist can pass that)
    tmp = Path(tempfile.mkdtemp(prefix="dbo-", dir="/tmp"))
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    beat = str(tmp_path / "launcher.beat")
    env = {**os.environ, "TMPDIR": str(tmp), HEARTBEAT_ENV: beat,
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), str(tmp_path / "worker.py"), str(folder),
                             method], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    started: dict[int, str | None] = {}
    try:
        ranks = _wait_for_ranks(proc, str(folder), beat)
        started = {p: process_start(p) for p in _children(proc.pid) | set(ranks)}  # ranks, fork server
        left_by_launcher = [n for n in os.listdir(tmp) if n.startswith(f"{FOLDER_PREFIX}{proc.pid}-")]
        assert len(left_by_launcher) == 1, os.listdir(tmp)

        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait()
        gone_after: dict[int, float] = {}
        while len(gone_after) < len(started) and time.monotonic() - killed < GONE_BOUND_S:
            for p, start in started.items():
                if p not in gone_after and not process_alive(p, start):  # a zombie has ended
                    gone_after[p] = time.monotonic() - killed
            time.sleep(0.05)
        left = sorted(set(started) - set(gone_after))
        print(f"{method}: seconds from the launcher's SIGKILL to each process gone: "
              + ", ".join(f"{'rank ' + str(ranks.index(p)) if p in ranks else 'pid ' + str(p)} {s:.2f}"
                          for p, s in sorted(gone_after.items())))
        assert not left, f"{len(left)} of the launcher's processes outlived it by {GONE_BOUND_S:.0f} s: {left}"

        # the next launch (none of its own ranks needed) removes the dead launcher's folder
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        assert launch_local("unused.py:loop", 0, start_method="spawn") == []
        assert not any(n.startswith(FOLDER_PREFIX) for n in os.listdir(tmp)), os.listdir(tmp)
    finally:
        for p, start in started.items():
            if process_alive(p, start):
                os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


@linux_only
def test_reclaim_keeps_live_launchers_folders_and_others_names(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process (or, recycled, one with another start time)
    me = f"{os.getpid()}-{process_start(os.getpid())}"
    names = [f"{FOLDER_PREFIX}{dead.pid}-{process_start(os.getpid())}-abc",  # a dead pid
             f"{FOLDER_PREFIX}{os.getpid()}-1-abc",  # this pid, another start time: a recycled pid
             f"{FOLDER_PREFIX}{me}-live", f"{FOLDER_PREFIX}oldstyle", "something-else"]
    for n in names:
        (tmp_path / n).mkdir()
        (tmp_path / n / "rank0.out").write_text("x")
    gone = reclaim_launch_folders(str(tmp_path))
    assert sorted(os.path.basename(p) for p in gone) == sorted(names[:2])
    assert sorted(os.listdir(tmp_path)) == sorted(names[2:])
