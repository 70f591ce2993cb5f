"""The texts of the failure side channel (`dynabatch.pipeline.runtime.failure`): the root-cause message a
failing rank publishes, with the tail of its traceback, and the gist of a transport error.

The root cause travels as text through the Store, and often only a *surviving* rank's output is shown
(``run_ranks`` prints the first failing rank's stderr: usually rank 0's `PipelineAborted`), so the message
carries where the error was raised, not only its type and text."""

from __future__ import annotations

import traceback

#: frames of the failing rank's traceback carried in its root-cause message (innermost last)
TAIL_FRAMES = 4


def root_cause(who: str, exc: BaseException) -> str:
    """``{who} failed: ExcType: message at file:line``, then the last `TAIL_FRAMES` frames of ``exc``'s
    traceback (file, line, function and source line each, innermost last)."""
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    msg = f"{who} failed: {type(exc).__name__}: {exc}{where}"
    if not tb:
        return msg
    frames = "".join(f"\n    {f.filename}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else "")
                     for f in tb[-TAIL_FRAMES:])
    n = min(len(tb), TAIL_FRAMES)
    return f"{msg}\n  its traceback (last {n} frame{'s' if n > 1 else ''}, innermost last):{frames}"


def short(text: str, limit: int = 160) -> str:
    """The gist of a transport error: without gloo's source location and advice, at most ``limit``."""
    text = text.split(". This is typically")[0]
    if "] " in text and text.find("[") < text.find("] "):
        head, _, rest = text.partition("[")
        text = head + rest.partition("] ")[2]
    return text if len(text) <= limit else text[:limit - 3] + "..."
