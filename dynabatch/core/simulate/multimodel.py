"""K models trained on one data pass over the same pipeline stages: the shard order and its simulator.

Every model sees the same ``M`` micro-batches of a step; model ``k``'s stage ``s`` is a *shard*
that runs on stage device ``s``. The shard schedule (what `dynabatch.pipeline.MultiModelRunner`
executes and what `simulate_multimodel` predicts) is:

* **LRTF model order** (`lrtf_order`): models sorted by their predicted remaining time of the step
  (sum over micro-batches of the plan's seconds x the model's time scale), longest first, ties by
  model index. Computed from the plan alone, so it is identical on every rank.
* **One pipeline over virtual micro-batches** (`multimodel_orders`, the plain op codes of
  `dynabatch.core.schedule.build.multimodel_ops`): position ``p`` of that order,
  micro-batch ``j`` is virtual micro-batch ``v = p * M + j``. ``interleave=True`` runs Megatron
  1F1B over the ``K * M`` virtual micro-batches, so stage 0 starts the next model's forwards while
  the later stages still drain the previous model's backwards: the pipeline fills and drains once
  per step, not once per model. ``interleave=False`` runs each model's own 1F1B to completion on
  each stage before the next model's (one shard active per stage at a time: what a memory budget of
  one shard needs). In both, each model's forwards and backwards run in ascending micro-batch order
  on every stage, exactly as `gpipe`/`1f1b` order them for that model alone (which is why the
  multi-model runner's gradients are bit-identical to single-model runs).
* `active_peak`: on one stage, the most shard bytes that must be resident at once under an order
  (a shard is active from its first op to its last op, or to its optimizer update).
* **Spilling** (`simulate_multimodel(..., budget_bytes=...)`): with a byte budget per stage device
  the shards move between host and device as in the runner (`dynabatch.core.simulate.spill`: the
  same residency windows, eviction order and one-shard-ahead prefetch), and their copies are timed
  on one copy engine per stage (``shard_bytes / load_bytes_per_s`` per load, ``/ spill_bytes_per_s``
  per spill, overlapping compute): an op waits for its shard's load, so the makespan includes the
  stalls (`MultiModelSim.stall_s`, ``load_s``, ``loads``, ``spills``, ``prefetches``). Without a
  budget every shard is resident and nothing moves.

Op encoding is the simulator's (`dynabatch.core.simulate.pipeline`): ``v + 1`` forward of virtual
micro-batch ``v``, ``-(v + 1)`` its backward. Times are seconds, memory bytes. The hot loop of `active_peak` is
a numba kernel in `dynabatch.core.kernels.residency` (`active_peak_kernel`, beside its plain-Python reference;
both re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels.residency import active_peak_kernel, active_peak_reference
from ..schedule.build import multimodel_ops
from .spill import spill_timing
from .pipeline import simulate_pipeline

__all__ = ["MultiModelSim", "active_peak", "active_peak_kernel", "active_peak_reference", "lrtf_order",
           "multimodel_orders", "simulate_multimodel", "virtual_times"]


def lrtf_order(remaining_s) -> np.ndarray:
    """Model indices (int64) by descending predicted remaining seconds ``remaining_s`` [K], ties by
    index (longest-remaining-time-first; a stable sort, so every rank derives the same order)."""
    t = np.asarray(remaining_s, np.float64)
    if t.ndim != 1 or t.size == 0 or not np.all(np.isfinite(t)):
        raise ValueError(f"remaining_s must be K >= 1 finite seconds, got {t!r}")
    return np.argsort(-t, kind="stable").astype(np.int64)


# --------------------------------------------------------------------------- orders


def multimodel_orders(num_stages: int, num_models: int, num_microbatches: int, *, interleave: bool = True) -> np.ndarray:
    """Op orders int32 ``[S, 2KM]`` (plain op codes over the virtual micro-batches) of K models on one data
    pass: `dynabatch.core.schedule.build.multimodel_ops` (see the module doc)."""
    return multimodel_ops(num_stages, num_models, num_microbatches, interleave=interleave).codes()


# --------------------------------------------------------------------------- residency


def active_peak(row, num_microbatches: int, shard_bytes, *, updates_at_end: bool = False) -> tuple[float, int]:
    """Peak resident shard bytes on one stage (see `active_peak_kernel`); ``shard_bytes`` [K] by LRTF
    position, bytes."""
    return active_peak_kernel(np.ascontiguousarray(row, np.int32), int(num_microbatches),
                              np.ascontiguousarray(shard_bytes, np.float64), bool(updates_at_end))


# --------------------------------------------------------------------------- simulator


def virtual_times(per_model, order) -> np.ndarray:
    """Concatenate ``per_model[order[p]]`` (each ``[S, M]`` or ``[M]``) along the micro-batch axis:
    the times of the virtual micro-batches ``p * M + j``."""
    return np.concatenate([np.asarray(per_model[int(k)], np.float64) for k in order], axis=-1)


@dataclass(frozen=True)
class MultiModelSim:
    """Outcome of `simulate_multimodel` (seconds; per stage ``[S]`` arrays).

    ``makespan_s``: one step of the K models together under the shard schedule, with the stalls of
    shard loads when a budget was given; ``sequential_s``: the sum of the K models' single-model
    makespans (each its own pipeline with fill and drain, one after the other; a model trained alone
    needs no spilling); ``model_makespan_s`` [K] those single makespans; ``lower_bound_s``: the
    busiest stage's total work plus the shortest way in and out (no order beats it); ``order``: the
    LRTF model order; ``ops``: the simulated int32 ``[S, 2KM]`` op lists. Shard moves of the step
    (all zero without a budget): ``load_s`` seconds each stage's copy engine spent copying (loads
    and spills), ``stall_s`` compute seconds each stage lost waiting for loads, ``loads`` /
    ``spills`` / ``prefetches`` counts (prefetches: the loads issued ahead of the shard's turn)."""

    makespan_s: float
    sequential_s: float
    model_makespan_s: np.ndarray
    lower_bound_s: float
    order: np.ndarray
    ops: np.ndarray
    load_s: np.ndarray
    stall_s: np.ndarray
    loads: np.ndarray
    spills: np.ndarray
    prefetches: np.ndarray

    @property
    def speedup(self) -> float:
        """``sequential_s / makespan_s``."""
        return self.sequential_s / self.makespan_s if self.makespan_s > 0 else 1.0


def simulate_multimodel(fwd_s, bwd_s, *, p2p_s=0.0, interleave: bool = True, order=None, num_stages: int | None = None,
                        single_schedule: str = "1f1b", shard_bytes=None, budget_bytes=None, load_bytes_per_s=None,
                        spill_bytes_per_s=None, updates_at_end: bool = False) -> MultiModelSim:
    """Simulate one step of K models trained on the same micro-batches over the same stages.

    ``fwd_s``/``bwd_s``: ``[K, S, M]`` per-shard seconds (model, stage, micro-batch), or ``[K, M]``
    (the same on every stage; pass ``num_stages``). ``p2p_s``: scalar or ``[M]`` seconds per hop.
    ``order``: the model order (default `lrtf_order` of each model's total forward+backward
    seconds). The K-model step is `dynabatch.core.simulate.pipeline.simulate_pipeline` on the virtual
    micro-batches with `multimodel_orders`; the baseline is each model alone with
    ``single_schedule``, summed.

    Spilling (`dynabatch.core.simulate.spill`, the runner's policy, timed in steady state):
    ``budget_bytes`` (bytes, scalar or ``[S]``) bounds the shard bytes resident on each stage device
    (None: every shard resident, nothing moves, the results of a run without it); ``shard_bytes``
    ``[K, S]`` (or ``[K]``, the same on every stage) each shard's parameter + gradient +
    optimizer-state bytes; ``load_bytes_per_s`` the host -> device and ``spill_bytes_per_s`` the
    device -> host bandwidth in bytes per second (default: the load's; ``inf``: free copies).
    ``updates_at_end``: updates after the step (the runner without ``num_tokens``), not right after
    each model's last backward. The stalls are in ``makespan_s`` (not in ``sequential_s``: a model
    trained alone needs no spilling) and reported with the copies in `MultiModelSim`'s ``load_s``,
    ``stall_s``, ``loads``, ``spills`` and ``prefetches``. Raises ValueError for malformed input, a
    shard larger than its stage's budget, or a budget below what the order needs at once
    (`active_peak`)."""
    f = np.asarray(fwd_s, np.float64)
    b = np.asarray(bwd_s, np.float64)
    if f.shape != b.shape or f.ndim not in (2, 3):
        raise ValueError(f"fwd_s and bwd_s must both be [K, S, M] or [K, M], got {f.shape} and {b.shape}")
    if f.ndim == 2:
        if num_stages is None:
            raise ValueError("[K, M] times need num_stages")
        f = np.repeat(f[:, None, :], int(num_stages), axis=1)
        b = np.repeat(b[:, None, :], int(num_stages), axis=1)
    K, S, M = f.shape
    p2p = np.broadcast_to(np.asarray(p2p_s, np.float64), (M,))
    order = lrtf_order((f + b).sum(axis=(1, 2))) if order is None else np.asarray(order, np.int64)
    if sorted(order.tolist()) != list(range(K)):
        raise ValueError(f"order must be a permutation of 0..{K - 1}, got {order.tolist()}")
    spill = _spill_inputs(shard_bytes, budget_bytes, load_bytes_per_s, spill_bytes_per_s, K, S)
    ops = multimodel_orders(S, K, M, interleave=interleave)
    vf, vb = virtual_times(f, order), virtual_times(b, order)
    vp = np.tile(p2p, K)
    sim = simulate_pipeline(vf, vb, schedule=ops, p2p_s=vp)
    alone = np.array([simulate_pipeline(f[k], b[k], schedule=single_schedule, p2p_s=p2p).makespan_s for k in range(K)])
    span, moves = float(sim.makespan_s), (np.zeros(S), np.zeros(S), *np.zeros((3, S), np.int64))
    if spill is not None:
        sizes, budget, load_bw, spill_bw = spill
        for s in range(S):
            need, n = active_peak(ops[s], M, sizes[order, s], updates_at_end=updates_at_end)
            if need > budget[s]:
                raise ValueError(f"stage {s} must hold {n} shards at once under the "
                                 f"{'interleaved' if interleave else 'model-after-model'} order ({need:.0f} bytes) "
                                 f"but its budget is {budget[s]:.0f} bytes; raise budget_bytes"
                                 + (" or use interleave=False" if interleave else ""))
        t = spill_timing(vf, vb, vp, ops, order, M, sizes, budget, load_bw, spill_bw, updates_at_end)
        span, moves = t.makespan_s, (t.load_s, t.stall_s, t.loads, t.spills, t.prefetches)
    return MultiModelSim(span, float(alone.sum()), alone, float(sim.lower_bound_s), order, ops, *moves)


def _spill_inputs(shard_bytes, budget_bytes, load_bytes_per_s, spill_bytes_per_s, K, S):
    """Validated ``(sizes [K, S], budget [S], load, spill bandwidth)`` of `simulate_multimodel`, or
    None without a budget (shapes and values are checked whenever given)."""
    sizes = None
    if shard_bytes is not None:
        sizes = np.asarray(shard_bytes, np.float64)
        if sizes.shape == (K,):
            sizes = np.repeat(sizes[:, None], S, axis=1)
        if sizes.shape != (K, S) or not np.all(np.isfinite(sizes)) or np.any(sizes < 0):
            raise ValueError(f"shard_bytes must be [K, S] = [{K}, {S}] or [K] finite bytes >= 0, got "
                             f"{np.shape(shard_bytes)} {np.asarray(shard_bytes).ravel()[:8].tolist()}")
    rates = []
    for name, bw in (("load_bytes_per_s", load_bytes_per_s), ("spill_bytes_per_s", spill_bytes_per_s)):
        if bw is not None and not (np.ndim(bw) == 0 and float(bw) > 0):  # NaN fails too
            raise ValueError(f"{name} must be one positive number of bytes per second (inf: free copies), got {bw!r}")
        rates.append(None if bw is None else float(bw))
    if budget_bytes is None:
        return None
    budget = np.asarray(budget_bytes, np.float64)
    if budget.ndim == 0:
        budget = np.full(S, float(budget))
    if budget.shape != (S,) or not np.all(budget > 0):
        raise ValueError(f"budget_bytes must be a positive number of bytes or [S] = [{S}] of them, "
                         f"got {budget_bytes!r}")
    if sizes is None or rates[0] is None:
        raise ValueError("budget_bytes needs shard_bytes ([K, S] bytes) and load_bytes_per_s (host -> device bytes/s)")
    over = np.argwhere(sizes > budget[None, :])
    if over.size:
        k, s = (int(x) for x in over[0])
        raise ValueError(f"model {k}'s stage {s} shard needs {sizes[k, s]:.0f} bytes but stage {s}'s budget is "
                         f"{budget[s]:.0f} bytes: no order can run it; raise budget_bytes to at least "
                         f"{sizes[k, s]:.0f}")
    return sizes, budget, rates[0], rates[0] if rates[1] is None else rates[1]
