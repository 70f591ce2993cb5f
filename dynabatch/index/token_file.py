"""The token cache on disk: every sample's token ids in one file, written once by the scan (batch
by batch, nothing held in memory) and read back with pread (`dynabatch.index.tokens`), so the cache
does not grow with the dataset in RAM (the page cache holds what the steps touch).

Layout (little-endian; offsets in int32 values from the start of each region)::

    input ids   int32[input_values]       region A, from byte 0
    second ids  int32[second_values]      region B: labels (decoder) or target ids
    padding to 8 bytes
    sample ids  int64[samples]            in the order written
    input offsets  int64[samples + 1]     sample k's input ids: A[off[k]:off[k+1]]
    second offsets int64[samples + 1]
    footer      JSON (see below)
    footer length uint64, magic b"DBTOKEN1"

The JSON footer records the format and version, the counts, the ``settings`` the ids were made
under (`dynabatch.index.index_settings`, which name the tokenizer and the source fingerprint), the
tokenizer's content hash (`tokenization.tokenizer_fingerprint`) and ``sha256``: the hash of every byte before
the footer. `read_token_file` refuses, naming the file, a file whose footer, hash, settings or
tokenizer differ from what the loader expects (`TokenFileError`).

Files of a process that was killed (SIGKILL, the OOM killer) cannot be deleted by it: a loader's
private token file (``tokens-PID-START-*.bin``, `private_token_path`) and a writer's unfinished one
(``.tokens-PID-START-*``) are named for the process that made them, its pid and start time, and the
next start removes those whose process is gone (`reclaim_token_files`). The private folder's size is
bounded (``$DYNABATCH_CACHE_MAX_BYTES``, default `DEFAULT_CACHE_MAX_BYTES`): a start that finds it
full, or a write that would pass the bound, raises `TokenCacheFull` naming the folder and what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import tempfile

import numpy as np

from ..process_identity import ended_owners, process_tag

MAGIC = b"DBTOKEN1"
FORMAT = "dynabatch.token_cache"
VERSION = 1
_TAIL = struct.Struct("<Q8s")
_CHUNK = 1 << 24  # bytes hashed per read when a file is checked
CACHE_MAX_ENV = "DYNABATCH_CACHE_MAX_BYTES"
DEFAULT_CACHE_MAX_BYTES = 100 << 30  # the private folder's bound: ids of ~13e9 decoder tokens (8 bytes each)
# a private file (the start time absent in names made before it was recorded) or a writer's unfinished one
_PRIVATE = re.compile(r"tokens-(\d+)-(?:(\d*)-)?[^-]*\.bin\Z")
_UNFINISHED = re.compile(r"\.tokens-(\d+)-(\d*)-")


class TokenFileError(ValueError):
    """A token-cache file that cannot be used (damaged, edited, or made for other data or another tokenizer)."""


class TokenCacheFull(RuntimeError):
    """The private token-cache folder holds (or a token file being written would make it hold)
    more than its bound, ``$DYNABATCH_CACHE_MAX_BYTES``."""


def reclaim_token_files(folder: str) -> list[str]:
    """Delete the private and unfinished token files in ``folder`` whose process (pid and start time
    in the name) is gone; the paths deleted."""
    gone = []
    for path in ended_owners(folder, (_PRIVATE, _UNFINISHED)):
        try:
            os.unlink(path)
        except OSError:  # removed by another process's start meanwhile
            continue
        gone.append(path)
    return gone


def cache_max_bytes() -> int:
    """The private token-cache folder's bound in bytes (``$DYNABATCH_CACHE_MAX_BYTES``, else the default)."""
    raw = os.environ.get(CACHE_MAX_ENV)
    if not raw:
        return DEFAULT_CACHE_MAX_BYTES
    try:
        return int(float(raw))
    except ValueError:
        raise ValueError(f"${CACHE_MAX_ENV}={raw!r} is not a number of bytes (e.g. 200e9)") from None


def _folder_bytes(folder: str) -> tuple[int, int]:
    """(bytes, number) of the files directly in ``folder``. Other processes share the folder: a file
    another loader removes between the listing and its ``stat`` (its own cache, or a dead one's
    reclaimed) no longer holds bytes and is not counted."""
    sizes = []
    for e in os.scandir(folder):
        try:
            if e.is_file(follow_symlinks=False):
                sizes.append(e.stat(follow_symlinks=False).st_size)
        except FileNotFoundError:
            continue
    return sum(sizes), len(sizes)


