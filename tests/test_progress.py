"""Progress on every scan a user waits for: the DataLoader's length index and token cache,
`build_index` (tqdm on stderr, counting samples to the known total; quiet when stderr is not a
terminal unless asked for), and the one rule of the long commands (`dynabatch.progress`: a bar on a
terminal, off one a line every 10 s and per stage with percent and ETA, nothing under --json)."""

from __future__ import annotations

import re

import pytest

from dynabatch import DataLoader, build_index

from test_dataloader_data import PLAN, records, write_parquet
from dynabatch.loader.settings import records_from_keywords


def _bars(err: str) -> dict[str, str]:
    """Last rendering of each tqdm bar in ``err``, by its description."""
    out = {}
    for piece in re.split(r"[\r\n]", err):
        m = re.match(r"(dynabatch: [^:]+):", piece.strip())
        if m:
            out[m.group(1)] = piece.strip()
    return out


def test_dataloader_index_build_shows_a_bar_of_every_sample(tmp_path, capsys):
    path = write_parquet(tmp_path / "t.parquet", records(300, seed=1))
    dl = DataLoader(path, **records_from_keywords(dict(global_batch_tokens=2000, progress=True, **PLAN)))
    assert len(dl) > 1
    bars = _bars(capsys.readouterr().err)
    assert "300/300" in bars["dynabatch: length index"]  # the token ids are kept by the same pass


def test_token_cache_pass_has_a_bar(tmp_path, capsys):
    path = write_parquet(tmp_path / "t.parquet", records(120, seed=2))
    index = build_index(path, max_len=None)  # an index without token columns: the loader tokenizes once more
    capsys.readouterr()
    DataLoader(path,
               **records_from_keywords(dict(index=index, global_batch_tokens=2000, cache_tokens=True, progress=True,
                                       **PLAN)))
    assert "120/120" in _bars(capsys.readouterr().err)["dynabatch: tokenize (token cache)"]


def test_build_index_bar_and_quiet_when_not_a_terminal(tmp_path, capsys):
    path = write_parquet(tmp_path / "t.parquet", records(90, seed=3))
    build_index(path, progress=True)
    assert "90/90" in _bars(capsys.readouterr().err)["dynabatch: length index"]
    build_index(path)  # default: a bar only on a terminal; pytest's captured stderr is not one
    DataLoader(path, **records_from_keywords(dict(global_batch_tokens=2000, **PLAN)))
    assert "dynabatch:" not in capsys.readouterr().err


# -- the one rule of the long commands (`dynabatch.progress`) ----------------------------------------


class _Clock:
    """A clock the test moves (seconds): progress lines are timed by it, not by the wall."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_every_interval_with_percent_and_eta_and_one_at_the_end():
    import io

    from dynabatch.progress import LineProgress

    clock, out = _Clock(), io.StringIO()
    bar = LineProgress(200, "scan", "sample", every_s=10, file=out, clock=clock)
    for _ in range(50):  # 50 samples within the first interval: no line yet
        bar.update(1)
    assert out.getvalue() == ""
    clock.now += 10.0
    bar.set_postfix_str("part  3/8", refresh=False)
    bar.update(50)  # 100/200 after 10 s: one line, 50%, 10 s left, the note after it
    assert out.getvalue().splitlines() == ["scan: 50% (100/200 samples), 10 s elapsed, ETA 10 s - part 3/8"]
    clock.now += 5.0
    bar.update(25)  # 5 s later: within the interval, no line
    clock.now += 5.0
    bar.update(25)
    bar.update(50)  # all done, no time passed: the closing line says it
    bar.close()
    bar.close()  # closed once: one final line
    assert out.getvalue().splitlines()[1:] == ["scan: 75% (150/200 samples), 20 s elapsed, ETA 6.7 s - part 3/8",
                                               "scan: done, 100% (200/200 samples) in 20 s"]


def test_a_stage_that_stops_early_or_has_no_total_says_so():
    import io

    from dynabatch.progress import LineProgress

    clock, out = _Clock(), io.StringIO()
    with pytest.raises(RuntimeError):
        with LineProgress(8, "plan", "step", file=out, clock=clock) as bar:
            bar.update(2)
            clock.now += 75
            raise RuntimeError("a part failed")
    assert out.getvalue().splitlines() == ["plan: stopped at 25% (2/8 steps) after 1 min 15 s"]
    out = io.StringIO()
    with LineProgress(None, "datagen", "sample", every_s=1, file=out, clock=clock) as bar:
        clock.now += 2
        bar.update(3)
    assert out.getvalue().splitlines() == ["datagen: 3 samples, 2.0 s elapsed", "datagen: 3 samples in 2.0 s"]


def test_progress_bar_is_tqdm_on_a_terminal_lines_off_it_and_nothing_when_off(monkeypatch):
    import sys

    from tqdm import tqdm

    from dynabatch import progress

    class Stream:
        def __init__(self, tty):
            self.tty = tty

        def isatty(self):
            return self.tty

        def write(self, s):
            return len(s)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Stream(True))
    bar = progress.progress_bar(3, "x", "it", True)
    assert isinstance(bar, tqdm)
    bar.close()
    monkeypatch.setattr(sys, "stderr", Stream(False))
    assert isinstance(progress.progress_bar(3, "x", "it", True), progress.LineProgress)
    assert isinstance(progress.progress_bar(3, "x", "it", False), progress.NoProgress)


def _run(args, cwd, capsys, monkeypatch):
    """A command run off a terminal (stdout and stderr captured, as in a log or CI), in this process: the
    commands' progress is decided by what stderr is when they run, not by how the interpreter started."""
    from types import SimpleNamespace

    from dynabatch.cli import main

    monkeypatch.chdir(cwd)
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    return SimpleNamespace(stdout=out, stderr=err)


def test_long_commands_off_a_terminal_write_lines_not_bars(tmp_path, capsys, monkeypatch):
    """datagen and scan in a log: no ``\\r`` bar redraws, one line per stage with its percent; under
    --json nothing but the JSON document."""
    import json

    r = _run(["datagen", "--out", "data", "--text", "3000"], tmp_path, capsys, monkeypatch)
    assert "\r" not in r.stderr
    assert "datagen text rows: done, 100% (3000/3000 samples) in " in r.stderr, r.stderr
    r = _run(["scan", "data/text", "--tokenizer", "bytes", "--workers", "1", "--out", "index.parquet"], tmp_path,
             capsys, monkeypatch)
    assert "\r" not in r.stderr and re.search(r"^scan: done, 100% \(3000/3000 samples\) in ", r.stderr, re.M), r.stderr
    r = _run(["scan", "data/text", "--tokenizer", "bytes", "--workers", "1", "--out", "index.parquet", "--json"],
             tmp_path, capsys, monkeypatch)
    assert r.stderr == "" and json.loads(r.stdout)["samples"] == 3000
    r = _run(["plan", "index.parquet", "--model", "gpt", "--workers", "1", "--out", "plan.parquet", "--json"],
             tmp_path, capsys, monkeypatch)
    assert r.stderr == "" and json.loads(r.stdout)["steps"] >= 1
    r = _run(["datagen", "--out", "quiet", "--text", "100", "--no-progress"], tmp_path, capsys, monkeypatch)
    assert r.stderr == ""
