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

import io
import os
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache

from ._errors import BadFieldError, CorruptFileError, MissingFieldError, TruncatedFileError
from ._files import CheckedReader, DamagedStream, compression_of, decompression_errors, open_binary
from ._fs import LOCAL, Storage
from ._jsonl import parse_json_object
from ._optional import optional_module
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


@lru_cache(maxsize=1)
def _base_plus_ext():
    """webdataset's member-name splitter (imported on first use: webdataset is optional)."""
    return optional_module("webdataset.tariterators", "reading webdataset tar shards").base_plus_ext


def _split(name: str) -> tuple[str | None, str]:
    key, ext = _base_plus_ext()(name)
    return key, (ext or "").lower()


def _keep(m: tarfile.TarInfo) -> tuple[str, str] | None:
    """(key, ext) of a member that is part of a sample; None for directories, ``__`` files etc."""
    key, ext = _split(m.name)
    if m.isfile() and key is not None and not os.path.basename(m.name).startswith("__"):
        return key, ext
    return None


def _tar_stream_error(name: str, e: BaseException, where: str):
    if isinstance(e, DamagedStream):
        if e.kind == "truncated":
            return TruncatedFileError(f"compressed tar ends early: {e.message}", where=where)
        return CorruptFileError(f"compressed tar is damaged: {e.message}; nothing from decompressed byte "
                                f"{e.verified_end} on is used", where=where)
    if isinstance(e, tarfile.ReadError):
        kind = TruncatedFileError if "unexpected end" in str(e) else CorruptFileError
        return kind(f"bad tar data: {e}", where=where)
    return TruncatedFileError(f"compressed tar ends early ({e})", where=where)


