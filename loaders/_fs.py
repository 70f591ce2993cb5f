"""Where shard files live: local paths, or URLs (``s3://``, ``gs://``, ``hf://``, ``https://``,
``memory://`` ...) read through `fsspec` with the source's ``storage_options``.

fsspec (and its backend: s3fs, gcsfs, ...) is imported only when a URL is opened. Without
``cache_dir`` nothing is written locally: line streams and compressed files are read front to
back, Parquet footers, row groups, Arrow record batches and tar members with range requests.
With ``cache_dir``, fsspec's ``filecache`` keeps a whole local copy of each remote file (made on
first open, made again when the remote file changes), and the local code paths read that copy.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import os
import re

from ._errors import MissingDependencyError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# The pip package of each common fsspec backend that fsspec does not hold itself.
PACKAGES = {
    "s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
    "abfss": "adlfs", "adl": "adlfs", "hf": "huggingface_hub", "http": "fsspec[http]", "https": "fsspec[http]",
    "oci": "ocifs", "oss": "ossfs", "sftp": "paramiko", "ssh": "paramiko", "webdav": "webdav4",
    "smb": "smbprotocol", "lakefs": "lakefs-spec",
}
# fsspec ``info`` fields naming a file's version, best first: content tags (the same in a listing
# and a HEAD request), then modification times.
_VERSION_KEYS = ("ETag", "etag", "md5Hash", "crc32c", "blob_id", "sha256", "checksum",
                 "mtime", "LastModified", "last_modified", "updated", "created")
_BUFFER = 1 << 16
# Local content digests (`content_digest`): files up to _WHOLE bytes are hashed whole, larger ones
# by their size, first and last _EDGE bytes and _BLOCKS evenly spaced blocks of _BLOCK bytes between.
_WHOLE, _EDGE, _BLOCK, _BLOCKS = 1 << 20, 1 << 16, 1 << 12, 32


def is_url(path) -> bool:
    """True for a ``scheme://...`` string other than ``file://``."""
    m = _SCHEME.match(path) if isinstance(path, str) else None
    return bool(m) and m.group(1).lower() != "file"


def scheme_of(url: str) -> str:
    """``"s3"`` for ``"s3://bucket/key"``."""
    return _SCHEME.match(url).group(1).lower()


def local_form(path: str) -> str:
    """A local path with a leading ``file://`` removed."""
    return path[len("file://"):] if isinstance(path, str) and path.lower().startswith("file://") else path


def content_digest(path: str, size: int | None = None) -> str:
    """A local file's content tag, ``sha256:<24 hex digits>``: a hash of the whole file up to 1 MiB,
    else of its size, its first and last 64 KiB and 32 blocks of 4 KiB spread evenly between
    (about 0.4 MiB read per file). It changes when a file is rewritten with other content (another
    text of the same token counts) but not when a file is only copied, moved or touched, so every
    node holding a copy of the data sees the same tag. An edit of the same size that falls between
    the sampled blocks of a file over 1 MiB is not seen."""
    with open(local_form(path), "rb") as f:
        n = os.fstat(f.fileno()).st_size if size is None else size
        h = hashlib.sha256(str(n).encode() + b"\0")
        if n <= _WHOLE:
            h.update(f.read())
        else:
            step = (n - 2 * _EDGE - _BLOCK) // (_BLOCKS + 1)
            spans = [(0, _EDGE), *((_EDGE + (k + 1) * step, _BLOCK) for k in range(_BLOCKS)), (n - _EDGE, _EDGE)]
            for start, length in spans:
                f.seek(start)
                h.update(f.read(length))
    return "sha256:" + h.hexdigest()[:24]


def version_of(info: dict) -> str:
    """The version tag of a file from fsspec's ``info`` (ETag, checksum, else modification time), or ""."""
    for key in _VERSION_KEYS:
        value = info.get(key)
        if value in (None, ""):
            continue
        if isinstance(value, datetime.datetime):
            value = value.timestamp()
        return str(value).strip('"')
    return ""


