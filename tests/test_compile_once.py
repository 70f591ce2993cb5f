"""Two processes that need the same kernel on an empty cache compile it once between them
(`dynabatch.core.kernels.compile_once`): the second waits on the first's lock, then loads what it saved."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("fcntl", reason="the compile lock is an fcntl.flock lock (POSIX)")

#: Holds ``round_up``'s compile lock until told to go, then compiles it itself and saves it.
HOLDER = """
import sys
from dynabatch.core.kernels import cost
from dynabatch.core.kernels.compile_once import compiling, lock_path
with compiling(lock_path(cost.round_up)):
    print("locked", flush=True)
    sys.stdin.readline()
    assert cost.round_up(7, 8) == 8
    print("compiled", sum(cost.round_up.stats.cache_misses.values()), flush=True)
"""

#: Needs ``round_up`` meanwhile: prints how many signatures it compiled and how many it loaded.
WAITER = """
from dynabatch.core.kernels import cost
assert cost.round_up(7, 8) == 8
stats = cost.round_up.stats
print("waiter", sum(stats.cache_misses.values()), sum(stats.cache_hits.values()), flush=True)
"""

LIVENESS_S = 300  # a generous bound on two small interpreters' start-up on a busy machine, never reached when well


def _waiting_on_a_flock(pid: int) -> bool:
    """Whether ``pid`` is blocked on an flock lock (a ``->`` waiter line of /proc/locks)."""
    with open("/proc/locks") as fh:
        return any("->" in line and "FLOCK" in line and f" {pid} " in line for line in fh)


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="reads the lock's waiters from /proc/locks (Linux)")
def test_a_second_process_waits_and_loads_instead_of_compiling(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))  # an empty cache of this test's own
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)
    waiter = None
    try:
        assert holder.stdout.readline().strip() == "locked"
        waiter = subprocess.Popen([sys.executable, "-c", WAITER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env)
        deadline = time.monotonic() + LIVENESS_S
        while not _waiting_on_a_flock(waiter.pid) and waiter.poll() is None:  # until it waits on the lock
            assert time.monotonic() < deadline, "the second process neither waited on the lock nor ended"
            time.sleep(0.05)
        holder.stdin.write("go\n")
        holder.stdin.flush()
        held = holder.stdout.readline().split()
        out, err = waiter.communicate(timeout=LIVENESS_S)
        assert waiter.returncode == 0, err
        assert out.split() == ["waiter", "0", "1"], f"the second process compiled the kernel itself: {out}"
        assert held == ["compiled", "1"], held
    finally:
        for p in (holder, waiter):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


class _Stream:
    def __init__(self, tty: bool):
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


def test_the_compile_notice_is_said_once_on_a_terminal_for_an_unsaved_kernel(tmp_path, monkeypatch):
    from dynabatch.core.kernels import compile_once

    monkeypatch.setattr(compile_once, "_announced", False)
    saved = tmp_path / "k.nbi"
    saved.write_text("")
    pipe, tty = _Stream(False), _Stream(True)
    assert not compile_once.announce_compile(str(tmp_path / "new.nbi.lock"), pipe) and pipe.text == ""  # a log
    assert not compile_once.announce_compile(str(saved) + ".lock", tty) and tty.text == ""  # saved: loads
    assert compile_once.announce_compile(str(tmp_path / "new.nbi.lock"), tty)
    assert not compile_once.announce_compile(str(tmp_path / "other.nbi.lock"), tty)  # once per process
    assert tty.text == compile_once.COMPILE_NOTICE


#: Compiles ``round_up`` (and nothing else) with stderr on whatever the test gives it.
COMPILER = """
from dynabatch.core.kernels import cost
assert cost.round_up(7, 8) == 8
print("compiled", sum(cost.round_up.stats.cache_misses.values()), flush=True)
"""


def test_a_first_compile_at_a_terminal_says_so_and_a_log_stays_quiet(tmp_path):
    """On an empty cache a process whose stderr is a terminal (a pseudo-terminal here) gets the notice
    before the compile; one writing to a file gets nothing; once saved, a terminal gets nothing either."""
    pty = pytest.importorskip("pty")

    def run(cache, on_tty: bool) -> tuple[str, str]:
        env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
        if on_tty:
            leader, follower = pty.openpty()
            try:
                out = subprocess.run([sys.executable, "-c", COMPILER], stdout=subprocess.PIPE, stderr=follower,
                                     text=True, env=env, timeout=LIVENESS_S).stdout
            finally:
                os.close(follower)
            err = b""
            while True:
                try:
                    chunk = os.read(leader, 4096)
                except OSError:  # the terminal's other end is closed: all was read
                    break
                if not chunk:
                    break
                err += chunk
            os.close(leader)
            return out, err.decode().replace("\r\n", "\n")
        done = subprocess.run([sys.executable, "-c", COMPILER], capture_output=True, text=True, env=env,
                              timeout=LIVENESS_S)
        return done.stdout, done.stderr

    from dynabatch.core.kernels.compile_once import COMPILE_NOTICE

    out, err = run(tmp_path / "logged", on_tty=False)
    assert out == "compiled 1\n" and err == "", err  # compiled, said nothing off a terminal
    out, err = run(tmp_path / "shown", on_tty=True)
    assert out == "compiled 1\n" and err == COMPILE_NOTICE, err
    out, err = run(tmp_path / "shown", on_tty=True)
    assert out == "compiled 0\n" and err == "", err  # saved by the run before: loaded, nothing to say
