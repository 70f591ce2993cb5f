"""Packages whose public names load on first use (so ``import dynabatch`` stays light and numba, torch or
``transformers`` are imported only by what needs them). In the core, which imports nothing above it, so
that `dynabatch.core.cost` uses it too (`dynabatch._lazy` re-exports it for the other packages)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_names(package: str, where: Mapping[str, str]) -> Callable[[str], object]:
    """The module-level ``__getattr__`` of ``package``: a name of ``where`` (public name -> submodule,
    relative to ``package``) is imported from its submodule when first asked for; any other name
    raises AttributeError as a module does."""

    def __getattr__(name: str):
        if name in where:
            return getattr(importlib.import_module(f".{where[name]}", package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
