"""One ``Source`` subclass per input format, and ``open_source`` which picks among them."""

from __future__ import annotations

import os

from ._arrow import ArrowIPCReader, ParquetReader
from ._files import COMPRESSED_SUFFIXES, expand_paths
from ._hf import HFDatasetReader, HFIterableReader
from ._jsonl import JsonArrayReader, JsonlReader
from ._source import Source
from ._webdataset import TAR_SUFFIXES, WebDatasetReader

_COMPRESSIONS = ("", *COMPRESSED_SUFFIXES)
JSONL_SUFFIXES = tuple(s + c for s in (".jsonl", ".ndjson") for c in _COMPRESSIONS)
JSON_SUFFIXES = tuple(".json" + c for c in _COMPRESSIONS)
PARQUET_SUFFIXES = (".parquet", ".pq")
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")
_BY_SUFFIX = {
    **dict.fromkeys(JSONL_SUFFIXES, "jsonl"),
    **dict.fromkeys(JSON_SUFFIXES, "json"),
    **dict.fromkeys(PARQUET_SUFFIXES, "parquet"),
    **dict.fromkeys(ARROW_SUFFIXES, "arrow"),
    **dict.fromkeys(TAR_SUFFIXES, "webdataset"),
}
_HF_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


class JsonlSource(Source):
    """JSON Lines (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``, ``.jsonl.bz2``); ``paths`` is a path, glob,
    ``{000..009}`` pattern, folder, or a list of them. Options: see ``Source``."""

    def __init__(self, paths, **options):
        super().__init__(JsonlReader(expand_paths(paths, JSONL_SUFFIXES)), **options)


class JsonSource(Source):
    """``.json`` files holding one array of records (e.g. LLaVA), parsed whole into memory."""

    def __init__(self, paths, **options):
        super().__init__(JsonArrayReader(expand_paths(paths, JSON_SUFFIXES)), **options)


class ParquetSource(Source):
    """Parquet files, read by row group; ``columns`` limits the columns read."""

    def __init__(self, paths, columns: list[str] | None = None, **options):
        super().__init__(ParquetReader(expand_paths(paths, PARQUET_SUFFIXES), columns), **options)


class ArrowSource(Source):
    """Arrow IPC files or streams (memory-mapped), read by record batch."""

    def __init__(self, paths, columns: list[str] | None = None, **options):
        super().__init__(ArrowIPCReader(expand_paths(paths, ARROW_SUFFIXES), columns), **options)


class WebDatasetSource(Source):
    """webdataset tar shards, e.g. ``"data/shard-{000..009}.tar"``; see ``_webdataset``."""

    def __init__(self, urls, **options):
        super().__init__(WebDatasetReader(expand_paths(urls, TAR_SUFFIXES)), **options)


class HFSource(Source):
    """A map-style ``datasets.Dataset``; ``sample_id`` is the row index."""

    def __init__(self, dataset, **options):
        super().__init__(HFDatasetReader(dataset, options.get("name")), **options)


class HFIterableSource(Source):
    """A streaming ``datasets.IterableDataset``, sharded by its ``n_shards``."""

    def __init__(self, dataset, **options):
        super().__init__(HFIterableReader(dataset, options.get("name")), **options)


_SOURCES = {"jsonl": JsonlSource, "json": JsonSource, "parquet": ParquetSource,
            "arrow": ArrowSource, "webdataset": WebDatasetSource}


def _format_of(path: str) -> str | None:
    low = path.lower()
    return next((kind for suffix, kind in _BY_SUFFIX.items() if low.endswith(suffix)), None)


def open_source(data, split: str | None = None, **options) -> Source:
    """Open files, a folder, a ``save_to_disk`` folder, or a HF dataset as a ``Source``.

    The format comes from the object type or the file extension (``.jsonl[.gz|.zst]``,
    ``.json``, ``.parquet``, ``.arrow``/``.feather``, ``.tar``/``.tar.gz``). ``split``
    picks a split from a ``DatasetDict``. Other keywords go to the ``Source``.
    """
    import datasets

    if isinstance(data, Source):
        return data
    if isinstance(data, (str, os.PathLike)) and os.path.isdir(data) and any(
        os.path.exists(os.path.join(data, m)) for m in _HF_SAVED_MARKERS
    ):
        options.setdefault("name", os.path.basename(os.path.normpath(data)))
        data = datasets.load_from_disk(os.fspath(data))
    if isinstance(data, datasets.DatasetDict | datasets.IterableDatasetDict):
        if split is None:
            raise ValueError(f"a DatasetDict needs split=..., one of {list(data)}")
        data = data[split]
    if isinstance(data, datasets.Dataset):
        return HFSource(data, **options)
    if isinstance(data, datasets.IterableDataset):
        return HFIterableSource(data, **options)
    files = expand_paths(data, tuple(_BY_SUFFIX))
    formats = {_format_of(f) for f in files}
    if None in formats:
        bad = next(f for f in files if _format_of(f) is None)
        raise ValueError(f"cannot tell the format of {bad}; known suffixes: {sorted(_BY_SUFFIX)}")
    if len(formats) > 1:
        raise ValueError(f"files of several formats {sorted(formats)}; open them separately (e.g. in a Mixture)")
    return _SOURCES[formats.pop()](files, **options)
