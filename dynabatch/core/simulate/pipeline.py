"""Event-driven simulator of pipeline-parallel schedules (GPipe, 1F1B, adaptive, auto, explicit orders).

Model: ``S`` stages each run a fixed list of ops strictly in order, one at a time. An op is
the forward (``F_j``) or backward (``B_j``) of micro-batch ``j`` and may start once the
stage is free and its dependency has finished:

* ``F(s, j)`` needs ``F(s-1, j)`` finished plus ``p2p_s[j]`` (activation transfer);
* ``B(S-1, j)`` needs ``F(S-1, j)`` finished (same stage, no transfer);
* ``B(s, j)`` needs ``B(s+1, j)`` finished plus ``p2p_s[j]`` (gradient transfer).

Sends are asynchronous: the transfer time sits on the dependency edge only, the sending
stage is never blocked. All times are in seconds, memory in bytes.

Op encoding (int32): ``j + 1`` is the forward of micro-batch ``j``, ``-(j + 1)`` its
backward; a schedule is an ``[S, 2M]`` array holding one such list per stage.

The hot loops are ``@njit(cache=True)`` kernels (:func:`simulate_kernel`,
:func:`makespan_kernel`, :func:`schedule_kernel`, :func:`inflight_kernel`, defined with their
plain-Python references in `dynabatch.core.kernels.simulate`) that other numba code may call
directly with contiguous float64 / int32 arrays. :func:`simulate_pipeline` is the validating,
user-facing wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..options import SCHEDULE_CODES, SCHEDULES
from ..schedule.schedules import AUTO_PREFERENCE, adaptive_order, pick_auto

# The kernels live beside their plain-Python references in `kernels.simulate`; they are
# re-exported here because numba callers (the planner, `dynabatch.pipeline`) use them by this name.
from ..kernels.simulate import (
    DEADLOCK,
    inflight_kernel,
    makespan_kernel,
    schedule_kernel,
    simulate_kernel,
)

__all__ = [
    "PipelineDeadlock",
    "SimResult",
    "inflight_kernel",
    "makespan",
    "makespan_kernel",
    "pipeline_schedule",
    "schedule_kernel",
    "simulate_kernel",
    "simulate_pipeline",
]

#: Schedule name -> ``kind_code`` of :func:`schedule_kernel` (the one vocabulary of `dynabatch.core.options`).
SCHEDULE_KINDS = SCHEDULE_CODES


class PipelineDeadlock(RuntimeError):
    """An op order that can never finish; ``stage`` and ``op`` name the first stuck stage and its op."""

    def __init__(self, message: str, stage: int, op: int) -> None:
        super().__init__(message)
        self.stage = stage
        self.op = op


@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate_pipeline` (times in seconds, memory in bytes).

    ``peak_inflight[s]`` is the most micro-batches whose activations stage ``s`` holds at
    once: a counter goes +1 when a forward *starts* and -1 when a backward *ends*. Since a
    stage runs its ops one at a time, this only depends on the op order (the maximum
    prefix count of forwards minus backwards in the stage's list).
    ``peak_inflight_bytes[s]`` is the same maximum over the sum of those micro-batches'
    ``mem_bytes`` (all zeros when ``mem_bytes`` was not given).
    ``start_s`` / ``end_s`` are ``[S, M, 2]``: index ``[s, j, 0]`` is the forward of
    micro-batch ``j`` on stage ``s``, ``[s, j, 1]`` its backward. ``schedule`` names the order that
    was simulated (``auto`` resolved to the one it chose; empty for an explicit op array) and
    ``ops`` holds it (int32 ``[S, 2M]``).
    """

    makespan_s: float
    bubble_fraction: float
    lower_bound_s: float
    peak_inflight: np.ndarray
    peak_inflight_bytes: np.ndarray
    start_s: np.ndarray
    end_s: np.ndarray
    schedule: str = ""
    ops: np.ndarray | None = None


# --------------------------------------------------------------------------- wrappers


