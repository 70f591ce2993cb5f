"""`dynabatch inspect --plot`: the PNG of a run plan.

Titled with the plan's method, cost model, device and world, and its step time against pack's on the
same global batches (`plot_title`). Six panels, every figure read from the plan file through
`dynabatch.planfile.inspect` (times in ms):
micro-batch shapes; the predicted iteration time of every step, beside the ``pack`` baseline and
the iteration lower bound of the same global batches (`step_baselines`: they need the samples'
shapes, from the length index the plan was made from); each rank's time as % off the mean rank
(an axis that shows a 1% imbalance); the padding efficiency of every step (and pack's); the drawn
rank's busy and idle time per stage (one bar when the layout is uniform: its stages are all
equal); and the step's pipeline timeline with a legend.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from ..core.plan.bounds import iteration_lower_bound
from ..core.shapes import Shapes
from ..core.plan.steps import plan_step
from .inspect import microbatch_columns, stage_busy, step_timeline
from .reader import RunPlan

MAX_BASELINE_STEPS = 400  # steps re-planned with pack for the baseline line (evenly spread beyond that)


@dataclasses.dataclass(frozen=True)
class StepBaselines:
    """Per-step figures of the same global batches under other plans: ``steps`` (the steps computed),
    ``pack_s`` (pack's predicted iteration seconds), ``pack_padding`` (its real / computed tokens) and
    ``lower_bound_s`` (`iteration_lower_bound`: no plan of the batch can be faster)."""

    steps: np.ndarray
    pack_s: np.ndarray
    pack_padding: np.ndarray
    lower_bound_s: np.ndarray


def index_shapes(run: RunPlan, index=None) -> Shapes | None:
    """The shapes of the run's samples (``sample_id`` as in the plan): from ``index`` (a length index
    path or paths, or a `LengthIndex`), else from the index files the plan was made from when they
    still exist, else None. A ValueError names an index whose fingerprint is not the plan's."""
    from ..index import read_index

    if index is None:
        info = run.index_info
        paths = info.get("paths") or []
        if info.get("scanned", True) or not paths or not all(os.path.isfile(p) for p in paths):
            return None  # planned from raw data (or synthetic shapes): no index file to read
        index = paths
    idx = read_index(index, sort=False)
    if run.dataset_fingerprint and idx.fingerprint != run.dataset_fingerprint:
        raise ValueError(f"the length index {idx.paths or index} has fingerprint {idx.fingerprint}, the plan "
                         f"{run.path or ''} was made from {run.dataset_fingerprint}: pass the index it was planned on")
    return idx.shapes


def step_baselines(run: RunPlan, shapes: Shapes, max_steps: int = MAX_BASELINE_STEPS) -> StepBaselines:
    """Each step's global batch (its samples, from ``shapes``) planned with ``pack`` (planner defaults,
    the plan's other options) and its iteration lower bound; at most ``max_steps`` steps, evenly spread."""
    cost = run.cost_model()
    steps = np.asarray(run.steps)
    if len(steps) > max_steps:
        steps = steps[np.unique(np.linspace(0, len(steps) - 1, max_steps).round().astype(int))]
    order = np.argsort(shapes.sample_id, kind="stable")
    pack_opts = dataclasses.replace(run.options, method="pack", method_options={})
    pack_s, pack_pad, lb = [], [], []
    for k in steps:
        ids = run.step(int(k)).sample_ids
        pos = order[np.searchsorted(shapes.sample_id, ids, sorter=order)]
        if not np.array_equal(shapes.sample_id[pos], ids):
            raise ValueError(f"step {int(k)} holds samples the length index does not (e.g. "
                             f"{ids[~np.isin(ids, shapes.sample_id)][:3].tolist()}): not the index it was planned on")
        pack = plan_step(shapes, cost, pack_opts, pos, int(k))
        pack_s.append(pack.iteration_time_s)
        pack_pad.append(pack.padding_efficiency)
        o = run.options
        limit = o.memory_limit if o.memory_limit is not None else cost.memory_limit(o.num_stages, o.num_ranks)
        lb.append(iteration_lower_bound(shapes.take(pos), cost, num_stages=o.num_stages,
                                        num_ranks=min(o.num_ranks, len(pos)), max_len=o.max_len,
                                        max_target_len=o.max_target_len, memory_limit=limit))
    return StepBaselines(steps, np.array(pack_s), np.array(pack_pad), np.array(lb))


def pack_speedup(run: RunPlan, base: StepBaselines) -> float:
    """Pack's predicted time over this plan's, summed over the steps ``base`` re-planned (> 1: this plan
    steps faster than pack on the same global batches)."""
    it = run.iteration_times_s()[np.searchsorted(run.steps, base.steps)]
    return float(base.pack_s.sum() / it.sum()) if it.sum() > 0 else float("nan")


