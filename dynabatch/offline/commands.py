"""The ``dynabatch scan`` and ``dynabatch plan`` subcommands (``dynabatch inspect``: `inspect_command`).

`add_commands(subparsers)` registers the three on the ``dynabatch`` parser (`dynabatch.cli`); building
their parsers imports nothing heavy, each handler imports its work. Each handler prints a one-line
``dynabatch: error: ...`` and returns 1 on bad input.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..devices import OFFLINE_DEFAULT_DEVICE
from ..progress import add_progress_option, show_progress
from .guard import guarded

TOKENIZER_HELP = ("tokenizer that counts tokens: 'bytes' (default: built-in, one token per UTF-8 byte, an "
                  "OVER-estimate of subword counts, ~4x for English), a local tokenizer.json, a sentencepiece "
                  ".model, a local transformers folder, or a tiktoken encoding name (cl100k_base, "
                  "tiktoken:o200k_base; must already be in the tiktoken cache). Nothing is downloaded.")

DATA_HELP = """\
data (DATA, files, globs or folders): JSONL(.gz/.zst), JSON arrays, Parquet, Arrow, webdataset .tar
shards or a datasets save_to_disk folder, read by the `loaders` package: FLAN inputs/targets,
instruction/response, prompt/completion, conversations (LLaVA), image+text (see docs/loaders.md).
"""

SCAN_EPILOG = DATA_HELP + """
the index (--out, Parquet), one row per sample, sorted by sample_id:
  sample_id      (file index << 32) | line/row: the loaders' stable id of the sample
  input_tokens   input (encoder-decoder) or prompt (decoder-only) tokens
  target_tokens  target / response tokens, EOS included
  vision_tokens  image tokens summed over the sample's images (--vision), 0 for text; they count
                 towards --max-len (with --image-token-id as placeholder runs in the ids, whose
                 <image> markers are then not counted as text)
  task_id        index into the sorted task names stored in the metadata, -1 = unknown
metadata: dynabatch.task_names, dynabatch.scan_stats (samples, skipped, truncated),
dynabatch.scan (paths, tokenizer, options, loader error counts), dynabatch.dataset_fingerprint.
The bytes do not depend on --workers or --engine (rows and task names are sorted).

parallelism: the rows are split into 2 x --workers parts with the loaders' rank/world_size layout
and each part is tokenized in its own process (--engine local) or Ray task (--engine ray,
pip install 'dynabatch[ray]'; uses $RAY_ADDRESS or starts a local Ray of --workers CPUs).

