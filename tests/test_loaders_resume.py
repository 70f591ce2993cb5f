"""Exact resume (shuffle buffer included), mixtures, and resume on another world size."""

from __future__ import annotations

import json
import os
import random
from collections import Counter

import pyarrow as pa
import pytest
from conftest_loaders import build_formats, ensure_dir, records, write_jsonl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import loaders


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    out = build_formats(root)
    import datasets

    it_ds = datasets.Dataset.from_list(records(50, "it")).to_iterable_dataset(num_shards=3)
    shard_sizes = [sum(1 for _ in it_ds.shard(3, i)) for i in range(3)]
    it_ids = [(i << 32) | p for i, n in enumerate(shard_sizes) for p in range(n)]
    out["hf_iterable"] = (lambda **kw: loaders.HFIterableSource(it_ds, **kw), it_ids)
    adir = ensure_dir(os.path.join(root, "arrow"))
    for i, n in enumerate((20, 31)):
        table = pa.Table.from_pylist(records(n, f"a{i}"))
        path = os.path.join(adir, f"part-{i}.arrow")
        # One file in the random-access format, one in the stream format (as save_to_disk writes).
        opener = pa.ipc.new_file if i == 0 else pa.ipc.new_stream
        with pa.OSFile(path, "wb") as f, opener(f, table.schema) as w:
            for batch in table.to_batches(max_chunksize=6):
                w.write_batch(batch)
    out["arrow"] = (lambda **kw: loaders.ArrowSource(adir, **kw), [p for i, n in enumerate((20, 31)) for p in
                                                                    [(i << 32) | j for j in range(n)]])
    gz = write_jsonl(os.path.join(root, "one.jsonl.gz"), records(40, "gz"))
    out["jsonl.gz"] = (lambda **kw: loaders.JsonlSource(gz, **kw), list(range(40)))
    return out


ALL = ("jsonl", "jsonl.gz", "parquet", "arrow", "webdataset", "hf", "hf_iterable")
OPTS = dict(shuffle=True, shuffle_buffer=16, seed=7)


def _ids(samples):
    return [s["sample_id"] for s in samples]


def _take(it, k):
    return [next(it) for _ in range(k)]


def _resume_matches(make, layout, cut, json_roundtrip):
    full = _ids(make(**OPTS, **layout))
    src = make(**OPTS, **layout)
    it = iter(src)
    head = _ids(_take(it, cut))
    state = src.state_dict()
    if json_roundtrip:
        state = json.loads(json.dumps(state))
    again = make(**OPTS, **layout)
    again.load_state_dict(state)
    assert head + _ids(again) == full, cut
    return full


@pytest.mark.parametrize("fmt", ALL)
def test_resume_equals_uninterrupted(formats, fmt):
    make, expected = formats[fmt]
    rng = random.Random(fmt)
    for layout in ({}, dict(rank=1, world_size=2, worker_id=1, num_workers=2)):
        n = len(_ids(make(**OPTS, **layout)))
        cuts = {0, 1, 5, 15, 16, 17, n - 1, n} | {rng.randrange(n + 1) for _ in range(4)}
        for cut in sorted(c for c in cuts if 0 <= c <= n):
            _resume_matches(make, layout, cut, json_roundtrip=fmt != "hf_iterable")
    assert sorted(_ids(make(**OPTS))) == sorted(expected)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(0, 120), min_size=1, max_size=4), buffer=st.integers(0, 40))
def test_resume_chain_hypothesis(formats, cuts, buffer):
    make, _ = formats["parquet"]
    opts = dict(shuffle=True, shuffle_buffer=buffer, seed=11)
    full = _ids(make(**opts))
    out, state = [], None
    for cut in cuts:
        src = make(**opts)
        if state is not None:
            src.load_state_dict(state)
        it = iter(src)
        out += _ids(x for _, x in zip(range(cut), it))
        state = src.state_dict()
    src = make(**opts)
    src.load_state_dict(state)
    assert out + _ids(src) == full


def test_state_before_start_and_after_end(formats):
    make, _ = formats["jsonl"]
    src = make(**OPTS)
    fresh = src.state_dict()
    src2 = make(**OPTS)
    src2.load_state_dict(fresh)
    assert _ids(src2) == _ids(make(**OPTS))
    ended = src2.state_dict()
    assert ended["finished"]
    src3 = make(**OPTS)
    src3.load_state_dict(ended)
    assert _ids(src3) == []
    src3.set_epoch(1)  # next epoch starts fresh
    assert len(_ids(src3)) == len(_ids(make(**OPTS)))


def test_state_is_small_refs_not_samples(formats):
    make, _ = formats["parquet"]
    src = make(shuffle=True, shuffle_buffer=32)
    it = iter(src)
    _take(it, 40)
    state = src.state_dict()
    assert len(state["buffer"]) == 32 and state["buffer_samples"] is None
    assert len(json.dumps(state)) < 4000


