"""How the offline commands (``scan``, ``plan``, ``inspect``) fail: a known error is one line on stderr and
exit 1, and a warning is one line (``dynabatch: warning: ...``); other packages' deprecations stay hidden."""

from __future__ import annotations

import sys


def one_line(e: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none)."""
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A `warnings.showwarning` that prints one ``dynabatch: warning:`` line."""
    print(f"dynabatch: warning: {one_line(message if isinstance(message, Warning) else category(message))}",
          file=sys.stderr)


def guarded(fn):
    """``fn(args)`` as a command function: its known errors one line and exit 1, its warnings one line each."""
    def run(args) -> int:
        import warnings

        from ..core.plan.planner import PlanningError
        from ..shape_sources import ShapeSourceError
        from ..engines import EngineError

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("default", UserWarning)
                # another package's deprecations (Ray's settings...) are for its own users, not ours: a
                # command's stderr stays its own messages (Python hides them outside __main__ too)
                for category in (DeprecationWarning, PendingDeprecationWarning):
                    warnings.filterwarnings("ignore", category=category, module=r"(?!dynabatch|loaders|tokenization)")
                warnings.showwarning = one_line_warning  # restored on exit by catch_warnings
                return int(fn(args) or 0)
        except (PlanningError, ShapeSourceError, EngineError, ValueError, OSError, ImportError) as e:
            print(f"dynabatch: error: {one_line(e)}", file=sys.stderr)
            return 1
    return run


__all__ = ["guarded", "one_line", "one_line_warning"]
