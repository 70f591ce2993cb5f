"""The `DataLoader` and what lies under it, in the data's order.

`dataloader` (the facade) -> `settings` (its typed settings records) and `options` (its
arguments normalized into one `PlanOptions`) -> `modes/` (each mode in one place: `modes/indexed/`, `modes/replay.py`,
`modes/streaming/`, a stateful iterator over steps beside the planner it drives) -> `records`
(a rank's step plan, tokenized samples, ready steps) -> `collate` (model inputs) -> `step` (the
`Step` that `DataLoader.steps` yields). `ahead` plans in the background, `state` nests and merges
the states, `collective` lets streaming ranks agree, `pixels` loads image tiles.

Names are imported lazily (torch is only needed once the loader is used)."""

from .._lazy import lazy_names

_NAMES = {
    "DataLoader": "dataloader", "build_index": "dataloader", "Step": "step", "LoaderSettings": "settings",
    "Tokenization": "settings", "DataSource": "settings", "Costing": "settings", "Runtime": "settings",
    "Mode": "modes", "IndexedMode": "modes", "ReplayMode": "modes", "StreamingMode": "modes",
    "LoaderStateError": "state", "merge_states": "state", "load_loader_state": "state", "save_loader_state": "state",
    "collate_padded": "collate", "collate_packed": "collate", "ThreadCollective": "collective",
    "TaskMixture": "tasks", "step_samples": "tasks",
}
__all__ = sorted(_NAMES)


__getattr__ = lazy_names(__name__, _NAMES)
