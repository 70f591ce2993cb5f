"""Weights are verified where they are read: a damaged safetensors file is an error naming the file and
what is wrong with it, a non-finite tensor is an error naming the tensor and its file, and a folder that
carries a checksum manifest (written by the library's own saves: `save_stage`, `merge_stages`, so
``HFStage.save``) has its files checked against it.

* `check_header(path)`: the safetensors layout, from the first bytes alone (a truncated copy, a garbled
  header, tensors whose data run past the end or leave gaps); safetensors' own messages ("incomplete
  metadata, file not fully covered", "header too large") name no file.
* `check_finite(t, name, where)`: no NaN or infinity in a floating tensor (`all_finite`: one sum, exact).
* The manifest, ``dynabatch-checksums.json`` (and ``dynabatch-checksums.stage-SSSSS-of-NNNNN.json``, one per
  stage part, so ranks saving into one folder never write the same file): per file its bytes, mtime (ns)
  and sha256. `write_manifest` records files; `FolderCheck` verifies each file once, when a reader first
  opens it.

Cost policy (``verify``): hashing is as slow as reading (sha256 ~1.1 GB/s on this project's CPUs, against a
stage load of about the same speed), so by default (``"auto"``) a file is hashed only when its mtime
differs from the manifest's (a copy, an edit in place); its size is always compared, its header always
parsed, every tensor read checked finite. ``"hash"`` hashes every file opened (bit rot keeps the mtime);
``"none"`` checks nothing. The default comes from ``$DYNABATCH_VERIFY_WEIGHTS``, else ``"auto"``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path

import torch

MANIFEST = "dynabatch-checksums.json"
MANIFEST_GLOB = "dynabatch-checksums*.json"
VERIFY_ENV = "DYNABATCH_VERIFY_WEIGHTS"
MODES = ("auto", "hash", "none")
_HEADER_LIMIT = 100_000_000  # safetensors' own cap on the JSON header, bytes
_CHUNK = 1 << 24  # bytes hashed per read
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


class DamagedWeights(ValueError):
    """A weights file is damaged, does not match its checksum manifest, or holds a non-finite tensor."""


def verify_mode(verify: str | None = None) -> str:
    """``verify``, else ``$DYNABATCH_VERIFY_WEIGHTS``, else ``"auto"`` (one of `MODES`)."""
    mode = verify if verify is not None else (os.environ.get(VERIFY_ENV) or "auto")
    if mode not in MODES:
        where = "verify" if verify is not None else f"${VERIFY_ENV}"
        raise ValueError(f"{where} must be one of {MODES}, got {mode!r}")
    return mode


def _damaged(path: Path, what: str) -> DamagedWeights:
    return DamagedWeights(f"{path}: {what}: the file is damaged (an interrupted copy or download, or a disk "
                          f"error); copy or download it again")


def check_header(path: str | Path) -> dict:
    """Parse ``path``'s safetensors header and check that the tensors it lists exactly fill the file;
    returns the header (tensor name -> dtype, shape, data_offsets). Raises `DamagedWeights` naming the file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _damaged(path, f"it has {size} bytes, fewer than the 8 of a safetensors header length")
        (n,) = struct.unpack("<Q", head)
        if n > _HEADER_LIMIT:
            raise _damaged(path, f"its first 8 bytes give a header of {n} bytes, over safetensors' limit of "
                                 f"{_HEADER_LIMIT} (the length is garbled, or it is not a safetensors file)")
        if 8 + n > size:
            raise _damaged(path, f"its header should take {n} bytes but the file has only {size - 8} after the "
                                 f"header length (truncated)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError(f"a JSON {type(header).__name__}, not an object")
    except ValueError as e:
        raise _damaged(path, f"its {n}-byte header is not valid JSON ({e})") from None
    data = size - 8 - n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            need = math.prod(int(d) for d in info["shape"]) * _ITEM_BYTES.get(info["dtype"], 0)
        except (KeyError, TypeError, ValueError):
            raise _damaged(path, f"the header entry of tensor {name!r} is garbled: {str(info)[:120]}") from None
        if end - begin != need or info["dtype"] not in _ITEM_BYTES:
            raise _damaged(path, f"tensor {name!r} ({info['dtype']} {info['shape']}) needs {need} bytes but the header "
                                 f"gives it bytes {begin}..{end}")
        if end > data:
            raise _damaged(path, f"tensor {name!r} ends at data byte {end} but the file holds {data} data bytes "
                                 f"(truncated)")
        spans.append((begin, end, name))
    covered = 0
    for begin, end, name in sorted(spans):
        if begin != covered:
            raise _damaged(path, f"tensor {name!r} starts at data byte {begin}, the tensors before it end at "
                                 f"{covered} (a gap or an overlap)")
        covered = end
    if covered != data:
        raise _damaged(path, f"its tensors fill {covered} of its {data} data bytes (bytes appended, or the header "
                             f"is wrong)")
    return header


def read_index(path: str | Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of the shard index ``path``; `DamagedWeights`
    naming it when it is not such JSON."""
    path = Path(path)
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is a {type(weight_map).__name__}")
        return weight_map
    except (ValueError, KeyError, TypeError) as e:
        raise _damaged(path, f"it is not a shard index ({type(e).__name__}: {e})") from None


def open_checked(path: str | Path):
    """``safetensors.safe_open(path)``, a failure of it `DamagedWeights` naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as e:
        raise _damaged(Path(path), f"safetensors cannot open it ({e})") from None


def read_tensor(handle, name: str, path) -> torch.Tensor:
    """Tensor ``name`` of the open file ``handle`` (``path``), a failure `DamagedWeights` naming both."""
    from safetensors import SafetensorError

    try:
        return handle.get_tensor(name)
    except SafetensorError as e:
        raise _damaged(Path(path), f"tensor {name} cannot be read ({e})") from None


def all_finite(t: torch.Tensor) -> bool:
    """Whether floating tensor ``t`` holds no NaN or infinity (non-floating tensors: True). One sum in ``t``'s
    own dtype (0.11 s/GB on CPU, memory-bound; a float64 sum takes 0.9): any NaN or infinity makes it
    non-finite; only a sum that overflowed with finite values (huge weights, float16) needs the exact
    element-wise check."""
    if not t.is_floating_point() or not t.numel() or bool(torch.isfinite(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def check_finite(t: torch.Tensor, name: str, where: str) -> torch.Tensor:
    """``t`` itself; `DamagedWeights` naming tensor ``name`` and ``where`` (its file) when it holds a NaN or
    an infinity (non-floating tensors pass)."""
    if not all_finite(t):
        bad = int((~torch.isfinite(t)).sum())
        raise DamagedWeights(f"tensor {name} in {where} holds {bad} non-finite value(s) (NaN or infinity) of "
                             f"{t.numel()}: the weights are damaged or diverged; load a checkpoint from before")
    return t


def sha256_file(path: str | Path) -> str:
    """The hex sha256 of ``path``'s bytes (read in 16 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: str | Path, files, name: str = MANIFEST) -> Path:
    """Record ``files`` (paths in ``folder``) in ``folder/name``: each file's bytes, mtime (ns) and sha256.
    Written to a temporary name, then renamed; returns the manifest."""
    folder = Path(folder)
    entries = {}
    for f in sorted(Path(x) for x in files):
        st = f.stat()
        entries[f.name] = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(f)}
    out = folder / name
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"format": 1, "algorithm": "sha256", "files": entries}, indent=1))
    os.replace(tmp, out)
    return out


def read_manifests(folder: str | Path) -> dict[str, dict]:
    """File name -> its record, over every manifest in ``folder`` (none: empty). A manifest that cannot be
    read is `DamagedWeights` naming it."""
    out: dict[str, dict] = {}
    for m in sorted(Path(folder).glob(MANIFEST_GLOB)):
        try:
            out.update(json.loads(m.read_text())["files"])
        except (ValueError, KeyError, TypeError) as e:
            raise _damaged(m, f"the checksum manifest cannot be read ({type(e).__name__}: {e})") from None
    return out


class FolderCheck:
    """Verifies the files of one folder as they are first opened (`opened`), under ``mode`` (module doc)."""

    def __init__(self, folder: str | Path, mode: str | None = None):
        self.folder = Path(folder)
        self.mode = verify_mode(mode)
        self.records = read_manifests(self.folder) if self.mode != "none" else {}
        self.done: set[str] = set()
        self.hashed: list[str] = []  # files whose sha256 was computed (the expensive part)

    def opened(self, path: str | Path) -> None:
        """Check ``path`` (once): its header, and against the manifest when it lists the file."""
        path = Path(path)
        if self.mode == "none" or str(path) in self.done:
            return
        check_header(path)
        rec = self.records.get(path.name)
        if rec is not None:
            st = path.stat()
            if st.st_size != int(rec["bytes"]):
                raise DamagedWeights(f"{path}: {st.st_size} bytes, but {MANIFEST} in {self.folder} records "
                                     f"{rec['bytes']}: the file is not the one saved; copy it again")
            if self.mode == "hash" or st.st_mtime_ns != int(rec["mtime_ns"]):
                self.hashed.append(path.name)
                if sha256_file(path) != rec["sha256"]:
                    raise DamagedWeights(f"{path}: its sha256 does not match {MANIFEST} in {self.folder} (same size, "
                                         f"different bytes: damaged in place); copy it again")
        self.done.add(str(path))

    def tensor(self, t: torch.Tensor, name: str, path) -> torch.Tensor:
        """``t`` (read as ``name`` from ``path``) checked finite, unless the mode is ``"none"``."""
        return t if self.mode == "none" else check_finite(t, name, str(path))