examples:
  dynabatch scan ../shared/data/text/niv2_sample.jsonl.gz --tokenizer bytes --out niv2.index.parquet
  dynabatch scan data/*.jsonl --tokenizer tokenizer.json --family encoder_decoder --max-len 2048 \\
      --max-target-len 512 --on-error skip --workers 8 --json --out index.parquet
  dynabatch scan llava.jsonl --vision tiling --out vlm.index.parquet
"""

PLAN_EPILOG = """\
input: DATA (a raw dataset, see `dynabatch scan --help`) is scanned first with --tokenizer;
INDEX is a `dynabatch scan` output or any file with input_tokens[/target_tokens/vision_tokens]
columns (or OmniBal's vit_num/token_num records). The kind is detected from the records.

global batches and steps: epoch e shuffles the samples with seed (--seed + e) and cuts them each
time a batch reaches --global-batch-tokens tokens (after truncation to --max-len/--max-target-len)
or --global-batch-size samples; the last, smaller batch of an epoch is kept unless --drop-last (as
the DataLoader keeps it). Steps are numbered from 0 across epochs. Every global batch is planned
independently (in parallel) with --method and its --method-option knobs, exactly as a
dynabatch.DataLoader given the same options plans it online.

the plan (--out, Parquet), one row per sample placement, grouped by step, rank, micro-batch:
  step           global step, 0-based across epochs
  rank           data-parallel rank that runs the micro-batch
  microbatch     position of the micro-batch in its rank's execution order
  row            row of the sample in the micro-batch (packed_rows: the packed row it shares)
  sample_id      the sample (the index's sample_id)
  rows           rows of the micro-batch (padded), sequences (packed) or packed rows
  input_len      padded main-stack length in tokens (packed: longest sample)
  target_len     padded decoder length in tokens (encoder-decoder; packed: longest sample)
  vision_tiles   image tiles the vision encoder processes
  tokens         tokens computed: rows x (input_len + target_len), or the packed total
  real_tokens    tokens of the micro-batch's samples (no padding)
  target_tokens  decoder tokens of the micro-batch's samples (packed: the decoder row's length)
  time_s         predicted forward+backward seconds of the micro-batch on one stage
  memory_bytes   predicted peak activation bytes of the micro-batch on one stage
  epoch          epoch of the step
  task_id        the sample's task (index into dynabatch.task_names; only when the index has tasks)
  sample_tokens  the sample's own tokens after truncation
metadata: dynabatch.dataset_fingerprint, dynabatch.cost_model (JSON), dynabatch.options (JSON:
every PlanOptions field, collation, epochs, tokenizer, family, and loader_default_differences: the
options taken at this command's defaults where the DataLoader's differ), dynabatch.epochs, dynabatch.seed,
dynabatch.steps_per_epoch, dynabatch.rank_time_s (simulated time of every rank at every step), schema versions.
Read it with dynabatch.offline.load_run_plan(path): .step(k) -> BatchPlan, .check(...).

examples:
  dynabatch plan ../shared/data/text/niv2_sample.jsonl.gz ../shared/data/text/flan_cot_sample.jsonl.gz \\
      --tokenizer bytes --model gpt --num-ranks 8 --num-stages 4 --global-batch-tokens 65536 --epochs 2 --out plan.parquet
  dynabatch plan index.parquet --model t5 --max-len 2048 --max-target-len 512 --collate packed --out plan.parquet
  dynabatch plan index.parquet --method pack --method-option rows=4 --global-batch-size 512 \\
      --memory-limit 16GiB --drop-last --out plan.parquet
  dynabatch plan index.parquet --model costs.json --engine ray --out plan.parquet
  dynabatch inspect plan.parquet --plot plan.png
"""

#: ``dynabatch plan``'s own defaults where the DataLoader's differ (`loader_default_differences`);
#: its device is the one `dynabatch.devices` plans GPU-scale presets for when there is no GPU.
PLAN_MODEL, PLAN_RANKS, PLAN_STAGES, PLAN_GLOBAL_BATCH_TOKENS = "gpt", 8, 4, 65536
PLAN_DEVICE = OFFLINE_DEFAULT_DEVICE


def _data_args(args) -> list[str]:
    paths = list(args.data or []) + list(getattr(args, "data_opt", None) or [])
    if not paths:
        raise ValueError("no data: give files, globs or folders (DATA or --data)")
    return paths


def _add_data(p, metavar: str, what: str) -> None:
    p.add_argument("data", nargs="*", metavar=metavar, help=what)
    p.add_argument("--data", dest="data_opt", nargs="+", metavar="PATH", help="same as the positional paths")


def _add_scan_options(p, for_plan: bool) -> None:
    g = p.add_argument_group("tokenization" + (" (when DATA is a raw dataset)" if for_plan else ""))
    g.add_argument("--tokenizer", default=None, metavar="SPEC", help=TOKENIZER_HELP)
    g.add_argument("--family", choices=("decoder", "encoder_decoder"), default=None,
                   help="how samples are formatted: prompt+response in one sequence (decoder) or "
                        "input -> target (encoder_decoder)" +
                        (" (default: from --model: encoder_decoder for t5)" if for_plan else " (default decoder)"))
    if not for_plan:
        g.add_argument("--max-len", type=int, default=None,
                       help="keep at most this many tokens per sample (decoder: input+target; encoder_decoder: "
                            "input); default: full lengths")
        g.add_argument("--max-target-len", type=int, default=None,
                       help="keep at most this many target tokens (EOS included); default: full lengths")
    g.add_argument("--vision", choices=("fixed", "tiling"), default=None,
                   help="image tokens for image+text data: fixed (one 336-px image = 576 tokens) or tiling "
                        "(InternVL 448-px dynamic tiles, 256 tokens each)" +
                        (" (default: tiling for --model vlm)" if for_plan else ""))
    g.add_argument("--image-token-id", type=int, default=None, metavar="ID",
                   help="count LLaVA-style image placeholders in the ids, as a DataLoader(tokenization=Tokenization(image_token_id=ID)) "
                        "formats them: each image's <image> marker (or, without markers, the text's start) becomes "
                        "a run of ID, one per vision token (needs --vision); default: no placeholders")
    g.add_argument("--chat-template", default=None, metavar="FILE|tokenizer|plain",
                   help="how conversation (messages) records are rendered, as DataLoader(chat_template=...): a "
                        "Jinja chat template file (loss on the assistant turns), 'tokenizer' (the tokenizer's own "
                        "template), 'plain' (User:/Assistant: text); default: the tokenizer's own template, else "
                        "plain with a warning")
    g.add_argument("--on-error", choices=("raise", "skip"), default="raise",
                   help="bad samples: stop with an error naming file and line (raise, default) or skip and "
                        "count them (skip)")


def _chat_template(value: str | None) -> str | None:
    """``--chat-template``: a keyword as is, else the text of the template file."""
    if value is None or value in ("tokenizer", "plain"):
        return value
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--chat-template {value!r}: no such file (give a Jinja template file, 'tokenizer' or "
                         "'plain')")
    return path.read_text(encoding="utf-8")


def _add_engine_options(p) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--workers", type=int, default=None,
                   help="processes (local) or Ray CPUs (default: the CPUs available, but on the local engine at "
                        "most one process per 16384 samples, so a smaller job runs in this process)")
    g.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="local processes (default) or Ray tasks (pip install 'dynabatch[ray]')")
    add_progress_option(g, "the samples scanned and the steps planned")


def add_commands(sub) -> None:
    """Register ``scan`` and ``plan`` on the ``dynabatch`` subparsers (``inspect``: `inspect_command`)."""
    from ..commands import add_subcommand
    from ..core.cost.presets import DEVICE_PRESETS, MODEL_PRESETS
    from ..option_flags import PLAN_OPTIONS_HELP, add_plan_options

    p = add_subcommand(sub, "scan", "tokenize a dataset into a length index (token counts per sample)",
                       "Count the tokens of every sample of a dataset, in parallel, and write the length index that "
                       "`dynabatch plan` reads.", SCAN_EPILOG)
    _add_data(p, "DATA", "dataset files, globs or folders")
    p.add_argument("--out", required=True, metavar="INDEX.parquet", help="where to write the index")
    _add_scan_options(p, for_plan=False)
    _add_engine_options(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of text")
    p.set_defaults(func=guarded(_cmd_scan))

    p = add_subcommand(sub, "plan", "plan a whole run offline: every step, rank and micro-batch, to Parquet",
                       "Plan every step of a training run (global batches -> micro-batches -> ranks, with predicted "
                       "time and memory) and write it as one Parquet file that a DataLoader replays.",
                       PLAN_EPILOG + "\n" + PLAN_OPTIONS_HELP)
    _add_data(p, "DATA|INDEX", "a raw dataset (scanned first) or a length index")
    p.add_argument("--out", required=True, metavar="PLAN.parquet", help="where to write the plan")
    g = p.add_argument_group("cost model")
    g.add_argument("--model", default=None, metavar="PRESET|COSTS.json",
                   help=f"cost model: a preset ({', '.join(MODEL_PRESETS)}; default {PLAN_MODEL}, said in the summary "
                        "when taken; gpt-tiny / t5-tiny for a CPU) or a saved cost model JSON (CostModel.save, e.g. "
                        "from profiling)")
    g.add_argument("--device", choices=sorted(DEVICE_PRESETS), default=None,
                   help="device preset for a --model preset (default a100-80gb, whatever this machine has: an "
                        "offline plan is for the cluster that trains; the DataLoader's device='auto' is not used "
                        "here)")
    g.add_argument("--layout", choices=("uniform", "contiguous"), default="uniform",
                   help="where a --model preset's layers sit: uniform (every stage the same, default) or "
                        "contiguous (whole layers in order, the vision tower on the first stages): the plan then "
                        "holds per-stage predictions that dynabatch inspect draws")
    g = p.add_argument_group("run length")
    g.add_argument("--epochs", type=int, default=1, help="epochs to plan (default 1)")
    add_plan_options(p, ranks=PLAN_RANKS, stages=PLAN_STAGES, global_batch_tokens=PLAN_GLOBAL_BATCH_TOKENS)
    g = p.add_argument_group("collation")
    g.add_argument("--collate", choices=("padded", "packed"), default=None,
                   help="padded rows (dp) or packed varlen sequences (dp_varlen); default: the method's own")
    _add_scan_options(p, for_plan=True)
    p.add_argument("--save-index", metavar="INDEX.parquet", help="also write the scanned index here")
    _add_engine_options(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of text")
    p.set_defaults(func=guarded(_cmd_plan))


# -- handlers --------------------------------------------------------------------------------


def _cmd_scan(args) -> int:
    from .scan import ScanConfig, scan_dataset

    cfg = ScanConfig(tokenizer=args.tokenizer or "bytes", family=args.family or "decoder", max_len=args.max_len,
                     max_target_len=args.max_target_len, vision=args.vision, on_error=args.on_error,
                     image_token_id=args.image_token_id, chat_template=_chat_template(args.chat_template))
    paths = _data_args(args)
    result = scan_dataset(paths, cfg, engine=args.engine, workers=args.workers, progress=show_progress(args))
    if not result.table.num_rows:
        skipped = result.summary()["skipped"]
        raise ValueError(f"{' '.join(paths)} holds no samples" + (f" ({skipped} bad records skipped)" if skipped else "")
                         + f"; nothing written to {args.out}")
    result.write(args.out)
    s = {**result.summary(), "out": str(args.out)}
    if args.json:
        print(json.dumps(s, indent=1))
        return 0
    skipped = ", ".join(f"{k} {v}" for k, v in s["skipped_by_kind"].items()) or "none"
    tps = s["tokens_per_sample"]
    print(f"scanned {s['samples']} samples ({s['tasks']} tasks) with {s['tokenizer']} in {s['seconds']:.1f} s "
          f"({s['engine']}, {s['workers']} worker{'s' * (s['workers'] != 1)}, "
          f"{s['parts']} part{'s' * (s['parts'] != 1)})")
    print(f"tokens: input {s['input_tokens']:,}, target {s['target_tokens']:,}, vision {s['vision_tokens']:,}; "
          f"per sample mean {tps['mean']:.0f}, p50 {tps['p50']:.0f}, p99 {tps['p99']:.0f}, max {tps['max']}")
    print(f"skipped: {skipped}; truncated: {s['truncated']}; fingerprint {s['fingerprint']}")
    print(f"messages rendered with: {s['chat_template']}")
    for key, reason in s["skipped_examples"]:
        print(f"  skipped {key}: {reason}")
    print(f"wrote {args.out}")
    return 0


def _cost_model(args):
    from ..core.cost.model import MODEL_PRESETS, TINY_MODEL_PRESETS, CostModel

    if args.model in MODEL_PRESETS + TINY_MODEL_PRESETS:
        return CostModel.preset(args.model, args.device, num_stages=args.stages, layout=args.layout)
    if args.layout != "uniform":
        raise ValueError("--layout applies to a --model preset; a saved cost model keeps its own layout")
    if not Path(args.model).is_file():
        raise ValueError(f"--model {args.model!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor a cost "
                         "model JSON file")
    return CostModel.load(args.model)


def _method(args) -> str:
    from ..core.plan.baselines import BASELINE_COLLATION

    if args.collate is None:
        return args.method
    if args.method in ("dp", "dp_varlen"):
        return "dp_varlen" if args.collate == "packed" else "dp"
    own = BASELINE_COLLATION[args.method]
    if own.startswith(args.collate):
        return args.method
    raise ValueError(f"--method {args.method} collates {own}, not {args.collate}; drop --collate")


def _check_family(scanned: str | None, stated: str | None, cost, model: str) -> None:
    """Refuse to plan a model on an index scanned for the other family (an encoder-decoder's targets are a
    second sequence; a decoder's are inside its one row), naming both and the fix."""
    want = "encoder_decoder" if cost.kind == "encoder_decoder" else "decoder"
    for what, family in (("--family", stated), ("the index", scanned)):
        if family is not None and family != want:
            raise ValueError(f"{what} says family {family!r} but --model {model} is {want!r}: its samples would be "
                             f"planned with the wrong lengths. Re-scan with --family {want} (dynabatch scan ... "
                             f"--family {want}), or plan with a model of family {family!r}")


def _check_chat_template(value: str, scan_options: dict, tokenizer, family) -> None:
    """Refuse ``--chat-template`` on an index scanned with another conversation rendering."""
    from tokenization import load_tokenizer, resolve_chat

    want = resolve_chat(_chat_template(value), load_tokenizer(tokenizer or "bytes"), family or "decoder").record()
    recorded = scan_options.get("chat_template")
    if recorded != want:
        raise ValueError(f"the index was scanned with messages rendered by {recorded or 'an unrecorded template'}, "
                         f"not {want} (--chat-template {value}); re-scan or drop --chat-template")


def _cmd_plan(args) -> int:
    from ..planfile.inspect import microbatch_columns
    from .inputs import is_index, read_index, tokenizer_spec
    from ..option_flags import plan_options_from_args
    from .runplan import RunPlanConfig, plan_run
    from ..engines import workers_for
    from .scan import ScanConfig, scan_dataset

    quiet = not show_progress(args)
    # the flags left at this command's defaults, said in the summary: a plan's times are its model's
    taken = {flag: value for flag, value, given in (("--model", PLAN_MODEL, args.model),
                                                     ("--device", PLAN_DEVICE, args.device)) if given is None}
    args.model, args.device = args.model or PLAN_MODEL, args.device or PLAN_DEVICE
    cost = _cost_model(args)
    paths = _data_args(args)
    t0 = time.perf_counter()
    scan_s = 0.0
    scanned = not is_index(paths)
    if not scanned:
        index = read_index(paths)
        recorded = index.scan_options.get("tokenizer")
        if args.tokenizer and recorded and tokenizer_spec(args.tokenizer) != recorded:
            raise ValueError(f"the index was scanned with tokenizer {recorded!r}, not {args.tokenizer!r}; "
                             "re-scan or drop --tokenizer")
        tokenizer = recorded or (tokenizer_spec(args.tokenizer) if args.tokenizer else None)
        family = index.scan_options.get("family")
        _check_family(family, args.family, cost, args.model)
        scanned_tid = index.scan_options.get("image_token_id")
        if args.image_token_id is not None and args.image_token_id != scanned_tid:
            raise ValueError(f"the index was scanned with image_token_id {scanned_tid}, not {args.image_token_id}; "
                             "re-scan or drop --image-token-id")
        if args.chat_template is not None:
            _check_chat_template(args.chat_template, index.scan_options, tokenizer, family)
        scan_s = time.perf_counter() - t0
    else:
        family = args.family or ("encoder_decoder" if cost.kind == "encoder_decoder" else "decoder")
        vision = args.vision or ("tiling" if cost.kind == "vision_language" else None)
        scfg = ScanConfig(tokenizer=args.tokenizer or "bytes", family=family, vision=vision, on_error=args.on_error,
                          image_token_id=args.image_token_id, chat_template=_chat_template(args.chat_template))
        result = scan_dataset(paths, scfg, engine=args.engine, workers=args.workers, progress=not quiet)
        if args.save_index:
            result.write(args.save_index)
        index = result.index
        tokenizer = scfg.tokenizer
        scan_s = time.perf_counter() - t0
        if not quiet:
            skipped = result.summary()["skipped"]
            print(f"scanned {len(index.shapes)} samples with {tokenizer} in {scan_s:.1f} s"
                  + (f" ({skipped} skipped)" if skipped else ""), file=sys.stderr)
    options = plan_options_from_args(args, method=_method(args))  # PlanOptions' defaults: the DataLoader's
    differ = loader_default_differences(args)
    cfg = RunPlanConfig(options, epochs=args.epochs, tokenizer=tokenizer, family=family, loader_differences=differ)
    t1 = time.perf_counter()
    run = plan_run(index, cost, cfg, engine=args.engine, workers=args.workers, progress=not quiet)
    plan_s = time.perf_counter() - t1
    run.write(args.out)
    it = run.iteration_times_s()
    mb = microbatch_columns(run)
    real, computed = int(mb["real_tokens"].sum()), int(mb["tokens"].sum())
    rt = run.rank_times_s()
    summary = {
        "out": str(args.out), "steps": run.num_steps, "steps_per_epoch": run.steps_per_epoch,
        "samples": len(index.shapes), "placements": run.table.num_rows, "method": run.method,
        "collation": run.collation, "model": cost.model.name, "device": cost.device.name,
        "ranks": run.num_ranks, "stages": run.num_stages, "dataset_fingerprint": run.dataset_fingerprint,
        "iteration_time_s": {"mean": float(it.mean()), "max": float(it.max())},
        "padding_efficiency": real / computed if computed else 1.0,
        "rank_imbalance_mean": float((rt.max(axis=1) / rt.mean(axis=1)).mean()),
        "scanned": scanned, "scan_s": round(scan_s, 3), "plan_s": round(plan_s, 3), "engine": args.engine,
        "workers": workers_for(run.table.num_rows, args.workers, args.engine),
    }
    if differ:
        summary["loader_default_differences"] = differ
    if taken:
        summary["defaults_taken"] = {flag.lstrip("-"): value for flag, value in taken.items()}
    recompute = run.recompute_summary()
    if recompute:
        summary["recompute"] = recompute
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"planned {summary['steps']} steps ({' + '.join(map(str, run.steps_per_epoch))} over {cfg.epochs} "
          f"epoch{'s' if cfg.epochs != 1 else ''}) of {summary['samples']} samples: {run.method} ({run.collation}) "
          f"for {cost.model.name} on {cost.device.name}, {run.num_ranks} ranks x {run.num_stages} stages")
    if taken:
        print(f"cost model: this command's default {' '.join(f'{k} {v}' for k, v in taken.items())} (not given): "
              f"the times below are {cost.model.name}'s on {cost.device.name}; give "
              f"{' and '.join(taken)} to plan for your model and cluster")
    print(f"predicted iteration time mean {it.mean() * 1e3:.1f} ms, max {it.max() * 1e3:.1f} ms; padding efficiency "
          f"{summary['padding_efficiency']:.3f}; max/mean rank {summary['rank_imbalance_mean']:.3f}")
    if differ:
        print("values of this plan that differ from the DataLoader's defaults (give the DataLoader the same ones "
              "for the same plan): " + "; ".join(f"{k}={v}" for k, v in differ.items()))
    if recompute:
        lim = recompute.get("device_memory_limit")
        print(f"recompute {recompute['policy']}: mean layers recomputed per stage "
              f"{' '.join(f'{x:.1f}' for x in recompute['mean_layers_per_stage'])}; largest predicted peak per stage "
              f"{' '.join(f'{x / 2**30:.2f}' for x in recompute['max_peak_bytes_per_stage'])} GiB"
              + (f" (device limit {lim / 2**30:.2f} GiB)" if lim else ""))
    print(f"{'scan' if scanned else 'read index'} {scan_s:.1f} s, plan {plan_s:.1f} s "
          f"({summary['workers']} worker{'s' * (summary['workers'] != 1)}, {args.engine}); wrote "
          f"{args.out} ({run.table.num_rows} placements, fingerprint {run.dataset_fingerprint})")
    print(f"next: dynabatch inspect {args.out} --plot {Path(args.out).with_suffix('.png')}")  # beside it: no clash
    return 0


def loader_default_differences(args) -> dict[str, str]:
    """The options whose value in this plan is ``dynabatch plan``'s own default where the DataLoader's
    default differs (name -> ``"<this command's value> (DataLoader: <its default>)"``), stated or not:
    either way the DataLoader must be given that value to form the same plan. An offline plan is made
    for the training cluster; the loader defaults to this machine and its own world size. Every other
    planning option defaults to `PlanOptions`' value in both."""
    from ..core.options import PlanOptions

    out = {}
    if args.model == PLAN_MODEL:
        out["cost_model"] = f"{PLAN_MODEL!r} (DataLoader: None, i.e. 'gpt' on a GPU, 'gpt-tiny'/'t5-tiny' on a CPU)"
    if args.device == PLAN_DEVICE:
        out["device"] = f"{PLAN_DEVICE!r} (DataLoader: 'auto', this machine's device)"
    if args.ranks == PLAN_RANKS:
        out["num_ranks"] = f"{PLAN_RANKS} (DataLoader: its world size)"
    if args.stages == PLAN_STAGES:
        out["num_stages"] = f"{PLAN_STAGES} (DataLoader: {PlanOptions().num_stages})"
    if args.global_batch_tokens is None and args.global_batch_size is None:
        out["global_batch_tokens"] = f"{PLAN_GLOBAL_BATCH_TOKENS} (DataLoader: none, it must be given)"
    return out
