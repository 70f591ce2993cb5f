"""``dynabatch bench trainer``: its parser and its command (the work: `dynabatch.bench.trainer`)."""

from __future__ import annotations

import json
import sys

from ..bench.trainer_config import TrainerBenchConfig
from ..config_flags import add_config_flags, config_from_args
from ..progress import add_progress_option
from . import add_subcommand, lazy_handler

BENCH_TRAINER_EPILOG = """\
methods:
  dp                dynabatch.DynabatchTrainer: DP-planned padded micro-batches, feedback refits the cost model
  group_by_length   transformers.Trainer, DataCollatorForSeq2Seq, train_sampling_strategy="group_by_length"
  batch_rebalance   the same with train_sampling_strategy="batch_rebalance" (transformers' own rank balancing)
  flattening        transformers.Trainer with DataCollatorWithFlattening (padding-free rows; decoder-only)
  trl_bfd           TRL's best-fit-decreasing packing (trl.pack_dataset, padding-free collator; decoder-only):
                    when trl is installed, else skipped with the reason

columns:
  tgt tok/s     real target (loss) tokens over the wall seconds of the timed steps (the slowest rank's
                intervals between step ends: data, forward, backward, all-reduce, optimizer)
  real tok/s    the same with every unpadded token
  cpu tok/s     target tokens per CPU second of each step's slowest rank (its process's CPU time: what the
                steps cost, whatever else the machine ran; steadier than the wall time on a shared machine)
  vs dp         dp's tgt tok/s over the row's
  pad eff       real tokens / computed tokens
  tok/step      real tokens per step (all ranks): the budget every method trains on
  rank spread   max/mean over the ranks of each step's forward seconds, median over the steps
  round spread  (max - min) / median of the method's tokens/s in each round: the run's timer and load noise
  eval loss     held-out summed cross-entropy / target tokens after the last step (same for every method)
  MAPE          dp: planned vs measured seconds per micro-batch before its first refit and over the last
                steps; noise: median spread of identical micro-batch shapes (the floor a MAPE can reach)
                floor: MAPE of a linear fit to all of dp's measured micro-batches, in sample (the features' best)

examples:
  dynabatch bench trainer                                   # both models, every method, the shared FLAN sample
  dynabatch bench trainer --models llama --steps 12 --rounds 3 --global-batch-tokens 16384 --max-len 1024
  dynabatch bench trainer --data data/text/shard-000000.jsonl --samples 1000 --json > trainer.json

The data default to the shared FLAN sample (../shared/data/text) when present, else generated FLAN-like text.
"""


def add_bench_trainer_command(bench_sub) -> None:
    """Register ``dynabatch bench trainer`` on the ``bench`` subparsers."""
    p = add_subcommand(bench_sub, "trainer",
                       "real training through transformers.Trainer on 2 gloo DDP ranks: dp + feedback vs HF batching",
                       "Train a tiny Llama and a tiny T5 through transformers.Trainer on two local gloo DDP ranks with "
                       "dynabatch's DP and feedback, and with what a Hugging Face user would otherwise pick, on the "
                       "same samples, steps and tokens per step, methods interleaved; report target tokens/s, the "
                       "held-out loss, the rank spread and dp's cost-model error.", BENCH_TRAINER_EPILOG)
    add_config_flags(p, TrainerBenchConfig)  # one flag per option, declared on the config
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    add_progress_option(p, "the steps trained")
    p.set_defaults(func=lazy_handler("dynabatch.commands.bench_trainer", "bench_trainer_command"))


def bench_trainer_command(args) -> int:
    """Run ``dynabatch bench trainer`` with its parsed arguments (1 with a one-line error on bad options)."""
    from ..bench.trainer import format_table, run_trainer_bench
    from ..progress import show_progress

    try:
        cfg = config_from_args(TrainerBenchConfig, args)
        doc = run_trainer_bench(cfg, progress=show_progress(args))
    except ValueError as e:  # options or data that cannot run: a line, not a traceback
        print(f"dynabatch: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=1, default=float) if args.json else format_table(doc))
    return 0


__all__ = ["BENCH_TRAINER_EPILOG", "add_bench_trainer_command", "bench_trainer_command"]
