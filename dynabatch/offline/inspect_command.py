"""``dynabatch inspect``: what a run plan predicts, as a table and a PNG (`dynabatch.planfile.inspect`,
`dynabatch.planfile.plot`); registered by `dynabatch.cli`."""

from __future__ import annotations

import json

from ..commands import add_subcommand
from .guard import guarded

INSPECT_EPILOG = """\
table (times predicted by the plan's cost model; ms unless noted):
  predicted iteration time  per step: the slowest rank's simulated pipeline time (mean/p50/p95/max)
  predicted run time        sum of the steps' iteration times
  predicted throughput      real (unpadded) tokens / predicted run time
  padding efficiency        real tokens / computed tokens over the run (1.0 = no padding)
  rank balance              per step, slowest rank / mean rank (1.0 = balanced); mean and worst step
  rank totals               each rank's time summed over the run: max/min over ranks
  micro-batches per step    over all ranks (and per rank)
  micro-batch time          predicted fwd+bwd time of one micro-batch on one stage; cv = std/mean
  peak micro-batch memory   largest predicted activation memory of a micro-batch vs the memory limit
  micro-batch shapes        how many micro-batches have R rows (1, 2-3, 4-7, ...) and a padded
                            length (input_len + target_len) in each power-of-two bucket
  token share by task       sample tokens of each task / all tokens (needs the plan's task_id column)
  step K                    per rank: micro-batches, samples, rows and padded length ranges, summed
                            compute time and simulated pipeline time (default K: the slowest step)

plot (--plot, PNG), titled with the plan's method, cost model, device, ranks x stages and how much
faster it steps than pack on the same global batches (pack's predicted time / this plan's; needs
the length index: the plan's own, or --index): micro-batch shapes (rows vs padded length, colour =
predicted time); predicted iteration time per step beside pack and the lower bound; rank balance;
padding efficiency per step (and pack's); busy / idle time per stage; step K's pipeline timeline
on its slowest rank (plain = forward, hatched = backward).

examples:
  dynabatch inspect plan.parquet
  dynabatch inspect plan.parquet --plot plan.png --step 12
  dynabatch inspect pack.parquet --index index.parquet --plot pack.png   # pack's own baseline lines
  dynabatch inspect plan.parquet --json > plan-summary.json
"""


def add_inspect_command(sub) -> None:
    """Register ``dynabatch inspect`` on the ``dynabatch`` subparsers."""
    p = add_subcommand(sub, "inspect", "summarize a plan file: predicted times, balance, shapes, tasks; PNG plot",
                       "Print what a run plan predicts (iteration time, padding, rank balance, micro-batch shapes, "
                       "token share per task) and optionally plot it.", INSPECT_EPILOG)
    p.add_argument("plan", metavar="PLAN.parquet", help="a file written by dynabatch plan")
    p.add_argument("--plot", metavar="OUT.png",
                   help="write the PNG here (micro-batch shapes, step times beside pack and the lower bound, "
                        "rank balance, padding efficiency, per-stage busy time, the step's timeline)")
    p.add_argument("--index", nargs="+", metavar="INDEX", default=None,
                   help="the length index the plan was made from, for the plot's pack baseline and lower bound "
                        "(default: the plan's own index files when they still exist)")
    p.add_argument("--step", type=int, default=None, help="step to detail and draw (default: the slowest)")
    p.add_argument("--top-tasks", type=int, default=10, help="tasks listed in the token share (default 10)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=guarded(_cmd_inspect))


def _cmd_inspect(args) -> int:
    from ..planfile.inspect import format_summary, summarize_plan
    from ..planfile.plot import index_shapes, plot_plan
    from ..planfile.reader import load_run_plan

    run = load_run_plan(args.plan)
    if args.step is not None and args.step not in set(run.steps.tolist()):
        raise ValueError(f"--step {args.step} is not in {args.plan} (steps 0..{run.num_steps - 1})")
    s = summarize_plan(run, step=args.step, top_tasks=args.top_tasks)
    if args.plot:
        plot_plan(run, args.plot, step=s["step_detail"]["step"] if s["step_detail"] else None,
                  shapes=index_shapes(run, args.index))
    if args.json:
        print(json.dumps(s, indent=1, default=float))
        return 0
    print(format_summary(s))
    if args.plot:
        print(f"\nplot written to {args.plot}")
    return 0
