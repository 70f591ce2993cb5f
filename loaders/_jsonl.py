"""JSON Lines shards (plain, .gz, .zst) and whole-file JSON arrays."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import numpy as np

from ._errors import CorruptFileError, InvalidJSONError
from ._files import decompression_errors, is_compressed, open_binary, stream_error
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


def count_lines(path: str) -> tuple[int, np.ndarray, BaseException | None]:
    """Count the lines of ``path`` in one sequential pass (the only indexing cost of JSONL).

    Returns (lines, checkpoint byte offsets, error). Offsets are only meaningful for
    uncompressed files. On a damaged compressed stream the count stops at the last
    complete line and the error is returned instead of raised.
    """
    offsets = [np.zeros(1, np.int64)]
    newlines = 0
    byte_pos = 0
    last = b"\n"
    try:
        with open_binary(path) as f:
            # read1: a damaged stream then still yields every chunk decoded before the damage.
            while chunk := f.read1(_CHUNK):
                nl = np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10)
                # Line k starts after newline k; keep the starts of lines CHECKPOINT, 2*CHECKPOINT, ...
                line_after = newlines + 1 + np.arange(len(nl))
                keep = nl[line_after % CHECKPOINT == 0]
                if len(keep):
                    offsets.append(byte_pos + keep.astype(np.int64) + 1)
                newlines += len(nl)
                byte_pos += len(chunk)
                last = chunk[-1:]
    except decompression_errors() as e:
        return newlines, np.concatenate(offsets), e
    lines = newlines + (1 if last != b"\n" else 0)
    return lines, np.concatenate(offsets), None


class JsonlReader(ShardReader):
    """JSON Lines files; position = 0-based line number, key = ``file:line`` (1-based).

    Blank lines are not samples but keep their line number. Construction counts the
    lines of every file once (one sequential read; for .gz/.zst one decompression).
    """

    kind = "jsonl"

    def __init__(self, paths: list[str]):
        super().__init__()
        self.paths = paths
        self._offsets: list[np.ndarray] = []
        for i, (path, name) in enumerate(zip(paths, shard_names(paths))):
            lines, offsets, err = count_lines(path)
            if err is not None:
                self.index_errors.append(stream_error(path, err, where=f"{name}:{lines + 1}"))
            self._offsets.append(offsets)
            self.shards.append(
                ShardInfo(i, name, path, lines, seekable=not is_compressed(path),
                          size_bytes=os.path.getsize(path))
            )

    def read(self, shard: int, start: int, stop: int) -> Iterator[RawRecord]:
        info = self.shards[shard]
        stop = min(stop, info.num_rows)
        if start >= stop:
            return
        base_dir = os.path.dirname(info.path)
        with open_binary(info.path) as f:
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
                    yield RawRecord(stop - 1, where, error=stream_error(info.path, e, where))
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

    def __init__(self, paths: list[str]):
        super().__init__()
        self.paths = paths
        self._cache: dict[int, list] = {}
        for i, (path, name) in enumerate(zip(paths, shard_names(paths))):
            rows = self._load(i, path, name)
            self.shards.append(ShardInfo(i, name, path, len(rows), size_bytes=os.path.getsize(path)))

    def _load(self, i: int, path: str, name: str) -> list:
        if i not in self._cache:
            try:
                with open_binary(path) as f:
                    data = json.load(f)
                if not isinstance(data, list):
                    raise ValueError(f"top level is {type(data).__name__}, expected an array")
            except (ValueError, *decompression_errors()) as e:
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
