"""Timeouts are liveness timeouts: a run that keeps making progress is never killed, however long
it takes; a silent one is killed about ``timeout`` seconds after its last sign of life.

`dynabatch.pipeline.launch_local` (``idle_timeout_s``, old name ``timeout_s``) and the test helper
``tests/liveness.run_live`` (``idle_s``). The ranks below are functions of this file (run by the
launcher in fresh processes: keep this module's top level light, stdlib and this directory only).

Every run here mostly sleeps (it prints every 0.25 s, or waits for a timeout to expire), so the
selected tests' runs start together in the background when the module's first test begins
(``tests/prelaunch.py``); each test then checks its own run exactly as when it runs alone. Elapsed
times are taken inside each run. Ranks are spawned (fresh interpreters: the module fixture) where an
interpreter's start or teardown is the point, else forked from the fork server (`FORKED`).
"""

import atexit
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the ranks run this file by path
from prelaunch import Prelaunch, job  # noqa: E402

from dynabatch.pipeline.runtime.launch import heartbeat, launch_local  # noqa: E402

# a rank prints nothing while it imports torch (through dynabatch.pipeline: ~2 s, 30 s at load 14-20 on
# 2 cores) or tears it down (19 s there): its CPU time is its progress then (see launch_local)
IDLE = 12.0
LAUNCHES = Prelaunch(parallel=6)
SPIN_ENV = "LIVENESS_TEST_SPIN_AT_IMPORT"


# a spinning rank computes BURN_S CPU seconds, then sleeps REST_S, over and over: a tenth of a core on
# an idle machine instead of a whole one, still 10x the 1% of a core that counts as progress (where CPU
# time is progress) and, under load 26 on 2 cores (burning then takes ~0.13 s), still 4.5%
BURN_S, REST_S = 0.01, 0.09


def _spin(seconds: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        c0 = time.process_time()
        while time.process_time() - c0 < BURN_S:
            pass
        time.sleep(REST_S)


if os.environ.get(SPIN_ENV):  # a rank of test_cpu_time_is_progress_...: its import of this module computes
    _spin(float(os.environ[SPIN_ENV]))


@pytest.fixture(scope="module", autouse=True)
def _launches(request):
    with pytest.MonkeyPatch.context() as mp:  # the point here: a fresh interpreter's start and teardown
        mp.setenv("DYNABATCH_LAUNCH_START", "spawn")
        yield from LAUNCHES.started(request)


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


# Launches whose point is not a fresh interpreter's start or teardown fork their rank from the fork server
# (FORKED): ~0.3 s of CPU instead of ~3 s for a spawned interpreter's imports of torch and dynabatch.
FORKED = "forkserver"


def _printing():
    return launch_local(f"{__file__}:chatty", 1, args=(IDLE + 3, 0.25), timeout_s=IDLE, start_method=FORKED)


def _beating():
    return launch_local(f"{__file__}:beating", 1, args=(IDLE + 3, 0.25), idle_timeout_s=IDLE, start_method=FORKED)


def _nested():
    """A child that prints 'ready', then runs a launch_local whose rank prints for longer than IDLE."""
    from liveness import run_live

    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "nested.py")
        with open(script, "w") as f:
            f.write("import sys\n"
                    "from dynabatch.pipeline.runtime.launch import launch_local\n"
                    "print('ready', flush=True)\n"
                    f"(r,) = launch_local({__file__!r} + ':chatty', 1, args=({IDLE + 3}, 0.25), idle_timeout_s=60)\n"
                    "sys.exit(0 if r.returncode == 0 else 1)\n")
        return run_live([sys.executable, script], idle_s=IDLE)


@pytest.mark.slow
@LAUNCHES.plan(lambda: [job("printing", _printing, weight=IDLE + 3), job("beating", _beating, weight=IDLE + 3)])
def test_ranks_that_make_progress_are_not_killed_past_the_timeout():
    """Printing (old keyword timeout_s) or heartbeat() only (idle_timeout_s): both run well past
    the timeout and finish normally."""
    (p,), (b,) = LAUNCHES.result(job("printing", _printing)), LAUNCHES.result(job("beating", _beating))
    for r in (p, b):
        assert r.returncode == 0 and not r.timed_out and r.timeout_reason is None, r.stderr[-2000:]
        assert r.result["ran_s"] >= IDLE + 3 and r.wall_s > IDLE + 3
    assert p.result["lines"] > 10 and p.stdout.count("step ") == p.result["lines"]
    assert b.stdout.strip().startswith("DYNABATCH_RESULT")  # no output: the heartbeat alone kept it alive


