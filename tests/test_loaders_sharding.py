"""Exactly-once coverage over ranks x workers, unit splitting and dealing."""

from __future__ import annotations

import os

import pytest
from conftest_loaders import build_formats, records, slot_ids, write_jsonl, write_parquet, write_tar, wds_text_samples

import loaders
from loaders._sharding import UNBOUNDED, WorkUnit, cap_units, deal, split_ranges
from loaders._types import ShardInfo

FORMATS = ("jsonl", "parquet", "webdataset", "hf")


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    return build_formats(tmp_path_factory.mktemp("formats"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_exactly_once_all_layouts(formats, fmt):
    make, expected = formats[fmt]
    for shuffle, buffer in ((False, 0), (True, 8)):
        src = make(shuffle=shuffle, shuffle_buffer=buffer, seed=3)
        for world_size in range(1, 9):
            for num_workers in range(0, 5):
                per_slot = slot_ids(src, world_size, num_workers)
                got = [i for ids in per_slot for i in ids]
                assert sorted(got) == sorted(expected), (fmt, world_size, num_workers)


@pytest.mark.parametrize("fmt", FORMATS)
def test_epochs_reorder_but_cover(formats, fmt):
    make, expected = formats[fmt]
    src = make(shuffle=True, shuffle_buffer=4, seed=1)
    orders = []
    for epoch in range(3):
        src.set_epoch(epoch)
        ids = [x["sample_id"] for x in src]
        assert sorted(ids) == sorted(expected)
        orders.append(ids)
    assert orders[0] != orders[1] != orders[2]
    src.set_epoch(1)
    assert [x["sample_id"] for x in src] == orders[1]  # deterministic per (seed, epoch)


def _one_big_file(fmt, tmp_path, n=203):
    if fmt == "jsonl":
        return loaders.JsonlSource(write_jsonl(tmp_path / "big.jsonl", records(n)))
    if fmt == "jsonl.gz":
        return loaders.JsonlSource(write_jsonl(tmp_path / "big.jsonl.gz", records(n)))
    if fmt == "parquet":
        return loaders.ParquetSource(write_parquet(tmp_path / "big.parquet", records(n), row_group_size=64))
    if fmt == "webdataset":
        return loaders.WebDatasetSource(write_tar(tmp_path / "big.tar", wds_text_samples(n, "b")))
    if fmt == "webdataset.gz":
        return loaders.WebDatasetSource(write_tar(tmp_path / "big.tar.gz", wds_text_samples(n, "b")))
    import datasets

    return loaders.HFSource(datasets.Dataset.from_list(records(n)))


@pytest.mark.parametrize("fmt", [*FORMATS, "jsonl.gz", "webdataset.gz"])
def test_one_big_file_keeps_every_slot_busy(tmp_path, fmt):
    src = _one_big_file(fmt, tmp_path)
    per_slot = slot_ids(src.with_layout(), 8, 4)
    assert all(per_slot), [len(s) for s in per_slot]
    counts = [len(s) for s in per_slot]
    assert max(counts) - min(counts) <= max(counts) // 2 + 1  # balanced by rows
    got = sorted(i for ids in per_slot for i in ids)
    assert got == list(range(203))


def test_real_dataloader_two_workers(formats):
    from torch.utils.data import DataLoader

    make, expected = formats["jsonl"]
    src = make(shuffle=True, shuffle_buffer=8)
    loader = DataLoader(src, batch_size=None, num_workers=2)
    samples = list(loader)
    ids = [int(s["sample_id"]) for s in samples]
    assert sorted(ids) == sorted(expected)
    assert {s["source"] for s in samples} == {"jsonl"}


def test_explicit_rank_args_and_layout_defaults(formats):
    make, expected = formats["parquet"]
    src = make(rank=1, world_size=3)
    lay = src.layout()
    assert (lay.rank, lay.world_size, lay.worker_id, lay.num_workers) == (1, 3, 0, 0)
    assert make().layout().num_slots == 1
    with pytest.raises(ValueError, match="rank 3"):
        make(rank=3, world_size=3).layout()


def test_split_balances_rows_and_snaps_to_row_groups():
    shards = [ShardInfo(0, "a", num_rows=1000, boundaries=tuple(range(0, 1001, 100))),
              ShardInfo(1, "b", num_rows=10), ShardInfo(2, "c", num_rows=None, seekable=False)]
    ranges = [WorkUnit(0, 0, 1000), WorkUnit(1, 0, 10), WorkUnit(2, 0, UNBOUNDED)]
    units = split_ranges(ranges, shards, num_slots=4, units_per_slot=2)
    big = [u for u in units if u.shard == 0]
    assert all(u.start % 100 == 0 for u in big) and len(big) >= 7
    assert WorkUnit(2, 0, UNBOUNDED) in units
    slots = deal([u for u in units if u.rows], 4)
    loads = [sum(u.rows for u in s) for s in slots]
    assert max(loads) - min(loads) <= 200


def test_cap_units_cuts_exactly():
    units = [WorkUnit(0, 0, 10), WorkUnit(1, 5, 25), WorkUnit(0, 10, 12)]
    kept, total = cap_units(units, 15)
    assert total == 32 and kept == [WorkUnit(0, 0, 10), WorkUnit(1, 5, 10)]


def test_sample_ids_and_keys_follow_sorted_file_list(tmp_path):
    for name, n in (("b.jsonl", 2), ("a.jsonl", 3)):
        write_jsonl(tmp_path / name, records(n, name))
    src = loaders.JsonlSource([str(tmp_path / "b.jsonl"), str(tmp_path / "a.jsonl")])
    got = {x["key"]: x["sample_id"] for x in src}
    assert got == {"a.jsonl:1": 0, "a.jsonl:2": 1, "a.jsonl:3": 2, "b.jsonl:1": 1 << 32, "b.jsonl:2": (1 << 32) | 1}
    assert [s.name for s in src.shards] == ["a.jsonl", "b.jsonl"]
    assert os.path.isabs(src.shards[0].path)


def test_layout_defaults_from_torch_distributed(tmp_path, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 6)
    monkeypatch.setattr(dist, "get_rank", lambda: 4)
    lay = loaders.Layout.resolve()
    assert (lay.rank, lay.world_size, lay.num_workers) == (4, 6, 0)
    assert loaders.Layout.resolve(rank=1, world_size=2).rank == 1  # explicit wins


def test_cap_on_compressed_file_still_spreads_over_slots(tmp_path):
    src = loaders.JsonlSource(write_jsonl(tmp_path / "c.jsonl.gz", records(200)), shuffle=True,
                              max_samples_per_epoch=30)
    per_slot = slot_ids(src, 4, 0)
    assert all(per_slot) and sum(map(len, per_slot)) == 30
    src.set_epoch(1)
    assert sorted(i for ids in slot_ids(src, 4, 0) for i in ids) != sorted(i for ids in per_slot for i in ids)
