"""``dynabatch bench spindle``: its parser and its command (the work: `dynabatch.bench.spindle`)."""

from __future__ import annotations

import json
import textwrap

from ..progress import add_progress_option, show_progress
from . import add_subcommand

BENCH_SPINDLE_EPILOG = """\
what it does: draws steps of a three-task mix (text-only, image+text, audio+text; from the shared data
folder when present: FLAN CoT + NIv2 text, the InternVL SFT shape records, COCO captions and LLaVA QA; the
audio is generated) for the full-size multi-task graph mtmm (InternViT-6B + audio encoder + projector +
InternLM2-20B + two heads), and simulates each step at every device count: the per-component allocation in
dependency-ordered waves (Spindle) and one pipeline over the whole model, cut uniformly or by the partition
search, each with and without the bypass of idle leading stages.

columns:
  allocation s     simulated step seconds of the per-component allocation (mean over the steps), a
                   micro-batch's image tiles split over the vit's replicas where shorter (simulated only)
  whole-mb s       the same with whole micro-batches (what the multi-task executor runs)
  uniform ...      one pipeline's simulated step seconds ((no fit): no stage count fits the memory)
  best/alloc       the best one-pipeline baseline over the allocation (> 1: the allocation is faster)
  best/whole       the same over the whole-micro-batch allocation
  lower bound      all the step's work over all devices, no communication
  chain bound      the heaviest micro-batch's forward + backward through its components, one after another
                   (data and pipeline parallelism never run one micro-batch's layers side by side)
  alloc/bound      the allocation over the larger of the two bounds
  plan ms          pricing the step + the allocation search (median; see the load line)

both sides overlap their gradient all-reduces with the backward: the allocation posts each component
group's all-reduce when that component's last backward on the rank ends (as the executor does), one pipeline
each stage's when that stage's last backward ends (Megatron's overlap-grad-reduce).

examples:
  dynabatch bench spindle                                  # shared data if found, 8 16 32 64 devices
  dynabatch bench spindle --devices 32 --steps 5           # one device count, more steps
  dynabatch bench spindle --generated --json > spindle.json
  dynabatch bench spindle --measure                        # executed gloo per-component times vs the simulator
"""


def add_bench_spindle_command(bench_sub) -> None:
    """Register ``dynabatch bench spindle`` on the ``bench`` subparsers."""
    p = add_subcommand(bench_sub, "spindle", "multi-task per-component allocation vs one pipeline, simulated",
                       "Spindle-style per-component device allocation in wavefronts against one pipeline over the "
                       "whole multi-task model (uniform and searched cuts, with and without bypass), simulated "
                       "step seconds at several device counts, with the iteration lower bound and planning time.",
                       BENCH_SPINDLE_EPILOG)
    p.add_argument("--devices", type=int, nargs="+", default=[8, 16, 32, 64], help="device counts (default 8 16 32 64)")
    p.add_argument("--steps", type=int, default=3, help="steps drawn per device count (default 3)")
    p.add_argument("--step-tokens", type=int, default=65536, help="backbone tokens per step (default 65536)")
    p.add_argument("--microbatch-tokens", type=int, default=2048,
                   help="backbone tokens per micro-batch, the same for every method (default 2048)")
    p.add_argument("--max-len", type=int, default=4096, help="longest backbone sequence (default 4096)")
    p.add_argument("--weights", type=float, nargs=3, metavar=("TEXT", "IMAGE", "AUDIO"), default=[0.4, 0.4, 0.2],
                   help="task weights of text, image_text, audio_text (default 0.4 0.4 0.2)")
    p.add_argument("--device", default="a100-80gb", help="device preset (default a100-80gb)")
    p.add_argument("--shared", default=None, metavar="DIR",
                   help="the shared data folder (default ../shared/data beside the repository)")
    p.add_argument("--generated", action="store_true", help="use generated data even when the shared data exists")
    p.add_argument("--seed", type=int, default=0, help="seed of the drawn steps (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--measure", action="store_true",
                   help="instead: run mtmm-tiny on 4 gloo ranks under its allocation and compare the simulator's "
                        "per-component seconds with the executed ones (dynabatch.bench.spindle_measure)")
    add_progress_option(p, "the steps planned")
    p.set_defaults(func=bench_spindle_command)


def bench_spindle_command(args) -> int:
    """Run ``dynabatch bench spindle`` with its parsed arguments."""
    from ..bench import spindle as B

    if args.measure:
        import importlib.util

        if importlib.util.find_spec("dynabatch.bench.spindle_measure") is None:
            print("bench spindle --measure needs dynabatch.bench.spindle_measure, which this checkout lacks")
            return 2
        from ..bench.spindle_measure import measure_spindle

        rep = measure_spindle()
        print(json.dumps(B.jsonable(rep), indent=1) if args.json else rep.format())
        return 0
    weights = dict(zip((t for t, _ in B.MIX), args.weights))
    pools = None if args.generated else B.shared_pools(args.shared or B.DEFAULT_SHARED, args.max_len, args.seed)
    shared = pools is not None
    if pools is None:
        pools = B.generated_pools(args.seed)
    rows = B.run_spindle_bench(pools, weights, tuple(args.devices), args.steps, args.step_tokens,
                               args.microbatch_tokens, args.device, args.seed, progress=show_progress(args))
    if args.json:
        print(json.dumps({"shared_data": shared, "pools": [p.origin for p in pools], "weights": weights,
                          "device": args.device, "step_tokens": args.step_tokens,
                          "microbatch_tokens": args.microbatch_tokens, "load": B.load_text(), "overlap": B.OVERLAP,
                          "split": B.SPLIT,
                          "rows": [r.to_dict() for r in rows]}, indent=1))
    else:
        print(B.describe(pools, weights, shared))
        print(f"model mtmm on {args.device}; {args.steps} steps of {args.step_tokens} backbone tokens, micro-batches "
              f"of <= {args.microbatch_tokens} tokens (one task each), the same for every method\n")
        print(B.format_spindle(rows))
        print(f"\n{textwrap.fill(B.OVERLAP, 116)}")
        print(textwrap.fill(B.SPLIT, 116))
        print(f"\n{B.load_text()}")
    return 0
