"""Errors name their cause (issue 37 C): `run_ranks` names the rank that failed first by time, not
the lowest failing rank; an indexed loader over data whose records were all skipped as bad names
the files and how many records were skipped."""

from __future__ import annotations

import os

import pytest

from dynabatch import DataLoader
from dynabatch.loader.settings import records_from_keywords
from dynabatch.pipeline.runtime import launch
from test_dataloader_data import PLAN, write_jsonl, write_parquet

# Rank 1 fails first but tears down slowly: its exit handler lets rank 0 fail only then (a marker
# file) and waits until rank 0 has exited. By exit, rank 0 comes first; by failure, rank 1 does.
WORKER = """\
import atexit, os, time

def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()[0]

def _let_rank0_fail_then_wait(folder):
    open(os.path.join(folder, "rank1.failed"), "w").close()  # after the launcher recorded our failure
    pid_file = os.path.join(folder, "rank0.pid")
    for _ in range(2400):  # a bound (120 s), not a target: rank 0 exits right after it sees the marker
        if os.path.exists(pid_file) and _state(int(open(pid_file).read())) in (None, "Z"):
            return
        time.sleep(0.05)

def work(rank, world_size, port, folder):
    if rank == 1:
        atexit.register(_let_rank0_fail_then_wait, folder)
        raise ValueError("rank 1 failed first, on purpose")
    with open(os.path.join(folder, ".rank0.pid"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(folder, ".rank0.pid"), os.path.join(folder, "rank0.pid"))
    while not os.path.exists(os.path.join(folder, "rank1.failed")):
        time.sleep(0.02)
    raise RuntimeError("rank 0 failed because rank 1 did")
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the worker watches its peer in /proc")
def test_run_ranks_names_the_rank_that_failed_first_by_time(tmp_path, monkeypatch):
    monkeypatch.setenv(launch.PRELOAD_ENV, "")  # a fork server of torch and dynabatch only: nothing else runs
    (tmp_path / "worker.py").write_text(WORKER)
    target = f"{tmp_path / 'worker.py'}:work"
    seen = []
    real = launch.launch_local

    def recording(*args, **kwargs):
        seen.extend(real(*args, **kwargs))
        return seen

    monkeypatch.setattr(launch, "launch_local", recording)
    with pytest.raises(RuntimeError) as e:
        launch.run_ranks(target, 2, args=(str(tmp_path),))
    r0, r1 = seen
    assert r0.returncode == r1.returncode == 1
    # The exit order is the other way, or a tie when the launcher's one poll sees both exits: by exit
    # time or by the lowest rank, rank 0 would be named either way.
    assert r1.failed_s < r0.failed_s and r0.wall_s <= r1.wall_s, seen
    msg = str(e.value)
    assert msg.startswith(f"{target}: rank 1 of 2 exited with 1: the first to fail, {r1.failed_s:.1f} s after the "
                          f"launch (then rank 0 exited with 1 at {r0.failed_s:.1f} s); the end of its stderr:\n"), msg
    assert "ValueError: rank 1 failed first, on purpose" in msg and "rank 0 failed because" not in msg, msg
    assert launch.first_failure(seen) is r1


def test_data_whose_records_were_all_skipped_names_its_files_and_the_count(tmp_path):
    bad = write_parquet(tmp_path / "bad.parquet", [{"inputs": None, "targets": "y", "task": "t"}] * 10)
    kw = records_from_keywords(dict(global_batch_tokens=500, mode="indexed", cache_tokens=False,
                               source_options={"on_error": "skip"}, **PLAN))
    with pytest.raises(ValueError) as e:
        DataLoader(bad, **kw)
    assert str(e.value).startswith(f"the data 'parquet' ({bad}) holds no samples: all 10 of its records were "
                                   "skipped as bad (on_error='skip'; by kind: {'missing_field': 10}); nothing to "
                                   "train on: fix the records or their field mapping"), str(e.value)


def test_empty_data_names_its_files(tmp_path):
    files = [write_jsonl(tmp_path / f"part{i}.jsonl", []) for i in range(5)]
    with pytest.raises(ValueError) as e:
        DataLoader(str(tmp_path / "*.jsonl"), **records_from_keywords(dict(global_batch_tokens=500, mode="indexed", **PLAN)))
    assert str(e.value) == (f"the data 'jsonl' ({', '.join(files[:3])} and 2 more) holds no samples: nothing to "
                            "train on; check the paths/split"), str(e.value)
