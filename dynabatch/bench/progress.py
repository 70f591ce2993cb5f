"""Progress of the benches whose work runs on rank processes (``dynabatch bench train / multimodel``).

The rule every long command follows (a bar on a terminal, lines with percent and ETA off one, nothing
under ``--json``; ``--progress`` / ``--no-progress``) is `dynabatch.progress`; its `add_progress_option`,
`show_progress` and `progress_bar` are importable from here too. ``bench train`` and ``bench
multimodel`` train on rank processes (`dynabatch.pipeline.launch_local`): there rank 0 calls
`rank_tick` once per unit (a step of a method), which appends an empty line to the file named by
``$DYNABATCH_PROGRESS``, and `watch_ticks` in the launching process moves the bar by the empty lines
that appeared. Between units rank 0 says what it is doing with `rank_note` (a line of text: "set up dp
(2/4)"), shown beside the bar, so that a set-up of minutes (a profile, a partition search per method)
is not a bar standing still at 0.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager

from ..progress import add_progress_option, progress_bar, show_progress  # noqa: F401  (the one rule, also from here)

PROGRESS_ENV = "DYNABATCH_PROGRESS"


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
            else:
                bar.refresh()  # off a terminal: the periodic line, also while a unit runs for minutes
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
