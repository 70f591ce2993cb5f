"""Vision shaping: image sizes (pixels) -> tiles -> vision tokens, from image headers only."""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, Sequence, Union

import numpy as np

from ._protocol import SampleError


class ImageError(SampleError):
    """An image of a sample is missing or cannot be identified; names the sample and image."""


@dataclass(frozen=True)
class FixedResolution:
    """Every image is resized to one square of ``image_size`` pixels (LLaVA-style).

    Tokens per image = ``tokens_per_image`` if given, else ``(image_size // patch_size) ** 2``
    (336 px / 14 px patches -> 576 tokens), plus ``extra_tokens`` (e.g. image start/end
    markers). One tile per image.
    """

    image_size: int = 336
    patch_size: int = 14
    tokens_per_image: int | None = None
    extra_tokens: int = 0

    def __post_init__(self) -> None:
        if self.tokens_per_image is None and (self.patch_size <= 0 or self.image_size % self.patch_size):
            raise ValueError(
                f"FixedResolution: image_size {self.image_size} px is not a multiple of patch_size "
                f"{self.patch_size} px; pass tokens_per_image explicitly"
            )
        if self.extra_tokens < 0 or (self.tokens_per_image is not None and self.tokens_per_image < 0):
            raise ValueError("FixedResolution: token counts must be >= 0")

    @property
    def image_tokens(self) -> int:
        """Vision tokens of one image, ``extra_tokens`` included."""
        per = self.tokens_per_image
        if per is None:
            per = (self.image_size // self.patch_size) ** 2
        return per + self.extra_tokens

    def num_tiles(self, width: Any, height: Any) -> np.ndarray:
        """Tiles per image (always 1) for image sizes in pixels (scalars or arrays)."""
        return np.ones(np.broadcast(np.asarray(width), np.asarray(height)).shape, dtype=np.int64)

    def tokens(self, width: Any, height: Any) -> np.ndarray:
        """Vision tokens per image for image sizes in pixels (scalars or arrays)."""
        return self.num_tiles(width, height) * self.image_tokens


@dataclass(frozen=True)
class DynamicTiling:
    """InternVL-style dynamic tiling: the image is cut into an ``i x j`` grid of square tiles.

    Among the grids with ``min_num <= i*j <= max_num`` the one whose aspect ratio (``i/j``,
    columns over rows) is closest to the image's (width / height) wins; on an exact tie the
    later (more tiles) grid wins if the image area exceeds half the grid's pixel area
    (``0.5 * tile_size**2 * i * j``), as InternVL's ``find_closest_aspect_ratio`` does. With
    ``use_thumbnail`` a grid of more than one tile gets one extra thumbnail tile.
    Tokens per tile = ``tokens_per_tile`` if given, else
    ``(tile_size // patch_size) ** 2 * downsample_ratio ** 2`` (448 px / 14 px = 32 -> 1024
    patches, pixel shuffle 0.5 -> 256 tokens); each image adds ``extra_tokens``.
    """

    tile_size: int = 448
    min_num: int = 1
    max_num: int = 12
    use_thumbnail: bool = True
    patch_size: int = 14
    downsample_ratio: float = 0.5
    tokens_per_tile: int | None = None
    extra_tokens: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_num <= self.max_num:
            raise ValueError(f"DynamicTiling: need 1 <= min_num <= max_num, got {self.min_num}, {self.max_num}")
        if self.tile_size <= 0:
            raise ValueError(f"DynamicTiling: tile_size must be > 0 pixels, got {self.tile_size}")
        if self.tokens_per_tile is None and (self.patch_size <= 0 or self.tile_size % self.patch_size):
            raise ValueError(
                f"DynamicTiling: tile_size {self.tile_size} px is not a multiple of patch_size "
                f"{self.patch_size} px; pass tokens_per_tile explicitly"
            )

    @property
    def tile_tokens(self) -> int:
        """Vision tokens of one tile."""
        if self.tokens_per_tile is not None:
            return self.tokens_per_tile
        return int((self.tile_size // self.patch_size) ** 2 * self.downsample_ratio**2)

    @cached_property
    def grids(self) -> np.ndarray:
        """Candidate grids as an ``(n, 2)`` array of (columns, rows), in InternVL's order."""
        # InternVL builds a set and sorts it by tile count; grids with equal counts then keep
        # the set's iteration order. Building the same set the same way reproduces that order,
        # which only matters for the (rare) exact ties between equal-count grids.
        cands = set(
            (i, j)
            for n in range(self.min_num, self.max_num + 1)
            for i in range(1, n + 1)
            for j in range(1, n + 1)
            if self.min_num <= i * j <= self.max_num
        )
        return np.array(sorted(cands, key=lambda g: g[0] * g[1]), dtype=np.int64).reshape(-1, 2)

    def grid(self, width: Any, height: Any) -> np.ndarray:
        """Chosen (columns, rows) per image for image sizes in pixels; shape ``(..., 2)``."""
        w, h = np.broadcast_arrays(np.asarray(width, dtype=np.int64), np.asarray(height, dtype=np.int64))
        shape = w.shape
        w, h = w.reshape(-1), h.reshape(-1)
        g = self.grids
        # Same float operations as the reference, so exact ties are detected identically.
        diff = np.abs((w / h)[:, None] - (g[:, 0] / g[:, 1])[None, :])
        is_best = diff == diff.min(axis=1, keepdims=True)
        first = is_best.argmax(axis=1)
        # Scanning the candidates in order, a later tie replaces the current choice iff the
        # image area beats half that grid's pixel area; the last such replacement wins.
        area = (w * h).astype(np.float64)[:, None]
        later = np.arange(len(g))[None, :] > first[:, None]
        takes_over = is_best & later & (area > 0.5 * self.tile_size**2 * (g[:, 0] * g[:, 1])[None, :])
        last = len(g) - 1 - takes_over[:, ::-1].argmax(axis=1)
        pick = np.where(takes_over.any(axis=1), last, first)
        return g[pick].reshape(*shape, 2)

    def num_tiles(self, width: Any, height: Any) -> np.ndarray:
        """Tiles per image (grid tiles + thumbnail) for image sizes in pixels."""
        g = self.grid(width, height)
        tiles = g[..., 0] * g[..., 1]
        if self.use_thumbnail:
            tiles = tiles + (tiles > 1)
        return tiles

    def tokens(self, width: Any, height: Any) -> np.ndarray:
        """Vision tokens per image for image sizes in pixels (scalars or arrays)."""
        return self.num_tiles(width, height) * self.tile_tokens + self.extra_tokens


VisionPolicy = Union[FixedResolution, DynamicTiling]


def _describe(image: Any) -> str:
    if isinstance(image, dict):
        if image.get("path"):
            return f"path {image['path']!r}"
        if image.get("bytes") is not None:
            return f"{len(image['bytes'])} bytes"
    return repr(image)[:80]


def read_image_size(image: Any) -> tuple[int, int]:
    """(width, height) in pixels of ``{"bytes": ...}`` or ``{"path": ...}``, from the header only.

    ``PIL.Image.open`` is lazy: it parses the header and stops, pixels are never decoded.
    So a file cut short *after* its header is not detected here (the training loader will
    fail on it); garbage, a missing file or a header cut short raise.
    """
    from PIL import Image

    if not isinstance(image, dict):
        raise TypeError(f"an image must be a dict with 'bytes' or 'path', got {type(image).__name__}")
    data, path = image.get("bytes"), image.get("path")
    if data is not None:
        src: Any = io.BytesIO(data)
    elif path:
        src = path
    else:
        raise ValueError("image has neither 'bytes' nor 'path'")
    with warnings.catch_warnings():
        # Only the size is read: a huge image is no decompression risk here.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(src) as img:
            w, h = img.size
    return int(w), int(h)


def _sizes(sample: dict) -> list[tuple[int, int]]:
    key = sample.get("key", sample.get("sample_id"))
    images = sample.get("images") or []
    given = sample.get("image_sizes")
    if given is not None and len(given) > 0:
        if images and len(images) != len(given):
            raise ImageError(key, f"has {len(images)} images but {len(given)} image_sizes")
        try:
            out = [(int(w), int(h)) for w, h in given]
        except (TypeError, ValueError) as exc:
            raise ImageError(key, f"image_sizes {given!r} is not a list of (width, height): {exc}") from exc
    else:
        out = []
        for i, image in enumerate(images):
            try:
                out.append(read_image_size(image))
            except Exception as exc:  # PIL raises many types (OSError, SyntaxError, ValueError...)
                raise ImageError(
                    key, f"image {i} ({_describe(image)}) cannot be read: {type(exc).__name__}: {exc}"
                ) from exc
    for i, (w, h) in enumerate(out):
        if w <= 0 or h <= 0:
            raise ImageError(key, f"image {i} has a non-positive size {(w, h)} (width, height)")
    return out


def sample_image_sizes(sample: dict) -> np.ndarray:
    """``(n_images, 2)`` int64 array of (width, height) in pixels for one sample.

    Uses ``sample["image_sizes"]`` when present (no file is opened), else reads each image's
    header. Raises `ImageError` naming the sample ``key`` and the image when an image cannot
    be read or a size is not positive.
    """
    return np.asarray(_sizes(sample), dtype=np.int64).reshape(-1, 2)


def image_tokens_batch(
    samples: Sequence[dict], policy: VisionPolicy | None, *, on_error: Literal["raise", "skip"] = "raise"
) -> tuple[list[np.ndarray], list[tuple[int, ImageError]]]:
    """Vision tokens of each image of each sample (one int64 array per sample, in image order) and the
    ``(index, error)`` of skipped samples (their array is empty).

    With ``policy=None`` every array is empty and no image is opened. Sizes are read per image
    (I/O), the tile/token arithmetic runs vectorised over the whole batch.
    """
    empty = np.zeros(0, dtype=np.int64)
    if policy is None:
        return [empty] * len(samples), []
    skipped: list[tuple[int, ImageError]] = []
    sizes: list[tuple[int, int]] = []
    counts = np.zeros(len(samples), dtype=np.int64)
    for i, s in enumerate(samples):
        try:
            wh = _sizes(s)
        except ImageError as exc:
            if on_error != "skip":
                raise
            skipped.append((i, exc))
            continue
        sizes.extend(wh)
        counts[i] = len(wh)
    if not sizes:
        return [empty] * len(samples), skipped
    wh = np.asarray(sizes, dtype=np.int64)
    tokens = np.asarray(policy.tokens(wh[:, 0], wh[:, 1]), dtype=np.int64).reshape(-1)
    return np.split(tokens, np.cumsum(counts)[:-1]), skipped


def vision_tokens_batch(
    samples: Sequence[dict], policy: VisionPolicy | None, *, on_error: Literal["raise", "skip"] = "raise"
) -> tuple[np.ndarray, list[tuple[int, ImageError]]]:
    """Vision tokens per sample (sum over its images) and the ``(index, error)`` of skipped samples.

    With ``policy=None`` every sample has 0 vision tokens and no image is opened. Sizes are read per
    image (I/O), the tile/token arithmetic runs vectorised over the whole batch (`image_tokens_batch`).
    A skipped sample gets 0 tokens; the caller drops it.
    """
    per_image, skipped = image_tokens_batch(samples, policy, on_error=on_error)
    counts = np.fromiter((int(a.sum()) for a in per_image), dtype=np.int64, count=len(per_image))
    return counts, skipped
