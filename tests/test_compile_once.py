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
