"""`dynabatch bench plan`: every planning method on the same global batches.

Baselines are tuned fairly: each one's knob (rows per micro-batch, token budget, ...) is swept
over `dynabatch.core.plan.baselines.BASELINE_KNOBS` and the value with the best mean simulated iteration
time that fits in memory is reported. The planner's own methods have no knob.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from ..core.plan import baselines as _bl
from ..core.kernels.dp import DPSearch, dp_kernel, dp_reference, segment_cost
from ..core.plan.bounds import iteration_lower_bound, objective_bound_kind, objective_lower_bound
from ..core.cost.model import CostModel
from ..core.options import METHODS, PlanOptions, method_collation
from ..core.plan.planner import sample_order
from ..core.shapes import Shapes
from ..core.plan.stage_plan import evaluate_plan
from ..core.plan.steps import global_batches, plan_step
from ..progress import progress_bar

#: The planning options `dynabatch bench plan` uses unless told otherwise (8 ranks x 4 stages,
#: 64k-token global batches, FLAN's 2048/512 truncation).
DEFAULT_OPTIONS = PlanOptions(global_batch_tokens=65536, max_len=2048, max_target_len=512, num_stages=4,
                              num_ranks=8)


@dataclass(frozen=True)
class PlanBenchConfig:
    """What `run_plan_bench` plans: the `PlanOptions` of every step (its ``method`` and
    ``method_options`` are replaced by each compared method and knob) plus the bench's own fields:
    the model/device presets the cost model came from, how many global batches to plan and a
    label of the data."""

    options: PlanOptions = field(default_factory=lambda: DEFAULT_OPTIONS)
    model: str = "gpt"
    device: str = "a100-80gb"
    num_batches: int = 64
    data: str = "synthetic"
    layout: str = "uniform"

    def to_dict(self) -> dict:
        """Flat JSON form: the bench fields and every `PlanOptions` field (``collation`` left out:
        it is per method)."""
        opts = self.options.to_dict()
        opts.pop("collation")
        return {"model": self.model, "device": self.device, "num_batches": self.num_batches, "data": self.data,
                **({"layout": self.layout} if self.layout != "uniform" else {}), **opts}


def _summarize(plans, obj_lbs, iter_lbs, plan_ms, bound="varlen") -> dict:
    it = np.array([p.iteration_time_s for p in plans])
    obj = np.array([p.objective_s for p in plans])
    real = sum(int(p.mb_real_tokens.sum()) for p in plans)
    computed = sum(int(p.mb_tokens.sum()) for p in plans)
    return {
        "iteration_time_s": float(it.mean()),
        "objective_s": float(obj.mean()),
        "padding_efficiency": real / computed if computed else 1.0,
        "ratio_to_iteration_bound": float(it.mean() / np.mean(iter_lbs)),
        "ratio_to_objective_bound": float(obj.mean() / np.mean(obj_lbs)),
        "objective_bound": bound,  # which objective bound: "padded" (padded plans) or "varlen" (any plan)
        "objective_lower_bound_s": float(np.mean(obj_lbs)),
        # the name of earlier releases for ratio_to_objective_bound (kept for one release)
        "ratio_to_lower_bound": float(obj.mean() / np.mean(obj_lbs)),
        "rank_imbalance": float(np.mean([p.rank_imbalance for p in plans])),
        "num_microbatches": float(np.mean([p.num_microbatches for p in plans])),
        "plan_ms_median": float(statistics.median(plan_ms)),
        "over_memory_limit": any(p.options.get("over_memory_limit", False) for p in plans),
    }


def _method_options(options: PlanOptions, method: str, knobs: dict) -> PlanOptions:
    return options.replace(method=method, method_options=knobs)


def _run_method(shapes, batches, cost, options: PlanOptions, first_step: int = 0):
    """Plan every global batch (``batches``: positions into ``shapes``) with ``options``; the plans
    and each one's planning time in ms (the first batch is planned once more before timing, to
    compile)."""
    plans, times = [], []
    for k, pos in enumerate(batches):
        if k == 0:
            plan_step(shapes, cost, options, pos, first_step)  # warm: numba compile and caches
        t0 = time.perf_counter()
        plans.append(plan_step(shapes, cost, options, pos, first_step + k))
        times.append((time.perf_counter() - t0) * 1e3)
    return plans, times


def _limit(cost: CostModel, options: PlanOptions) -> float:
    if options.memory_limit is not None:
        return float(options.memory_limit)
    return cost.memory_limit(options.num_stages, options.num_ranks)


def run_plan_bench(shapes: Shapes, cost: CostModel, cfg: PlanBenchConfig, methods=METHODS, *, progress=True,
                   reference=False):
    """Plan ``cfg.num_batches`` random global batches of ``shapes`` with every method.

    The global batches are epoch 0's steps of ``cfg.options`` (`dynabatch.core.plan.steps.global_batches`,
    the cut the DataLoader and ``dynabatch plan`` make) and each is planned as they plan it
    (`dynabatch.core.plan.steps.plan_step`) with the method swapped in. Returns (result, plans):
    ``result`` is the JSON document of `dynabatch bench plan --json`, ``plans[method]`` the list of
    BatchPlans of the chosen configuration.
    """
    options = cfg.options
    if options.recompute == "none" and options.device_memory_limit is not None:
        options = options.replace(device_memory_limit=None)  # the limit is the recompute table's (below)
    batches_idx = global_batches(shapes, cost, options, 0)
    if not batches_idx:
        size = (f"{options.global_batch_tokens} tokens" if options.global_batch_size is None
                else f"{options.global_batch_size} samples")
        raise ValueError(f"the data ({len(shapes)} samples) holds less than one global batch of {size}")
    rng = np.random.default_rng(options.seed)
    if cfg.num_batches and len(batches_idx) > cfg.num_batches:
        pick = np.sort(rng.choice(len(batches_idx), cfg.num_batches, replace=False))
        batches_idx = [batches_idx[i] for i in pick]
    batches = [shapes.take(i) for i in batches_idx]
    bound_kw = dict(num_stages=options.num_stages, max_len=options.max_len, max_target_len=options.max_target_len,
                    memory_limit=_limit(cost, options))
    # the objective bound of each collation: the varlen one holds for every plan, the padded one
    # (tighter: 2-D padding, capped micro-batches) for padded plans only (`dynabatch.core.plan.bounds`)
    kinds = {objective_bound_kind(cost, method_collation(m)) for m in methods}
    obj_lbs_of = {kind: [objective_lower_bound(g, cost, num_ranks=min(options.num_ranks, len(g)),
                                               collation="padded" if kind == "padded" else None, **bound_kw)
                         for g in batches] for kind in sorted(kinds | {"varlen"})}
    obj_lbs = obj_lbs_of["varlen"]
    iter_lbs = [iteration_lower_bound(g, cost, num_ranks=min(options.num_ranks, len(g)), **bound_kw) for g in batches]
    jobs = []
    for m in methods:
        if m in _bl.BASELINE_KNOBS:
            knob, values = _bl.BASELINE_KNOBS[m]
            jobs.extend((m, {knob: v}) for v in values)
        else:
            jobs.append((m, {}))
    results: dict[str, list] = {}
    with progress_bar(len(jobs), f"bench plan ({cfg.model})", "config", progress) as bar:
        for m, opts in jobs:
            bar.set_postfix_str(f"{m} {opts}" if opts else m)
            plans, ms = _run_method(shapes, batches_idx, cost, _method_options(options, m, opts))
            results.setdefault(m, []).append((opts, plans, ms))
            bar.update(1)
    out_methods, chosen = {}, {}
    for m, runs in results.items():
        feasible = [r for r in runs if not any(p.options.get("over_memory_limit") for p in r[1])] or runs
        opts, plans, ms = min(feasible, key=lambda r: np.mean([p.iteration_time_s for p in r[1]]))
        kind = objective_bound_kind(cost, method_collation(m))
        out_methods[m] = {**_summarize(plans, obj_lbs_of[kind], iter_lbs, ms, kind), "options": opts}
        chosen[m] = plans
    if cost.stage_aware:  # the planner's methods planned stage-blind (uniform layout), priced under ``cost``
        blind = cost.with_layout("uniform")
        for m in [m for m in methods if m in ("dp", "dp_varlen")]:
            plans, ms = _run_method(shapes, batches_idx, blind, _method_options(options, m, {}))
            plans = [evaluate_plan(p, cost, shapes) for p in plans]
            kind = objective_bound_kind(cost, method_collation(m))
            out_methods[f"{m} (stage-blind)"] = {**_summarize(plans, obj_lbs_of[kind], iter_lbs, ms, kind),
                                                 "options": {}}
            chosen[f"{m} (stage-blind)"] = plans
            aware = out_methods[m]
            aware["vs_stage_blind"] = aware["iteration_time_s"] / out_methods[f"{m} (stage-blind)"]["iteration_time_s"]
    if "pack" in out_methods:
        base = out_methods["pack"]["iteration_time_s"]
        for v in out_methods.values():
            v["speedup_vs_pack"] = base / v["iteration_time_s"]
    result = {
        "config": {**cfg.to_dict(), "num_batches": len(batches), "samples": int(sum(len(g) for g in batches)),
                   "memory_limit_bytes": _limit(cost, options), "forward_fraction": cost.forward_fraction},
        "iteration_lower_bound_s": float(np.mean(iter_lbs)),
        "objective_lower_bound_s": float(np.mean(obj_lbs)),  # the varlen bound: any plan, any collation
        **({"objective_lower_bound_padded_s": float(np.mean(obj_lbs_of["padded"]))} if "padded" in obj_lbs_of else {}),
        "lower_bound_s": float(np.mean(obj_lbs)),  # = objective_lower_bound_s, the name of earlier releases
        "methods": out_methods,
    }
    if cfg.options.device_memory_limit is not None:  # none / full / adaptive recomputation of the dp methods
        from .plan_recompute import recompute_rows

        base = cost.with_model(recompute=False) if cost.model.recompute else cost
        result["recompute"] = {
            "device_memory_limit": float(cfg.options.device_memory_limit),
            "base_model_recompute": bool(cost.model.recompute),
            "methods": recompute_rows(shapes, batches_idx, base, cfg.options, methods)}
    if reference:
        result["reference"] = time_reference(batches[0], cost, cfg)
    return result, chosen


def time_reference(batch: Shapes, cost: CostModel, cfg: PlanBenchConfig) -> dict:
    """Time the numba DP kernel and the pure-Python reference on one global batch (ms), and check
    that they reach the same objective."""
    o = cfg.options
    main, dec, tiles = cost.sample_dims(batch, o.max_len, o.max_target_len)
    order = sample_order(cost, main, dec, tiles)
    main, dec, tiles = main[order], dec[order], tiles[order]
    limit = _limit(cost, o)
    ranks = min(o.num_ranks, len(batch))
    args = (main, dec, tiles, segment_cost(False, cost.pad_multiple, cost.model.tile_patches, cost.time_coef,
                                           cost.mem_coef, limit), DPSearch(ranks, o.num_stages, o.max_caps, True))
    dp_kernel(*args)
    t0 = time.perf_counter()
    starts, _ = dp_kernel(*args)
    kernel_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    ref, _ = dp_reference(*args)
    ref_ms = (time.perf_counter() - t0) * 1e3
    return {"samples": len(batch), "dp_kernel_ms": kernel_ms, "dp_reference_ms": ref_ms,
            "same_partition": bool(np.array_equal(np.asarray(starts), np.asarray(ref)))}


_COLUMNS = (
    ("method", "{}", "method"),
    ("iteration_time_s", "{:.1f}", "iter ms"),
    ("ratio_to_iteration_bound", "{:.3f}", "iter/LB"),
    ("padding_efficiency", "{:.3f}", "pad eff"),
    ("speedup_vs_pack", "{:.2f}x", "vs pack"),
    ("vs_stage_blind", "{:.3f}", "/stage-blind"),
    ("ratio_to_objective_bound", "{:.3f}", "obj/LB"),
    ("objective_bound", "{}", "bound"),
    ("rank_imbalance", "{:.3f}", "max/mean rank"),
    ("num_microbatches", "{:.1f}", "micro-batches"),
    ("plan_ms_median", "{:.2f}", "plan ms"),
    ("options", "{}", "tuned knob"),
)


def format_table(result: dict) -> str:
    """The benchmark result as an aligned text table (times in ms)."""
    rows = []
    columns = [c for c in _COLUMNS if c[0] != "vs_stage_blind"
               or any(c[0] in v for v in result["methods"].values())]
    for m, v in result["methods"].items():
        row = []
        for key, fmt, _ in columns:
            if key == "method":
                row.append(m + (" (OOM)" if v.get("over_memory_limit") else ""))
            elif key == "iteration_time_s":
                row.append(fmt.format(v[key] * 1e3))
            elif key == "options":
                row.append(", ".join(f"{k}={x}" for k, x in v[key].items()) or "-")
            else:
                row.append(fmt.format(v[key]) if key in v else "-")
        rows.append(row)
    head = [c[2] for c in columns]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    cfg = result["config"]
    size = (f"{cfg['global_batch_tokens']}-token" if cfg.get("global_batch_size") is None
            else f"{cfg['global_batch_size']}-sample")
    title = (f"{cfg['model']} on {cfg['device']}: {cfg['num_ranks']} ranks x {cfg['num_stages']} stages "
             f"({cfg['schedule']}), {size} global batches, max len {cfg['max_len']}, "
             f"{cfg['num_batches']} batches from {cfg['data']}"
             + (f", {cfg['layout']} layer layout" if cfg.get("layout") else ""))
    lbs = [f"iteration lower bound (iter/LB): {result['iteration_lower_bound_s'] * 1e3:.1f} ms per step, any plan "
           f"and schedule",
           f"objective lower bound (obj/LB):  {result['objective_lower_bound_s'] * 1e3:.1f} ms of sum/R + (S-1) x max, "
           f"not a bound on iteration time (bound varlen: any plan)"]
    if "objective_lower_bound_padded_s" in result:
        lbs.append(f"padded objective bound:          {result['objective_lower_bound_padded_s'] * 1e3:.1f} ms, padded "
                   f"plans only (bound padded: 2-D padding, capped micro-batches)")
    text = "\n".join([title, *lbs, line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])
    if "recompute" in result:
        from .plan_recompute import format_recompute

        rc = result["recompute"]
        note = ("\n(the preset prices full recomputation in every row above; the recompute table starts from the "
                "same model without it)") if rc["base_model_recompute"] else ""
        text += "\n\n" + format_recompute(rc["methods"], rc["device_memory_limit"]) + note
    return text


def mix_text(shapes: Shapes, text: Shapes, fraction: float = 0.5, seed: int = 0) -> Shapes:
    """``shapes`` plus text-only samples drawn (seeded, with replacement) from ``text`` so that they make
    ``fraction`` of the result; the drawn samples get fresh sample ids above ``shapes``'."""
    if not 0 < fraction < 1:
        raise ValueError(f"the text fraction must lie in (0, 1), got {fraction}")
    n = int(round(len(shapes) * fraction / (1 - fraction)))
    pick = np.random.default_rng(seed).integers(0, len(text), n)
    drawn = text.take(pick)
    ids = int(shapes.sample_id.max(initial=-1)) + 1 + np.arange(n, dtype=np.int64)
    return Shapes.concat([shapes, Shapes(ids, drawn.input_tokens, drawn.target_tokens,
                                         np.zeros(n, np.int32), drawn.task_id)])


