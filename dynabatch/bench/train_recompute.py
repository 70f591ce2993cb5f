"""``dynabatch bench train --device-memory-limit L ...``: recomputation policies under device memory limits.

At each limit (bytes of activations one device may hold, or a fraction of the predicted peak of
``dp`` without recomputation, written ``0.6x``), three variants of ``dp`` train the same model on the
same global batches, interleaved step by step as every ``bench train`` run (`RECOMPUTE_VARIANTS`):

* ``dp+none``: no recomputation, planned without the limit (it may not fit: the result says whether
  its planned and measured peaks do);
* ``dp+full``: every recomputable layer of every stage under ``torch.utils.checkpoint``;
* ``dp+adaptive``: the planner's per-stage choice (`dynabatch.core.plan.recompute`) under the limit.

The runs use equal block counts per stage (``--partition uniform``) so that every variant has the
same stages, and the cost model's `StageMemory` is measured on those stages
(`dynabatch.pipeline.measure.memory.measured_stage_memory`, on the run's device). The recompute variants
are not refit online, so that every variant plans with the same cost model (a `FeedbackLoop` would
refit the time without recomputation, see `dynabatch.core.plan.feedback`).
Reported per limit and variant: tokens/s, step time against ``dp+full``, each stage's largest
measured bytes kept for backward (saved-tensor hooks) against the limit and against the plan's
prediction, and the mean recomputed layers per stage. Bytes, seconds, tokens.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

RECOMPUTE_VARIANTS = ("dp+none", "dp+full", "dp+adaptive")
#: Steps whose plans give the predicted peak a relative level (``0.6x``) scales.
PEAK_STEPS = 4


def split_variant(method: str) -> tuple[str, str | None]:
    """``"dp+adaptive"`` -> ``("dp", "adaptive")``; a plain method -> ``(method, None)``."""
    from ..core.options import RECOMPUTE

    base, _, policy = method.partition("+")
    if not policy:
        return method, None
    if policy not in RECOMPUTE or base not in ("dp", "dp_varlen"):
        raise ValueError(f"unknown method {method!r}: recompute variants are dp+{{{','.join(RECOMPUTE)}}}")
    return base, policy


def parse_level(text: str) -> tuple[float, bool]:
    """``"0.6x"`` -> ``(0.6, True)`` (relative to the predicted peak without recomputation);
    ``"12MB"``/``"3e7"`` -> ``(bytes, False)``."""
    from ..option_flags import parse_bytes

    t = str(text).strip()
    if t.lower().endswith("x"):
        v = float(t[:-1])
        if not v > 0:
            raise ValueError(f"a relative memory level must be > 0, got {text!r}")
        return v, True
    return parse_bytes(t), False


def measured_memory(model, bounds, cost, device) -> None:
    """Give ``cost`` the `StageMemory` measured on ``model``'s stages at ``bounds``."""
    from ..pipeline.measure.memory import measured_stage_memory

    cost.stage_memory_model = measured_stage_memory(model, bounds, cost, device=device)


def variant_options(options, policy: str):
    """The `PlanOptions` of a recompute variant: ``none`` plans unchecked (whether it fits is
    reported), the others under ``options.device_memory_limit``."""
    if policy == "none":
        return options.replace(recompute="none", device_memory_limit=1e300)  # peaks recorded, never refused
    return options.replace(recompute=policy)


def observe(step, res) -> dict:
    """Per-stage planned and measured peaks (bytes) and recomputed layers of one trained step."""
    plan = getattr(step, "plan", None)
    opts = (plan.options if plan is not None else {}) or {}
    timings = res.all_timings or (res.timing,)
    S = max(t.stage for t in timings) + 1
    measured = [max(t.peak_saved_bytes for t in timings if t.stage == s) for s in range(S)]
    return {"planned_peak_bytes": [float(x) for x in opts.get("stage_peak_bytes", [np.nan] * S)],
            "measured_peak_bytes": [float(x) for x in measured],
            "recompute_layers": [int(x) for x in opts.get("recompute_layers", [0] * S)]}


def summarize(rows: list[dict], limit: float | None) -> dict:
    """A variant's memory result over its steps (per stage: the largest planned and measured peaks)."""
    planned = np.array([r["planned_peak_bytes"] for r in rows], np.float64)
    measured = np.array([r["measured_peak_bytes"] for r in rows], np.float64)
    ks = np.array([r["recompute_layers"] for r in rows], np.float64)
    out = {"planned_peak_bytes": planned.max(axis=0).tolist(), "measured_peak_bytes": measured.max(axis=0).tolist(),
           "mean_recompute_layers": ks.mean(axis=0).tolist(),
           "measured_over_planned": float(np.nanmax(measured / np.where(planned > 0, planned, np.nan)))}
    if limit is not None:
        out.update(device_memory_limit=float(limit), fits_planned=bool(np.nanmax(planned) <= limit),
                   fits_measured=bool(measured.max() <= limit))
    return out


