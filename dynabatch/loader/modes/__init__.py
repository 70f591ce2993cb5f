"""The planning modes of `dynabatch.DataLoader`, each an explicit stateful iterator over steps with
``state_dict()`` / ``load_state_dict()``: `IndexedMode`, `ReplayMode`, `StreamingMode` (see `Mode`)."""

from .base import Context, Mode
from .indexed import IndexedMode, VersionedPlanner, build_indexed, open_index
from .replay import ReplayMode, build_replay
from .streaming import StreamingMode, default_collective

__all__ = ["Context", "IndexedMode", "Mode", "ReplayMode", "StreamingMode", "VersionedPlanner", "build_indexed",
           "build_replay", "default_collective", "open_index"]
