"""The lazy-name ``__getattr__`` of dynabatch's packages: `dynabatch.core.lazy.lazy_names`, kept there so
that the core (which may import nothing above it) uses the same one; and `moved_names`, the
``__getattr__`` of a package whose former top-level names now live in their modules only."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping

from .core.lazy import lazy_names  # noqa: F401


def moved_names(package: str, moved: Mapping[str, str],
                fallback: Callable[[str], object] | None = None) -> Callable[[str], object]:
    """A module ``__getattr__`` for names that left ``package``'s top level (name -> the module, absolute,
    that holds it now): the name still resolves for one release, with a DeprecationWarning saying where
    to import it from; any other name goes to ``fallback`` (or raises AttributeError as a module does)."""

    def __getattr__(name: str):
        if name in moved:
            warnings.warn(f"{package}.{name} is no longer a top-level name: import it from {moved[name]} "
                          f"({package} keeps the entry points)", DeprecationWarning, stacklevel=2)
            return getattr(importlib.import_module(moved[name]), name)
        if fallback is not None:
            return fallback(name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
