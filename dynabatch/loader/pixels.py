"""Image tiles: per-sample tile counts (from image sizes, no decoding) and, on request, pixels.

Tile counts follow the tokenization package's vision policy exactly (`DynamicTiling.grid` /
`FixedResolution`), so they match the vision tokens the plan was costed with. Decoding pixels is
the expensive part (PIL decode + resize, about 10-50 ms per megapixel image), so the loader only
does it with ``load_pixels=True``. Each image becomes ``[tiles, 3, S, S]`` float32, normalized with
the ImageNet mean/std as InternVL does: the grid tiles row-major, then the thumbnail (the whole
image resized to one tile) when the grid has more than one tile.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import torch

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _policy_classes():
    from tokenization import DynamicTiling, FixedResolution

    return DynamicTiling, FixedResolution


def tile_size(policy) -> int:
    """Side of one tile in pixels."""
    DynamicTiling, _ = _policy_classes()
    return int(policy.tile_size if isinstance(policy, DynamicTiling) else policy.image_size)


def sample_sizes(sample: dict) -> np.ndarray:
    """``(n_images, 2)`` (width, height) in pixels, from ``image_sizes`` or the image headers."""
    from tokenization import sample_image_sizes

    if not sample.get("images"):
        return np.zeros((0, 2), np.int64)
    return sample_image_sizes(sample)


def sample_tiles(samples: Sequence[dict], policy) -> np.ndarray:
    """Tiles per sample (summed over its images) under ``policy``; 0 without a policy."""
    counts = np.zeros(len(samples), np.int64)
    if policy is None:
        return counts
    sizes, owner = [], []
    for i, s in enumerate(samples):  # header reads are I/O per image; the arithmetic is vectorized
        wh = sample_sizes(s)
        if len(wh):
            sizes.append(wh)
            owner.append(np.full(len(wh), i))
    if sizes:
        wh = np.concatenate(sizes)
        np.add.at(counts, np.concatenate(owner), policy.num_tiles(wh[:, 0], wh[:, 1]))
    return counts


def _open(ref):
    from PIL import Image

    src = io.BytesIO(ref["bytes"]) if ref.get("bytes") is not None else ref["path"]
    return Image.open(src).convert("RGB")


def image_tiles(ref: dict, policy) -> np.ndarray:
    """Decoded tiles of one image as uint8 ``[tiles, 3, S, S]``."""
    from PIL import Image

    DynamicTiling, _ = _policy_classes()
    S = tile_size(policy)
    img = _open(ref)
    if not isinstance(policy, DynamicTiling):
        arr = np.asarray(img.resize((S, S), Image.BICUBIC))
        return arr.transpose(2, 0, 1)[None]
    cols, rows = (int(v) for v in policy.grid(img.width, img.height))
    big = np.asarray(img.resize((S * cols, S * rows), Image.BICUBIC))
    # [rows*S, cols*S, 3] -> [rows, cols, 3, S, S] -> row-major tiles, no loop over tiles
    tiles = big.reshape(rows, S, cols, S, 3).transpose(0, 2, 4, 1, 3).reshape(rows * cols, 3, S, S)
    if policy.use_thumbnail and rows * cols > 1:
        thumb = np.asarray(img.resize((S, S), Image.BICUBIC)).transpose(2, 0, 1)[None]
        tiles = np.concatenate([tiles, thumb])
    return tiles


def pixel_values(image_lists: Sequence[Sequence[dict]], policy, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> torch.Tensor:
    """All tiles of all images of the samples, in sample order: float32 ``[tiles, 3, S, S]``."""
    S = tile_size(policy)
    parts = [image_tiles(ref, policy) for refs in image_lists for ref in refs]
    if not parts:
        return torch.zeros((0, 3, S, S), dtype=torch.float32)
    arr = torch.from_numpy(np.concatenate(parts)).to(torch.float32).div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    return arr.sub_(m).div_(s)
