"""Reading Shapes from files (text estimates, token columns, OmniBal records) and the generator."""

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynabatch.shape_sources import ShapeSourceError, read_shapes, synthetic_shapes


def test_text_estimate_is_bytes_over_four(tmp_path):
    p = tmp_path / "t.jsonl"
    rows = [{"inputs": "a" * 9, "targets": "bb", "task": "x"}, {"inputs": "é" * 4, "targets": "", "task": "y"}]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    shapes, tasks = read_shapes(p)
    assert shapes.input_tokens.tolist() == [3, 2]  # ceil(9/4), ceil(8 bytes/4)
    assert shapes.target_tokens.tolist() == [2, 1]  # ceil(2/4)+1 EOS, 0+1 EOS
    assert [tasks[t] for t in shapes.task_id] == ["x", "y"]


def test_alternate_field_names(tmp_path):
    p = tmp_path / "alt.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write(json.dumps({"instruction": "abcdefgh", "response": "abcd"}) + "\n")
    shapes, _ = read_shapes(p)
    assert (shapes.input_tokens[0], shapes.target_tokens[0]) == (2, 2)


def test_omnibal_records_and_csv(tmp_path):
    recs = [{"vit_num": 1, "token_num": 358, "image_flags": 1}, {"vit_num": 5, "token_num": 1341, "image_flags": 5}]
    (tmp_path / "ai2d_train_12k_wh_token_lengths.json").write_text(json.dumps(recs, indent=2))
    with gzip.open(tmp_path / "more.csv.gz", "wt") as f:
        f.write("dataset,vit_num,token_num,image_flags\nchartqa,3,900,3\n")
    shapes, tasks = read_shapes(tmp_path)
    assert shapes.vision_tokens.tolist() == [256, 1280, 768]
    assert shapes.input_tokens.tolist() == [102, 61, 132]
    assert sorted(tasks) == ["ai2d_train_12k", "chartqa"]
    # ids are (file index << 32) | row: unique across files
    assert len(np.unique(shapes.sample_id)) == 3


def test_token_columns_parquet_keep_ids(tmp_path):
    t = pa.table({"sample_id": [7, 9], "input_tokens": [10, 20], "target_tokens": [1, 2]})
    pq.write_table(t, tmp_path / "idx.parquet")
    shapes, _ = read_shapes(tmp_path / "idx.parquet")
    assert shapes.sample_id.tolist() == [7, 9] and shapes.vision_tokens.tolist() == [0, 0]


def test_errors_name_the_file(tmp_path):
    p = tmp_path / "cols.jsonl"
    p.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ShapeSourceError, match="cols.jsonl.*no token columns"):
        read_shapes(p)
    bad = tmp_path / "neg.json"
    bad.write_text(json.dumps([{"vit_num": 2, "token_num": 100}]))
    with pytest.raises(ShapeSourceError, match="neg.json: record 0"):
        read_shapes(bad)
    with pytest.raises(ShapeSourceError, match="no such file"):
        read_shapes(tmp_path / "missing.parquet")


@pytest.mark.parametrize("kind", ["text", "vision"])
def test_synthetic_is_deterministic_and_heavy_tailed(kind):
    a, names = synthetic_shapes(kind, 5000, seed=3)
    b, _ = synthetic_shapes(kind, 5000, seed=3)
    c, _ = synthetic_shapes(kind, 5000, seed=4)
    assert a.to_arrow().equals(b.to_arrow()) and not a.to_arrow().equals(c.to_arrow())
    total = a.total_tokens
    spread = 10 if kind == "text" else 3  # text lengths span orders of magnitude; tiles are bounded
    assert total.max() > spread * np.median(total) and total.min() < np.median(total) / 3
    assert set(np.unique(a.task_id)) == set(range(len(names)))
