"""Issue 27 point 3: a plan file records a checksum of every column and metadata entry; the replay
loader, `load_run_plan` and ``dynabatch inspect`` refuse an edited one naming the file and column."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynabatch import DataLoader, PlanMismatchError, build_index, load_run_plan
from dynabatch.cli import main

from test_dataloader_data import PLAN, records, write_jsonl
from dynabatch.loader.settings import records_from_keywords

TOKENS = 3000


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan_integrity")
    data = write_jsonl(d / "train.jsonl", records(160, seed=6))
    index = d / "index.parquet"
    build_index(data, path=index)
    plan = d / "plan.parquet"
    argv = ["plan", str(index), "--out", str(plan), "--model", "gpt", "--device", "cpu", "--ranks", "1", "--stages",
            "2", "--global-batch-tokens", str(TOKENS), "--tokenizer", "bytes", "--workers", "1", "--no-progress"]
    assert main(argv) == 0
    return {"data": data, "index": index, "plan": plan}


def _first_mb_rows(t):
    step, mb = t.column("step").to_numpy(), t.column("microbatch").to_numpy()
    return (step == step[0]) & (mb == mb[0])


def _set(column, fn):
    def edit(t):
        col = t.column(column).to_numpy().copy()
        col = fn(col, t)
        field = t.schema.field(column)
        return t.set_column(t.column_names.index(column), field, pa.array(col, field.type))
    return edit


EDITS = {
    "input_len": _set("input_len", lambda c, t: np.where(_first_mb_rows(t), c * 2, c)),
    "time_s": _set("time_s", lambda c, t: np.where(np.arange(len(c)) == 0, np.nan, c)),
    "rows": _set("rows", lambda c, t: np.where(_first_mb_rows(t), c + 1, c)),
    "tokens": _set("tokens", lambda c, t: c + 1),
    "sample_tokens": _set("sample_tokens", lambda c, t: np.where(np.arange(len(c)) == 5, c + 100, c)),
    "memory_bytes": _set("memory_bytes", lambda c, t: c * 0.5),
    "target_len": _set("target_len", lambda c, t: np.where(_first_mb_rows(t), c + 8, c)),
    "target_tokens": _set("target_tokens", lambda c, t: np.where(_first_mb_rows(t), c + 3, c)),
    "row": _set("row", lambda c, t: _shuffled_rows(c, t)),
}


def _shuffled_rows(row, t):
    """The ``row`` values of the first micro-batch with two different rows, reversed (else one row's
    moved to the next row)."""
    key = t.column("step").to_numpy() * 1000 + t.column("microbatch").to_numpy()
    for k in np.unique(key):
        at = np.flatnonzero(key == k)
        if len(np.unique(row[at])) > 1:
            row[at] = row[at][::-1]
            return row
    row[0] += 1
    return row


def _write(planned, tmp_path, name, edit=None, meta=None):
    table = pq.read_table(planned["plan"])
    out = edit(table) if edit else table
    out = out.replace_schema_metadata(meta if meta is not None else table.schema.metadata)
    path = tmp_path / name
    pq.write_table(out, path)
    return path


def test_plan_records_every_column(planned):
    table = pq.read_table(planned["plan"])
    rec = json.loads(table.schema.metadata[b"dynabatch.integrity"])
    assert set(rec["columns"]) == set(table.column_names) - {"step", "rank", "microbatch", "sample_id"}
    assert {"dynabatch.options", "dynabatch.cost_model", "dynabatch.rank_time_s"} <= set(rec["metadata"])


@pytest.mark.parametrize("column", sorted(EDITS))
def test_edited_column_is_refused_by_reader_inspect_and_replay(planned, tmp_path, capsys, column):
    bad = _write(planned, tmp_path, "edited.parquet", EDITS[column])
    assert not pq.read_table(bad).column(column).equals(pq.read_table(planned["plan"]).column(column))
    with pytest.raises(PlanMismatchError) as e:
        load_run_plan(bad)
    msg = str(e.value)
    assert msg.startswith(f"{bad}: column {column} does not match the integrity record"), msg
    assert "re-plan with `dynabatch plan`" in msg and "\n" not in msg
    capsys.readouterr()
    assert main(["inspect", str(bad)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"column {column} does not match" in err and "edited.parquet" in err
    with pytest.raises(PlanMismatchError, match=f"column {column} does not match"):
        DataLoader(planned["data"], **records_from_keywords(dict(plan=str(bad), index=str(planned["index"]), global_batch_tokens=TOKENS, **PLAN)))


def test_edited_metadata_is_refused_and_the_plan_as_written_replays(planned, tmp_path):
    table = pq.read_table(planned["plan"])
    meta = dict(table.schema.metadata)
    opts = json.loads(meta[b"dynabatch.options"])
    opts["max_len"] = 77
    meta[b"dynabatch.options"] = json.dumps(opts, sort_keys=True).encode()
    bad = _write(planned, tmp_path, "options.parquet", meta=meta)
    with pytest.raises(PlanMismatchError, match="metadata entry dynabatch.options does not match"):
        load_run_plan(bad)
    meta = dict(table.schema.metadata)
    meta[b"dynabatch.rank_time_s"] = b"{}"
    with pytest.raises(PlanMismatchError, match="metadata entry dynabatch.rank_time_s does not match"):
        load_run_plan(_write(planned, tmp_path, "times.parquet", meta=meta))
    steps = list(DataLoader(planned["data"], **records_from_keywords(dict(plan=str(planned["plan"]), index=str(planned["index"]), global_batch_tokens=TOKENS, **PLAN))))
    assert len(steps) == load_run_plan(planned["plan"]).num_steps
