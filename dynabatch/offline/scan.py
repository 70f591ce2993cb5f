"""`scan_dataset`: the length index of a whole dataset, in parallel. The scan itself, its
configuration and result live in `dynabatch.index.scan` (the one scan the DataLoader, ``dynabatch
scan``/``plan`` and ``build_index`` share); the index format in `dynabatch.index.table`."""

from __future__ import annotations

from ..index.scan import FAMILIES, VISION_POLICIES, ScanConfig, ScanResult, scan_dataset  # noqa: F401
from ..index.table import INDEX_FORMAT, write_index  # noqa: F401
