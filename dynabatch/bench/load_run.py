"""`dynabatch bench load`: timing both paths on every source and summarizing the runs.

`run_load_bench` prepares the inputs, runs each path ``repeat`` times per source (alternating
which goes first, each baseline run with a fresh ``datasets`` cache), and reports median wall
and CPU seconds, samples/s, tokens/s and the dynabatch / baseline ratios.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from .load_baseline import drop_map_cache, run_baseline_text, run_baseline_webdataset
from .load_common import failure_summary, per_s
from .load_config import BASELINE_PATHS, DYNABATCH_PATHS, METHODS, TEXT_SOURCES, LoadBenchConfig, LoadBenchError
from .load_data import Prepared, prepare
from .load_dynabatch import run_dynabatch


def _cpu_s() -> float:
    """CPU seconds used so far by this process (all threads) and its finished child processes.

    Less sensitive than wall time to other jobs on a shared machine; pyarrow's reader threads
    (baseline) and worker processes (both paths, once joined) are included.
    """
    try:
        import resource

        ch = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + ch.ru_utime + ch.ru_stime
    except ImportError:  # not on Unix: this process only
        return time.process_time()


def _rates(samples: int, tokens: int, runs: list[float], cpu: list[float]) -> dict:
    """One path on one source: the counts, median wall and CPU seconds of a run, and the rates."""
    sec = statistics.median(runs)
    return {"samples": samples, "tokens": tokens, "seconds": sec, "runs_s": runs, "cpu_s": statistics.median(cpu),
            "samples_per_s": per_s(samples, sec), "tokens_per_s": per_s(tokens, sec)}


def _ratio(methods: dict) -> dict:
    d, b = methods["dynabatch"], methods["baseline"]
    return {k: d[k] / b[k] if b[k] else float("inf") for k in ("samples_per_s", "tokens_per_s")}


def _aggregate(per_source: dict, names: list[str]) -> dict:
    """Per path, the sources ``names`` together: summed counts over summed median seconds."""
    out = {}
    for m in METHODS:
        s = sum(per_source[n]["methods"][m]["samples"] for n in names)
        t = sum(per_source[n]["methods"][m]["tokens"] for n in names)
        sec = sum(per_source[n]["methods"][m]["seconds"] for n in names)
        cpu = sum(per_source[n]["methods"][m]["cpu_s"] for n in names)
        out[m] = {"samples": s, "tokens": t, "seconds": sec, "cpu_s": cpu,
                  "samples_per_s": per_s(s, sec), "tokens_per_s": per_s(t, sec)}
    return out


@contextlib.contextmanager
def _serial_tokenizers(on: bool):
    """``TOKENIZERS_PARALLELISM=false`` while the block runs (when ``on`` and the caller has not set it), then
    the caller's environment again: its later subprocesses and launches see what it had (an import-time
    variable changed in the process gives `launch_local` a second fork server, a second preload of torch)."""
    own = on and "TOKENIZERS_PARALLELISM" not in os.environ
    if own:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if own:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)


def run_load_bench(cfg: LoadBenchConfig, progress: bool = True) -> dict:
    """Prepare the inputs, time both paths ``cfg.repeat`` times per source, report medians.

    Returns ``{"config", "sources": {name: {"methods": {"dynabatch": {...}, "baseline": {...}},
    "ratio", "counts_agree", ...}}, "methods", "ratio", "aggregate_over"}``; each method has
    ``samples``, ``tokens``, ``seconds`` (median wall time of one run), ``runs_s``,
    ``samples_per_s`` and ``tokens_per_s``. Top-level ``methods`` sums the text sources
    (samples over summed median seconds), or all sources when no text source ran.
    Raises `LoadBenchError` (or a ``loaders.LoaderError`` naming file and line) on bad input.
    """
    from tokenization import load_tokenizer

    from ..progress import progress_bar

    tok = load_tokenizer(cfg.tokenizer)
    # Forked workers must not inherit a busy Rust thread pool (tokenizers warns, may hang).
    with _serial_tokenizers(cfg.workers > 1), tempfile.TemporaryDirectory(prefix="dynabatch-bench-load-") as tmp_name:
        tmp = Path(tmp_name)
        prep = prepare(cfg, tmp, progress)
        runs = {s: {m: [] for m in METHODS} for s in cfg.sources}
        cpu = {s: {m: [] for m in METHODS} for s in cfg.sources}
        counts = {s: {} for s in cfg.sources}
        bar = progress_bar(len(cfg.sources) * cfg.repeat * 2, "bench load", "run", progress)
        try:
            for kind in cfg.sources:
                for r in range(cfg.repeat):
                    # Alternate which path goes first, so file-cache warmth favours neither.
                    for method in (METHODS if r % 2 == 0 else METHODS[::-1]):
                        bar.set_postfix_str(f"{kind} {method}")
                        cache = tmp / f"hf-cache-{kind}-{r}"  # fresh per run: nothing cached
                        cache.mkdir()
                        gc.collect()
                        c0, t0 = _cpu_s(), time.perf_counter()
                        counted = _run_one(kind, method, prep, tok, cfg, cache)
                        runs[kind][method].append(time.perf_counter() - t0)
                        cpu[kind][method].append(_cpu_s() - c0)
                        counts[kind][method] = counted
                        bar.update(1)
                        # Free the disk the run used (Arrow copies, .map caches), untimed.
                        shutil.rmtree(cache, ignore_errors=True)
                        if kind == "hf" and method == "baseline":
                            drop_map_cache(prep.hf_dir)
        finally:
            bar.close()
        gc.collect()

    per_source = {}
    for kind in cfg.sources:
        methods = {m: _rates(*counts[kind][m], runs[kind][m], cpu[kind][m]) for m in METHODS}
        files = {"jsonl": prep.text_files, "parquet": prep.parquet_files, "webdataset": prep.tar_files}.get(kind)
        per_source[kind] = {
            "methods": methods,
            "ratio": _ratio(methods),
            "counts_agree": counts[kind]["dynabatch"] == counts[kind]["baseline"],
            "dynabatch_path": DYNABATCH_PATHS[kind],
            "baseline_path": BASELINE_PATHS[kind],
            "files": [p.name for p in files] if files else ["save_to_disk folder"],
        }
    text = [k for k in cfg.sources if k in TEXT_SOURCES] or list(cfg.sources)
    methods = _aggregate(per_source, text)
    config = asdict(cfg)
    config.update(sources=list(cfg.sources), data=list(cfg.data), text_data=prep.text_label,
                  image_text_data=prep.tar_label, tokenizer_name=tok.name)
    return {"config": config, "sources": per_source, "methods": methods, "ratio": _ratio(methods),
            "aggregate_over": text}


def _run_one(kind: str, method: str, prep: Prepared, tok, cfg: LoadBenchConfig, cache: Path) -> tuple[int, int]:
    """One run of one path on one source: (samples, tokens); a library failure becomes one line."""
    import loaders

    try:
        if method == "dynabatch":
            return run_dynabatch(kind, prep, tok, cfg.tokenizer, cfg.batch_size, cfg.workers)
        if kind == "webdataset":
            return run_baseline_webdataset(prep, tok, cfg.batch_size, cfg.workers)
        return run_baseline_text(kind, prep, tok, cfg.batch_size, cfg.workers, cache)
    except (LoadBenchError, loaders.LoaderError):
        raise
    except Exception as e:  # a library failing deep inside: say which source and path
        raise LoadBenchError(f"{kind} {method} path failed: {failure_summary(e)}") from e