def test_mismatched_state_raises(formats, tmp_path):
    make, _ = formats["jsonl"]
    src = make(**OPTS, rank=0, world_size=2)
    it = iter(src)
    _take(it, 3)
    state = src.state_dict()
    with pytest.raises(loaders.StateError, match="seed"):
        make(shuffle=True, shuffle_buffer=16, seed=8, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(loaders.StateError, match="different file list"):
        loaders.JsonlSource(write_jsonl(tmp_path / "other.jsonl", records(5)), **OPTS).load_state_dict(state)
    with pytest.raises(loaders.StateError, match="merge_states"):
        make(**OPTS, rank=0, world_size=4).load_state_dict(state)
    workers = make(**OPTS, rank=0, world_size=2, worker_id=0, num_workers=2)
    workers.load_state_dict(state)
    with pytest.raises(loaders.StateError, match="worker 0 of 0"):
        iter(workers)
    pq_make, _ = formats["parquet"]
    with pytest.raises(loaders.StateError, match="different file list"):
        pq_make(**OPTS, rank=0, world_size=2).load_state_dict(state)


def _run_partially(sources, rng):
    delivered, states = [], []
    for src in sources:
        it = iter(src)
        k = rng.randrange(0, 25)
        delivered += _ids(x for _, x in zip(range(k), it))
        states.append(src.state_dict())
    return delivered, states


@pytest.mark.parametrize("fmt", ("jsonl", "parquet", "webdataset", "hf", "hf_iterable"))
@pytest.mark.parametrize("old_workers", (0, 2))
def test_world_size_change_4_to_2(formats, fmt, old_workers):
    make, expected = formats[fmt]
    base = make(**OPTS)
    rng = random.Random(f"{fmt}{old_workers}")
    old = [base.with_layout(rank=r, world_size=4, worker_id=w, num_workers=old_workers)
           for r in range(4) for w in range(max(1, old_workers))]
    delivered, states = _run_partially(old, rng)
    merged = loaders.merge_states(states)
    if fmt != "hf_iterable":
        merged = json.loads(json.dumps(merged))
    rest = []
    for rank in range(2):
        new = make(**OPTS, rank=rank, world_size=2)
        new.load_state_dict(merged)
        rest += _ids(new)
    assert Counter(delivered + rest) == Counter(expected)
    with pytest.raises(loaders.StateError, match="missing slots"):
        loaders.merge_states(states[1:])


def _mixture(formats, **kw):
    jm, _ = formats["jsonl"]
    pm, _ = formats["parquet"]
    srcs = {"niv2": jm(shuffle=True, shuffle_buffer=8, seed=1), "cot": pm(shuffle=True, seed=2)}
    return loaders.Mixture(srcs, **{"weights": {"niv2": 3.0, "cot": 1.0}, "seed": 5, **kw})


def test_mixture_proportions_and_exactly_once(formats):
    mix = _mixture(formats)
    samples = list(mix)
    n_j, n_p = len(formats["jsonl"][1]), len(formats["parquet"][1])
    assert Counter(s["source"] for s in samples) == {"niv2": n_j, "cot": n_p}
    assert len({s["sample_id"] for s in samples}) == n_j + n_p  # ids unique across sources
    head = samples[:60]  # before either source runs out
    share = sum(s["source"] == "niv2" for s in head) / len(head)
    assert 0.6 <= share <= 0.9


def test_mixture_caps_exact_across_slots(formats, caplog):
    mix = _mixture(formats, caps={"cot": 50})
    got = Counter()
    with caplog.at_level("INFO", logger="loaders"):
        for rank in range(3):
            for w in range(2):
                got.update(s["source"] for s in mix.with_layout(rank=rank, world_size=3, worker_id=w, num_workers=2))
    assert got["cot"] == 50 and got["niv2"] == len(formats["jsonl"][1])
    assert mix.cap_report() == {"cot": {"kept": 50, "total": len(formats["parquet"][1])}}
    assert "capped at 50" in caplog.text


def test_mixture_resume(formats):
    layout = dict(rank=1, world_size=2, worker_id=0, num_workers=2)
    full = list(_mixture(formats, caps={"cot": 60}, **layout))
    for cut in sorted({0, 3, 9, 20, len(full) // 2, len(full) - 1, len(full)}):
        mix = _mixture(formats, caps={"cot": 60}, **layout)
        it = iter(mix)
        head = _take(it, cut)
        state = json.loads(json.dumps(mix.state_dict()))
        again = _mixture(formats, caps={"cot": 60}, **layout)
        again.load_state_dict(state)
        rest = list(again)
        assert _ids(head + rest) == _ids(full)
        assert [s["source"] for s in head + rest] == [s["source"] for s in full]


def test_mixture_world_size_change(formats):
    mix = _mixture(formats, caps={"cot": 70})
    rng = random.Random(0)
    delivered, states = _run_partially([mix.with_layout(rank=r, world_size=4) for r in range(4)], rng)
    merged = loaders.merge_states(states)
    rest = []
    for rank in range(2):
        m2 = _mixture(formats, caps={"cot": 70}, rank=rank, world_size=2)
        m2.load_state_dict(merged)
        rest += _ids(m2)
    all_ids = delivered + rest
    assert len(all_ids) == len(set(all_ids)) == 70 + len(formats["jsonl"][1])
    with pytest.raises(loaders.StateError, match="for sources"):
        loaders.Mixture({"x": formats["jsonl"][0]()}).load_state_dict(states[0])


def test_merged_state_in_dataloader_workers(formats):
    from torch.utils.data import DataLoader

    make, expected = formats["parquet"]
    old = [make(**OPTS).with_layout(rank=r, world_size=4) for r in range(4)]
    delivered, states = _run_partially(old, random.Random(1))
    merged = loaders.merge_states(states)
    for rank in range(2):
        new = make(**OPTS, rank=rank, world_size=2)
        new.load_state_dict(merged)  # copied into each worker, which deals itself its share
        delivered += [int(s["sample_id"]) for s in DataLoader(new, batch_size=None, num_workers=2)]
    assert Counter(delivered) == Counter(expected)
