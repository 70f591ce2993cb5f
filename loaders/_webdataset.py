"""webdataset tar shards: text-only samples and image + text samples.

Samples follow webdataset's conventions exactly: members are grouped into a sample while
their key (``webdataset.tariterators.base_plus_ext``) stays the same, extensions are
lower-cased, and ``__key__`` is that key.

Why ``tarfile`` instead of ``webdataset.tariterators.tar_file_iterator``: webdataset streams
members without exposing their byte offsets, so it can neither start at sample k of a
shard (needed to split one big shard over many rank x worker slots) nor resume at an exact
position without re-reading the prefix. Indexing with ``tarfile`` gives each member's
``offset_data``; uncompressed shards are then read with plain ``seek`` + ``read``.
Compressed shards (``.tar.gz``) cannot seek and are streamed from the start.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from webdataset.tariterators import base_plus_ext

from ._errors import BadFieldError, CorruptFileError, MissingFieldError, TruncatedFileError
from ._files import decompression_errors
from ._jsonl import parse_json_object
from ._types import RawRecord, ShardInfo, ShardReader, shard_names

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_BLOCK = 512


@dataclass(frozen=True)
class _Member:
    ext: str
    offset: int  # byte offset of the data; -1 in compressed shards
    size: int


@dataclass(frozen=True)
class _Sample:
    key: str
    members: tuple[_Member, ...]


def _group(entries: Iterable[tuple[str, str, object]]) -> Iterator[tuple[str, list]]:
    """Group consecutive ``(key, ext, payload)`` entries by key, as webdataset does."""
    key, parts = None, []
    for k, ext, payload in entries:
        if k != key and parts:
            yield key, parts
            parts = []
        key = k
        parts.append((ext, payload))
    if parts:
        yield key, parts


def _split(name: str) -> tuple[str | None, str]:
    key, ext = base_plus_ext(name)
    return key, (ext or "").lower()


def _stream_members(path: str) -> Iterator[tuple[str, str, tarfile.TarInfo, tarfile.TarFile]]:
    """Walk a (possibly compressed) tar as a stream; the caller reads data before moving on."""
    with tarfile.open(path, "r|*") as tf:
        for m in tf:
            key, ext = _split(m.name)
            if m.isfile() and key is not None and not os.path.basename(m.name).startswith("__"):
                yield key, ext, m, tf


def _index_plain(path: str, name: str) -> tuple[list[_Sample], Exception | None]:
    """Index an uncompressed tar; returns complete samples and the damage found, if any."""
    size = os.path.getsize(path)
    entries, error, end = [], None, 0
    with open(path, "rb") as f:
        try:
            with tarfile.open(fileobj=f, mode="r:") as tf:
                for m in tf:
                    key, ext = _split(m.name)
                    if m.offset_data + m.size > size:
                        error = TruncatedFileError(f"member {m.name} is cut off", where=name)
                        break
                    end = m.offset_data + -(-m.size // _BLOCK) * _BLOCK
                    if m.isfile() and key is not None and not os.path.basename(m.name).startswith("__"):
                        entries.append((key, ext, _Member(ext, m.offset_data, m.size)))
        except tarfile.ReadError as e:
            error = CorruptFileError(f"bad tar header after byte {end}: {e}", where=name)
        if error is None:
            # tarfile treats a cut-off header as the end of the archive; a real end has a zero block.
            f.seek(end)
            tail = f.read(_BLOCK)
            if len(tail) < _BLOCK or tail.strip(b"\0"):
                error = TruncatedFileError(f"archive ends without an end-of-archive block (after byte {end})",
                                           where=name)
    samples = [_Sample(k, tuple(p for _, p in parts)) for k, parts in _group(entries)]
    if error is not None and samples:
        samples.pop()  # the last sample may be missing members
    return samples, error


def _index_stream(path: str, name: str) -> tuple[list[_Sample], Exception | None]:
    samples, error = [], None
    try:
        entries = ((k, ext, _Member(ext, -1, m.size)) for k, ext, m, _ in _stream_members(path))
        for key, parts in _group(entries):
            samples.append(_Sample(key, tuple(p for _, p in parts)))
    except decompression_errors() as e:
        error = TruncatedFileError(f"compressed tar ends early ({e})", where=f"{name} sample {len(samples)}")
    except tarfile.ReadError as e:
        kind = TruncatedFileError if "unexpected end" in str(e) else CorruptFileError
        error = kind(f"bad tar data: {e}", where=f"{name} sample {len(samples)}")
    if error is not None and samples:
        samples.pop()
    return samples, error


class WebDatasetReader(ShardReader):
    """webdataset ``.tar`` shards; position = sample index in the shard, key = ``__key__``."""

    kind = "webdataset"

    def __init__(self, paths: list[str]):
        super().__init__()
        self.paths = paths
        self._samples: list[list[_Sample]] = []
        for i, (path, name) in enumerate(zip(paths, shard_names(paths))):
            plain = path.endswith(".tar")
            samples, error = (_index_plain if plain else _index_stream)(path, name)
            if error is not None:
                self.index_errors.append(error)
            self._samples.append(samples)
            self.shards.append(ShardInfo(i, name, path, len(samples), seekable=plain,
                                         size_bytes=os.path.getsize(path)))

    def read(self, shard: int, start: int, stop: int) -> Iterator[RawRecord]:
        info = self.shards[shard]
        samples = self._samples[shard]
        stop = min(stop, len(samples))
        if start >= stop:
            return
        if info.seekable:
            with open(info.path, "rb") as f:
                for pos in range(start, stop):
                    parts = []
                    for m in samples[pos].members:
                        f.seek(m.offset)
                        parts.append((m.ext, f.read(m.size)))
                    yield to_raw_record(info, pos, samples[pos].key, parts)
            return
        yield from self._read_stream(info, start, stop)

    @staticmethod
    def _read_stream(info: ShardInfo, start: int, stop: int) -> Iterator[RawRecord]:
        # A sample is emitted as soon as the next key shows up, before that member's data
        # is read, so a damaged tail never hides the complete samples before it.
        key, parts, pos = None, [], 0
        try:
            for k, ext, member, tf in _stream_members(info.path):
                if k != key and parts:
                    if pos >= start:
                        yield to_raw_record(info, pos, key, parts)
                    pos, parts = pos + 1, []
                    if pos >= stop:
                        return
                key = k
                parts.append((ext, tf.extractfile(member).read() if pos >= start else b""))
            if parts and start <= pos < stop:
                yield to_raw_record(info, pos, key, parts)
        except (*decompression_errors(), tarfile.ReadError) as e:
            err = TruncatedFileError(f"compressed tar ends early ({e})", where=f"{info.name} sample {pos}")
            yield RawRecord(stop - 1, f"{info.name}:{pos}", error=err)


def to_raw_record(info: ShardInfo, pos: int, key: str, parts: list[tuple[str, bytes]]) -> RawRecord:
    """Turn one sample's members into a record the schema mapping understands.

    ``.json`` is the record itself; without it ``.txt`` becomes ``{"caption": ...}`` when
    the sample has an image and ``{"text": ...}`` otherwise. Image members are carried
    as embedded images; all other members go to ``meta`` under their extension.
    """
    where = f"{info.name}:{key}"
    base_dir = os.path.dirname(info.path)
    images = [{"bytes": data} for ext, data in parts if ext.rsplit(".", 1)[-1] in IMAGE_EXTS]
    texts = {ext: data for ext, data in parts if ext.rsplit(".", 1)[-1] not in IMAGE_EXTS}
    try:
        if "json" in texts:
            record = parse_json_object(texts.pop("json"), where=f"{where}.json")
        elif "txt" in texts:
            text = _decode(texts.pop("txt"), where, "txt")
            record = {"caption": text} if images else {"text": text}
        else:
            raise MissingFieldError("sample has no .json or .txt member", where=where, field="json")
        extra = {ext: _maybe_text(data) for ext, data in texts.items()}
    except (MissingFieldError, BadFieldError, ValueError) as e:
        return RawRecord(pos, key, error=e)
    return RawRecord(pos, key, record, images=images, base_dir=base_dir, extra=extra)


def _decode(data: bytes, where: str, ext: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadFieldError(f".{ext} member is not UTF-8 ({e.reason})", where=where, field=ext) from None


def _maybe_text(data: bytes):
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data
