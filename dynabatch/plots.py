"""Matplotlib drawing shared by `dynabatch bench plan --plot` and `dynabatch inspect --plot`."""

from __future__ import annotations

import numpy as np

from .core.schedule.orders import split_times
from .core.simulate.pipeline import simulate_pipeline

_KIND = ("F", "B", "W")


def draw_pipeline_timeline(ax, times_s: np.ndarray, forward_fraction: float, num_stages: int, schedule: str) -> None:
    """Gantt chart of one rank's simulated schedule: ``times_s`` is ``[M]`` seconds per micro-batch
    (every stage the same) or ``[S, M]`` per-stage seconds; ``schedule`` a schedule name or an int op
    array (see `simulate_pipeline`). Drawn by `draw_simulated_timeline`."""
    times_s = np.asarray(times_s, np.float64)
    if times_s.shape[-1]:
        fwd, bwd = split_times(times_s, forward_fraction)
        if times_s.ndim == 1:
            fwd, bwd = fwd[0], bwd[0]
        sim = simulate_pipeline(fwd, bwd, num_stages=None if times_s.ndim == 2 else num_stages, schedule=schedule)
        draw_simulated_timeline(ax, sim.start_s, sim.end_s, weight_start_s=sim.weight_start_s,
                                weight_end_s=sim.weight_end_s)
    else:
        draw_simulated_timeline(ax, np.zeros((num_stages, 0, 2)), np.zeros((num_stages, 0, 2)))


def draw_simulated_timeline(ax, start_s: np.ndarray, end_s: np.ndarray, microbatch_ids=None, *,
                            weight_start_s=None, weight_end_s=None) -> list:
    """Gantt chart of simulated op times ``start_s`` / ``end_s`` (``[Q, M, 2]`` seconds, as
    `SimResult` holds them: a row per stage, or per virtual stage ``c S + s`` of an interleaved order): a
    colour per micro-batch, plain boxes for forwards and hatched ones for backwards (of a split backward:
    its input part; ``weight_start_s``/``weight_end_s`` ``[Q, M]``, when given, add its weight parts
    cross-hatched), in ms. Each box's ``gid`` is ``"s{stage}:F{j}"`` / ``"s{stage}:B{j}"`` / ``"s{stage}:W{j}"``
    (``j`` the micro-batch's position in ``start_s``); returns the boxes (matplotlib Rectangles).
    ``microbatch_ids`` (``[M]``) picks the colours (default ``0..M-1``)."""
    import matplotlib.pyplot as plt

    start_s = np.asarray(start_s, np.float64)
    end_s = np.asarray(end_s, np.float64)
    S, M = start_s.shape[:2]
    ids = np.arange(M) if microbatch_ids is None else np.asarray(microbatch_ids)
    cmap = plt.get_cmap("tab20")
    colors = [cmap(int(i) % 20) for i in ids]
    boxes = []
    parts = [(start_s[..., 0], end_s[..., 0]), (start_s[..., 1], end_s[..., 1])]
    if weight_start_s is not None:
        parts.append((np.asarray(weight_start_s, np.float64), np.asarray(weight_end_s, np.float64)))
    for s in range(S):
        for kind, (st, en) in enumerate(parts):
            if not M:
                continue
            a, b = st[s] * 1e3, en[s] * 1e3
            bars = ax.barh(np.full(M, s), b - a, left=a, color=colors, hatch=(None, "//", "xx")[kind],
                           edgecolor="k", lw=0.3)
            for j, patch in enumerate(bars.patches):
                patch.set_gid(f"s{s}:{_KIND[kind]}{j}")
                boxes.append(patch)
    ax.set_yticks(range(S))
    ax.set_ylim(S - 0.5, -0.5)
    ax.set_ylabel("pipeline stage")
    ax.set_xlabel("time (ms); colour = micro-batch, plain = forward, hatched = backward"
                  + ("'s input part, crossed = its weight part" if weight_start_s is not None else ""))
    return boxes


def draw_stage_busy(ax, busy_s, idle_s, utilization, run_utilization=None) -> None:
    """Per-stage busy time (sum of the stage's forwards and backwards) stacked under its idle time
    (makespan - busy), in ms, each bar labelled with the stage's utilisation (busy / makespan) and,
    when given, ``run_utilization`` (the same over the whole run)."""
    busy = np.asarray(busy_s, np.float64) * 1e3
    idle = np.asarray(idle_s, np.float64) * 1e3
    x = np.arange(len(busy))
    ax.bar(x, busy, 0.6, color="tab:green", label="busy (forward + backward)")
    ax.bar(x, idle, 0.6, bottom=busy, color="lightgray", edgecolor="gray", lw=0.5, label="idle (bubble)")
    for s in x:
        lab = f"{100 * utilization[s]:.0f}%"
        if run_utilization is not None:
            lab += f"\n(run {100 * run_utilization[s]:.0f}%)"
        ax.text(s, busy[s] + idle[s], lab, ha="center", va="bottom", fontsize=8)
    top = float((busy + idle).max(initial=0.0))
    ax.set_ylim(0, top * 1.4 if top > 0 else 1.0)
    ax.set_xticks(x)
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8, loc="upper center", ncol=2)
