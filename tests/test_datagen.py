"""dynabatch.datagen: deterministic, heavy-tailed, readable by the loaders, varied image tiling."""

import numpy as np
import pytest

import loaders
from dynabatch import datagen
from dynabatch.shape_sources import synthetic_shapes
from dynabatch.cli import main
from tokenization import DynamicTiling, scan_shapes


def _bytes_of(paths):
    return [p.read_bytes() for p in paths]


@pytest.mark.parametrize("fmt", datagen.TEXT_FORMATS)
def test_text_shards_are_byte_identical_for_a_seed(tmp_path, fmt):
    a = datagen.write_text_shards(tmp_path / "a", 120, 3, seed=7, format=fmt)
    b = datagen.write_text_shards(tmp_path / "b", 120, 3, seed=7, format=fmt)
    c = datagen.write_text_shards(tmp_path / "c", 120, 3, seed=8, format=fmt)
    assert [p.name for p in a] == [f"shard-{k:06d}.{fmt}" for k in range(3)]
    assert _bytes_of(a) == _bytes_of(b)
    assert _bytes_of(a) != _bytes_of(c)


def test_image_text_shards_are_byte_identical_for_a_seed(tmp_path):
    a = datagen.write_image_text_shards(tmp_path / "a", 12, 2, seed=3)
    b = datagen.write_image_text_shards(tmp_path / "b", 12, 2, seed=3)
    assert [p.name for p in a] == ["shard-000000.tar", "shard-000001.tar"]
    assert _bytes_of(a) == _bytes_of(b)


def test_text_lengths_are_heavy_tailed_and_follow_synthetic_shapes():
    rows = datagen.text_records(1500, seed=0)
    assert set(rows[0]) == {"id", "task", "inputs", "targets"}
    assert {r["task"] for r in rows} == set(datagen.TEXT_TASKS)
    total = np.array([len((r["inputs"] + r["targets"]).encode()) for r in rows])
    assert total.max() > 10 * np.median(total)
    # ~4 bytes per synthetic token, sample by sample.
    shapes, _ = synthetic_shapes("text", 1500, seed=0)
    est = np.ceil(np.array([len(r["inputs"].encode()) for r in rows]) / 4)
    ratio = est / shapes.input_tokens
    assert 0.8 < np.median(ratio) < 1.25
    # Pseudo-words from a small vocabulary: few distinct words, so BPE learns them.
    words = {w.strip(".,?:()\n").lower() for r in rows[:200] for w in r["inputs"].split()}
    assert len(words) < 2000


@pytest.mark.parametrize("fmt", datagen.TEXT_FORMATS)
def test_text_shards_read_back_with_the_loaders(tmp_path, fmt):
    datagen.write_text_shards(tmp_path, 250, 3, seed=1, format=fmt)
    src = loaders.open_source(str(tmp_path))
    samples = list(src)
    assert len(samples) == 250
    assert sorted(s["meta"]["id"] for s in samples) == [f"gen1-{i:08d}" for i in range(250)]
    assert all(s["inputs"].strip() and s["task"] in datagen.TEXT_TASKS for s in samples)


def test_image_text_shards_read_back_and_tile_counts_vary(tmp_path):
    datagen.write_image_text_shards(tmp_path, 40, 3, seed=0)
    samples = list(loaders.open_source(str(tmp_path)))
    assert len(samples) == 40
    sizes = np.array([s["image_sizes"][0] for s in samples])
    assert all(len(s["images"]) == 1 and s["messages"][0]["content"].startswith("<image>\n") for s in samples)
    assert sizes.min() >= datagen.MIN_SIDE_PX - 1 and sizes.max() <= datagen.MAX_SIDE_PX
    tiles = DynamicTiling().num_tiles(sizes[:, 0], sizes[:, 1])
    assert tiles.min() == 1 and tiles.max() >= 6 and len(set(tiles.tolist())) >= 4
    table = scan_shapes(samples, "bytes", vision=DynamicTiling())
    assert table.num_rows == 40 and min(table.column("vision_tokens").to_pylist()) >= 256


def test_datagen_cli(tmp_path, capsys):
    assert main(["datagen", "--out", str(tmp_path), "--text", "30", "--image-text", "4", "--shards", "2",
                 "--text-format", "jsonl.gz", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "text: 30 samples in 2 shards" in out and "image_text: 4 samples" in out
    assert len(list(loaders.open_source(str(tmp_path / "text")))) == 30
    assert sorted(p.name for p in (tmp_path / "image_text").iterdir()) == ["shard-000000.tar", "shard-000001.tar"]
    assert main(["datagen", "--out", str(tmp_path)]) == 1  # nothing asked for


def test_datagen_help_teaches(capsys):
    with pytest.raises(SystemExit):
        main(["datagen", "--help"])
    out = capsys.readouterr().out
    for word in ("--image-text", "byte-identical", "conversations", "tiles"):
        assert word in out
