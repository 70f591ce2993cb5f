"""Issue 27 point 4: data replaced between save and resume. A length index, a plan and a loader state
record each data file's fingerprint (size and content digest locally, ETag and size on S3); a file
rewritten with other text of the same token counts is refused, naming the FILE or OBJECT."""

from __future__ import annotations

import gzip
import json
import re

import pyarrow.parquet as pq
import pytest

import loaders
from dynabatch import DataLoader, LoaderStateError, PlanMismatchError, build_index
from dynabatch.cli import main
from dynabatch.index import LengthIndexError

from test_dataloader_data import PLAN, records, write_jsonl, write_parquet
from test_loaders_remote import s3  # noqa: F401  (the moto S3 server fixture, on 127.0.0.1)
from dynabatch.loader.settings import records_from_keywords

TOKENS = 2000


def _same_counts(recs):
    """Other text of exactly the same byte (token) counts."""
    swap = str.maketrans("abcdefgh", "hgfedcba")
    return [dict(r, inputs=r["inputs"].translate(swap)) for r in recs]


def _state_after(loader, steps=2):
    it = iter(loader)
    for _ in range(steps):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    return state


def test_local_parquet_rewritten_with_the_same_token_counts_is_refused(tmp_path):
    recs = records(100, seed=8)
    data = write_parquet(tmp_path / "train.parquet", recs, row_group_size=20)
    index = tmp_path / "index.parquet"
    build_index(data, path=index)
    plan = tmp_path / "plan.parquet"
    assert main(["plan", str(index), "--out", str(plan), "--model", "gpt", "--device", "cpu", "--ranks", "1",
                 "--stages", "2", "--global-batch-tokens", str(TOKENS), "--tokenizer", "bytes", "--workers", "1",
                 "--no-progress"]) == 0
    state = _state_after(DataLoader(data, **records_from_keywords(dict(index=str(index), global_batch_tokens=TOKENS, **PLAN))), steps=1)

    write_parquet(data, _same_counts(recs), row_group_size=20)  # same rows, same token counts, other text
    changed = f"{data} changed (size "
    with pytest.raises(LengthIndexError) as e:
        DataLoader(data, **records_from_keywords(dict(index=str(index), global_batch_tokens=TOKENS, **PLAN)))
    assert str(e.value).startswith(f"{index} was made from other data than is read now: {changed}"), str(e.value)
    assert "re-scan the data (dynabatch scan)" in str(e.value)
    with pytest.raises(PlanMismatchError, match=rf"{plan} was made from other data than is read now: .*train.parquet "
                                                r"changed"):
        DataLoader(data, **records_from_keywords(dict(plan=str(plan), index=str(index), global_batch_tokens=TOKENS, **PLAN)))
    # a loader that scans the new data itself is fine, but the state saved over the old data is refused
    fresh = DataLoader(data, **records_from_keywords(dict(global_batch_tokens=TOKENS, **PLAN)))
    with pytest.raises(LoaderStateError, match="the DataLoader state was made from other data than is read now: "
                                               + re.escape(changed)):
        fresh.load_state_dict(state)
    # the data as it was resumes again
    write_parquet(data, recs, row_group_size=20)
    DataLoader(data, **records_from_keywords(dict(index=str(index), global_batch_tokens=TOKENS, **PLAN))).load_state_dict(state)


def test_same_size_edit_of_a_jsonl_and_a_gz_stream_names_the_file(tmp_path):
    recs = records(80, seed=9)
    data = write_jsonl(tmp_path / "train.jsonl", recs)
    state = _state_after(DataLoader(data, **records_from_keywords(dict(global_batch_tokens=TOKENS, mode="indexed", **PLAN))))
    size = (tmp_path / "train.jsonl").stat().st_size
    write_jsonl(data, _same_counts(recs))
    assert (tmp_path / "train.jsonl").stat().st_size == size  # same size: only the content tells
    same_size = re.escape(f"{data} changed (size {size} -> {size} bytes, version sha256:")
    with pytest.raises(LoaderStateError, match=same_size):
        DataLoader(data, **records_from_keywords(dict(global_batch_tokens=TOKENS, mode="indexed", **PLAN))).load_state_dict(state)

    gz = tmp_path / "stream.jsonl.gz"
    gz.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in recs).encode(), mtime=0))
    state = _state_after(DataLoader(str(gz), **records_from_keywords(dict(global_batch_tokens=TOKENS, mode="streaming", **PLAN))))
    gz.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in _same_counts(recs)).encode(), mtime=0))
    with pytest.raises(LoaderStateError, match=rf"{gz} changed"):
        DataLoader(str(gz), **records_from_keywords(dict(global_batch_tokens=TOKENS, mode="streaming", **PLAN))).load_state_dict(state)
    # a loaders Source names the file too (not only a fingerprint)
    src = loaders.JsonlSource(str(gz))
    saved = src.state_dict()
    gz.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in recs).encode(), mtime=0))
    with pytest.raises(loaders.StateError, match=rf"different file list or dataset: {gz} changed"):
        loaders.JsonlSource(str(gz)).load_state_dict(saved)


def test_copied_or_touched_data_still_resumes(tmp_path):
    recs = records(60, seed=10)
    (tmp_path / "a").mkdir()
    data = write_parquet(tmp_path / "a" / "train.parquet", recs)
    state = _state_after(DataLoader(data, **records_from_keywords(dict(global_batch_tokens=TOKENS, **PLAN))), steps=1)
    copy = tmp_path / "b"
    copy.mkdir()
    (copy / "train.parquet").write_bytes((tmp_path / "a" / "train.parquet").read_bytes())  # a copy elsewhere
    DataLoader(str(copy / "train.parquet"), **records_from_keywords(dict(global_batch_tokens=TOKENS, **PLAN))).load_state_dict(state)
    assert loaders.file_fingerprints(loaders.open_source(data)) == \
        loaders.file_fingerprints(loaders.open_source(str(copy / "train.parquet")))


def test_s3_object_rewritten_with_the_same_token_counts_is_refused(s3, tmp_path):  # noqa: F811
    recs = records(60, seed=11)
    local = write_parquet(tmp_path / "part.parquet", recs, row_group_size=16)
    url = s3.upload("replaced/part.parquet", local)
    opts = {"storage_options": s3.opts}
    index = tmp_path / "index.parquet"
    build_index(url, path=index, source_options=opts)
    recorded = json.loads(pq.read_schema(index).metadata[b"dynabatch.data_files"])
    assert recorded[0][0] == "part.parquet" and recorded[0][2]  # the object's ETag
    state = _state_after(DataLoader(url, **records_from_keywords(dict(index=str(index), source_options=opts, global_batch_tokens=TOKENS, **PLAN))))

    write_parquet(local, _same_counts(recs), row_group_size=16)
    s3.upload("replaced/part.parquet", local)  # another ETag
    with pytest.raises(LengthIndexError, match=rf"{index} was made from other data than is read now: {url} changed"):
        DataLoader(url, **records_from_keywords(dict(index=str(index), source_options=opts, global_batch_tokens=TOKENS, **PLAN)))
    with pytest.raises(LoaderStateError, match=rf"the DataLoader state was made from other data than is read now: "
                                               rf"{url} changed"):
        DataLoader(url, **records_from_keywords(dict(source_options=opts, global_batch_tokens=TOKENS, **PLAN))).load_state_dict(state)