def predicted_peak(cfg, steps: int = PEAK_STEPS) -> float:
    """The largest per-stage peak (bytes) ``dp`` without recomputation is predicted to keep over the
    first ``steps`` steps of ``cfg`` (a resolved `TrainBenchConfig`), on this process's CPU: what a
    relative level scales."""
    import dynabatch
    from ..pipeline import make_model, stage_cost_model
    from .train import uniform_bounds

    S = cfg.options.num_stages
    model = make_model(cfg.model, **cfg.resolved_sizes(), seed=cfg.options.seed)
    cost = stage_cost_model(model, S, cfg.device_preset)
    measured_memory(model, uniform_bounds(model, S), cost, "cpu")
    enc_dec = model.kind == "encoder_decoder"
    opts = cfg.options.replace(method="dp", num_ranks=1, recompute="none", device_memory_limit=1e300,
                               max_target_len=cfg.options.max_target_len if enc_dec else None)
    from ..loader.settings import Costing, DataSource, Runtime

    loader = dynabatch.DataLoader(list(cfg.data), options=opts, source=DataSource(index=cfg.index, mode="indexed"),
                                  costing=Costing(cost_model=cost),
                                  runtime=Runtime(world_size=1, rank=0, plan_ahead=0))
    try:
        peaks = [max(s.plan.options["stage_peak_bytes"]) for s, _ in zip(loader, range(steps))]
    finally:
        loader.close()
    return float(max(peaks))


def run_recompute_bench(cfg, levels, *, verbose: bool = False, generated_samples: int = 2000,
                        out: str | None = None, progress: bool = False) -> dict:
    """`RECOMPUTE_VARIANTS` at every level of ``levels`` (`parse_level` strings): one ``bench train``
    run per level (see the module docstring; ``progress``: its bar). Returns ``{"config", "levels": [...]}``."""
    import tempfile

    from .train import build_data, run_train_bench

    cfg = replace(cfg, methods=RECOMPUTE_VARIANTS, partition="uniform")
    with tempfile.TemporaryDirectory() as tmp:
        resolved = build_data(cfg, tmp, generated_samples)
        parsed = [parse_level(x) for x in levels]
        peak = predicted_peak(resolved) if any(rel for _, rel in parsed) else None
        results = []
        for (value, rel), text in zip(parsed, levels):
            limit = value * peak if rel else value
            run = replace(cfg, data=resolved.data, options=cfg.options.replace(device_memory_limit=limit))
            res = run_train_bench(run, verbose=verbose, generated_samples=generated_samples, progress=progress)
            methods = res["methods"]
            full = methods["dp+full"]["tokens_per_s"]
            for m in methods.values():
                m["step_time_vs_full"] = full / m["tokens_per_s"] if m["tokens_per_s"] > 0 else float("nan")
            results.append({"level": text, "device_memory_limit": limit, "methods": methods,
                            "config": res.get("config")})
    doc = {"predicted_peak_without_recompute_bytes": peak, "levels": results}
    if out:
        import json

        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


def format_recompute_table(doc: dict) -> str:
    """The text table of `run_recompute_bench`."""
    lines = []
    if doc.get("predicted_peak_without_recompute_bytes"):
        lines.append(f"predicted peak without recomputation: {doc['predicted_peak_without_recompute_bytes'] / 1e6:.2f} "
                     "MB per device (dp, first steps); relative levels scale it")
    head = (f"{'limit':>14}  {'variant':<12} {'tokens/s':>9} {'step/full':>9} {'fits':>5}  "
            f"{'measured peak MB per stage':<28} {'planned MB per stage':<24} {'recomputed layers':<18}")
    lines += [head, "-" * len(head)]
    for lv in doc["levels"]:
        lim = lv["device_memory_limit"]
        for name, m in lv["methods"].items():
            mem = m.get("memory", {})
            fits = "yes" if mem.get("fits_measured", True) and mem.get("fits_planned", True) else "no"
            meas = " ".join(f"{x / 1e6:.2f}" for x in mem.get("measured_peak_bytes", []))
            plan = " ".join(f"{x / 1e6:.2f}" for x in mem.get("planned_peak_bytes", []))
            ks = " ".join(f"{x:.1f}" for x in mem.get("mean_recompute_layers", []))
            lines.append(f"{lv['level'] + f' {lim / 1e6:.1f}MB':>14}  {name:<12} {m['tokens_per_s']:9.0f} "
                         f"{m['step_time_vs_full']:9.3f} {fits:>5}  {meas:<28} {plan:<24} {ks:<18}")
    return "\n".join(lines)
