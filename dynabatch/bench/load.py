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

import contextlib
import gc
import gzip
import io
import json
import os
import shutil
import statistics
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
from ._format import fmt_rate

SOURCES = ("jsonl", "parquet", "hf", "webdataset")
TEXT_SOURCES = ("jsonl", "parquet", "hf")
METHODS = ("dynabatch", "baseline")
#: The shared FLAN sample, relative to the repository root.
DEFAULT_TEXT_DATA = ("../shared/data/text/niv2_sample.jsonl.gz", "../shared/data/text/flan_cot_sample.jsonl.gz")
#: Generated data when the shared sample is absent / for ``--image-text generate``.
GENERATED_TEXT_SAMPLES = 20000
GENERATED_IMAGE_TEXT_SAMPLES = 512
GENERATED_SHARDS = 4
#: (inputs, targets) column pairs the text baseline understands (the loaders map more).
BASELINE_TEXT_COLUMNS = (("inputs", "targets"), ("input", "output"), ("prompt", "completion"), ("source", "target"))
BASELINE_PATHS = {
    "jsonl": "datasets.load_dataset('json') + .map(tokenize, batched=True) + for row in ds",
    "parquet": "datasets.load_dataset('parquet') + .map(tokenize, batched=True) + for row in ds",
    "hf": "datasets.load_from_disk + .map(tokenize, batched=True) + for row in ds",
    "webdataset": "webdataset.WebDataset().decode() + PIL header + batched tokenize via WebLoader",
}
DYNABATCH_PATHS = {
    "jsonl": "loaders.JsonlSource + tokenization.scan_shapes",
    "parquet": "loaders.ParquetSource + tokenization.scan_shapes",
    "hf": "loaders.open_source(save_to_disk dir) + tokenization.scan_shapes",
    "webdataset": "loaders.WebDatasetSource + tokenization.scan_shapes(vision=DynamicTiling())",
}


class LoadBenchError(ValueError):
    """Bad benchmark input (missing file, unusable columns, a path that failed); one-line message."""


@dataclass(frozen=True)
class LoadBenchConfig:
    """What `run_load_bench` measures.

    ``data``: text files (JSONL, ``.jsonl.gz``); empty = the shared FLAN sample if present,
    else generated shards. ``image_text``: a folder (or one file) of webdataset ``.tar``
    shards, or ``"generate"`` / None for generated shards. ``limit``: samples per data set (None = all).
    ``repeat``: runs per path (the median is reported). ``workers``: processes for both
    paths. ``tokenizer``: a `tokenization.load_tokenizer` spec. ``batch_size``: samples per
    tokenizer call on both paths.
    """

    data: tuple[str, ...] = ()
    image_text: str | None = "generate"
    sources: tuple[str, ...] = SOURCES
    limit: int | None = None
    repeat: int = 3
    workers: int = 1
    tokenizer: str = "bytes"
    batch_size: int = 1024
    seed: int = 0

    def __post_init__(self):
        bad = [s for s in self.sources if s not in SOURCES]
        if bad or not self.sources:
            raise LoadBenchError(f"--sources must be among {list(SOURCES)}, got {list(self.sources)}")
        for name, least in (("repeat", 1), ("workers", 1), ("batch_size", 1)):
            if getattr(self, name) < least:
                raise LoadBenchError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if self.limit is not None and self.limit < 1:
            raise LoadBenchError(f"limit must be >= 1 samples, got {self.limit}")


@dataclass
class _Prepared:
    """Input of each source after (untimed) preparation."""

    text_files: list[Path] = field(default_factory=list)
    text_label: str = ""
    parquet_files: list[Path] = field(default_factory=list)
    hf_dir: Path | None = None
    tar_files: list[Path] = field(default_factory=list)
    tar_label: str = ""
    same_columns: bool = True


# ---------------------------------------------------------------------------------------------
# Preparation (not timed)

def repo_root() -> Path:
    """The repository root (dynabatch is installed editable from it)."""
    return Path(__file__).resolve().parents[2]


