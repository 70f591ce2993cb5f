"""Vision token counts: fixed resolution and InternVL-style dynamic tiling, from headers."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from tokenization import (
    ByteTokenizer,
    DynamicTiling,
    FixedResolution,
    Formatter,
    ImageError,
    read_image_size,
    sample_image_sizes,
    scan_shapes,
    scan_stats,
)


def png_bytes(w: int, h: int, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format=fmt)
    return buf.getvalue()


def vision_sample(images, key="img", **kw):
    return {"sample_id": 1, "key": key, "inputs": "describe", "targets": "", "images": images, **kw}


def test_fixed_resolution_counts():
    assert FixedResolution().image_tokens == 576  # (336 / 14) ** 2
    assert FixedResolution(image_size=224, patch_size=16, extra_tokens=2).image_tokens == 14 * 14 + 2
    assert FixedResolution(tokens_per_image=64).image_tokens == 64
    assert FixedResolution().tokens([10, 5000], [10, 20]).tolist() == [576, 576]  # size-independent
    with pytest.raises(ValueError, match="not a multiple"):
        FixedResolution(image_size=300, patch_size=14)


# Hand-computed with tile 448, max_num 12, thumbnail on, 256 tokens per tile. A grid (i, j)
# is i columns by j rows (aspect i/j); a tie goes to the later (more tiles) grid only when
# the image area > 0.5 * 448**2 * i * j = 100352 * i * j.
HAND = [
    # 448x448: aspect 1 -> (1,1) exact; ties (2,2), (3,3) need area > 401408 / 903168, 200704 is not
    (448, 448, (1, 1), 1, 256),
    # 896x448: aspect 2 -> (2,1); tie (4,2) needs area > 802816, 401408 is not -> 2 tiles + thumbnail
    (896, 448, (2, 1), 3, 768),
    # 1000x300: aspect 3.33 -> (3,1) (diff .33) ties (6,2) (needs > 1204224, area 300000) -> 3 + 1
    (1000, 300, (3, 1), 4, 1024),
    # 300x1000: aspect .3 -> (1,3) (diff .033) beats (1,4) (diff .05) -> 3 + 1
    (300, 1000, (1, 3), 4, 1024),
    # 2000x2000: aspect 1; area 4e6 beats the ties (2,2) and (3,3) -> 9 + 1
    (2000, 2000, (3, 3), 10, 2560),
    # 448x4480: aspect .1 -> (1,10) exact -> 10 + 1
    (448, 4480, (1, 10), 11, 2816),
    # 600x448: aspect 1.339 -> (4,3) = 1.333 (diff .006) beats (3,2) = 1.5 and (1,1) -> 12 + 1
    (600, 448, (4, 3), 13, 3328),
    # 100x20: aspect 5 -> (5,1) exact ((10,2) has 20 > 12 tiles); tiny images still get tiles -> 5 + 1
    (100, 20, (5, 1), 6, 1536),
    # 1344x448: aspect 3 -> (3,1); tie (6,2) needs area > 1204224, 602112 is not -> 3 + 1
    (1344, 448, (3, 1), 4, 1024),
]


@pytest.mark.parametrize("w, h, grid, tiles, tokens", HAND)
def test_dynamic_tiling_hand_values(w, h, grid, tiles, tokens):
    p = DynamicTiling()
    assert p.tile_tokens == 256  # 448 / 14 = 32 -> 1024 patches, pixel shuffle 0.5 -> 256
    assert tuple(p.grid(w, h).tolist()) == grid
    assert int(p.num_tiles(w, h)) == tiles
    assert int(p.tokens(w, h)) == tokens


def test_dynamic_tiling_options():
    assert int(DynamicTiling(use_thumbnail=False).tokens(896, 448)) == 512  # 2 tiles, no thumbnail
    assert int(DynamicTiling(max_num=6).num_tiles(2000, 2000)) == 5  # (3,3) not allowed -> (2,2) + 1
    assert int(DynamicTiling(min_num=2).num_tiles(448, 448)) == 5  # (1,1) excluded -> (2,2) + 1
    assert int(DynamicTiling(tokens_per_tile=100, extra_tokens=3).tokens(896, 448)) == 303
    # vectorised over many images at once, shape preserved
    p = DynamicTiling()
    w = np.array([[448, 896], [1000, 300]])
    h = np.array([[448, 448], [300, 1000]])
    assert p.num_tiles(w, h).tolist() == [[1, 3], [4, 4]]
    with pytest.raises(ValueError, match="min_num"):
        DynamicTiling(min_num=5, max_num=4)


def reference_grid(w, h, min_num=1, max_num=12, tile=448):
    """Straight loop over InternVL's rule, written from its description."""
    grids = sorted(
        set(
            (i, j)
            for n in range(min_num, max_num + 1)
            for i in range(1, n + 1)
            for j in range(1, n + 1)
            if min_num <= i * j <= max_num
        ),
        key=lambda g: g[0] * g[1],
    )
    aspect, best, best_diff = w / h, (1, 1), float("inf")
    for i, j in grids:
        diff = abs(aspect - i / j)
        if diff < best_diff:
            best, best_diff = (i, j), diff
        elif diff == best_diff and w * h > 0.5 * tile * tile * i * j:
            best = (i, j)
    return best


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 6000), st.integers(1, 6000)), min_size=1, max_size=20),
    st.integers(1, 4),
    st.integers(0, 10),
)
def test_dynamic_tiling_matches_reference_loop(sizes, min_num, extra):
    max_num = min_num + extra
    p = DynamicTiling(min_num=min_num, max_num=max_num)
    w, h = np.array(sizes).T
    got = [tuple(g) for g in p.grid(w, h).tolist()]
    assert got == [reference_grid(a, c, min_num, max_num) for a, c in sizes]


