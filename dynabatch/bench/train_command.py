"""``dynabatch bench train``'s command (parser: `dynabatch.commands.bench_train`) and the recompute bench it runs
for ``--device-memory-limit`` (`run_recompute_bench`: one ``bench train`` run per memory level, see
`dynabatch.bench.train_recompute` for the variants). This module sits above the train bench
(`dynabatch.bench.train`) and its report (`dynabatch.bench.train_report`), which never import it."""

from __future__ import annotations

import json
import os
from dataclasses import replace

from ..progress import show_progress
from .train_recompute import PEAK_STEPS, RECOMPUTE_VARIANTS, measured_memory, parse_level
from .train_report import TrainBenchStopped, format_table


def sizes_from_args(args) -> dict:
    """The model size overrides of ``--hidden`` and ``--size`` (`dynabatch.commands.bench_train.add_size_arguments`;
    ValueError on a bad one)."""
    return {**({"hidden": args.hidden} if args.hidden else {}), **model_size_overrides(args.model, args.size)}


def model_size_overrides(model: str, items) -> dict:
    """``NAME=INT`` strings as size keywords of ``model``'s constructor (ValueError naming a bad one and
    the names it takes)."""
    import inspect

    from ..pipeline import models

    ctor = models.gpt_tiny if model == "gpt-tiny" else models.t5_tiny if model == "t5-tiny" else None
    if model == "hf-llama":
        from .train_hf import hf_llama as ctor
    elif ctor is None:
        from ..pipeline.models.vlm import vlm_tiny as ctor
    fixed = ("seed", "tile_size", "patch_size", "tile_tokens")  # vlm-tiny's tiling is the loader's vision policy
    names = sorted(k for k, p in inspect.signature(ctor).parameters.items()
                   if k not in fixed and (isinstance(p.default, int) and not isinstance(p.default, bool)
                                          or (p.default is None and k in ("ffn", "vision_ffn"))))
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or name not in names:
            raise ValueError(f"--size {item!r}: expected NAME=INT with NAME one of {model}'s sizes: {', '.join(names)}")
        try:
            out[name] = int(value)
        except ValueError:
            raise ValueError(f"--size {item!r}: {value!r} is not an integer") from None
        if out[name] < 1:
            raise ValueError(f"--size {item!r}: a size is at least 1")
    return out


def bench_train_command(args) -> int:
    """Run ``dynabatch bench train`` with its parsed arguments (parser: `dynabatch.commands.bench_train`)."""
    import sys

    from .train import (TRAIN_METHODS, VLM_METHODS, VLM_MODEL, TrainBenchConfig, default_train_options,
                        run_train_bench)

    vlm = args.model == VLM_MODEL
    try:
        sizes = sizes_from_args(args)
    except ValueError as e:
        print(f"dynabatch: error: {e}", file=sys.stderr)
        return 1
    if args.bypass_idle_stages and args.flush_free:
        print("dynabatch: error: --bypass-idle-stages runs flushed steps; the --flush-free variants stream", file=sys.stderr)
        return 1
    bypass = (vlm and not args.flush_free) if args.bypass_idle_stages is None else args.bypass_idle_stages
    if args.flush_free:
        from .train_flushfree import FLUSH_VARIANTS

        args.methods = list(FLUSH_VARIANTS)
    options = default_train_options().replace(
        num_stages=args.stages, global_batch_tokens=args.global_batch_tokens, max_len=args.max_len,
        max_target_len=args.max_target_len, schedule=args.schedule, seed=args.seed, memory_limit=args.memory_limit)
    cfg = TrainBenchConfig(model=args.model, data=tuple(args.data or ()), options=options, steps=args.steps,
                           warmup=args.warmup, methods=tuple(args.methods or (VLM_METHODS if vlm else TRAIN_METHODS)), device_preset=args.device_preset,
                           backend=args.backend, refit_every=args.refit_every,
                           partition=args.partition or ("modality" if vlm else "searched"), text_fraction=args.text_fraction,
                           timeout_s=args.timeout, max_wall_s=args.max_wall, model_sizes=sizes,
                           bypass_idle_stages=bypass,
                           flush_window=args.flush_window,
                           save_cost_model=os.path.abspath(args.save_cost_model) if args.save_cost_model else None,
                           cost_model=os.path.abspath(args.cost_model) if args.cost_model else None)
    if args.device_memory_limit:

        if vlm or args.model == "hf-llama":
            print("dynabatch bench train: --device-memory-limit compares recomputation on gpt-tiny or t5-tiny",
                  file=sys.stderr)
            return 2
        try:
            doc = run_recompute_bench(cfg, args.device_memory_limit, verbose=args.verbose,
                                      generated_samples=args.generated_samples, out=args.out,
                                      progress=show_progress(args))
        except TrainBenchStopped as e:
            print(f"dynabatch {e}", file=sys.stderr)
            return e.exit_code
        except (ValueError, RuntimeError) as e:
            print(f"dynabatch bench train: {e}", file=sys.stderr)
            return 1
        print(json.dumps(doc, default=float) if args.json else format_recompute_table(doc))
        return 0
    try:
        result = run_train_bench(cfg, verbose=args.verbose, generated_samples=args.generated_samples, out=args.out,
                                 progress=show_progress(args))
    except TrainBenchStopped as e:
        if e.result is not None:
            print(json.dumps(e.result, default=float) if args.json else format_table(e.result), flush=True)
        print(f"dynabatch {e}", file=sys.stderr)  # "dynabatch bench train stopped by SIGTERM; steps done: ..."
        return e.exit_code
    except (ValueError, RuntimeError) as e:
        print(f"dynabatch bench train: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, default=float))
    else:
        print(format_table(result))
        if args.flush_free:
            from .train_flushfree import format_flush_table

            print("\n" + format_flush_table(result))
    return 0


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


__all__ = ["bench_train_command", "format_recompute_table", "model_size_overrides", "predicted_peak",
           "run_recompute_bench", "sizes_from_args"]
