"""``dynabatch datagen``: its parser (the work: `dynabatch.datagen.datagen_command`)."""

from __future__ import annotations

from ..progress import add_progress_option
from . import add_subcommand, lazy_handler
from .choices import TEXT_FORMATS

DATAGEN_EPILOG = """\
what is written:
  DIR/text/shard-000000.jsonl ...        FLAN-like rows {"id", "task", "inputs", "targets"}: 7 task
                                         families (qa_short, classification, fewshot_niv2,
                                         summarization, translation, cot, long_context) with the
                                         heavy-tailed lengths of synthetic_shapes("text"), in
                                         pseudo-words (~4 UTF-8 bytes per token)
  DIR/image_text/shard-000000.tar ...    webdataset shards: <key>.jpg (or .png) + <key>.json
                                         {"id", "task", "image", "conversations": [{"from": "human",
                                         "value": "<image>\\n..."}, {"from": "gpt", ...}]}; image
                                         sizes 200..2000 px chosen so that InternVL dynamic tiling
                                         (448-px tiles, max 12 + thumbnail) gives 1..13 tiles

The same arguments always write byte-identical files. Images take ~10 ms each.

examples:
  dynabatch datagen --out data --text 20000 --image-text 500
  dynabatch datagen --out data --text 100000 --text-format parquet --shards 8 --seed 1
  dynabatch datagen --out data --text 20000 --no-progress > datagen.log 2>&1
  python -c "import loaders; print(sum(1 for _ in loaders.open_source('data/text')))"
"""


def add_datagen_command(sub) -> None:
    """Register ``dynabatch datagen`` on the top-level subparsers."""
    p = add_subcommand(sub, "datagen", "write realistic FLAN-like text and image+text sample shards",
                       "Write the project's generated sample data: FLAN-like text shards (JSONL, JSONL.gz or "
                       "Parquet) and LLaVA-like image+text webdataset shards.", DATAGEN_EPILOG)
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (text/ and image_text/ inside)")
    p.add_argument("--text", type=int, default=0, metavar="N", help="text samples to write (default 0)")
    p.add_argument("--image-text", type=int, default=0, metavar="N", help="image+text samples to write (default 0)")
    p.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    p.add_argument("--shards", type=int, default=4, help="shards per kind (default 4)")
    p.add_argument("--text-format", choices=TEXT_FORMATS, default="jsonl", help="text file format (default jsonl)")
    add_progress_option(p, "the samples written")
    p.set_defaults(func=lazy_handler("dynabatch.datagen", "datagen_command"))
