"""Flush-free (asynchronous, cross-step) 1F1B: simulation, per-step steady-state times and the
planner objective that goes with it. Times are seconds.

**The schedule.** Today every step ends with a flush: each rank's pipeline drains, the gradients
are all-reduced and every stage takes its optimizer step before step ``k+1``'s first forward
(`BatchPlan.iteration_time_s` is that flushed makespan). Flush-free, every stage of a rank runs
Megatron's 1F1B order over the rank's *whole stream* of micro-batches, steps back to back
(`dynabatch.core.schedule.build.stream_ops`, the order the runner executes): the warm-up forwards of
stage ``s`` happen once, at the start of training, and afterwards
the stage alternates one forward and one backward across step boundaries, so stage ``s`` starts
step ``k+1``'s forwards while later stages still finish step ``k``. Each stage applies step
``k``'s update right after its own backward of step ``k``'s last micro-batch (op ``U_k``): on every
data-parallel rank at once, when the last rank's same stage got there (the stage's gradient
all-reduce is a barrier over the ranks; it and the optimizer step take ``update_s`` seconds,
0 by default as in the flushed model). Dependencies and transfers are those of
`dynabatch.core.simulate.pipeline` (asynchronous sends, ``p2p_s[j]`` on every edge between stages).

Micro-batch ``i`` of a rank's stream then sees, on stage ``s``, `update_lag` updates between its
forward and its backward (0 or 1 when a step has at least ``S - 1`` micro-batches per rank; more
when it has fewer): the ``s_k`` of optimizer-dependent weight prediction
(`dynabatch.pipeline.runtime.weight_prediction`), and the number of weight versions a stash holds.
In-flight activations are those of 1F1B (at most ``S - s`` micro-batches on stage ``s``).

**Steady-state step time.** Step ``k`` is complete when every stage has applied its update
(``completion_s[k] = max_s update_end_s[s, k]``; stage 0, last in the backward chain, sets it
unless updates take time). Its flush-free time is ``completion_s[k] - completion_s[k-1]``: the
step's share of a long run. `flushfree_report` measures it on consecutive plans with
``warm_steps`` copies of the first plan before them and of the last plan after them, so the first
step does not pay the pipeline's one-time fill and the last one, like every other, runs the next
step's first forwards (stage 0's window of step ``k`` holds ``S - 1`` forwards of step ``k+1``)
instead of the final drain.

**What bounds it.** Over a long run a step takes at least, on every rank ``r`` and stage ``s``
(`stage_loads`): the stage's busy time ``load[r, s] = sum_j st[s, j]`` and the 1F1B round trip
``cycle[r, s] = sum_j (sum_{s' >= s} st[s', j] + 2 (S-1-s) p2p_j) / (S - s)`` (stage ``s`` starts
micro-batch ``j + S - s`` only after ``j``'s backward came back). `flushfree_bound` is their
maximum, the planner objective of the flush-free schedule: the flushed objective's fill/drain term
``(S-1) * max_j t_j`` does not apply in steady state. Without transfer time and with equal stages it
is the busiest rank's total micro-batch time, exactly the steady state of uniform micro-batches;
with variable times the simulated steady state lies above it by the stalls 1F1B's fixed order
leaves. `flushfree_objective` is its rank-balanced form (``sum_j t_j / R`` plus the stage-0 round
trip's transfer share), the counterpart of `BatchPlan.objective_s`.

The event loop is the numba kernel `dynabatch.core.kernels.flushfree.flushfree_kernel` (beside its
plain-Python reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels import op_codes as oc
from ..kernels.arrays import kernel_array
from ..kernels.flushfree import DEADLOCK, flushfree_kernel, stage_loads
from ..schedule.build import stream_ops
from ..schedule.orders import DEFAULT_FORWARD_FRACTION, plan_p2p_s, plan_stage_times, split_times

__all__ = [
    "FlushFreeReport",
    "FlushFreeSim",
    "flushfree_bound",
    "flushfree_objective",
    "flushfree_report",
    "rank_streams",
    "simulate_flushfree",
    "update_lag",
]


@dataclass(frozen=True)
class FlushFreeSim:
    """Outcome of `simulate_flushfree` (seconds).

    ``start_s``/``end_s`` ``[S, N, 2]`` (``[..., 0]`` forward, ``[..., 1]`` backward) over the flat
    rank-major stream; ``update_end_s`` ``[S, K]``: when stage ``s`` finished applying step ``k``'s
    update (every rank); ``completion_s`` ``[K]``: ``max_s update_end_s[s, k]``; ``step_time_s``
    ``[K]``: ``completion_s[k] - completion_s[k-1]`` (the first from time 0, fill included);
    ``busy_s`` ``[R, S]``: compute seconds of each rank's stage.
    """

    start_s: np.ndarray
    end_s: np.ndarray
    update_end_s: np.ndarray
    completion_s: np.ndarray
    step_time_s: np.ndarray
    busy_s: np.ndarray

    @property
    def makespan_s(self) -> float:
        """When the last step is complete on every stage (seconds)."""
        return float(self.completion_s[-1]) if len(self.completion_s) else 0.0


def update_lag(ends, num_stages: int) -> np.ndarray:
    """Optimizer updates between the forward and the backward of each micro-batch of one rank's
    stream on each stage: int64 ``[S, n]``.

    ``ends`` (int ``[K]``): the exclusive end of each step in the stream (cumulative micro-batch
    counts; ``n = ends[-1]``). Counted on the stream's op order (`dynabatch.core.schedule.build.stream_ops`:
    1F1B over the stream, ``U_k`` after the backward of micro-batch ``ends[k] - 1``): the updates listed
    between a micro-batch's forward and its backward on the stage. This is the ``s`` to pass to
    `WeightPredictor.predicted` for that forward.
    """
    ops = stream_ops(int(num_stages), ends)
    out = np.zeros((ops.num_stages, ops.num_microbatches), np.int64)
    for s in range(ops.num_stages):
        row = ops.table[s, :ops.length(s)]
        seen = np.cumsum(row[:, oc.KIND] == oc.UPDATE)  # updates up to each position
        fwd, bwd = row[:, oc.KIND] == oc.FORWARD, row[:, oc.KIND] == oc.BACKWARD
        out[s, row[bwd, oc.MICROBATCH]] += seen[bwd]
        out[s, row[fwd, oc.MICROBATCH]] -= seen[fwd]
    return out


def _check_times(name, arr):
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must be finite and >= 0")


def simulate_flushfree(fwd_s, bwd_s, counts, *, p2p_s=0.0, update_s=0.0) -> FlushFreeSim:
    """Simulate ``K`` consecutive steps of ``R`` ranks flush-free (the schedule in the module doc).

    ``counts`` int ``[R, K]``: micro-batches of rank ``r`` in step ``k``. ``fwd_s``/``bwd_s``
    ``[S, N]`` seconds (``N = counts.sum()``), micro-batches rank-major: rank 0's stream (its step 0
    in execution order, then its step 1, ...), then rank 1's, and so on (`rank_streams` builds it
    from plans). ``p2p_s``: scalar or ``[N]`` seconds per stage-to-stage transfer; ``update_s``:
    scalar or ``[S]`` seconds of a stage's gradient all-reduce + optimizer step.
    """
    fwd, bwd = (kernel_array(np.atleast_2d(np.asarray(x, np.float64)), np.float64) for x in (fwd_s, bwd_s))
    counts = np.asarray(counts, np.int64)
    if counts.ndim != 2 or np.any(counts < 0):
        raise ValueError(f"counts must be a non-negative int array [R, K], got shape {counts.shape}")
    R, K = counts.shape
    S, N = fwd.shape
    if bwd.shape != fwd.shape or N != int(counts.sum()):
        raise ValueError(f"fwd_s/bwd_s must both be [S, counts.sum()] = [S, {int(counts.sum())}], got "
                         f"{fwd.shape} and {bwd.shape}")
    # kernel_array: a broadcast of an [N] / [S] array is a read-only view, which numba would compile apart
    p2p = kernel_array(np.broadcast_to(np.asarray(p2p_s, np.float64), (N,)), np.float64)
    upd = kernel_array(np.broadcast_to(np.asarray(update_s, np.float64), (S,)), np.float64)
    for name, arr in (("fwd_s", fwd), ("bwd_s", bwd), ("p2p_s", p2p), ("update_s", upd)):
        _check_times(name, arr)
    roff = np.concatenate(([0], np.cumsum(counts.sum(axis=1)))).astype(np.int64)
    ends = np.ascontiguousarray(np.cumsum(counts, axis=1), np.int64)
    start = np.empty((S, N, 2))
    end = np.empty((S, N, 2))
    upd_end = np.empty((S, K))
    if flushfree_kernel(fwd, bwd, p2p, roff, ends, upd, start, end, upd_end) == DEADLOCK:
        raise RuntimeError("flush-free simulation deadlocked (a bug: the 1F1B order cannot deadlock)")
    completion = upd_end.max(axis=0) if S else np.zeros(K)
    step = np.diff(np.concatenate(([0.0], completion)))
    busy = np.zeros((R, S))
    for r in range(R):
        busy[r] = fwd[:, roff[r]:roff[r + 1]].sum(axis=1) + bwd[:, roff[r]:roff[r + 1]].sum(axis=1)
    return FlushFreeSim(start_s=start, end_s=end, update_end_s=upd_end, completion_s=completion, step_time_s=step,
                        busy_s=busy)


# --------------------------------------------------------------------------- plans


def _plan_p2p(plan, cost, p2p_s):
    """Seconds ``[M]`` of a plan's micro-batch transfers: ``p2p_s`` (scalar or ``[M]``) or the cost model's
    (`dynabatch.core.schedule.orders.plan_p2p_s`)."""
    if p2p_s is not None:
        return np.broadcast_to(np.asarray(p2p_s, np.float64), (plan.num_microbatches,)).copy()
    if cost is None:
        raise ValueError("give the cost model (its p2p_time prices the transfers) or p2p_s=")
    return plan_p2p_s(plan, cost)


def rank_streams(plans, p2p, forward_fraction: float):
    """The rank-major stream of consecutive ``plans`` (one pipeline width ``S``; ranks past a plan's
    ``num_ranks`` get no micro-batch in that step) as `simulate_flushfree` takes it:
    ``(fwd [S, N], bwd [S, N], p2p [N], counts [R, K])``. ``p2p``: one ``[M]`` array per plan."""
    if not plans:
        raise ValueError("need at least one plan")
    S = plans[0].num_stages
    if any(p.num_stages != S for p in plans):
        raise ValueError(f"every plan must have the same num_stages, got {sorted({p.num_stages for p in plans})}")
    R = max(p.num_ranks for p in plans)
    counts = np.zeros((R, len(plans)), np.int64)
    cols, links = [], []
    stage_t = [plan_stage_times(p) for p in plans]
    for r in range(R):
        for k, p in enumerate(plans):
            idx = p.rank_indices(r)
            counts[r, k] = len(idx)
            cols.append(stage_t[k][:, idx])
            links.append(np.asarray(p2p[k], np.float64)[idx])
    st = np.concatenate(cols, axis=1) if cols else np.zeros((S, 0))
    fwd, bwd = split_times(st, forward_fraction)
    return fwd, bwd, np.concatenate(links), counts


@dataclass(frozen=True)
class FlushFreeReport:
    """Per step of `flushfree_report` (``[K]`` arrays, seconds unless named otherwise).

    ``flushed_s``: the plan's ``iteration_time_s`` (today: fill, steady part and drain, its own
    schedule); ``flushfree_s``: the steady-state step time of the flush-free 1F1B schedule;
    ``removed_share``: ``1 - flushfree_s / flushed_s``, the share of the flushed step the flush
    costs; ``load_bound_s``: the busiest stage's busy time ``max_{r,s} load``; ``bound_s``:
    `flushfree_bound` (busy time and 1F1B round trip, >= ``load_bound_s``); ``max_lag``: the most
    optimizer updates between a forward and its backward among the step's micro-batches (weight
    versions a stash keeps beside the current one).
    """

    num_stages: int
    num_ranks: int
    flushed_s: np.ndarray
    flushfree_s: np.ndarray
    removed_share: np.ndarray
    load_bound_s: np.ndarray
    bound_s: np.ndarray
    max_lag: np.ndarray
    warm_steps: int

    @property
    def total_flushed_s(self) -> float:
        """Seconds of all the steps, flushed."""
        return float(self.flushed_s.sum())

    @property
    def total_flushfree_s(self) -> float:
        """Seconds of all the steps, flush-free (steady state)."""
        return float(self.flushfree_s.sum())

    @property
    def total_removed_share(self) -> float:
        """Share of the flushed run's time the flush-free schedule removes."""
        return 1.0 - self.total_flushfree_s / self.total_flushed_s if self.total_flushed_s > 0 else 0.0

    def to_dict(self) -> dict:
        """JSON form: the per-step lists and the totals."""
        return {"num_stages": self.num_stages, "num_ranks": self.num_ranks, "warm_steps": self.warm_steps,
                "flushed_s": self.flushed_s.tolist(), "flushfree_s": self.flushfree_s.tolist(),
                "removed_share": self.removed_share.tolist(), "load_bound_s": self.load_bound_s.tolist(),
                "bound_s": self.bound_s.tolist(), "max_lag": self.max_lag.tolist(),
                "total_flushed_s": self.total_flushed_s, "total_flushfree_s": self.total_flushfree_s,
                "total_removed_share": self.total_removed_share}


