"""Parquet and Arrow IPC shards, read one row group / record batch at a time."""

from __future__ import annotations

import bisect
import os
from abc import abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ._errors import CorruptFileError
from ._fs import LOCAL, Storage
from ._types import RawRecord, ShardInfo, ShardReader, shard_names

# Rows converted to Python at once; bounds memory inside a big row group.
BATCH_ROWS = 1024


class _GroupedTableReader(ShardReader):
    """Shared logic: a shard is a sequence of groups (row groups or record batches).

    Position = 0-based row index in the file, key = ``file:row``. A group that fails to
    decode yields one ``CorruptFileError`` and reading resumes at the next group. ``storage``
    opens local paths and URLs (`loaders.Storage`).
    """

    def __init__(self, paths: list[str], columns: list[str] | None = None, storage: Storage | None = None):
        super().__init__()
        self.paths = paths
        self.columns = columns
        self.storage = storage or LOCAL
        self._group_starts: list[list[int]] = []
        for i, (path, name) in enumerate(zip(paths, shard_names(paths))):
            size, version = self.storage.stat(path)
            try:
                sizes = self._group_sizes(path)
            except (pa.ArrowException, OSError) as e:
                self.index_errors.append(CorruptFileError(f"cannot open {self.kind} file: {e}", where=name))
                sizes = []
            starts = [0, *np.cumsum(sizes).tolist()]
            self._group_starts.append(starts)
            self.shards.append(ShardInfo(i, name, path, starts[-1], boundaries=tuple(starts),
                                         size_bytes=size, version=version))

    @abstractmethod
    def _group_sizes(self, path: str) -> list[int]:
        """Row count of each row group (Parquet) or record batch (Arrow) of the file at ``path``."""

    @abstractmethod
    def _iter_batches(self, path: str, first_group: int) -> Iterator[pa.RecordBatch]:
        """Batches of groups ``first_group, first_group + 1, ...`` in order."""

    def read(self, shard: int, start: int, stop: int) -> Iterator[RawRecord]:
        info = self.shards[shard]
        starts = self._group_starts[shard]
        stop = min(stop, info.num_rows)
        base_dir = os.path.dirname(info.path)
        while start < stop:
            group = bisect.bisect_right(starts, start) - 1
            pos = starts[group]
            try:
                for batch in self._iter_batches(info.path, group):
                    lo, hi = max(start, pos), min(stop, pos + batch.num_rows)
                    if hi > lo:
                        rows = batch.slice(lo - pos, hi - lo).to_pylist()
                        for off, row in enumerate(rows):
                            yield RawRecord(lo + off, f"{info.name}:{lo + off}", row, base_dir=base_dir)
                    pos += batch.num_rows
                    if pos >= stop:
                        return
                return
            except (pa.ArrowException, OSError) as e:
                where = f"{info.name}:{max(pos, start)}"
                err = CorruptFileError(f"cannot read {self.kind} data near row {pos}: {e}", where=where)
                # Every work unit that meets the damaged group fails at the same row ``pos`` (reads go
                # from the group's start); only the unit holding that row counts it, so the count does
                # not depend on how the file was cut into units (number of workers, scan parts).
                err.repeat = pos < start
                # Skip the rest of the damaged group. The error takes the last skipped
                # position, so a resume after it does not meet (and count) it again.
                group = bisect.bisect_right(starts, pos)
                skip_to = min(stop, starts[group]) if group < len(starts) else stop
                yield RawRecord(skip_to - 1, where, error=err)
                start = skip_to


class ParquetReader(_GroupedTableReader):
    """Parquet files; row counts come from the footer, reads go row group by row group."""

    kind = "parquet"

    def _group_sizes(self, path: str) -> list[int]:
        with parquet_file(self.storage, path, random=True) as pf:
            md = pf.metadata
        return [md.row_group(g).num_rows for g in range(md.num_row_groups)]

    def _iter_batches(self, path: str, first_group: int) -> Iterator[pa.RecordBatch]:
        with parquet_file(self.storage, path) as pf:
            # One row group per call: given several, pyarrow reads ahead, and a damaged
            # group would then fail (and be blamed on) the groups before it.
            for group in range(first_group, pf.metadata.num_row_groups):
                yield from pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=self.columns)


class ArrowIPCReader(_GroupedTableReader):
    """Arrow IPC files or streams (``.arrow``, ``.feather``; also HF ``save_to_disk`` shards).

    Files are memory-mapped, so counting rows touches only batch headers. The random-access
    file format jumps to a batch directly; the stream format walks batch headers from the
    start (cheap: no data is copied). A remote file without a local copy (``cache_dir``) is read
    through fsspec instead: counting rows then reads every batch once.
    """

    kind = "arrow"

    @staticmethod
    def _open(source):
        try:
            return pa.ipc.open_file(source), True
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_stream(source), False

    def _group_sizes(self, path: str) -> list[int]:
        with arrow_input(self.storage, path) as mm:
            reader, is_file = self._open(mm)
            if is_file:
                return [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
            return [b.num_rows for b in reader]

    def _iter_batches(self, path: str, first_group: int) -> Iterator[pa.RecordBatch]:
        with arrow_input(self.storage, path) as mm:
            reader, is_file = self._open(mm)
            if is_file:
                batches = (reader.get_batch(g) for g in range(first_group, reader.num_record_batches))
            else:
                batches = (b for g, b in enumerate(reader) if g >= first_group)
            for batch in batches:
                if self.columns is not None:
                    batch = batch.select(self.columns)
                for off in range(0, batch.num_rows, BATCH_ROWS):
                    yield batch.slice(off, BATCH_ROWS)


@contextmanager
def parquet_file(storage: Storage, path: str, random: bool = False):
    """A ``pq.ParquetFile`` of a local path or URL (``random``: see `Storage.open`), closed on exit."""
    local = storage.local_path(path)
    if local is not None:
        with pq.ParquetFile(local) as pf:
            yield pf
        return
    with storage.open(path, random=random) as f, pq.ParquetFile(f) as pf:
        yield pf


def arrow_input(storage: Storage, path: str, random: bool = False):
    """What ``pa.ipc`` reads a file from: a memory map of a local file (or local copy), else the
    remote file opened through fsspec (``random``: see `Storage.open`)."""
    local = storage.local_path(path)
    return pa.memory_map(local) if local is not None else storage.open(path, random=random)