def spinning(rank, world, port, where, seconds):
    """Print nothing; compute (`_spin`: a tenth of a core) for ``seconds`` seconds in this function
    (``where="function"``) or in the interpreter's teardown (``"exit"``: an atexit handler); ``"import"``:
    this module's import did (`SPIN_ENV`)."""
    if where == "function":
        _spin(seconds)
    elif where == "exit":
        atexit.register(_spin, seconds)
    return where


def _spinning(where, seconds, idle=IDLE):
    env = {SPIN_ENV: str(seconds)} if where == "import" else None
    return launch_local(f"{__file__}:spinning", 1, args=(where, seconds), idle_timeout_s=idle, env=env)


SPINS = {"import": IDLE + 3, "exit": IDLE + 3, "function": 120.0}


@pytest.mark.slow
@LAUNCHES.plan(lambda: [job(("spin", w), _spinning, w, s, weight=IDLE + 3) for w, s in SPINS.items()])
def test_cpu_time_is_progress_outside_the_worker_function_only():
    """A rank computing silently while it imports (torch: 30 s on a loaded 2-core machine) or tears
    its interpreter down (19 s) outlives the idle timeout; one spinning silently inside its worker
    function (a hung loop) is killed about ``IDLE`` seconds after it began (3 s was too tight for the
    imports at load 26 with 3 CPU hogs: 1% of a core over the idle window is the rule). Spawned ranks:
    a fresh interpreter's start and teardown are the point. The spins use a tenth of a core (`_spin`),
    10x the rule's share: a launcher that counted CPU time inside the worker function would keep the
    hung loop alive, one that did not count it outside would kill the other two."""
    for where in ("import", "exit"):
        (r,) = LAUNCHES.result(job(("spin", where), _spinning, where, SPINS[where]))
        assert r.returncode == 0 and not r.timed_out and r.result == where, (where, r.stderr[-2000:])
        assert r.wall_s > SPINS[where] and r.stdout.startswith("DYNABATCH_RESULT")  # silent otherwise
    (f,) = LAUNCHES.result(job(("spin", "function"), _spinning, "function", SPINS["function"]))
    assert f.timed_out and f.timeout_reason == "idle" and f.result is None and f.stdout == ""


def compiling(rank, world, port, seconds):
    """Print nothing; compile fresh numba functions (no cache) for ``seconds`` seconds, what a rank's
    first planning step does on a cold numba cache."""
    import numba

    t0, n = time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        scope = {}
        exec(f"def f{n}(k):\n    s = 0\n    for i in range(k):\n        s += i * {n + 1}\n    return s\n", scope)
        assert numba.njit(cache=False)(scope[f"f{n}"])(10) == 45 * (n + 1)
        n += 1
    return n


COMPILE_IDLE = 4.0


def _compiling():
    """Forked: a spawned rank's first compile sets numba's CPU target up (1.4 s of CPU, silent, inside the
    worker function, before the first compiler pass: 9 s at load 13 on 2 cores, past COMPILE_IDLE); the
    fork server did that when it loaded the op-order kernels, as a rank's own earlier planning would."""
    return launch_local(f"{__file__}:compiling", 1, args=(COMPILE_IDLE + 2,), idle_timeout_s=COMPILE_IDLE,
                        start_method=FORKED)


@pytest.mark.slow
@LAUNCHES.plan(lambda: [job("compiling", _compiling, weight=COMPILE_IDLE + 2)])
def test_a_rank_compiling_numba_kernels_is_alive():
    """Inside the worker function CPU time is no progress, but each numba compiler pass is a heartbeat:
    a rank compiling silently for longer than the idle timeout (a cold cache's first steps) lives."""
    (r,) = LAUNCHES.result(job("compiling", _compiling))
    assert r.returncode == 0 and not r.timed_out, r.stderr[-2000:]
    assert r.result >= 2 and r.wall_s > COMPILE_IDLE + 2 and r.stdout.startswith("DYNABATCH_RESULT")