def flushfree_report(plans, cost=None, *, p2p_s=None, forward_fraction: float | None = None,
                     warm_steps: int = 1, update_s=0.0) -> FlushFreeReport:
    """Flushed vs flush-free time of each of the consecutive ``plans`` (`BatchPlan`, one ``num_stages``).

    Stage times: each plan's ``stage_time_s`` or ``mb_time_s``; forward share ``cost.forward_fraction``
    (else ``forward_fraction``, default 1/3); transfers: the cost model's, as the planner priced them
    (`dynabatch.core.schedule.orders.plan_p2p_s`), unless ``p2p_s`` gives them (a scalar, or one scalar / ``[M]``
    array per plan). ``warm_steps`` copies of
    the first plan run before the steps and of the last after them (module doc); ``update_s``: seconds
    of a stage's all-reduce + optimizer step (scalar or ``[S]``).
    """
    plans = list(plans)
    if not plans:
        raise ValueError("need at least one plan")
    warm = int(warm_steps)
    if warm < 0:
        raise ValueError(f"warm_steps must be >= 0, got {warm_steps}")
    if forward_fraction is None:
        forward_fraction = cost.forward_fraction if cost is not None else DEFAULT_FORWARD_FRACTION
    if p2p_s is None or np.ndim(p2p_s) == 0:
        p2p = [_plan_p2p(p, cost, p2p_s) for p in plans]
    else:
        if len(p2p_s) != len(plans):
            raise ValueError(f"p2p_s needs one entry per plan ({len(plans)}), got {len(p2p_s)}")
        p2p = [_plan_p2p(p, cost, x) for p, x in zip(plans, p2p_s)]
    run = [plans[0]] * warm + plans + [plans[-1]] * warm
    links = [p2p[0]] * warm + p2p + [p2p[-1]] * warm
    fwd, bwd, flat_p2p, counts = rank_streams(run, links, forward_fraction)
    sim = simulate_flushfree(fwd, bwd, counts, p2p_s=flat_p2p, update_s=update_s)
    K = len(plans)
    flushfree = sim.step_time_s[warm:warm + K].copy()
    flushed = np.array([p.iteration_time_s for p in plans])
    S, R = plans[0].num_stages, counts.shape[0]
    load_b, bound = np.zeros(K), np.zeros(K)
    for k, p in enumerate(plans):
        load, cyc = _loads(p, p2p[k], R)
        load_b[k] = load.max(initial=0.0)
        bound[k] = max(load_b[k], cyc.max(initial=0.0))
    lag = np.zeros(K, np.int64)
    ends_all = np.cumsum(counts, axis=1)
    for r in range(R):
        lags = update_lag(ends_all[r], S)
        start = np.concatenate(([0], ends_all[r]))
        for k in range(K):
            a, b = start[warm + k], start[warm + k + 1]
            if b > a:
                lag[k] = max(lag[k], int(lags[:, a:b].max()))
    with np.errstate(divide="ignore", invalid="ignore"):
        removed = np.where(flushed > 0, 1.0 - flushfree / flushed, 0.0)
    return FlushFreeReport(num_stages=S, num_ranks=R, flushed_s=flushed, flushfree_s=flushfree,
                           removed_share=removed, load_bound_s=load_b, bound_s=bound, max_lag=lag, warm_steps=warm)


