"""``dynabatch check``: its parser (the work: `dynabatch.check.command.check_command`)."""

from __future__ import annotations

from . import add_subcommand, lazy_handler

CHECK_EPILOG = """\
what it reports:
  the family and class, the layers and their split over --num-stages, each stage's parameter bytes, the
  tokenizer against the model's vocabulary, the decoder start id, the vision settings; then one step of
  DATA on each route (step_backward as DynabatchTrainer / accelerate run it, the pipeline's stages)
  against the plain Hugging Face model's own logits: loss and every gradient, with the tolerance.
  Exit 0: everything agrees; exit 1: a problem or a disagreement, each with what to do.

examples:
  dynabatch check my-model/ data/train.jsonl --num-stages 2
  dynabatch check my-model/ data/train.jsonl --num-stages 4 --collate packed --dtype float64
  dynabatch check my-llava/ data/llava.jsonl --num-stages 2 --batch-tokens 8192 --json
"""


def add_check_command(sub) -> None:
    """Register ``dynabatch check`` on the top-level subparsers."""
    p = add_subcommand(sub, "check", "check your model folder and data before a long run",
                       "Check a save_pretrained model folder and your data before training: how the model splits "
                       "over pipeline stages and whether one step of your own micro-batches gives the Hugging "
                       "Face model's loss and gradients on every route.", CHECK_EPILOG)
    p.add_argument("model_dir", help="a save_pretrained folder (config.json, safetensors, tokenizer files)")
    p.add_argument("data", help="JSONL/Parquet file, folder or glob of records")
    p.add_argument("--num-stages", "--stages", dest="stages", type=int, default=1,
                   help="pipeline stages to split the model into (default 1)")
    p.add_argument("--collate", choices=("padded", "packed"), default="padded",
                   help="micro-batch layout to check (default padded)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer spec (default: the folder's tokenizer files, else the bytes tokenizer)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="parameter dtype of the check (default float32; float64: tighter tolerances)")
    p.add_argument("--batch-tokens", type=int, default=4096, help="global batch of the checked step, tokens")
    p.add_argument("--max-len", type=int, default=512, help="longest sample, tokens (default 512)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=lazy_handler("dynabatch.check.command", "check_command"))