def test_sizes_from_bytes_paths_and_image_sizes(tmp_path, monkeypatch):
    jpg = tmp_path / "wide.jpg"
    jpg.write_bytes(png_bytes(1000, 300, "JPEG"))
    images = [{"bytes": png_bytes(896, 448)}, {"path": str(jpg)}]
    assert read_image_size(images[0]) == (896, 448)
    assert read_image_size({"bytes": None, "path": str(jpg)}) == (1000, 300)  # HF datasets layout

    def no_decoding(self):
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(Image.Image, "load", no_decoding)  # only headers may be read
    s = vision_sample(images)
    assert sample_image_sizes(s).tolist() == [[896, 448], [1000, 300]]
    enc = Formatter(ByteTokenizer(), vision=DynamicTiling()).encode(s)
    assert enc.vision_tokens == 768 + 1024
    assert Formatter(ByteTokenizer(), vision=FixedResolution()).encode(s).vision_tokens == 2 * 576
    # image_sizes wins: no file is opened (these paths do not exist)
    s2 = vision_sample([{"path": "/nope/a.jpg"}, {"path": "/nope/b.jpg"}], image_sizes=[(448, 448), (896, 448)])
    assert Formatter(ByteTokenizer(), vision=DynamicTiling()).encode(s2).vision_tokens == 256 + 768
    # a text sample has no vision tokens
    assert Formatter(ByteTokenizer(), vision=DynamicTiling()).encode(vision_sample([])).vision_tokens == 0


@pytest.mark.parametrize(
    "image, what",
    [
        ({"bytes": b"definitely not an image"}, "23 bytes"),
        ({"bytes": png_bytes(64, 64)[:20]}, "20 bytes"),  # cut inside the PNG header
        ({"path": "/no/such/dir/img.png"}, "/no/such/dir/img.png"),
        ({}, "neither 'bytes' nor 'path'"),
    ],
)
def test_unreadable_image_names_sample_and_image(image, what, tmp_path):
    s = vision_sample([{"bytes": png_bytes(8, 8)}, image], key="shard3/000042")
    with pytest.raises(ImageError, match="shard3/000042") as info:
        Formatter(ByteTokenizer(), vision=FixedResolution()).encode(s)
    assert "image 1" in str(info.value) and what in str(info.value)


def test_truncated_file_on_disk_is_reported_and_skippable(tmp_path):
    bad = tmp_path / "cut.png"
    bad.write_bytes(png_bytes(64, 64)[:20])
    good = {"bytes": png_bytes(448, 448)}
    samples = [
        vision_sample([good], key="ok0") | {"sample_id": 0},
        vision_sample([{"path": str(bad)}], key="broken") | {"sample_id": 1},
        vision_sample([good, good], key="ok2") | {"sample_id": 2},
    ]
    with pytest.raises(ImageError, match=r"'broken'.*cut\.png"):
        scan_shapes(samples, "bytes", vision=DynamicTiling())
    table = scan_shapes(samples, "bytes", vision=DynamicTiling(), on_error="skip")
    assert table.column("sample_id").to_pylist() == [0, 2]
    assert table.column("vision_tokens").to_pylist() == [256, 512]
    stats = scan_stats(table)
    assert (stats.num_samples, stats.num_skipped) == (2, 1)
    assert stats.skipped[0][0] == "broken" and "cut.png" in stats.skipped[0][1]
    out = Formatter(ByteTokenizer(), vision=DynamicTiling()).encode_batch(samples, on_error="skip")
    assert out[1] is None and out[2].vision_tokens == 512


def test_bad_image_sizes():
    with pytest.raises(ImageError, match="2 images but 1 image_sizes"):
        sample_image_sizes(vision_sample([{"path": "a"}, {"path": "b"}], image_sizes=[(1, 1)]))
    with pytest.raises(ImageError, match="non-positive size"):
        sample_image_sizes(vision_sample([], image_sizes=[(10, 0)]))
    with pytest.raises(ImageError, match="not a list of"):
        sample_image_sizes(vision_sample([], image_sizes=[(10, 2, 3)]))
