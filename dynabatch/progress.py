"""The one progress rule of every long ``dynabatch`` command (datagen, scan, plan, profile, bench *).

* On a terminal (stderr is a TTY): a tqdm bar on stderr, redrawn in place.
* Off a terminal (a log file, a pipe, CI): no bar, since each redraw of one would be another
  ``\\r``-separated copy of it in the log. Instead `LineProgress` writes one line when a stage ends
  and, while it runs, at most one line every `LOG_EVERY_S` seconds, each with the percent done and
  the time left: ``scan: 45% (9000/20000 samples), 12 s elapsed, ETA 15 s``.
* Nothing under ``--json`` (stdout is the JSON document and stderr stays quiet) or ``--no-progress``.

A command adds ``--progress`` / ``--no-progress`` with `add_progress_option` (default: on) and reads
the choice back with `show_progress`; the work makes each stage's bar with
`progress_bar(total, desc, unit, show)`. Importing this module imports no tqdm (the first bar on a
terminal does), so a parser that adds the option stays light.
"""

from __future__ import annotations

import argparse
import sys
import time

#: Seconds between two progress lines of one stage off a terminal.
LOG_EVERY_S = 10.0


def add_progress_option(p, what: str = "progress") -> None:
    """``--progress`` / ``--no-progress`` on a command's parser (default: on; `show_progress`)."""
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help=f"show {what} on stderr: a bar on a terminal, else a line every {LOG_EVERY_S:.0f} s and at "
                        "the end of each stage with the percent done and the time left (default: on; never with "
                        "--json)")


def show_progress(args) -> bool:
    """Whether a command run with these parsed arguments shows progress: never under ``--json``, not
    with ``--no-progress``, else yes (`progress_bar` picks a bar or lines)."""
    if getattr(args, "json", False):
        return False
    return getattr(args, "progress", None) is not False


def is_terminal(stream) -> bool:
    """Whether ``stream`` is a terminal (False for a closed or file-less stream)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _duration(seconds: float) -> str:
    """``4.2 s``, ``37 s``, ``3 min 05 s``, ``1 h 02 min``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, s = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {s:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def _count(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


class LineProgress:
    """Progress of one stage as lines of text (the off-terminal half of the rule; module doc).

    The part of tqdm's interface the commands use: `update`, `set_postfix_str` (a note shown after
    the figures), `refresh`, `close` and use as a context manager. A line is written on `update`,
    `set_postfix_str` or `refresh` when ``every_s`` seconds passed since the last one, and always on
    `close`: ``done`` when ``total`` was reached, ``stopped at`` otherwise. ``total`` None: counts
    without percent or ETA. ``clock`` (seconds, monotonic) and ``file`` (default: stderr at the
    time of writing) are for tests."""

    def __init__(self, total: float | None, desc: str, unit: str = "it", *, every_s: float = LOG_EVERY_S,
                 file=None, clock=time.monotonic):
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, float(every_s)
        self.n: float = 0
        self.note = ""
        self._file, self._clock = file, clock
        self._start = self._last = clock()
        self._closed = False

    def _units(self) -> str:
        return self.unit if self.unit.endswith("s") else self.unit + "s"

    def line(self, now: float | None = None, final: bool = False) -> str:
        """The line this stage would write now (``final``: the closing one)."""
        elapsed = (self._clock() if now is None else now) - self._start
        head = f"{self.desc}: " if self.desc else ""
        if not self.total:
            text = f"{head}{_count(self.n)} {self._units()}"
            text += f" in {_duration(elapsed)}" if final else f", {_duration(elapsed)} elapsed"
        else:
            frac = min(self.n / self.total, 1.0)
            figures = f"{frac:.0%} ({_count(self.n)}/{_count(self.total)} {self._units()})"
            if final:
                text = (f"{head}done, {figures} in {_duration(elapsed)}" if self.n >= self.total else
                        f"{head}stopped at {figures} after {_duration(elapsed)}")
            else:
                eta = _duration(elapsed * (1 - frac) / frac) if frac > 0 else "unknown"
                text = f"{head}{figures}, {_duration(elapsed)} elapsed, ETA {eta}"
        return text + (f" - {self.note}" if self.note and not final else "")

    def _write(self, text: str) -> None:
        f = self._file if self._file is not None else sys.stderr
        print(text, file=f, flush=True)

    def refresh(self) -> None:
        """Write a line if ``every_s`` passed since the last one (a watcher calls this while waiting)."""
        now = self._clock()
        if not self._closed and now - self._last >= self.every_s:
            self._last = now
            self._write(self.line(now))

    def update(self, n: float = 1) -> None:
        self.n += n
        self.refresh()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.note = " ".join(str(s).split())
        if refresh:
            self.refresh()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._write(self.line(final=True))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NoProgress:
    """The bar of a stage that shows nothing (``--no-progress``, ``--json``): every call a no-op."""

    n: float = 0
    total: float | None = None

    def update(self, n: float = 1) -> None:
        self.n += n

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def progress_bar(total: float | None, desc: str, unit: str, show: bool, **tqdm_kw):
    """The bar of one stage of ``total`` ``unit`` by the rule (module doc): nothing unless ``show``, a
    tqdm bar on stderr when it is a terminal (``tqdm_kw`` passed to ``tqdm.auto.tqdm``, e.g. ``unit_scale=True``), else
    a `LineProgress`."""
    if not show:
        return NoProgress()
    if is_terminal(sys.stderr):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, **tqdm_kw)
    return LineProgress(total, desc, unit)
