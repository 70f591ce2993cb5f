"""`dynabatch.engines.map_parts` (local engine): order, context, errors."""

from __future__ import annotations

import pytest

from dynabatch.offline import map_parts


def _scaled(context, item):
    if item == "boom":
        raise ValueError("part boom: bad input")
    return context * item


@pytest.mark.parametrize("workers", [1, 2])
def test_results_in_item_order(workers):
    items = list(range(17))
    assert map_parts(_scaled, items, 3, workers=workers, progress=False, weights=[1] * 17) == [3 * i for i in items]


def test_worker_error_is_reraised():
    with pytest.raises(ValueError, match="part boom: bad input"):
        map_parts(_scaled, [1, 2, "boom", 4], 1, workers=2, progress=False)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown engine"):
        map_parts(_scaled, [1], 1, engine="spark")
    with pytest.raises(ValueError, match="workers must be >= 1"):
        map_parts(_scaled, [1], 1, workers=0)


_STARTED = "imported"  # set to "forked" in the test: a forked worker inherits it, a spawned one imports it anew


def _how_started(context, item):
    return _STARTED


def test_workers_are_not_forked_from_a_process_running_other_threads():
    """A busy second thread: forking mid-way through its work can crash the child (a segfault in the
    child's garbage collector was seen when the suite's threads were running), so the workers are
    spawned; with no other thread, this process forks them (cheapest)."""
    import threading

    from dynabatch import engines

    global _STARTED
    _STARTED = "forked"
    stop = threading.Event()
    busy = threading.Thread(target=lambda: [list(range(1000)) for _ in iter(stop.is_set, True)], daemon=True)
    busy.start()
    try:
        assert map_parts(_how_started, list(range(4)), None, workers=2, progress=False) == ["imported"] * 4
    finally:
        stop.set()
        busy.join()
        _STARTED = "imported"
    if not engines._other_threads():  # pytest-xdist workers run another thread (execnet's): then nothing forks
        _STARTED = "forked"
        try:
            assert map_parts(_how_started, list(range(4)), None, workers=2, progress=False) == ["forked"] * 4
        finally:
            _STARTED = "imported"


def test_default_workers_leave_small_jobs_in_this_process(monkeypatch, tmp_path, capsys):
    """By default a scan or a plan uses one local process per SAMPLES_PER_WORKER samples, up to the CPUs (a
    worker costs seconds to start, a small job milliseconds); --workers and Ray are taken as given, and
    `dynabatch scan`/`plan` report the count they used."""
    import argparse
    import json

    import pyarrow.parquet as pq

    from dynabatch import engines
    from dynabatch.shape_sources import synthetic_shapes
    from dynabatch.cli import main
    from dynabatch.engines import SAMPLES_PER_WORKER, workers_for
    from dynabatch.offline import runplan
    from dynabatch.offline.commands import _add_engine_options

    monkeypatch.setattr(engines, "default_workers", lambda: 8)
    assert workers_for(SAMPLES_PER_WORKER - 1) == 1 and workers_for(3 * SAMPLES_PER_WORKER) == 3
    assert workers_for(100 * SAMPLES_PER_WORKER) == 8 and workers_for(None) == 8  # unknown size: the CPUs
    assert workers_for(10, 4) == 4 and workers_for(10, None, "ray") == 8

    calls = []
    for module in (runplan, engines):  # plan_run imports map_parts at import, the scan where it runs
        real = module.map_parts
        monkeypatch.setattr(module, "map_parts", lambda *a, _real=real, **k: calls.append(k["workers"]) or _real(*a, **k))
    shapes, _ = synthetic_shapes("text", 400, seed=0)
    pq.write_table(shapes.to_arrow(), tmp_path / "index.parquet")
    for extra in ([], ["--workers", "2"]):
        assert main(["plan", str(tmp_path / "index.parquet"), "--global-batch-tokens", "8192", "--no-progress",
                     "--out", str(tmp_path / "plan.parquet"), *extra]) == 0
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"inputs": f"question {i}", "targets": "answer"}) + "\n" for i in range(50)))
    assert main(["scan", str(data), "--no-progress", "--out", str(tmp_path / "scan.parquet")]) == 0
    assert calls == [1, 2, 1]
    out = capsys.readouterr().out
    assert "(1 worker, local)" in out and "(2 workers, local)" in out and "(local, 1 worker, 1 part)" in out

    parser = argparse.ArgumentParser()
    _add_engine_options(parser)
    assert str(SAMPLES_PER_WORKER) in parser.format_help()  # the --workers help names the same share
