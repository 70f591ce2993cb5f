"""Integrity records, defined once: what a writer records of every field or column it wrote, and the
one check that refuses a file whose content no longer matches, naming the file, the fields or
columns that differ and what to do.

Used by the three files a run reads back: the DataLoader state (`dynabatch.loader.state`: a digest
per field of the JSON state), the length index (`dynabatch.index.table`) and the plan file
(`dynabatch.planfile`): a checksum per column and a digest per metadata entry. The same three
record what they were made from, checked here too: the data files (`check_data_files`) and the
tokenizer's content hash (`check_tokenizer`).

A column checksum is the sum (mod 2**64) over rows of a 64-bit hash of (row key, value): it does
not depend on the order of the rows, but changes when a value is edited or moved to another row.
The row key is what identifies a row in its file (the ``sample_id`` of an index row, the
placement of a plan row), so the checksum is computed with numpy over whole columns, never a
Python loop over rows. The record catches edits and damage, not forgery: anyone who edits a file
can also recompute its record.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_NULL = np.uint64(0x5851F42D4C957F2D)  # the value hash of a null (any constant unlike a mixed value)
_DIGITS = 16  # hex digits kept of a digest


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 (wrapping arithmetic): a good 64-bit hash of each element."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * _M1
        x = x ^ (x >> np.uint64(27))
        x = x * _M2
        return x ^ (x >> np.uint64(31))


def sum64(hashes: np.ndarray) -> int:
    """Hashes summed mod 2**64 (order-independent)."""
    with np.errstate(over="ignore"):
        return int(np.sum(hashes, dtype=np.uint64))


# -- JSON fields ---------------------------------------------------------------------------------

def json_digest(value) -> str:
    """Digest of a JSON-able value: sha256 of its canonical JSON (sorted keys, no spaces), 16 hex
    digits. The same after a JSON round trip (tuples and lists hash alike)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:_DIGITS]


def field_digests(obj: dict, depth: int = 3, prefix: str = "") -> dict[str, str]:
    """``{dotted field path: json_digest(value)}`` of a JSON object, descending into objects
    ``depth`` levels (deeper values are digested whole), so a mismatch names the field edited."""
    out = {}
    for key, value in obj.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and depth > 1 and value:
            out.update(field_digests(value, depth - 1, path + "."))
        else:
            out[path] = json_digest(value)
    return out


# -- Arrow columns -------------------------------------------------------------------------------

def _bits(values: np.ndarray) -> np.ndarray:
    """The uint64 bit pattern of numeric values (floats by their float64 bits, NaN included)."""
    if values.dtype.kind == "f":
        return np.ascontiguousarray(values, np.float64).view(np.uint64)
    if values.dtype.kind == "b":
        return values.astype(np.uint64)
    if values.dtype.kind in "iu":
        return values.astype(np.int64, copy=False).view(np.uint64) if values.dtype.kind == "i" else \
            values.astype(np.uint64)
    if values.dtype.kind == "M" or values.dtype.kind == "m":
        return values.view(np.int64).view(np.uint64)
    raise TypeError(f"no integrity hash for numpy dtype {values.dtype}")


def _value_hashes(arr: pa.Array) -> np.ndarray:
    """One uint64 hash per element of an Arrow array (numbers, booleans, strings, lists of them)."""
    t = arr.type
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        flat = arr.flatten()
        inner = _value_hashes(flat)
        if pa.types.is_fixed_size_list(t):
            lengths = np.full(len(arr), t.list_size, np.int64)
        else:
            lengths = np.asarray(pa.compute.list_value_length(arr).fill_null(0), np.int64)
        starts = np.r_[0, np.cumsum(lengths)[:-1]].astype(np.int64)
        # each value is mixed with its position in its list, so reordering inside a list counts
        with np.errstate(over="ignore"):
            pos = np.arange(len(flat), dtype=np.int64) - np.repeat(starts, lengths)
            inner = mix(inner + pos.astype(np.uint64) * GOLDEN)
        sums = np.add.reduceat(inner, np.minimum(starts, max(len(inner) - 1, 0))) if len(inner) else \
            np.zeros(len(arr), np.uint64)
        sums = np.where(lengths > 0, sums, np.uint64(0))
        with np.errstate(over="ignore"):
            out = mix(sums.astype(np.uint64) + lengths.astype(np.uint64) * _M1)
    elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or \
            pa.types.is_large_binary(t):  # metadata-like columns only: a Python loop is fine here
        out = np.array([int.from_bytes(hashlib.blake2b(v if isinstance(v, bytes) else str(v).encode(),
                                                       digest_size=8).digest(), "little") if v is not None else 0
                        for v in arr.to_pylist()], np.uint64)
    elif pa.types.is_dictionary(t):
        out = _value_hashes(arr.dictionary_decode())
    else:
        values = arr.fill_null(0) if arr.null_count else arr
        out = mix(_bits(values.to_numpy(zero_copy_only=False)))
    if arr.null_count:
        out = np.where(np.asarray(arr.is_null()), _NULL, out)
    return out


