"""``dynabatch bench train``: its command line, the result document, its table, and how a run stops.

Stopping: ``timeout_s`` (``--timeout``) is a liveness timeout, not a wall clock: the ranks are
killed only when none of them made progress (a step, a print) for that long
(`dynabatch.pipeline.launch_local`); ``max_wall_s`` (``--max-wall``) is an optional whole-run cap.
After a round of steps (at most once a second) rank 0 writes the result so far (``"partial": true,
"status": "running"``) to a JSON file (``--out``, else a temporary one); when the run is stopped
(SIGINT, SIGTERM, a timeout, a failed rank) the command prints and writes that partial result with
``"status": "stopped"`` and ``"stopped_by"``, and
`run_train_bench` raises `TrainBenchStopped` carrying it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal

import numpy as np

from .progress import add_progress_option, show_progress


def timer_noise(phi: np.ndarray, y: np.ndarray) -> float:
    """Median relative deviation from the median among micro-batches of identical shape (>= 3 repeats)."""
    keys: dict = {}
    for row, v in zip(map(bytes, np.round(phi, 6).view(np.uint8).reshape(len(phi), -1)), y):
        keys.setdefault(row, []).append(v)
    devs = []
    for vals in keys.values():
        if len(vals) >= 3:
            m = float(np.median(vals))
            devs += [abs(v - m) / m for v in vals]
    return float(np.median(devs)) if devs else float("nan")


def _ratios(methods: dict) -> dict:
    """dp's tokens/s over every other method's (``dp_vs_<method>``) and over the best of them; with the
    spread of the paired per-step ratios (``paired``: the methods train the same global batches
    interleaved, so each timed step's time ratio is one paired sample of the timer and load noise)."""
    if "dp" not in methods:
        return {}
    dp = methods["dp"]
    others = {k: v for k, v in methods.items() if k != "dp"}
    ratios = {f"dp_vs_{k.replace('-', '_')}": dp["tokens_per_s"] / v["tokens_per_s"]
              for k, v in others.items() if v.get("tokens_per_s")}
    best_other = max((v["tokens_per_s"] for v in others.values()), default=None)
    if best_other:
        ratios["dp_vs_best_baseline"] = dp["tokens_per_s"] / best_other
    paired = {}
    for k, v in others.items():
        a, b = dp.get("per_step", []), v.get("per_step", [])
        n, w = min(len(a), len(b)), dp.get("warmup_steps", 0)
        r = [b[i]["step_s"] / a[i]["step_s"] for i in range(w, n) if a[i]["step_s"] > 0]
        if r:
            q = [float(x) for x in np.quantile(r, [0.25, 0.5, 0.75])]
            paired[k] = {"p25": q[0], "median": q[1], "p75": q[2], "steps": len(r)}
    if paired:
        ratios["paired"] = paired
    return ratios


def assemble_result(config: dict, methods: dict, *, status: str = "complete", stopped_by: str | None = None) -> dict:
    """The JSON document of a run: ``status`` is ``complete``, ``running`` (written mid-run) or
    ``stopped``; anything but complete has ``"partial": true`` and per-method results of the steps
    done so far (``steps_done``; a method with no finished step is left out of ``methods``)."""
    done = {m: 0 for m in config.get("methods", ())}
    done.update({m: int(v["steps"]) for m, v in methods.items()})
    return {"config": config, "methods": methods, "ratios": _ratios(methods), "partial": status != "complete",
            "status": status, "stopped_by": stopped_by, "steps_done": done}


def _write_json(path: str, doc: dict) -> None:
    """Write ``doc`` atomically (a reader, or a kill mid-write, never sees half a file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, default=float)
    os.replace(tmp, path)


def _read_json(path: str | None) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError, TypeError):
        return None


class TrainBenchStopped(RuntimeError):
    """``bench train`` ended before its last step: a signal (SIGINT, SIGTERM), its liveness timeout
    (no rank made progress for ``timeout_s``), ``max_wall_s``, or a failed rank. ``result`` is the
    partial result (``"partial": true``, per-method results of the steps done; None when the data
    was not even prepared) and ``exit_code`` the exit status the command returns (128 + signal
    number for a signal, else 1)."""

    def __init__(self, message: str, result: dict | None = None, exit_code: int = 1):
        super().__init__(message)
        self.result, self.exit_code = result, exit_code


class _Stop(BaseException):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals():
    """SIGINT/SIGTERM raise `_Stop` (once; a second signal while stopping is ignored). Only in the
    main thread, and not for a signal this process ignores (a background job's SIGINT)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = []

    def handler(signum, frame):
        if not fired:
            fired.append(signum)
            raise _Stop(signum)

    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            old[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _result_config(cfg: TrainBenchConfig, index_s: float, parameters: int) -> dict:
    config = {k: v for k, v in cfg.to_payload().items() if k not in ("index", "model_sizes", "timeout_s", "max_wall_s")}
    config.update(data=list(cfg.data), methods=list(cfg.methods), model_sizes=cfg.resolved_sizes(),
                  parameters=parameters,
                  backend=cfg.backend or "auto (gloo on CPU, nccl on GPU)", index_build_s=index_s,
                  timing="tokens_per_s = real tokens of the timed steps / sum over those steps of the slowest "
                         "rank's PipelineRunner.step wall time (warm-up steps excluded); tokens_per_s_e2e adds "
                         "the time waiting for the DataLoader",
                  mape_basis="per micro-batch: planned forward+backward seconds on one stage vs measured on the "
                             "slowest stage; mape_start = steps before the first refit, mape_end = last "
                             "max(3, steps//4) steps, predictions made before the step ran")
    if cfg.model == "vlm-tiny":
        from .train_vlm import data_description

        config.update(records=data_description(cfg.data),
                      stage_mape_basis="per micro-batch and stage: cost.stage_times (planned before the step's refit) "
                                       "vs that stage's measured forward+backward seconds; start/end windows as MAPE; "
                                       "stage_mape_* pools every micro-batch, stage_compute_mape_* the micro-batches "
                                       "the stage runs layers on, stage_passthrough_mape_* those it passes through "
                                       "(the vision stage on text-only micro-batches: sub-millisecond dispatch of "
                                       "skipped layers and index bookkeeping, slower after a vision micro-batch left "
                                       "the CPU caches cold; their shares of the stage's micro-batches and seconds in "
                                       "stage_passthrough_share/_time_share); *_floor: MAPE of predicting each "
                                       "repeated identical micro-batch by its median measured time (timing noise); "
                                       "stage_step_mape_*: each step's planned vs measured sum over its micro-batches "
                                       "per stage (the stage's busy seconds the pipeline simulation adds up); a "
                                       "stage's measured 0 s is a micro-batch it bypassed (--bypass-idle-stages: "
                                       "no op there), left out of every figure and counted in stage_bypassed_share")
    return config


def _pct(x: float) -> str:
    """``x`` as a percentage, ``-`` when undefined (no shape repeated often enough to measure noise)."""
    return "-" if x != x else f"{x:.1%}"


def _stages(v) -> str:
    return "/".join(_pct(x) for x in v) if v else "-"


def _stage_lines(name: str, m: dict) -> list[str]:
    """The per-stage MAPE of one vlm method, split: the micro-batches each stage computes on and
    those it passes through (with their shares of the stage's micro-batches and seconds), start ->
    end and the noise floor of each."""
    if "stage_compute_mape_end" not in m:
        return []
    parts = []
    for s in range(len(m["stage_compute_mape_end"])):
        text = (f"s{s} computing {_pct(m['stage_compute_mape_start'][s])} -> {_pct(m['stage_compute_mape_end'][s])}"
                f" (floor {_pct(m['stage_compute_mape_floor'][s])})")
        skipped = (m.get("stage_bypassed_share") or [0.0] * (s + 1))[s]
        if skipped > 0:
            text += f", bypassed ({skipped:.0%} of its micro-batches: no op)"
        share = m["stage_passthrough_share"][s]
        if share > 0:
            text += (f", pass-through ({share:.0%} of its micro-batches, {_pct(m['stage_passthrough_time_share'][s])}"
                     f" of its seconds) {_pct(m['stage_passthrough_mape_start'][s])} -> "
                     f"{_pct(m['stage_passthrough_mape_end'][s])} (floor {_pct(m['stage_passthrough_mape_floor'][s])})")
        parts.append(text)
    if m.get("stage_step_mape_end"):
        parts.append(f"per-step sums {_stages(m['stage_step_mape_start'])} -> {_stages(m['stage_step_mape_end'])}")
    return [f"  {name:<13}" + "; ".join(parts)]


def format_table(result: dict) -> str:
    """The human-readable table of a `run_train_bench` result."""
    cfg = result["config"]
    o = cfg["options"]
    staged = any("stage_mape_start" in m for m in result["methods"].values())
    lines = [] if not result.get("partial") else [
        f"PARTIAL RESULT ({result.get('stopped_by') or result.get('status')}): steps done "
        + ", ".join(f"{m} {n}" for m, n in result.get("steps_done", {}).items()) + f" of {cfg['steps']}", ""]
    lines += [f"bench train: {cfg['model']} ({cfg['parameters'] / 1e6:.2f}M parameters), {o['num_stages']} stages "
             f"({cfg['partition']} split), {cfg['steps']} steps ({cfg['warmup']} warm-up excluded), global batch "
             f"{o['global_batch_tokens']} tokens, max_len {o['max_len']}"
             + (f"/{o['max_target_len']}" if cfg["model"] == "t5-tiny" else "") + f", {o['schedule']}",
             f"data: {' '.join(os.path.basename(d) for d in cfg['data'])}",
             "",
             f"{'method':<13}{'tok/s':>9}{'e2e tok/s':>11}{'vs pack':>9}{'mbs/step':>10}{'loss start->end':>18}"
             f"{'MAPE start':>12}{'MAPE end':>10}{'noise':>8}{'step MAPE':>17}  stage bounds"
             + ("  per-stage MAPE start -> end  refit" if staged else "")]
    pack = result["methods"].get("pack", {}).get("tokens_per_s")
    for name, m in result["methods"].items():
        vs = f"{m['tokens_per_s'] / pack:.2f}x" if pack else "-"
        lines.append(f"{name:<13}{m['tokens_per_s']:>9.0f}{m['tokens_per_s_e2e']:>11.0f}{vs:>9}"
                     f"{m['microbatches_per_step']:>10.1f}{m['loss_start']:>9.3f}->{m['loss_end']:<7.3f}"
                     f"{m['mape_start']:>12.1%}{m['mape_end']:>10.1%}{_pct(m['mape_noise']):>8}"
                     f"{m.get('mape_start_step', float('nan')):>9.1%}->{m.get('mape_end_step', float('nan')):<6.1%}"
                     f"  {m.get('bounds', '-')}"
                     + (f"  {_stages(m.get('stage_mape_start'))} -> {_stages(m.get('stage_mape_end'))}"
                        f"  {m.get('feedback_mode') or '-'}" if staged else ""))
    split = [x for name, m in result["methods"].items() for x in _stage_lines(name, m)]
    if split:
        lines += ["", "per-stage MAPE start -> end, split: micro-batches the stage runs layers on | those it passes "
                      "through (vision stage, text-only micro-batch); floor = timing noise of identical micro-batches; "
                      "per-step sums = each stage's busy seconds per step"]
        lines += split
    r = result.get("ratios", {})
    if r:
        lines.append("")
        lines.append("dp vs " + "; ".join(f"{m}: {r['dp_vs_' + m.replace('-', '_')]:.2f}x"
                                          + (f" (per-step {p['median']:.2f}x, IQR {p['p25']:.2f}-{p['p75']:.2f})"
                                             if (p := r.get("paired", {}).get(m)) else "")
                                          for m in result["methods"] if m != "dp" and f"dp_vs_{m.replace('-', '_')}" in r)
                     + "; best other: " + (f"{r['dp_vs_best_baseline']:.2f}x" if "dp_vs_best_baseline" in r else "-"))
    if any(m in ("dp", "dp-blind") for m in result["methods"]):
        lines.append("dp: feedback refits its cost model every %d steps; baselines: planner default knobs, no refit "
                     "(their MAPE is the analytic prior's)" % cfg["refit_every"])
    else:  # recompute / flush-free variants of dp all plan with the same cost model
        lines.append("no method refits its cost model (their MAPE is the analytic prior's)")
    return "\n".join(lines)


def add_bench_train_command(bench_sub) -> None:
    """Register ``dynabatch bench train`` on the ``bench`` subparsers."""
    import argparse

    from ..option_flags import parse_bytes
    from ..core.options import SCHEDULES
    from .train import HF_MODEL, MODEL_SIZES, TRAIN_METHODS

    p = bench_sub.add_parser(
        "train", help="real training tokens/s of a pipelined tiny model: dp + feedback vs pack/pad/token_budget",
        description="Train the same tiny model on the same global batches with each method, over local "
                    "pipeline stages, and report real tokens/s and the cost model's MAPE.",
        epilog=BENCH_TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=(*MODEL_SIZES, HF_MODEL), default="t5-tiny",
                   help="vlm-tiny: ViT -> projector -> GPT on image+text and text-only records (methods dp, "
                        "dp-blind, pack, token_budget by default); hf-llama: a tiny transformers Llama (random "
                        "weights) through from_hf, costed by a profile on this machine, dp refit per stage")
    p.add_argument("--cost-model", metavar="PATH",
                   help="hf-llama: start every method from this cost model (`dynabatch profile --model "
                        "hf:CONFIG.json --stages N --out PATH`) instead of profiling the model first")
    p.add_argument("--data", nargs="+", metavar="PATH",
                   help="JSONL files with inputs/targets; default the shared FLAN sample when present, else "
                        "generated FLAN-like data (vlm-tiny: image+text records; default the shared COCO/LLaVA "
                        "captions and instructions mixed with FLAN text, else generated ones)")
    p.add_argument("--text-fraction", type=float, default=0.5,
                   help="vlm-tiny: share of text-only (FLAN) records in the default data (default 0.5)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from timing (default 3)")
    p.add_argument("--methods", nargs="+", default=None,
                   help=f"default {' '.join(TRAIN_METHODS)} (vlm-tiny: dp dp-blind pack token_budget)")
    p.add_argument("--global-batch-tokens", type=int, default=32768,
                   help="tokens (inputs + targets) per global batch (default 32768)")
    p.add_argument("--max-len", type=int, default=2048,
                   help="truncate inputs to this many tokens (default 2048: with byte tokens, FLAN inputs run "
                        "to ~1.9k at the 95th percentile and half exceed 512, so a shorter cap would clip the "
                        "very length spread the methods differ on)")
    p.add_argument("--max-target-len", type=int, default=512, help="truncate targets (default 512)")
    p.add_argument("--device-preset", default="cpu", help="analytic cost model preset to start from (default cpu)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                   help="pipeline schedule planned, simulated and run (adaptive: memory-bounded order; auto: per "
                        "step the fastest that fits memory)")
    p.add_argument("--memory-limit", type=parse_bytes, default=None, metavar="BYTES",
                   help="activation bytes one micro-batch may use on one stage (17e9, 16GiB, 800MB; default: the "
                        "cost model's)")
    p.add_argument("--device-memory-limit", nargs="+", default=None, metavar="LEVEL",
                   help="compare recomputation instead of methods: at each level (bytes of activations a device "
                        "may hold, e.g. 12MB, or a fraction of dp's predicted peak without recomputation, e.g. "
                        "0.6x) train dp+none, dp+full and dp+adaptive (the planner's per-stage choice) "
                        "interleaved; text models, uniform stages")
    p.add_argument("--flush-free", action="store_true",
                   help="compare dp/sync (a flush per global batch) with flush-free asynchronous 1F1B streams of "
                        "--flush-window steps: dp/stale (stale weights), dp/stash (the forward's weights stashed "
                        "for the backward) and dp/predict (AdamW's update predicted, PipeOptim); no refits")
    p.add_argument("--flush-window", type=int, default=10, metavar="N",
                   help="steps one flush-free stream runs between flushes (default 10)")
    p.add_argument("--partition", choices=("searched", "uniform", "modality"), default=None,
                   help="stage split: searched per method (profile the layers on the method's first global "
                        "batch, simulate every split, keep the fastest; the text models' default) or uniform "
                        "block counts; vlm-tiny: modality (vision on stage 0, language after; its default) or uniform")
    p.add_argument("--bypass-idle-stages", action=argparse.BooleanOptionalAction, default=None,
                   help="every method's runner skips the stages holding only a micro-batch's idle layers "
                        "(RunnerConfig(bypass_idle_stages=True): text-only micro-batches never visit the vision "
                        "stage; per-stage MAPE then covers the micro-batches each stage ran). Default: on for "
                        "vlm-tiny (off with --flush-free), no effect on the text models")
    p.add_argument("--refit-every", type=int, default=2)
    p.add_argument("--save-cost-model", metavar="PATH",
                   help="write dp's refit cost model as JSON; dynabatch.CostModel.load(PATH) reads it back, "
                        "e.g. for DataLoader(costing=Costing(cost_model=...)) to start the next run from the measured costs")
    p.add_argument("--seed", type=int, default=0)
    add_size_arguments(p, "model width (default 256; vlm-tiny 128)")
    p.add_argument("--generated-samples", type=int, default=2000,
                   help="generated samples when no data is found (vlm-tiny: records in its default mix)")
    p.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                   help="liveness timeout: stop when no rank made progress (a step) for this long (default 900); "
                        "a slow or loaded machine only makes the run slower")
    p.add_argument("--max-wall", type=float, default=None, metavar="SECONDS",
                   help="optional cap on the whole run's wall time (default none)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--out", metavar="PATH",
                   help="also write the JSON document here, updated as the steps go (at most once a second; marked "
                        "\"partial\": true until the run completes); a run stopped early (SIGINT/SIGTERM, a "
                        "timeout) leaves its partial result here and on stdout")
    p.add_argument("--verbose", action="store_true", help="per-step lines on stderr")
    add_progress_option(p, "a bar of the steps trained (each: every method's)")
    p.set_defaults(func=_cmd_bench_train)


def add_size_arguments(p, hidden_help: str) -> None:
    """``--hidden`` and ``--size NAME=INT`` (the model's sizes) of a bench command (`sizes_from_args`)."""
    p.add_argument("--hidden", type=int, default=None, help=hidden_help)
    p.add_argument("--size", action="append", default=[], metavar="NAME=INT",
                   help="override one of the model's sizes (its constructor's keyword; repeatable), e.g. "
                        "--size layers=6, or for vlm-tiny --size vision_hidden=128 --size vision_layers=8 "
                        "(a heavier vision stage)")


def sizes_from_args(args) -> dict:
    """The model size overrides of ``--hidden`` and ``--size`` (`add_size_arguments`; ValueError on a bad one)."""
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


def _cmd_bench_train(args) -> int:
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
        from .train_recompute import format_recompute_table, run_recompute_bench

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


BENCH_TRAIN_EPILOG = """\
columns:
  tok/s        real (unpadded) tokens / wall seconds of the pipelined training steps (slowest rank),
               warm-up steps excluded
  e2e tok/s    the same, counting the time the loop waited for the DataLoader
  vs pack      tok/s over pack's
  MAPE         per micro-batch: planned vs measured forward+backward seconds on the slowest stage;
               start = before the first refit, end = the last max(3, steps/4) steps (predictions made
               before each step ran: out of sample); noise = median relative spread of identical
               shapes in the run (about the floor a per-micro-batch MAPE can reach on this machine)
  step MAPE    the same on each step's sum over its micro-batches (start -> end): what the step
               time the planner balances sees, with the per-micro-batch timer noise averaged out
  per-stage MAPE  (vlm-tiny, hf-llama) each stage's planned vs measured seconds per micro-batch, stage 0/1/...,
               pooled over every micro-batch; refit: dp's feedback (per_stage: one coefficient row per
               stage; max: the slowest stage). The lines below the table split it: the micro-batches a
               stage runs layers on, and those it passes through (the vision stage on a text-only
               micro-batch runs no layer: its time is sub-millisecond dispatch, a few % of the
               stage's seconds), each with its noise floor (MAPE of predicting identical
               micro-batches by their median time), and the per-step sums: each stage's planned
               vs measured busy seconds per step. With --bypass-idle-stages the vision stage
               never runs text-only micro-batches: "bypassed", no observation
  dp vs X      tok/s ratio; per-step: median and IQR of the paired per-step time ratios (same global
               batches, interleaved): the timer and load noise of the comparison

examples:
  dynabatch bench train --model t5-tiny --stages 2 --steps 20
  dynabatch bench train --model gpt-tiny --steps 20 --data ../shared/data/text/niv2_sample.jsonl.gz --json
  dynabatch bench train --model vlm-tiny --stages 2 --steps 40 --global-batch-tokens 16384
  dynabatch bench train --model hf-llama --steps 30 --global-batch-tokens 16384 --max-len 1024
"""
