"""In-memory data: a list of dicts (what HF users pass to ``datasets.Dataset.from_list``) opens as a
map-style source (random access, row count, resumable), reads like the same ``datasets.Dataset``
and ``IterableDataset``, feeds the dynabatch DataLoader's indexed mode, and anything else in a list
gets a clear error."""

from __future__ import annotations

import json
from collections import Counter

import datasets
import pytest
from conftest_loaders import records

import loaders
from dynabatch import Costing, PlanOptions

ROWS = records(29, "m")


def _inputs(src) -> list[str]:
    return [x["inputs"] for x in src]


def test_list_of_dicts_is_a_map_style_source_like_a_dataset():
    src = loaders.open_source(ROWS)
    assert isinstance(src, loaders.HFSource)
    assert src.num_rows == len(ROWS) and src.map_style and src.supports_random_access
    samples = list(src)
    assert [x["inputs"] for x in samples] == [r["inputs"] for r in ROWS]
    assert [x["sample_id"] for x in samples] == list(range(len(ROWS)))
    assert samples[4]["targets"] == "answer 4" and samples[4]["meta"] == {"idx": 4}
    assert src.read([7, 2, 7]) == [samples[7], samples[2], samples[7]]
    # the same rows as a datasets.Dataset and a datasets.IterableDataset read alike
    ds = datasets.Dataset.from_list(ROWS)
    assert list(loaders.open_source(ds)) == samples
    stream = loaders.open_source(ds.to_iterable_dataset(num_shards=3))
    assert isinstance(stream, loaders.HFIterableSource)
    assert sorted(_inputs(stream)) == sorted(r["inputs"] for r in ROWS)
    assert loaders.open_source(tuple(ROWS)).fingerprint() == src.fingerprint()


def test_records_with_different_keys_keep_every_field():
    rows = [{"text": "first"}, {"text": "second", "lang": "de"}, {"inputs": "q", "targets": "a"}]
    samples = list(loaders.open_source(rows))
    assert [(x["inputs"], x["targets"]) for x in samples] == [("first", ""), ("second", ""), ("q", "a")]
    assert samples[1]["meta"]["lang"] == "de"  # datasets.Dataset.from_list would keep only "text"


def test_list_of_records_resumes_and_refuses_other_records():
    src = loaders.open_source(ROWS, shuffle_buffer=6, seed=1)
    full = [x["sample_id"] for x in loaders.open_source(ROWS, shuffle_buffer=6, seed=1)]
    it = iter(src)
    head = [next(it)["sample_id"] for _ in range(11)]
    state = json.loads(json.dumps(src.state_dict()))
    again = loaders.open_source([dict(r) for r in ROWS], shuffle_buffer=6, seed=1)  # equal records, new objects
    again.load_state_dict(state)
    assert head + [x["sample_id"] for x in again] == full
    with pytest.raises(loaders.StateError, match="different file list or dataset"):
        loaders.open_source(records(29, "other"), shuffle_buffer=6, seed=1).load_state_dict(state)


@pytest.mark.parametrize("data, error, match", [
    ([1, 2, 3], TypeError, r"list holding 'int' items .*list of dicts"),
    ([{"text": "a"}, "b.jsonl"], TypeError, r"list holding 'dict' items .*list of dicts"),
    ([("text", "a")], TypeError, r"list holding 'tuple' items"),
    ([], ValueError, "empty list"),
    ({"text": ["a", "b"]}, TypeError, "cannot open 'dict' data"),
    (42, TypeError, "cannot open 'int' data"),
    ([{"text": "a", "n": 1}, {"text": "b", "n": "two"}], ValueError, r"cannot make a table of these 2 records"),
    ([{1: "a"}], TypeError, "record keys must be strings"),
], ids=["ints", "dicts-and-paths", "tuples", "empty", "dict-of-columns", "int", "mixed-types", "int-keys"])
def test_other_lists_get_a_clear_error(data, error, match):
    with pytest.raises(error, match=match):
        loaders.open_source(data)


def test_storage_options_do_not_apply_to_records():
    with pytest.raises(TypeError, match="storage_options= and cache_dir= apply to files and URLs"):
        loaders.open_source(ROWS, storage_options={"anon": True})


def _delivered(loader) -> list[int]:
    return [i for step in loader.steps() for mb in step for i in mb["sample_ids"].tolist()]


def test_dataloader_reads_a_list_of_dicts_in_the_indexed_mode():
    import dynabatch

    rows = [{"text": f"sample {i} " + "word " * (i % 7)} for i in range(37)]
    loader = dynabatch.DataLoader(rows, options=PlanOptions(global_batch_size=8), costing=Costing(device="cpu"))
    assert loader.mode == "indexed" and len(loader) == 5
    got = _delivered(loader)
    assert Counter(got) == Counter(range(37))


def test_dataloader_still_reads_datasets_objects():
    import dynabatch

    ds = datasets.Dataset.from_list([{"text": f"row {i}"} for i in range(21)])
    indexed = dynabatch.DataLoader(ds, options=PlanOptions(global_batch_size=8), costing=Costing(device="cpu"))
    streamed = dynabatch.DataLoader(ds.to_iterable_dataset(num_shards=2),
                                    options=PlanOptions(global_batch_tokens=4096), costing=Costing(device="cpu"))
    assert (indexed.mode, streamed.mode) == ("indexed", "streaming")
    assert Counter(_delivered(indexed)) == Counter(range(21))
    from_list = dynabatch.DataLoader([{"text": f"row {i}"} for i in range(21)],
                                     options=PlanOptions(global_batch_size=8), costing=Costing(device="cpu"))
    assert Counter(_delivered(from_list)) == Counter(range(21))
    assert sorted(_delivered(streamed)) == sorted(x["sample_id"] for x in loaders.open_source(ds.to_iterable_dataset(
        num_shards=2)))
