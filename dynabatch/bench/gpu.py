"""``dynabatch bench gpu``: one command that measures what only a GPU can show, in about 8 minutes on
one H100/H200 (``--quick``: about 3), and runs a tiny version of every section on a machine without
CUDA so that the code path stays tested.

Sections, in order (each in its own module):

* ``environment`` (`dynabatch.bench.gpu_env`): GPU, memory, versions, which attention kernels work;
* ``cost_model`` (`dynabatch.bench.gpu_cost`): the device preset's predictions against the profiled
  Llama-style model on FLAN-like micro-batches; the profiled cost model saved as ``cost_model.json``;
* ``training`` (`dynabatch.bench.gpu_train`): dp, dp_varlen, pack, token_budget and pad training the
  model through `dynabatch.pipeline.models.hf` on one stage, interleaved on the same global batches;
* ``recompute`` (`dynabatch.bench.gpu_train`): adaptive recomputation under a device memory limit
  against full recomputation;
* ``multimodel`` (`dynabatch.bench.gpu_multi`): two models on one GPU under a budget that forces
  spilling to pinned host memory, bit-identity with training each alone.

A section that cannot run says ``skipped: <reason>`` (``skipped: no CUDA`` for the GPU-only rows on
a CPU run); one that raises says ``failed: <reason>`` with its traceback, and the later sections
still run. Nothing is estimated in place of a measurement. Seconds, tokens, bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback

from .gpu_setup import SKIP_NO_CUDA

SECTIONS = ("environment", "cost_model", "training", "recompute", "multimodel")
#: wall-clock budgets of the GPU forms (seconds): reported beside the run's own wall time
WALL_BUDGET_S = {"full": 480.0, "quick": 180.0}


def _failed(e: BaseException) -> dict:
    first = (str(e).strip().splitlines() or [""])[0]
    return {"status": f"failed: {type(e).__name__}: {first}"[:300], "traceback": traceback.format_exc()[-4000:]}


def _guard(sections: dict, name: str, fn):
    """Run one section into ``sections[name]``; a failure is recorded, not raised. Returns its result."""
    try:
        out = fn()
        sections[name] = {"status": "ok", **out}
        return out
    except Exception as e:  # the other sections must still run: device time is scarce
        sections[name] = _failed(e)
        return None


def _config_record(cfg, factory) -> dict:
    return {"device": cfg.device, "quick": cfg.quick, "llama": cfg.llama, "parameters": factory.parameters,
            "dtype": str(factory.dtype).replace("torch.", ""), "attn_implementation": factory.attn_implementation,
            "global_batch_tokens": cfg.global_batch_tokens, "max_len": cfg.max_len, "steps": cfg.steps,
            "warmup": cfg.warmup, "seed": cfg.seed}


def run_gpu_bench(*, quick: bool = False, out_dir: str | None = None, device: str | None = None,
                  progress: bool = False, data: tuple = (), attn_implementation: str = "sdpa") -> dict:
    """Run every section (module docstring) on ``device`` (default: ``cuda:0`` when CUDA is available,
    else ``cpu``); returns the JSON-able result, also written to ``out_dir/result.json`` (with the
    profiled ``cost_model.json`` beside it) when ``out_dir`` is given."""
    # cuBLAS's deterministic workspace must be set before its first use (the bit-identity check)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    from ..progress import progress_bar

    from .gpu_env import environment_section
    from .gpu_setup import bench_config

    device = device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    cfg = bench_config(device, quick=quick, data=tuple(data), attn_implementation=attn_implementation)
    t_start = time.perf_counter()
    sections: dict = {}
    result = {"form": ("quick" if quick else "full") + ("" if cfg.cuda else " (cpu: code path only)"),
              "sections": sections}
    ticks = 2 + cfg.steps * 5 + cfg.recompute_steps * 2 + cfg.multimodel_steps
    bar = progress_bar(ticks, "bench gpu", "step", progress)
    threads = torch.get_num_threads()
    if not cfg.cuda:  # the CPU form checks the code path: one thread spares a shared machine oversubscription
        torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            keep = out_dir or tmp
            os.makedirs(keep, exist_ok=True)
            _guard(sections, "environment", lambda: environment_section(device))
            bar.update(1)
            _run_model_sections(cfg, sections, result, keep, tmp, bar.update)
            if out_dir is None and isinstance(sections.get("cost_model"), dict):
                sections["cost_model"]["cost_model_path"] = None  # written to a temporary folder: not kept
    finally:
        torch.set_num_threads(threads)
        bar.close()
    wall = time.perf_counter() - t_start
    budget = WALL_BUDGET_S["quick" if quick else "full"]
    result["wall_s"] = wall
    result["wall_budget_s"] = budget if cfg.cuda else SKIP_NO_CUDA
    result["within_budget"] = bool(wall <= budget) if cfg.cuda else SKIP_NO_CUDA
    if out_dir:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
    return result


def _run_model_sections(cfg, sections: dict, result: dict, keep: str, tmp: str, tick) -> None:
    """The sections that need the model: skipped with the reason when it cannot be built."""
    from .gpu_cost import cost_section
    from .gpu_multi import multimodel_section
    from .gpu_setup import ModelFactory, one_stage, prepare_data
    from .gpu_train import recompute_section, train_section

    try:
        data, index = prepare_data(cfg, tmp)
        factory = ModelFactory(cfg)
    except ImportError as e:  # transformers / accelerate absent: the adapters cannot run
        why = f"skipped: {e} (install the 'hf' extra: transformers, accelerate)"
        sections.update({name: {"status": why} for name in SECTIONS[1:]})
        return
    result["config"] = _config_record(cfg, factory)
    result["config"]["data"] = list(data)
    profiled: dict = {}

    def cost_fn():
        res, profiled["cost"] = cost_section(cfg, factory, data, index, keep)
        return res

    _guard(sections, "cost_model", cost_fn)
    tick(1)
    cost = profiled.get("cost")
    if cost is None:
        for name in SECTIONS[2:]:
            sections[name] = {"status": "skipped: the cost model section failed (the plans need its cost model)"}
        return
    with one_stage(cfg.device) as ctx:
        train = _guard(sections, "training", lambda: train_section(ctx, cfg, factory, data, index, cost, tick=tick))
        peak = train["methods"]["dp"]["planned_activation_bytes"] if train else 0.0
        if peak > 0:
            _guard(sections, "recompute", lambda: recompute_section(ctx, cfg, factory, data, index, cost, peak,
                                                                     tick=tick))
        else:
            sections["recompute"] = {"status": "skipped: the training section gave no planned peak to limit"}
        _release(cfg.device)
        _guard(sections, "multimodel", lambda: multimodel_section(ctx, cfg, factory, data, index, cost, tick=tick))


def _release(device: str) -> None:
    """Return the finished sections' cached blocks to the device (the next one starts from free memory)."""
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _gib(x) -> str:
    """Bytes as GiB (MiB below one GiB); a skipped row's text as it is."""
    if not isinstance(x, (int, float)):
        return str(x)
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.1f} MiB"


