"""dynabatch.DataLoader token cache, planning processes and packed worker steps: the batches are
exactly those of the uncached, threaded, in-process path."""

from __future__ import annotations

import pytest
import torch

import dynabatch.loader.modes.indexed.steps as indexed
from dynabatch import DataLoader, build_index
from dynabatch.loader.modes.indexed.steps import TOKEN_COLUMNS
from dynabatch.loader.records import PackedBatches

from test_dataloader_data import records, write_parquet
from dynabatch import DataSource, PlanOptions
from dynabatch.loader.settings import records_from_keywords


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_parquet(tmp_path_factory.mktemp("cache") / "train.parquet", records(220, seed=4), row_group_size=40)


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], torch.Tensor):
                assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k
            elif k != "plan_time_s":
                assert x[k] == y[k], k


CASES = [
    dict(cost_model="gpt", method="dp"),
    dict(cost_model="gpt", method="dp_varlen", max_len=40),
    dict(cost_model="gpt", method="pack", max_len=256),
    dict(cost_model="t5", method="dp", max_len=40, max_target_len=10),
    dict(cost_model="t5", method="dp_varlen"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['cost_model']}-{c['method']}-{c.get('max_len')}")
def test_cached_and_uncached_batches_are_identical(path, case):
    kw = dict(global_batch_tokens=1500, world_size=2, rank=1, seed=3, **case)
    ref = DataLoader(path, **records_from_keywords(dict(cache_tokens=False, plan_processes=0, **kw)))
    assert ref.token_cache is None
    want = list(ref.microbatches())
    cached = DataLoader(path, **records_from_keywords(dict(cache_tokens=True, **kw)))  # its own scan keeps the ids
    assert cached.token_cache is not None
    assert_same(want, list(cached.microbatches()))
    family = "encoder_decoder" if case["cost_model"] == "t5" else "decoder"
    lens = dict(family=family, max_len=case.get("max_len"), max_target_len=case.get("max_target_len"))
    table = build_index(path, cache_tokens=True, **lens)
    assert all(c in table.column_names for c in TOKEN_COLUMNS)
    assert_same(want, list(DataLoader(path, **records_from_keywords(dict(index=table, **kw))).microbatches()))
    plain = build_index(path, **lens)  # no ids in the index: the loader tokenizes once when built
    assert not any(c in plain.column_names for c in TOKEN_COLUMNS)
    dl = DataLoader(path, **records_from_keywords(dict(index=plain, **kw)))
    assert dl.token_cache is not None
    assert_same(want, list(dl.microbatches()))


def test_index_token_columns_are_used_without_tokenizing(path, monkeypatch, tmp_path):
    table = build_index(path, cache_tokens=True, path=tmp_path / "idx.parquet")

    def boom(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr("dynabatch.loader.modes.indexed.mode.encode_to_file", boom)
    for index in (table, tmp_path / "idx.parquet"):
        dl = DataLoader(path, options=PlanOptions(global_batch_tokens=1500), source=DataSource(index=index))
        assert dl.token_cache is not None and len(list(dl.microbatches())) > 0
    # other tokenization settings: the cached ids do not apply, so they are made again
    with pytest.raises(AssertionError, match="tokenized again"):
        DataLoader(path, options=PlanOptions(global_batch_tokens=1500, max_len=30), source=DataSource(index=table))


def test_index_cache_keeps_the_ids(path, tmp_path, monkeypatch):
    cache = tmp_path / "index.parquet"
    first = list(DataLoader(path, options=PlanOptions(global_batch_tokens=1500), source=DataSource(index_cache=cache)).microbatches())
    monkeypatch.setattr("dynabatch.loader.modes.indexed.mode.encode_to_file", lambda *a, **k: (_ for _ in ()).throw(AssertionError()))
    dl = DataLoader(path, options=PlanOptions(global_batch_tokens=1500), source=DataSource(index_cache=cache))
    assert dl.token_cache is not None
    assert_same(first, list(dl.microbatches()))


def test_disk_space_turns_the_default_off(path, monkeypatch):
    """The token cache is a file: before a tokenization pass that would not fit on the disk, the
    default (cache_tokens=None) goes without it; cache_tokens=True keeps it."""
    import collections

    plain = build_index(path)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr("dynabatch.loader.modes.indexed.mode.shutil.disk_usage", lambda p: usage(100, 100, 100))
    opts = PlanOptions(global_batch_tokens=1500)
    assert DataLoader(path, options=opts, source=DataSource(index=plain)).token_cache is None
    assert DataLoader(path, options=opts, source=DataSource(index=plain, cache_tokens=True)).token_cache is not None


def test_planning_processes_workers_and_threads_agree(path):
    kw = dict(global_batch_tokens=1200, method="dp", seed=1)
    ref = list(DataLoader(path, **records_from_keywords(dict(plan_processes=0, cache_tokens=False, **kw))).microbatches())
    assert_same(ref, list(DataLoader(path, **records_from_keywords(dict(plan_processes=2, **kw))).microbatches()))
    assert_same(ref, list(DataLoader(path, **records_from_keywords(dict(plan_processes=1, plan_ahead=1, **kw))).microbatches()))
    assert_same(ref, list(DataLoader(path, **records_from_keywords(dict(num_workers=2, **kw))).microbatches()))
    steps = list(DataLoader(path, **records_from_keywords(dict(num_workers=2, **kw))).steps())
    assert sum(len(s) for s in steps) == len(ref)
    with pytest.raises(ValueError, match="plan_processes"):
        DataLoader(path, **records_from_keywords(dict(plan_processes=-1, **kw)))


def test_resume_with_planning_processes(path):
    kw = dict(global_batch_tokens=1200, seed=2, plan_processes=2)
    full = list(DataLoader(path, **records_from_keywords(dict(**kw))).microbatches())
    dl = DataLoader(path, **records_from_keywords(dict(**kw)))
    it = dl.microbatches()
    head = [next(it) for _ in range(5)]
    state = dl.state_dict()
    dl.close()
    again = DataLoader(path, **records_from_keywords(dict(**kw)))
    again.load_state_dict(state)
    assert_same(full, head + list(again.microbatches()))


def test_packed_batches_round_trip():
    batches = [{"input_ids": torch.arange(12).reshape(3, 4), "cu_seqlens": torch.tensor([0, 3, 7], dtype=torch.int32),
                "empty": torch.zeros((0, 5), dtype=torch.int64), "step": 3, "is_padding": False},
               {"labels": torch.full((1, 3), -100), "pixel_values": torch.rand(2, 3, 2, 2)}]
    for shared in (True, False):
        out = PackedBatches.pack(batches, shared).unpack()
        assert_same(batches, out)


def test_index_file_with_a_removed_row_is_refused(path, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dynabatch.index import LengthIndexError

    good = tmp_path / "idx.parquet"
    build_index(path, cache_tokens=True, path=good)
    table = pq.read_table(good)
    gone = table.column("sample_id")[7].as_py()
    bad = tmp_path / "edited.parquet"
    pq.write_table(pa.concat_tables([table.slice(0, 7), table.slice(8)]), bad)
    with pytest.raises(LengthIndexError, match=rf"edited.parquet: sample_id {gone} was removed"):
        DataLoader(path, options=PlanOptions(global_batch_tokens=1500), source=DataSource(index=bad))
    # the loader's own index cache fails its integrity record instead: it is made again (logged), whole
    DataLoader(path, options=PlanOptions(global_batch_tokens=1500), source=DataSource(index_cache=bad))
    assert gone in pq.read_table(bad).column("sample_id").to_pylist()