def default_text_data() -> list[Path]:
    """The shared FLAN sample files that exist, resolved against the repository root."""
    return [p for p in ((repo_root() / d).resolve() for d in DEFAULT_TEXT_DATA) if p.is_file()]


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def _unique_names(paths: list[Path]) -> list[str]:
    """File names for copies in one folder: the original names, numbered only on a clash."""
    names = [p.name for p in paths]
    return [n if names.count(n) == 1 else f"{k}-{n}" for k, n in enumerate(names)]


def _count_records(path: Path) -> int:
    with _open_binary(path) as f:
        return sum(1 for line in f if line.strip())


def _quotas(counts: list[int], limit: int) -> list[int]:
    """Split ``limit`` samples over files in proportion to their sizes (largest remainders)."""
    total = sum(counts)
    if limit >= total:
        return counts
    exact = [c * limit / total for c in counts]
    q = [int(x) for x in exact]
    for i in sorted(range(len(counts)), key=lambda i: q[i] - exact[i])[: limit - sum(q)]:
        q[i] += 1
    return q


def _head_jsonl(src: Path, dst: Path, records: int) -> None:
    """Copy the lines of ``src`` up to its ``records``-th non-blank one, same compression (line
    numbers are kept, so error positions are those of the original file)."""
    lines, seen = [], 0
    with _open_binary(src) as f:
        for line in f:
            if seen >= records:
                break
            lines.append(line)
            seen += bool(line.strip())
    data = b"".join(lines)
    dst.write_bytes(gzip.compress(data, compresslevel=6, mtime=0) if dst.name.endswith(".gz") else data)


def _resolve_text(cfg: LoadBenchConfig, tmp: Path, progress: bool) -> tuple[list[Path], str]:
    if cfg.data:
        files = []
        for d in cfg.data:
            p = Path(d)
            if p.is_dir():
                found = sorted(q for q in p.iterdir() if q.name.endswith((".jsonl", ".jsonl.gz")))
                if not found:
                    raise LoadBenchError(f"{p}: directory holds no .jsonl/.jsonl.gz files")
                files += found
            elif p.is_file():
                if not p.name.endswith((".jsonl", ".jsonl.gz")):
                    raise LoadBenchError(f"{p}: bench load reads text as .jsonl or .jsonl.gz")
                files.append(p)
            else:
                raise LoadBenchError(f"{p}: no such file or directory")
        label = " ".join(p.name for p in files)
    else:
        files = default_text_data()
        label = " ".join(p.name for p in files) + " (shared FLAN sample)"
        if not files:
            from ..datagen import write_text_shards

            n = min(cfg.limit or GENERATED_TEXT_SAMPLES, GENERATED_TEXT_SAMPLES)
            files = write_text_shards(tmp / "generated_text", n, GENERATED_SHARDS, cfg.seed, format="jsonl.gz")
            return files, f"generated FLAN-like text ({n} samples, {len(files)} shards)"
    if cfg.limit is not None:
        counts = [_count_records(p) for p in files]
        quotas = _quotas(counts, cfg.limit)
        if quotas != counts:
            out = tmp / "limited"
            out.mkdir(exist_ok=True)
            limited = []
            for p, name, q in zip(files, _unique_names(files), quotas):
                if q:
                    _head_jsonl(p, out / name, q)
                    limited.append(out / name)
            files = limited
            label += f", first {cfg.limit} samples"
    return files, label


def _head_tar(src: Path, dst: Path, samples: int) -> None:
    """Copy the first ``samples`` samples (runs of members sharing a key) of a tar shard."""
    from webdataset.tariterators import base_plus_ext

    keys = 0
    last = None
    with tarfile.open(src, "r|*") as tin, tarfile.open(dst, "w") as tout:
        for m in tin:
            key = base_plus_ext(m.name)[0] if m.isfile() else None
            if key is not None and key != last:
                if keys >= samples:
                    break
                keys, last = keys + 1, key
            tout.addfile(m, tin.extractfile(m) if m.isfile() else None)


