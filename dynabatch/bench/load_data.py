"""`dynabatch bench load`: preparing the inputs of every source (untimed).

Resolves the text files (``--data``, the shared FLAN sample, or generated shards) and the
webdataset shards (``--image-text``), copies the first ``--limit`` samples, and converts the
text once into Parquet and a ``save_to_disk`` folder. Both measured paths read the output.
`resolve_text` is also the data resolution of `dynabatch bench loader`.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from loaders import optional_module

from .load_config import (DEFAULT_TEXT_DATA, GENERATED_IMAGE_TEXT_SAMPLES, GENERATED_SHARDS,
                          GENERATED_TEXT_SAMPLES, TEXT_SOURCES, LoadBenchConfig, LoadBenchError)


@dataclass
class Prepared:
    """Input of each source after (untimed) preparation."""

    text_files: list[Path] = field(default_factory=list)
    text_label: str = ""
    parquet_files: list[Path] = field(default_factory=list)
    hf_dir: Path | None = None
    tar_files: list[Path] = field(default_factory=list)
    tar_label: str = ""
    same_columns: bool = True


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


def file_quotas(counts: list[int], limit: int) -> list[int]:
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


def resolve_text(cfg: LoadBenchConfig, tmp: Path, progress: bool) -> tuple[list[Path], str]:
    """The text files to read and a label for the report. ``cfg`` needs ``data``, ``limit`` and
    ``seed`` (a `LoadBenchConfig` or `dynabatch.bench.loader.LoaderBenchConfig`); limited copies and
    generated shards go under ``tmp``."""
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
        quotas = file_quotas(counts, cfg.limit)
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
    base_plus_ext = optional_module("webdataset.tariterators", "bench load's webdataset shards").base_plus_ext

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
        quotas = file_quotas(counts, cfg.limit)
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


def prepare(cfg: LoadBenchConfig, tmp: Path, progress: bool = False) -> Prepared:
    """Resolve, limit, convert and generate the inputs of every selected source (untimed)."""
    from ..datagen import PARQUET_ROW_GROUP

    prep = Prepared()
    if set(cfg.sources) & set(TEXT_SOURCES):
        prep.text_files, prep.text_label = resolve_text(cfg, tmp, progress)
        prep.same_columns = _same_columns(prep.text_files)
        if {"parquet", "hf"} & set(cfg.sources):
            import pyarrow as pa
            import pyarrow.parquet as pq

            datasets = optional_module("datasets", "bench load's parquet/hf baselines")

            tables = _normalized_table(prep.text_files)
            out = tmp / "parquet"
            out.mkdir(exist_ok=True)
            for name, t in zip(_unique_names(prep.text_files), tables):
                prep.parquet_files.append(out / f"{name.split('.')[0]}.parquet")
                pq.write_table(t, prep.parquet_files[-1], row_group_size=PARQUET_ROW_GROUP)
            if "hf" in cfg.sources:
                prep.hf_dir = tmp / "hf_saved"
                ds = datasets.Dataset(pa.concat_tables(tables))
                with quiet_datasets():
                    ds.save_to_disk(str(prep.hf_dir))
    if "webdataset" in cfg.sources:
        prep.tar_files, prep.tar_label = _resolve_image_text(cfg, tmp, progress)
    return prep


@contextlib.contextmanager
def quiet_datasets():
    """No datasets progress bars or info logs inside a timed run (they would be timed too)."""
    datasets = optional_module("datasets", "bench load's datasets baseline")

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