def _silent(idle):
    """Forked: spawned ranks' imports under a 4 s idle timeout were killed before they started at load 10
    (the spins above show a fresh interpreter's start is progress)."""
    t0 = time.time()
    res = launch_local(f"{__file__}:silent", 2, args=(300,), idle_timeout_s=idle, start_method=FORKED)
    return t0, res, time.time()


def _max_wall():
    return launch_local(f"{__file__}:chatty", 1, args=(300, 0.2), idle_timeout_s=60, max_wall_s=6,
                        start_method=FORKED)


def _run_live_chatty():
    from liveness import run_live

    return run_live([sys.executable, "-c", "import time\nfor i in range(16):\n print(i, flush=True); time.sleep(0.25)"],
                    idle_s=2)


def _run_live_silent():
    """The child starts a grandchild, says so, then both hang; the LivenessTimeout raised carries
    ``elapsed`` (seconds from the start to the kill)."""
    from liveness import run_live

    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(300)\n")
    t0 = time.monotonic()
    try:
        return run_live([sys.executable, "-c", code], idle_s=2, max_s=120)
    except BaseException as e:
        e.elapsed = time.monotonic() - t0
        raise


@LAUNCHES.plan(lambda: [job("silent", _silent, 4.0, weight=6)])
def test_silent_ranks_are_killed_soon_after_their_last_sign_of_life():
    idle = 4.0
    t0, res, t_end = LAUNCHES.result(job("silent", _silent, idle))
    for r in res:
        assert r.timed_out and r.returncode is None and r.timeout_reason == "idle" and r.result is None
    starts = [float(r.stdout.split()[1]) for r in res if r.stdout.startswith("started")]
    last_sign = max(starts, default=t0)
    # killed after idle seconds of silence (not before), with a margin for a loaded machine
    assert len(starts) == 2  # both started, then went silent
    assert idle - 0.5 <= t_end - last_sign < idle + 15, (t0, starts, t_end)


@LAUNCHES.plan(lambda: [job("max_wall", _max_wall, weight=6)])
def test_max_wall_is_a_last_resort_cap():
    (r,) = LAUNCHES.result(job("max_wall", _max_wall))
    assert r.timed_out and r.timeout_reason == "max_wall" and 6 <= r.wall_s < 6 + 15


def test_both_keywords_must_agree():
    with pytest.raises(ValueError, match="not both"):
        launch_local(f"{__file__}:silent", 1, args=(0,), timeout_s=5, idle_timeout_s=6)


@LAUNCHES.plan(lambda: [job("run_live_chatty", _run_live_chatty, weight=4),
                         job("run_live_silent", _run_live_silent, weight=3)])
def test_run_live_keeps_a_chatty_child_and_kills_a_silent_one_with_its_children():
    from liveness import LivenessTimeout

    out = LAUNCHES.result(job("run_live_chatty", _run_live_chatty))
    assert out.returncode == 0 and out.stdout.split() == [str(i) for i in range(16)]
    # the child starts a grandchild, says so, then both hang: the whole group goes
    with pytest.raises(LivenessTimeout) as e:
        LAUNCHES.result(job("run_live_silent", _run_live_silent))
    assert e.value.elapsed < 2 + 30
    assert "no progress" in str(e.value)
    grandchild = int(e.value.output.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(grandchild):
        time.sleep(0.1)
    assert not _alive(grandchild)


@pytest.mark.slow
@LAUNCHES.plan(lambda: [job("nested", _nested, weight=IDLE + 5)])
def test_run_live_counts_a_nested_launch_local_as_progress():
    """The child prints nothing itself (after 'ready') while its launch_local rank prints for longer
    than idle_s: launch_local passes the progress up (heartbeat), so run_live does not kill it."""
    out = LAUNCHES.result(job("nested", _nested))
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


def test_free_port_never_hands_a_port_out_twice():
    """The kernel hands just-closed ports out again (a few repeats in 300 binds): two launches started
    together would then share one coordination store. free_port keeps what it returned."""
    from dynabatch.pipeline.runtime import free_port

    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)
