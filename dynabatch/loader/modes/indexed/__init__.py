"""Indexed mode, in one place: `steps` (the length index, one global plan per step computed
identically on every rank, random access to this rank's samples: `IndexedPlanner`, `IndexedSteps`)
and `mode` (`IndexedMode`, its stateful iterator; `open_index` builds or reads the length index and
the token cache)."""

from .mode import IndexedMode, VersionedPlanner, build_indexed, check_not_empty, open_index
from .steps import IndexedPlanner, IndexedSteps, index_rank_step, load_index, scan_source, write_index_table

__all__ = ["IndexedMode", "IndexedPlanner", "IndexedSteps", "VersionedPlanner", "build_indexed", "check_not_empty",
           "index_rank_step", "load_index", "open_index", "scan_source", "write_index_table"]
