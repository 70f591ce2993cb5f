"""The planner's ordering search and ``auto``'s pick, on the orders of `dynabatch.core.schedule.build`.

`order_step` orders each rank's micro-batches for a schedule by simulating candidate orders
(`dynabatch.core.kernels.schedules`: every candidate's op table from `rank_ops_kernel`, priced by the
table simulator); for ``auto`` it does so for each of `AUTO_PREFERENCE` and `pick_auto` keeps the lowest
makespan whose peak in-flight activation bytes per stage fit the limit (GPipe holds all M micro-batches
on every stage, 1F1B at most ``S - s`` on stage ``s``, ZB-H2 about twice that, adaptive stays within the
limit by construction). The orders of several chunks per stage (interleaved) need their own model cut, which a
runner keeps for the whole run: `run_choice` weighs them against the per-step picks per run, and
`compare_orders` (what ``dynabatch inspect`` prints) lists them marked ``per_run``. Times are seconds, memory
bytes.
"""

from __future__ import annotations

import numpy as np

from ..kernels.arrays import kernel_array
from ..kernels.schedules import order_ranks_schedule, order_ranks_stages
from ..kernels.simulate import schedule_kernel
from .build import rank_span_and_peaks
from .orders import DEFAULT_FORWARD_FRACTION, plan_p2p_s, plan_stage_times, stage_limit
from .registry import AUTO_PREFERENCE, REGISTRY, schedule_info


def ops_by_count(stages: int, counts: np.ndarray, schedule: str) -> np.ndarray:
    """int32 ``[kmax + 1, S, 2 kmax]``: the plain op codes of the order ``schedule``'s rank balancing judges
    swaps on (its registered ``balance`` order) for every micro-batch count ``k`` in ``counts`` at index
    ``k`` (zero-padded), as `dynabatch.core.kernels.assign.balance_simulated` takes them."""
    code = schedule_info(schedule_info(schedule).balance).code
    kmax = int(counts.max()) if len(counts) else 0
    ops = np.zeros((kmax + 1, stages, 2 * max(kmax, 1)), np.int32)
    for k in np.unique(counts):
        if k > 0:
            ops[k, :, : 2 * k] = schedule_kernel(stages, int(k), code)
    return ops


def order_step(schedule: str, st, p2p, mem, rank_of, ranks: int, fwd_fraction: float, stage_limit: float,
               optimize: bool, per_stage: bool = True):
    """Order each rank's micro-batches for ``schedule`` (a registered name; ``auto`` tries `AUTO_PREFERENCE`).

    ``st`` ``[S, M]`` seconds per stage, ``p2p`` seconds and ``mem`` bytes (on the largest stage) per
    micro-batch, ``rank_of`` int32 ranks, ``stage_limit`` in-flight activation bytes per stage. Each
    rank's candidate orders are simulated and the fastest kept (with ``optimize``; else the given
    order): `stage_candidates` on per-stage times (``per_stage``), else the four orders of stage 0's
    times (a stage-blind plan, every stage alike). Returns ``(perm, rank_time_s, schedule)``:
    micro-batch indices rank by rank in execution order, each rank's simulated makespan (``inf``
    where it cannot be simulated), and the concrete schedule (``auto`` resolved).
    """
    st, p2p, mem = (kernel_array(x, np.float64) for x in (st, p2p, mem))
    rank_of = kernel_array(rank_of, np.int32)
    names = AUTO_PREFERENCE if schedule_info(schedule).name == "auto" else (schedule,)
    results = {}
    for name in names:
        args = (p2p, mem, rank_of, int(ranks), float(fwd_fraction))
        code, limit = np.int64(schedule_info(name).code), float(stage_limit)
        if per_stage:
            perm, rank_time, peak = order_ranks_stages(st, *args, code, limit, bool(optimize))
        else:
            perm, rank_time, peak = order_ranks_schedule(st[0], *args, st.shape[0], code, limit, bool(optimize))
        results[name] = (perm, np.where(np.isnan(rank_time), np.inf, rank_time), float(peak.max(initial=0.0)))
    if len(names) == 1:
        return results[schedule][0], results[schedule][1], schedule
    best = pick_auto({n: float(r[1].max(initial=0.0)) for n, r in results.items()},
                     {n: r[2] for n, r in results.items()}, stage_limit)
    return results[best][0], results[best][1], best