def _resolve_image_text(cfg: LoadBenchConfig, tmp: Path, progress: bool) -> tuple[list[Path], str]:
    if cfg.image_text in (None, "generate"):
        from ..datagen import write_image_text_shards

        n = min(cfg.limit or GENERATED_IMAGE_TEXT_SAMPLES, GENERATED_IMAGE_TEXT_SAMPLES)
        files = write_image_text_shards(tmp / "generated_image_text", n, GENERATED_SHARDS, cfg.seed,
                                        progress=progress)
        return files, f"generated image+text ({n} samples, {len(files)} shards)"
    p = Path(cfg.image_text)
    files = sorted(q for q in p.iterdir() if q.name.endswith(".tar")) if p.is_dir() else [p] if p.is_file() else []
    if not files:
        raise LoadBenchError(f"{p}: no webdataset .tar shards there")
    label = " ".join(q.name for q in files)
    if cfg.limit is not None:
        import loaders

        counts = [loaders.WebDatasetSource(str(q)).num_rows for q in files]
        quotas = _quotas(counts, cfg.limit)
        if quotas != counts:
            out = tmp / "limited_tar"
            out.mkdir(exist_ok=True)
            names = _unique_names(files)
            for q, name, k in zip(files, names, quotas):
                if k:
                    _head_tar(q, out / name, k)
            files = [out / name for name, k in zip(names, quotas) if k]
            label += f", first {cfg.limit} samples"
    return files, label


def _normalized_table(files: list[Path]):
    """The text files as one Arrow table per file of ``task``, ``inputs``, ``targets``, read
    through the loaders (so a bad line fails here with its file and line number)."""
    import pyarrow as pa

    import loaders

    tables = []
    for p in files:
        rows = {"task": [], "inputs": [], "targets": []}
        for s in loaders.JsonlSource(str(p)):
            for k in rows:
                rows[k].append(s[k])
        tables.append(pa.table(rows, schema=pa.schema([(k, pa.string()) for k in rows])))
    return tables


def _same_columns(files: list[Path]) -> bool:
    """Whether every file's first record has the same fields (one ``load_dataset`` call works)."""
    keys = set()
    for p in files:
        with _open_binary(p) as f:
            first = next((line for line in f if line.strip()), b"{}")
        try:
            keys.add(tuple(sorted(json.loads(first))))
        except (ValueError, TypeError):
            return False
    return len(keys) <= 1


def prepare(cfg: LoadBenchConfig, tmp: Path, progress: bool = False) -> _Prepared:
    """Resolve, limit, convert and generate the inputs of every selected source (untimed)."""
    from ..datagen import PARQUET_ROW_GROUP

    prep = _Prepared()
    if set(cfg.sources) & set(TEXT_SOURCES):
        prep.text_files, prep.text_label = _resolve_text(cfg, tmp, progress)
        prep.same_columns = _same_columns(prep.text_files)
        if {"parquet", "hf"} & set(cfg.sources):
            import datasets
            import pyarrow as pa
            import pyarrow.parquet as pq

            tables = _normalized_table(prep.text_files)
            out = tmp / "parquet"
            out.mkdir(exist_ok=True)
            for name, t in zip(_unique_names(prep.text_files), tables):
                prep.parquet_files.append(out / f"{name.split('.')[0]}.parquet")
                pq.write_table(t, prep.parquet_files[-1], row_group_size=PARQUET_ROW_GROUP)
            if "hf" in cfg.sources:
                prep.hf_dir = tmp / "hf_saved"
                ds = datasets.Dataset(pa.concat_tables(tables))
                with _quiet_datasets():
                    ds.save_to_disk(str(prep.hf_dir))
    if "webdataset" in cfg.sources:
        prep.tar_files, prep.tar_label = _resolve_image_text(cfg, tmp, progress)
    return prep


# ---------------------------------------------------------------------------------------------
# The two paths. Each returns (samples, tokens); tokens = input + target + vision tokens.

def _open_source(kind: str, prep: _Prepared):
    import loaders

    if kind == "jsonl":
        return loaders.JsonlSource([str(p) for p in prep.text_files])
    if kind == "parquet":
        return loaders.ParquetSource([str(p) for p in prep.parquet_files])
    if kind == "hf":
        return loaders.open_source(str(prep.hf_dir))
    return loaders.WebDatasetSource([str(p) for p in prep.tar_files])


def _table_counts(table) -> tuple[int, int]:
    tokens = sum(int(np.sum(table.column(c).to_numpy(), dtype=np.int64))
                 for c in ("input_tokens", "target_tokens", "vision_tokens"))
    return table.num_rows, tokens


