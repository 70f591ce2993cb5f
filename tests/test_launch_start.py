"""`launch_local`'s two start methods agree: the same results, outputs, exit codes, environment and
timeouts from ranks spawned as fresh interpreters and ranks forked from the fork server."""

import multiprocessing
import os
import signal
import time

import pytest

from dynabatch.pipeline import launch_local

MOD = '''
import gc, os, signal, sys

def act(rank, world, port, tag):
    import torch
    print("out", rank, tag)
    print("err", rank, file=sys.stderr)
    if rank == 1:
        raise ValueError(f"boom {tag}")
    if rank == 2:
        sys.exit(3)
    if rank == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return {"env": dict(os.environ), "threads": torch.get_num_threads(), "path0": sys.path[1],
            "forked": "dynabatch.pipeline.runtime.preload" in sys.modules, "ppid": os.getppid(),
            "frozen": gc.get_freeze_count(), "gc": gc.isenabled()}

def hang(rank, world, port):
    import time
    print("started", rank)
    time.sleep(600)
'''


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    """A module importable only through the PYTHONPATH the launch passes."""
    where = tmp_path_factory.mktemp("launchpkg")
    (where / "launchmod.py").write_text(MOD)
    return str(where)


def _launch(pkg, method, target="launchmod:act", nprocs=4, args=("t",), idle=120.0, extra=None, preload=None):
    env = {"PYTHONPATH": os.pathsep.join([pkg, os.environ.get("PYTHONPATH", "")]), "LAUNCH_TEST": "yes",
           **(extra or {})}
    return launch_local(target, nprocs, args=args, env=env, idle_timeout_s=idle, threads_per_proc=2,
                        start_method=method, preload=preload)


# a variable read at import time that the fork server's interpreter did not see: a forkserver launch that
# sets it falls back to spawning fresh interpreters (`forked_ranks.IMPORT_TIME_ENV`)
IMPORT_TIME = {"NUMBA_LAUNCH_TEST": "1"}


@pytest.fixture(scope="module")
def both(pkg):
    """Four ranks of a forkserver launch that had to spawn (IMPORT_TIME), and four forked ones: the spawned
    ranks serve the comparison and the fallback's own test, from one set of fresh interpreters (both
    launches here, so that the environment pytest sets, PYTEST_CURRENT_TEST, is the same for both)."""
    return _launch(pkg, "forkserver", extra=IMPORT_TIME), _launch(pkg, "forkserver")


def test_both_start_methods_give_the_same_ranks(pkg, both):
    spawned, forked = both
    for s, f in zip(spawned, forked):
        assert (s.rank, s.returncode, s.timed_out) == (f.rank, f.returncode, f.timed_out)
        # rank 0's result line names its heartbeat file and says how it started: compared below
        assert s.stdout.splitlines()[0] == f.stdout.splitlines()[0] == f"out {s.rank} t"
        assert s.rank == 0 or s.stdout == f.stdout
        assert s.stderr.splitlines()[0] == f.stderr.splitlines()[0] == f"err {s.rank}"
    assert [r.returncode for r in forked] == [0, 1, 3, -signal.SIGTERM]
    assert forked[0].stdout.startswith("out 0 t\nDYNABATCH_RESULT ")
    assert "Traceback" in forked[1].stderr and forked[1].stderr.splitlines()[-1] == "ValueError: boom t"
    assert spawned[1].stderr.splitlines()[-1] == "ValueError: boom t"
    assert [r.result for r in forked[1:]] == [None] * 3
    s, f = spawned[0].result, forked[0].result
    assert (s["forked"], f["forked"]) == (False, True)  # the forkserver launch did not fall back to spawn
    assert _same_env(s["env"], {**f["env"], **IMPORT_TIME})  # the whole environment, heartbeat file names aside
    assert f["env"]["LAUNCH_TEST"] == "yes" and f["env"]["OMP_NUM_THREADS"] == "2"
    assert s["threads"] == f["threads"] == 2
    assert s["path0"] == f["path0"] == pkg
    # a forked rank keeps the server's heap out of its collector's passes (frozen), and collects its own
    assert f["frozen"] > 100_000 and s["frozen"] == 0 and s["gc"] is f["gc"] is True


def _same_env(a, b):
    return {k: v for k, v in a.items() if k != "DYNABATCH_HEARTBEAT"} == \
        {k: v for k, v in b.items() if k != "DYNABATCH_HEARTBEAT"}


