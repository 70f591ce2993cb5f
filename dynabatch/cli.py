"""The ``dynabatch`` command line."""

from __future__ import annotations

import argparse
import sys

from .bench.gpu import add_bench_gpu_command
from .commands import add_subcommand
from .commands.bench_load import add_bench_load_command, add_bench_loader_command
from .commands.bench_plan import add_bench_plan_command
from .commands.bench_schedules import add_bench_schedules_command
from .commands.bench_spindle import add_bench_spindle_command
from .commands.bench_train import add_bench_multimodel_command, add_bench_train_command
from .commands.bench_trainer import add_bench_trainer_command
from .commands.check import add_check_command
from .commands.datagen import add_datagen_command
from .commands.profile import add_profile_command
from .offline.commands import add_commands as add_offline_commands
from .offline.inspect_command import add_inspect_command

DESCRIPTION = """\
dynabatch plans micro-batches of variable-length samples so that every micro-batch costs about
the same, spreads them evenly over data-parallel ranks and pipeline stages, and compares the
result with the usual ways of batching (padding, length grouping, token budgets, packing).

Start here (in a fresh clone: datagen writes the data the later commands read):
  dynabatch demo                       generate FLAN-like and image+text shards, plan and stream them
  dynabatch datagen --out data --text 20000 --image-text 500   write generated sample shards to data/
  dynabatch bench plan --model t5 --data data/text             all planning methods on the same global batches
  dynabatch bench load                 samples/s and tokens/s: loaders + scan_shapes vs datasets
  dynabatch plan data/text --tokenizer bytes --num-ranks 8 --num-stages 4 --max-len 2048 --out plan.parquet  plan a whole run
  dynabatch inspect plan.parquet --plot plan.png                                       what it predicts

Optional: the project's own machines also hold real FLANv2/NIv2, LLaVA and OmniBal samples in a
shared/data/ folder beside the clone (not in the repository), e.g.
  dynabatch bench plan --model t5 --data ../shared/data/text/niv2_sample.jsonl.gz
"""

EPILOG = """\
examples of the other commands (every command's --help ends with its own examples):
  dynabatch scan data/text --tokenizer bytes --family encoder_decoder --out index.parquet    a length index
  dynabatch plan index.parquet --model t5 --max-len 2048 --max-target-len 512 --out plan.parquet
  dynabatch profile --model gpt-tiny --device cpu --out costs.json  a cost model measured here
  dynabatch check my-model/ data/train.jsonl --num-stages 2             your model folder and data, before a run
  dynabatch bench schedules                                          every pipeline schedule on the same dp plans
  dynabatch bench spindle --devices 32                              multi-task: per-component allocation vs one pipeline
  dynabatch bench loader --limit 20000 --workers 0                  DataLoader vs torch's + collators
  dynabatch bench train --model t5-tiny --num-stages 2 --steps 20       real pipelined training (~10 min)
  dynabatch bench trainer --models llama --steps 12                 transformers.Trainer on 2 ranks: dp vs HF batching
  dynabatch bench multimodel --k 2 --steps 12                       K models on one data pass
  dynabatch bench gpu --quick                                       on a GPU machine (~3 min)

progress: a long command shows a bar on a terminal, else a line every 10 s and one per stage with
the percent done and the time left; --no-progress shows none, --json prints only the JSON document.
"""

DEMO_EPILOG = """\
what it prints, per part: the plan of one step (step 0) by dynabatch and by its baseline (packing
into fixed-length rows), rank 0's micro-batches, what the DataLoader delivered for them, and a last
line "result: ..." with dynabatch's step time against the baseline's on the same samples.

examples:
  dynabatch demo
  dynabatch demo --out demo-data --seed 1     # keep the generated shards in demo-data/
  dynabatch demo --verbose                    # also the planner's objective against its lower bound
"""

BENCH_EPILOG = """\
examples:
  dynabatch bench plan --synthetic                                  # seconds: planning methods, simulated
  dynabatch bench schedules --num-stages 4 8 --num-ranks 8 32         # a minute: every schedule, simulated
  dynabatch bench spindle                                           # a minute: multi-task allocation vs one pipeline
  dynabatch bench load --sources jsonl --repeat 1                   # a minute: loaders vs datasets
  dynabatch bench loader --limit 20000 --workers 0                  # a minute: DataLoader vs torch's
  dynabatch bench train --model t5-tiny --num-stages 2 --steps 20       # ~10 minutes: real training
  dynabatch bench trainer --models llama --steps 12                 # minutes: Trainer, dp vs HF batching
  dynabatch bench multimodel --k 2 --steps 12                       # minutes: K models on one data pass
  dynabatch bench gpu --quick                                       # on a GPU: ~3 minutes
"""


def _cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(out_dir=args.out, seed=args.seed, verbose=args.verbose)


def _add_demo(sub) -> None:
    p = add_subcommand(sub, "demo", "stream generated FLAN-like and image+text shards through the DataLoader",
                       "Generate FLAN-like text shards (JSONL) and image+text shards (webdataset tars), plan one "
                       "step for GPT and T5 (8 ranks x 4 stages) with dynabatch and with packing, stream it through "
                       "dynabatch.DataLoader and check the delivered micro-batches equal the plan; then do the same "
                       "for a vision-language model on the image+text shards.", DEMO_EPILOG)
    p.add_argument("--out", default=None, help="keep the generated shards in this folder (default: a temp folder)")
    p.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    p.add_argument("--verbose", action="store_true",
                   help="also print the planner's objective against its lower bound (how close the search came "
                        "to the best plan by its own measure)")
    p.set_defaults(func=_cmd_demo)


def _add_bench(sub) -> None:
    bench = add_subcommand(sub, "bench", "benchmarks that print a table and ratios against baselines",
                           "Benchmarks. Each runs dynabatch and its baselines in the same process and reports "
                           "ratios, not just seconds.", BENCH_EPILOG)
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH")
    add_bench_plan_command(bench_sub)
    add_bench_schedules_command(bench_sub)
    add_bench_spindle_command(bench_sub)
    add_bench_load_command(bench_sub)
    add_bench_loader_command(bench_sub)
    add_bench_train_command(bench_sub)
    add_bench_trainer_command(bench_sub)
    add_bench_multimodel_command(bench_sub)
    add_bench_gpu_command(bench_sub)
    bench.set_defaults(func=lambda a: (bench.print_help(), 2)[1])


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``dynabatch`` command (builds without numpy, numba or torch:
    `dynabatch.commands`)."""
    parser = argparse.ArgumentParser(prog="dynabatch", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from . import __version__

    parser.add_argument("--version", action="version", version=f"dynabatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(sub)
    add_datagen_command(sub)
    _add_bench(sub)
    add_offline_commands(sub)  # scan, plan
    add_inspect_command(sub)
    add_profile_command(sub)
    add_check_command(sub)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``dynabatch`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from .core.plan.planner import PlanningError
    from .shape_sources import ShapeSourceError

    try:
        return int(args.func(args) or 0)
    except (ShapeSourceError, PlanningError) as e:
        print(f"dynabatch: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