def column_checksums(table: pa.Table, row_keys: np.ndarray, skip=()) -> dict[str, str]:
    """``{column: checksum}`` of every column of ``table`` but ``skip`` (see the module docstring);
    ``row_keys``: one uint64 per row naming it in its file. 16 hex digits each."""
    keys = np.asarray(row_keys, np.uint64)
    out = {}
    for name in table.column_names:
        if name in skip:
            continue
        col = table.column(name)
        values = _value_hashes(col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)) if len(col) else \
            np.zeros(0, np.uint64)
        with np.errstate(over="ignore"):
            out[name] = f"{sum64(mix(keys * GOLDEN + values)):016x}"
    return out


def metadata_digests(metadata, skip=()) -> dict[str, str]:
    """``{key: digest}`` of a schema's ``dynabatch.*`` metadata entries (bytes or str keys) but ``skip``."""
    out = {}
    for k, v in (metadata or {}).items():
        key = k.decode() if isinstance(k, bytes) else k
        if key.startswith("dynabatch.") and key not in skip:
            raw = v if isinstance(v, bytes) else str(v).encode()
            out[key] = hashlib.sha256(raw).hexdigest()[:_DIGITS]
    return out


# -- the check -----------------------------------------------------------------------------------

def mismatches(recorded: dict, current: dict) -> list[str]:
    """What differs between a recorded and a current ``{name: digest}``: each name changed, added
    (``name (added)``) or removed (``name (removed)``), in sorted order."""
    out = []
    for name in sorted(set(recorded) | set(current)):
        if name not in current:
            out.append(f"{name} (removed)")
        elif name not in recorded:
            out.append(f"{name} (added)")
        elif recorded[name] != current[name]:
            out.append(name)
    return out


def refuse(error: type[Exception], where: str, what: str, names: list[str], fix: str):
    """Raise ``error`` saying that the ``what`` (e.g. ``column``) ``names`` of ``where`` (the file)
    no longer match the integrity record written with it, and ``fix`` (what to do)."""
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    plural = "s" if len(names) > 1 else ""
    raise error(f"{where}: {what}{plural} {shown} do{'' if plural else 'es'} not match the integrity record "
                f"written with it (edited or damaged after it was written); {fix}")


def check(error: type[Exception], where: str, what: str, recorded: dict, current: dict, fix: str) -> None:
    """`refuse` when `mismatches` of ``recorded`` and ``current`` finds any."""
    bad = mismatches(recorded, current)
    if bad:
        refuse(error, where, what, bad, fix)


# -- what a file was made from -------------------------------------------------------------------

def check_data_files(error: type[Exception], where: str, recorded, source, fix: str) -> None:
    """Refuse (``error``) when the data files ``where`` (an index, a plan, a state) recorded
    (`loaders.file_fingerprints`; None: not recorded, nothing to compare) differ from ``source``'s
    files now, naming each changed file or object (`loaders.changed_files`)."""
    if recorded is None or source is None:
        return
    import loaders

    changes = loaders.changed_files(recorded, source)
    if changes:
        raise error(f"{where} was made from other data than is read now: {'; '.join(changes)}; {fix}")


def check_tokenizer(error: type[Exception], where: str, recorded: str | None, recorded_name, tokenizer,
                    fix: str) -> None:
    """Refuse (``error``) when the tokenizer content hash ``where`` recorded
    (`tokenization.tokenizer_fingerprint`; None: not recorded) is not that of ``tokenizer`` (the
    one in use), naming both tokenizers."""
    if recorded is None:
        return
    from tokenization import tokenizer_fingerprint

    now = tokenizer_fingerprint(tokenizer)
    if now != recorded:
        name = getattr(tokenizer, "name", type(tokenizer).__name__)
        made = (f"the tokenizer {recorded_name} (content {recorded})" if recorded_name
                else f"a tokenizer of content {recorded}")
        raise error(f"{where} was made with {made}, but the one in use is {name} (content {now}): token counts and "
                    f"ids differ between them; {fix}")
