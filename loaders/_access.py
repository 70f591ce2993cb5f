"""Random access to a `Source` (or `Mixture`) by ``sample_id``: `open_access` and `Source.read`.

``sample_id`` is ``(shard << 32) | position`` (the row index for a HF ``datasets.Dataset``), so a
sample is found without any search. Costs, per format:

* Parquet: the row-group starts come from the footer (already read by the source). A read groups
  the wanted rows by row group and decodes each touched row group once per call (``read_row_group``
  + ``take``), so a read of samples spread over the file decodes up to one row group per sample:
  keep row groups small (a few thousand rows) for random access.
* Arrow IPC files: memory-mapped; one record batch per touched batch, zero-copy ``take``.
* JSONL: a byte offset per line, built once by one vectorized newline scan of each file (8 bytes
  of memory per line, about 1 s per GB); reads are ``mmap`` slices. Compressed ``.gz``/``.zst`` files
  have no byte offsets: they are decompressed once into memory (the whole file) and indexed there.
* HF ``datasets.Dataset``: ``dataset[indices]`` through the Arrow formatter (one ``take``).
* Anything else (webdataset, JSON arrays, streaming HF): the source's own reader over the nearby
  positions; streaming HF datasets re-stream from the shard start, so they are not random access
  (``Source.supports_random_access`` is False).

Every reader maps raw records to the same normalized sample dicts the source yields (same schema
mapping, ``key``, ``source`` name and ``sample_id``).
"""

from __future__ import annotations

import bisect
import mmap
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from ._arrow import ArrowIPCReader, ParquetReader, arrow_input
from ._errors import CorruptFileError, InvalidJSONError
from ._files import decompression_errors, is_compressed, open_binary, stream_error
from ._fs import LOCAL
from ._hf import HFDatasetReader
from ._iterator import reread_runs, normalized_sample
from ._jsonl import JsonlReader, parse_json_object
from ._sharding import POSITION_BITS, split_sample_ids
from ._types import RawRecord

_CHUNK = 1 << 20


class SampleAccess(ABC):
    """Reads normalized sample dicts by ``sample_id``. Subclasses implement `_read_shard`."""

    random_access = True

    def __init__(self, source, name: str | None = None, shard_offset: int = 0):
        self.source = source
        self.reader = source._reader
        self.storage = getattr(self.reader, "storage", None) or LOCAL
        self.name = name or source.name
        self.shard_offset = shard_offset
        self._pid = os.getpid()
        self._handles: dict = {}  # open files by shard: never shared with forked or pickled copies

    def _check_pid(self) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._handles = {}

    def read(self, sample_ids: Sequence[int] | np.ndarray) -> list[dict]:
        """The samples with these ids, in the given order. Raises KeyError for an unknown id."""
        self._check_pid()
        ids = np.asarray(sample_ids, np.int64)
        shard, pos = split_sample_ids(ids)
        shard = shard - self.shard_offset
        found: dict[int, dict] = {}
        for s in np.unique(shard):
            sel = shard == s
            if s < 0 or s >= len(self.reader.shards):
                raise KeyError(f"sample_id {int(ids[sel][0])} names shard {int(s)}, but source "
                               f"{self.name!r} has {len(self.reader.shards)} shards")
            want = np.unique(pos[sel])
            for p, raw in zip(want, self._read_shard(int(s), want)):
                found[(int(s) << POSITION_BITS) | int(p)] = self._normalize(raw, int(s))
        return [found[int(i) - (self.shard_offset << POSITION_BITS)] for i in ids]

    @abstractmethod
    def _read_shard(self, shard: int, positions: np.ndarray) -> list:
        """`loaders` RawRecords at the sorted, unique ``positions`` of ``shard``, in that order."""

    def _normalize(self, raw, shard: int) -> dict:
        if raw.error is not None:
            raise raw.error
        return normalized_sample(raw, self.source._schema(raw), shard + self.shard_offset, self.name)

    def __getstate__(self):
        d = self.__dict__.copy()
        d["_handles"] = {}
        return d


class GenericAccess(SampleAccess):
    """Through the source's own reader: one range read per cluster of nearby positions."""

    def __init__(self, source, name=None, shard_offset=0):
        super().__init__(source, name, shard_offset)
        self.random_access = bool(getattr(self.reader, "random_access", True))

    def _read_shard(self, shard, positions):
        got = {}
        clusters = reread_runs(positions.tolist())
        wanted = set(positions.tolist())
        for a, b in clusters:
            for raw in self.reader.read(shard, a, b + 1):
                if raw.position in wanted:
                    got[raw.position] = raw
        missing = [p for p in positions.tolist() if p not in got]
        if missing:
            info = self.reader.shards[shard]
            raise KeyError(f"{info.name}: no sample at positions {missing[:5]} (blank lines, or the data changed)")
        return [got[p] for p in positions.tolist()]