def plot_title(run: RunPlan, base: StepBaselines | None) -> str:
    """The figure's title: the file, method, cost model, device, world and steps, and the plan's step
    time against pack's on the same global batches (or how to get it: the length index)."""
    cost = run.cost_model()
    head = (f"{os.path.basename(run.path) if run.path else 'run plan'}: {run.method} ({run.collation}) for "
            f"{cost.model.name} on {cost.device.name}, {run.num_ranks} ranks x {run.num_stages} stages, "
            f"{run.num_steps} steps")
    if base is None:
        return head + "\nvs pack: pass the length index the plan was made from (--index) to compare"
    return (head + f"\n{run.method} vs pack (planner defaults) on the same global batches: "
            f"{pack_speedup(run, base):.2f}x (pack's predicted step time / this plan's, over {len(base.steps)} steps)")


def step_padding(run: RunPlan, mb: dict) -> np.ndarray:
    """Real / computed tokens of every step (in ``run.steps`` order)."""
    pos = np.searchsorted(run.steps, mb["step"])
    real = np.bincount(pos, weights=mb["real_tokens"], minlength=run.num_steps)
    computed = np.bincount(pos, weights=mb["tokens"], minlength=run.num_steps)
    return np.divide(real, computed, out=np.ones_like(real), where=computed > 0)


def _shapes_panel(fig, ax, run: RunPlan, mb: dict, max_points: int) -> None:
    from matplotlib.colors import LogNorm

    n = len(mb["rows"])
    pick = np.random.default_rng(0).choice(n, max_points, replace=False) if n > max_points else np.arange(n)
    t_ms = np.maximum(mb["time_s"][pick] * 1e3, 1e-3)
    sc = ax.scatter(mb["length"][pick], mb["rows"][pick], c=t_ms, s=8, cmap="viridis", norm=LogNorm(), alpha=0.7)
    per_stage = "stage_time_s" in run.table.column_names
    fig.colorbar(sc, ax=ax, label="fwd+bwd ms per stage" + (" (slowest)" if per_stage else ""))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("padded length (tokens)")
    ax.set_ylabel("rows (sequences)")
    ax.set_title(f"micro-batch shapes ({n}{', sampled' if n > max_points else ''})")


def _iteration_panel(ax, run: RunPlan, step: int, base: StepBaselines | None) -> None:
    it = run.iteration_times_s()
    ax.plot(run.steps, it * 1e3, lw=0.9, color="tab:green", label=f"{run.method} (this plan)", gid="plan")
    if base is not None:
        ax.plot(base.steps, base.pack_s * 1e3, lw=0.9, color="tab:gray", label="pack (planner defaults)", gid="pack")
        ax.plot(base.steps, base.lower_bound_s * 1e3, lw=0.9, ls="--", color="k", label="lower bound (any plan)",
                gid="lower_bound")
    for end in np.cumsum(run.steps_per_epoch)[:-1]:
        ax.axvline(end - 0.5, color="gray", ls=":", lw=1)
    ax.axvline(step, color="tab:red", lw=1, label=f"step {step} (drawn below)")
    ax.set_xlabel("step (dotted: epoch boundaries)")
    ax.set_ylabel("ms")
    ax.set_title("predicted iteration time per step (slowest rank)" if base is not None else
                 "predicted iteration time per step\n(pack and lower bound: pass the length index)")
    ax.legend(fontsize=8)


def _rank_panel(ax, run: RunPlan, step: int) -> None:
    """Each rank's time as % off the mean rank: the chosen step, and the run's totals."""
    rt = run.rank_times_s()
    k = int(np.searchsorted(run.steps, step))
    row = rt[k] if rt.size else np.zeros(run.num_ranks)
    tot = rt.sum(axis=0) if rt.size else np.zeros(run.num_ranks)
    off = lambda x: (x / x.mean() - 1.0) * 100 if x.mean() > 0 else np.zeros_like(x)  # noqa: E731
    x = np.arange(run.num_ranks)
    ax.bar(x - 0.2, off(tot), 0.4, color="tab:blue", label="whole run", gid="run")
    ax.bar(x + 0.2, off(row), 0.4, color="tab:orange", label=f"step {step}", gid="step")
    top = max(1.0, 1.25 * float(np.abs(np.concatenate([off(tot), off(row)])).max(initial=0.0)))
    ax.set_ylim(-top, top)  # at least +-1%: a 1% imbalance shows
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xticks(x)
    ax.set_xlabel("data-parallel rank")
    ax.set_ylabel("% off the mean rank")
    ax.set_title("rank balance (simulated time)")
    ax.legend(fontsize=8)


