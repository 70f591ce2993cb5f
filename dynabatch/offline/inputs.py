"""What the offline commands read: tokenizer specs, and whether paths hold a raw dataset (to be
scanned) or a length index (token counts per sample, ready to plan).

A path is an *index* when its records already carry token counts: ``input_tokens`` (the output
of `dynabatch scan`, `Shapes.to_arrow`, or any Parquet/JSONL/CSV with that column) or
``vit_num`` + ``token_num`` (OmniBal's vision-language length files). Anything else (FLAN-style
``inputs``/``targets`` JSONL, conversations, webdataset shards, a ``save_to_disk`` folder) is a
*dataset* and is tokenized by `scan_dataset` first.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..core.shape_sources import SUFFIXES, read_shapes
from ..core.shapes import Shapes

#: tiktoken encodings accepted without the ``tiktoken:`` prefix.
TIKTOKEN_ENCODINGS = ("cl100k_base", "o200k_base", "p50k_base", "p50k_edit", "r50k_base")
TASK_NAMES_KEY = b"dynabatch.task_names"
FINGERPRINT_KEY = "dynabatch.dataset_fingerprint"
_TOKEN_COLUMNS = ({"input_tokens"}, {"vit_num", "token_num"})


class OfflineError(ValueError):
    """Bad input to an offline command (unreadable file, mismatched plan...); one-line message."""


def tokenizer_spec(spec: str | None) -> str:
    """Normalize a ``--tokenizer`` value for `tokenization.load_tokenizer`.

    ``None`` or ``"bytes"``: the built-in byte-level tokenizer (one token per UTF-8 byte: an
    over-estimate of subword counts, about 4x for English). A bare tiktoken encoding name
    (``cl100k_base``...) becomes ``tiktoken:<name>``; paths (``tokenizer.json``, a
    sentencepiece ``.model``, a transformers folder) are made absolute so worker processes
    started elsewhere find them.
    """
    if spec is None or spec == "bytes":
        return "bytes"
    if spec in TIKTOKEN_ENCODINGS:
        return f"tiktoken:{spec}"
    if spec.startswith("tiktoken:"):
        return spec
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


def _first_record_keys(path: Path) -> set[str] | None:
    """Field names of the first record of a JSON-lines/JSON/CSV file (None when unreadable)."""
    name = path.name
    opener = gzip.open if name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            if ".csv" in name:
                return set(f.readline().strip().split(","))
            head = f.read(1 << 16)
    except (OSError, EOFError, UnicodeDecodeError):
        return None
    text = head.lstrip()
    if text.startswith("["):  # a JSON array: peek at its first object
        text = text[1:].lstrip()
        depth, end = 0, None
        for i, ch in enumerate(text):  # good enough for a peek: braces inside strings are rare here
            depth += ch == "{"
            depth -= ch == "}"
            if depth == 0 and ch == "}":
                end = i + 1
                break
        text = text[:end] if end else ""
    else:
        text = text.split("\n", 1)[0]
    try:
        rec = json.loads(text)
    except json.JSONDecodeError:
        return None
    return set(rec) if isinstance(rec, dict) else None


def _column_names(path: Path) -> set[str] | None:
    name = path.name
    try:
        if name.endswith((".parquet", ".pq")):
            return set(pq.read_schema(path).names)
        if name.endswith(".arrow"):
            with pa.memory_map(str(path)) as src:
                return set(pa.ipc.open_file(src).schema.names)
    except (pa.ArrowInvalid, OSError):
        return None
    if name.endswith(SUFFIXES):
        return _first_record_keys(path)
    return None


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(q for q in path.iterdir() if q.is_file() and q.name.endswith(SUFFIXES))
    return [path]


def is_index(paths) -> bool:
    """True when every path holds token counts (see the module docstring), False when none does.

    Raises `OfflineError` for a missing path or a mix of index files and raw data.
    """
    kinds = {}
    for p in map(Path, [paths] if isinstance(paths, (str, os.PathLike)) else paths):
        if not p.exists() and not any(ch in str(p) for ch in "*?{["):
            raise OfflineError(f"{p}: no such file or directory")
        files = _files(p) if p.exists() else []
        names = [_column_names(f) for f in files]
        kinds[str(p)] = bool(names) and all(n is not None and any(c <= n for c in _TOKEN_COLUMNS) for n in names)
    if len(set(kinds.values())) > 1:
        index = [k for k, v in kinds.items() if v]
        data = [k for k, v in kinds.items() if not v]
        raise OfflineError(f"{index[0]} is a length index (token counts) but {data[0]} is a raw dataset; "
                           "scan the dataset first (dynabatch scan) or pass only one kind")
    return all(kinds.values())


@dataclass(frozen=True)
class Index:
    """A dataset's length index in memory: its `Shapes`, the task names ``task_id`` indexes, and
    where it came from (``paths``; ``scanned`` when it was tokenized just now)."""

    shapes: Shapes
    task_names: list[str]
    paths: list[str]
    scanned: bool = False
    scan_options: dict = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        """`Shapes.fingerprint()`: the dataset identity a plan is tied to."""
        return self.shapes.fingerprint()


def read_index(paths) -> Index:
    """Read a length index: a `dynabatch scan` Parquet file (task names from its metadata), or
    any files `dynabatch.read_shapes` accepts. Sample ids must be unique."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    files = [f for p in paths for f in _files(Path(p))]
    scan_options: dict = {}
    if len(files) == 1 and files[0].name.endswith((".parquet", ".pq")):
        try:
            table = pq.read_table(files[0])
        except (pa.ArrowInvalid, OSError) as e:
            raise OfflineError(f"{files[0]}: cannot read ({e})") from None
        meta = table.schema.metadata or {}
        if TASK_NAMES_KEY in meta and "input_tokens" in table.column_names:
            try:
                shapes = Shapes.from_arrow(table)
            except (ValueError, TypeError) as e:
                raise OfflineError(f"{files[0]}: not a valid length index ({e})") from None
            names = list(json.loads(meta[TASK_NAMES_KEY]))
            scan_options = json.loads(meta.get(b"dynabatch.scan", b"{}"))
            return _checked(Index(shapes, names, [str(Path(p).resolve()) for p in paths], False, scan_options))
    shapes, names = read_shapes(paths)
    return _checked(Index(shapes, names, [str(Path(p).resolve()) for p in paths], False, scan_options))


def _checked(index: Index) -> Index:
    ids = index.shapes.sample_id
    if len(ids) == 0:
        raise OfflineError(f"{', '.join(index.paths)}: the index holds no samples")
    uniq, counts = np.unique(ids, return_counts=True)
    if len(uniq) != len(ids):
        k = int(np.argmax(counts > 1))
        raise OfflineError(f"{', '.join(index.paths)}: sample_id {int(uniq[k])} appears {int(counts[k])} times; "
                           "a plan names samples by id, so ids must be unique")
    return index
