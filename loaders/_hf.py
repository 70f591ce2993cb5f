"""Hugging Face ``datasets.Dataset`` (map-style) and ``datasets.IterableDataset`` (streaming)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from ._types import RawRecord, ShardInfo, ShardReader

# Rows fetched per slice; one Arrow slice per chunk keeps Python overhead low.
CHUNK_ROWS = 512


class HFDatasetReader(ShardReader):
    """A map-style ``datasets.Dataset`` as one shard; position = row index, key = ``name:row``.

    Rows are read through the Arrow formatter, so ``Image``/``Audio`` columns come back as
    their stored ``{"bytes", "path"}`` structs instead of being decoded here.
    """

    kind = "hf"

    def __init__(self, dataset, name: str | None = None):
        super().__init__()
        self._arrow = dataset.with_format("arrow")
        self._fp = getattr(dataset, "_fingerprint", None) or ""
        self.name = name or _dataset_name(dataset)
        self.shards = [ShardInfo(0, self.name, "", len(dataset), version=self._fp)]

    @property
    def default_name(self) -> str:
        return self.name

    def fingerprint(self) -> str:
        desc = f"hf|{self.name}|{len(self._arrow)}|{self._fp}"
        return hashlib.sha1(desc.encode()).hexdigest()[:16]

    def read(self, shard: int, start: int, stop: int) -> Iterator[RawRecord]:
        stop = min(stop, self.shards[0].num_rows)
        for lo in range(start, stop, CHUNK_ROWS):
            hi = min(stop, lo + CHUNK_ROWS)
            for off, row in enumerate(self._arrow[lo:hi].to_pylist()):
                yield RawRecord(lo + off, f"{self.name}:{lo + off}", row)


class HFIterableReader(ShardReader):
    """A streaming ``datasets.IterableDataset``; shards are its ``n_shards`` data shards.

    Row counts are unknown, so a shard is never split: with fewer shards than
    rank x worker slots some slots get no data (re-shard the dataset, e.g.
    ``to_iterable_dataset(num_shards=...)``). Starting at position p streams and drops p
    rows, so shuffle buffers are saved as samples, not positions.
    """

    kind = "hf_iterable"
    random_access = False

    def __init__(self, dataset, name: str | None = None):
        super().__init__()
        if hasattr(dataset, "decode"):
            # Leave image decoding to the tokenization stage: keep {"bytes", "path"}.
            dataset = dataset.decode(False)
        self._ds = dataset
        self.name = name or _dataset_name(dataset)
        n = dataset.n_shards
        self.shards = [ShardInfo(i, f"{self.name}#{i}", "", None, seekable=False) for i in range(n)]

    @property
    def default_name(self) -> str:
        return self.name

    def read(self, shard: int, start: int, stop: int) -> Iterator[RawRecord]:
        part = self._ds.shard(num_shards=len(self.shards), index=shard)
        for pos, row in enumerate(part):
            if pos >= stop:
                return
            if pos >= start:
                yield RawRecord(pos, f"{self.name}#{shard}:{pos}", dict(row))


def _dataset_name(dataset) -> str:
    info = getattr(dataset, "info", None)
    for attr in ("dataset_name", "builder_name", "config_name"):
        value = getattr(info, attr, None)
        if value:
            return str(value)
    return "dataset"
