"""A clean exit of every pipeline mode returns 0 (issue 27.7): no helper thread of ours is left
inside a store call or a gloo wait when the interpreter exits (that aborts the process)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exit_soak import soak  # noqa: E402

from dynabatch.pipeline import launch_local  # noqa: E402


def slow_store_worker(rank, world, port):
    """One rank whose watchdog store answers after 2 s (a loaded machine): ``close`` returns only
    once the watchdog and waiter threads are gone."""
    import threading
    import time

    from dynabatch.pipeline import init_pipeline

    ctx = init_pipeline(1, rank=rank, world_size=world, master_port=port, timeout_s=30)

    class Slow:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            fn = getattr(self.inner, name)

            def slow(*a, **k):
                time.sleep(2.0)
                return fn(*a, **k)
            return slow

    ctx.monitor.watch_store = Slow(ctx.monitor.watch_store)
    time.sleep(0.5)  # the watchdog is inside a slow call now
    with ctx:
        pass
    # the rank's watch on its launcher (`orphans.watch_launcher`) lives as long as the process, by design
    return [t.name for t in threading.enumerate() if t.name.startswith("dynabatch-")
            and t.name != "dynabatch-parent-watch"]


def test_close_waits_for_the_helper_threads():
    (res,) = launch_local(f"{__file__}:slow_store_worker", 1, idle_timeout_s=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.result == []  # main: the watchdog outlived close() (joined for 1.1 s only)


def test_clean_exits_return_zero_in_every_mode(monkeypatch):
    """One clean 2-rank launch per mode (`exit_soak` runs them N times: see its docstring); spawned:
    the point is the fresh interpreter's teardown (a forked rank skips it)."""
    monkeypatch.setenv("DYNABATCH_LAUNCH_START", "spawn")
    for mode, r in soak(1).items():
        assert r["ok"] == r["runs"], (mode, r["bad"])
