"""Matplotlib drawing shared by `dynabatch bench plan --plot` and `dynabatch inspect --plot`."""

from __future__ import annotations

import numpy as np

from .core.simulate import simulate_pipeline


def draw_pipeline_timeline(ax, times_s: np.ndarray, forward_fraction: float, num_stages: int, schedule: str) -> None:
    """Gantt chart of one rank's simulated schedule: a row per stage, a colour per micro-batch,
    plain boxes for forwards and hatched ones for backwards (times in ms)."""
    import matplotlib.pyplot as plt

    times_s = np.asarray(times_s, np.float64)
    if len(times_s):
        sim = simulate_pipeline(times_s * forward_fraction, times_s * (1 - forward_fraction),
                                num_stages=num_stages, schedule=schedule)
        cmap = plt.get_cmap("tab20")
        for s in range(num_stages):
            for j in range(len(times_s)):
                for kind in (0, 1):
                    a, b = sim.start_s[s, j, kind] * 1e3, sim.end_s[s, j, kind] * 1e3
                    ax.barh(s, b - a, left=a, color=cmap(j % 20), hatch=None if kind == 0 else "//",
                            edgecolor="k", lw=0.3)
    ax.set_yticks(range(num_stages))
    ax.invert_yaxis()
    ax.set_ylabel("pipeline stage")
    ax.set_xlabel("time (ms); colour = micro-batch, plain = forward, hatched = backward")