# --------------------------------------------------------------------------- planner objective


def _loads(plan, p2p, R=None):
    R = plan.num_ranks if R is None else R
    st = kernel_array(plan_stage_times(plan), np.float64)
    load = np.empty((R, plan.num_stages))
    cyc = np.empty((R, plan.num_stages))
    stage_loads(st, kernel_array(p2p, np.float64), kernel_array(plan.mb_rank, np.int64), np.int64(R), load, cyc)
    return load, cyc


def flushfree_bound(plan, cost=None, *, p2p_s=None) -> float:
    """Lower bound (seconds) on a plan's flush-free steady-state step time, its planner objective:
    ``max_{r,s} max(load[r, s], cycle[r, s])`` (module doc; transfers as in `flushfree_report`)."""
    load, cyc = _loads(plan, _plan_p2p(plan, cost, p2p_s))
    return float(max(load.max(initial=0.0), cyc.max(initial=0.0)))


def flushfree_objective(time_s, num_ranks: int, num_stages: int, p2p_s=0.0) -> float:
    """The rank-balanced flush-free objective of micro-batches of times ``time_s`` (``[M]`` seconds,
    equal on every stage) over ``num_ranks`` ranks: ``(sum_j t_j + 2 (S-1)/S * sum_j p2p_j) / R``, what
    `flushfree_bound` is for perfectly balanced ranks. It replaces `BatchPlan.objective_s`'s
    ``sum_j t_j / R + (S-1) * max_j t_j`` as a *bound*: in steady state there is no fill/drain to pay per
    step. It is not a good cut objective: a rank of few large micro-batches stalls in its 1F1B round
    trips, which the bound cannot see (cutting FLAN-like gpt steps on ``sum/R`` alone gave 4x larger
    micro-batches and a 31% slower simulated steady state than the flushed objective's cuts), so the
    planner keeps the flushed objective's cuts with ``flush=False`` and records the simulated steady
    state (`dynabatch.core.plan.planner._plan`)."""
    t = np.asarray(time_s, np.float64)
    p = np.broadcast_to(np.asarray(p2p_s, np.float64), t.shape)
    S = int(num_stages)
    return float((t.sum() + 2.0 * (S - 1) / S * p.sum()) / int(num_ranks))