def pipeline_schedule(num_stages: int, num_microbatches: int, kind: str = "1f1b") -> np.ndarray:
    """Per-stage op lists, int32 ``[num_stages, 2 * num_microbatches]`` (encoding in the module doc).

    ``kind`` is ``"gpipe"`` (all forwards, then all backwards in micro-batch order 0..M-1)
    or ``"1f1b"`` (Megatron's warm-up / one-forward-one-backward / cool-down order). ``"adaptive"``
    and ``"auto"`` depend on the micro-batches' times and memory: see `simulate_pipeline` and
    `dynabatch.core.schedule.schedules.adaptive_order`.
    """
    code = SCHEDULE_KINDS.get(str(kind).lower())
    if code is None:
        raise ValueError(f"unknown schedule kind {kind!r}; valid kinds: {SCHEDULES}")
    if code > 1:
        raise ValueError(f"the {kind!r} order depends on the micro-batches' times and memory; use simulate_pipeline"
                         f"(..., schedule={kind!r}, mem_bytes=..., memory_limit=...) or adaptive_order")
    S, M = int(num_stages), int(num_microbatches)
    if S < 1 or M < 1:
        raise ValueError(f"need num_stages >= 1 and num_microbatches >= 1, got {S} and {M}")
    return schedule_kernel(S, M, code)


def makespan(fwd_s, bwd_s, ops, p2p_s) -> float:
    """Makespan in seconds of op lists ``ops`` (int32 ``[S, 2M]``), or ``+inf`` if they deadlock.

    Fast path with no validation beyond dtype/shape: ``fwd_s``/``bwd_s`` are ``[S, M]``
    seconds, ``p2p_s`` is ``[M]`` seconds. A schedule that is not a per-stage permutation
    of all ops gives an unspecified (but memory-safe) answer.
    """
    fwd = np.ascontiguousarray(fwd_s, dtype=np.float64)
    bwd = np.ascontiguousarray(bwd_s, dtype=np.float64)
    ops = np.ascontiguousarray(ops, dtype=np.int32)
    p2p = np.ascontiguousarray(p2p_s, dtype=np.float64)
    if fwd.ndim != 2 or bwd.shape != fwd.shape or p2p.shape != (fwd.shape[1],):
        raise ValueError(
            f"makespan needs fwd/bwd [S, M] and p2p [M]; got {fwd.shape}, {bwd.shape}, {p2p.shape}"
        )
    out = makespan_kernel(fwd, bwd, p2p, ops)
    if np.isnan(out):
        raise ValueError(f"ops must be int32 [S, 2M] = {(fwd.shape[0], 2 * fwd.shape[1])} with codes in ±1..±M")
    return float(out)


