"""File lists (globs, ``{000..009}`` brace ranges, folders) and compressed streams."""

from __future__ import annotations

import bz2
import glob
import gzip
import io
import logging
import os
import zlib
from collections.abc import Iterable
from pathlib import Path

from braceexpand import braceexpand

from ._errors import CorruptFileError, MissingDependencyError, TruncatedFileError
from ._fs import LOCAL, Storage, is_url, local_form

logger = logging.getLogger("loaders")

COMPRESSED_SUFFIXES = (".gz", ".zst", ".zstd", ".bz2")


def expand_paths(spec: str | os.PathLike | Iterable, suffixes: tuple[str, ...] = (),
                 storage: Storage | None = None) -> list[str]:
    """Expand a path, glob, brace pattern, folder, or list of them into a sorted list of files.

    URLs (``s3://bucket/train-*.jsonl.gz``) are listed through fsspec with ``storage`` (`Storage`)
    and stay URLs; local paths become absolute.

    Sorting makes the shard index (and so every ``sample_id``) independent of the order
    the user listed the files in or the order the file system returns them.
    A folder contributes the files in it whose name ends with one of ``suffixes`` (in any case:
    ``b.JSONL`` counts). Subfolders are not read and other files are not used: both are reported
    in one WARNING on logger ``"loaders"`` with their count and an example (hidden files, whose
    names start with ``.``, are left out silently). Use a glob (``folder/**/*.jsonl``) to read
    subfolders.
    """
    items = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    found: set[str] = set()
    low_suffixes = tuple(x.lower() for x in suffixes)
    for item in items:
        for pattern in braceexpand(os.fspath(item)):
            if is_url(pattern):
                files, skipped_files, skipped_dirs = (storage or LOCAL).expand_url(pattern, low_suffixes)
                found.update(files)
                _report_skipped(pattern, skipped_files, skipped_dirs, low_suffixes)
                continue
            pattern = local_form(pattern)
            if any(ch in pattern for ch in "*?["):
                matches = glob.glob(pattern, recursive=True)
                if not matches:
                    raise FileNotFoundError(f"no files match {pattern!r}")
                found.update(m for m in matches if os.path.isfile(m))
            elif os.path.isdir(pattern):
                skipped_files, skipped_dirs = [], []
                for p in Path(pattern).iterdir():
                    if p.name.startswith("."):
                        continue
                    if p.is_dir():
                        skipped_dirs.append(str(p))
                    elif not low_suffixes or p.name.lower().endswith(low_suffixes):
                        found.add(str(p))
                    else:
                        skipped_files.append(str(p))
                _report_skipped(pattern, sorted(skipped_files), sorted(skipped_dirs), low_suffixes)
            elif os.path.isfile(pattern):
                found.add(pattern)
            else:
                raise FileNotFoundError(f"no such file: {pattern!r}")
    if not found:
        raise FileNotFoundError(f"no input files in {spec!r}")
    return sorted(p if is_url(p) else os.path.abspath(p) for p in found)


def _report_skipped(folder: str, files: list[str], dirs: list[str], suffixes: tuple[str, ...]) -> None:
    """One WARNING for a folder's files of other types and its subfolders (see `expand_paths`)."""
    parts = []
    if files:
        known = sorted(set(suffixes))
        shown = ", ".join(known[:8]) + (", ..." if len(known) > 8 else "")
        parts.append(f"{len(files)} file(s) of other types not read (e.g. {files[0]}; read here: {shown})")
    if dirs:
        parts.append(f"{len(dirs)} subfolder(s) not read (e.g. {dirs[0]}; pass a glob such as "
                     f"'{folder.rstrip('/')}/**/*{suffixes[0] if suffixes else ''}' to read them)")
    if parts:
        logger.warning("folder %s: %s", folder, "; ".join(parts))


def _lower(path: str) -> str:
    return os.fspath(path).lower()


def is_compressed(path: str) -> bool:
    """True for ``.gz``/``.zst``/``.bz2`` files, which can only be read from the start."""
    return _lower(path).endswith(COMPRESSED_SUFFIXES)


def compression_of(path: str) -> str | None:
    """``"gz"``, ``"zst"``, ``"bz2"`` or None (plain), from the file name (any case)."""
    low = _lower(path)
    if low.endswith((".gz", ".tgz")):
        return "gz"
    if low.endswith((".zst", ".zstd")):
        return "zst"
    if low.endswith(".bz2"):
        return "bz2"
    return None


