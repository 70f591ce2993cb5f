"""Error types for bad input, and the raise-or-skip policy that counts them."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

logger = logging.getLogger("loaders")


class LoaderError(ValueError):
    """Base class of all bad-input errors; ``kind`` is the key used in ``error_counts``.

    ``where`` names the file and position (``"a.jsonl:12"``, ``"a.parquet:40"``) or the
    sample key; ``field`` the offending field when there is one. ``repeat`` is True on an error
    that another work unit reports too (it raises, but a skip does not count it twice).
    """

    repeat = False

    kind = "error"

    def __init_subclass__(cls, *, kind: str | None = None) -> None:
        """A subclass declares its ``kind`` in its header (``class X(LoaderError, kind="x")``)."""
        super().__init_subclass__()
        if kind is not None:
            cls.kind = kind

    def __init__(self, message: str, *, where: str = "", field: str | None = None):
        self.where = where
        self.field = field
        self.detail = message
        prefix = f"{where}: " if where else ""
        super().__init__(f"{prefix}{message}")


class InvalidJSONError(LoaderError, kind="invalid_json"):
    """A JSONL line (or JSON member) that does not parse, or is not a JSON object."""


class SchemaError(LoaderError):
    """Base for field problems found while mapping a record to a sample."""


class MissingFieldError(SchemaError, kind="missing_field"):
    """A field the schema needs is absent."""


class BadFieldError(SchemaError, kind="bad_field"):
    """A field has the wrong type or an inconsistent value."""


class EmptyTextError(SchemaError, kind="empty_text"):
    """A sample whose required text is empty or whitespace only."""


class TruncatedFileError(LoaderError, kind="truncated"):
    """A gzip/zstd stream or tar archive that ends early."""


class CorruptFileError(LoaderError, kind="corrupt_file"):
    """A file the reader cannot parse at all (bad Parquet footer, bad gzip header, ...)."""


class ImageError(LoaderError):
    """Base for image references that cannot be used."""


class MissingImageError(ImageError, kind="missing_image"):
    """An image path that does not exist."""


class BadImageError(ImageError, kind="bad_image"):
    """Image bytes or file that PIL cannot open (header check only, no decode)."""


class StateError(ValueError):
    """A state dict that does not belong to this source, seed, epoch or world layout."""


class MissingDependencyError(ImportError):
    """An optional module needed for this input is not installed."""


@dataclass
class ErrorPolicy:
    """Raise on bad input (``on_error="raise"``) or skip it and count it by kind (``"skip"``)."""

    on_error: str = "raise"
    counts: Counter = field(default_factory=Counter)

    def __post_init__(self):
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")

    def handle(self, err: LoaderError) -> None:
        """Raise ``err``, or count it when skipping."""
        if self.on_error == "raise":
            raise err
        if getattr(err, "repeat", False):
            # The same damage as an error another work unit counts (e.g. a Parquet row group split
            # over several units): skipped, not counted again.
            logger.debug("skipped, counted elsewhere (%s): %s", err.kind, err)
            return
        self.counts[err.kind] += 1
        logger.debug("skipped bad input (%s): %s", err.kind, err)
