"""A killed loader's token-cache files are reclaimed at the next start, and the private cache
folder is bounded (issue 37 B): files are named for the process that made them (pid and start
time), those of dead processes are deleted, and a full folder is a clear error naming it."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

from dynabatch import DataLoader
from dynabatch.index.token_file import CACHE_MAX_ENV, TokenCacheFull, reclaim_token_files
from dynabatch.process_identity import process_start
from dynabatch.loader.settings import records_from_keywords
from test_dataloader_data import records, write_parquet

linux_only = pytest.mark.skipif(not os.path.isdir("/proc"), reason="process start times come from /proc")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_parquet(tmp_path_factory.mktemp("reclaim") / "train.parquet", records(60, seed=7), row_group_size=30)


def _loader(path):
    return DataLoader(path, **records_from_keywords(dict(global_batch_tokens=1500, cache_tokens=True, mode="indexed")))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # reaped: the pid names no process now (or, recycled, one with another start time)
    return p.pid


@linux_only
def test_files_of_dead_processes_are_reclaimed_when_an_indexed_loader_starts(path, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("DYNABATCH_CACHE_DIR", str(cache))
    dead, me, start = _dead_pid(), os.getpid(), process_start(os.getpid())
    stale = [f"tokens-{dead}-{start}-abc123de.bin",  # a SIGKILLed loader's private file
             f"tokens-{dead}-x1y2z3w4.bin",  # one named before start times were recorded
             f".tokens-{dead}-{start}-q9r8s7t6",  # a SIGKILLed scan's unfinished file
             f"tokens-{me}-1-recycled.bin"]  # this pid, another start time: a dead process's pid reused
    kept = [f"tokens-{me}-{start}-inuse123.bin", "notes.txt"]  # a running process's file; not ours to judge
    for name in stale + kept:
        (cache / name).write_bytes(b"\0" * 4096)
    dl = _loader(path)
    left = sorted(os.listdir(cache))
    ours = os.path.basename(dl.token_cache.path)
    assert ours.startswith(f"tokens-{me}-{start}-") and ours.endswith(".bin"), ours  # named for this process
    assert left == sorted(kept + [ours]), left
    del dl
    gc.collect()
    assert sorted(os.listdir(cache)) == sorted(kept)  # the private file still goes with its loader


@linux_only
def test_reclaim_leaves_files_of_running_processes(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        start = process_start(child.pid)
        assert start is not None
        (tmp_path / f"tokens-{child.pid}-{start}-running1.bin").write_bytes(b"x")
        assert reclaim_token_files(str(tmp_path)) == []
    finally:
        child.communicate(b"")
    assert reclaim_token_files(str(tmp_path)) == [str(tmp_path / f"tokens-{child.pid}-{start}-running1.bin")]


def test_a_full_cache_folder_is_an_error_naming_it_its_size_and_the_remedies(path, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "someone-elses.bin").write_bytes(b"\0" * (3 << 20))
    monkeypatch.setenv("DYNABATCH_CACHE_DIR", str(cache))
    monkeypatch.setenv(CACHE_MAX_ENV, str(2 << 20))
    with pytest.raises(TokenCacheFull) as e:
        _loader(path)
    msg = str(e.value)
    assert f"token cache folder {cache} holds 3.0 MiB in 1 file, over its bound of 2.0 MiB" in msg, msg
    assert f"${CACHE_MAX_ENV}={2 << 20}" in msg and "raise $DYNABATCH_CACHE_MAX_BYTES" in msg, msg
    assert "DYNABATCH_CACHE_DIR" in msg and "cache_tokens=False" in msg, msg
    assert os.listdir(cache) == ["someone-elses.bin"]


def test_a_token_file_that_would_pass_the_bound_stops_and_leaves_nothing(path, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DYNABATCH_CACHE_DIR", str(cache))
    monkeypatch.setenv(CACHE_MAX_ENV, "2000")  # the 60 records' ids need more
    written = rf"\(0 bytes in 0 files, \d+ bytes of the token file being written so far\)"
    with pytest.raises(TokenCacheFull, match=rf"token cache folder {cache} would hold \d+ bytes {written}, over its "
                                             r"bound of 2000 bytes \(\$DYNABATCH_CACHE_MAX_BYTES=2000\)"):
        _loader(path)
    assert os.listdir(cache) == []  # neither the private file nor the unfinished one


def test_a_bound_that_is_no_number_is_named(path, tmp_path, monkeypatch):
    monkeypatch.setenv("DYNABATCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(CACHE_MAX_ENV, "lots")
    with pytest.raises(ValueError, match=r"\$DYNABATCH_CACHE_MAX_BYTES='lots' is not a number of bytes"):
        _loader(path)


def test_a_token_file_removed_while_the_folder_is_counted_is_not_counted(tmp_path, monkeypatch):
    """Loaders of several processes share the folder: a file listed and then removed by another one
    before its size is read no longer holds bytes (before: FileNotFoundError out of the DataLoader's
    start, seen when a test's threaded ranks started next to another test's loaders)."""
    import dynabatch.index.token_file as token_file

    (tmp_path / "tokens-a.bin").write_bytes(b"x" * 10)
    (tmp_path / "tokens-b.bin").write_bytes(b"y" * 7)
    listed = list(os.scandir(tmp_path))  # the listing, taken before the other process's unlink
    (tmp_path / "tokens-a.bin").unlink()
    monkeypatch.setattr(token_file.os, "scandir", lambda folder: iter(listed))
    assert token_file._folder_bytes(str(tmp_path)) == (7, 1)
