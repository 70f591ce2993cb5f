"""One ``Source`` subclass per input format, and ``open_source`` which picks among them."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from ._arrow import ArrowIPCReader, ParquetReader
from ._files import COMPRESSED_SUFFIXES, expand_paths
from ._fs import Storage, is_url, local_form
from ._hf import HFDatasetReader, HFIterableReader
from ._jsonl import JsonArrayReader, JsonlReader
from ._optional import optional_module
from ._source import Source, with_source_options
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


class _FileSource(Source):
    """Files of one format read by ``_reader`` (class attribute) over ``expand_paths(paths, _suffixes)``;
    ``columns`` limits the columns read (columnar formats only)."""

    _reader: type
    _suffixes: tuple[str, ...]
    _columnar = False

    @with_source_options
    def __init__(self, paths, storage_options: dict | None = None, cache_dir: str | None = None, **options):
        self._open(paths, None, storage_options, cache_dir, options)

    def _open(self, paths, columns, storage_options, cache_dir, options) -> None:
        storage = Storage(storage_options, cache_dir)
        files = expand_paths(paths, self._suffixes, storage)
        reader = self._reader(files, columns, storage) if self._columnar else self._reader(files, storage)
        Source.__init__(self, reader, **options)


class JsonlSource(_FileSource):
    """JSON Lines (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``, ``.jsonl.bz2``); ``paths`` is a path, glob,
    ``{000..009}`` pattern, folder, URL (``s3://...``), or a list of them. ``storage_options``: the
    fsspec file system's keywords for URLs; ``cache_dir``: keep local copies of remote files there
    (see `loaders.Storage`). Other options: see ``Source``."""

    _reader, _suffixes = JsonlReader, JSONL_SUFFIXES


class JsonSource(_FileSource):
    """``.json`` files holding one array of records (e.g. LLaVA), parsed whole into memory;
    ``storage_options``/``cache_dir`` as for `JsonlSource`."""

    _reader, _suffixes = JsonArrayReader, JSON_SUFFIXES


class _ColumnarSource(_FileSource):
    _columnar = True

    @with_source_options
    def __init__(self, paths, columns: list[str] | None = None, storage_options: dict | None = None,
                 cache_dir: str | None = None, **options):
        self._open(paths, columns, storage_options, cache_dir, options)


class ParquetSource(_ColumnarSource):
    """Parquet files, read by row group; ``columns`` limits the columns read; ``storage_options``/
    ``cache_dir`` as for `JsonlSource`."""

    _reader, _suffixes = ParquetReader, PARQUET_SUFFIXES


class ArrowSource(_ColumnarSource):
    """Arrow IPC files or streams (memory-mapped), read by record batch; ``storage_options``/
    ``cache_dir`` as for `JsonlSource`."""

    _reader, _suffixes = ArrowIPCReader, ARROW_SUFFIXES


class WebDatasetSource(Source):
    """webdataset tar shards, e.g. ``"data/shard-{000..009}.tar"`` or ``"s3://b/shard-{000..009}.tar"``;
    ``storage_options``/``cache_dir`` as for `JsonlSource`; see ``_webdataset``."""

    @with_source_options
    def __init__(self, urls, storage_options: dict | None = None, cache_dir: str | None = None, **options):
        storage = Storage(storage_options, cache_dir)
        super().__init__(WebDatasetReader(expand_paths(urls, TAR_SUFFIXES, storage), storage), **options)


class HFSource(Source):
    """A map-style ``datasets.Dataset``; ``sample_id`` is the row index."""

    @with_source_options
    def __init__(self, dataset, **options):
        super().__init__(HFDatasetReader(dataset, options.get("name")), **options)


class HFIterableSource(Source):
    """A streaming ``datasets.IterableDataset``, sharded by its ``n_shards``."""

    @with_source_options
    def __init__(self, dataset, **options):
        super().__init__(HFIterableReader(dataset, options.get("name")), **options)


_SOURCES = {"jsonl": JsonlSource, "json": JsonSource, "parquet": ParquetSource,
            "arrow": ArrowSource, "webdataset": WebDatasetSource}


def _format_of(path: str) -> str | None:
    low = path.lower()
    return next((kind for suffix, kind in _BY_SUFFIX.items() if low.endswith(suffix)), None)


@with_source_options
def open_source(data, split: str | None = None, *, storage_options: dict | None = None,
                cache_dir: str | None = None, **options) -> Source:
    """Open files, a folder, a ``save_to_disk`` folder, URLs, a HF dataset or a list of records as a ``Source``.

    The format comes from the object type or the file extension (``.jsonl[.gz|.zst]``,
    ``.json``, ``.parquet``, ``.arrow``/``.feather``, ``.tar``/``.tar.gz``). Paths may be URLs
    (``s3://``, ``gs://``, ``hf://``, ``https://`` ...) read through fsspec with ``storage_options``;
    ``cache_dir`` keeps local copies of remote files (see `loaders.Storage`). A list of dicts
    becomes an in-memory ``datasets.Dataset`` (map-style: random access, known row count).
    ``split`` picks a split from a ``DatasetDict``. Other keywords go to the ``Source``.
    """
    if isinstance(data, Source):
        return data
    storage = Storage(storage_options, cache_dir)
    wants_files = storage_options is not None or cache_dir is not None
    saved = _saved_dataset_dir(data, storage)
    if saved is not None:
        datasets = optional_module("datasets", f"loading the saved Hugging Face dataset {saved}")

        options.setdefault("name", saved.rstrip("/").rsplit("/", 1)[-1])
        kw = {"storage_options": storage.options} if is_url(saved) else {}
        data, wants_files = datasets.load_from_disk(saved, **kw), False
    elif _is_records(data):
        data = _records_dataset(data)
    # ``data`` can be a datasets object only once the (slow to import) module is loaded: files and
    # URLs open without it
    datasets = sys.modules.get("datasets")
    if datasets is None:
        return _open_files(data, storage, storage_options, cache_dir, options)
    if wants_files and isinstance(data, datasets.Dataset | datasets.IterableDataset | datasets.DatasetDict
                            | datasets.IterableDatasetDict):
        raise TypeError("storage_options= and cache_dir= apply to files and URLs, not to a datasets object "
                        "or a list of records")
    if isinstance(data, datasets.DatasetDict | datasets.IterableDatasetDict):
        if split is None:
            raise ValueError(f"a DatasetDict needs split=..., one of {list(data)}")
        data = data[split]
    if isinstance(data, datasets.Dataset):
        return HFSource(data, **options)
    if isinstance(data, datasets.IterableDataset):
        return HFIterableSource(data, **options)
    return _open_files(data, storage, storage_options, cache_dir, options)


def _open_files(data, storage: Storage, storage_options, cache_dir, options: dict) -> Source:
    """``data`` (paths or URLs) as the ``Source`` of their format."""
    files = expand_paths(_as_paths(data), tuple(_BY_SUFFIX), storage)
    formats = {_format_of(f) for f in files}
    if None in formats:
        bad = next(f for f in files if _format_of(f) is None)
        raise ValueError(f"cannot tell the format of {bad}; known suffixes: {sorted(_BY_SUFFIX)}")
    if len(formats) > 1:
        raise ValueError(f"files of several formats {sorted(formats)}; open them separately (e.g. in a Mixture)")
    return _SOURCES[formats.pop()](files, storage_options=storage_options, cache_dir=cache_dir, **options)


def _saved_dataset_dir(data, storage: Storage) -> str | None:
    """``data`` as a path or URL when it is a ``save_to_disk`` folder, else None."""
    if not isinstance(data, (str, os.PathLike)):
        return None
    path = local_form(os.fspath(data))
    if not is_url(path):
        ok = os.path.isdir(path) and any(os.path.exists(os.path.join(path, m)) for m in _HF_SAVED_MARKERS)
        return os.path.normpath(path) if ok else None
    if _format_of(path) is not None or any(ch in path for ch in "*?[{"):
        return None  # a data file or a pattern: no folder to look into
    return path if any(storage.exists(path.rstrip("/") + "/" + m) for m in _HF_SAVED_MARKERS) else None


def _is_records(data) -> bool:
    """A non-empty list/tuple of dicts (records, as for ``datasets.Dataset.from_list``)."""
    return isinstance(data, (list, tuple)) and bool(data) and all(isinstance(x, Mapping) for x in data)


def _records_dataset(records) -> datasets.Dataset:
    """An in-memory ``datasets.Dataset`` of a list of dicts: one column per key found in any record
    (in first-seen order; None where a record lacks it), unlike ``Dataset.from_list``, which keeps
    only the first record's keys."""
    import pyarrow as pa

    datasets = optional_module("datasets", "a list of records as input (an in-memory datasets.Dataset)")

    keys = list(dict.fromkeys(k for r in records for k in r))
    bad = [k for k in keys if not isinstance(k, str)]
    if bad:
        raise TypeError(f"record keys must be strings, got {bad[0]!r}")
    columns = {k: [r.get(k) for r in records] for k in keys}
    try:
        return datasets.Dataset.from_dict(columns)
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise ValueError(f"cannot make a table of these {len(records)} records ({e}); build the "
                         "datasets.Dataset yourself (e.g. with features=) and pass it") from None


def _as_paths(data):
    """``data`` as a path/URL or a list of them; TypeError/ValueError for anything else."""
    if isinstance(data, (str, os.PathLike)):
        return data
    if isinstance(data, Mapping) or not hasattr(data, "__iter__"):
        raise TypeError(f"open_source cannot open {type(data).__name__!r} data: pass paths/URLs, a list of "
                        "records (dicts), a datasets.Dataset/IterableDataset/DatasetDict, or a loaders.Source")
    items = list(data)
    if not items:
        raise ValueError("open_source got an empty list: no paths and no records")
    bad = next((x for x in items if not isinstance(x, (str, os.PathLike))), None)
    if bad is not None:
        raise TypeError(f"open_source got a list holding {type(bad).__name__!r} items ({bad!r:.60}); expected a "
                        "list of dicts (records, as for datasets.Dataset.from_list) or a list of paths/URLs")
    return items