def simulate_pipeline(
    fwd_s,
    bwd_s,
    *,
    schedule="1f1b",
    p2p_s=0.0,
    mem_bytes=None,
    memory_limit: float | None = None,
    num_stages: int | None = None,
) -> SimResult:
    """Simulate a pipeline schedule; times in seconds, ``mem_bytes`` in bytes.

    ``fwd_s``/``bwd_s``: ``[M]`` (the same on every stage; the stage count then comes from
    an explicit ``schedule`` array or ``num_stages``) or ``[S, M]`` per-stage times.
    ``schedule``: ``"gpipe"``, ``"1f1b"``, ``"adaptive"`` (the memory-aware order of
    `dynabatch.core.schedule.schedules.adaptive_order` on these times, ``mem_bytes`` and ``memory_limit``),
    ``"auto"`` (simulate those three, return the lowest makespan whose peak in-flight bytes per stage
    fit ``memory_limit``; ``SimResult.schedule`` names it) or an explicit int ``[S, 2M]`` op array in
    which every stage lists each ``F_j`` and ``B_j`` exactly once.
    ``p2p_s``: scalar or ``[M]`` transfer time of micro-batch ``j`` between neighbouring
    stages (activation forward, gradient backward), modelled as an async send.
    ``mem_bytes``: optional ``[M]`` activation bytes a micro-batch holds on a stage between
    its forward and backward. ``memory_limit``: in-flight activation bytes per stage for ``adaptive``
    and ``auto`` (default ``S`` times the largest micro-batch, 1F1B's stage-0 depth; without
    ``mem_bytes`` every micro-batch counts 1). ``adaptive`` raises ValueError when one micro-batch
    alone exceeds it.

    ``lower_bound_s`` is valid for *any* order of these times (up to float rounding)::

        busy_s = sum_j (f[s, j] + b[s, j])
        head_s = min_j sum_{s' < s} (f[s', j] + p2p_j)   # earliest any op can start on s
        tail_s = min_j sum_{s' < s} (b[s', j] + p2p_j)   # s's last op is a backward that
                                                         # must still travel back to stage 0
        lower_bound = max_s (head_s + busy_s + tail_s)

    Raises ``ValueError`` for malformed input and :class:`PipelineDeadlock` for an order
    that can never finish.
    """
    name = schedule.lower() if isinstance(schedule, str) else ""
    dynamic = name in ("adaptive", "auto")
    fwd, bwd, ops = _stage_times_and_ops(fwd_s, bwd_s, "1f1b" if dynamic else schedule, num_stages)
    S, M = fwd.shape
    p2p = _per_microbatch("p2p_s", p2p_s, M)
    mem = np.zeros(M) if mem_bytes is None else _per_microbatch("mem_bytes", mem_bytes, M)
    if name == "auto":
        return _simulate_auto(fwd, bwd, p2p, mem_bytes, memory_limit)
    if name == "adaptive":
        ops = adaptive_order(fwd, bwd, mem_bytes if mem_bytes is None else mem, memory_limit, p2p_s=p2p)

    start = np.empty((S, M, 2))
    end = np.empty((S, M, 2))
    if simulate_kernel(fwd, bwd, p2p, ops, start, end) == DEADLOCK:
        raise _deadlock_error(ops, end)

    span = float(end.max())
    busy = float(fwd.sum() + bwd.sum())
    # busy and span sum the same times in different orders; clamp the rounding residue.
    bubble = max(0.0, 1.0 - busy / (S * span)) if span > 0 else 0.0
    peak_n = np.empty(S, dtype=np.int64)
    peak_b = np.empty(S, dtype=np.float64)
    inflight_kernel(ops, mem, peak_n, peak_b)
    return SimResult(
        makespan_s=span,
        bubble_fraction=bubble,
        lower_bound_s=_lower_bound(fwd, bwd, p2p),
        peak_inflight=peak_n,
        peak_inflight_bytes=peak_b,
        start_s=start,
        end_s=end,
        schedule=name,
        ops=ops,
    )


def _simulate_auto(fwd, bwd, p2p, mem_bytes, memory_limit) -> SimResult:
    """``schedule="auto"`` of `simulate_pipeline`: the lowest makespan among gpipe, 1f1b and adaptive
    whose peak in-flight bytes per stage fit the limit (ties in `AUTO_PREFERENCE` order)."""
    S, M = fwd.shape
    count = np.ones(M) if mem_bytes is None else _per_microbatch("mem_bytes", mem_bytes, M)
    limit = float(S * count.max()) if memory_limit is None else float(memory_limit)
    sims, peaks = {}, {}
    for name in AUTO_PREFERENCE:
        sims[name] = simulate_pipeline(fwd, bwd, schedule=name, p2p_s=p2p, mem_bytes=mem_bytes, memory_limit=limit)
        peak_n = np.empty(S, dtype=np.int64)
        peak_b = np.empty(S)
        inflight_kernel(sims[name].ops, count, peak_n, peak_b)
        peaks[name] = float(peak_b.max())
    best = sims[pick_auto({n: sim.makespan_s for n, sim in sims.items()}, peaks, limit)]
    return best  # adaptive always fits (it raised otherwise)


# --------------------------------------------------------------------------- helpers


def _lower_bound(fwd: np.ndarray, bwd: np.ndarray, p2p: np.ndarray) -> float:
    S = fwd.shape[0]
    hops = np.arange(S)[:, None] * p2p[None, :]
    # Exclusive prefix sums over stages: what micro-batch j spends before reaching stage s.
    head = (np.cumsum(fwd, axis=0) - fwd + hops).min(axis=1)
    tail = (np.cumsum(bwd, axis=0) - bwd + hops).min(axis=1)
    busy = fwd.sum(axis=1) + bwd.sum(axis=1)
    return float((head + busy + tail).max())


