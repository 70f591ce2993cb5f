"""`dynabatch.bench.progress`: long benches follow the one progress rule (`dynabatch.progress`: a bar on a
terminal, lines off one, nothing under --json or --no-progress); rank processes move the launcher's bar
(bench train / multimodel)."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from dynabatch import progress as rule
from dynabatch.bench import load_common
from dynabatch.bench.progress import rank_note, rank_tick, show_progress, watch_ticks
from dynabatch.cli import main
from dynabatch.commands.bench_load import add_output_options
from dynabatch.pipeline import launch_local


class _Tty:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty

    def write(self, s):
        return len(s)

    def flush(self):
        pass


@pytest.mark.parametrize("json_out, flag, tty, shown", [
    (False, None, True, True), (False, None, False, True),  # default: on (a bar or lines: `progress_bar`)
    (False, True, False, True), (False, False, True, False),  # --progress / --no-progress
    (True, True, True, False), (True, None, True, False)])  # --json: never
def test_show_progress(monkeypatch, json_out, flag, tty, shown):
    monkeypatch.setattr(sys, "stderr", _Tty(tty))
    assert show_progress(argparse.Namespace(json=json_out, progress=flag)) is shown


def ticking(rank, world, port, n):
    """A rank that does ``n`` units (rank 0 ticks each), after a set-up it says it is in (rank 0's note)."""
    if rank == 0:
        rank_note("set up  the\nmethod")  # one line, whitespace folded
    for _ in range(n):
        if rank == 0:
            rank_tick()
    return n


@pytest.mark.parametrize("show, tty", [(True, True), (True, False), (False, False)])
def test_rank_ticks_move_the_launchers_bar(tmp_path, capsys, monkeypatch, show, tty):
    monkeypatch.setattr(rule, "is_terminal", lambda stream: tty)  # a terminal: tqdm's bar; else lines
    path = str(tmp_path / "progress")
    with watch_ticks(path, 7, "ticks test", "step", show, poll_s=0.05) as env:
        res = launch_local(f"{__file__}:ticking", 2, args=(7,), idle_timeout_s=120, env=env)
    assert [r.result for r in res] == [7, 7], res[0].stderr[-2000:]
    err = capsys.readouterr().err
    if not show:
        assert err == "" and not (tmp_path / "progress").exists()  # the ranks wrote nothing
        return
    assert open(path).read() == "set up the method\n" + "\n" * 7  # rank 0's note and ticks only
    if tty:
        assert "ticks test" in err and "7/7" in err and "set up the method" in err  # the note beside the bar
    else:  # a log: no bar redraws, the stage's line with its percent
        assert "\r" not in err and "ticks test: done, 100% (7/7 steps)" in err.splitlines()[-1], err


SMALL = ["bench", "plan", "--synthetic", "--samples", "2000", "--batches", "2", "--methods", "dp", "pack"]


def test_bench_plan_progress_off_a_terminal_and_not_under_json(capsys):
    assert main([*SMALL, "--progress"]) == 0
    out = capsys.readouterr()
    assert "\r" not in out.err and "bench plan (gpt): done, 100% (" in out.err and "configs)" in out.err
    assert "dp" in out.out
    assert main([*SMALL, "--progress", "--json"]) == 0
    out = capsys.readouterr()
    assert out.err == "" and json.loads(out.out)["methods"].keys() == {"dp", "pack"}


def test_load_and_loader_benches_pass_the_choice_on(capsys):
    """bench load / loader (`load_common.run_command`) give their runs ``progress=show_progress(args)``."""
    seen = []

    def run(cfg, progress):
        seen.append(progress)
        return {"ok": 1}

    for argv, want in ((["--progress"], True), (["--no-progress"], False), (["--progress", "--json"], False)):
        p = argparse.ArgumentParser()
        add_output_options(p, "bars")
        assert load_common.run_command(p.parse_args(argv), lambda: None, run, lambda r: "table") == 0
        assert seen[-1] is want
    capsys.readouterr()
