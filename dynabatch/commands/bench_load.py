"""``dynabatch bench load`` and ``dynabatch bench loader``: their parsers (the work:
`dynabatch.bench.load`, `dynabatch.bench.loader`; both run through `dynabatch.bench.load_common.run_command`)."""

from __future__ import annotations

from ..bench.load_config import DEFAULT_TEXT_DATA, GENERATED_IMAGE_TEXT_SAMPLES, SOURCES
from ..progress import add_progress_option
from . import add_subcommand, lazy_handler
from .choices import LOADER_METHODS


def add_data_option(p, files: str, default: str) -> None:
    """``--data``: the text files or folders `load_data.resolve_text` reads (``files`` says which
    kind); without it the shared FLAN sample ``default``, else generated data."""
    p.add_argument("--data", nargs="+", metavar="PATH",
                   help=f"{files} or folders; default: the shared FLAN sample {default} "
                        "(relative to the repository root), else generated data")


def add_output_options(p, progress_what: str) -> None:
    """``--json`` (one JSON document instead of the table) and ``--progress`` / ``--no-progress``
    (`dynabatch.progress`)."""
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    add_progress_option(p, progress_what)


BENCH_LOAD_HELP = "samples/s and tokens/s: loaders + scan_shapes vs datasets / webdataset"
BENCH_LOAD_DESCRIPTION = ("Time reading files into per-sample token counts: dynabatch's loaders + scan_shapes "
                          "against the plain datasets.load_dataset + .map and webdataset pipelines, on the same "
                          "files in the same run, and print the ratio.")
BENCH_LOAD_EPILOG = """\
what is timed (per source, both paths on the same files, same tokenizer object and batch size):
  dynabatch   loaders source (built inside the timing: indexing the files is a real cost)
              -> tokenization.scan_shapes -> length table (the input of dynabatch.Shapes)
  baseline    text: datasets.load_dataset("json" | "parquet", data_files=...) or load_from_disk
              -> .map(tokenize, batched=True, num_proc=workers) returning the two lengths
              -> for row in ds; webdataset: WebDataset(...).decode() -> render the turns
              -> one tokenizer call per batch + PIL.Image.open(bytes).size + DynamicTiling
              -> WebLoader(num_workers=workers)
  Token counts are input + target (+1 EOS) + vision tokens; both paths must agree.

columns:
  samples / tokens   what the path counted (the two rows must be equal)
  time s             median wall time of one run over --repeat runs
  cpu s              median CPU seconds of one run: all threads of this process (pyarrow's
                     reader threads, tokenizers' Rust threads) plus its worker processes;
                     steadier than wall time when other jobs share the machine
  samples/s          samples / time s (k = thousand, M = million)
  tokens/s           tokens / time s
  x baseline         dynabatch samples/s over baseline samples/s (> 1: dynabatch is faster)
  text total         all text sources: summed samples over summed median times (the
                     top-level "methods" in --json)

caveats:
  * datasets caches: load_dataset writes Arrow files to its cache and .map caches results.
    Each baseline run here is a FIRST run (fresh temporary cache_dir, load_from_cache_file=False);
    a second run of the same user script would skip most of that work.
  * jsonl: files with different fields (NIv2 vs CoT's extra "answer") cannot go through one
    load_dataset call; the baseline then loads each file and concatenates the text columns.
  * parquet / hf: the JSONL is converted once, untimed, into Parquet (row groups of 1024 rows)
    and a save_to_disk folder; both paths read those.
  * --workers N runs N processes on both paths (dynabatch: one loaders slot per process;
    datasets: num_proc=N for load_dataset and .map; webdataset: WebLoader workers, one or
    more shards each). Process start-up is timed. On a machine with fewer cores than N the
    numbers measure oversubscription.

examples:
  dynabatch bench load
  dynabatch bench load --sources jsonl hf --repeat 5 --json
  dynabatch bench load --data ../shared/data/text/niv2_sample.jsonl.gz --limit 5000 --workers 2
  dynabatch bench load --tokenizer path/to/tokenizer.json --image-text shards/
"""


def add_bench_load_command(bench_sub) -> None:
    """Register ``dynabatch bench load`` on the ``bench`` subparsers."""
    p = add_subcommand(bench_sub, "load", BENCH_LOAD_HELP, BENCH_LOAD_DESCRIPTION, BENCH_LOAD_EPILOG)
    add_data_option(p, "text files (.jsonl / .jsonl.gz, FLAN-like inputs/targets)",
                    "../shared/data/text/{niv2,flan_cot}_sample.jsonl.gz")
    p.add_argument("--image-text", default="generate", metavar="DIR|generate",
                   help="webdataset .tar shards of image+text samples, or 'generate' (default: "
                        f"{GENERATED_IMAGE_TEXT_SAMPLES} generated samples in a temporary folder)")
    p.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES), metavar="SOURCE",
                   help=f"which sources to time, among {' '.join(SOURCES)} (default: all)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="use only the first N samples of the text data and of the image+text data")
    p.add_argument("--repeat", type=int, default=3, metavar="R", help="runs per path; the median is shown (default 3)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes for both paths (dynabatch slots, datasets num_proc, WebLoader workers; default 1)")
    p.add_argument("--tokenizer", default="bytes",
                   help="tokenization.load_tokenizer spec: 'bytes' (default), a tokenizer.json, a sentencepiece "
                        ".model, a local transformers folder, or tiktoken:<encoding>")
    p.add_argument("--batch-size", type=int, default=1024,
                   help="samples per tokenizer call on both paths (default 1024)")
    p.add_argument("--seed", type=int, default=0, help="seed of generated data (default 0)")
    add_output_options(p, "bars of the data preparation and the timed runs")
    p.set_defaults(func=lazy_handler("dynabatch.bench.load", "bench_load_command"))