def _check_times(name: str, arr: np.ndarray) -> None:
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must be finite and >= 0, got min {arr.min()!r}")


def _per_microbatch(name: str, value, M: int) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim == 0:
        arr = np.full(M, float(arr))
    if arr.shape != (M,):
        raise ValueError(f"{name} must be a scalar or have shape ({M},), got {arr.shape}")
    _check_times(name, arr)
    return np.ascontiguousarray(arr)


def _stage_times_and_ops(fwd_s, bwd_s, schedule, num_stages):
    """Broadcast times to float64 ``[S, M]`` and resolve/validate ``schedule`` to int32 ``[S, 2M]``."""
    fwd = np.asarray(fwd_s, dtype=np.float64)
    bwd = np.asarray(bwd_s, dtype=np.float64)
    for name, arr in (("fwd_s", fwd), ("bwd_s", bwd)):
        if arr.ndim not in (1, 2) or arr.shape[-1] == 0:
            raise ValueError(f"{name} must have shape [M] or [S, M] with M >= 1, got {arr.shape}")
    M = fwd.shape[-1]
    if bwd.shape[-1] != M:
        raise ValueError(f"fwd_s and bwd_s disagree on the number of micro-batches: {fwd.shape} vs {bwd.shape}")

    ops = None
    if not isinstance(schedule, str):
        ops = np.asarray(schedule)
        if ops.ndim != 2 or ops.shape[1] != 2 * M or ops.dtype.kind not in "iu":
            raise ValueError(f"schedule must be an int array [S, {2 * M}], got {ops.dtype} {ops.shape}")

    candidates = {
        "fwd_s": fwd.shape[0] if fwd.ndim == 2 else None,
        "bwd_s": bwd.shape[0] if bwd.ndim == 2 else None,
        "schedule": None if ops is None else ops.shape[0],
        "num_stages": None if num_stages is None else int(num_stages),
    }
    given = {k: v for k, v in candidates.items() if v is not None}
    if not given:
        raise ValueError("1-D fwd_s/bwd_s need num_stages=... or an explicit schedule array")
    if len(set(given.values())) > 1:
        raise ValueError(f"inconsistent number of stages: {given}")
    S = next(iter(given.values()))
    if S < 1:
        raise ValueError(f"need at least one stage, got {S}")

    fwd = np.ascontiguousarray(np.broadcast_to(fwd, (S, M)))
    bwd = np.ascontiguousarray(np.broadcast_to(bwd, (S, M)))
    _check_times("fwd_s", fwd)
    _check_times("bwd_s", bwd)

    if ops is None:
        ops = pipeline_schedule(S, M, schedule)
    else:
        expected = np.concatenate([np.arange(-M, 0), np.arange(1, M + 1)])
        bad = np.flatnonzero(~np.all(np.sort(ops, axis=1) == expected, axis=1))
        if bad.size:
            s = int(bad[0])
            raise ValueError(
                f"schedule stage {s} must list every F_j and B_j (codes ±1..±{M}) exactly once, got {ops[s].tolist()}"
            )
        ops = np.ascontiguousarray(ops, dtype=np.int32)
    return fwd, bwd, ops


def _op_name(op: int) -> str:
    return f"F{op - 1}" if op > 0 else f"B{-op - 1}"


def _deadlock_error(ops: np.ndarray, end: np.ndarray) -> PipelineDeadlock:
    S = ops.shape[0]
    done = np.isfinite(end)
    waits = []
    for s in range(S):
        # Ops run in list order, so the finished ones form a prefix of the stage's list.
        pos = int(sum(done[s, abs(int(op)) - 1, int(op < 0)] for op in ops[s]))
        if pos == ops.shape[1]:
            continue
        op = int(ops[s, pos])
        j = abs(op) - 1
        if op > 0:
            need = f"F{j} from stage {s - 1}"
        elif s == S - 1:
            need = f"F{j} on this stage first"
        else:
            need = f"B{j} from stage {s + 1}"
        waits.append((s, op, f"stage {s} waits forever at {_op_name(op)} (needs {need})"))
    first_stage, first_op, _ = waits[0]
    return PipelineDeadlock("pipeline deadlock: " + "; ".join(w[2] for w in waits), first_stage, first_op)