def _scan_slot(source, tokenizer, vision, batch_size):
    """One worker's share: scan one slot of the source (module level: picklable)."""
    from tokenization import scan_shapes

    return scan_shapes(source, tokenizer, vision=vision, batch_size=batch_size)


def _pool(workers: int):
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # fork, like datasets' num_proc: workers inherit the imports instead of re-importing torch.
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
    return ProcessPoolExecutor(workers, mp_context=ctx)


def run_dynabatch(kind: str, prep: _Prepared, tok, tokenizer_spec: str, batch_size: int, workers: int):
    """The dynabatch path: loaders source -> `scan_shapes` -> length table. Returns (samples, tokens)."""
    from tokenization import DynamicTiling, concat_length_tables, scan_shapes

    vision = DynamicTiling() if kind == "webdataset" else None
    source = _open_source(kind, prep)
    if workers <= 1:
        return _table_counts(scan_shapes(source, tok, vision=vision, batch_size=batch_size))
    parts = [source.with_layout(rank=0, world_size=1, worker_id=k, num_workers=workers) for k in range(workers)]
    with _pool(workers) as pool:
        # The spec, not the object, goes to the workers: each loads its own tokenizer.
        tables = list(pool.map(partial(_scan_slot, tokenizer=tokenizer_spec, vision=vision,
                                       batch_size=batch_size), parts))
    return _table_counts(concat_length_tables(tables))


def _tokenize_text_batch(batch: dict, tok, input_col: str, target_col: str) -> dict:
    """The user's ``.map`` function: token counts of input and target (+1 EOS), as scan_shapes."""
    inputs = tok.encode_batch(batch[input_col])
    targets = tok.encode_batch([t or "" for t in batch[target_col]])
    return {"input_tokens": [len(a) for a in inputs], "target_tokens": [len(a) + 1 for a in targets]}


def _text_columns(names, where: str) -> tuple[str, str]:
    for i, t in BASELINE_TEXT_COLUMNS:
        if i in names and t in names:
            return i, t
    raise LoadBenchError(f"{where}: the datasets baseline needs one of the column pairs "
                         f"{['/'.join(p) for p in BASELINE_TEXT_COLUMNS]}; columns are {sorted(names)}")


