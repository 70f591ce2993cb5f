"""Command-line flags of `PlanOptions`: one flag per field, shared by every command that plans
(``dynabatch plan``, ``dynabatch bench plan``). The flags, their meaning and defaults are read from
`PlanOptions`' declaration (`dynabatch.core.options`: `option_flag`, `option_help`, `option_default`);
what is here is how the command line parses them (types, metavars, the commands' own defaults) and
the epilog that teaches them."""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings

from .core.methods import BASELINE_KNOBS
from .core.options import METHODS, RECOMPUTE, SCHEDULES, PlanOptions, option_default, option_flag, option_help

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
    flag, about = option_flag, option_help  # each flag and its meaning: PlanOptions' declaration

    def add(into, name: str, note: str = "", **kw):
        """The flag of field ``name``: its declared flag and help (``note`` adds what the CLI does differently);
        ``default`` is the field's own unless ``kw`` gives the command's."""
        if "action" not in kw:
            kw.setdefault("default", option_default(name))
        return into.add_argument(flag(name), help=about(name) + note, **kw)

    size = g.add_mutually_exclusive_group()
    add(size, "global_batch_tokens", f" (default {global_batch_tokens})", type=int, default=None, metavar="N")
    add(size, "global_batch_size", "", type=int, metavar="N")
    add(g, "max_len", " (dynabatch plan: default none, as the DataLoader's max_len; bench plan: 2048, 8192 for vlm)",
        type=int, metavar="L")
    add(g, "max_target_len", " (dynabatch plan: default none, as the DataLoader's max_target_len; bench plan: 512, "
                             "as FLAN)", type=int, metavar="T")
    if methods:
        add(g, "method", f" (default {option_default('method')})", choices=METHODS)
        add(g, "method_options", ", repeatable: rows=4 (pad, group_by_length, pack, pack_varlen), max_tokens=4096 "
                                 "(token_budget, kk), microbatches_per_rank=2 (rebalance); default: the method's own",
            action="append", type=_method_option, default=[], metavar="KEY=VALUE", dest="method_option")
    # the old names of the two layout flags stay as aliases (PlanOptions deprecates stages=/ranks=)
    g.add_argument(flag("num_stages"), "--stages", dest="stages", type=int, default=stages, metavar="S",
                   help=f"{about('num_stages')}, PlanOptions.num_stages (default {stages}; --stages: the old name)")
    g.add_argument(flag("num_ranks"), "--ranks", dest="ranks", type=int, default=ranks, metavar="D",
                   help=f"{about('num_ranks')}, the training run's world size (default {ranks}; --ranks: the old name)")
    add(g, "schedule", f" (default {option_default('schedule')}; adaptive: memory-bounded list order; auto: per step "
                       "the fastest order that fits memory, recorded in the plan)", choices=SCHEDULES)
    add(g, "memory_limit", ": 17e9, 16GiB, 800MB (the cost model's limit is for --num-stages x --num-ranks)",
        type=parse_bytes, metavar="BYTES")
    add(g, "recompute", f" (default {option_default('recompute')}; full: every layer; adaptive: per stage the fewest "
                        "layers that keep the stage within --device-memory-limit)", choices=RECOMPUTE)
    add(g, "device_memory_limit", ", e.g. 40GiB; needed by --recompute adaptive, every policy checked against it when "
                                  "given",
        type=parse_bytes, metavar="BYTES")
    add(g, "flush", "; the flag plans flush-free, and each step records its simulated steady-state time",
        dest="flush", action="store_false")
    add(g, "max_caps", f" (default {option_default('max_caps')})", type=int, metavar="N")
    add(g, "seed", f" (default {option_default('seed')})", type=int, metavar="K")
    add(g, "shuffle", "; the flag sets False", dest="shuffle", action="store_false")
    add(g, "drop_last", " (default: keep it, as the DataLoader does)", action="store_true")
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
