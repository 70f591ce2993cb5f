"""Integrity records, defined once: what a writer records of every field or column it wrote, and the
one check that refuses a file whose content no longer matches, naming the file, the fields or
columns that differ and what to do.

Used by the three files a run reads back: the DataLoader state (`dynabatch.loader.state`: a digest
per field of the JSON state), the length index (`dynabatch.index.table`) and the plan file
(`dynabatch.planfile`): a checksum per column and a digest per metadata entry. The same three
record what they were made from, checked here too: the data files (`check_data_files`) and the
tokenizer's content hash (`check_tokenizer`).

A column checksum is a sha256 of the column's buffers with the rows ordered by their row key,
where a row belongs in its file (the ``sample_id`` of an index row; the step, rank and micro-batch
of a plan row): it does not depend on the order those are stored in, but changes when a value is
edited or moved to another row, and it is computed over whole buffers, never a Python loop over
rows. The records catch edits and damage, not forgery: anyone who edits a file can also recompute
its record.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
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

def _feed(h, arr: pa.Array) -> None:
    """Hash an Arrow array's values into ``h`` straight from its buffers (numbers as their bytes,
    float NaNs included; lists as their lengths, then their values)."""
    t = arr.type
    h.update(len(arr).to_bytes(8, "little"))
    if arr.null_count:
        h.update(np.packbits(np.asarray(arr.is_null(), bool)).tobytes())
    if pa.types.is_dictionary(t):
        _feed(h, arr.dictionary_decode())
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        h.update(np.diff(np.asarray(arr.offsets, np.int64)).astype("<i8").tobytes())
        _feed(h, arr.flatten())
    elif pa.types.is_fixed_size_list(t):
        _feed(h, arr.flatten())
    elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        offsets = np.frombuffer(arr.buffers()[1], np.int64 if pa.types.is_large_string(t) or
                                pa.types.is_large_binary(t) else np.int32)[arr.offset:arr.offset + len(arr) + 1]
        h.update(np.diff(offsets).astype("<i8").tobytes())
        h.update(memoryview(arr.buffers()[2])[int(offsets[0]):int(offsets[-1])] if len(arr) else b"")
    else:
        values = (arr.fill_null(0) if arr.null_count else arr).to_numpy(zero_copy_only=False)
        h.update(np.ascontiguousarray(values).view(np.uint8))


def column_checksums(table: pa.Table, row_keys: np.ndarray, skip=()) -> dict[str, str]:
    """``{column: checksum}`` of every column of ``table`` but ``skip``: sha256 (16 hex digits) of
    the column's values with the rows ordered by ``row_keys`` (one integer per row naming where it
    belongs in its file; rows of equal keys keep their stored order), so the checksum does not
    depend on the order the keys' groups are stored in but changes when a value is edited or moved
    to another row. Hashes whole buffers: no Python loop over rows (no sort when the rows are
    stored in key order, as writers store them)."""
    keys = np.asarray(row_keys)
    if len(keys) > 1 and not np.all(keys[1:] >= keys[:-1]):
        table = table.take(pa.array(np.argsort(keys, kind="stable")))
    out = {}
    for name in table.column_names:
        if name in skip:
            continue
        col = table.column(name)
        arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        h = hashlib.sha256()
        _feed(h, arr)
        out[name] = h.hexdigest()[:_DIGITS]
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
