"""The length index of a dataset (token counts per sample), defined once.

* `table`: the one type `LengthIndex`, its one reader `read_index` (path, table, `Shapes`) and
  writer `write_index`, the on-disk format keys and the integrity checks (`check_index`).
* `scan`: the one scan (`tokenization.scan_shapes` over parts of a source, on local processes or
  Ray): `scan_dataset` for ``dynabatch scan``/``plan``, `scan_source` for the DataLoader and
  ``build_index``.
* `tokens`: the DataLoader's `TokenCache` (token ids by index position); `token_file`: its file on
  disk, read with pread, checked against its integrity record and the tokenizer's content hash.
"""

from .scan import (ScanConfig, ScanResult, check_ids_in_data, index_settings, scan_dataset, scan_parts, scan_source,
                   tokenizer_spec)
from .table import (DATA_FILES_KEY, FINGERPRINT_KEY, INTEGRITY_KEY, LABEL_COLUMN, SCAN_KEY, SETTINGS_KEY, TOKEN_COLUMNS,
                    TOKEN_SETTINGS_KEY, LengthIndex, LengthIndexError, check_index, derived_labels, read_index,
                    read_index_table, write_index)
from .token_file import TokenFileError, TokenFileWriter
from .tokens import TokenCache, encode_all, encode_to_file, token_cache_bytes

__all__ = [
    "DATA_FILES_KEY", "FINGERPRINT_KEY", "INTEGRITY_KEY", "LABEL_COLUMN", "SCAN_KEY", "SETTINGS_KEY",
    "TOKEN_COLUMNS", "TOKEN_SETTINGS_KEY", "LengthIndex", "LengthIndexError", "ScanConfig",
    "ScanResult", "TokenCache", "TokenFileError", "TokenFileWriter", "check_ids_in_data", "check_index",
    "derived_labels", "encode_all", "encode_to_file", "index_settings",
    "read_index", "read_index_table", "scan_dataset", "scan_parts", "scan_source", "token_cache_bytes",
    "tokenizer_spec", "write_index",
]
