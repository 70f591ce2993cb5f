"""`--engine ray`: the same scan and plan functions on a local Ray instance give the same bytes
as local processes. Skipped only when Ray cannot be imported."""

from __future__ import annotations

import os

import pytest

from dynabatch.cli import main
from dynabatch.offline import load_run_plan

from test_offline import write_dataset

ray = pytest.importorskip("ray", reason="Ray is not installed; pip install 'dynabatch[ray]' (ray>=2.9) "
                                        "to test --engine ray")


@pytest.fixture(scope="module")
def local_ray():
    """The Ray instance the first ``--engine ray`` command starts (the library's own start, as a user
    gets it), shut down after this module."""
    started = not ray.is_initialized()
    yield started
    if started and ray.is_initialized():
        ray.shutdown()


def test_ray_scan_and_plan_equal_local(local_ray, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    write_dataset(data, n=1500, seed=1)
    local, on_ray = tmp_path / "local.parquet", tmp_path / "ray.parquet"
    assert main(["scan", str(data), "--workers", "2", "--no-progress", "--out", str(local)]) == 0
    assert main(["scan", str(data), "--engine", "ray", "--workers", "2", "--no-progress", "--out", str(on_ray)]) == 0
    assert "(ray, 2 workers, 4 parts)" in capsys.readouterr().out
    assert local.read_bytes() == on_ray.read_bytes()
    if local_ray:  # the command started Ray: its workers run at this process's priority, not Ray's nice 15
        # (beside other work a nice-15 worker gets a few percent of a core)
        assert ray.get(ray.remote(lambda: os.nice(0)).remote()) == os.nice(0)

    plans = {}
    for engine in ("local", "ray"):
        out = tmp_path / f"plan_{engine}.parquet"
        assert main(["plan", str(local), "--engine", engine, "--workers", "2", "--ranks", "8", "--stages", "4",
                     "--global-batch-tokens", "32768", "--epochs", "2", "--no-progress", "--out", str(out)]) == 0
        plans[engine] = load_run_plan(out)
    assert plans["local"].num_steps > 4
    assert plans["local"].table.equals(plans["ray"].table, check_metadata=True)


def test_ray_worker_error_is_one_line(local_ray, tmp_path, capsys):
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"inputs": "fine", "targets": "ok"}\n{"inputs": "broken", "targets": \n')
    assert main(["scan", str(bad), "--engine", "ray", "--workers", "2", "--no-progress",
                 "--out", str(tmp_path / "o.parquet")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "broken.jsonl:2" in err and "invalid JSON" in err, err
