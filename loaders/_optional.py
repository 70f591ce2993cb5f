"""Optional third-party modules, imported where a feature uses them (so that ``import loaders`` and
``import dynabatch`` work without them, e.g. on an image that lacks ``datasets``/``webdataset``)."""

from __future__ import annotations

import importlib

from ._errors import MissingDependencyError

#: the pip requirement that provides each optional top-level module (as pinned in pyproject.toml)
REQUIREMENTS = {"datasets": "datasets>=2.16", "webdataset": "webdataset>=0.2.86"}


def optional_module(name: str, purpose: str):
    """Import module ``name`` (dotted, e.g. ``webdataset.tariterators``) for ``purpose`` (what the user
    asked for, e.g. "reading webdataset tar shards"); `MissingDependencyError` (an ImportError) naming
    the purpose and the pip command when it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        top = name.split(".")[0]
        req = REQUIREMENTS.get(top, top)
        raise MissingDependencyError(
            f"{purpose} needs the {top!r} package, which cannot be imported ({e}); install it with "
            f"pip install '{req}' (a dependency of dynabatch that an install with --no-deps leaves out)") from None