def compare_orders(plan, cost=None) -> dict:
    """The orders ``auto`` weighs, side by side for ``plan``'s step (why it runs what it runs): for each of
    `AUTO_PREFERENCE` (and the plan's own schedule), every rank's micro-batches in the plan's execution
    order simulated under it with the plan's stage times, transfers (``cost``'s; none without) and bytes:
    ``{name: {"makespan_s", "peak_bytes", "fits", "per_run"}}`` (the slowest rank, the largest in-flight bytes on
    a stage, whether they fit the in-flight budget: the plan's adaptive budget, else ``S`` x the cost model's
    per-micro-batch limit). The orders of several chunks per stage (interleaved) follow, ``per_run`` True: a
    runner holds one model cut for all its steps, so ``auto`` cannot switch to them per step; `run_choice`
    weighs them for the whole run. The planner searched each schedule's own order, so a schedule other than
    the chosen one can only be slower there than here."""
    S = plan.num_stages
    budget = stage_limit(plan)
    if not np.isfinite(budget) and cost is not None:
        budget = S * float(cost.memory_limit(S, plan.num_ranks))
    ff = DEFAULT_FORWARD_FRACTION if cost is None else cost.forward_fraction
    st, p2p = plan_stage_times(plan), plan_p2p_s(plan, cost)
    mem = np.broadcast_to(np.asarray(plan.mb_memory_bytes, np.float64), st.shape)
    out = {}
    chunked = tuple(n for n, info in REGISTRY.items() if info.concrete and info.chunks > 1)
    for name in dict.fromkeys(AUTO_PREFERENCE + (plan.schedule,) + chunked):
        span = peak = 0.0
        for r in range(plan.num_ranks):
            idx = plan.rank_indices(r)
            if len(idx):
                _, peaks, t = rank_span_and_peaks(name, st[:, idx], p2p[idx], mem[:, idx], ff, budget)
                span, peak = max(span, t), max(peak, float(peaks.max()))
        out[name] = {"makespan_s": span, "peak_bytes": peak, "fits": bool(peak <= budget),
                     "per_run": schedule_info(name).chunks > 1}
    return out


def run_choice(plans, cost=None) -> dict:
    """What ``auto`` runs for a whole run of ``plans`` (its steps): the per-step picks among `AUTO_PREFERENCE`
    (one cut of one chunk per stage; each step the fastest order that fits, `compare_orders`) against each order
    of several chunks per stage (a cut of ``v`` chunks per stage for every step), by simulated seconds summed over
    the steps. Returns ``{"choice": "auto" or the chunked name, "seconds": {"auto": s, name: s, ...}, "fits":
    {name: every step fits}}``; a chunked order is chosen only when it fits on every step and is faster."""
    total, fits = {"auto": 0.0}, {"auto": True}
    for plan in plans:
        cmp = compare_orders(plan, cost)
        ok = [n for n in AUTO_PREFERENCE if cmp[n]["fits"]] or list(AUTO_PREFERENCE)
        total["auto"] += min(cmp[n]["makespan_s"] for n in ok)
        for name, c in cmp.items():
            if c["per_run"]:
                total[name] = total.get(name, 0.0) + c["makespan_s"]
                fits[name] = fits.get(name, True) and c["fits"]
    better = [n for n in total if n != "auto" and fits[n] and total[n] < total["auto"]]
    return {"choice": min(better, key=total.get) if better else "auto", "seconds": total, "fits": fits}


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
