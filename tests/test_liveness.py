"""Timeouts are liveness timeouts: a run that keeps making progress is never killed, however long
it takes; a silent one is killed about ``timeout`` seconds after its last sign of life.

`dynabatch.pipeline.launch_local` (``idle_timeout_s``, old name ``timeout_s``) and the test helper
``tests/liveness.run_live`` (``idle_s``). The ranks below are functions of this file (run by the
launcher in fresh processes: keep this module's top level free of test-only imports).
"""

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dynabatch.pipeline.launch import heartbeat, launch_local

# a rank is silent while it imports torch (through dynabatch.pipeline: ~2 s, 5+ s on a loaded 2-core
# machine): the idle timeouts that must not fire are well above that
IDLE = 12.0


def chatty(rank, world, port, seconds, every):
    """Print a line every ``every`` seconds for ``seconds`` seconds."""
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < seconds:
        print(f"step {n}", flush=True)
        n += 1
        time.sleep(every)
    return {"lines": n, "ran_s": time.monotonic() - t0}


def beating(rank, world, port, seconds, every):
    """Print nothing; call heartbeat() every ``every`` seconds for ``seconds`` seconds."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        heartbeat()
        time.sleep(every)
    return {"ran_s": time.monotonic() - t0}


def silent(rank, world, port, seconds):
    """Say when it started, then hang (sleep) without a sign of life."""
    print(f"started {time.time()}", flush=True)
    time.sleep(seconds)
    return "woke up"


@pytest.mark.slow
def test_ranks_that_make_progress_are_not_killed_past_the_timeout():
    """Printing (old keyword timeout_s) or heartbeat() only (idle_timeout_s): both run well past
    the timeout and finish normally."""
    with ThreadPoolExecutor(2) as pool:
        printing = pool.submit(launch_local, f"{__file__}:chatty", 1, args=(IDLE + 3, 0.25), timeout_s=IDLE)
        beats = pool.submit(launch_local, f"{__file__}:beating", 1, args=(IDLE + 3, 0.25), idle_timeout_s=IDLE)
        (p,), (b,) = printing.result(), beats.result()
    for r in (p, b):
        assert r.returncode == 0 and not r.timed_out and r.timeout_reason is None, r.stderr[-2000:]
        assert r.result["ran_s"] >= IDLE + 3 and r.wall_s > IDLE + 3
    assert p.result["lines"] > 10 and p.stdout.count("step ") == p.result["lines"]
    assert b.stdout.strip().startswith("DYNABATCH_RESULT")  # no output: the heartbeat alone kept it alive


def test_silent_ranks_are_killed_soon_after_their_last_sign_of_life():
    idle = 4.0
    t0 = time.time()
    res = launch_local(f"{__file__}:silent", 2, args=(300,), idle_timeout_s=idle)
    t_end = time.time()
    for r in res:
        assert r.timed_out and r.returncode is None and r.timeout_reason == "idle" and r.result is None
    starts = [float(r.stdout.split()[1]) for r in res if r.stdout.startswith("started")]
    last_sign = max(starts, default=t0)
    # killed after idle seconds of silence (not before), with a margin for a loaded machine
    assert idle - 0.5 <= t_end - last_sign < idle + 15, (t0, starts, t_end)
    assert t_end - t0 < 60


def test_max_wall_is_a_last_resort_cap():
    (r,) = launch_local(f"{__file__}:chatty", 1, args=(300, 0.2), idle_timeout_s=60, max_wall_s=6)
    assert r.timed_out and r.timeout_reason == "max_wall" and 6 <= r.wall_s < 6 + 15


def test_both_keywords_must_agree():
    with pytest.raises(ValueError, match="not both"):
        launch_local(f"{__file__}:silent", 1, args=(0,), timeout_s=5, idle_timeout_s=6)


def test_run_live_keeps_a_chatty_child_and_kills_a_silent_one_with_its_children():
    from liveness import LivenessTimeout, run_live

    out = run_live([sys.executable, "-c", "import time\nfor i in range(16):\n print(i, flush=True); time.sleep(0.25)"],
                   idle_s=2)
    assert out.returncode == 0 and out.stdout.split() == [str(i) for i in range(16)]
    # the child starts a grandchild, says so, then both hang: the whole group goes
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(300)\n")
    t0 = time.monotonic()
    with pytest.raises(LivenessTimeout) as e:
        run_live([sys.executable, "-c", code], idle_s=2, max_s=120)
    assert time.monotonic() - t0 < 2 + 30
    assert "no progress" in str(e.value)
    grandchild = int(e.value.output.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(grandchild):
        time.sleep(0.1)
    assert not _alive(grandchild)


@pytest.mark.slow
def test_run_live_counts_a_nested_launch_local_as_progress(tmp_path):
    """The child prints nothing itself (after 'ready') while its launch_local rank prints for longer
    than idle_s: launch_local passes the progress up (heartbeat), so run_live does not kill it."""
    script = tmp_path / "nested.py"
    script.write_text(
        "import sys\n"
        "from dynabatch.pipeline.launch import launch_local\n"
        "print('ready', flush=True)\n"
        f"(r,) = launch_local({__file__!r} + ':chatty', 1, args=({IDLE + 3}, 0.25), idle_timeout_s=60)\n"
        "sys.exit(0 if r.returncode == 0 else 1)\n")
    from liveness import run_live

    out = run_live([sys.executable, str(script)], idle_s=IDLE)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "ready\n"  # and nothing more from the child itself for > idle_s


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
