"""`dynabatch.index`: the one length-index type, reader and writer, and its integrity checks on disk
(duplicated, removed or added rows, negative and empty samples, ids the data does not hold)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynabatch import Shapes
from dynabatch.cli import main
from dynabatch.index import (INTEGRITY_KEY, LengthIndex, LengthIndexError, ScanConfig, read_index, read_index_table,
                             scan_dataset, write_index)
from dynabatch.loader.modes.indexed.steps import load_index

from test_offline import write_dataset


@pytest.fixture(scope="module")
def scanned(tmp_path_factory):
    d = tmp_path_factory.mktemp("index")
    data = d / "train.jsonl"
    write_dataset(data, n=400, seed=2)
    out = d / "index.parquet"
    scan_dataset(data, ScanConfig(), workers=1, progress=False).write(out)
    return {"dir": d, "data": data, "index": out}


def tampered(src, dst, edit) -> pa.Table:
    """Rewrite the index with ``edit(table)`` applied, keeping its metadata (integrity record included)."""
    table = pq.read_table(src)
    out = edit(table).replace_schema_metadata(table.schema.metadata)
    pq.write_table(out, dst)
    return out


def plan_argv(index, tmp_path):
    return ["plan", str(index), "--ranks", "2", "--stages", "2", "--global-batch-tokens", "8192", "--workers", "1",
            "--no-progress", "--out", str(tmp_path / "plan.parquet")]


def test_round_trip_and_one_type(scanned, tmp_path):
    index = read_index(scanned["index"])
    assert isinstance(index, LengthIndex) and len(index) == 400
    assert index.task_names == sorted(index.task_names) and index.scan_options["tokenizer"] == "bytes"
    assert index.paths == [str(scanned["index"].resolve())] and not index.scanned
    meta = pq.read_schema(scanned["index"]).metadata
    record = json.loads(meta[INTEGRITY_KEY])
    assert record["samples"] == 400 and len(record["sample_id_checksum"]) == 16
    assert index.fingerprint == meta[b"dynabatch.dataset_fingerprint"].decode()
    # the same type and reader serve the DataLoader (labels derived without a label_tokens column)
    loaded = load_index(str(scanned["index"]), "decoder")
    assert loaded.fingerprint == index.fingerprint and not loaded.exact_labels and len(loaded.label_tokens) == 400
    # a LengthIndex, a table and Shapes write and read back the same; Arrow IPC by suffix
    for src, path in ((index, tmp_path / "a.parquet"), (pq.read_table(scanned["index"]), tmp_path / "b.arrow"),
                      (index.shapes, tmp_path / "c.parquet")):
        write_index(src, path)
        again = read_index(path)
        assert again.fingerprint == index.fingerprint and len(again) == 400
    assert read_index(tmp_path / "a.parquet").task_names == index.task_names


def test_duplicated_row_is_refused(scanned, tmp_path, capsys):
    bad = tmp_path / "dup.parquet"
    table = tampered(scanned["index"], bad, lambda t: pa.concat_tables([t, t.slice(17, 1)]))
    sid = table.column("sample_id")[17].as_py()
    for read in (read_index, read_index_table):
        with pytest.raises(LengthIndexError, match=rf"dup.parquet: sample_id {sid} appears 2 times"):
            read(bad)
    assert main(plan_argv(bad, tmp_path)) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"sample_id {sid} appears 2 times" in err and "dup.parquet" in err


def test_removed_row_is_refused_and_named(scanned, tmp_path, capsys):
    bad = tmp_path / "removed.parquet"
    ids = pq.read_table(scanned["index"]).column("sample_id").to_pylist()
    tampered(scanned["index"], bad, lambda t: pa.concat_tables([t.slice(0, 30), t.slice(31)]))
    with pytest.raises(LengthIndexError, match=rf"removed.parquet: sample_id {ids[30]} was removed \(399 rows, 400 "):
        read_index(bad)
    assert main(plan_argv(bad, tmp_path)) == 1
    assert f"sample_id {ids[30]} was removed" in capsys.readouterr().err
    # a changed id (same row count) is refused too
    other = tmp_path / "changed.parquet"

    def change(t):
        sid = t.column("sample_id").to_numpy().copy()
        sid[5] = sid[-1] + 1
        return t.set_column(0, "sample_id", pa.array(sid))

    tampered(scanned["index"], other, change)
    with pytest.raises(LengthIndexError, match="changed.parquet: its sample ids differ from those written"):
        read_index(other)


def test_negative_and_empty_samples(scanned, tmp_path, caplog):
    table = pq.read_table(scanned["index"])
    sid = table.column("sample_id")[3].as_py()

    def with_tokens(value):
        def edit(t):
            col = t.column("input_tokens").to_numpy().copy()
            col[3] = value
            t = t.set_column(1, t.schema.field(1), pa.array(col, pa.int32()))
            return t.set_column(2, t.schema.field(2), pa.array(np.where(np.arange(len(col)) == 3, 0,
                                                                    t.column(2).to_numpy()), pa.int32()))
        return edit

    neg = tmp_path / "negative.parquet"
    tampered(scanned["index"], neg, with_tokens(-4))
    with pytest.raises(LengthIndexError, match=rf"negative.parquet: .*negative \(-4\) for sample_id {sid}"):
        read_index(neg)
    empty = tmp_path / "empty.parquet"
    # written through write_index (an edit kept with the old record is refused: test_integrity_index)
    write_index(with_tokens(0)(table), empty)
    with caplog.at_level(logging.WARNING, logger="dynabatch"):
        index = read_index(empty)
    assert len(index) == 400
    assert f"empty.parquet: 1 samples have no tokens at all (sample_id {sid})" in caplog.text


def test_plan_refuses_ids_not_in_the_data(scanned, tmp_path, capsys):
    index = read_index(scanned["index"])
    s = index.shapes
    ids = s.sample_id.copy()
    ids[-1] = 400 + 5  # row 405 of a 400-line file
    moved = LengthIndex(Shapes(ids, s.input_tokens, s.target_tokens, s.vision_tokens, s.task_id), index.task_names,
                        scan_options=index.scan_options)
    path = tmp_path / "stale.parquet"
    write_index(moved, path)  # a freshly written index: its integrity record holds
    assert len(read_index_table(path)) == 400
    assert main(plan_argv(path, tmp_path)) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "stale.parquet: sample_id 405 is not in the data it was scanned from" in err
    assert "train.jsonl, 400 rows" in err
    assert main(plan_argv(scanned["index"], tmp_path)) == 0  # the untouched index plans
