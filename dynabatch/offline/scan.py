"""`scan_dataset`: the length index of a whole dataset (token counts per sample), in parallel.

The dataset is opened once with `loaders.open_source`; its rows are split into ``parts`` slots
with the loaders' own layout (``with_layout(rank=i, world_size=parts)``: the union of the slots
is every sample exactly once); each part is tokenized with `tokenization.scan_shapes` in a
worker (`engines.map_parts`: local processes or Ray Data); the parts are merged with
`tokenization.concat_length_tables`. The result is made independent of how the work was cut:
task names are sorted (``task_id`` indexes that sorted list) and rows are sorted by
``sample_id``, so a scan with 1 worker and a scan with 8 workers, local or on Ray, write the
same bytes.

The index is a Parquet file with the columns of `tokenization.SHAPE_SCHEMA`::

    sample_id      int64  (file index << 32) | line/row of the sample (the loaders' id)
    input_tokens   int32  input / prompt tokens (BOS included when the tokenizer adds one)
    target_tokens  int32  target / response tokens, EOS included
    vision_tokens  int32  image tokens summed over the sample's images (0 for text)
    task_id        int32  index into the task names of the metadata, -1 = unknown

and metadata ``dynabatch.task_names`` (JSON list), ``dynabatch.scan_stats`` (rows, skipped,
truncated, the first skipped keys), ``dynabatch.scan`` (data paths, tokenizer, family, max
lengths, vision policy, on_error, loader error counts) and ``dynabatch.dataset_fingerprint``.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..core.shapes import Shapes
from .engines import default_workers, map_parts
from .inputs import FINGERPRINT_KEY, Index, OfflineError, tokenizer_spec

FAMILIES = ("decoder", "encoder_decoder")
VISION_POLICIES = ("fixed", "tiling")
INDEX_FORMAT = "dynabatch.length_index"


@dataclass(frozen=True)
class ScanConfig:
    """How samples become token counts (see `tokenization.scan_shapes`).

    ``tokenizer``: a `load_tokenizer` spec (``bytes``, a ``tokenizer.json``, a sentencepiece
    ``.model``, ``tiktoken:<encoding>``). ``family``: ``decoder`` (prompt and response counted
    separately, summed by the planner) or ``encoder_decoder``. ``max_len``: tokens kept per
    sample (decoder: input + target; encoder_decoder: input), ``max_target_len``: target tokens
    kept; None keeps full lengths (the planner truncates with its own max lengths anyway).
    ``vision``: ``fixed`` (336-px images, 576 tokens each) or ``tiling`` (InternVL's 448-px
    dynamic tiles, 256 tokens per tile), None for text. ``on_error``: ``raise`` on the first bad
    sample, or ``skip`` and count bad samples.
    """

    tokenizer: str = "bytes"
    family: str = "decoder"
    max_len: int | None = None
    max_target_len: int | None = None
    vision: str | None = None
    on_error: str = "raise"
    batch_size: int = 1024

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokenizer", tokenizer_spec(self.tokenizer))
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.vision not in (None, *VISION_POLICIES):
            raise ValueError(f"vision must be one of {VISION_POLICIES} or None, got {self.vision!r}")
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")

    def scan_kwargs(self) -> dict:
        """Keyword arguments of `tokenization.scan_shapes` for this configuration."""
        from tokenization import DynamicTiling, FixedResolution

        vision = {"fixed": FixedResolution, "tiling": DynamicTiling}.get(self.vision)
        kw = dict(family=self.family, vision=vision() if vision else None, batch_size=self.batch_size,
                  max_target_tokens=self.max_target_len, on_error=self.on_error)
        if self.family == "decoder":
            kw["max_total_tokens"] = self.max_len
        else:
            kw["max_input_tokens"] = self.max_len
        return kw


@dataclass(frozen=True)
class _Part:
    source: object  # a loaders Source (pickled once per worker)
    config: ScanConfig
    num_parts: int


@dataclass(frozen=True)
class ScanResult:
    """A finished scan: the index ``table`` and how it was made (``seconds`` of wall time, the
    ``engine``, ``workers`` and number of ``parts`` the rows were split into)."""

    table: pa.Table
    seconds: float
    engine: str
    workers: int
    parts: int

    @property
    def meta(self) -> dict:
        """The ``dynabatch.scan`` metadata (paths, options, loader error counts)."""
        return json.loads(self.table.schema.metadata[b"dynabatch.scan"])

    @property
    def index(self) -> Index:
        """The index as `Shapes` plus task names, ready for planning."""
        from tokenization import task_names_of

        return Index(Shapes.from_arrow(self.table), task_names_of(self.table), self.meta["data"], True,
                     {k: v for k, v in self.meta.items() if k not in ("data", "loader_errors")})

    def summary(self) -> dict:
        """JSON-able figures: samples, skipped (by kind), truncated, tasks, token totals, timing."""
        from tokenization import scan_stats, task_names_of

        stats = scan_stats(self.table)
        loader_errors = self.meta.get("loader_errors", {})
        skipped = dict(loader_errors)
        if stats.num_skipped:
            skipped["sample"] = stats.num_skipped
        col = lambda c: self.table.column(c).to_numpy().astype(np.int64)  # noqa: E731
        inp, tgt, vis = col("input_tokens"), col("target_tokens"), col("vision_tokens")
        total = inp + tgt + vis
        return {
            "samples": self.table.num_rows,
            "skipped": sum(skipped.values()),
            "skipped_by_kind": skipped,
            "skipped_examples": [list(s) for s in stats.skipped[:5]],
            "truncated": stats.num_truncated,
            "tasks": len(task_names_of(self.table)),
            "input_tokens": int(inp.sum()),
            "target_tokens": int(tgt.sum()),
            "vision_tokens": int(vis.sum()),
            "tokens_per_sample": {"mean": float(total.mean()) if len(total) else 0.0,
                                  "p50": float(np.percentile(total, 50)) if len(total) else 0.0,
                                  "p99": float(np.percentile(total, 99)) if len(total) else 0.0,
                                  "max": int(total.max(initial=0))},
            "fingerprint": self.table.schema.metadata[FINGERPRINT_KEY.encode()].decode(),
            "tokenizer": self.meta["tokenizer"],
            "engine": self.engine,
            "workers": self.workers,
            "parts": self.parts,
            "seconds": round(self.seconds, 3),
        }

    def write(self, path) -> None:
        """Write the index as Parquet (deterministic bytes for the same table)."""
        write_index(self.table, path)


def write_index(table: pa.Table, path) -> None:
    """Write a length index to ``path`` (Parquet, zstd)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, str(path), compression="zstd")


