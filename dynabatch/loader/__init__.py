"""dynabatch/loader: the `DataLoader` facade, its planning modes (`dynabatch.loader.modes`), the
`Step` it yields, collation, collectives and loader states.

Names are imported lazily (torch is only needed once the loader is used)."""

_NAMES = {
    "DataLoader": "dataloader", "build_index": "dataloader", "Step": "step", "LoaderSettings": "options",
    "Mode": "modes", "IndexedMode": "modes", "ReplayMode": "modes", "StreamingMode": "modes",
    "LoaderStateError": "state", "merge_states": "state",
}
__all__ = sorted(_NAMES)


def __getattr__(name):
    if name in _NAMES:
        import importlib

        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
