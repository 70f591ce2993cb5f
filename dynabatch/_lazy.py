"""The lazy-name ``__getattr__`` of dynabatch's packages: `dynabatch.core.lazy.lazy_names`, kept there so
that the core (which may import nothing above it) uses the same one."""

from .core.lazy import lazy_names  # noqa: F401