def _scan_part(part: _Part, i: int):
    """Tokenize slot ``i`` of ``part.num_parts``: (length table, loader error counts)."""
    from tokenization import scan_shapes

    src = part.source.with_layout(rank=i, world_size=part.num_parts, worker_id=0, num_workers=0)
    before = Counter(src.error_counts)  # damage found while indexing: counted once, by the caller
    table = scan_shapes(src, part.config.tokenizer, **part.config.scan_kwargs())
    return table, dict(Counter(src.error_counts) - before)


def _canonical(tables: list[pa.Table], data: list[str], config: ScanConfig, loader_errors: dict) -> pa.Table:
    """Merge part tables; sort task names and rows so the bytes do not depend on the split."""
    from tokenization import SCAN_STATS_KEY, SHAPE_SCHEMA, TASK_NAMES_KEY, ScanStats, concat_length_tables
    from tokenization import scan_stats, task_names_of

    merged = concat_length_tables(tables)
    names = task_names_of(merged)
    order_names = sorted(range(len(names)), key=names.__getitem__)
    remap = np.full(len(names) + 1, -1, np.int32)  # slot -1 keeps unknown (-1) unknown
    remap[order_names] = np.arange(len(names), dtype=np.int32)
    ids = merged.column("sample_id").to_numpy()
    order = np.argsort(ids, kind="stable")
    cols = {f.name: merged.column(f.name).to_numpy()[order] for f in SHAPE_SCHEMA}
    cols["task_id"] = remap[cols["task_id"]]
    stats = scan_stats(merged)
    stats = ScanStats(stats.num_samples, stats.num_skipped, stats.num_truncated, tuple(sorted(stats.skipped)))
    shapes = Shapes(**{k: cols[k] for k in ("sample_id", "input_tokens", "target_tokens", "vision_tokens",
                                            "task_id")})
    scan_meta = {"format": INDEX_FORMAT, "version": 1, "data": data, **asdict(config),
                 "loader_errors": dict(sorted(loader_errors.items()))}
    meta = {
        TASK_NAMES_KEY: json.dumps([names[k] for k in order_names]).encode(),
        SCAN_STATS_KEY: stats.to_json(),
        b"dynabatch.scan": json.dumps(scan_meta, sort_keys=True).encode(),
        FINGERPRINT_KEY.encode(): shapes.fingerprint().encode(),
    }
    arrays = [pa.array(cols[f.name].astype(f.type.to_pandas_dtype()), type=f.type) for f in SHAPE_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=SHAPE_SCHEMA.with_metadata(meta))


def scan_dataset(data, config: ScanConfig | None = None, *, engine: str = "local", workers: int | None = None,
                 parts: int | None = None, progress: bool = True) -> ScanResult:
    """Tokenize every sample of ``data`` (paths, globs or folders `loaders.open_source` reads)
    and return the length index (see the module docstring).

    ``workers``: processes (local) or CPUs of a Ray instance started here (default: the CPU
    count). ``parts``: slots the rows are split into (default ``2 * workers``; 1 when
    ``workers`` is 1). Bad input raises the loaders'/tokenizer's error, whose message names the
    file and line (or sample key), unless ``config.on_error == "skip"``.
    """
    import loaders

    config = config or ScanConfig()
    paths = [data] if isinstance(data, (str, Path)) else list(data)
    if not paths:
        raise OfflineError("scan: no data paths given")
    for p in paths:
        if not Path(p).exists() and not any(ch in str(p) for ch in "*?{["):
            raise OfflineError(f"{p}: no such file or directory")
    t0 = time.perf_counter()
    from tokenization import load_tokenizer

    load_tokenizer(config.tokenizer)  # a bad spec or a missing package fails here, once, not in every worker
    workers = workers or default_workers()
    num_parts = parts or (1 if workers == 1 else 2 * workers)
    source = loaders.open_source([str(p) for p in paths], on_error=config.on_error)
    weights = []
    for i in range(num_parts):
        units = source.plan(loaders.Layout(rank=i, world_size=num_parts), epoch=0)
        weights.append(sum(u.rows or 0 for u in units))
    results = map_parts(_scan_part, range(num_parts), _Part(source, config, num_parts), engine=engine,
                        workers=workers, progress=progress, desc="scan", unit="sample", weights=weights)
    loader_errors: dict[str, int] = {}
    for kind, n in getattr(source, "error_counts", {}).items():  # damage found while indexing
        loader_errors[kind] = loader_errors.get(kind, 0) + n
    for _, counts in results:
        for kind, n in counts.items():
            loader_errors[kind] = loader_errors.get(kind, 0) + n
    data_paths = [str(Path(p).resolve()) if Path(p).exists() else str(p) for p in paths]
    table = _canonical([t for t, _ in results], data_paths, config, loader_errors)
    return ScanResult(table, time.perf_counter() - t0, engine, workers, num_parts)
