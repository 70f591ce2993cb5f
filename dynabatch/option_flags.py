"""Command-line flags of `PlanOptions`: one flag per field, shared by every command that plans
(``dynabatch plan``, ``dynabatch bench plan``), defined beside the options they set."""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings

from .core.methods import BASELINE_KNOBS
from .core.options import METHODS, RECOMPUTE, SCHEDULES, PlanOptions

PLAN_OPTIONS_HELP = """\
planning options (one flag per field of dynabatch.PlanOptions; the DataLoader takes the same
options as keywords, so an offline plan and an online loader given the same values form the same
steps and micro-batches):
  --global-batch-tokens N  a step = samples drawn at random until the step holds N tokens (all
                           ranks together; tokens = main + decoder tokens after --max-len /
                           --max-target-len truncation)
  --global-batch-size N    a step = N samples instead (give one of the two)
  --method-option K=V      (dynabatch plan) a knob of --method: rows=N (pad, group_by_length, pack,
                           pack_varlen), max_tokens=N (token_budget, kk), microbatches_per_rank=N
                           (rebalance); bench plan sweeps these knobs itself
  --memory-limit BYTES     activation bytes one micro-batch may use on one stage (17e9, 16GiB,
                           800MB; default: the cost model's limit for the world layout)
  --recompute POLICY       per-stage activation recomputation: none (default), full, or adaptive
                           (per stage the fewest layers that keep its peak within
                           --device-memory-limit; the first stages of 1F1B hold the most)
  --device-memory-limit B  activation bytes one device may hold at once (all micro-batches in
                           flight); with it every policy is checked against the limit
  --no-flush               steps stream flush-free (asynchronous 1F1B across steps, the runner's
                           run_steps with flush=False); each plan records its simulated
                           steady-state step time (flushfree_step_s)
  --seed K                 epoch e shuffles with seed K + e
  --no-shuffle             global batches in sample-id order (evaluation); the DataLoader's
                           shuffle=False
  --drop-last              drop an epoch's last, smaller step (default: keep it, as the
                           DataLoader does; --keep-last is a deprecated no-op)
"""

_BYTE_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20,
               "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """``17e9``, ``16GiB``, ``800MB`` -> bytes (argparse type of ``--memory-limit``)."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 17e9, 16GiB, 800MB)")
    value = float(m.group(1)) * _BYTE_UNITS[m.group(2)]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"the memory limit must be positive, got {text!r}")
    return value


