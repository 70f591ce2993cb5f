"""Issue 27 point 2: a length index carries a checksum of every column and metadata entry; the
loader, `read_index` and ``dynabatch plan`` refuse an edited one naming the file and the column."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynabatch import DataLoader
from dynabatch.cli import main
from dynabatch.index import INTEGRITY_KEY, LengthIndexError, read_index, read_index_table, write_index
from dynabatch.integrity import column_checksums

from test_dataloader_data import PLAN, records, write_jsonl
from test_length_index import plan_argv, tampered
from dynabatch.loader.settings import records_from_keywords


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from dynabatch import build_index

    d = tmp_path_factory.mktemp("index_integrity")
    data = write_jsonl(d / "train.jsonl", records(150, seed=4))
    index = d / "index.parquet"
    build_index(data, path=index)  # the DataLoader's own index: Shapes columns plus label_tokens
    return {"dir": d, "data": data, "index": index}


def _scale(column, factor=2, row=None, value=None):
    def edit(t):
        col = t.column(column).to_numpy().copy()
        if row is None:
            col = col * factor
        else:
            col[row] = value
        field = t.schema.field(column)
        return t.set_column(t.column_names.index(column), field, pa.array(col, field.type))
    return edit


EDITS = {
    "input_tokens x2": ("input_tokens", _scale("input_tokens")),
    "target_tokens x2": ("target_tokens", _scale("target_tokens")),
    "label_tokens x2": ("label_tokens", _scale("label_tokens")),
    "one sample 2**31-1": ("input_tokens", _scale("input_tokens", row=7, value=2**31 - 1)),
    "task_id": ("task_id", _scale("task_id", row=3, value=0)),
    "vision_tokens": ("vision_tokens", _scale("vision_tokens", row=9, value=576)),
    "two rows swapped": ("input_tokens", lambda t: t.set_column(
        1, t.schema.field(1), pa.array(np.r_[t.column(1).to_numpy()[[1, 0]], t.column(1).to_numpy()[2:]],
                                       pa.int32()))),
}


def test_index_records_every_column(built):
    meta = pq.read_schema(built["index"]).metadata
    rec = json.loads(meta[INTEGRITY_KEY])
    table = pq.read_table(built["index"])
    assert set(rec["columns"]) == set(table.column_names) - {"sample_id"} and "label_tokens" in rec["columns"]
    assert {"dynabatch.index_settings", "dynabatch.task_names"} <= set(rec["metadata"])
    # the checksum does not depend on row order: the reversed table (same metadata) reads fine
    rev = built["dir"] / "reversed.parquet"
    tampered(built["index"], rev, lambda t: t.take(pa.array(np.arange(t.num_rows)[::-1])))
    assert len(read_index_table(rev)) == 150
    # and it is keyed by sample: moving one value to another row changes it
    ids = table.column("sample_id").to_numpy()
    a = column_checksums(table, ids)
    swapped = _scale("input_tokens", row=0, value=table.column("input_tokens")[1].as_py())(table)
    assert column_checksums(swapped, ids)["input_tokens"] != a["input_tokens"]
    assert column_checksums(table.take(pa.array(np.arange(len(ids))[::-1])), ids[::-1]) == a


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_edited_column_is_refused_by_reader_loader_and_plan(built, tmp_path, capsys, edit):
    column, fn = EDITS[edit]
    bad = tmp_path / "edited.parquet"
    tampered(built["index"], bad, fn)
    for read in (read_index, read_index_table):
        with pytest.raises(LengthIndexError) as e:
            read(bad)
        msg = str(e.value)
        assert msg.startswith(f"{bad}: column {column} does not match the integrity record"), msg
        assert "re-scan the data (dynabatch scan)" in msg
    with pytest.raises(LengthIndexError, match=rf"edited.parquet: column {column} does not match"):
        DataLoader(built["data"], **records_from_keywords(dict(index=str(bad), global_batch_tokens=2000, **PLAN)))
    capsys.readouterr()
    assert main(plan_argv(bad, tmp_path)) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"column {column} does not match" in err and "edited.parquet" in err


def test_edited_metadata_and_dropped_column_are_refused(built, tmp_path):
    table = pq.read_table(built["index"])
    meta = dict(table.schema.metadata)
    meta[b"dynabatch.task_names"] = json.dumps(["x", "y", "z", "w"]).encode()
    bad = tmp_path / "meta.parquet"
    pq.write_table(table.replace_schema_metadata(meta), bad)
    with pytest.raises(LengthIndexError, match="metadata entry dynabatch.task_names does not match"):
        read_index(bad)
    gone = tmp_path / "gone.parquet"
    tampered(built["index"], gone, lambda t: t.drop_columns(["label_tokens"]))
    with pytest.raises(LengthIndexError, match=r"column label_tokens \(removed\) does not match"):
        read_index(gone)
    # rewritten through write_index, the same edit is a new, valid index
    write_index(read_index_table(built["index"]).drop_columns(["label_tokens"]), gone)
    assert len(read_index(gone)) == 150


def test_edited_index_cache_is_rebuilt_with_a_warning(built, tmp_path, caplog):
    cache = tmp_path / "cache.parquet"
    kw = dict(index_cache=str(cache), global_batch_tokens=2000, mode="indexed", **PLAN)
    want = [s.plan.fingerprint() for s in DataLoader(built["data"], **records_from_keywords(dict(**kw))).steps()]
    tampered(cache, cache, _scale("input_tokens"))
    with caplog.at_level("WARNING", logger="dynabatch"):
        again = [s.plan.fingerprint() for s in DataLoader(built["data"], **records_from_keywords(dict(**kw))).steps()]
    assert f"{cache}: column input_tokens does not match" in caplog.text and "rebuilding the index cache" in caplog.text
    assert again == want and len(read_index_table(cache)) == 150  # the cache is whole again
