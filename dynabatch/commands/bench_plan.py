"""``dynabatch bench plan``: its parser and its command (the work: `dynabatch.bench.plan`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..core.cost.presets import DEVICE_PRESETS, MODEL_PRESETS
from ..core.options import METHODS
from ..option_flags import PLAN_OPTIONS_HELP, add_plan_options, plan_options_from_args
from ..progress import add_progress_option, show_progress
from . import add_subcommand

BENCH_PLAN_EPILOG = """\
columns:
  iter ms        simulated 1F1B iteration time of the slowest rank (mean over global batches)
  iter/LB        iter ms over a lower bound of the iteration time for any plan of the same batches
                 (dynabatch.core.plan.bounds.iteration_lower_bound)
  pad eff        real tokens / computed tokens (1.0 = no padding)
  vs pack        pack's iteration time / this method's
  obj/LB         the plan's objective (sum of micro-batch times + (stages-1) x largest, slowest
                 rank) over a lower bound of that objective (objective_lower_bound; it bounds the
                 objective, not the iteration time): the padded bound for padded methods, the
                 varlen bound (valid for any plan) otherwise; the bound column says which
  max/mean rank  slowest rank's simulated time over the mean rank's
  plan ms        median wall time of planning one global batch (after numba compilation)
  tuned knob     baselines are swept over their knob; the best setting that fits in memory is shown

data (--data, files or directories):
  text JSONL/Parquet with inputs/targets (or input/output, instruction/response, source/target):
      token counts are estimated as ceil(UTF-8 bytes / 4), +1 EOS on targets;
  shape records with input_tokens/target_tokens/vision_tokens columns (e.g. `dynabatch scan` output);
  vision-language length records {vit_num, token_num} (OmniBal's files: 448-px tiles, LLM tokens
      including 256 per tile).

examples:
  dynabatch datagen --out data --text 20000 && dynabatch bench plan --model gpt --data data/text
  dynabatch bench plan --synthetic --num-ranks 4 --num-stages 2 --json > result.json
  dynabatch bench plan --synthetic --global-batch-size 256 --memory-limit 8GiB --schedule gpipe
  optional, on the project's machines (real data in shared/data/ beside the clone):
  dynabatch bench plan --model vlm --data ../shared/data/vlm_shapes --plot vlm.png
"""


def add_bench_plan_command(sub) -> None:
    """Register ``dynabatch bench plan`` on the ``bench`` subparsers."""
    p = add_subcommand(sub, "plan", "compare planning methods on the same global batches",
                       "Plan the same random global batches with dynabatch's DP and every baseline, simulate the "
                       "pipeline, and print one row per method.", BENCH_PLAN_EPILOG + "\n" + PLAN_OPTIONS_HELP)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", nargs="+", metavar="PATH", help="files or directories of samples (see below)")
    src.add_argument("--synthetic", action="store_true", help="use the project's generator (default)")
    p.add_argument("--samples", type=int, default=40000, help="synthetic samples to generate (default 40000)")
    p.add_argument("--model", choices=MODEL_PRESETS, default="gpt", help="model preset (default gpt)")
    p.add_argument("--device", choices=sorted(DEVICE_PRESETS), default="a100-80gb",
                   help="device preset planned for (default a100-80gb, whatever this machine has: offline "
                        "planning plans for the cluster; the DataLoader's default is this machine's)")
    p.add_argument("--batches", type=int, default=64, help="global batches to plan, 0 = all (default 64)")
    p.add_argument("--layout", choices=("uniform", "contiguous"), default="uniform",
                   help="where the layers sit: uniform (every stage a slice of every layer kind, the default) "
                        "or contiguous (vision first; stage-aware planning, plus the dp methods planned "
                        "stage-blind and priced under the contiguous costs)")
    p.add_argument("--mix-text", nargs="+", metavar="PATH",
                   help="add text-only samples drawn from these files (e.g. text_mix_small.jsonl)")
    p.add_argument("--mix-fraction", type=float, default=0.5,
                   help="share of the samples --mix-text makes up (default 0.5)")
    add_plan_options(p, methods=False)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                   help="methods to compare (default: all); each baseline's knob is swept, so there is no "
                        "--method/--method-option here")
    p.add_argument("--reference", action="store_true",
                   help="also time the pure-Python DP reference on the first batch (slow)")
    p.add_argument("--flush-free", nargs="*", type=int, metavar="S", default=None,
                   help="also simulate the dp plans flush-free (asynchronous 1F1B across steps, PipeOptim) at these "
                        "pipeline depths (default 4 8): flushed vs flush-free step time, the fill/drain share removed")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="write bars per method and a per-rank timeline")
    add_progress_option(p, "the configurations planned (methods x knob values)")
    p.set_defaults(func=bench_plan_command)


def bench_plan_command(args) -> int:
    """Run ``dynabatch bench plan`` with its parsed arguments (1 with a one-line error on bad options)."""
    from ..bench.plan import PlanBenchConfig, format_table, plot, run_plan_bench
    from ..core.cost.model import CostModel
    from ..shape_sources import bench_shapes, read_shapes

    try:
        options = plan_options_from_args(args, max_len=8192 if args.model == "vlm" else 2048, max_target_len=512)
    except ValueError as e:
        print(f"dynabatch: error: {e}", file=sys.stderr)
        return 1
    shapes, data = bench_shapes(args.data, args.model, args.samples, args.seed)
    if args.mix_text:
        from ..bench.plan import mix_text

        shapes = mix_text(shapes, read_shapes(args.mix_text)[0], args.mix_fraction, seed=args.seed)
        data += f" + {args.mix_fraction:.0%} text from " + " ".join(Path(d).name for d in args.mix_text)
    cfg = PlanBenchConfig(options, model=args.model, device=args.device, num_batches=args.batches, data=data,
                          layout=args.layout)
    cost = CostModel.preset(args.model, args.device, num_stages=options.num_stages, layout=args.layout)
    result, plans = run_plan_bench(shapes, cost, cfg, args.methods, progress=show_progress(args),
                                   reference=args.reference)
    if args.plot:
        plot(result, plans, args.plot)
    if args.flush_free is not None:
        from ..bench.flushfree import format_flushfree, run_flushfree_bench

        result["flush_free"] = run_flushfree_bench(
            shapes, label=data, model=args.model, device=args.device, stages=tuple(args.flush_free or (4, 8)),
            num_ranks=options.num_ranks, global_batch_tokens=options.global_batch_tokens or 65536,
            max_len=options.max_len, max_target_len=options.max_target_len or 512, num_batches=args.batches or None)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(format_table(result))
        if "reference" in result:
            r = result["reference"]
            print(f"DP on one batch of {r['samples']} samples: numba {r['dp_kernel_ms']:.2f} ms, "
                  f"pure-Python reference {r['dp_reference_ms']:.0f} ms, same partition: {r['same_partition']}")
        if args.plot:
            print(f"plot written to {args.plot}")
        if "flush_free" in result:
            print("\n" + format_flushfree(result["flush_free"]))
    return 0
