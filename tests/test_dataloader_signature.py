"""The DataLoader's signature a user can read (issue 23 item 5): torch's arguments, ``options``
(`PlanOptions`) and four typed settings records, every field documented in ``help()``; the loose
keywords of earlier releases fail with the record they now belong to."""

from __future__ import annotations

import dataclasses
import inspect
import os
import pydoc
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_dataloader_data import records, write_parquet  # noqa: E402

from dynabatch import Costing, DataLoader, DataSource, PlanOptions, Runtime, Tokenization  # noqa: E402
from dynabatch.loader.settings import records_from_keywords  # noqa: E402

TORCH = ["batch_size", "shuffle", "sampler", "batch_sampler", "num_workers", "collate_fn", "pin_memory", "drop_last",
         "timeout", "worker_init_fn", "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers",
         "pin_memory_device", "in_order"]
#: Every loose keyword of the last release and the record it belongs to now (the migration table).
OLD = {
    **{k: "tokenization=Tokenization" for k in (
        "tokenizer", "family", "add_bos", "truncation_side", "format_config", "pretokenized", "decoder_start_token_id",
        "vision", "image_token_id", "load_pixels", "pixel_mean", "pixel_std")},
    **{k: "source=DataSource" for k in (
        "source_options", "split", "on_error", "mode", "index", "index_cache", "cache_tokens", "plan", "progress")},
    **{k: "costing=Costing" for k in ("cost_model", "device", "collate", "pad_to_multiple_of")},
    **{k: "runtime=Runtime" for k in (
        "rank", "world_size", "collective", "plan_ahead", "plan_processes", "buffer_tokens", "chunk_size")},
    **{k: "options=PlanOptions" for k in (
        "global_batch_tokens", "global_batch_size", "max_len", "max_target_len", "method", "method_options",
        "num_stages", "schedule", "memory_limit", "recompute", "device_memory_limit", "flush", "seed",
        "equal_microbatches", "max_caps", "batch_tokens")},
}


@pytest.fixture(scope="module")
def parquet(tmp_path_factory):
    return write_parquet(tmp_path_factory.mktemp("signature") / "train.parquet", records(40, seed=6))


def test_the_signature_names_every_argument_and_help_documents_every_field():
    params = inspect.signature(DataLoader.__init__).parameters
    assert list(params)[2:2 + len(TORCH)] == TORCH
    for name, kind in (("options", PlanOptions), ("tokenization", Tokenization), ("source", DataSource),
                       ("costing", Costing), ("runtime", Runtime)):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY and params[name].default is None
        text = pydoc.render_doc(kind, renderer=pydoc.plaintext)
        for field in dataclasses.fields(kind):
            assert field.name in text, f"help({kind.__name__}) does not mention {field.name}"
    doc = pydoc.render_doc(DataLoader, renderer=pydoc.plaintext)
    for name in TORCH + ["options", "tokenization", "source", "costing", "runtime", "feedback"]:
        assert name in doc
    # every field of every record documented in its docstring (not only listed by the dataclass)
    for kind in (Tokenization, DataSource, Costing, Runtime):
        for field in dataclasses.fields(kind):
            assert field.name in kind.__doc__, f"{kind.__name__}'s docstring does not document {field.name}"


@pytest.mark.parametrize("old,record", sorted(OLD.items()))
def test_an_old_loose_keyword_names_its_record(parquet, old, record):
    with pytest.raises(TypeError, match=rf"{old}= -> {record}\("):
        DataLoader(parquet, **{old: None})


def test_records_and_the_migration_helper_give_the_same_loader(parquet):
    new = DataLoader(parquet, options=PlanOptions(global_batch_tokens=1500, num_stages=2, seed=3, max_len=300),
                     tokenization=Tokenization(tokenizer="bytes"), source=DataSource(mode="indexed"),
                     costing=Costing(cost_model="gpt", device="cpu"), runtime=Runtime(rank=1, world_size=2))
    old = DataLoader(parquet, **records_from_keywords(dict(global_batch_tokens=1500, num_stages=2, seed=3, max_len=300,
                                                      tokenizer="bytes", mode="indexed", cost_model="gpt",
                                                      device="cpu", rank=1, world_size=2)))
    ids = [[b["sample_ids"].tolist() for b in step] for step in new]
    assert ids and ids == [[b["sample_ids"].tolist() for b in step] for step in old]


def test_a_record_of_the_wrong_kind_is_refused(parquet):
    with pytest.raises(TypeError, match=r"costing=\) takes a Costing\(\.\.\.\), got str; e.g. costing=Costing\("
                                        r"cost_model='gpt'\)"):
        DataLoader(parquet, 8, costing="gpt")
    with pytest.raises(TypeError, match="options= must be a PlanOptions"):
        DataLoader(parquet, options={"global_batch_tokens": 10})
    with pytest.raises(TypeError, match=r"drop_last=True but options.drop_last=False: give it in one place"):
        DataLoader(parquet, drop_last=True, options=PlanOptions(global_batch_tokens=1500))
    with pytest.raises(TypeError, match="batch_size= .* and options= both give the step size"):
        DataLoader(parquet, 8, options=PlanOptions(global_batch_tokens=1500))
