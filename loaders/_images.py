"""Image references: normalize to ``{"bytes": ...}`` / ``{"path": ...}`` and check they open.

Decoding pixels is the tokenization package's job. Here ``PIL.Image.open`` only reads the
header (for ``.size``), which is enough to catch missing files and non-images early.
"""

from __future__ import annotations

import io
import os
import re

from ._errors import BadFieldError, BadImageError, MissingImageError
from ._fs import LOCAL, Storage, is_url


def image_ref(value, root: str, where: str, field: str) -> dict:
    """One image value (path str, bytes, or ``{"bytes", "path"}`` dict) as a reference dict."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"bytes": bytes(value)}
    if isinstance(value, str):
        if not value:
            raise BadFieldError("empty image path", where=where, field=field)
        if is_url(value) or os.path.isabs(value):
            return {"path": value}
        if is_url(root):  # next to a remote data file: a URL too
            return {"path": root.rstrip("/") + "/" + value}
        return {"path": os.path.abspath(os.path.join(root, value))}
    if isinstance(value, dict):
        if value.get("bytes"):
            return {"bytes": bytes(value["bytes"])}
        if value.get("path"):
            return image_ref(value["path"], root, where, field)
    raise BadFieldError(f"cannot use {type(value).__name__} as an image", where=where, field=field)


def image_refs(value, root: str, where: str, field: str) -> list[dict]:
    """A single image value or a list of them, as a list of reference dicts."""
    values = value if isinstance(value, list) else [value]
    return [image_ref(v, root, where, field) for v in values if v is not None]


def image_size(ref: dict, where: str, storage: Storage | None = None) -> tuple[int, int]:
    """(width, height) from the image header; raise if the file is missing or not an image.
    A URL path is opened through fsspec with ``storage`` (the data source's `Storage`)."""
    from PIL import Image, UnidentifiedImageError

    remote = "path" in ref and is_url(ref["path"])
    if "path" in ref and not remote and not os.path.isfile(ref["path"]):
        raise MissingImageError(f"image file not found: {ref['path']}", where=where, field="image")
    try:
        source = (storage or LOCAL).open(ref["path"]) if remote else ref.get("path") or io.BytesIO(ref["bytes"])
    except FileNotFoundError:
        raise MissingImageError(f"image file not found: {ref['path']}", where=where, field="image") from None
    try:
        with Image.open(source) as im:
            return im.size
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        name = ref.get("path", f"embedded image bytes ({len(ref.get('bytes') or b'')} bytes)")
        reason = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", str(e)) or type(e).__name__
        raise BadImageError(f"cannot open image {name}: {reason}", where=where, field="image") from None
    finally:
        if remote:
            source.close()
