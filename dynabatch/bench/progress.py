"""Progress bars of the long benches (``dynabatch bench plan / load / loader / train / multimodel``).

A bar shows on stderr when it is a terminal, or when forced with ``--progress``; never with
``--json`` (the JSON document is all a run prints) or ``--no-progress`` (`show_progress`). Benches
that work in their own process count their units (methods, configurations, runs, samples) with
`progress_bar`. ``bench train`` and ``bench multimodel`` train on rank processes
(`dynabatch.pipeline.launch_local`): there rank 0 calls `rank_tick` once per unit (a step of a
method), which appends an empty line to the file named by ``$DYNABATCH_PROGRESS``, and `watch_ticks`
in the launching process moves the bar by the empty lines that appeared. Between units rank 0 says
what it is doing with `rank_note` (a line of text: "set up dp (2/4)"), shown beside the bar, so that a
set-up of minutes (a profile, a partition search per method) is not a bar standing still at 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from contextlib import contextmanager

from tqdm.auto import tqdm

PROGRESS_ENV = "DYNABATCH_PROGRESS"


def add_progress_option(p, what: str = "a progress bar") -> None:
    """``--progress`` / ``--no-progress`` on a bench's parser (default: auto, see `show_progress`)."""
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help=f"show {what} on stderr (default: when stderr is a terminal; never with --json)")


def show_progress(args) -> bool:
    """Whether a bench run with these parsed arguments shows its bar: never under ``--json``, else
    ``--progress`` / ``--no-progress``, else when stderr is a terminal."""
    if getattr(args, "json", False):
        return False
    flag = getattr(args, "progress", None)
    return sys.stderr.isatty() if flag is None else bool(flag)


def progress_bar(total: int | None, desc: str, unit: str, show: bool):
    """A tqdm bar on stderr of ``total`` ``unit`` (disabled, printing nothing, when not ``show``)."""
    return tqdm(total=total, desc=desc, unit=unit, disable=not show, file=sys.stderr, dynamic_ncols=True)


def _append(line: str) -> None:
    path = os.environ.get(PROGRESS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def rank_tick() -> None:
    """One unit done, on a rank process: an empty line appended to ``$DYNABATCH_PROGRESS`` (no-op when
    unset)."""
    _append("")


def rank_note(text: str) -> None:
    """What a rank process is doing now (one line of text, shown beside the launcher's bar until the
    next note); a no-op when ``$DYNABATCH_PROGRESS`` is unset."""
    _append(" ".join(str(text).split()) or "-")


@contextmanager
def watch_ticks(path: str, total: int, desc: str, unit: str, show: bool, poll_s: float = 0.5):
    """Show a bar of ``total`` ``unit`` moved by the `rank_tick` lines in the file ``path`` while the
    block runs, with the last `rank_note` beside it; yields the environment to give the rank
    processes (``{}`` when not ``show``: the ranks then write nothing)."""
    if not show:
        yield {}
        return
    open(path, "w").close()
    bar = progress_bar(total, desc, unit, True)
    stop = threading.Event()

    def poll():
        done, note = 0, ""
        while True:
            stopping = stop.wait(poll_s)
            with open(path) as f:
                lines = f.read().split("\n")[:-1]  # whole lines only: a rank may be writing the last
            n = lines.count("")
            said = next((line for line in reversed(lines) if line), "")
            if said != note:
                note = said
                bar.set_postfix_str(note, refresh=n == done)
            if n > done:
                bar.update(n - done)
                done = n
            if stopping:
                return

    t = threading.Thread(target=poll, name="bench-progress", daemon=True)
    t.start()
    try:
        yield {PROGRESS_ENV: path}
    finally:
        stop.set()
        t.join()
        bar.close()