class ParquetAccess(SampleAccess):
    """Parquet files: row group + offset, one decode per touched row group per call."""

    def _file(self, shard):
        import pyarrow.parquet as pq

        if shard not in self._handles:
            path = self.reader.shards[shard].path
            local = self.storage.local_path(path)
            self._handles[shard] = pq.ParquetFile(local if local is not None else self.storage.open(path, random=True))
        return self._handles[shard]

    def _groups(self, shard, positions):
        starts = np.asarray(self.reader._group_starts[shard], np.int64)
        n = starts[-1] if len(starts) else 0
        if len(positions) and positions[-1] >= n:
            raise KeyError(f"{self.reader.shards[shard].name}: row {int(positions[-1])} is past the end ({n} rows)")
        return starts, np.searchsorted(starts, positions, side="right") - 1

    def _read_group(self, shard, group):
        return self._file(shard).read_row_group(int(group), columns=self.reader.columns)

    def _checked_group(self, shard, group, starts):
        import pyarrow as pa

        try:
            return self._read_group(shard, group)
        except (pa.ArrowException, OSError) as e:
            info = self.reader.shards[shard]
            raise CorruptFileError(f"cannot read {self.reader.kind} data of group {int(group)} (rows "
                                   f"{int(starts[group])}-{int(starts[group + 1]) - 1}): {e}",
                                   where=f"{info.name}:{int(starts[group])}") from None

    def _read_shard(self, shard, positions):
        info = self.reader.shards[shard]
        base_dir = os.path.dirname(info.path)
        starts, group = self._groups(shard, positions)
        out = []
        for g in np.unique(group):
            sel = positions[group == g]
            rows = self._checked_group(shard, g, starts).take(sel - starts[g]).to_pylist()
            out += [RawRecord(int(p), f"{info.name}:{int(p)}", r, base_dir=base_dir) for p, r in zip(sel, rows)]
        return out


class ArrowAccess(ParquetAccess):
    """Arrow IPC files (random-access format): memory-mapped record batches."""

    def _file(self, shard):
        import pyarrow as pa

        if shard not in self._handles:
            self._handles[shard] = pa.ipc.open_file(arrow_input(self.storage, self.reader.shards[shard].path, True))
        return self._handles[shard]

    def _read_group(self, shard, group):
        batch = self._file(shard).get_batch(int(group))
        if self.reader.columns is not None:
            batch = batch.select(self.reader.columns)
        return batch


class HFAccess(SampleAccess):
    """A map-style ``datasets.Dataset``: ``sample_id`` is the row index."""

    def _read_shard(self, shard, positions):
        n = self.reader.shards[0].num_rows
        if len(positions) and positions[-1] >= n:
            raise KeyError(f"row {int(positions[-1])} is past the end of dataset {self.name!r} ({n} rows)")
        rows = self.reader._arrow[positions.tolist()].to_pylist()
        return [RawRecord(int(p), f"{self.reader.name}:{int(p)}", r) for p, r in zip(positions, rows)]


def line_offsets(data) -> np.ndarray:
    """Byte offset of the start of every line, plus the end (int64, length lines + 1).

    ``data`` is a bytes-like object or an open binary file; one vectorized newline scan.
    """
    parts = [np.zeros(1, np.int64)]
    size = 0
    if isinstance(data, (bytes, bytearray, memoryview, mmap.mmap)):
        buf = np.frombuffer(data, np.uint8)
        parts.append(np.flatnonzero(buf == 10).astype(np.int64) + 1)
        size = len(buf)
    else:
        while chunk := data.read(_CHUNK):
            parts.append(np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10).astype(np.int64) + 1 + size)
            size += len(chunk)
    offs = np.concatenate(parts)
    if offs[-1] != size:  # last line without a trailing newline
        offs = np.append(offs, size)
    return offs


