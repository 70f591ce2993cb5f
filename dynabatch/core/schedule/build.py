"""`step_ops`: the one derivation of a rank's op order, for every registered schedule.

A static schedule's order is fixed by the stage and micro-batch counts (`dynabatch.core.kernels.op_tables`);
``adaptive`` (DynaPipe-style) builds it from the micro-batches' predicted per-stage seconds, transfer
seconds and activation bytes by list scheduling: a free stage runs its earliest-ready backward, else the
next forward in micro-batch order while its in-flight bytes stay within the limit
(`dynabatch.core.kernels.schedules.adaptive_kernel`). The planner's ordering search calls the same kernel
(`rank_ops_kernel`) for every candidate it simulates; the runner, the simulator, inspect and the bench take
their orders from here. Flush-free streams (`stream_ops`) and many models (`multimodel_ops`) are 1F1B
orders with their updates and models. Times are seconds, memory bytes.
"""

from __future__ import annotations

import numpy as np

from ..kernels.arrays import kernel_array
from ..kernels.op_tables import multimodel_table, stream_row
from ..kernels import op_codes as oc
from ..kernels.schedules import OK, OVERSIZE, adaptive_kernel, rank_ops_kernel
from ..kernels.simulate import held_table_kernel, makespan_table_kernel
from ..kernels.times import chunk_times, split_kernel
from .ops import StepOps
from .registry import concrete

#: Forward share of a stage time when no cost model says (plans that record no order, bare shapes).
DEFAULT_FORWARD_FRACTION = 1.0 / 3.0


def step_ops(schedule: str, num_stages: int, num_microbatches: int, *, stage_times=None, p2p_s=0.0,
             mem_bytes=None, forward_fraction: float = DEFAULT_FORWARD_FRACTION,
             memory_limit: float = np.inf) -> StepOps:
    """The ops of one rank's step under ``schedule`` (any concrete registered name; unknown names raise):
    ``num_microbatches`` micro-batches in execution order over ``num_stages`` stages. ``adaptive`` also reads
    ``stage_times`` (``[S, k]`` or ``[k]`` forward+backward seconds, split by ``forward_fraction``), ``p2p_s``
    (scalar or ``[k]`` seconds per hop), ``mem_bytes`` (``[k]`` activation bytes; None: each counts 1) and
    ``memory_limit`` (in-flight bytes per stage; a micro-batch over it runs alone); the static orders only
    the counts."""
    info = concrete(schedule)
    S, k = int(num_stages), int(num_microbatches)
    if S < 1 or k < 0:
        raise ValueError(f"need num_stages >= 1 and num_microbatches >= 0, got {S} and {k}")
    st = np.ones((S, k)) if stage_times is None else np.asarray(stage_times, np.float64)
    st = kernel_array(np.broadcast_to(st, (S, k)) if st.ndim == 1 else st, np.float64)
    if st.shape != (S, k) or not np.all(np.isfinite(st)) or st.min(initial=0) < 0:
        raise ValueError(f"stage_times must be [{S}, {k}] (or [{k}]) finite seconds >= 0, got shape {st.shape}")
    # kernel_array: a broadcast of a [k] array is a read-only view, which numba would compile apart
    p2p = kernel_array(np.broadcast_to(np.asarray(p2p_s, np.float64), (k,)), np.float64)
    mem = np.ones(k) if mem_bytes is None else kernel_array(np.broadcast_to(np.asarray(mem_bytes, np.float64),
                                                                            (k,)), np.float64)
    limit = float(S if mem_bytes is None and not np.isfinite(memory_limit) else memory_limit)
    table, _, _, status = rank_ops_kernel(np.int64(info.code), st, p2p, mem, float(forward_fraction), limit)
    if status != OK:
        raise RuntimeError("adaptive order construction stalled (internal error)")
    return StepOps(info.name, S, k, info.chunks, table)


def rank_span_and_peaks(schedule: str, st, p2p, held, forward_fraction: float, limit: float,
                        weight_share: float = oc.WEIGHT_SHARE, split_factor: float = 1.0):
    """``(ops, peaks, span)`` of one rank running micro-batches of stage times ``st`` ``[S, k]`` (seconds,
    execution order) under ``schedule``: its `step_ops` (adaptive keeps ``limit`` bytes in flight, each
    micro-batch counting its largest per-stage bytes), each stage's peak of held bytes ``held`` ``[S, k]``
    (kept from a forward to its backward, or to its weight part when split), and the simulated makespan
    with ``p2p`` ``[k]`` seconds per hop (seconds; the split of ``forward_fraction``). A split backward
    takes ``split_factor`` x the whole one's seconds, ``weight_share`` of them in its weight part (a measured
    `dynabatch.core.cost.backward_split.BackwardSplit`'s figures; default: halves of a whole backward)."""
    st, held, p2p = (kernel_array(x, np.float64) for x in (st, held, p2p))
    S, k = st.shape
    ops = step_ops(schedule, S, k, stage_times=st, p2p_s=p2p, mem_bytes=held.max(axis=0),
                   forward_fraction=forward_fraction, memory_limit=limit)
    peaks = np.empty(S)
    fwd, bwd = split_kernel(st, float(forward_fraction))
    if ops.num_chunks > 1:  # each chunk a 1 / v share of its stage's seconds and bytes
        fwd, bwd, held = (chunk_times(x, ops.num_chunks) for x in (fwd, bwd, held))
    held_table_kernel(ops.kernel_table, held, peaks)
    if ops.split:
        bwd = bwd * float(split_factor)
    return ops, peaks, float(makespan_table_kernel(fwd, bwd, float(weight_share), p2p, ops.kernel_table))


