"""Helpers that `dynabatch bench load` and `dynabatch bench loader` share.

Per-second rates, the one-line summary of a library failing deep inside a timed run, and the
command-line plumbing: registering the subcommand, the ``--data``, ``--json`` and
``--progress`` options, and running it (one-line error, no traceback, on bad input; JSON or the table on success).
"""

from __future__ import annotations

import json
import sys
from typing import Callable

from .progress import add_progress_option, show_progress


def per_s(count: float, seconds: float) -> float:
    """``count / seconds``; infinite when no time was measured."""
    return count / seconds if seconds > 0 else float("inf")


def failure_summary(e: BaseException) -> str:
    """``"TypeName: first line of the message"`` for an error raised inside a library."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"


def add_subcommand(bench_sub, name: str, help: str, description: str, epilog: str):
    """Register ``dynabatch bench <name>``; the epilog keeps its line breaks. Returns the parser."""
    import argparse

    return bench_sub.add_parser(name, help=help, description=description, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)


def add_data_option(p, files: str, default: str) -> None:
    """``--data``: the text files or folders `load_data.resolve_text` reads (``files`` says which
    kind); without it the shared FLAN sample ``default``, else generated data."""
    p.add_argument("--data", nargs="+", metavar="PATH",
                   help=f"{files} or folders; default: the shared FLAN sample {default} "
                        "(relative to the repository root), else generated data")


def add_output_options(p, progress_what: str) -> None:
    """``--json`` (one JSON document instead of the table) and ``--progress`` / ``--no-progress``
    (`dynabatch.bench.progress`)."""
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    add_progress_option(p, progress_what)


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