def _status(sec: dict | None) -> str | None:
    """None for a section that ran, else its skipped/failed line."""
    if sec is None:
        return "skipped: not run"
    return None if sec.get("status") == "ok" else sec["status"]


def _environment_lines(env: dict) -> list[str]:
    lines = [f"  device {env['device']}  gpu {env['gpu']}  memory {_gib(env.get('gpu_memory_bytes', 'n/a'))}  "
             f"torch {env['torch']}  cuda {env['cuda']}  transformers {env['transformers']}"]
    return lines + [f"  {name:<26} {k['status']}" for name, k in env["attention"].items()]


def _cost_lines(cm: dict) -> list[str]:
    lines = [f"  preset {cm['preset']}: MAPE per micro-batch {cm['mape_preset']:.1%} over {cm['microbatches']} "
             f"FLAN-like micro-batches; profiled model {cm['mape_profiled']:.1%} (saved: {cm['cost_model_path']})",
             f"  {'layer':<12} {'forward s':>10} {'backward s':>11}"]
    return lines + [f"  {r['kind'] + ' ' + str(r['layer']):<12} {r['forward_s']:10.4f} {r['backward_s']:11.4f}"
                    for r in cm["per_layer"]]


def _training_lines(tr: dict) -> list[str]:
    lines = [f"  {'method':<13} {'tokens/s':>10} {'vs pack':>8} {'data wait':>9} {'peak':>11} "
             f"{'activations / planned':>22}"]
    for m, r in tr["methods"].items():
        ratio = r.get("activation_over_planned")
        lines.append(f"  {m:<13} {r['tokens_per_s']:10.0f} {r['ratio_to_pack']:8.2f} {r['data_wait_share']:9.2%} "
                     f"{_gib(r['peak_bytes']):>11} {(f'{ratio:.2f}' if ratio is not None else SKIP_NO_CUDA):>22}")
    return lines