def _size(b: int) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{b} bytes"


def _full(folder: str, used: int, files: int, bound: int, writing: int = 0) -> TokenCacheFull:
    """The error of a full private folder (``writing``: bytes of the token file being written)."""
    held = f"{_size(used)} in {files} file{'s' if files != 1 else ''}"
    now = (f"would hold {_size(used + writing)} ({held}, {_size(writing)} of the token file being written so far)"
           if writing else f"holds {held}")
    return TokenCacheFull(
        f"token cache folder {folder} {now}, over its bound of {_size(bound)} (${CACHE_MAX_ENV}={bound}): "
        f"raise ${CACHE_MAX_ENV}, point $DYNABATCH_CACHE_DIR at a folder with room, or delete the files there "
        f"no running loader uses (tokens-PID-START-*.bin is in use while process PID runs; those of ended "
        f"processes are deleted at each start); DataSource(cache_tokens=False) or an index_cache= (its token "
        f"file lies beside it) keeps the loader out of this folder")


def private_token_path(folder: str) -> tuple[str, int]:
    """(a new path for this process's private token file in ``folder``, the bytes left under the
    folder's bound), after `reclaim_token_files`; `TokenCacheFull` when no byte is left."""
    reclaim_token_files(folder)
    bound = cache_max_bytes()
    used, files = _folder_bytes(folder)
    if used >= bound:
        raise _full(folder, used, files, bound)
    fd, path = tempfile.mkstemp(prefix=f"tokens-{process_tag()}-", suffix=".bin", dir=folder)
    os.close(fd)
    os.unlink(path)  # written (atomically) by a TokenFileWriter
    return path, bound - used


class TokenFileWriter:
    """Writes a token file batch by batch (`add`), then `finish` publishes it at ``path``
    atomically (a temporary file renamed): a killed scan leaves no half file (the next writer in
    that folder deletes its unfinished one). ``max_bytes``: `TokenCacheFull` once the file would
    pass that many bytes (the room `private_token_path` leaves; None: no bound)."""

    def __init__(self, path: str, max_bytes: int | None = None):
        self.path = str(path)
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        reclaim_token_files(folder)
        self._max, self._written = max_bytes, 0
        self._main = tempfile.NamedTemporaryFile(dir=folder, prefix=f".tokens-{process_tag()}-", delete=False)
        self._second = tempfile.TemporaryFile(dir=folder)
        self._hash = hashlib.sha256()
        self._ids: list[np.ndarray] = []
        self._in_len: list[np.ndarray] = []
        self._sec_len: list[np.ndarray] = []

    def add(self, sample_ids, input_ids, input_lengths, second_ids, second_lengths) -> None:
        """One batch: flat int32 ids and int64 lengths per sample (the `tokenization.scan_shapes` sink)."""
        a = np.ascontiguousarray(input_ids, np.int32).tobytes()
        b = np.ascontiguousarray(second_ids, np.int32).tobytes()
        self._written += len(a) + len(b) + 24 * len(input_lengths)  # ids, then 3 int64 index values per sample
        if self._max is not None and self._written > self._max:
            folder = os.path.dirname(os.path.abspath(self.path))
            self.discard()
            used, files = _folder_bytes(folder)
            raise _full(folder, used, files, cache_max_bytes(), self._written)
        self._hash.update(a)
        self._main.write(a)
        self._second.write(b)
        self._ids.append(np.asarray(sample_ids, np.int64))
        self._in_len.append(np.asarray(input_lengths, np.int64))
        self._sec_len.append(np.asarray(second_lengths, np.int64))

    def finish(self, meta: dict) -> str:
        """Append region B, the index arrays and the footer (``meta`` plus counts and hash); rename."""
        try:
            self._second.seek(0)
            while chunk := self._second.read(_CHUNK):
                self._hash.update(chunk)
                self._main.write(chunk)
            self._second.close()
            pad = (-self._main.tell()) % 8
            ids = np.concatenate(self._ids) if self._ids else np.zeros(0, np.int64)
            offs = [np.concatenate([[0], np.cumsum(np.concatenate(x) if x else np.zeros(0, np.int64))]).astype(np.int64)
                    for x in (self._in_len, self._sec_len)]
            for part in (b"\0" * pad, ids.tobytes(), offs[0].tobytes(), offs[1].tobytes()):
                self._hash.update(part)
                self._main.write(part)
            footer = dict(meta, format=FORMAT, version=VERSION, samples=len(ids), input_values=int(offs[0][-1]),
                          second_values=int(offs[1][-1]), sha256=self._hash.hexdigest())
            raw = json.dumps(footer, sort_keys=True).encode()
            self._main.write(raw + _TAIL.pack(len(raw), MAGIC))
            self._main.close()
            os.replace(self._main.name, self.path)
        except BaseException:
            self.discard()
            raise
        return self.path

    def discard(self) -> None:
        """Drop the unfinished file."""
        for f in (self._main, self._second):
            f.close()
        if os.path.exists(self._main.name):
            os.unlink(self._main.name)


