"""Records passed between the readers, the schema mapping and the iterator."""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field

from ._errors import LoaderError
from ._fs import LOCAL, Storage, is_url

# sample_id packs (shard << 32) | position, so positions must fit in 32 bits.
MAX_ROWS_PER_SHARD = 1 << 32


@dataclass(frozen=True)
class ShardInfo:
    """One file (or HF shard) of a source.

    ``num_rows`` counts positions (JSONL lines incl. blank ones, Parquet rows, tar samples);
    ``None`` when unknown (streaming HF datasets). ``boundaries`` are cheap split points
    (Parquet row-group starts). ``seekable`` is False when reading from position p costs
    reading everything before p (gzip, zstd, streaming). ``path`` is a local path or a URL;
    ``version`` tells the file's content apart: a remote file's version tag (ETag, checksum or
    modification time), a local file's content digest (`loaders._fs.content_digest`), a HF
    dataset's fingerprint.
    """

    index: int
    name: str
    path: str = ""
    num_rows: int | None = None
    boundaries: tuple[int, ...] = ()
    seekable: bool = True
    size_bytes: int = 0
    version: str = ""


@dataclass
class RawRecord:
    """One position read from a shard: a raw record, or the error found there.

    ``images`` holds images carried next to the record (webdataset image members);
    ``base_dir`` is where relative image paths resolve when no ``image_root`` is given;
    ``extra`` holds further members/columns that go to ``meta`` unchanged. ``where`` names the
    file and position in error messages when ``key`` alone does not (webdataset keys).
    """

    position: int
    key: str
    record: dict | None = None
    error: LoaderError | None = None
    images: list = field(default_factory=list)
    base_dir: str = ""
    extra: dict = field(default_factory=dict)
    where: str = ""


class ShardReader(ABC):
    """Reads positions ``[start, stop)`` of one shard; one subclass per file format.

    Construction indexes the shards (row counts) and must not raise on bad data:
    problems go to ``index_errors`` and the shard is shortened to its readable part,
    so that ``on_error="skip"`` can carry on. ``random_access`` says whether re-reading
    a few positions is cheap (used to restore shuffle buffers from positions).
    """

    kind = "base"
    random_access = True
    storage: Storage = LOCAL  # opens the shard paths (local paths and URLs); file readers set their own

    def __init__(self) -> None:
        self.shards: list[ShardInfo] = []
        self.index_errors: list[LoaderError] = []

    @property
    def default_name(self) -> str:
        """Name used for the ``"source"`` field when the user gives none."""
        return self.kind

    @abstractmethod
    def read(self, shard: int, start: int, stop: int) -> Iterator[RawRecord]:
        """Yield the records at positions ``start <= p < stop`` in increasing order."""

    def fingerprint(self) -> str:
        """Hash of the shard list (names, sizes, row counts, remote version tags); state dicts must match it."""
        desc = [self.kind] + [[s.name, s.num_rows, s.size_bytes, *([s.version] if s.version else [])]
                              for s in self.shards]
        return hashlib.sha1(json.dumps(desc).encode()).hexdigest()[:16]


def shard_names(paths: list[str]) -> list[str]:
    """Names relative to the files' common folder: the plain file name for one folder. URLs count
    as ``/scheme/rest`` paths, so ``s3://b/x/a.jsonl`` and ``s3://b/y/c.jsonl`` are ``x/a.jsonl``, ``y/c.jsonl``."""
    if not any(is_url(p) for p in paths):
        if len(paths) <= 1:
            return [os.path.basename(p) for p in paths]
        root = os.path.commonpath([os.path.dirname(p) for p in paths])
        return [os.path.relpath(p, root) for p in paths]
    forms = [posixpath.normpath("/" + p.replace("://", "/", 1) if is_url(p) else os.path.abspath(p)) for p in paths]
    if len(forms) <= 1:
        return [posixpath.basename(f) for f in forms]
    root = posixpath.commonpath([posixpath.dirname(f) for f in forms])
    return [posixpath.relpath(f, root) for f in forms]
