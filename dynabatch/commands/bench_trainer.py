"""``dynabatch bench trainer``: its parser and its command (the work: `dynabatch.bench.trainer`)."""

from __future__ import annotations

import json
import sys

from ..bench.trainer_names import METHODS, MODELS
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
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per method (default 12)")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds the steps are split into (default 3; each round's first step is not timed)")
    p.add_argument("--global-batch-tokens", type=int, default=8192, help="tokens per step over both ranks (default 8192)")
    p.add_argument("--max-len", type=int, default=512, help="truncate inputs to this many tokens (default 512)")
    p.add_argument("--max-target-len", type=int, default=128, help="truncate targets (default 128)")
    p.add_argument("--samples", type=int, default=2000, help="training samples drawn from the data (default 2000)")
    p.add_argument("--eval-samples", type=int, default=64,
                   help="held-out samples the final loss is measured on (default 64)")
    p.add_argument("--data", nargs="+", metavar="PATH", help="JSONL (.gz) or Parquet files with inputs/targets")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate, constant (default 1e-3)")
    p.add_argument("--refit-every", type=int, default=2, help="dp: steps between cost-model refits (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="liveness timeout: stop when no rank made progress for this long (default 600)")
    p.add_argument("--max-wall", type=float, default=None, metavar="SECONDS", help="optional cap on the run's wall time")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    add_progress_option(p, "the steps trained")
    p.set_defaults(func=lazy_handler("dynabatch.commands.bench_trainer", "bench_trainer_command"))


def bench_trainer_command(args) -> int:
    """Run ``dynabatch bench trainer`` with its parsed arguments (1 with a one-line error on bad options)."""
    from ..bench.trainer import TrainerBenchConfig, format_table, run_trainer_bench
    from ..progress import show_progress

    try:
        cfg = TrainerBenchConfig(models=tuple(args.models), methods=tuple(args.methods), steps=args.steps,
                                 rounds=args.rounds, global_batch_tokens=args.global_batch_tokens, max_len=args.max_len,
                                 max_target_len=args.max_target_len, samples=args.samples, eval_samples=args.eval_samples,
                                 data=tuple(args.data or ()),
                                 lr=args.lr, refit_every=args.refit_every, seed=args.seed, timeout_s=args.timeout,
                                 max_wall_s=args.max_wall)
        doc = run_trainer_bench(cfg, progress=show_progress(args))
    except ValueError as e:  # options or data that cannot run: a line, not a traceback
        print(f"dynabatch: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=1, default=float) if args.json else format_table(doc))
    return 0


__all__ = ["BENCH_TRAINER_EPILOG", "add_bench_trainer_command", "bench_trainer_command"]