def _footer(path: str) -> tuple[dict, int]:
    """(footer JSON, bytes before it) of a token file; TokenFileError naming it otherwise."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < _TAIL.size:
            raise TokenFileError(f"token cache {path}: {size} bytes, too short to be a token-cache file")
        f.seek(size - _TAIL.size)
        n, magic = _TAIL.unpack(f.read(_TAIL.size))
        if magic != MAGIC or n > size - _TAIL.size:
            raise TokenFileError(f"token cache {path}: not a dynabatch token-cache file (no footer); delete it")
        f.seek(size - _TAIL.size - n)
        try:
            meta = json.loads(f.read(n))
        except ValueError as e:
            raise TokenFileError(f"token cache {path}: damaged footer ({e}); delete it") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise TokenFileError(f"token cache {path}: format {meta.get('format')} v{meta.get('version')}, this "
                             f"dynabatch reads {FORMAT} v{VERSION}; delete it")
    return meta, size - _TAIL.size - n


def _check_hash(path: str, body: int, want: str) -> None:
    h = hashlib.sha256()
    with open(path, "rb") as f:  # read, not mapped: the check does not grow this process's memory
        left = body
        while left > 0:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    if h.hexdigest() != want:
        raise TokenFileError(f"token cache {path}: its content does not match its integrity record (sha256 "
                             f"{h.hexdigest()[:12]}..., recorded {want[:12]}...): the file was damaged or edited; "
                             "delete it and the loader rebuilds it")


def read_token_file(path: str, *, settings: dict, tokenizer: str):
    """(sample ids, input ids, input offsets, second ids, second offsets) of a token file, the ids
    memory-mapped, after checking its footer, its sha256 over every byte, and that it was made
    under ``settings`` with the tokenizer whose `tokenizer_fingerprint` is ``tokenizer``."""
    path = str(path)
    meta, body = _footer(path)
    if meta.get("tokenizer") != tokenizer:
        raise TokenFileError(f"token cache {path} was made with another tokenizer (content hash "
                             f"{str(meta.get('tokenizer'))[:12]}..., this loader's {tokenizer[:12]}...): delete it")
    diff = sorted(k for k in set(settings) | set(meta.get("settings", {}))
                  if settings.get(k) != meta.get("settings", {}).get(k))
    if diff:
        k = diff[0]
        raise TokenFileError(f"token cache {path} was made with {k}={meta['settings'].get(k)!r}, this loader has "
                             f"{k}={settings.get(k)!r} (the data or the tokenization changed): delete it")
    n, a, b = int(meta["samples"]), int(meta["input_values"]), int(meta["second_values"])
    start = 4 * (a + b) + (-(4 * (a + b)) % 8)
    if start + 8 * (3 * n + 2) != body:
        raise TokenFileError(f"token cache {path}: {body} bytes before the footer, its counts need "
                             f"{start + 8 * (3 * n + 2)}: the file was damaged or edited; delete it")
    _check_hash(path, body, meta["sha256"])
    values = np.memmap(path, np.int32, mode="r", shape=(a + b,)) if a + b else np.zeros(0, np.int32)
    arrays = np.fromfile(path, np.int64, count=3 * n + 2, offset=start)
    ids, in_off, sec_off = arrays[:n], arrays[n:2 * n + 1], arrays[2 * n + 1:]
    return ids, values[:a], in_off, values[a:], sec_off