@contextlib.contextmanager
def _quiet_datasets():
    """No datasets progress bars or info logs inside a timed run (they would be timed too)."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    level = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if was:
            datasets.enable_progress_bars()


def run_baseline_text(kind: str, prep: _Prepared, tok, batch_size: int, workers: int, cache_dir: Path):
    """``load_dataset`` / ``load_from_disk`` + batched ``.map`` + row iteration. Returns (samples, tokens).

    ``cache_dir`` should be empty (a first run: nothing cached); ``load_dataset`` writes its
    Arrow copy of the data there.
    """
    import datasets

    num_proc = workers if workers > 1 else None
    cache = str(cache_dir)
    with _quiet_datasets():
        if kind == "hf":
            ds = datasets.load_from_disk(str(prep.hf_dir))
        else:
            builder = "json" if kind == "jsonl" else "parquet"
            files = prep.text_files if kind == "jsonl" else prep.parquet_files
            if kind == "parquet" or prep.same_columns:
                ds = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train",
                                           cache_dir=cache, num_proc=num_proc)
            else:
                # Files with different fields (NIv2 vs CoT's extra "answer") make one
                # load_dataset call fail with a CastError: load each, keep the text, concatenate.
                parts = []
                for p in files:
                    part = datasets.load_dataset(builder, data_files=str(p), split="train", cache_dir=cache)
                    parts.append(part.select_columns(list(_text_columns(part.column_names, p.name))))
                ds = datasets.concatenate_datasets(parts)
        cols = _text_columns(ds.column_names, kind)
        ds = ds.map(partial(_tokenize_text_batch, tok=tok, input_col=cols[0], target_col=cols[1]),
                    batched=True, batch_size=batch_size, num_proc=num_proc,
                    remove_columns=ds.column_names, load_from_cache_file=False)
        samples = tokens = 0
        for row in ds:
            samples += 1
            tokens += row["input_tokens"] + row["target_tokens"]
    return samples, tokens


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_PREFIX = {"user": "User: ", "assistant": "Assistant: ", "system": "System: "}
_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


def _wds_pieces(sample: dict) -> dict:
    """One decoded webdataset sample -> the texts to tokenize and its image bytes.

    Decoder-only rendering, as `tokenization.ChatTemplate`: masked text (``"User: " + value +
    "\\n"`` ...) up to each ``"Assistant: "`` counts as input, each answer (+ EOS) as target.
    """
    rec = sample.get("json") or {}
    inputs, targets = [], []
    if "conversations" in rec or "messages" in rec:
        pending = ""
        for turn in rec.get("conversations") or rec.get("messages"):
            role = _ROLES[turn.get("from", turn.get("role"))]
            content = turn.get("value", turn.get("content"))
            if role != "assistant":
                pending += _PREFIX[role] + content + "\n"
                continue
            inputs.append(pending + _PREFIX["assistant"])
            pending = ""
            targets.append(content)
        if pending:
            inputs.append(pending)
    images = [v for k, v in sample.items() if k.rsplit(".", 1)[-1] in _IMAGE_EXTS]
    if not inputs and not targets:
        if "json" not in sample and "txt" in sample:  # a caption (with an image) or plain text
            rec = {"inputs": "", "targets": sample["txt"]} if images else {"inputs": sample["txt"], "targets": ""}
        inputs.append(rec.get("inputs", ""))
        targets.append(rec.get("targets", "") or "")
    return {"inputs": inputs, "targets": targets, "images": images}


def _wds_count_batch(batch: list[dict], tok, policy) -> tuple[int, int]:
    """Collation: one tokenizer call for the batch's texts, PIL headers for the image sizes."""
    from PIL import Image

    texts = [t for s in batch for t in s["inputs"]] + [t for s in batch for t in s["targets"]]
    n_targets = sum(len(s["targets"]) for s in batch)
    tokens = sum(len(a) for a in tok.encode_batch(texts)) + n_targets  # + one EOS per answer
    sizes = []
    for s in batch:
        for data in s["images"]:
            with Image.open(io.BytesIO(data)) as im:
                sizes.append(im.size)
    if sizes:
        wh = np.asarray(sizes, dtype=np.int64)
        tokens += int(policy.tokens(wh[:, 0], wh[:, 1]).sum())
    return len(batch), tokens


def run_baseline_webdataset(prep: _Prepared, tok, batch_size: int, workers: int):
    """``WebDataset().decode()`` + rendering + batched counting through ``WebLoader``. Returns (samples, tokens)."""
    import webdataset as wds

    from tokenization import DynamicTiling

    urls = [str(p) for p in prep.tar_files]
    pipeline = (wds.WebDataset(urls, shardshuffle=False, empty_check=False)
                .decode()
                .map(_wds_pieces)
                .batched(batch_size, collation_fn=partial(_wds_count_batch, tok=tok, policy=DynamicTiling())))
    loader = wds.WebLoader(pipeline, batch_size=None, num_workers=workers if workers > 1 else 0)
    samples = tokens = 0
    for n, t in loader:
        samples += n
        tokens += t
    return samples, tokens


# ---------------------------------------------------------------------------------------------
# Timing and report

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
    sec = statistics.median(runs)
    return {"samples": samples, "tokens": tokens, "seconds": sec, "runs_s": runs, "cpu_s": statistics.median(cpu),
            "samples_per_s": samples / sec if sec > 0 else float("inf"),
            "tokens_per_s": tokens / sec if sec > 0 else float("inf")}


def _ratio(methods: dict) -> dict:
    d, b = methods["dynabatch"], methods["baseline"]
    return {k: d[k] / b[k] if b[k] else float("inf") for k in ("samples_per_s", "tokens_per_s")}


def _aggregate(per_source: dict, names: list[str]) -> dict:
    out = {}
    for m in METHODS:
        s = sum(per_source[n]["methods"][m]["samples"] for n in names)
        t = sum(per_source[n]["methods"][m]["tokens"] for n in names)
        sec = sum(per_source[n]["methods"][m]["seconds"] for n in names)
        cpu = sum(per_source[n]["methods"][m]["cpu_s"] for n in names)
        out[m] = {"samples": s, "tokens": t, "seconds": sec, "cpu_s": cpu,
                  "samples_per_s": s / sec if sec > 0 else float("inf"),
                  "tokens_per_s": t / sec if sec > 0 else float("inf")}
    return out


