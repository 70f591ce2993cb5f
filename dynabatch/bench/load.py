"""`dynabatch bench load`: samples/s and tokens/s from files to per-sample token counts.

Two paths read the same files in the same process, with the same tokenizer object and the
same batch size, and must produce the same sample and token counts:

* **dynabatch**: a `loaders` source (``JsonlSource``, ``ParquetSource``, ``HFSource`` from a
  ``save_to_disk`` folder, ``WebDatasetSource``) fed to `tokenization.scan_shapes`, which
  returns the length table that `dynabatch.Shapes` reads. Building the source (indexing the
  files) is timed. With ``workers > 1`` each worker process scans one slot
  (``source.with_layout(worker_id=k, num_workers=workers)``) and the tables are concatenated.
* **baseline**: what a user writes today. Text: ``datasets.load_dataset("json" | "parquet",
  data_files=...)`` (or ``load_from_disk``) + ``.map(tokenize, batched=True)`` returning the
  two lengths + a ``for row in ds`` loop, with ``num_proc=workers``. Webdataset:
  ``webdataset.WebDataset(...).decode()`` + the same text rendering, a batched tokenizer
  call, image sizes from ``PIL.Image.open`` on the bytes and the same `DynamicTiling` policy,
  through ``WebLoader(num_workers=workers)``.

Fairness: every baseline run is a *first* run. ``load_dataset`` gets a fresh, empty
``cache_dir`` in a temporary folder and ``.map`` runs with ``load_from_cache_file=False``;
``datasets`` would reuse its Arrow cache on a second run of the same script (dynabatch
keeps no cache: it reads the files every time). Preparation (limited copies, the Parquet and
``save_to_disk`` conversions, generated data) is not timed; both paths read its output.
"""

from __future__ import annotations

from ._format import fmt_rate
from .load_baseline import run_baseline_text, run_baseline_webdataset
from .load_common import add_data_option, add_output_options, add_subcommand, run_command
from .load_config import (BASELINE_PATHS, BASELINE_TEXT_COLUMNS, DEFAULT_TEXT_DATA, DYNABATCH_PATHS,
                          GENERATED_IMAGE_TEXT_SAMPLES, GENERATED_SHARDS, GENERATED_TEXT_SAMPLES, METHODS, SOURCES,
                          TEXT_SOURCES, LoadBenchConfig, LoadBenchError)
from .load_data import _quotas, default_text_data, prepare, repo_root, resolve_text
from .load_dynabatch import run_dynabatch
from .load_run import run_load_bench

__all__ = [
    "BASELINE_PATHS", "BASELINE_TEXT_COLUMNS", "BENCH_LOAD_EPILOG", "DEFAULT_TEXT_DATA", "DYNABATCH_PATHS",
    "GENERATED_IMAGE_TEXT_SAMPLES", "GENERATED_SHARDS", "GENERATED_TEXT_SAMPLES", "METHODS", "SOURCES",
    "TEXT_SOURCES", "LoadBenchConfig", "LoadBenchError", "_quotas", "add_bench_load_command", "default_text_data",
    "format_table", "prepare", "repo_root", "resolve_text", "run_baseline_text", "run_baseline_webdataset",
    "run_dynabatch", "run_load_bench",
]


def format_table(result: dict) -> str:
    """The human-readable report: one row per source and path, ratios dynabatch / baseline."""
    c = result["config"]
    lines = [
        f"tokenizer {c['tokenizer_name']}, batch {c['batch_size']} samples, workers {c['workers']} "
        f"(both paths), median of {c['repeat']} run(s); baseline runs are cold (empty datasets cache)",
    ]
    if c.get("text_data"):
        lines.append(f"text: {c['text_data']}")
    if c.get("image_text_data"):
        lines.append(f"image+text: {c['image_text_data']}")
    head = f"{'source':<11} {'path':<10} {'samples':>9} {'tokens':>12} {'time s':>7} {'cpu s':>6} " \
           f"{'samples/s':>10} {'tokens/s':>10} {'x baseline':>10}"
    lines += ["", head, "-" * len(head)]

    def rows(name, methods, ratio, agree=True):
        for m in METHODS:
            r = methods[m]
            x = f"{ratio['samples_per_s']:.2f}x" if m == "dynabatch" else ""
            flag = "" if agree else "  counts differ!"
            lines.append(f"{name if m == 'dynabatch' else '':<11} {m:<10} {r['samples']:>9} {r['tokens']:>12} "
                         f"{r['seconds']:>7.2f} {r['cpu_s']:>6.2f} {fmt_rate(r['samples_per_s']):>10} "
                         f"{fmt_rate(r['tokens_per_s']):>10} {x:>10}{flag if m == 'baseline' else ''}")

    for name, s in result["sources"].items():
        rows(name, s["methods"], s["ratio"], s["counts_agree"])
    if len(result["aggregate_over"]) > 1:
        lines.append("-" * len(head))
        rows("all " + "+".join(result["aggregate_over"]) if len(result["aggregate_over"]) < 3 else "text total",
             result["methods"], result["ratio"])
    agree = all(s["counts_agree"] for s in result["sources"].values())
    lines.append("")
    lines.append("sample and token counts agree on every source" if agree else
                 "WARNING: the two paths counted different samples or tokens (see 'counts differ!')")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line: `dynabatch bench load`

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
    p.set_defaults(func=_cmd_bench_load)


def _cmd_bench_load(args) -> int:
    return run_command(
        args, lambda: LoadBenchConfig(data=tuple(args.data or ()), image_text=args.image_text,
                                      sources=tuple(args.sources), limit=args.limit, repeat=args.repeat,
                                      workers=args.workers, tokenizer=args.tokenizer, batch_size=args.batch_size,
                                      seed=args.seed),
        run_load_bench, format_table)
