"""The length index: one type (`LengthIndex`), one reader (`read_index`) and one writer (`write_index`).

On disk a length index is a Parquet file (or an Arrow IPC file, by its suffix) with the columns of
`tokenization.SHAPE_SCHEMA` (``sample_id``, ``input_tokens``, ``target_tokens``, ``vision_tokens``,
``task_id``), rows sorted by ``sample_id``, and optionally `LABEL_COLUMN` (loss labels per sample)
and the token-cache columns `TOKEN_COLUMNS`. Schema metadata (bytes keys, JSON values):

    dynabatch.task_names           list of task names ``task_id`` indexes (-1 = unknown)
    dynabatch.scan_stats           the scan's `tokenization.ScanStats`
    dynabatch.scan                 how ``dynabatch scan`` made it (data paths, tokenizer, family, ...)
    dynabatch.index_settings       tokenization settings of a DataLoader-built index
    dynabatch.token_settings       settings the token-cache columns were made with
    dynabatch.dataset_fingerprint  `Shapes.fingerprint()` of the index
    dynabatch.data_files           the data files the index was made from (`loaders.file_fingerprints`)
    dynabatch.index_integrity      written by `write_index`: ``samples`` (rows), ``sample_id_checksum``
                                   (sha256 of the sorted ids), ``sample_id_sum`` (mod 2**64),
                                   ``columns`` (a checksum of every other column, keyed by sample id:
                                   `dynabatch.integrity.column_checksums`) and ``metadata`` (a
                                   digest of every other ``dynabatch.*`` entry)

Every reader path (`read_index`, `read_index_table`) refuses, naming the file and the sample id, an
index whose ids repeat, whose token counts are negative, or whose rows no longer match the
integrity record (a row removed, added or changed after writing), and naming the file and the
column (or metadata entry) one whose values were edited (``input_tokens`` doubled, a count set to
2**31-1...); samples with no tokens at all are reported (a warning).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
from tokenization import ID_COLUMNS, LABEL_COLUMN, SCAN_STATS_KEY, TASK_NAMES_KEY, task_names_of  # noqa: F401

from .. import integrity
from ..core.shapes import Shapes

logger = logging.getLogger("dynabatch")

FINGERPRINT_KEY = b"dynabatch.dataset_fingerprint"
SCAN_KEY = b"dynabatch.scan"
#: JSON of the tokenization settings a DataLoader-built index was made with.
SETTINGS_KEY = b"dynabatch.index_settings"
#: JSON of the tokenization settings the cached token ids were made with.
TOKEN_SETTINGS_KEY = b"dynabatch.token_settings"
INTEGRITY_KEY = b"dynabatch.index_integrity"
#: JSON list of the data files the index was made from (`loaders.file_fingerprints`).
DATA_FILES_KEY = b"dynabatch.data_files"
#: Token-cache columns (``large_list<int32>``): input ids, then labels (decoder) or target ids.
TOKEN_COLUMNS = ID_COLUMNS
INDEX_FORMAT = "dynabatch.length_index"
_IPC_SUFFIXES = (".arrow", ".feather", ".ipc")
_TABLE_SUFFIXES = (".parquet", ".pq", *_IPC_SUFFIXES)


class LengthIndexError(ValueError):
    """A length index that cannot be used (unreadable, duplicated or edited rows...); one line."""


@dataclass(frozen=True)
class LengthIndex:
    """Token counts of every sample of a dataset, and where they came from.

    ``shapes`` (sorted by ``sample_id`` unless read with ``sort=False``), ``task_names`` (what
    ``task_id`` indexes), ``paths`` (the index files read, or the data just scanned),
    ``scanned`` (tokenized just now), ``scan_options`` (``dynabatch.scan`` metadata),
    ``label_tokens`` (loss labels per sample: exact when the index has the column,
    ``exact_labels``; else derived from ``target_tokens`` when a family was given, see
    `derived_labels`; else None), ``settings`` (``dynabatch.index_settings``),
    ``given_fingerprint`` (fingerprint in the order the rows were given) and ``data_files``
    (`loaders.file_fingerprints` of the data it was made from; None when not recorded).
    """

    shapes: Shapes
    task_names: list = field(default_factory=list)
    paths: list = field(default_factory=list)
    scanned: bool = False
    scan_options: dict = field(default_factory=dict)
    label_tokens: np.ndarray | None = None
    exact_labels: bool = False
    settings: dict | None = None
    given_fingerprint: str | None = None
    data_files: list | None = None

    def __len__(self) -> int:
        return len(self.shapes)

    @cached_property
    def fingerprint(self) -> str:
        """`Shapes.fingerprint()`: the dataset identity a plan is tied to."""
        return self.shapes.fingerprint()

    @cached_property
    def fingerprints(self) -> frozenset:
        """Fingerprints a plan of this data may carry: this one, the rows' given order, and the other
        task numberings scanners use (task ids do not change plans)."""
        return frozenset({self.fingerprint, self.given_fingerprint or self.fingerprint,
                          *_task_variants(self.shapes)})

    @property
    def tokenizer_hash(self) -> str | None:
        """`tokenization.tokenizer_fingerprint` of the tokenizer that counted the index (None when
        not recorded: indexes of older releases, or plain length tables)."""
        return (self.settings or {}).get("tokenizer_hash") or self.scan_options.get("tokenizer_hash")

    @property
    def tokenizer_name(self) -> str | None:
        """The name or spec of the tokenizer that counted the index, when recorded."""
        return (self.settings or {}).get("tokenizer") or self.scan_options.get("tokenizer")

    def check_origin(self, source, tokenizer, where: str | None = None) -> None:
        """Refuse (`LengthIndexError`, naming the index file ``where`` and the data file or both
        tokenizers) to serve a loader reading ``source`` with ``tokenizer`` when the index recorded
        other data files or another tokenizer (`dynabatch.integrity.check_data_files`, `check_tokenizer`)."""
        where = where or (self.paths[0] if len(self.paths) == 1 else "the length index")
        integrity.check_data_files(LengthIndexError, where, self.data_files, source,
                                   "re-scan the data (dynabatch scan), or read the data the index was made from")
        integrity.check_tokenizer(LengthIndexError, where, self.tokenizer_hash, self.tokenizer_name, tokenizer,
                                  "re-scan the data with this tokenizer (dynabatch scan --tokenizer ...), or give the "
                                  "loader the tokenizer the index was made with")

    def positions(self, sample_ids) -> np.ndarray:
        """Positions of ``sample_ids`` in the (sorted) index; KeyError for ids not in it."""
        ids = np.asarray(sample_ids, np.int64)
        own = self.shapes.sample_id
        pos = np.searchsorted(own, ids)
        pos_c = np.minimum(pos, max(len(own) - 1, 0))
        bad = (pos >= len(own)) | (own[pos_c] != ids) if len(own) else np.ones(len(ids), bool)
        if bad.any():
            raise KeyError(f"sample ids {ids[bad][:5].tolist()} are not in the length index")
        return pos

    def to_table(self) -> pa.Table:
        """The index as a length table (Shapes columns, labels when exact, metadata)."""
        table = self.shapes.to_arrow()
        if self.exact_labels and self.label_tokens is not None:
            table = table.append_column(LABEL_COLUMN, pa.array(np.asarray(self.label_tokens, np.int32)))
        meta = {TASK_NAMES_KEY: json.dumps(list(self.task_names)).encode(),
                FINGERPRINT_KEY: self.fingerprint.encode()}
        if self.scan_options:
            meta[SCAN_KEY] = json.dumps(self.scan_options, sort_keys=True).encode()
        if self.settings is not None:
            meta[SETTINGS_KEY] = json.dumps(self.settings, sort_keys=True).encode()
        if self.data_files is not None:
            meta[DATA_FILES_KEY] = json.dumps(self.data_files).encode()
        return table.replace_schema_metadata(meta)


def _task_variants(shapes: Shapes) -> list[str]:
    """Fingerprints of the same index under tasks numbered by first appearance in sample_id order
    (`tokenization.scan_shapes` over a source), and with no task ids at all."""
    t = shapes.task_id
    known = t >= 0
    uniq, first = np.unique(t[known], return_index=True)
    remap = np.full(int(t.max(initial=-1)) + 2, -1, np.int32)  # the last slot keeps -1 at -1
    remap[uniq[np.argsort(first)]] = np.arange(len(uniq), dtype=np.int32)
    return [Shapes(shapes.sample_id, shapes.input_tokens, shapes.target_tokens, shapes.vision_tokens,
                   task_id).fingerprint() for task_id in (remap[t], np.full(len(t), -1, np.int32))]


def derived_labels(shapes: Shapes, family: str, max_len=None, max_target_len=None, bos: int = 0) -> np.ndarray:
    """Loss labels per sample from token counts alone: the target tokens left after truncation
    (the input is cut first, as `tokenization` does; a sample's vision tokens count towards
    ``max_len`` and are never cut), minus the first label when the input is empty. Exact for
    prompt/response and chat samples; plain-text samples (every token trained) cannot be told apart
    from their counts."""
    inp = shapes.input_tokens.astype(np.int64)
    tgt = shapes.target_tokens.astype(np.int64)
    if family == "encoder_decoder":
        return tgt if max_target_len is None else np.minimum(tgt, max_target_len)
    if max_len is not None:
        over = np.maximum(inp + tgt + shapes.vision_tokens.astype(np.int64) - int(max_len), 0)
        tgt = tgt - np.maximum(over - np.maximum(inp - bos, 0), 0)
    return np.maximum(tgt - ((inp == 0) & (tgt > 0)), 0)


# -- integrity --------------------------------------------------------------------------------

def integrity_record(sample_ids, table: pa.Table | None = None) -> dict:
    """What `write_index` records of the ``sample_id`` column (independent of row order) and, given
    the ``table``, of its other columns and metadata (see the module docstring)."""
    ids = np.sort(np.asarray(sample_ids, np.int64))
    with np.errstate(over="ignore"):
        total = int(ids.astype(np.uint64).sum(dtype=np.uint64))
    rec = {"samples": len(ids), "sample_id_checksum": hashlib.sha256(ids.astype("<i8").tobytes()).hexdigest()[:16],
           "sample_id_sum": total}
    if table is not None:
        rec.update(columns=_column_checksums(table),
                   metadata=integrity.metadata_digests(table.schema.metadata, skip=(INTEGRITY_KEY.decode(),)))
    return rec


def _column_checksums(table: pa.Table) -> dict[str, str]:
    """Checksums of every column but ``sample_id``, each row keyed by its sample id."""
    ids = table.column("sample_id").to_numpy(zero_copy_only=False).astype(np.int64)
    return integrity.column_checksums(table, ids, skip=("sample_id",))


_RESCAN = "re-scan the data (dynabatch scan), or use the index exactly as it was written"


def check_index(table: pa.Table, name: str) -> None:
    """Refuse a length table whose ids repeat or no longer match its integrity record (see the module
    docstring), naming ``name`` and the sample id; report samples without tokens."""
    ids = table.column("sample_id").to_numpy(zero_copy_only=False).astype(np.int64)
    s = ids if np.all(ids[1:] > ids[:-1]) else np.sort(ids, kind="stable")
    dup = np.flatnonzero(s[1:] == s[:-1])
    if len(dup):
        x = int(s[dup[0]])
        raise LengthIndexError(f"{name}: sample_id {x} appears {int(np.count_nonzero(ids == x))} times (a duplicated "
                               "row?); a plan names samples by id, so ids must be unique")
    raw = (table.schema.metadata or {}).get(INTEGRITY_KEY)
    if raw is not None:
        try:
            want, got = json.loads(raw), integrity_record(s)
            same = want["samples"] == got["samples"] and want["sample_id_checksum"] == got["sample_id_checksum"]
        except (ValueError, KeyError, TypeError) as e:
            raise LengthIndexError(f"{name}: its {INTEGRITY_KEY.decode()} record cannot be read ({e}); "
                                   f"{_RESCAN}") from None
        if not same:
            raise LengthIndexError(f"{name}: {_edit(want, got, s)}; the index was changed after it was written: "
                                   "re-scan the data (dynabatch scan)")
        if "columns" in want:  # indexes of older releases record the sample ids only
            integrity.check(LengthIndexError, name, "column", want["columns"], _column_checksums(table), _RESCAN)
            integrity.check(LengthIndexError, name, "metadata entry", want.get("metadata", {}),
                            integrity.metadata_digests(table.schema.metadata, skip=(INTEGRITY_KEY.decode(),)), _RESCAN)
    total = np.zeros(len(ids), np.int64)
    for c in ("input_tokens", "target_tokens", "vision_tokens"):
        if c in table.column_names:
            total += table.column(c).to_numpy(zero_copy_only=False).astype(np.int64)
    empty = ids[total == 0]
    if len(empty):
        logger.warning("%s: %d samples have no tokens at all (sample_id %s%s); they are planned but train on "
                       "nothing", name, len(empty), ", ".join(map(str, empty[:3].tolist())),
                       ", ..." if len(empty) > 3 else "")


def _edit(want: dict, got: dict, ids: np.ndarray) -> str:
    """What changed between the written record and the rows read, naming the id when it is one row."""
    n, m = want["samples"], got["samples"]
    if abs(n - m) == 1:
        diff = (int(want["sample_id_sum"]) - int(got["sample_id_sum"])) % 2**64
        x = diff if n > m else (-diff) % 2**64
        x = x - 2**64 if x >= 2**63 else x
        present = bool(np.isin(x, ids))
        if (n > m) != present:
            return f"sample_id {x} was {'removed' if n > m else 'added'} ({m} rows, {n} when written)"
    if n != m:
        return f"it holds {m} rows but {n} when written"
    return f"its sample ids differ from those written ({n} rows; sample_id checksum {got['sample_id_checksum']}, " \
           f"{want['sample_id_checksum']} when written)"


# -- reading ----------------------------------------------------------------------------------

def _files(paths) -> list[Path]:
    from ..shape_sources import SUFFIXES

    out = []
    for p in map(Path, paths):
        out += sorted(q for q in p.iterdir() if q.is_file() and q.name.endswith(SUFFIXES)) if p.is_dir() else [p]
    return out


def _read_file(path: Path) -> pa.Table:
    try:
        if path.name.endswith(_IPC_SUFFIXES):
            with pa.memory_map(str(path)) as mm:
                return pa.ipc.open_file(mm).read_all()
        import pyarrow.parquet as pq

        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise LengthIndexError(f"{path}: cannot read ({e})") from None


def _load(source) -> tuple[pa.Table, str, list[str]]:
    """(table, name for messages, paths) of a path, paths, an Arrow table, `Shapes` or `LengthIndex`."""
    if isinstance(source, LengthIndex):
        return source.to_table(), "the length index", list(source.paths)
    if isinstance(source, Shapes):
        return source.to_arrow(), "the length index (Shapes)", []
    if isinstance(source, pa.Table):
        return source, "the length index table", []
    paths = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    resolved = [str(Path(p).resolve()) for p in paths]
    files = _files(paths)
    if len(files) == 1 and files[0].name.endswith(_TABLE_SUFFIXES):
        import pyarrow.parquet as pq

        names = (pq.read_schema(files[0]).names if not files[0].name.endswith(_IPC_SUFFIXES) and files[0].exists()
                 else None)
        if names is None or {"sample_id", "input_tokens"} <= set(names):
            return _read_file(files[0]), str(files[0]), resolved
    from ..shape_sources import read_shapes

    shapes, task_names = read_shapes(paths)
    table = shapes.to_arrow().replace_schema_metadata({TASK_NAMES_KEY: json.dumps(list(task_names)).encode()})
    return table, ", ".join(map(str, paths)), resolved


def read_index_table(source) -> pa.Table:
    """The length table of ``source`` (see `read_index`), checked (`check_index`)."""
    table, name, _ = _load(source)
    _shapes(table, name)
    check_index(table, name)
    return table


def _shapes(table: pa.Table, name: str) -> Shapes:
    try:
        return Shapes.from_arrow(table)
    except (ValueError, TypeError) as e:
        raise LengthIndexError(f"{name}: not a valid length index ({e})") from None


def read_index(source, *, family: str | None = None, max_len: int | None = None, max_target_len: int | None = None,
               bos: int = 0, sort: bool = True) -> LengthIndex:
    """The one reader: a `LengthIndex` from a path (a ``dynabatch scan`` / `build_index` Parquet or
    Arrow file, or any files `dynabatch.read_shapes` reads), paths, an Arrow table, `Shapes` or a
    `LengthIndex`, checked (`check_index`). ``sort`` orders the rows by ``sample_id`` (the
    DataLoader's positions need it). Without a `LABEL_COLUMN` the label counts are derived from
    ``target_tokens`` under ``family``'s max lengths (`derived_labels`), or left None without a family."""
    if isinstance(source, LengthIndex) and (not sort or _sorted(source.shapes.sample_id)):
        return source
    table, name, paths = _load(source)
    given = _shapes(table, name)
    check_index(table, name)
    order = np.argsort(given.sample_id, kind="stable") if sort and not _sorted(given.sample_id) else None
    shapes = given if order is None else given.take(order)
    meta = table.schema.metadata or {}
    exact = LABEL_COLUMN in table.column_names
    labels = None
    if exact:
        labels = table.column(LABEL_COLUMN).to_numpy(zero_copy_only=False).astype(np.int64)
        labels = labels if order is None else labels[order]
    elif family is not None:
        labels = derived_labels(shapes, family, max_len, max_target_len, bos)
    settings = json.loads(meta[SETTINGS_KEY]) if SETTINGS_KEY in meta else None
    files = json.loads(meta[DATA_FILES_KEY]) if DATA_FILES_KEY in meta else None
    return LengthIndex(shapes, task_names_of(table), paths, False, json.loads(meta.get(SCAN_KEY, b"{}")), labels,
                       exact, settings, given.fingerprint() if order is not None else None, files)


def _sorted(ids: np.ndarray) -> bool:
    return bool(np.all(ids[1:] > ids[:-1]))


def write_index(index, path) -> None:
    """The one writer: a length index (`LengthIndex`, table or `Shapes`) to ``path``, atomically
    (Parquet with zstd; Arrow IPC for ``.arrow``/``.feather``/``.ipc``), with the integrity record.
    The same table gives the same bytes."""
    table = index.to_table() if isinstance(index, LengthIndex) else _load(index)[0]
    meta = dict(table.schema.metadata or {})
    meta[INTEGRITY_KEY] = json.dumps(integrity_record(table.column("sample_id").to_numpy(), table)).encode()
    table = table.replace_schema_metadata(meta)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    if path.name.endswith(_IPC_SUFFIXES):
        with pa.OSFile(str(tmp), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
            w.write_table(table)
    else:
        import pyarrow.parquet as pq

        pq.write_table(table, str(tmp), compression="zstd")
    os.replace(tmp, path)
