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
from .load_common import run_command
from .load_config import (BASELINE_PATHS, BASELINE_TEXT_COLUMNS, DEFAULT_TEXT_DATA, DYNABATCH_PATHS,
                          GENERATED_IMAGE_TEXT_SAMPLES, GENERATED_SHARDS, GENERATED_TEXT_SAMPLES, METHODS, SOURCES,
                          TEXT_SOURCES, LoadBenchConfig, LoadBenchError)
from .load_data import file_quotas, default_text_data, prepare, repo_root, resolve_text
from .load_dynabatch import run_dynabatch
from .load_run import run_load_bench

__all__ = [
    "BASELINE_PATHS", "BASELINE_TEXT_COLUMNS", "DEFAULT_TEXT_DATA", "DYNABATCH_PATHS",
    "GENERATED_IMAGE_TEXT_SAMPLES", "GENERATED_SHARDS", "GENERATED_TEXT_SAMPLES", "METHODS", "SOURCES",
    "TEXT_SOURCES", "LoadBenchConfig", "LoadBenchError", "file_quotas", "bench_load_command", "default_text_data",
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
# Command line: `dynabatch bench load` (its parser: `dynabatch.commands.bench_load`)

def bench_load_command(args) -> int:
    """Run ``dynabatch bench load`` with its parsed arguments (parser: `dynabatch.commands.bench_load`)."""
    return run_command(
        args, lambda: LoadBenchConfig(data=tuple(args.data or ()), image_text=args.image_text,
                                      sources=tuple(args.sources), limit=args.limit, repeat=args.repeat,
                                      workers=args.workers, tokenizer=args.tokenizer, batch_size=args.batch_size,
                                      seed=args.seed),
        run_load_bench, format_table)
