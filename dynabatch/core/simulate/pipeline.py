"""Event-driven simulator of pipeline-parallel schedules: every registered schedule
(`dynabatch.core.schedule.registry`), ``auto``, and explicit orders.

Model: ``S`` stages (ranks) each run a fixed list of ops strictly in order, one at a time. A stage may
hold ``v`` model chunks (virtual stage ``q = c S + s`` is chunk ``c`` of stage ``s``; ``v = 1`` without
chunks). An op is the forward (``F``) or backward (``B``) of micro-batch ``j`` on a chunk, or the two
parts of a split backward (``Bi``, input gradients, then ``W``, weight gradients), and may start once
the stage is free and its dependency has finished:

* ``F(q, j)`` needs ``F(q-1, j)`` finished plus ``p2p_s[j]`` (activation transfer);
* ``B(Q-1, j)`` (or ``Bi``) needs ``F(Q-1, j)`` finished (same stage, no transfer);
* ``B(q, j)`` (or ``Bi``) needs ``B(q+1, j)`` (or ``Bi``) finished plus ``p2p_s[j]`` (gradient transfer);
* ``W(q, j)`` needs ``Bi(q, j)`` (same stage); it takes `WEIGHT_SHARE` of the backward's seconds.

Sends are asynchronous: the transfer time sits on the dependency edge only, the sending stage is never
blocked; chunks of one stage pass results on without a transfer. All times are in seconds, memory in
bytes. Orders are `dynabatch.core.schedule.ops.StepOps` (per rank its typed ops); plain op codes (int
``[S, 2M]``: ``j + 1`` forward, ``-(j + 1)`` backward, one chunk) are accepted too.

The hot loops are ``@njit(cache=True)`` kernels (`dynabatch.core.kernels.simulate`: the table kernels,
:func:`simulate_kernel`, :func:`makespan_kernel`, :func:`schedule_kernel`, :func:`inflight_kernel` on plain
codes, each beside its plain-Python reference) that other numba code may call directly with contiguous
float64 / int32 arrays. :func:`simulate_pipeline` is the validating, user-facing wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels import op_codes as oc
from ..kernels.arrays import kernel_array
from ..kernels.op_codes import WEIGHT_SHARE
from ..kernels.simulate import (
    DEADLOCK,
    chunk_times,
    inflight_kernel,
    inflight_table_kernel,
    makespan_kernel,
    makespan_table_kernel,
    schedule_kernel,
    simulate_kernel,
    simulate_table_kernel,
)
from ..schedule.build import adaptive_order, step_ops
from ..schedule.ops import StepOps
from ..schedule.registry import AUTO_PREFERENCE, schedule_info
from ..schedule.search import pick_auto

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
    ``start_s`` / ``end_s`` are ``[Q, M, 2]`` (``Q = v S`` virtual stages; ``Q = S`` without chunks):
    index ``[q, j, 0]`` is the forward of micro-batch ``j`` on virtual stage ``q``, ``[q, j, 1]`` its
    backward (of a split backward: its input part; ``weight_start_s`` / ``weight_end_s`` ``[Q, M]`` hold the
    weight parts, None without). ``schedule`` names the order that was simulated (``auto`` resolved to the
    one it chose; empty for an explicit order) and ``ops`` holds it (`StepOps`).
    """

    makespan_s: float
    bubble_fraction: float
    lower_bound_s: float
    peak_inflight: np.ndarray
    peak_inflight_bytes: np.ndarray
    start_s: np.ndarray
    end_s: np.ndarray
    schedule: str = ""
    ops: StepOps | None = None
    weight_start_s: np.ndarray | None = None
    weight_end_s: np.ndarray | None = None


# --------------------------------------------------------------------------- wrappers


def pipeline_schedule(num_stages: int, num_microbatches: int, kind: str = "1f1b") -> np.ndarray:
    """Plain op codes, int32 ``[num_stages, 2 * num_microbatches]``, of a static schedule of one chunk
    without split backwards (``"gpipe"``, ``"1f1b"``; `dynabatch.core.schedule.build.step_ops` gives every
    schedule's ops). ``"adaptive"`` and ``"auto"`` depend on the micro-batches' times and memory: see
    `simulate_pipeline` and `dynabatch.core.schedule.build.adaptive_order`.
    """
    info = schedule_info(str(kind).lower())
    if not info.static:
        raise ValueError(f"the {kind!r} order depends on the micro-batches' times and memory; use simulate_pipeline"
                         f"(..., schedule={kind!r}, mem_bytes=..., memory_limit=...) or adaptive_order")
    S, M = int(num_stages), int(num_microbatches)
    if S < 1 or M < 1:
        raise ValueError(f"need num_stages >= 1 and num_microbatches >= 1, got {S} and {M}")
    return step_ops(info.name, S, M).codes()


