"""Pipeline schedules beyond the static orders: the memory-aware ``adaptive`` order and ``auto``.

``adaptive`` (DynaPipe-style) is the one definition the simulator (`simulate_pipeline`), the planner
(`plan_microbatches`) and the runner (`dynabatch.pipeline.runtime.schedule.adaptive_orders`) share: list
scheduling on per-stage forward/backward seconds in which a free stage runs its earliest-ready
backward, else the next forward in micro-batch order while the stage's in-flight activation bytes
stay within the memory limit (see `dynabatch.core.kernels.schedules.adaptive_kernel`).

``auto`` simulates ``gpipe``, ``1f1b`` and ``adaptive`` and takes the lowest makespan whose peak
in-flight activation bytes per stage fit the limit (ties: `AUTO_PREFERENCE` order). Peaks: GPipe holds
all M micro-batches on every stage, 1F1B at most ``S - s`` on stage ``s``, adaptive stays within the
limit by construction. Times are seconds, memory bytes.
"""

from __future__ import annotations

import numpy as np

from .kernels.assign import order_ranks
from .kernels.schedules import OK, OVERSIZE, adaptive_kernel, order_ranks_schedule
from .kernels.simulate import inflight_kernel, schedule_kernel
from .options import SCHEDULE_CODES

#: The concrete orders ``auto`` chooses from, in the order it prefers them on equal makespans.
AUTO_PREFERENCE: tuple[str, ...] = ("1f1b", "adaptive", "gpipe")


def adaptive_order(fwd_s, bwd_s, mem_bytes=None, memory_limit: float | None = None, *, p2p_s=0.0,
                   num_stages: int | None = None, oversize: str = "error") -> np.ndarray:
    """The adaptive op order, int32 ``[S, 2M]`` (encoding of `dynabatch.core.simulate`).

    ``fwd_s``/``bwd_s``: ``[S, M]`` seconds per stage, or ``[M]`` with ``num_stages``; ``p2p_s``: scalar
    or ``[M]`` seconds per hop; ``mem_bytes``: ``[M]`` activation bytes a micro-batch holds on a stage
    (None: every micro-batch counts 1); ``memory_limit``: in-flight bytes (or micro-batches) per stage
    (None: ``S`` times the largest micro-batch, 1F1B's stage-0 depth).
    ``oversize``: ``"error"`` raises ValueError when one micro-batch alone exceeds the limit,
    ``"alone"`` runs such a micro-batch with nothing else in flight.
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
    code = adaptive_kernel(np.ascontiguousarray(fwd), np.ascontiguousarray(bwd), np.ascontiguousarray(p2p),
                           np.ascontiguousarray(mem), limit, oversize == "alone", ops)
    if code == OVERSIZE:
        j = int(np.argmax(mem))
        raise ValueError(f"micro-batch {j} alone holds {mem[j]:.4g} bytes of activations, over the memory limit "
                         f"of {limit:.4g} bytes per stage; raise the limit or split it (oversize='alone' runs it "
                         "with nothing else in flight)")
    if code != OK:
        raise RuntimeError("adaptive order construction stalled (internal error)")
    return ops


def schedule_ops_by_count(stages: int, counts: np.ndarray, code: int) -> np.ndarray:
    """int32 ``[kmax + 1, S, 2 kmax]``: the static order (code 0 GPipe, 1 1F1B) for every micro-batch
    count ``k`` in ``counts`` at index ``k`` (zero-padded), as `order_ranks` takes them."""
    kmax = int(counts.max()) if len(counts) else 0
    ops = np.zeros((kmax + 1, stages, 2 * max(kmax, 1)), np.int32)
    for k in np.unique(counts):
        if k > 0:
            ops[k, :, : 2 * k] = schedule_kernel(stages, int(k), code)
    return ops


def _static_peaks(perm, mem, rank_of, ranks, stages, ops) -> np.ndarray:
    """Largest in-flight bytes on any stage of each rank running ``perm`` with ``ops[k]``."""
    peak = np.zeros(ranks)
    pn, pb = np.empty(stages, np.int64), np.empty(stages)
    r_sorted = rank_of[perm]
    for r in range(ranks):
        mine = perm[r_sorted == r]
        k = len(mine)
        if k:
            inflight_kernel(np.ascontiguousarray(ops[k][:, : 2 * k]), np.ascontiguousarray(mem[mine]), pn, pb)
            peak[r] = pb.max()
    return peak


def order_step(schedule: str, times, p2p, mem, rank_of, ranks: int, fwd_fraction: float, stages: int,
               stage_limit: float, optimize: bool):
    """Order each rank's micro-batches for ``schedule`` (``gpipe``, ``1f1b``, ``adaptive`` or ``auto``).

    ``times``/``p2p`` seconds and ``mem`` bytes per micro-batch, ``rank_of`` int32 ranks,
    ``stage_limit`` in-flight activation bytes per stage. Returns ``(perm, rank_time_s, schedule)``:
    micro-batch indices rank by rank in execution order, each rank's simulated makespan, and the
    concrete schedule (``auto`` resolved; see the module docstring).
    """
    rank_of = np.ascontiguousarray(rank_of, np.int32)
    times = np.ascontiguousarray(times, np.float64)
    p2p = np.ascontiguousarray(p2p, np.float64)
    mem = np.ascontiguousarray(mem, np.float64)
    counts = np.bincount(rank_of, minlength=ranks)
    names = AUTO_PREFERENCE if schedule == "auto" else (schedule,)
    results = {}
    for name in names:
        code = SCHEDULE_CODES[name]
        if name == "adaptive":
            perm, rank_time, peak = order_ranks_schedule(times, p2p, mem, rank_of, ranks, fwd_fraction, stages, code,
                                                         float(stage_limit), optimize)
        else:
            ops = schedule_ops_by_count(stages, counts, code)
            perm, rank_time = order_ranks(times, p2p, rank_of, ranks, fwd_fraction, stages, ops, optimize)
            peak = _static_peaks(perm, mem, rank_of, ranks, stages, ops) if schedule == "auto" else np.zeros(ranks)
        rank_time = np.where(np.isnan(rank_time), np.inf, rank_time)
        results[name] = (perm, rank_time, float(peak.max(initial=0.0)))
    if schedule != "auto":
        perm, rank_time, _ = results[schedule]
        return perm, rank_time, schedule
    fits = [n for n in names if results[n][2] <= stage_limit]
    if fits:
        best = min(fits, key=lambda n: (float(results[n][1].max(initial=0.0)), names.index(n)))
    else:  # nothing fits (oversize micro-batches of a baseline): the least memory
        best = min(names, key=lambda n: (results[n][2], names.index(n)))
    perm, rank_time, _ = results[best]
    return perm, rank_time, best
