"""Helpers that `dynabatch bench load` and `dynabatch bench loader` share.

Per-second rates, the one-line summary of a library failing deep inside a timed run, and running
the command (one-line error, no traceback, on bad input; JSON or the table on success). Their
parsers: `dynabatch.commands.bench_load`.
"""

from __future__ import annotations

import json
import sys
from typing import Callable

from ..progress import show_progress


def per_s(count: float, seconds: float) -> float:
    """``count / seconds``; infinite when no time was measured."""
    return count / seconds if seconds > 0 else float("inf")


def failure_summary(e: BaseException) -> str:
    """``"TypeName: first line of the message"`` for an error raised inside a library."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"


def run_command(args, make_config: Callable, run: Callable, format_table: Callable[[dict], str]) -> int:
    """Build the config from ``args``, run the benchmark, print JSON or the table; 0 on success.

    The benchmark's own error, ``loaders.LoaderError`` (``"file.jsonl:3: invalid JSON ..."``)
    and ``tokenization.SampleError`` are ValueErrors: they print one line, no traceback, and 1.
    """
    try:
        result = run(make_config(), progress=show_progress(args))
    except (ValueError, ImportError, OSError) as e:
        print(f"dynabatch: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0
