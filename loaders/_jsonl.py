"""JSON Lines shards (plain, .gz, .zst) and whole-file JSON arrays."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import numpy as np

from ._errors import CorruptFileError, InvalidJSONError, TruncatedFileError
from ._files import (CheckedReader, DamagedStream, compression_of, decompression_errors, is_compressed, open_binary,
                     stream_error)
from ._fs import LOCAL, Storage
from ._types import RawRecord, ShardInfo, ShardReader, shard_names

# A byte offset is kept for every CHECKPOINT-th line of a plain file, so a work unit
# starting at line n seeks to the nearest checkpoint and skips < CHECKPOINT lines.
CHECKPOINT = 1024
_CHUNK = 1 << 16


def parse_json_object(data: bytes | str, where: str) -> dict:
    """Parse one JSON object; raise ``InvalidJSONError`` naming ``where`` otherwise."""
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as e:
        raise InvalidJSONError(f"invalid JSON ({e.msg} at column {e.colno})", where=where) from None
    except UnicodeDecodeError as e:
        raise InvalidJSONError(f"invalid UTF-8 ({e.reason})", where=where) from None
    if not isinstance(obj, dict):
        raise InvalidJSONError(f"expected a JSON object, got {type(obj).__name__}", where=where)
    return obj


def count_lines(path: str, storage: Storage | None = None
                ) -> tuple[int, np.ndarray, BaseException | None, int | None]:
    """Count the lines of ``path`` (a local path or URL, opened by ``storage``) in one sequential pass
    (the only indexing cost of JSONL).

    Returns (lines, checkpoint byte offsets, error, readable bytes). Offsets are only meaningful
    for uncompressed files. Compressed files are checked unit by unit (gzip member, zstd frame,
    bz2 stream, see `CheckedReader`): when a unit fails its check, the count stops at the last
    complete line of the units before it, which passed theirs; when the file ends early, at the
    last complete line decoded. ``readable bytes`` is then where those lines end (reads never go
    past it), else None; the error is returned instead of raised.
    """
    offsets = [np.zeros(1, np.int64)]
    newlines = 0
    byte_pos = 0
    last = b"\n"
    line_end = 0  # decompressed offset just after the last newline
    verified = (0, 0)  # (newlines, line_end) within the units that passed their check
    fmt = compression_of(path)
    reader = CheckedReader(path, fmt, storage=storage) if fmt else None
    try:
        if reader is None:
            f = (storage or LOCAL).open(path)
            chunks = iter(lambda: f.read(_CHUNK), b"")
        else:
            f = reader
            chunks = reader.chunks()
        with f:
            for chunk in chunks:
                if reader is not None and reader.verified_end >= byte_pos:
                    verified = (newlines, line_end)
                nl = np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10)
                # Line k starts after newline k; keep the starts of lines CHECKPOINT, 2*CHECKPOINT, ...
                line_after = newlines + 1 + np.arange(len(nl))
                keep = nl[line_after % CHECKPOINT == 0]
                if len(keep):
                    offsets.append(byte_pos + keep.astype(np.int64) + 1)
                if len(nl):
                    line_end = byte_pos + int(nl[-1]) + 1
                newlines += len(nl)
                byte_pos += len(chunk)
                last = chunk[-1:]
                if reader is not None and reader.verified_end >= byte_pos:
                    verified = (newlines, line_end)
    except DamagedStream as e:
        if e.verified_end >= byte_pos:  # the last unit ended on a call that gave no output
            verified = (newlines, line_end)
        if e.kind == "truncated":
            # The decoded part of a cut stream is what the stream holds (the cut only drops the
            # unit's checksum): keep its complete lines.
            return newlines, np.concatenate(offsets), e, line_end
        return verified[0], np.concatenate(offsets), e, verified[1]
    except decompression_errors() as e:  # pragma: no cover - CheckedReader translates them
        return newlines, np.concatenate(offsets), e, line_end
    lines = newlines + (1 if last != b"\n" else 0)
    return lines, np.concatenate(offsets), None, None


def damage_error(path: str, name: str, err: BaseException, lines: int, readable: int | None):
    """The `LoaderError` of a damaged compressed file found while indexing: names the file, the
    first line not delivered and what happened there."""
    if not isinstance(err, DamagedStream):
        return stream_error(path, err, where=f"{name}:{lines + 1}")
    if err.kind == "truncated":
        return TruncatedFileError(
            f"compressed stream of {name} ends early: {err.message}; the data ends after line {lines} "
            f"(decompressed byte {readable}), the rest of the file is missing", where=f"{name}:{lines + 1}")
    return CorruptFileError(
        f"compressed stream of {name} is damaged: {err.message}; lines from {lines + 1} on (decompressed "
        f"byte {readable} on, in or after {err.unit}) are not used", where=f"{name}:{lines + 1}")


class JsonlReader(ShardReader):
    """JSON Lines files; position = 0-based line number, key = ``file:line`` (1-based).

    Blank lines are not samples but keep their line number. Construction counts the
    lines of every file once (one sequential read; for .gz/.zst one decompression).
    ``storage`` opens local paths and URLs (`loaders.Storage`).
    """

    kind = "jsonl"

    def __init__(self, paths: list[str], storage: Storage | None = None):
        super().__init__()
        self.paths = paths
        self.storage = storage or LOCAL
        self._offsets: list[np.ndarray] = []
        self._readable: list[int | None] = []  # decompressed bytes to read of a damaged file; None: all
        for i, (path, name) in enumerate(zip(paths, shard_names(paths))):
            size, version = self.storage.stat(path)
            lines, offsets, err, readable = count_lines(path, self.storage)
            if err is not None:
                self.index_errors.append(damage_error(path, name, err, lines, readable))
            self._offsets.append(offsets)
            self._readable.append(readable)
            self.shards.append(ShardInfo(i, name, path, lines, seekable=not is_compressed(path),
                                         size_bytes=size, version=version))

    def readable_bytes(self, shard: int) -> int | None:
        """Decompressed bytes of ``shard`` that passed the integrity check (None: the whole file)."""
        readable = getattr(self, "_readable", None)  # None: a reader pickled before this existed
        return readable[shard] if readable else None

    def read(self, shard: int, start: int, stop: int) -> Iterator[RawRecord]:
        info = self.shards[shard]
        stop = min(stop, info.num_rows)
        if start >= stop:
            return
        base_dir = os.path.dirname(info.path)
        with open_binary(info.path, limit=self.readable_bytes(shard), storage=self.storage) as f:
            line_no = 0
            if info.seekable:
                cp = min(start // CHECKPOINT, len(self._offsets[shard]) - 1)
                f.seek(int(self._offsets[shard][cp]))
                line_no = cp * CHECKPOINT
            lines = iter(f)
            while line_no < stop:
                where = f"{info.name}:{line_no + 1}"
                try:
                    raw = next(lines)
                except StopIteration:
                    return
                except decompression_errors() as e:
                    # The rest of the unit is lost; report it at the last skipped position
                    # so that a resume after the error does not meet it again.
                    err = stream_error(info.path, e, where)
                    err.repeat = line_no < start  # a unit before this one meets (and counts) it too
                    yield RawRecord(stop - 1, where, error=err)
                    return
                text = raw.strip() if line_no >= start else b""
                if text:
                    try:
                        rec = parse_json_object(text, where)
                    except InvalidJSONError as e:
                        yield RawRecord(line_no, where, error=e)
                    else:
                        yield RawRecord(line_no, where, rec, base_dir=base_dir)
                line_no += 1


class JsonArrayReader(ShardReader):
    """``.json`` files holding one array of objects (common for LLaVA data).

    Each file is parsed whole into memory on first use, so keep these small or convert
    them to JSONL. Position = array index, key = ``file[index]``.
    """

    kind = "json"

    def __init__(self, paths: list[str], storage: Storage | None = None):
        super().__init__()
        self.paths = paths
        self.storage = storage or LOCAL
        self._cache: dict[int, list] = {}
        for i, (path, name) in enumerate(zip(paths, shard_names(paths))):
            size, version = self.storage.stat(path)
            rows = self._load(i, path, name)
            self.shards.append(ShardInfo(i, name, path, len(rows), size_bytes=size, version=version))

    def _load(self, i: int, path: str, name: str) -> list:
        if i not in self._cache:
            try:
                with open_binary(path, storage=self.storage) as f:
                    data = json.load(f)
                if not isinstance(data, list):
                    raise ValueError(f"top level is {type(data).__name__}, expected an array")
            except decompression_errors() as e:
                self.index_errors.append(stream_error(path, e, where=name))
                data = []
            except ValueError as e:
                self.index_errors.append(CorruptFileError(f"cannot read JSON array: {e}", where=name))
                data = []
            self._cache[i] = data
        return self._cache[i]

    def read(self, shard: int, start: int, stop: int) -> Iterator[RawRecord]:
        info = self.shards[shard]
        rows = self._load(shard, info.path, info.name)
        base_dir = os.path.dirname(info.path)
        for pos in range(start, min(stop, len(rows))):
            where = f"{info.name}[{pos}]"
            rec = rows[pos]
            if isinstance(rec, dict):
                yield RawRecord(pos, where, rec, base_dir=base_dir)
            else:
                err = InvalidJSONError(f"expected a JSON object, got {type(rec).__name__}", where=where)
                yield RawRecord(pos, where, error=err)