def plot(result: dict, plans: dict, path: str) -> None:
    """Three panels: mean iteration time per method with the iteration and objective lower bounds; per-rank simulated time
    of the first batch for dp and pack; the dp plan's pipeline timeline on its slowest rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..plots import draw_pipeline_timeline

    methods = list(result["methods"])
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    vals = [result["methods"][m]["iteration_time_s"] * 1e3 for m in methods]
    colors = ["tab:green" if m.startswith("dp") else "tab:gray" for m in methods]
    ax.bar(methods, vals, color=colors, label="simulated iteration time")
    objs = [result["methods"][m]["objective_s"] * 1e3 for m in methods]
    ax.scatter(methods, objs, marker="D", color="k", zorder=3, label="objective sum/R + (S-1)max")
    ax.axhline(result["iteration_lower_bound_s"] * 1e3, color="tab:red", ls="-",
               label="iteration lower bound (bars)")
    ax.axhline(result["objective_lower_bound_s"] * 1e3, color="tab:purple", ls="--",
               label="objective lower bound, varlen (diamonds)")
    if "objective_lower_bound_padded_s" in result:
        ax.axhline(result["objective_lower_bound_padded_s"] * 1e3, color="tab:purple", ls=":",
                   label="objective lower bound, padded plans")
    ax.set_ylabel("ms per step")
    ax.set_title("methods, same global batches")
    ax.tick_params(axis="x", rotation=45)
    ax.legend(fontsize=8)
    ax = axes[1]
    shown = [m for m in ("dp", "pack") if m in plans]
    width = 0.8 / max(len(shown), 1)
    for q, m in enumerate(shown):
        p = plans[m][0]
        ax.bar(np.arange(p.num_ranks) + q * width, p.rank_time_s * 1e3, width, label=m)
    ax.set_xlabel("data-parallel rank")
    ax.set_ylabel("simulated pipeline time (ms)")
    ax.set_title("per-rank time, first global batch")
    ax.legend()
    ax = axes[2]
    key = "dp" if "dp" in plans else methods[0]
    p = plans[key][0]
    r = int(np.argmax(p.rank_time_s))
    sel = p.mb_rank == r
    t = p.mb_time_s[sel]
    draw_pipeline_timeline(ax, t, result["config"].get("forward_fraction", 1 / 3), p.num_stages, p.schedule)
    ax.set_title(f"{key}: rank {r} timeline ({p.schedule}, {len(t)} micro-batches)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