class DamagedStream(Exception):
    """A compressed stream that fails its integrity check (``kind="corrupt"``) or ends early
    (``kind="truncated"``), raised by `CheckedReader`.

    ``raw_offset``: compressed byte where the damage was found; ``data_offset``: decompressed
    bytes delivered when it was found; ``verified_end``: decompressed bytes in the members/frames
    that passed their check (everything before it is known good); ``unit``: "gzip member 2" etc.
    """

    def __init__(self, kind: str, message: str, *, path: str, raw_offset: int, data_offset: int,
                 verified_end: int, unit: str):
        self.kind, self.message, self.path = kind, message, path
        self.raw_offset, self.data_offset, self.verified_end, self.unit = raw_offset, data_offset, verified_end, unit
        super().__init__(f"{os.path.basename(path)}: {message}")


_RAW_CHUNK = 1 << 16
_MAX_OUT = 1 << 20


class CheckedReader(io.RawIOBase):
    """Decompresses ``.gz`` (member by member), ``.zst`` (frame by frame) or ``.bz2`` (stream by
    stream) and checks each unit's integrity: gzip CRC-32 and ISIZE, zstd frame completeness and
    content checksums (when the frame has one), bz2 block and stream CRCs.

    Damage raises `DamagedStream` naming the unit and the compressed byte offset. ``verified_end``
    (decompressed bytes of the units that passed their check) lets callers keep only verified data:
    the readers index a file once with this class and later read at most ``limit`` decompressed bytes,
    so a record from a member or frame that failed its check is never delivered. Memory stays bounded
    (64 KiB of input and at most about 1 MiB of gzip/bz2 output per step).
    """

    def __init__(self, path: str, fmt: str, limit: int | None = None, storage: Storage | None = None):
        super().__init__()
        self.path, self.fmt, self.limit = path, fmt, limit
        self._f = (storage or LOCAL).open(path)
        self.size = file_size(self._f)
        self.raw_read = 0          # compressed bytes read from the file
        self.data_offset = 0       # decompressed bytes produced
        self.verified_end = 0      # decompressed bytes in verified units
        self.units = 0             # units started
        self._unit_raw_start = 0
        self._in = b""             # compressed bytes not yet given to the decoder
        self._out = b""            # decompressed bytes; those from _pos on are not returned yet
        self._pos = 0
        self._dec = None           # decoder of the current unit (None: between units)
        self._fed = 0              # bytes given to the current unit's decoder
        self._eof = False

    # -- io.RawIOBase -----------------------------------------------------------------------
    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._pos >= len(self._out) and not self._eof:
            self._step()
        n = min(len(b), len(self._out) - self._pos)
        b[:n] = memoryview(self._out)[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()

    def chunks(self):
        """Yield decompressed chunks (a chunk never spans two units) until the end or the limit."""
        while not self._eof:
            self._step()
            if self._pos < len(self._out):
                out, self._out, self._pos = self._out[self._pos:], b"", 0
                yield out

    # -- decoding ---------------------------------------------------------------------------
    def _raw_pos(self) -> int:
        """Compressed offset of the next byte the decoder has not consumed (approximate inside a unit)."""
        return self.raw_read - len(self._in)

    def _fail(self, kind: str, message: str):
        unit = f"{self._unit_name()} {self.units}"
        raise DamagedStream(kind, message, path=self.path, raw_offset=self._raw_pos(), data_offset=self.data_offset,
                            verified_end=self.verified_end, unit=unit)

    def _unit_name(self) -> str:
        return {"gz": "gzip member", "zst": "zstd frame", "bz2": "bz2 stream"}[self.fmt]

    def _new_decoder(self):
        if self.fmt == "gz":
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        if self.fmt == "bz2":
            return bz2.BZ2Decompressor()
        return _zstd_module(self.path).ZstdDecompressor().decompressobj()

    def _emit(self, data: bytes) -> None:
        if self.limit is not None and self.data_offset + len(data) >= self.limit:
            data = data[: max(0, self.limit - self.data_offset)]
            self._eof = True
        self.data_offset += len(data)
        if self._pos >= len(self._out):
            self._out, self._pos = data, 0
        else:
            self._out, self._pos = self._out[self._pos:] + data, 0

    def _fill(self) -> bool:
        chunk = self._f.read(_RAW_CHUNK)
        self.raw_read += len(chunk)
        self._in += chunk
        return bool(chunk)

    def _step(self) -> None:
        if self.limit is not None and self.data_offset >= self.limit:
            self._eof = True
            return
        if self._dec is None:  # between units: start the next one, or end cleanly
            if not self._in and not self._fill():
                self._eof = True
                return
            if self.fmt == "gz":
                self._in = self._in.lstrip(b"\0")  # zero padding between/after members (as gzip.GzipFile)
                if not self._in:
                    return
            self._dec = self._new_decoder()
            self._fed = 0
            self.units += 1
            self._unit_raw_start = self._raw_pos()
        pending = self.fmt == "bz2" and not self._dec.needs_input  # bz2 holds input it has not decoded yet
        if not self._in and not pending and not self._fill():
            self._fail("truncated", f"the file ends (at byte {self.size}) inside {self._unit_name()} {self.units}, "
                                    f"which starts at byte {self._unit_raw_start}")
        data, self._in = self._in, b""
        self._fed += len(data)
        try:
            if self.fmt == "zst":
                out = self._dec.decompress(data)
                rest = self._dec.unused_data if self._dec.eof else b""
            elif self.fmt == "gz":
                out = self._dec.decompress(data, _MAX_OUT)
                rest = self._dec.unused_data if self._dec.eof else self._dec.unconsumed_tail
            else:
                out = self._dec.decompress(data, _MAX_OUT)
                rest = self._dec.unused_data if self._dec.eof else b""
        except (zlib.error, OSError, EOFError, ValueError, _zstd_error()) as e:
            self._in = data  # the damage lies within this chunk: name its start
            self._fail("corrupt", f"{self._unit_name()} {self.units} (starting at byte {self._unit_raw_start}) fails "
                                  f"its integrity check within bytes {self._raw_pos()}-{self.raw_read} ({_reason(e)})")
        self._fed -= len(rest)
        self._in = rest
        self._emit(out)
        if self._dec.eof:
            self.verified_end = self.data_offset
            self._dec = None


def _reason(e: BaseException) -> str:
    msg = str(e)
    low = msg.lower()
    if "incorrect data check" in low or "checksum" in low:
        return f"checksum mismatch: {msg}"
    if "incorrect length check" in low:
        return f"length mismatch: {msg}"
    return msg or type(e).__name__


def _zstd_module(path: str):
    try:
        import zstandard
    except ImportError:
        raise MissingDependencyError(
            f"{path} is zstd-compressed; reading it needs the zstandard module: pip install zstandard"
        ) from None
    return zstandard


def _zstd_error() -> type[BaseException]:
    try:
        import zstandard

        return zstandard.ZstdError
    except ImportError:  # pragma: no cover
        return zlib.error


def file_size(f) -> int:
    """Size in bytes of an open local or fsspec file."""
    try:
        return os.fstat(f.fileno()).st_size
    except (OSError, AttributeError, io.UnsupportedOperation):
        pass
    size = getattr(getattr(f, "raw", f), "size", None)
    if isinstance(size, int):
        return size
    here = f.tell()
    size = f.seek(0, io.SEEK_END)
    f.seek(here)
    return size


def open_binary(path: str, limit: int | None = None, storage: Storage | None = None):
    """Open ``path`` (a local path or URL, see `Storage`) for binary reading, decompressing ``.gz``,
    ``.zst`` and ``.bz2`` with their integrity checks (`CheckedReader`). ``limit``: read at most
    that many decompressed bytes (the verified part found when the file was indexed)."""
    fmt = compression_of(path)
    if fmt is None:
        return (storage or LOCAL).open(path)
    if fmt == "zst":
        _zstd_module(path)
    return io.BufferedReader(CheckedReader(path, fmt, limit, storage), buffer_size=_RAW_CHUNK)


def stream_error(path: str, exc: BaseException, where: str):
    """Translate a decompression exception into a ``LoaderError`` naming file and position."""
    name = os.path.basename(path)
    if isinstance(exc, DamagedStream):
        if exc.kind == "truncated":
            return TruncatedFileError(f"compressed stream of {name} ends early ({exc.message}); "
                                      f"the data ends at decompressed byte {exc.data_offset}", where=where)
        return CorruptFileError(f"compressed stream of {name} is damaged: {exc.message}; nothing from "
                                f"decompressed byte {exc.verified_end} on is used", where=where)
    if isinstance(exc, EOFError):
        return TruncatedFileError(f"compressed stream of {name} ends early ({exc})", where=where)
    return CorruptFileError(f"cannot decompress {name}: {exc}", where=where)


def decompression_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean a damaged compressed stream."""
    errs: list[type[BaseException]] = [DamagedStream, EOFError, zlib.error, gzip.BadGzipFile]
    try:
        import zstandard

        errs.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errs)
