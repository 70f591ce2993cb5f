"""The one length scan of a dataset: `tokenization.scan_shapes` mapped over parts of a source.

A `loaders.Source` is read in its natural (unshuffled) order and split into ``parts`` slots with
the loaders' own layout (``with_layout(rank=i, world_size=parts)``: every sample is in exactly one
slot); each slot runs `tokenization.scan_shapes` (in this process, local worker processes or Ray
Data: `dynabatch.engines.map_parts`) and the parts are merged with
`tokenization.concat_length_tables`. The result does not depend on how the work was cut: rows are
sorted by ``sample_id`` and task names alphabetically (``task_id`` indexes the sorted list).

Three entry points share it: `scan_dataset` (``dynabatch scan`` / ``dynabatch plan`` on raw data,
data paths and a `ScanConfig`), `scan_source` (the DataLoader's own index and ``build_index``: a
source and a `Formatter`, plus loss-label counts and optionally the token cache) and `scan_parts`
under both.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..core.shapes import Shapes
from .table import (DATA_FILES_KEY, FINGERPRINT_KEY, INDEX_FORMAT, SCAN_KEY, SETTINGS_KEY, TOKEN_COLUMNS,
                    TOKEN_SETTINGS_KEY, LengthIndex, LengthIndexError, write_index)

FAMILIES = ("decoder", "encoder_decoder")
VISION_POLICIES = ("fixed", "tiling")
#: tiktoken encodings accepted without the ``tiktoken:`` prefix.
TIKTOKEN_ENCODINGS = ("cl100k_base", "o200k_base", "p50k_base", "p50k_edit", "r50k_base")


def tokenizer_spec(spec):
    """Normalize a ``--tokenizer`` value for `tokenization.load_tokenizer` (a tokenizer object is
    returned unchanged).

    ``None`` or ``"bytes"``: the built-in byte-level tokenizer (one token per UTF-8 byte: an
    over-estimate of subword counts, about 4x for English). A bare tiktoken encoding name
    (``cl100k_base``...) becomes ``tiktoken:<name>``; paths (``tokenizer.json``, a
    sentencepiece ``.model``, a transformers folder) are made absolute so worker processes
    started elsewhere find them.
    """
    if spec is None or spec == "bytes":
        return "bytes"
    if not isinstance(spec, (str, Path)):
        return spec
    if spec in TIKTOKEN_ENCODINGS:
        return f"tiktoken:{spec}"
    if spec.startswith("tiktoken:"):
        return spec
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


@dataclass(frozen=True)
class ScanConfig:
    """How samples become token counts (see `tokenization.scan_shapes`).

    ``tokenizer``: a `load_tokenizer` spec (``bytes``, a ``tokenizer.json``, a sentencepiece
    ``.model``, ``tiktoken:<encoding>``, or a tokenizer object: the metadata records its name).
    ``family``: ``decoder`` (prompt and response counted separately, summed by the planner) or
    ``encoder_decoder``. ``max_len``: tokens kept per
    sample (decoder: input + target; encoder_decoder: input), ``max_target_len``: target tokens
    kept; None keeps full lengths (the planner truncates with its own max lengths anyway).
    ``vision``: ``fixed`` (336-px images, 576 tokens each) or ``tiling`` (InternVL's 448-px
    dynamic tiles, 256 tokens per tile), None for text; its vision tokens count towards ``max_len``
    (the text is cut to make room, a sample whose images alone pass it is refused). ``on_error``:
    ``raise`` on the first bad sample, or ``skip`` and count bad samples. ``image_token_id`` (needs
    ``vision``): count as a `DataLoader` with the same ``image_token_id=`` formats, LLaVA-style image
    placeholders in the ids (``<image>`` markers are replaced by the placeholder runs, so they are not
    counted as text; see `tokenization.FormatConfig.image_token_id`); None: no placeholders.
    ``chat_template``: how ``messages`` are rendered, as a `DataLoader` with the same ``chat_template=``
    (`tokenization.FormatConfig.chat_template`: None the tokenizer's own Jinja template, else the plain
    format with a warning; ``"tokenizer"``, ``"plain"`` or a Jinja template's text); the index records
    which rendering was used (`tokenization.ChatRenderer.record`).
    """

    tokenizer: object = "bytes"
    family: str = "decoder"
    max_len: int | None = None
    max_target_len: int | None = None
    vision: str | None = None
    on_error: str = "raise"
    batch_size: int = 1024
    image_token_id: int | None = None
    chat_template: str | None = None

    def __post_init__(self) -> None:
        from tokenization import FormatConfig

        object.__setattr__(self, "tokenizer", tokenizer_spec(self.tokenizer))
        FormatConfig(chat_template=self.chat_template)  # refuses a value that is no template
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.vision not in (None, *VISION_POLICIES):
            raise ValueError(f"vision must be one of {VISION_POLICIES} or None, got {self.vision!r}")
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        tid = self.image_token_id
        if tid is not None:
            if isinstance(tid, bool) or not isinstance(tid, (int, np.integer)) or tid < 0:
                raise ValueError(f"image_token_id must be a token id (int >= 0) or None, got {tid!r}")
            if self.vision is None:
                raise ValueError("image_token_id needs a vision policy (vision='tiling' or 'fixed'): it sets how "
                                 "many placeholder tokens each image gets")
            object.__setattr__(self, "image_token_id", int(tid))

    def scan_kwargs(self) -> dict:
        """Keyword arguments of `tokenization.scan_shapes` for this configuration."""
        from tokenization import DynamicTiling, FixedResolution

        vision = {"fixed": FixedResolution, "tiling": DynamicTiling}.get(self.vision)
        kw = dict(family=self.family, vision=vision() if vision else None, batch_size=self.batch_size,
                  max_target_tokens=self.max_target_len, on_error=self.on_error)
        if self.image_token_id is not None:
            kw["image_token_id"] = self.image_token_id
        if self.chat_template is not None:
            kw["chat_template"] = self.chat_template
        if self.family == "decoder":
            kw["max_total_tokens"] = self.max_len
        else:
            kw["max_input_tokens"] = self.max_len
        return kw


# -- the scan ---------------------------------------------------------------------------------

def natural_order(source, rank: int = 0, world_size: int = 1):
    """Slot ``rank`` of ``world_size`` of a source, unshuffled, at epoch 0 (``sample_id`` order)."""
    src = source.with_layout(rank=rank, world_size=world_size, worker_id=0, num_workers=0).fresh(
        shuffle=False, shuffle_buffer=0)
    src.set_epoch(0)
    return src


@dataclass(frozen=True)
class _Job:
    source: object  # a loaders Source (pickled once per worker)
    tokenizer: object  # a load_tokenizer spec, or a tokenizer object (in-process only)
    kwargs: dict  # of tokenization.scan_shapes
    num_parts: int


def _scan_part(job: _Job, i: int):
    """`tokenization.scan_shapes` of slot ``i``: (length table, loader error counts)."""
    from tokenization import scan_shapes

    src = natural_order(job.source, i, job.num_parts)
    before = Counter(src.error_counts)  # damage found while indexing: counted once, by the caller
    table = scan_shapes(src, job.tokenizer, **job.kwargs)
    return table, dict(Counter(src.error_counts) - before)


def canonical(table: pa.Table) -> pa.Table:
    """A merged length table with rows sorted by ``sample_id`` and task names sorted (``task_id``
    remapped), skipped-sample examples sorted: the same table however the work was cut."""
    from tokenization import SCAN_STATS_KEY, TASK_NAMES_KEY, ScanStats, scan_stats, task_names_of

    names = task_names_of(table)
    by_name = sorted(range(len(names)), key=names.__getitem__)
    remap = np.full(len(names) + 1, -1, np.int32)  # slot -1 keeps unknown (-1) unknown
    remap[by_name] = np.arange(len(names), dtype=np.int32)
    order = np.argsort(table.column("sample_id").to_numpy(), kind="stable")
    out = table.take(pa.array(order))
    task_id = remap[out.column("task_id").to_numpy()]
    out = out.set_column(out.column_names.index("task_id"), out.schema.field("task_id"), pa.array(task_id))
    s = scan_stats(table)
    stats = ScanStats(s.num_samples, s.num_skipped, s.num_truncated, tuple(sorted(s.skipped)))
    return out.replace_schema_metadata({TASK_NAMES_KEY: json.dumps([names[k] for k in by_name]).encode(),
                                        SCAN_STATS_KEY: stats.to_json()})


def scan_parts(source, tokenizer, kwargs: dict, *, engine: str = "local", workers: int | None = 1,
               parts: int | None = None, progress: bool = False) -> tuple[pa.Table, dict]:
    """The one scan: `tokenization.scan_shapes` (with ``kwargs``) over ``parts`` slots of ``source`` on
    ``engine`` (default ``2 * workers`` slots, 1 for one worker), merged into one `canonical` table.
    Returns it and the loader error counts by kind (found while indexing and while reading)."""
    import loaders

    from ..engines import default_workers, map_parts

    workers = workers or default_workers()
    num_parts = parts or (1 if workers == 1 else 2 * workers)
    weights = [sum(u.rows or 0 for u in source.plan(loaders.Layout(rank=i, world_size=num_parts), epoch=0))
               for i in range(num_parts)] if progress else None
    results = map_parts(_scan_part, range(num_parts), _Job(source, tokenizer, kwargs, num_parts), engine=engine,
                        workers=workers, progress=progress, desc="scan", unit="sample", weights=weights)
    errors = Counter(getattr(source, "error_counts", {}))
    for _, counts in results:
        errors.update(counts)
    from tokenization import concat_length_tables

    return canonical(concat_length_tables([t for t, _ in results])), dict(sorted(errors.items()))


def _finish(table: pa.Table, meta: dict) -> pa.Table:
    """``table`` with extra metadata and its dataset fingerprint."""
    full = dict(table.schema.metadata or {})
    full.update(meta)
    full[FINGERPRINT_KEY] = Shapes.from_arrow(table).fingerprint().encode()
    return table.replace_schema_metadata(full)


# -- dynabatch scan / plan --------------------------------------------------------------------

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
        return json.loads(self.table.schema.metadata[SCAN_KEY])

    @property
    def index(self) -> LengthIndex:
        """The index as a `LengthIndex` (Shapes, task names, where it came from), ready for planning."""
        from tokenization import task_names_of

        files = self.table.schema.metadata.get(DATA_FILES_KEY)
        return LengthIndex(Shapes.from_arrow(self.table), task_names_of(self.table), self.meta["data"], True,
                           {k: v for k, v in self.meta.items() if k not in ("data", "loader_errors")},
                           data_files=json.loads(files) if files is not None else None)

    def summary(self) -> dict:
        """JSON-able figures: samples, skipped (by kind), truncated, tasks, token totals, timing."""
        from tokenization import scan_stats, task_names_of

        stats = scan_stats(self.table)
        skipped = dict(self.meta.get("loader_errors", {}))
        if stats.num_skipped:
            skipped["sample"] = stats.num_skipped
        col = lambda c: self.table.column(c).to_numpy().astype(np.int64)  # noqa: E731
        inp, tgt, vis = col("input_tokens"), col("target_tokens"), col("vision_tokens")
        total = inp + tgt + vis
        pct = lambda q: float(np.percentile(total, q)) if len(total) else 0.0  # noqa: E731
        return {
            "samples": self.table.num_rows, "skipped": sum(skipped.values()), "skipped_by_kind": skipped,
            "skipped_examples": [list(s) for s in stats.skipped[:5]], "truncated": stats.num_truncated,
            "tasks": len(task_names_of(self.table)), "input_tokens": int(inp.sum()),
            "target_tokens": int(tgt.sum()), "vision_tokens": int(vis.sum()),
            "tokens_per_sample": {"mean": float(total.mean()) if len(total) else 0.0, "p50": pct(50),
                                  "p99": pct(99), "max": int(total.max(initial=0))},
            "fingerprint": self.table.schema.metadata[FINGERPRINT_KEY].decode(), "tokenizer": self.meta["tokenizer"],
            "chat_template": self.meta.get("chat_template"),
            "engine": self.engine, "workers": self.workers, "parts": self.parts, "seconds": round(self.seconds, 3),
        }

    def write(self, path) -> None:
        """Write the index (`dynabatch.index.write_index`: deterministic bytes for the same table)."""
        write_index(self.table, path)


def scan_dataset(data, config: ScanConfig | None = None, *, engine: str = "local", workers: int | None = None,
                 parts: int | None = None, progress: bool = True, storage_options: dict | None = None) -> ScanResult:
    """Tokenize every sample of ``data`` (paths, globs or folders `loaders.open_source` reads)
    and return the length index (see the module docstring; metadata ``dynabatch.scan`` records
    the data paths, the `ScanConfig` and the loader error counts).

    ``workers``: processes (local) or CPUs of a Ray instance started here (default: the CPU
    count; on the local engine at most one per `dynabatch.engines.SAMPLES_PER_WORKER` rows of the
    data, so a small scan runs in this process). ``parts``: slots the rows are split into (default
    ``2 * workers``; 1 when ``workers`` is 1). Bad input raises the loaders'/tokenizer's error, whose
    message names the file and line (or sample key), unless ``config.on_error == "skip"``. Remote data (``s3://``,
    ``gs://``, ``memory://``...) is read through fsspec with ``storage_options`` (else the
    backend's defaults: environment credentials, ``FSSPEC_S3_ENDPOINT_URL``...).
    """
    import loaders
    from tokenization import load_tokenizer, resolve_chat, tokenizer_fingerprint

    from ..engines import workers_for

    config = config or ScanConfig()
    paths = [data] if isinstance(data, (str, Path)) else list(data)
    if not paths:
        raise LengthIndexError("scan: no data paths given")
    for p in paths:  # URLs (s3://...) are checked by loaders.open_source, which names a missing one
        if not loaders.is_url(p) and not Path(p).exists() and not any(ch in str(p) for ch in "*?{["):
            raise LengthIndexError(f"{p}: no such file or directory")
    t0 = time.perf_counter()
    tok = load_tokenizer(config.tokenizer)  # a bad spec or a missing package fails here, once, not in every worker
    chat = resolve_chat(config.chat_template, tok, config.family)  # and a template that does not fit it
    # a string spec travels to the workers as is; an object as its adapter (adapters pickle)
    spec = config.tokenizer if isinstance(config.tokenizer, str) else tok
    source = loaders.open_source([str(p) for p in paths], on_error=config.on_error,
                                 **({"storage_options": storage_options} if storage_options else {}))
    workers = workers_for(source.num_rows, workers, engine)
    num_parts = parts or (1 if workers == 1 else 2 * workers)
    table, errors = scan_parts(source, spec, config.scan_kwargs(), engine=engine, workers=workers,
                               parts=num_parts, progress=progress)
    data_paths = [str(Path(p).resolve()) if not loaders.is_url(p) and Path(p).exists() else str(p) for p in paths]
    options = {f.name: getattr(config, f.name) for f in fields(config)}
    if options["image_token_id"] is None:  # recorded only when set (indexes scanned without it read the same)
        del options["image_token_id"]
    options["tokenizer"] = spec if isinstance(spec, str) else tok.name
    options["chat_template"] = chat.record()  # which rendering, not the template's text
    options["tokenizer_hash"] = tokenizer_fingerprint(tok)
    scan_meta = {"format": INDEX_FORMAT, "version": 1, "data": data_paths, **options, "loader_errors": errors}
    table = _finish(table, {SCAN_KEY: json.dumps(scan_meta, sort_keys=True).encode(),
                            DATA_FILES_KEY: json.dumps(loaders.file_fingerprints(source)).encode()})
    return ScanResult(table, time.perf_counter() - t0, engine, workers, num_parts)


def check_ids_in_data(index: LengthIndex, name: str) -> None:
    """Refuse an index naming samples that the data it was scanned from (``scan_options["data"]``)
    does not hold: a negative id, a file index past the data's files, or a row past its file's
    rows. Skipped when the data is not where the index says (it may be planned elsewhere)."""
    import loaders

    data = index.scan_options.get("data") or []
    if not data or any(loaders.is_url(p) for p in data) or not all(Path(p).exists() for p in data):
        return  # remote data is not read again just to check ids

    shards = loaders.open_source(list(data), on_error="skip").shards
    rows = np.array([s.num_rows if s.num_rows is not None else np.iinfo(np.int64).max for s in shards] or [0],
                    np.int64)
    ids = index.shapes.sample_id
    shard, pos = ids >> 32, ids & 0xFFFFFFFF
    bad = (ids < 0) | (shard >= len(shards)) | (pos >= rows[np.clip(shard, 0, len(rows) - 1)])
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        where = (f"file {int(shard[k])} ({shards[int(shard[k])].name}, {int(rows[shard[k]])} rows)"
                 if 0 <= shard[k] < len(shards) else f"file {int(shard[k])} (the data has {len(shards)} files)")
        raise LengthIndexError(f"{name}: sample_id {int(ids[k])} is not in the data it was scanned from: {where} "
                               f"has no row {int(pos[k])} ({int(bad.sum())} such ids); the index is stale or "
                               "edited: re-scan the data (dynabatch scan)")


# -- the DataLoader's own index ---------------------------------------------------------------

def index_settings(formatter, vision, source=None) -> dict:
    """The tokenization settings an index depends on (a rebuilt index must match them)."""
    from tokenization import tokenizer_fingerprint

    cfg = formatter.config
    out = {
        "tokenizer": getattr(formatter.tokenizer, "name", type(formatter.tokenizer).__name__),
        "tokenizer_hash": tokenizer_fingerprint(formatter.tokenizer),
        "vocab_size": int(getattr(formatter.tokenizer, "vocab_size", 0)),
        "family": cfg.family, "max_input_tokens": cfg.max_input_tokens, "max_target_tokens": cfg.max_target_tokens,
        "max_total_tokens": cfg.max_total_tokens, "truncation_side": cfg.truncation_side, "add_bos": cfg.add_bos,
        "chat_template": formatter.chat.record(), "vision": repr(vision),
    }
    if cfg.pretokenized is not None:  # set explicitly (None: detected per row)
        out["pretokenized"] = cfg.pretokenized
    if cfg.image_token_id is not None:  # placeholders replace the <image> markers: other text counts
        out["image_token_id"] = int(cfg.image_token_id)
    if vision is not None or formatter.vision is not None:
        # vision tokens count towards the max lengths (label counts and refused samples depend on it);
        # indexes built before they did lack this key and are rebuilt
        out["vision_in_max_len"] = True
    if source is not None:
        out["source_fingerprint"] = source.fingerprint()
    return out


LOADER_ERRORS_KEY = b"dynabatch.loader_errors"  # of scan_source: {kind: count} of skipped bad records


def scan_source(source, formatter, *, vision=None, batch_size: int = 512, on_error: str = "raise",
                keep_tokens: bool = False, token_budget: int | None = None, progress: bool | None = None,
                token_sink=None) -> pa.Table:
    """The length table of a whole `loaders.Source` for the DataLoader (`scan_parts`, in this process).

    The Shapes columns hold *full* token counts (as ``dynabatch scan`` writes them for the same
    tokenizer, family and vision policy, so plan files made from either match the same
    fingerprint); ``label_tokens`` counts the loss labels under ``formatter``'s max lengths, and a
    sample they refuse (its vision tokens alone pass them) has no row (``on_error="skip"``; else it
    raises). The metadata records the tokenization settings (`index_settings`). ``keep_tokens`` (text only)
    also keeps every sample's token ids under ``formatter`` in the `TOKEN_COLUMNS` (the token
    cache), unless they pass ``token_budget`` bytes; ``token_sink`` (text only) instead receives them
    batch by batch (`tokenization.scan_shapes`' ``ids_sink``, e.g. a `TokenFileWriter.add`), and the
    table keeps none. ``progress``: a tqdm bar of scanned samples (None: only when stderr is a terminal).
    """
    if getattr(source, "max_samples_per_epoch", None) is not None:
        raise ValueError("the indexed mode plans every sample of the source; a source with max_samples_per_epoch "
                         "(a per-epoch cap) only works in the streaming mode (mode='streaming')")
    cfg = formatter.config
    full = replace(cfg, max_input_tokens=None, max_target_tokens=None, max_total_tokens=None)
    text = vision is None and formatter.vision is None
    keep_tokens = keep_tokens and text and token_sink is None
    kwargs = dict(family=cfg.family, vision=formatter.vision, batch_size=batch_size, truncation_side=full.truncation_side,
                  add_bos=full.add_bos, chat_template=full.chat_template, pretokenized=full.pretokenized,
                  on_error=on_error, label_config=cfg,
                  keep_ids=keep_tokens, ids_budget=token_budget, ids_sink=token_sink if text else None,
                  progress=progress,
                  progress_total=getattr(source, "num_rows", None), progress_desc="dynabatch: length index")
    table, errors = scan_parts(source, formatter.tokenizer, kwargs, workers=1)
    import loaders

    settings = json.dumps(index_settings(formatter, vision, source), sort_keys=True).encode()
    meta = {SETTINGS_KEY: settings, DATA_FILES_KEY: json.dumps(loaders.file_fingerprints(source)).encode()}
    if errors:  # bad records the loaders skipped: an empty index says how many (tables without any unchanged)
        meta[LOADER_ERRORS_KEY] = json.dumps(errors, sort_keys=True).encode()
    if all(c in table.column_names for c in TOKEN_COLUMNS):
        meta[TOKEN_SETTINGS_KEY] = settings
    return _finish(table, meta)