def _method_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--method-option``; the value is read as JSON (numbers, lists), else kept as text."""
    key, sep, value = str(text).partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--method-option takes KEY=VALUE (e.g. rows=4), got {text!r}")
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value
    return key.strip(), parsed


class _DeprecatedNoOp(argparse.Action):
    """A flag kept for one release: it does nothing but warn (``--keep-last``)."""

    def __init__(self, option_strings, dest, message: str = "", **kw):
        self.message = message
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        warnings.warn(self.message, DeprecationWarning, stacklevel=2)
        print(f"dynabatch: warning: {self.message}", file=sys.stderr)


def add_plan_options(parser, *, methods: bool = True, ranks: int = 8, stages: int = 4,
                     global_batch_tokens: int = 65536, title: str = "planning options (dynabatch.PlanOptions)"):
    """Add one flag per `dynabatch.PlanOptions` field to ``parser`` (an argument group titled
    ``title``) and return the group. ``methods=False`` leaves out ``--method``/``--method-option``
    (`dynabatch bench plan` runs every method and sweeps the baselines' knobs). Read the parsed
    arguments back with `plan_options_from_args`."""

    g = parser.add_argument_group(title)
    size = g.add_mutually_exclusive_group()
    size.add_argument("--global-batch-tokens", type=int, default=None, metavar="N",
                      help=f"tokens of one step over all ranks, after truncation (default {global_batch_tokens})")
    size.add_argument("--global-batch-size", type=int, default=None, metavar="N",
                      help="samples of one step over all ranks, instead of --global-batch-tokens")
    g.add_argument("--max-len", type=int, default=None, metavar="L",
                   help="truncate each sample's main-stack tokens (decoder-only: the whole sequence; "
                        "encoder-decoder: the input) to L (dynabatch plan: default none, as the DataLoader's "
                        "max_len; bench plan: 2048, 8192 for vlm)")
    g.add_argument("--max-target-len", type=int, default=None, metavar="T",
                   help="truncate an encoder-decoder sample's target (decoder) tokens to T (dynabatch plan: default "
                        "none, as the DataLoader's max_target_len; bench plan: 512, as FLAN)")
    if methods:
        g.add_argument("--method", choices=METHODS, default="dp",
                       help="planning method: dp (padded micro-batches), dp_varlen (packed varlen) or a "
                            "baseline (default dp)")
        g.add_argument("--method-option", action="append", type=_method_option, default=[], metavar="KEY=VALUE",
                       help="a knob of --method, repeatable: rows=4 (pad, group_by_length, pack, pack_varlen), "
                            "max_tokens=4096 (token_budget, kk), microbatches_per_rank=2 (rebalance); "
                            "default: the method's own")
    g.add_argument("--num-stages", "--stages", dest="stages", type=int, default=stages, metavar="S",
                   help=f"pipeline stages, PlanOptions.num_stages (default {stages}; --stages: the old name)")
    g.add_argument("--num-ranks", "--ranks", dest="ranks", type=int, default=ranks, metavar="D",
                   help=f"data-parallel ranks, the training run's world size (default {ranks})")
    g.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                   help="pipeline schedule the micro-batches are ordered and simulated for (default 1f1b; "
                        "adaptive: memory-bounded list order; auto: per step the fastest order that fits memory, "
                        "recorded in the plan)")
    g.add_argument("--memory-limit", type=parse_bytes, default=None, metavar="BYTES",
                   help="activation bytes one micro-batch may use on one stage: 17e9, 16GiB, 800MB "
                        "(default: the cost model's limit for --num-stages x --num-ranks)")
    g.add_argument("--recompute", choices=RECOMPUTE, default="none",
                   help="per-stage activation recomputation (default none; full: every layer; adaptive: per stage "
                        "the fewest layers that keep the stage within --device-memory-limit)")
    g.add_argument("--device-memory-limit", type=parse_bytes, default=None, metavar="BYTES",
                   help="activation bytes one device may hold at once, every micro-batch in flight together "
                        "(e.g. 40GiB); needed by --recompute adaptive, checked for every policy when given")
    g.add_argument("--no-flush", dest="flush", action="store_false",
                   help="plan for flush-free streaming of steps (asynchronous 1F1B): each step also records its "
                        "simulated steady-state time")
    g.add_argument("--max-caps", type=int, default=48, metavar="N",
                   help="candidate caps on the largest micro-batch the dp search tries (default 48)")
    g.add_argument("--seed", type=int, default=0, metavar="K",
                   help="seed of the global batches: epoch e shuffles with K + e (default 0)")
    g.add_argument("--no-shuffle", dest="shuffle", action="store_false",
                   help="form global batches in sample-id order instead of a seeded permutation (evaluation)")
    g.add_argument("--drop-last", action="store_true",
                   help="drop each epoch's last global batch when it is smaller than the others (default: keep "
                        "it, as the DataLoader does)")
    g.add_argument("--keep-last", action=_DeprecatedNoOp,
                   message="--keep-last is deprecated and does nothing: the last global batch is kept by default "
                           "(--drop-last drops it)",
                   help="deprecated no-op: the last batch is kept unless --drop-last")
    parser.set_defaults(_plan_defaults={"global_batch_tokens": global_batch_tokens})
    return g


def plan_options_from_args(args, *, max_len: int | None = None, max_target_len: int | None = None,
                           method: str | None = None):
    """The `PlanOptions` of arguments parsed by a parser given `add_plan_options`.

    ``max_len`` / ``max_target_len``: the defaults when ``--max-len`` / ``--max-target-len`` are not
    given (None: `PlanOptions`' and the DataLoader's, no truncation; ``bench plan`` passes its own);
    ``method``: overrides ``--method`` (``dynabatch plan --collate`` picks the method). Raises
    ValueError (one line) on a method option the method does not take."""

    method = method or getattr(args, "method", None) or "dp"
    knobs = dict(getattr(args, "method_option", None) or [])
    takes = {"order"} if method in ("dp", "dp_varlen") else {BASELINE_KNOBS[method][0]}
    wrong = sorted(set(knobs) - takes)
    if wrong:
        raise ValueError(f"--method {method} takes --method-option {'/'.join(sorted(takes))}=..., not {wrong}")
    tokens, size = args.global_batch_tokens, args.global_batch_size
    if tokens is None and size is None:
        tokens = getattr(args, "_plan_defaults", {}).get("global_batch_tokens", 65536)
    return PlanOptions(global_batch_tokens=tokens, global_batch_size=size,
                       max_len=args.max_len if args.max_len is not None else max_len,
                       max_target_len=args.max_target_len if args.max_target_len is not None else max_target_len,
                       method=method, method_options=knobs,
                       num_stages=args.stages, num_ranks=args.ranks, schedule=args.schedule,
                       memory_limit=args.memory_limit, recompute=getattr(args, "recompute", "none"),
                       device_memory_limit=getattr(args, "device_memory_limit", None),
                       flush=getattr(args, "flush", True), seed=args.seed, shuffle=getattr(args, "shuffle", True),
                       drop_last=args.drop_last,
                       max_caps=args.max_caps)