BENCH_LOADER_HELP = "micro-batches/s and tokens/s: dynabatch.DataLoader vs torch DataLoader + pad/pack collate"
BENCH_LOADER_DESCRIPTION = ("Time one epoch of micro-batches delivered to the training loop: dynabatch.DataLoader "
                            "(padded and packed, planning included) against torch.utils.data.DataLoader with a "
                            "padding and a packing collator, on the same files in the same run.")
BENCH_LOADER_EPILOG = """\
what is timed: one epoch of micro-batches (`loader.microbatches()`; torch: `loader`), touching input_ids / attention_mask / sample
ids, per method and per --workers value, on one rank (world_size 1, no torch.distributed):
  torch_pad         pre-tokenized samples -> torch DataLoader(batch_size=B, shuffle=True,
                    num_workers=W) + a collate padding to the batch max (DataCollatorWithPadding)
  torch_pack        same, with a packing collate: rows of --max-len, position_ids per sample
  dynabatch_padded  dynabatch.DataLoader(costing=Costing(collate="padded")), method dp, planning in the loop
  dynabatch_packed  dynabatch.DataLoader(costing=Costing(collate="packed")), method dp_varlen
B = round(--global-batch-tokens / mean sample length), so both sides put about as many tokens in a step.
Setup is not timed for either side (reported as setup_s): the baselines tokenize every sample up
front, dynabatch builds its length index and token cache up front (the loader's scan into an
index cache and its token file, one tokenization pass); dynabatch plans every step inside the timed loop (in a planning thread, in
each worker with --workers > 0) and collates from the cached token ids.

columns:
  mbatches / mbatch/s  batches (micro-batches for dynabatch) delivered, and per second
  samples/s            samples delivered per second (each sample exactly once per epoch)
  real tok/s           real (non-padding) tokens per second
  pad eff              real tokens / tokens in the yielded input_ids tensors
  x torch_pad          samples/s over torch_pad's at the same worker count

examples:
  dynabatch bench loader
  dynabatch bench loader --limit 20000 --workers 0 --json
  dynabatch bench loader --data ../shared/data/text/niv2_sample.jsonl.gz --global-batch-tokens 32768 --max-len 2048
"""


def add_bench_loader_command(bench_sub) -> None:
    """Register ``dynabatch bench loader`` on the ``bench`` subparsers."""
    p = add_subcommand(bench_sub, "loader", BENCH_LOADER_HELP, BENCH_LOADER_DESCRIPTION, BENCH_LOADER_EPILOG)
    add_data_option(p, "text files (.jsonl / .jsonl.gz)", " + ".join(DEFAULT_TEXT_DATA))
    p.add_argument("--limit", type=int, default=None, metavar="N", help="use only the first N samples")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2], metavar="W",
                   help="num_workers values to run every method with (default: 0 2)")
    p.add_argument("--global-batch-tokens", type=int, default=65536,
                   help="dynabatch's global batch in tokens; sets the baselines' batch size (default 65536, as everywhere in dynabatch)")
    p.add_argument("--max-len", type=int, default=1024,
                   help="truncation for every method and the packing row length (default 1024)")
    p.add_argument("--tokenizer", default="bytes", help="tokenization.load_tokenizer spec (default: bytes)")
    p.add_argument("--cost-model", default="gpt", help="dynabatch cost model preset (default gpt)")
    p.add_argument("--device", default="a100-80gb", help="cost model device preset (default a100-80gb)")
    p.add_argument("--num-stages", "--stages", dest="stages", type=int, default=1, help="pipeline stages dynabatch plans for (default 1)")
    p.add_argument("--methods", nargs="+", choices=LOADER_METHODS, default=list(LOADER_METHODS), metavar="METHOD",
                   help=f"among {' '.join(LOADER_METHODS)} (default: all)")
    p.add_argument("--seed", type=int, default=0, help="shuffle / global-batch seed (default 0)")
    add_output_options(p, "a bar of the samples loaded (every method and worker count)")
    p.set_defaults(func=lazy_handler("dynabatch.bench.loader", "bench_loader_command"))
