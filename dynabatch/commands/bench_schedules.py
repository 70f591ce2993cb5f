"""``dynabatch bench schedules``: its parser and its command (the work: `dynabatch.bench.schedules`)."""

from __future__ import annotations

import json

from ..progress import add_progress_option, show_progress
from . import add_subcommand

BENCH_SCHEDULES_EPILOG = """\
what it does: plans FLAN-like global batches with dp under 1F1B at each --num-stages x --num-ranks, then
simulates every rank's micro-batches (the plan's order, per-stage seconds, transfers and bytes) under each
registered schedule: gpipe, 1f1b, adaptive, interleaved (2 model chunks per stage) and zb-h1 (zero bubble:
backwards split into input and weight parts).

columns:
  iteration ms  mean simulated step time (the slowest rank's makespan)
  vs 1f1b       1F1B's iteration time over the row's
  bubble        idle share of the slowest rank's stages: 1 - busy / (S x makespan)
  peak vs 1f1b  most in-flight activation bytes on a stage, over 1F1B's
  vs bound      iteration time over the busiest stage's work (no order does better)

examples:
  dynabatch bench schedules                                          # generated FLAN-like text, 4 and 8 stages
  dynabatch bench schedules --data ../shared/data/text/niv2_sample.jsonl.gz --num-stages 4 --num-ranks 8 32
  dynabatch bench schedules --model t5 --batches 8 --json > schedules.json
  dynabatch bench schedules --measure                                # executed vs simulated op seconds, 2 gloo stages
"""


def add_bench_schedules_command(bench_sub) -> None:
    """Register ``dynabatch bench schedules`` on the ``bench`` subparsers."""
    p = add_subcommand(bench_sub, "schedules", "every pipeline schedule on the same dp plans, simulated",
                       "Simulate gpipe, 1f1b, adaptive, interleaved 1F1B and zero-bubble ZB-H1 on the same dp plans "
                       "of FLAN-like data at several pipeline depths and data-parallel widths: iteration time, "
                       "speed-up over 1F1B, bubble share, memory and the lower bound.", BENCH_SCHEDULES_EPILOG)
    p.add_argument("--data", nargs="+", metavar="PATH", help="files or directories of samples (default: generated)")
    p.add_argument("--samples", type=int, default=40000, help="generated samples (default 40000)")
    p.add_argument("--model", choices=("gpt", "t5", "vlm"), default="gpt", help="model preset (default gpt)")
    p.add_argument("--device", default="a100-80gb", help="device preset (default a100-80gb)")
    p.add_argument("--num-stages", type=int, nargs="+", default=[4, 8], help="pipeline depths (default 4 8)")
    p.add_argument("--num-ranks", type=int, nargs="+", default=[8, 32], help="data-parallel widths (default 8 32)")
    p.add_argument("--batches", type=int, default=16, help="global batches per configuration (default 16)")
    p.add_argument("--global-batch-tokens", type=int, default=65536, help="tokens per step (default 65536)")
    p.add_argument("--max-len", type=int, default=2048, help="truncate inputs (default 2048)")
    p.add_argument("--max-target-len", type=int, default=512, help="truncate targets (default 512)")
    p.add_argument("--seed", type=int, default=0, help="seed of the global batches (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--weight-share", type=float, default=None,
                   help="price split backwards with this weight-part share (a measured one; default 0.5)")
    p.add_argument("--split-factor", type=float, default=1.0,
                   help="a split backward's seconds over a whole one's (a measured one, e.g. from --measure; default 1)")
    p.add_argument("--measure", action="store_true",
                   help="instead: run gpt-tiny on 2 gloo stages (1f1b and zb-h1) and score the simulator's op seconds "
                        "(F, B, Bi, W) against the executed ones (dynabatch.bench.schedules_measure)")
    p.add_argument("--rounds", type=int, default=12, help="--measure: rounds of fresh micro-batches (default 12)")
    p.add_argument("--clock", choices=("thread", "wall"), default="thread",
                   help="--measure: time ops in the rank thread's CPU seconds (default) or wall seconds")
    add_progress_option(p, "the global batches planned")
    p.set_defaults(func=bench_schedules_command)


def bench_schedules_command(args) -> int:
    """Run ``dynabatch bench schedules`` with its parsed arguments."""
    from ..bench.schedules import format_schedules, run_schedules_bench
    from ..shape_sources import bench_shapes

    if args.measure:
        from ..bench.schedules_measure import MeasureConfig, format_measure, run_measure

        rep = run_measure(MeasureConfig(rounds=args.rounds, seed=args.seed, clock=args.clock))
        print(json.dumps(rep, indent=1) if args.json else format_measure(rep))
        return 0
    shapes, data = bench_shapes(args.data, args.model, args.samples, args.seed)
    rows = run_schedules_bench(shapes, args.model, args.device, tuple(args.num_stages), tuple(args.num_ranks),
                               args.batches, args.global_batch_tokens, args.max_len,
                               args.max_target_len if args.model == "t5" else None, args.seed,
                               progress=show_progress(args),
                               split=None if args.weight_share is None and args.split_factor == 1.0 else
                               (0.5 if args.weight_share is None else args.weight_share, args.split_factor))
    if args.json:
        print(json.dumps({"data": data, "model": args.model, "device": args.device,
                          "rows": [r.to_dict() for r in rows]}, indent=1))
    else:
        print(f"{data}, {args.model} on {args.device}, {args.batches} global batches of {args.global_batch_tokens} "
              "tokens, dp plans (1F1B), every schedule simulated on them"
              + ("" if args.weight_share is None and args.split_factor == 1.0 else
                 f"; split backwards at {args.split_factor:g}x a whole one, weight share "
                 f"{0.5 if args.weight_share is None else args.weight_share:g}") + "\n")
        print(format_schedules(rows))
    return 0
