"""``dynabatch profile``: its parser (the work: `dynabatch.pipeline.measure.profile_report.profile_command`)."""

from __future__ import annotations

import argparse

from ..progress import add_progress_option
from . import add_subcommand, lazy_handler
from .choices import PROFILE_LENGTHS, PROFILE_ROWS, PROFILE_TILES, TINY_MODELS

PROFILE_EPILOG = """\
what it prints: each shape's progress while it measures (on a terminal a bar, else a line every
10 s), then the table of ms per micro-batch, and a warning when timings disagree beyond the
noise of the repeats: a larger shape measured faster than a smaller one, or a shape whose repeats
spread far wider than the others' (a busy machine; rerun with more --repeats, fewer other jobs).

examples:
  dynabatch profile --model gpt-tiny --device cpu --out costs.json
  dynabatch profile --model t5-tiny --rows 1 4 --lengths 32 64 --target-lengths 8 16 --out t5.json
  dynabatch profile --model hf:path/to/llama --lengths 64 128 --device cuda --out llama.json
  dynabatch profile --model gpt-tiny --repeats 5 --no-progress --out costs.json 2> profile.log
"""


def model_spec(text: str) -> str:
    """``--model``: a tiny model's name or ``hf:PATH`` (argparse type; a clear error otherwise)."""
    if text in TINY_MODELS or (text.startswith("hf:") and len(text) > 3):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither one of {', '.join(TINY_MODELS)} nor hf:PATH")


def add_profile_command(sub) -> None:
    """Register ``dynabatch profile`` on the top-level subparsers."""
    p = add_subcommand(sub, "profile", "time micro-batch shapes of a model and save a cost model",
                       "Time forward+backward of every layer of a tiny or Hugging Face model on this machine over "
                       "a grid of padded micro-batch shapes (rows x length [x target length]), packed ones (text "
                       "models: decoder-only and encoder-decoder), ones with image tiles (vision-language models) "
                       "and, for a decoder-only model, the longer half of the grid again with a padded row (what "
                       "its padding mask costs, q_pad); save the profiled cost model (load it with CostModel.load, "
                       "for the DataLoader and the planner) with the per-layer costs (load_layer_costs, for the "
                       "partition search) as JSON.", PROFILE_EPILOG)
    p.add_argument("--model", type=model_spec, default="gpt-tiny",
                   help=f"model to profile: one of {', '.join(TINY_MODELS)}, or hf:PATH for a Hugging Face "
                        "save_pretrained folder or config.json (random weights from a config; default gpt-tiny)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1 ... (default cpu)")
    p.add_argument("--out", required=True, help="where to write the cost model (JSON)")
    p.add_argument("--rows", type=int, nargs="+", default=list(PROFILE_ROWS), help="rows per micro-batch")
    p.add_argument("--lengths", type=int, nargs="+", default=list(PROFILE_LENGTHS),
                   help="main-stack lengths (tokens)")
    p.add_argument("--target-lengths", type=int, nargs="+", default=None,
                   help="decoder lengths (tokens) for t5-tiny (default 8 16 32)")
    p.add_argument("--tiles", type=int, nargs="+", default=list(PROFILE_TILES),
                   help="image tiles per micro-batch for vision-language models (default 1 2 4)")
    p.add_argument("--num-stages", "--stages", dest="stages", type=int, default=1, help="pipeline stages: record the slowest stage (default 1)")
    p.add_argument("--hidden", type=int, default=None, help="override the model's hidden size")
    p.add_argument("--layers", type=int, default=None, help="override the number of (encoder) layers")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds over the grid, fastest kept (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and inputs (default 0)")
    add_progress_option(p, "the shapes timed")
    p.set_defaults(func=lazy_handler("dynabatch.pipeline.measure.profile_report", "profile_command"))