def _padding_panel(ax, run: RunPlan, mb: dict, base: StepBaselines | None) -> None:
    pad = step_padding(run, mb)
    ax.plot(run.steps, pad, lw=0.9, color="tab:green", label=f"{run.method} (this plan)", gid="plan")
    low = float(pad.min(initial=1.0))
    if base is not None:
        ax.plot(base.steps, base.pack_padding, lw=0.9, color="tab:gray", label="pack (planner defaults)", gid="pack")
        low = min(low, float(base.pack_padding.min(initial=1.0)))
    ax.set_ylim(max(0.0, low - 0.05), 1.01)
    ax.set_xlabel("step")
    ax.set_ylabel("real / computed tokens")
    ax.set_title("padding efficiency per step")
    ax.legend(fontsize=8, loc="lower right")


def _stage_panel(ax, tl: dict, busy: dict, step: int) -> None:
    from ..plots import draw_stage_busy

    run_util = busy["run"]["utilization"]
    if tl["per_stage"]:
        draw_stage_busy(ax, tl["busy_s"], tl["idle_s"], tl["utilization"], run_util)
        ax.set_title(f"step {step}, rank {tl['rank']}: busy / idle per stage\n(% = utilisation)")
        return
    # uniform layout: every stage costs the same, one bar says it all
    draw_stage_busy(ax, tl["busy_s"][:1], tl["idle_s"][:1], tl["utilization"][:1], run_util[:1])
    ax.set_xticks([0], [f"each of {len(tl['busy_s'])} stages"])
    ax.set_xlim(-1.5, 1.5)
    ax.set_title(f"step {step}, rank {tl['rank']}: busy / idle\n(uniform layout; % = utilisation)")


def _timeline_panel(ax, tl: dict, step: int) -> None:
    from matplotlib.patches import Patch

    from ..plots import draw_simulated_timeline

    draw_simulated_timeline(ax, tl["start_s"], tl["end_s"], tl["microbatches"], weight_start_s=tl.get("weight_start_s"),
                            weight_end_s=tl.get("weight_end_s"))
    ax.set_xlabel("time (ms)")
    ax.legend(handles=[Patch(facecolor="white", edgecolor="k", label="forward"),
                       Patch(facecolor="white", edgecolor="k", hatch="//", label="backward"),
                       Patch(facecolor="tab:blue", label="colour: one micro-batch")],
              fontsize=8, loc="upper right", bbox_to_anchor=(1.0, -0.07), ncol=3)
    ax.set_title(f"step {step}, rank {tl['rank']}: simulated pipeline timeline ({tl['schedule']}, "
                 f"{len(tl['microbatches'])} micro-batches, {'per-stage' if tl['per_stage'] else 'equal'} stage "
                 f"costs, {tl['makespan_s'] * 1e3:.1f} ms)")


def plot_plan(run: RunPlan, path: str | None, step: int | None = None, max_points: int = 20000,
              rank: int | None = None, shapes: Shapes | None = None):
    """Draw the six panels (see the module doc) of ``step`` (default: the slowest) on ``rank``
    (default: its slowest). ``shapes``: the run's samples (`index_shapes`) for the pack and lower
    bound lines (default: read from the plan's own index file when it still exists; without one
    the lines are left out and the title says so). Writes the PNG to ``path`` (None: no file) and
    returns the (closed) matplotlib Figure; its axes carry ``gid`` s (``shapes``, ``iteration``,
    ``ranks``, ``padding``, ``stage_busy``, ``timeline``), the timeline's boxes as
    `dynabatch.plots.draw_simulated_timeline` names them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mb = microbatch_columns(run)
    if step is None:
        step = int(run.steps[int(np.argmax(run.iteration_times_s()))])
    shapes = index_shapes(run) if shapes is None else shapes
    base = step_baselines(run, shapes) if shapes is not None else None
    tl = step_timeline(run, step, rank)
    fig = plt.figure(figsize=(16, 14))
    grid = fig.add_gridspec(3, 6, height_ratios=(1, 1, 1.1))
    _shapes_panel(fig, fig.add_subplot(grid[0, :3], gid="shapes"), run, mb, max_points)
    _iteration_panel(fig.add_subplot(grid[0, 3:], gid="iteration"), run, step, base)
    _rank_panel(fig.add_subplot(grid[1, :2], gid="ranks"), run, step)
    _padding_panel(fig.add_subplot(grid[1, 2:4], gid="padding"), run, mb, base)
    _stage_panel(fig.add_subplot(grid[1, 4:], gid="stage_busy"), tl, stage_busy(run, step, mb), step)
    _timeline_panel(fig.add_subplot(grid[2, :], gid="timeline"), tl, step)
    fig.suptitle(plot_title(run, base), fontsize=12)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig
