"""Each input format through its Source class and through open_source."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from conftest_loaders import records, slot_ids, wds_text_samples, write_jsonl, write_parquet, write_tar

import loaders


def _inputs(src):
    return [x["inputs"] for x in src]


def test_jsonl_seeks_past_checkpoints(tmp_path):
    # More lines than one checkpoint interval, so units start at seeks + skips.
    n = 2 * loaders._jsonl.CHECKPOINT + 77
    path = write_jsonl(tmp_path / "long.jsonl", records(n))
    src = loaders.JsonlSource(path)
    per_slot = slot_ids(src, 7, 3)
    assert sorted(i for ids in per_slot for i in ids) == list(range(n))
    for s in src.with_layout(rank=5, world_size=7):
        assert s["key"] == f"long.jsonl:{s['meta']['idx'] + 1}" and s["sample_id"] == s["meta"]["idx"]


def test_jsonl_gz_and_unterminated_last_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"inputs": "a", "targets": "b"}\n\n{"inputs": "c", "targets": "d"}')
    assert _inputs(loaders.JsonlSource(str(path))) == ["a", "c"]
    gz = write_jsonl(tmp_path / "y.jsonl.gz", records(3))
    assert [x["key"] for x in loaders.open_source(gz)] == ["y.jsonl.gz:1", "y.jsonl.gz:2", "y.jsonl.gz:3"]


def test_parquet_row_groups_and_columns(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", records(50), row_group_size=7)
    src = loaders.ParquetSource(path, columns=["inputs", "targets"])
    assert src.num_rows == 50 and src.shards[0].boundaries[:3] == (0, 7, 14)
    samples = list(src)
    assert [s["key"] for s in samples[:2]] == ["p.parquet:0", "p.parquet:1"]
    assert samples[3]["meta"] == {} and samples[3]["task"] == ""


def test_arrow_ipc_file(tmp_path):
    table = pa.Table.from_pylist(records(9))
    path = str(tmp_path / "t.feather")
    with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table, max_chunksize=4)
    src = loaders.open_source(path)
    assert isinstance(src, loaders.ArrowSource) and len(list(src)) == 9


def test_hf_dataset_and_save_to_disk(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(records(20))
    assert [x["sample_id"] for x in loaders.open_source(ds)] == list(range(20))
    ds.save_to_disk(str(tmp_path / "saved"))
    src = loaders.open_source(str(tmp_path / "saved"))
    assert isinstance(src, loaders.HFSource) and src.name == "saved"
    assert [x["key"] for x in src][:2] == ["saved:0", "saved:1"]
    # The saved Arrow shards themselves are also readable as Arrow IPC streams.
    arrow = loaders.ArrowSource(str(tmp_path / "saved" / "*.arrow"))
    assert sorted(_inputs(arrow)) == sorted(_inputs(src))
    dd = datasets.DatasetDict({"train": ds})
    with pytest.raises(ValueError, match="split"):
        loaders.open_source(dd)
    assert len(list(loaders.open_source(dd, split="train"))) == 20
    # A shuffled / selected view keeps its own row order.
    view = ds.shuffle(seed=0).select(range(5))
    assert _inputs(loaders.HFSource(view)) == view["inputs"]


def test_hf_iterable_dataset():
    import datasets

    ds = datasets.Dataset.from_list(records(12)).to_iterable_dataset(num_shards=4)
    src = loaders.open_source(ds, name="stream")
    assert isinstance(src, loaders.HFIterableSource) and src.num_shards == 4 and src.num_rows is None
    got = list(src)
    assert sorted(x["inputs"] for x in got) == sorted(r["inputs"] for r in records(12))
    assert got[0]["key"] == "stream#0:0"
    with pytest.raises(ValueError, match="row counts"):
        loaders.HFIterableSource(ds, max_samples_per_epoch=3)


def test_webdataset_brace_pattern_and_gz(tmp_path):
    for i in range(3):
        write_tar(tmp_path / f"shard-{i:03d}.tar", wds_text_samples(4, f"s{i}"))
    src = loaders.open_source(str(tmp_path / "shard-{000..002}.tar"))
    assert isinstance(src, loaders.WebDatasetSource) and src.num_shards == 3
    assert [x["key"] for x in src][:2] == ["s0_00000", "s0_00001"]
    assert src.shards[2].name == "shard-002.tar"
    gz = write_tar(tmp_path / "z.tar.gz", wds_text_samples(5, "z"))
    assert len(list(loaders.open_source(gz))) == 5


def test_json_array_llava_file(tmp_path):
    data = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
            for i in range(4)]
    path = tmp_path / "llava.json"
    path.write_text(json.dumps(data))
    src = loaders.open_source(str(path))
    assert isinstance(src, loaders.JsonSource)
    assert [x["key"] for x in src] == [f"llava.json[{i}]" for i in range(4)]


def test_open_source_rejects_unknown_and_mixed(tmp_path):
    (tmp_path / "a.csv").write_text("x\n")
    with pytest.raises(ValueError, match="cannot tell the format"):
        loaders.open_source(str(tmp_path / "a.csv"))
    write_jsonl(tmp_path / "b.jsonl", records(1))
    write_parquet(tmp_path / "c.parquet", records(1))
    with pytest.raises(ValueError, match="several formats"):
        loaders.open_source(str(tmp_path))


def test_plan_is_inspectable(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", records(100), row_group_size=10)
    src = loaders.ParquetSource(path, shuffle=True)
    plans = [src.plan(loaders.Layout(rank=r, world_size=2)) for r in range(2)]
    rows = [sum(u.rows for u in p) for p in plans]
    assert sum(rows) == 100 and abs(rows[0] - rows[1]) <= 10
    assert "ParquetSource" in repr(src) and src.num_shards == 1
