"""Public random access of `loaders`: Source.read / open_access, fingerprints, Mixture accessors,
putting samples back into a global state."""

from __future__ import annotations

import loaders
from conftest_loaders import records, write_jsonl, write_parquet


def test_read_by_sample_id_equals_iteration(tmp_path):
    for src in (loaders.open_source(write_jsonl(tmp_path / "a.jsonl", records(40))),
                loaders.open_source(write_parquet(tmp_path / "a.parquet", records(40), row_group_size=7))):
        seen = list(src)
        ids = [s["sample_id"] for s in seen][::-3]
        assert src.read(ids) == [s for s in seen if s["sample_id"] in set(ids)][::-1]
        assert loaders.open_access(src, generic=True).read(ids) == src.read(ids)
        assert src.supports_random_access and isinstance(src.fingerprint(), str)
    assert src.map_style and not loaders.open_source(str(tmp_path / "a.jsonl")).map_style


def test_mixture_accessors_and_requeue(tmp_path):
    a = loaders.open_source(write_jsonl(tmp_path / "a.jsonl", records(10, prefix="a")))
    b = loaders.open_source(write_jsonl(tmp_path / "b.jsonl", records(6, prefix="b")))
    mix = loaders.Mixture({"a": a, "b": b}, seed=1)
    assert mix.shard_ranges == {"a": (0, 1), "b": (1, 2)} and mix.num_shards == 2
    assert set(mix.fingerprint()) == {"a", "b"} and mix.supports_random_access
    every = list(mix)
    some = [s["sample_id"] for s in every[::4]]
    assert [s["inputs"] for s in mix.read(some)] == [s["inputs"] for s in every[::4]]
    # consume half, merge, put a few back: the rest + the requeued ids, each exactly once
    head = loaders.Mixture({"a": a, "b": b}, seed=1)
    it = iter(head)
    taken = [next(it)["sample_id"] for _ in range(8)]
    g = loaders.requeue_samples(loaders.merge_states([head.state_dict()]), taken[:3], mix.shard_ranges)
    rest = loaders.Mixture({"a": a, "b": b}, seed=1)
    rest.load_state_dict(g)
    got = [s["sample_id"] for s in rest]
    assert sorted(got + taken[3:]) == sorted(s["sample_id"] for s in every)


def test_fresh_copy_drops_loaded_state(tmp_path):
    src = loaders.open_source(write_jsonl(tmp_path / "c.jsonl", records(12)), shuffle=True, seed=3)
    it = iter(src)
    next(it)
    src.load_state_dict(src.state_dict())
    ordered = src.fresh(shuffle=False)
    assert [s["sample_id"] for s in ordered] == sorted(s["sample_id"] for s in ordered.fresh())


def test_fresh_keeps_what_it_is_not_given_and_none_lifts_a_cap(tmp_path):
    src = loaders.open_source(write_jsonl(tmp_path / "d.jsonl", records(12)), max_samples_per_epoch=5, seed=3)
    assert len(list(src.fresh())) == 5 and src.fresh().seed == 3
    assert len(list(src.fresh(max_samples_per_epoch=None))) == 12