def test_a_hung_launch_is_killed_at_the_idle_timeout_either_way(pkg):
    """Both launches wait out their idle timeout at once (two threads of this process: each launch keeps
    its own liveness rule), not one after the other."""
    from concurrent.futures import ThreadPoolExecutor

    methods = ("spawn", "forkserver")
    with ThreadPoolExecutor(len(methods)) as pool:
        runs = list(pool.map(lambda m: _launch(pkg, m, "launchmod:hang", nprocs=2, args=(), idle=4.0), methods))
    for method, res in zip(methods, runs):
        assert [(r.timed_out, r.timeout_reason, r.returncode) for r in res] == [(True, "idle", None)] * 2, method
        assert [r.stdout for r in res] == ["started 0\n", "started 1\n"], method


def test_an_import_time_variable_falls_back_to_spawn(both):
    res = both[0][0]
    assert res.returncode == 0 and res.result["forked"] is False
    assert res.result["env"]["NUMBA_LAUNCH_TEST"] == "1"


def test_the_start_method_is_checked(monkeypatch):
    with pytest.raises(ValueError, match="start_method must be one of"):
        launch_local("launchmod:act", 1, start_method="fork")
    monkeypatch.setenv("DYNABATCH_LAUNCH_START", "threads")
    with pytest.raises(ValueError, match="DYNABATCH_LAUNCH_START must be one of"):
        launch_local("launchmod:act", 1)


def test_a_fork_server_started_by_other_code_does_not_stop_ranks_forking(pkg):
    """Other code in this process started `multiprocessing`'s process-wide fork server first (as a
    DataLoader with forkserver workers does): ranks still fork, from launch_local's own server."""
    from multiprocessing import forkserver

    from dynabatch.pipeline.runtime import forked_ranks

    other = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(0,))
    other.start()
    other.join()
    assert other.exitcode == 0 and forkserver._forkserver._forkserver_pid is not None
    (res,) = _launch(pkg, "forkserver", nprocs=1)
    assert res.returncode == 0 and res.result["forked"] is True
    ours = {e["pid"] for e in forked_ranks._servers.values()}
    assert res.result["ppid"] in ours and res.result["ppid"] != forkserver._forkserver._forkserver_pid


def test_an_environment_changed_since_the_server_started_gets_its_own_server(pkg, monkeypatch):
    """A variable read at import time set in this process after an earlier launch started its server
    (as `map_parts` sets TOKENIZERS_PARALLELISM): ranks still fork, from a server started with it."""
    from dynabatch.pipeline.runtime import forked_ranks

    (first,) = _launch(pkg, "forkserver", nprocs=1)
    monkeypatch.setenv("TOKENIZERS_LAUNCH_TEST", "changed")
    # the new server serves this launch only (no other test sets the variable): the suite's preload
    # (transformers, conftest.py) would cost it seconds of CPU for nothing
    (second,) = _launch(pkg, "forkserver", nprocs=1, preload=())
    assert (first.result["forked"], second.result["forked"]) == (True, True)
    assert "TOKENIZERS_LAUNCH_TEST" not in first.result["env"]
    assert second.result["env"]["TOKENIZERS_LAUNCH_TEST"] == "changed"
    assert first.result["ppid"] != second.result["ppid"]
    assert {first.result["ppid"], second.result["ppid"]} <= {e["pid"] for e in forked_ranks._servers.values()}


def test_variables_read_only_when_used_keep_the_server(pkg, monkeypatch, tmp_path):
    """torch sets TORCHINDUCTOR_CACHE_DIR to its default the first time inductor looks for its cache (on
    importing transformers' Trainer, say) and reads it only then; ``ray.init`` sets PYTHONBREAKPOINT, read
    at each ``breakpoint()``. Ranks forked from the running server get the new values, and no second server
    (a second preload of torch and transformers) starts for them."""
    (first,) = _launch(pkg, "forkserver", nprocs=1)
    new = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "PYTHONBREAKPOINT": "launchmod.act"}
    for name, value in new.items():
        monkeypatch.setenv(name, value)
    (second,) = _launch(pkg, "forkserver", nprocs=1)
    assert (first.result["forked"], second.result["forked"]) == (True, True)
    assert first.result["ppid"] == second.result["ppid"]
    assert {k: second.result["env"][k] for k in new} == new
