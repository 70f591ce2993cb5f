"""Streaming sample sources: JSONL, Parquet/Arrow, HF datasets, webdataset, lists of records; local or
remote (``s3://``, ``gs://``, ``hf://``, ``https://`` ... through fsspec)."""

from ._errors import (
    BadFieldError,
    BadImageError,
    CorruptFileError,
    EmptyTextError,
    ImageError,
    InvalidJSONError,
    LoaderError,
    MissingDependencyError,
    MissingFieldError,
    MissingImageError,
    SchemaError,
    StateError,
    TruncatedFileError,
)
from ._access import open_access
from ._fingerprints import changed_files, file_fingerprints
from ._fs import Storage, is_url
from ._iterator import SlotIterator, normalized_sample
from ._mixture import Mixture, MixtureIterator
from ._optional import optional_module
from ._open import (
    ArrowSource,
    HFIterableSource,
    HFSource,
    JsonlSource,
    JsonSource,
    ParquetSource,
    WebDatasetSource,
    open_source,
)
from ._schema import Mapped, Schema
from ._sharding import Layout, WorkUnit, split_sample_ids
from ._source import Source
from ._state import merge_states, requeue_samples

__all__ = [
    "ArrowSource",
    "BadFieldError",
    "BadImageError",
    "CorruptFileError",
    "EmptyTextError",
    "HFIterableSource",
    "HFSource",
    "ImageError",
    "InvalidJSONError",
    "JsonSource",
    "JsonlSource",
    "Layout",
    "LoaderError",
    "Mapped",
    "MissingDependencyError",
    "MissingFieldError",
    "MissingImageError",
    "Mixture",
    "MixtureIterator",
    "ParquetSource",
    "SchemaError",
    "Schema",
    "SlotIterator",
    "Source",
    "StateError",
    "Storage",
    "is_url",
    "TruncatedFileError",
    "WebDatasetSource",
    "WorkUnit",
    "changed_files",
    "file_fingerprints",
    "merge_states",
    "normalized_sample",
    "open_access",
    "open_source",
    "optional_module",
    "requeue_samples",
    "split_sample_ids",
]
