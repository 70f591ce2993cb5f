"""File lists (globs, ``{000..009}`` brace ranges, folders) and compressed streams."""

from __future__ import annotations

import glob
import gzip
import io
import os
import zlib
from collections.abc import Iterable
from pathlib import Path

from braceexpand import braceexpand

from ._errors import CorruptFileError, MissingDependencyError, TruncatedFileError

COMPRESSED_SUFFIXES = (".gz", ".zst", ".zstd")


def expand_paths(spec: str | os.PathLike | Iterable, suffixes: tuple[str, ...] = ()) -> list[str]:
    """Expand a path, glob, brace pattern, folder, or list of them into a sorted list of files.

    Sorting makes the shard index (and so every ``sample_id``) independent of the order
    the user listed the files in or the order the file system returns them.
    A folder contributes the files in it whose name ends with one of ``suffixes``.
    """
    items = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    found: set[str] = set()
    for item in items:
        for pattern in braceexpand(os.fspath(item)):
            if any(ch in pattern for ch in "*?["):
                matches = glob.glob(pattern, recursive=True)
                if not matches:
                    raise FileNotFoundError(f"no files match {pattern!r}")
                found.update(m for m in matches if os.path.isfile(m))
            elif os.path.isdir(pattern):
                found.update(
                    str(p) for p in Path(pattern).iterdir()
                    if p.is_file() and (not suffixes or p.name.endswith(suffixes))
                )
            elif os.path.isfile(pattern):
                found.add(pattern)
            else:
                raise FileNotFoundError(f"no such file: {pattern!r}")
    if not found:
        raise FileNotFoundError(f"no input files in {spec!r}")
    return sorted(os.path.abspath(p) for p in found)


def is_compressed(path: str) -> bool:
    """True for ``.gz``/``.zst`` files, which can only be read from the start."""
    return path.endswith(COMPRESSED_SUFFIXES)


def open_binary(path: str):
    """Open ``path`` for binary reading, decompressing ``.gz`` and ``.zst`` transparently."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith((".zst", ".zstd")):
        try:
            import zstandard
        except ImportError:
            raise MissingDependencyError(
                f"{path} is zstd-compressed; reading it needs the zstandard module: "
                "pip install zstandard"
            ) from None
        raw = open(path, "rb")
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)
        return io.BufferedReader(reader)
    return open(path, "rb")


def stream_error(path: str, exc: BaseException, where: str):
    """Translate a decompression exception into a ``LoaderError`` naming file and position."""
    name = os.path.basename(path)
    if isinstance(exc, EOFError):
        return TruncatedFileError(f"compressed stream of {name} ends early ({exc})", where=where)
    return CorruptFileError(f"cannot decompress {name}: {exc}", where=where)


def decompression_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean a damaged compressed stream."""
    errs: list[type[BaseException]] = [EOFError, zlib.error, gzip.BadGzipFile]
    try:
        import zstandard

        errs.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errs)