class JsonlAccess(SampleAccess):
    """JSON Lines: byte offset of every line (see the module docstring for the cost)."""

    def __init__(self, source, name=None, shard_offset=0):
        super().__init__(source, name, shard_offset)
        self._offsets: list[np.ndarray] = []
        self._memory: dict[int, bytes] = {}  # decompressed files
        for info in self.reader.shards:
            if is_compressed(info.path):
                # Only the part that passed the integrity check when the source was built.
                try:
                    limit = self.reader.readable_bytes(info.index)
                    with open_binary(info.path, limit=limit, storage=self.storage) as f:
                        self._memory[info.index] = f.read()
                except decompression_errors() as e:  # the file changed since the source was built
                    raise stream_error(info.path, e, where=info.name) from None
                self._offsets.append(line_offsets(self._memory[info.index]))
            else:
                with self.storage.open(info.path) as f:
                    self._offsets.append(line_offsets(f))

    def _data(self, shard):
        if shard in self._memory:
            return self._memory[shard]
        if shard not in self._handles:
            path = self.reader.shards[shard].path
            local = self.storage.local_path(path)
            if local is None:  # a remote file: range requests
                self._handles[shard] = _RemoteBytes(self.storage.open(path, random=True))
            else:
                with open(local, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    self._handles[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        return self._handles[shard]

    def _read_shard(self, shard, positions):
        info = self.reader.shards[shard]
        offs = self._offsets[shard]
        if len(positions) and positions[-1] >= len(offs) - 1:
            raise KeyError(f"{info.name}: line {int(positions[-1]) + 1} is past the end ({len(offs) - 1} lines)")
        data = self._data(shard)
        if isinstance(data, _RemoteBytes):
            data.fetch(offs, positions)
        base_dir = os.path.dirname(info.path)
        out = []
        for p in positions.tolist():
            where = f"{info.name}:{p + 1}"
            text = bytes(data[offs[p]:offs[p + 1]]).strip()
            if not text:
                raise KeyError(f"{where}: blank line, no sample there (is the index from other data?)")
            try:
                out.append(RawRecord(p, where, parse_json_object(text, where), base_dir=base_dir))
            except InvalidJSONError as e:
                out.append(RawRecord(p, where, error=e))
        return out


class _RemoteBytes:
    """Slices of a remote file: `fetch` reads the lines wanted, one range request per run of lines
    less than 64 KiB apart; slicing then serves them from memory."""

    GAP = 1 << 16

    def __init__(self, f):
        self.f = f
        self.spans: list[tuple[int, bytes]] = []  # (start byte, data), by start

    def fetch(self, offs: np.ndarray, positions: np.ndarray) -> None:
        runs: list[list[int]] = []
        for p in positions.tolist():
            a, b = int(offs[p]), int(offs[p + 1])
            if runs and a - runs[-1][1] <= self.GAP:
                runs[-1][1] = max(runs[-1][1], b)
            else:
                runs.append([a, b])
        self.spans = []
        for a, b in runs:
            self.f.seek(a)
            self.spans.append((a, self.f.read(b - a)))

    def __getitem__(self, sl: slice) -> bytes:
        start, stop = int(sl.start), int(sl.stop)
        i = bisect.bisect_right([a for a, _ in self.spans], start) - 1
        if i < 0 or stop > self.spans[i][0] + len(self.spans[i][1]):
            self.f.seek(start)
            return self.f.read(stop - start)
        a, data = self.spans[i]
        return data[start - a:stop - a]


class MixtureAccess:
    """A `loaders.Mixture`: dispatch each id to its source by shard range."""

    def __init__(self, mixture, generic: bool = False):
        self.parts = []
        for name, (lo, hi) in mixture.shard_ranges.items():
            self.parts.append((lo, hi, open_access(mixture.sources[name], name=name, shard_offset=lo,
                                                   generic=generic)))
        self.random_access = all(p[2].random_access for p in self.parts)

    def read(self, sample_ids) -> list[dict]:
        ids = np.asarray(sample_ids, np.int64)
        shard, _ = split_sample_ids(ids)
        out: list = [None] * len(ids)
        for lo, hi, acc in self.parts:
            sel = np.flatnonzero((shard >= lo) & (shard < hi))
            if len(sel):
                for i, s in zip(sel, acc.read(ids[sel])):
                    out[i] = s
        bad = [int(ids[i]) for i, s in enumerate(out) if s is None]
        if bad:
            raise KeyError(f"sample ids {bad[:5]} belong to no source of the mixture")
        return out


def open_access(source, name: str | None = None, shard_offset: int = 0, generic: bool = False):
    """The best random-access reader for a `loaders.Source` (or `Mixture`). ``generic`` uses the
    source's own range reads, which need no index of their own (for the few re-reads of a resume)."""
    if getattr(source, "shard_ranges", None) is not None:  # a `Mixture`: each source read by its own access
        return MixtureAccess(source, generic)
    reader = source._reader
    if generic:
        return GenericAccess(source, name, shard_offset)
    if isinstance(reader, ParquetReader):
        return ParquetAccess(source, name, shard_offset)
    if isinstance(reader, ArrowIPCReader) and _all_ipc_files(reader):
        return ArrowAccess(source, name, shard_offset)
    if isinstance(reader, JsonlReader):
        return JsonlAccess(source, name, shard_offset)
    if isinstance(reader, HFDatasetReader):
        return HFAccess(source, name, shard_offset)
    return GenericAccess(source, name, shard_offset)


def _all_ipc_files(reader) -> bool:
    import pyarrow as pa

    storage = getattr(reader, "storage", None) or LOCAL
    try:
        for info in reader.shards:
            with arrow_input(storage, info.path, random=True) as mm:
                pa.ipc.open_file(mm)
        return True
    except (pa.ArrowInvalid, OSError):
        return False
