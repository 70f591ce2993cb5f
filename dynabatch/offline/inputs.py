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
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..shape_sources import SUFFIXES
from ..index.scan import TIKTOKEN_ENCODINGS, check_ids_in_data, tokenizer_spec  # noqa: F401
from ..index.table import LengthIndex, read_index as _read_index
from ..planfile import format as _format

TASK_NAMES_KEY = _format.TASK_NAMES_KEY.encode()  # bytes: compared with raw Arrow metadata keys
FINGERPRINT_KEY = _format.FINGERPRINT_KEY
_TOKEN_COLUMNS = ({"input_tokens"}, {"vit_num", "token_num"})


class OfflineError(ValueError):
    """Bad input to an offline command (unreadable file, mismatched plan...); one-line message."""


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
    """True when every path holds token counts (see the module docstring), False when none does
    (remote ``s3://``... paths count as raw data).

    Raises `OfflineError` for a missing path or a mix of index files and raw data.
    """
    import loaders

    listed = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    kinds = {str(q): False for q in listed if loaders.is_url(q)}  # remote paths are raw data
    for p in map(Path, [q for q in listed if not loaders.is_url(q)]):
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


#: The length index of `dynabatch plan` is the one `dynabatch.index.LengthIndex` (same fields, in
#: the order ``Index(shapes, task_names, paths, scanned, scan_options)``).
Index = LengthIndex


def read_index(paths) -> LengthIndex:
    """Read a length index for planning (`dynabatch.index.read_index`, rows in file order): a
    ``dynabatch scan`` file (task names and scan settings from its metadata), or any files
    `dynabatch.read_shapes` accepts. Refuses an empty index, repeated sample ids, rows changed
    since the index was written, and ids the data it was scanned from does not hold."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    index = _read_index(paths, sort=False)
    name = ", ".join(map(str, paths))
    if len(index) == 0:
        raise OfflineError(f"{name}: the index holds no samples")
    check_ids_in_data(index, name)
    return index
