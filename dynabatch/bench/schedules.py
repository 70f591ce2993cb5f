"""`dynabatch bench schedules`: every registered schedule on the same dp plans, simulated.

For each pipeline depth ``S`` and data-parallel width ``R`` the global batches of FLAN-like samples are
planned once with ``method="dp"`` under 1F1B; every rank's micro-batches (in the plan's execution order,
with the plan's per-stage seconds, transfer seconds and bytes) are then simulated under each registered
schedule (`dynabatch.core.schedule.build.rank_span_and_peaks`: the order the runner would execute). Per
schedule: the mean simulated iteration time (the slowest rank's makespan), its speed-up over 1F1B, the
bubble share (idle stage time over ``S x`` makespan, busiest rank), the peak in-flight activation bytes
on a stage relative to 1F1B's, and the iteration lower bound no order beats (the busiest stage's work of
the busiest rank). Interleaved cuts each stage into its chunks, each a ``1 / v`` share of the stage's
seconds; zero-bubble splits each backward into halves (`dynabatch.core.kernels.op_codes.WEIGHT_SHARE`), or
by a measured split (``split``: the weight share and the split's seconds over a whole backward's,
`dynabatch.core.cost.backward_split.BackwardSplit`; ``--weight-share``/``--split-factor``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.cost.model import CostModel
from ..core.kernels.op_codes import WEIGHT_SHARE
from ..core.options import PlanOptions
from ..core.plan.steps import global_batches, plan_step
from ..core.schedule.build import rank_span_and_peaks
from ..core.schedule.orders import plan_p2p_s, plan_stage_times, stage_limit
from ..core.schedule.registry import REGISTRY
from ..core.shapes import Shapes
from ..progress import progress_bar

#: The concrete schedules the bench compares, in registration order.
SCHEDULES = tuple(n for n, info in REGISTRY.items() if info.concrete)


@dataclass(frozen=True)
class ScheduleRow:
    """One schedule at one (stages, ranks): seconds are means over the steps."""

    stages: int
    ranks: int
    schedule: str
    iteration_s: float
    speedup_vs_1f1b: float
    bubble_share: float
    peak_vs_1f1b: float
    bound_s: float
    microbatches_per_rank: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def simulate_schedules(plan, cost: CostModel, schedules=SCHEDULES, split: tuple[float, float] | None = None) -> dict:
    """``{schedule: (iteration seconds, busiest rank's bubble share, peak in-flight bytes on a stage)}`` of one
    plan's ranks simulated under each schedule, and ``"bound"``: the busiest stage's work (seconds).
    ``split``: ``(weight share, split factor)`` of a measured backward split (None: halves of a whole one)."""
    share, factor = split if split is not None else (WEIGHT_SHARE, 1.0)
    st, p2p = plan_stage_times(plan), plan_p2p_s(plan, cost)
    held = np.asarray(plan.stage_memory_bytes if plan.stage_memory_bytes is not None else
                      np.broadcast_to(plan.mb_memory_bytes, st.shape), np.float64)
    S, limit = plan.num_stages, stage_limit(plan)
    if not np.isfinite(limit):
        limit = S * float(cost.memory_limit(S, plan.num_ranks))
    out, bound = {}, 0.0
    for name in schedules:
        span, bubble, peak = 0.0, 0.0, 0.0
        for r in range(plan.num_ranks):
            idx = plan.rank_indices(r)
            if not len(idx):
                continue
            _, peaks, t = rank_span_and_peaks(name, st[:, idx], p2p[idx], held[:, idx], cost.forward_fraction, limit,
                                              share, factor)
            busy = st[:, idx].sum()
            bound = max(bound, float(st[:, idx].sum(axis=1).max()))
            if t > span:
                span, bubble = t, 1.0 - busy / (S * t) if t > 0 else 0.0
            peak = max(peak, float(peaks.max()))
        out[name] = (span, bubble, peak)
    out["bound"] = bound
    return out


def run_schedules_bench(shapes: Shapes, model: str = "gpt", device: str = "a100-80gb", stages=(4, 8), ranks=(8, 32),
                        num_batches: int = 16, global_batch_tokens: int = 65536, max_len: int = 2048,
                        max_target_len: int | None = None, seed: int = 0, schedules=SCHEDULES,
                        progress: bool = False, split: tuple[float, float] | None = None) -> list[ScheduleRow]:
    """The rows of the bench (module doc): per (stages, ranks) and schedule, means over ``num_batches``
    global batches of ``global_batch_tokens`` tokens planned with dp under 1F1B; ``split`` as
    `simulate_schedules` takes it."""
    rows = []
    with progress_bar(len(stages) * len(ranks) * num_batches, "bench schedules", "plan", progress) as bar:
        for S in stages:
            rows += _depth(shapes, model, device, S, ranks, num_batches, global_batch_tokens, max_len,
                           max_target_len, seed, schedules, bar, split)
    return rows


def _depth(shapes, model, device, S, ranks, num_batches, global_batch_tokens, max_len, max_target_len, seed,
           schedules, bar, split) -> list[ScheduleRow]:
    """The rows of pipeline depth ``S``, one data-parallel width of ``ranks`` after the other."""
    rows = []
    cost = CostModel.preset(model, device=device, num_stages=S)
    for R in ranks:
        opts = PlanOptions(global_batch_tokens=global_batch_tokens, max_len=max_len, max_target_len=max_target_len,
                           num_stages=S, num_ranks=R, method="dp", schedule="1f1b", seed=seed, drop_last=True)
        sims, mbs = [], []
        for k, batch in enumerate(global_batches(shapes, cost, opts)):
            if k == num_batches:
                break
            plan = plan_step(shapes, cost, opts, batch, step=k)
            sims.append(simulate_schedules(plan, cost, schedules, split))
            mbs.append(plan.num_microbatches / R)
            bar.update(1)
        base = np.array([s["1f1b"][0] for s in sims])
        for name in schedules:
            it = np.array([s[name][0] for s in sims])
            rows.append(ScheduleRow(S, R, name, float(it.mean()), float(base.mean() / it.mean()),
                                    float(np.mean([s[name][1] for s in sims])),
                                    float(np.mean([s[name][2] / s["1f1b"][2] for s in sims])),
                                    float(np.mean([s["bound"] for s in sims])), float(np.mean(mbs))))
    return rows


def format_schedules(rows: list[ScheduleRow]) -> str:
    """The bench table, one block per (stages, ranks)."""
    lines = []
    for S, R in dict.fromkeys((r.stages, r.ranks) for r in rows):
        block = [r for r in rows if (r.stages, r.ranks) == (S, R)]
        lines += [f"{S} stages x {R} ranks ({block[0].microbatches_per_rank:.1f} micro-batches per rank, "
                  f"bound {block[0].bound_s * 1e3:.1f} ms)",
                  "schedule        iteration ms  vs 1f1b  bubble  peak vs 1f1b  vs bound"]
        for r in block:
            lines.append(f"{r.schedule:<14}  {r.iteration_s * 1e3:>12.1f}  {r.speedup_vs_1f1b:>6.3f}x  "
                         f"{100 * r.bubble_share:>5.1f}%  {r.peak_vs_1f1b:>11.2f}x  {r.iteration_s / r.bound_s:>7.3f}")
        lines.append("")
    return "\n".join(lines).rstrip()