def adaptive_order(fwd_s, bwd_s, mem_bytes=None, memory_limit: float | None = None, *, p2p_s=0.0,
                   num_stages: int | None = None, oversize: str = "error") -> np.ndarray:
    """The adaptive op order as plain op codes, int32 ``[S, 2M]``, from forward and backward seconds.

    ``fwd_s``/``bwd_s``: ``[S, M]`` seconds per stage, or ``[M]`` with ``num_stages``; ``p2p_s``: scalar or
    ``[M]`` seconds per hop; ``mem_bytes``: ``[M]`` activation bytes a micro-batch holds on a stage (None:
    every micro-batch counts 1); ``memory_limit``: in-flight bytes (or micro-batches) per stage (None: ``S``
    times the largest micro-batch, 1F1B's stage-0 depth). ``oversize``: ``"error"`` raises ValueError when
    one micro-batch alone exceeds the limit, ``"alone"`` runs such a micro-batch with nothing else in flight.
    """
    fwd = np.asarray(fwd_s, np.float64)
    bwd = np.asarray(bwd_s, np.float64)
    if fwd.ndim == 1:
        if num_stages is None:
            raise ValueError("1-D fwd_s/bwd_s need num_stages=")
        fwd = np.broadcast_to(fwd, (int(num_stages), fwd.shape[0]))
    if bwd.ndim == 1:
        bwd = np.broadcast_to(bwd, fwd.shape)
    if fwd.ndim != 2 or bwd.shape != fwd.shape or fwd.shape[0] < 1 or fwd.shape[1] < 1:
        raise ValueError(f"fwd_s/bwd_s must be [S, M] (or [M]) with S, M >= 1; got {fwd.shape} and {bwd.shape}")
    if num_stages is not None and fwd.shape[0] != int(num_stages):
        raise ValueError(f"num_stages={num_stages} but the times have {fwd.shape[0]} stages")
    if not (np.all(np.isfinite(fwd)) and np.all(np.isfinite(bwd)) and fwd.min() >= 0 and bwd.min() >= 0):
        raise ValueError("fwd_s/bwd_s must be finite and >= 0")
    S, M = fwd.shape
    p2p = np.full(M, float(p2p_s)) if np.ndim(p2p_s) == 0 else np.asarray(p2p_s, np.float64)
    if p2p.shape != (M,) or not np.all(np.isfinite(p2p)) or p2p.min(initial=0) < 0:
        raise ValueError(f"p2p_s must be a scalar or [{M}] finite seconds >= 0")
    mem = np.ones(M) if mem_bytes is None else np.asarray(mem_bytes, np.float64)
    if mem.shape != (M,) or not np.all(np.isfinite(mem)) or mem.min() < 0:
        raise ValueError(f"mem_bytes must be [{M}] finite bytes >= 0, got shape {mem.shape}")
    limit = float(S * mem.max()) if memory_limit is None else float(memory_limit)
    if oversize not in ("error", "alone"):
        raise ValueError(f"oversize must be 'error' or 'alone', got {oversize!r}")
    ops = np.zeros((S, 2 * M), np.int32)
    code = adaptive_kernel(*(kernel_array(x, np.float64) for x in (fwd, bwd, p2p, mem)), limit, oversize == "alone",
                           ops)
    if code == OVERSIZE:
        j = int(np.argmax(mem))
        raise ValueError(f"micro-batch {j} alone holds {mem[j]:.4g} bytes of activations, over the memory limit "
                         f"of {limit:.4g} bytes per stage; raise the limit or split it (oversize='alone' runs it "
                         "with nothing else in flight)")
    if code != OK:
        raise RuntimeError("adaptive order construction stalled (internal error)")
    return ops


def stream_ops(num_stages: int, ends) -> StepOps:
    """The ops of a flush-free stream of one rank whose steps end at ``ends`` (exclusive, cumulative
    micro-batch counts): 1F1B over the whole stream (one warm-up), step ``k``'s update (``U``, micro-batch
    column ``k``) right after each stage's backward of its last micro-batch."""
    e = np.ascontiguousarray(ends, np.int64)
    if e.ndim != 1 or np.any(np.diff(e) < 0) or e.min(initial=0) < 0:
        raise ValueError(f"ends must be non-decreasing micro-batch counts, got {e.tolist()}")
    S, n = int(num_stages), int(e[-1]) if len(e) else 0
    table = np.zeros((S, 2 * n + len(e), oc.COLUMNS), np.int32)
    for s in range(S):
        stream_row(table, s, S, e)
    return StepOps("1f1b", S, n, 1, table)


def multimodel_ops(num_stages: int, num_models: int, num_microbatches: int, *, interleave: bool = True) -> StepOps:
    """The ops of ``K`` models on one data pass over virtual micro-batches ``p * M + j`` (model position
    ``p`` in the model column): 1F1B over all of them (``interleave``), or model after model."""
    S, K, M = int(num_stages), int(num_models), int(num_microbatches)
    if S < 1 or K < 1 or M < 1:
        raise ValueError(f"need num_stages, num_models and num_microbatches >= 1, got {S}, {K}, {M}")
    return StepOps("1f1b", S, K * M, 1, multimodel_table(S, K, M, bool(interleave)))
