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

from ..kernels.arrays import kernel_array
from ..kernels.schedules import OK, OVERSIZE, adaptive_kernel, order_ranks_schedule, order_ranks_stages
from ..kernels.simulate import schedule_kernel
from ..options import SCHEDULE_CODES

#: The concrete orders ``auto`` chooses from, in the order it prefers them on equal makespans.
AUTO_PREFERENCE: tuple[str, ...] = ("1f1b", "adaptive", "gpipe")


def adaptive_order(fwd_s, bwd_s, mem_bytes=None, memory_limit: float | None = None, *, p2p_s=0.0,
                   num_stages: int | None = None, oversize: str = "error") -> np.ndarray:
    """The adaptive op order, int32 ``[S, 2M]`` (encoding of `dynabatch.core.simulate.pipeline`).

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


def order_step(schedule: str, st, p2p, mem, rank_of, ranks: int, fwd_fraction: float, stage_limit: float,
               optimize: bool, per_stage: bool = True):
    """Order each rank's micro-batches for ``schedule`` (``gpipe``, ``1f1b``, ``adaptive`` or ``auto``).

    ``st`` ``[S, M]`` seconds per stage, ``p2p`` seconds and ``mem`` bytes (on the largest stage) per
    micro-batch, ``rank_of`` int32 ranks, ``stage_limit`` in-flight activation bytes per stage. Each
    rank's candidate orders are simulated and the fastest kept (with ``optimize``; else the given
    order): `stage_candidates` on per-stage times (``per_stage``), else the four orders of stage 0's
    times (a stage-blind plan, every stage alike). Returns ``(perm, rank_time_s, schedule)``:
    micro-batch indices rank by rank in execution order, each rank's simulated makespan (``inf``
    where it cannot be simulated), and the concrete schedule (``auto`` resolved; see the module
    docstring).
    """
    st, p2p, mem = (kernel_array(x, np.float64) for x in (st, p2p, mem))
    rank_of = kernel_array(rank_of, np.int32)
    names = AUTO_PREFERENCE if schedule == "auto" else (schedule,)
    results = {}
    for name in names:
        args = (p2p, mem, rank_of, int(ranks), float(fwd_fraction))
        code, limit = SCHEDULE_CODES[name], float(stage_limit)
        if per_stage:
            perm, rank_time, peak = order_ranks_stages(st, *args, code, limit, bool(optimize))
        else:
            perm, rank_time, peak = order_ranks_schedule(st[0], *args, st.shape[0], code, limit, bool(optimize))
        results[name] = (perm, np.where(np.isnan(rank_time), np.inf, rank_time), float(peak.max(initial=0.0)))
    if schedule != "auto":
        return results[schedule][0], results[schedule][1], schedule
    best = pick_auto({n: float(r[1].max(initial=0.0)) for n, r in results.items()},
                     {n: r[2] for n, r in results.items()}, stage_limit)
    return results[best][0], results[best][1], best


def pick_auto(span_s: dict, peak_bytes: dict, limit: float) -> str:
    """The schedule ``auto`` runs, from the simulated makespan ``span_s`` (seconds) and peak in-flight
    bytes per stage ``peak_bytes`` of each of `AUTO_PREFERENCE`: the lowest makespan whose peak fits
    ``limit`` (ties: preference order); when none fits (oversize micro-batches of a baseline), the
    least memory."""
    names = AUTO_PREFERENCE
    fits = [n for n in names if peak_bytes[n] <= limit]
    if fits:
        return min(fits, key=lambda n: (span_s[n], names.index(n)))
    return min(names, key=lambda n: (peak_bytes[n], names.index(n)))