class Storage:
    """How a source opens its files: local paths with ``open``, URLs through fsspec.

    ``storage_options``: keywords of the fsspec file system (e.g. ``{"anon": True}``, ``{"key": ...,
    "secret": ..., "client_kwargs": {"endpoint_url": ...}}`` for s3fs). ``cache_dir``: keep whole
    local copies of remote files there (fsspec ``filecache``); None reads them remotely each time.
    Picklable (DataLoader workers): file systems are made again in each process.
    """

    def __init__(self, storage_options: dict | None = None, cache_dir: str | os.PathLike | None = None):
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict, got {type(storage_options).__name__}")
        self.options = dict(storage_options or {})
        self.cache_dir = os.path.abspath(os.fspath(cache_dir)) if cache_dir is not None else None

    def __repr__(self) -> str:
        return f"Storage(options={sorted(self.options)}, cache_dir={self.cache_dir!r})"

    # -- file systems ---------------------------------------------------------------------
    def filesystem(self, url: str):
        """(fsspec file system, path within it) of ``url``; MissingDependencyError names the package."""
        try:
            import fsspec.core
        except ImportError:
            raise MissingDependencyError(f"reading {url} needs fsspec: pip install fsspec") from None
        scheme = scheme_of(url)
        try:
            return fsspec.core.url_to_fs(url, **self.options)
        except ImportError as e:
            package = PACKAGES.get(scheme)
            hint = f"pip install {package}" if package else f"install the fsspec backend for {scheme}://"
            raise MissingDependencyError(f"reading {url} needs the {scheme}:// file system of fsspec "
                                         f"({e}): {hint}") from None
        except ValueError as e:
            if "protocol" in str(e).lower():
                raise ValueError(f"cannot read {url}: fsspec knows no {scheme}:// file system ({e})") from None
            raise

    def _cache(self, fs):
        import fsspec

        return fsspec.filesystem("filecache", fs=fs, cache_storage=self.cache_dir, check_files=True)

    # -- files ----------------------------------------------------------------------------
    def local_path(self, path: str) -> str | None:
        """A local file holding ``path``: the path itself, the local copy of a URL when ``cache_dir``
        is set (downloaded now if needed), else None (read the URL with `open`)."""
        if not is_url(path):
            return local_form(path)
        if self.cache_dir is None:
            return None
        fs, p = self.filesystem(path)
        try:
            with self._cache(fs).open(p, "rb") as f:
                return f.name
        except FileNotFoundError:
            raise FileNotFoundError(f"no such file: {path!r}") from None

    def open(self, path: str, random: bool = False):
        """Open ``path`` for binary reading. ``random``: the caller jumps around (Parquet row groups,
        single lines), so remote reads fetch exactly what is asked instead of reading ahead."""
        local = self.local_path(path)
        if local is not None:
            return open(local, "rb")
        fs, p = self.filesystem(path)
        try:
            f = fs.open(p, "rb", cache_type="none") if random else fs.open(p, "rb")
        except FileNotFoundError:
            raise FileNotFoundError(f"no such file: {path!r}") from None
        # fsspec's readline reads a whole block per line: buffer in front of it.
        return f if random else io.BufferedReader(f, buffer_size=_BUFFER)

    def stat(self, path: str) -> tuple[int, str]:
        """(size in bytes, version tag) of a file: `version_of` a remote file (ETag, checksum or
        modification time), `content_digest` of a local one."""
        if not is_url(path):
            size = os.path.getsize(local_form(path))
            return size, content_digest(path, size)
        fs, p = self.filesystem(path)
        try:
            info = fs.info(p)
        except FileNotFoundError:
            raise FileNotFoundError(f"no such file: {path!r}") from None
        return int(info.get("size") or 0), version_of(info)

    def exists(self, url: str) -> bool:
        """Whether ``url`` names an existing file or folder."""
        fs, p = self.filesystem(url)
        return fs.exists(p)

    def expand_url(self, url: str, suffixes: tuple[str, ...]) -> tuple[list[str], list[str], list[str]]:
        """Files named by a URL (a file, a glob, or a folder: its files ending in ``suffixes``):
        (files, other files of the folder, its subfolders), as full URLs. Listings are fetched anew."""
        fs, path = self.filesystem(url)
        fs.invalidate_cache()  # a source sees the files as they are now, not an earlier listing
        magic = "*[" if scheme_of(url) in ("http", "https") else "*?["  # "?" starts an HTTP query
        if any(ch in path for ch in magic):
            matches = fs.glob(path, detail=True)
            if not matches:
                raise FileNotFoundError(f"no files match {url!r}")
            return [fs.unstrip_protocol(p) for p, i in matches.items() if i.get("type") == "file"], [], []
        try:
            info = fs.info(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"no such file: {url!r}") from None
        if info.get("type") != "directory":
            return [fs.unstrip_protocol(path)], [], []
        files, others, dirs = [], [], []
        for entry in fs.ls(path, detail=True):
            name = entry["name"].rstrip("/")
            if name.rsplit("/", 1)[-1].startswith("."):
                continue
            full = fs.unstrip_protocol(name)
            if entry.get("type") == "directory":
                dirs.append(full)
            elif not suffixes or name.lower().endswith(suffixes):
                files.append(full)
            else:
                others.append(full)
        return files, sorted(others), sorted(dirs)


LOCAL = Storage()