def run_load_bench(cfg: LoadBenchConfig, progress: bool = True) -> dict:
    """Prepare the inputs, time both paths ``cfg.repeat`` times per source, report medians.

    Returns ``{"config", "sources": {name: {"methods": {"dynabatch": {...}, "baseline": {...}},
    "ratio", "counts_agree", ...}}, "methods", "ratio", "aggregate_over"}``; each method has
    ``samples``, ``tokens``, ``seconds`` (median wall time of one run), ``runs_s``,
    ``samples_per_s`` and ``tokens_per_s``. Top-level ``methods`` sums the text sources
    (samples over summed median seconds), or all sources when no text source ran.
    Raises `LoadBenchError` (or a ``loaders.LoaderError`` naming file and line) on bad input.
    """
    from tqdm.auto import tqdm

    from tokenization import load_tokenizer

    tok = load_tokenizer(cfg.tokenizer)
    if cfg.workers > 1:
        # Forked workers must not inherit a busy Rust thread pool (tokenizers warns, may hang).
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory(prefix="dynabatch-bench-load-") as tmp_name:
        tmp = Path(tmp_name)
        prep = prepare(cfg, tmp, progress)
        runs = {s: {m: [] for m in METHODS} for s in cfg.sources}
        cpu = {s: {m: [] for m in METHODS} for s in cfg.sources}
        counts = {s: {} for s in cfg.sources}
        bar = tqdm(total=len(cfg.sources) * cfg.repeat * 2, desc="bench load", unit="run", disable=not progress)
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
                            _drop_map_cache(prep.hf_dir)
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


def _run_one(kind: str, method: str, prep: _Prepared, tok, cfg: LoadBenchConfig, cache: Path) -> tuple[int, int]:
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
        first = (str(e).strip().splitlines() or [""])[0]
        raise LoadBenchError(f"{kind} {method} path failed: {type(e).__name__}: {first}") from e


def _drop_map_cache(hf_dir: Path | None) -> None:
    """``.map`` on a ``load_from_disk`` dataset writes its cache next to the data; remove it
    (``load_from_cache_file=False`` recomputes anyway; this keeps the temp folder small)."""
    if hf_dir is None:
        return
    for p in hf_dir.glob("cache-*.arrow"):
        with contextlib.suppress(OSError):
            p.unlink()
    for p in hf_dir.glob("tmp*"):
        shutil.rmtree(p, ignore_errors=True)


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
    import argparse

    p = bench_sub.add_parser(
        "load", help="samples/s and tokens/s: loaders + scan_shapes vs datasets / webdataset",
        description="Time reading files into per-sample token counts: dynabatch's loaders + scan_shapes "
                    "against the plain datasets.load_dataset + .map and webdataset pipelines, on the same "
                    "files in the same run, and print the ratio.",
        epilog=BENCH_LOAD_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="+", metavar="PATH",
                   help="text files (.jsonl / .jsonl.gz, FLAN-like inputs/targets) or folders; default: "
                        "the shared FLAN sample ../shared/data/text/{niv2,flan_cot}_sample.jsonl.gz "
                        "(relative to the repository root), else generated data")
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
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.set_defaults(func=_cmd_bench_load)


def _cmd_bench_load(args) -> int:
    import sys

    try:
        cfg = LoadBenchConfig(data=tuple(args.data or ()), image_text=args.image_text, sources=tuple(args.sources),
                              limit=args.limit, repeat=args.repeat, workers=args.workers,
                              tokenizer=args.tokenizer, batch_size=args.batch_size, seed=args.seed)
        result = run_load_bench(cfg, progress=not args.no_progress and not args.json)
    except (ValueError, ImportError, OSError) as e:
        # LoadBenchError, loaders.LoaderError ("file.jsonl:3: invalid JSON ...") and
        # tokenization.SampleError are ValueErrors: print one line, no traceback.
        print(f"dynabatch: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0