def _recompute_lines(rc: dict) -> list[str]:
    return [f"  activation limit {_gib(rc['activation_limit_bytes'])}: planned {_gib(rc['planned_activation_bytes'])}, "
            f"saved for backward {_gib(rc['measured_saved_bytes'])} (within: {rc['saved_within_limit']})",
            f"  device limit {_gib(rc['device_limit_bytes'])}; "
            f"max_memory_allocated {_gib(rc['max_memory_allocated'])}; "
            f"fits: {rc['fits']}; step time adaptive / full: {rc['step_time_vs_full']:.3f}"]


def _multimodel_lines(mm: dict) -> list[str]:
    hidden = mm["hidden_copy_share"]
    return [f"  {mm['models']} models, budget {_gib(mm['budget_bytes'])} (shard {_gib(mm['shard_bytes'])}): "
            f"{mm['spills']} spills, {mm['loads']} loads, {_gib(mm['moved_bytes'])} moved; pinned: "
            f"{mm['pinned_host_copies']}; copy hidden: {f'{hidden:.1%}' if isinstance(hidden, float) else hidden}",
            f"  bit-identical to each alone: {mm['bit_identical_to_alone']}; step s: "
            + ", ".join(f"{k} {v:.3f}" for k, v in mm["step_s"].items())]


#: each section's lines in the text report (after its "[name] status" header)
_LINES = {"environment": _environment_lines, "cost_model": _cost_lines, "training": _training_lines,
          "recompute": _recompute_lines, "multimodel": _multimodel_lines}


def format_table(result: dict) -> str:
    """The text report of `run_gpu_bench`: one block per section, its skipped/failed line instead where so."""
    lines = [f"dynabatch bench gpu ({result['form']}), {result['wall_s']:.0f} s wall "
             f"(budget {result['wall_budget_s']}, within: {result['within_budget']})"]
    for name in SECTIONS:
        sec = result["sections"].get(name)
        why = _status(sec)
        lines.append(f"\n[{name.replace('_', ' ')}] {why or ''}")
        if why is None:
            lines += _LINES[name](sec)
    return "\n".join(lines)


BENCH_GPU_EPILOG = """\
examples:
  dynabatch bench gpu --quick --out gpu-result          # about 3 minutes on one H100/H200
  dynabatch bench gpu --json > gpu.json                 # the full form, the JSON document only
  dynabatch bench gpu --device cpu --quick              # no GPU: every section's code path, tiny model
  dynabatch bench gpu --attn eager --data ../shared/data/text/niv2_sample.jsonl.gz
"""


def add_bench_gpu_command(sub) -> None:
    """Register ``dynabatch bench gpu`` on the ``bench`` subparsers."""
    from ..progress import add_progress_option

    p = sub.add_parser("gpu", help="what only a GPU can show: kernels, cost model, training, recompute, spilling",
                       description=__doc__, epilog=BENCH_GPU_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the short form (about 3 minutes on one H100)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (no table, no progress)")
    p.add_argument("--out", metavar="DIR", help="write result.json and the profiled cost_model.json here")
    p.add_argument("--device", help="torch device (default: cuda:0 when CUDA is available, else cpu)")
    p.add_argument("--data", nargs="+", default=(), metavar="FILE",
                   help="JSONL text files (default: the shared FLAN sample on a GPU, else generated records)")
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "flex_attention", "eager"),
                   help="the model's Hugging Face attention implementation (default sdpa)")
    add_progress_option(p, "the steps of every section")
    p.set_defaults(func=_cmd_bench_gpu)


def _cmd_bench_gpu(args) -> int:
    from ..progress import show_progress

    result = run_gpu_bench(quick=args.quick, out_dir=args.out, device=args.device, data=tuple(args.data),
                           attn_implementation=args.attn, progress=show_progress(args))
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 1 if failed_sections(result) else 0


def failed_sections(result: dict) -> list[str]:
    """The names of ``result``'s sections whose status says they failed (`run_gpu_bench`'s result)."""
    return [n for n, sec in result["sections"].items() if str(sec.get("status", "")).startswith("failed")]