def makespan(fwd_s, bwd_s, ops, p2p_s) -> float:
    """Makespan in seconds of ``ops`` (a `StepOps`, or plain op codes int32 ``[S, 2M]``), or ``+inf`` if they
    deadlock.

    Fast path with no validation beyond dtype/shape: ``fwd_s``/``bwd_s`` are ``[S, M]`` seconds (``[v S, M]``
    per virtual stage, or ``[S, M]`` split evenly over a `StepOps`' chunks), ``p2p_s`` is ``[M]`` seconds. A
    schedule that is not a per-stage permutation of all ops gives an unspecified (but memory-safe) answer.
    """
    fwd, bwd, p2p = (kernel_array(x, np.float64) for x in (fwd_s, bwd_s, p2p_s))
    if fwd.ndim != 2 or bwd.shape != fwd.shape or p2p.shape != (fwd.shape[1],):
        raise ValueError(
            f"makespan needs fwd/bwd [S, M] and p2p [M]; got {fwd.shape}, {bwd.shape}, {p2p.shape}"
        )
    if isinstance(ops, StepOps):
        if ops.num_chunks > 1 and fwd.shape[0] == ops.num_stages:
            fwd, bwd = chunk_times(fwd, ops.num_chunks), chunk_times(bwd, ops.num_chunks)
        out = makespan_table_kernel(fwd, bwd, WEIGHT_SHARE, p2p, ops.kernel_table)
    else:
        out = makespan_kernel(fwd, bwd, p2p, kernel_array(ops, np.int32))
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

    ``fwd_s``/``bwd_s``: ``[M]`` (the same on every stage; the stage count then comes from an explicit
    order or ``num_stages``), ``[S, M]`` per-stage times, or ``[v S, M]`` per virtual stage for a schedule
    of ``v`` chunks per stage (given ``num_stages`` or an explicit order; per-stage times give each chunk a
    ``1 / v`` share of its stage's). ``schedule``: a registered name (``"gpipe"``, ``"1f1b"``,
    ``"adaptive"``: the memory-aware order of `dynabatch.core.schedule.build.adaptive_order` on these times,
    ``mem_bytes`` and ``memory_limit``; ``"auto"``: simulate `AUTO_PREFERENCE`, return the lowest makespan
    whose peak in-flight bytes per stage fit ``memory_limit``, ``SimResult.schedule`` names it; the others
    of `dynabatch.core.schedule.registry.SCHEDULE_NAMES`), a `StepOps`, or plain op codes int ``[S, 2M]`` in which every stage lists each
    ``F_j`` and ``B_j`` exactly once. ``p2p_s``: scalar or ``[M]`` transfer time of micro-batch ``j`` between
    neighbouring stages (activation forward, gradient backward), modelled as an async send.
    ``mem_bytes``: optional ``[M]`` activation bytes a micro-batch holds on a stage between its forward
    and its (last) backward part. ``memory_limit``: in-flight activation bytes per stage for ``adaptive``
    and ``auto`` (default ``S`` times the largest micro-batch, 1F1B's stage-0 depth; without
    ``mem_bytes`` every micro-batch counts 1). ``adaptive`` raises ValueError when one micro-batch alone
    exceeds it.

    ``lower_bound_s`` is valid for *any* order of these times (up to float rounding)::

        busy_s = sum_j (f[s, j] + b[s, j])                # over the stage's chunks
        head_s = min_j sum_{q < s} (f[q, j] + p2p_j)      # earliest any op can start on s (chunk 0)
        tail_s = min_j sum_{q < s} (b[q, j] + p2p_j)      # s's last backward must still travel back
                                                          # to virtual stage 0 (0 with a split backward:
                                                          # a weight part can end a stage)
        lower_bound = max_s (head_s + busy_s + tail_s)

    Raises ``ValueError`` for malformed input and :class:`PipelineDeadlock` for an order that can never
    finish.
    """
    name = schedule.lower() if isinstance(schedule, str) else ""
    if name:
        info = schedule_info(name)
        chunks = info.chunks
    else:
        chunks = schedule.num_chunks if isinstance(schedule, StepOps) else 1
    fwd, bwd, S = _stage_times(fwd_s, bwd_s, schedule, num_stages, chunks)
    M = fwd.shape[1]
    p2p = _per_microbatch("p2p_s", p2p_s, M)
    mem = np.zeros(M) if mem_bytes is None else _per_microbatch("mem_bytes", mem_bytes, M)
    if name == "auto":
        return _simulate_auto(fwd, bwd, p2p, mem_bytes, memory_limit)
    if name == "adaptive":
        ops = StepOps.from_codes(adaptive_order(fwd, bwd, mem_bytes if mem_bytes is None else mem, memory_limit,
                                                p2p_s=p2p), "adaptive")
    elif name:
        ops = step_ops(name, S, M)
    else:
        ops = _explicit_ops(schedule, S, M)
    if ops.num_chunks > 1 and fwd.shape[0] == S:
        fwd, bwd = chunk_times(fwd, ops.num_chunks), chunk_times(bwd, ops.num_chunks)
    Q = fwd.shape[0]
    start, end = np.empty((Q, M, 2)), np.empty((Q, M, 2))
    wstart, wend = np.empty((Q, M)), np.empty((Q, M))
    if simulate_table_kernel(fwd, bwd, WEIGHT_SHARE, p2p, ops.kernel_table, start, end, wstart, wend) == DEADLOCK:
        raise _deadlock_error(ops, end, wend)

    span = float(max(end.max(), wend.max()))
    busy = float(fwd.sum() + bwd.sum())
    # busy and span sum the same times in different orders; clamp the rounding residue.
    bubble = max(0.0, 1.0 - busy / (S * span)) if span > 0 else 0.0
    peak_n = np.empty(S, dtype=np.int64)
    peak_b = np.empty(S, dtype=np.float64)
    inflight_table_kernel(ops.kernel_table, mem, np.int64(ops.num_chunks), peak_n, peak_b)
    return SimResult(
        makespan_s=span,
        bubble_fraction=bubble,
        lower_bound_s=_lower_bound(fwd, bwd, p2p, S, ops.split),
        peak_inflight=peak_n,
        peak_inflight_bytes=peak_b,
        start_s=start,
        end_s=end,
        schedule=name,
        ops=ops,
        weight_start_s=wstart if ops.split else None,
        weight_end_s=wend if ops.split else None,
    )


def _simulate_auto(fwd, bwd, p2p, mem_bytes, memory_limit) -> SimResult:
    """``schedule="auto"`` of `simulate_pipeline`: the lowest makespan among `AUTO_PREFERENCE` whose peak
    in-flight bytes per stage fit the limit (ties in `AUTO_PREFERENCE` order)."""
    S, M = fwd.shape
    count = np.ones(M) if mem_bytes is None else _per_microbatch("mem_bytes", mem_bytes, M)
    limit = float(S * count.max()) if memory_limit is None else float(memory_limit)
    sims, peaks = {}, {}
    for name in AUTO_PREFERENCE:
        sims[name] = simulate_pipeline(fwd, bwd, schedule=name, p2p_s=p2p, mem_bytes=mem_bytes, memory_limit=limit)
        peak_n = np.empty(S, dtype=np.int64)
        peak_b = np.empty(S)
        inflight_table_kernel(sims[name].ops.kernel_table, count, np.int64(sims[name].ops.num_chunks), peak_n, peak_b)
        peaks[name] = float(peak_b.max())
    return sims[pick_auto({n: sim.makespan_s for n, sim in sims.items()}, peaks, limit)]


# --------------------------------------------------------------------------- helpers


def _lower_bound(fwd: np.ndarray, bwd: np.ndarray, p2p: np.ndarray, S: int, split: bool) -> float:
    Q = fwd.shape[0]
    hops = np.arange(S)[:, None] * p2p[None, :] * (S > 1)
    # Exclusive prefix sums over the first S virtual stages (chunk 0): what micro-batch j spends before
    # reaching stage s.
    head = (np.cumsum(fwd[:S], axis=0) - fwd[:S] + hops).min(axis=1)
    tail = np.zeros(S) if split else (np.cumsum(bwd[:S], axis=0) - bwd[:S] + hops).min(axis=1)
    busy = (fwd.reshape(Q // S, S, -1).sum(axis=(0, 2)) + bwd.reshape(Q // S, S, -1).sum(axis=(0, 2)))
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
    return kernel_array(arr, np.float64)


def _stage_times(fwd_s, bwd_s, schedule, num_stages, chunks):
    """Times as float64 ``[S, M]`` or ``[v S, M]`` and the stage count ``S``, validated."""
    fwd = np.asarray(fwd_s, dtype=np.float64)
    bwd = np.asarray(bwd_s, dtype=np.float64)
    for name, arr in (("fwd_s", fwd), ("bwd_s", bwd)):
        if arr.ndim not in (1, 2) or arr.shape[-1] == 0:
            raise ValueError(f"{name} must have shape [M] or [S, M] with M >= 1, got {arr.shape}")
    M = fwd.shape[-1]
    if bwd.shape[-1] != M:
        raise ValueError(f"fwd_s and bwd_s disagree on the number of micro-batches: {fwd.shape} vs {bwd.shape}")
    if isinstance(schedule, StepOps):
        order_stages = schedule.num_stages
    elif not isinstance(schedule, str):
        ops = np.asarray(schedule)
        if ops.ndim != 2 or ops.shape[1] != 2 * M or ops.dtype.kind not in "iu":
            raise ValueError(f"schedule must be an int array [S, {2 * M}], got {ops.dtype} {ops.shape}")
        order_stages = ops.shape[0]
    else:
        order_stages = None
    rows = {"fwd_s": fwd.shape[0] if fwd.ndim == 2 else None, "bwd_s": bwd.shape[0] if bwd.ndim == 2 else None}
    if len({r for r in rows.values() if r is not None}) > 1:
        raise ValueError(f"inconsistent number of stages: {rows}")
    given = {k: v for k, v in (("schedule", order_stages), ("num_stages", num_stages)) if v is not None}
    stated = {int(v) for v in given.values()}
    row = next((r for r in rows.values() if r is not None), None)
    if len(stated) > 1:
        raise ValueError(f"inconsistent number of stages: {given}")
    if stated:
        S = stated.pop()
        if row is not None and row not in (S, chunks * S):
            raise ValueError(f"inconsistent number of stages: {dict(rows, **given)}")
    elif row is not None:
        S = row
    else:
        raise ValueError("1-D fwd_s/bwd_s need num_stages=... or an explicit schedule array")
    if S < 1:
        raise ValueError(f"need at least one stage, got {S}")
    Q = row if row is not None else S
    # kernel_array: broadcast_to of a [Q, M] array is a read-only view, which numba types (and compiles
    # every kernel it reaches) apart from a writable one
    fwd = kernel_array(np.broadcast_to(fwd, (Q, M)), np.float64)
    bwd = kernel_array(np.broadcast_to(bwd, (Q, M)), np.float64)
    _check_times("fwd_s", fwd)
    _check_times("bwd_s", bwd)
    return fwd, bwd, S


def _explicit_ops(schedule, S: int, M: int) -> StepOps:
    """An explicit order (a `StepOps`, or plain op codes in which every stage lists each op once), checked."""
    if isinstance(schedule, StepOps):
        if schedule.num_microbatches != M:
            raise ValueError(f"the order is of {schedule.num_microbatches} micro-batches, the times of {M}")
        schedule.check()
        return schedule
    ops = np.asarray(schedule)
    expected = np.concatenate([np.arange(-M, 0), np.arange(1, M + 1)])
    bad = np.flatnonzero(~np.all(np.sort(ops, axis=1) == expected, axis=1))
    if bad.size:
        s = int(bad[0])
        raise ValueError(
            f"schedule stage {s} must list every F_j and B_j (codes ±1..±{M}) exactly once, got {ops[s].tolist()}"
        )
    return StepOps.from_codes(ops)


def _deadlock_error(ops: StepOps, end: np.ndarray, wend: np.ndarray) -> PipelineDeadlock:
    S = ops.num_stages
    Q = ops.num_virtual_stages
    waits = []
    for s in range(S):
        # Ops run in list order, so the finished ones form a prefix of the stage's list.
        rank = ops.rank(s)
        done = [op.kind == oc.UPDATE or np.isfinite(
            wend[op.chunk * S + s, op.microbatch] if op.kind == oc.BACKWARD_WEIGHT else
            end[op.chunk * S + s, op.microbatch, int(op.kind != oc.FORWARD)]) for op in rank]
        pos = done.index(False) if False in done else len(rank)
        if pos == len(rank):
            continue
        op = rank[pos]
        q = op.chunk * S + s
        if op.kind == oc.FORWARD:
            need = f"F{op.microbatch} of virtual stage {q - 1} (stage {(s - 1) % S})"
        elif op.kind == oc.BACKWARD_WEIGHT:
            need = f"Bi{op.microbatch} on this stage first"
        elif q == Q - 1:
            need = f"F{op.microbatch} on this stage first"
        else:
            need = f"B{op.microbatch} of virtual stage {q + 1} (stage {(s + 1) % S})"
        if Q == S:
            need = need.replace(f" of virtual stage {q - 1} (stage {s - 1})", f" from stage {s - 1}").replace(
                f" of virtual stage {q + 1} (stage {s + 1})", f" from stage {s + 1}")
        waits.append((s, op, f"stage {s} waits forever at {op.name} (needs {need})"))
    first_stage, first_op, _ = waits[0]
    code = first_op.microbatch + 1 if first_op.kind == oc.FORWARD else -(first_op.microbatch + 1)
    return PipelineDeadlock("pipeline deadlock: " + "; ".join(w[2] for w in waits), first_stage, code)