def _index_plain(path: str, name: str, storage: Storage, size: int) -> tuple[list[_Sample], Exception | None]:
    """Index an uncompressed tar of ``size`` bytes; returns complete samples and the damage found, if any."""
    entries, error, end = [], None, 0
    with storage.open(path) as f:
        try:
            with tarfile.open(fileobj=f, mode="r:") as tf:
                for m in tf:
                    key, ext = _split(m.name)
                    if m.offset_data + m.size > size:
                        error = TruncatedFileError(f"member {m.name} is cut off: its data ends at byte "
                                                   f"{m.offset_data + m.size}, the file at byte {size}", where=name)
                        break
                    end = m.offset_data + -(-m.size // _BLOCK) * _BLOCK
                    if m.isfile() and key is not None and not os.path.basename(m.name).startswith("__"):
                        entries.append((key, ext, _Member(ext, m.offset_data, m.size)))
        except tarfile.ReadError as e:
            # "unexpected end of data": the file ends inside a member's data or padding.
            kind = TruncatedFileError if "unexpected end" in str(e) or end + _BLOCK > size else CorruptFileError
            what = f"the file is cut at byte {size}" if kind is TruncatedFileError else f"bad tar header after byte {end}"
            error = kind(f"{what}: {e}", where=name)
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
    return samples, error, None


def _index_stream(path: str, name: str, storage: Storage) -> tuple[list[_Sample], Exception | None, int | None]:
    """Index a compressed tar in one pass; the whole compressed stream is checked (`CheckedReader`:
    gzip CRC/ISIZE per member, also after the tar's end blocks). Returns the samples whose data lies
    in the verified part, the damage found, and the decompressed bytes later reads may use (None:
    all)."""
    raw = CheckedReader(path, compression_of(path) or "gz", storage=storage)
    entries, error, tar_error = [], None, None
    try:
        with raw, io.BufferedReader(raw, buffer_size=1 << 16) as buf:
            try:
                with tarfile.open(fileobj=buf, mode="r|") as tf:
                    for m in tf:
                        if (kept := _keep(m)) is not None:
                            entries.append((*kept, _Member(kept[1], -1, m.size), m.offset_data + m.size))
            except tarfile.ReadError as e:
                tar_error = e
            for _ in raw.chunks():  # check the rest of the stream (tarfile stops at the end blocks)
                pass
    except DamagedStream as e:
        safe = e.data_offset if e.kind == "truncated" else e.verified_end
        error = e
        entries = [x for x in entries if x[3] <= safe]
    if error is None and tar_error is not None:
        error = tar_error
    grouped = list(_group((k, ext, (m, end)) for k, ext, m, end in entries))
    samples = [_Sample(k, tuple(m for _, (m, _) in parts)) for k, parts in grouped]
    ends = [max(end for _, (_, end) in parts) for _, parts in grouped]
    readable = None
    if error is not None:
        if samples:
            samples.pop()  # the last sample may be missing members
            ends.pop()
        readable = ends[-1] if ends else 0
        error = _tar_stream_error(name, error, where=f"{name}:sample {len(samples)}")
    return samples, error, readable


class WebDatasetReader(ShardReader):
    """webdataset ``.tar`` shards; position = sample index in the shard, key = ``__key__``.
    ``storage`` opens local paths and URLs (`loaders.Storage`)."""

    kind = "webdataset"

    def __init__(self, paths: list[str], storage: Storage | None = None):
        super().__init__()
        self.paths = paths
        self.storage = storage or LOCAL
        self._samples: list[list[_Sample]] = []
        self._readable: list[int | None] = []  # decompressed bytes a read may use; None: all
        for i, (path, name) in enumerate(zip(paths, shard_names(paths))):
            plain = path.lower().endswith(".tar")
            size, version = self.storage.stat(path)
            if plain:
                samples, error, readable = _index_plain(path, name, self.storage, size)
            else:
                samples, error, readable = _index_stream(path, name, self.storage)
            if error is not None:
                self.index_errors.append(error)
            self._samples.append(samples)
            self._readable.append(readable)
            self.shards.append(ShardInfo(i, name, path, len(samples), seekable=plain,
                                         size_bytes=size, version=version))

    def read(self, shard: int, start: int, stop: int) -> Iterator[RawRecord]:
        info = self.shards[shard]
        samples = self._samples[shard]
        stop = min(stop, len(samples))
        if start >= stop:
            return
        if info.seekable:
            with self.storage.open(info.path) as f:
                for pos in range(start, stop):
                    parts = []
                    for m in samples[pos].members:
                        f.seek(m.offset)
                        parts.append((m.ext, f.read(m.size)))
                    yield to_raw_record(info, pos, samples[pos].key, parts)
            return
        yield from self._read_stream(shard, start, stop)

    def _read_stream(self, shard: int, start: int, stop: int) -> Iterator[RawRecord]:
        # Only the part of the stream that passed the integrity check when indexing is read, and a
        # sample is emitted as soon as it has all its members (known from the index).
        info = self.shards[shard]
        samples = self._samples[shard]
        readable = getattr(self, "_readable", None)
        limit = readable[shard] if readable else None
        pos, parts = 0, []
        try:
            with (open_binary(info.path, limit=limit, storage=self.storage) as f,
                  tarfile.open(fileobj=f, mode="r|") as tf):
                for member in tf:
                    if _keep(member) is None:
                        continue
                    ext = _split(member.name)[1]
                    parts.append((ext, tf.extractfile(member).read() if pos >= start else b""))
                    if len(parts) >= len(samples[pos].members):
                        if pos >= start:
                            yield to_raw_record(info, pos, samples[pos].key, parts)
                        pos, parts = pos + 1, []
                        if pos >= stop:
                            return
            if pos < stop:
                raise tarfile.ReadError(f"unexpected end of data: {pos} of {len(samples)} indexed samples found")
        except (*decompression_errors(), tarfile.ReadError) as e:
            err = _tar_stream_error(info.name, e, where=f"{info.name}:sample {pos}")
            err.repeat = pos < start  # a unit before this one meets (and counts) it too
            yield RawRecord(stop - 1, f"{info.name}:{pos}", error=err, where=f"{info.name}:sample {pos}")


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
        return RawRecord(pos, key, error=e, where=where)
    return RawRecord(pos, key, record, images=images, base_dir=base_dir, extra=extra, where=where)


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
