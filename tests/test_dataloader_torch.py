"""`dynabatch.DataLoader` as a torch user counts on it: iterating yields what ``len()`` counts
(optimizer steps), torch's signature (positional dataset and batch size, shuffle, worker
arguments) maps onto dynabatch's meaning or is refused with a message saying what to use, and
bad arguments fail early with one clear line."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dynabatch import DataLoader, Step

from test_dataloader_data import PLAN, assert_exactly_once, records, write_jsonl, write_parquet
from dynabatch import Costing, DataSource, PlanOptions, Runtime
from dynabatch.loader.settings import records_from_keywords


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("torch_args")
    recs = records(400, seed=5)
    return {"parquet": write_parquet(d / "t.parquet", recs, row_group_size=50), "jsonl": write_jsonl(d / "t.jsonl", recs),
            "index": str(d / "index.parquet"), "n": len(recs)}


def _ids(step) -> list[int]:
    return [i for mb in step for i in mb["sample_ids"].tolist() if not mb["is_padding"]]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("batch", [dict(global_batch_tokens=3000), dict(global_batch_size=24)])
def test_iterating_yields_len_steps_on_every_rank(data, world, batch):
    per_rank = []
    for r in range(world):
        dl = DataLoader(data["parquet"],
                        **records_from_keywords(dict(index_cache=data["index"], world_size=world, rank=r, **batch, **PLAN)))
        steps = list(dl)
        assert len(steps) == len(dl) > 1
        assert all(isinstance(s, Step) and len(s) >= 1 and isinstance(s[0], dict) for s in steps)
        assert [s.step for s in steps] == list(range(len(dl)))
        # micro-batch iteration is explicit, and holds the same micro-batches (of the same epoch)
        dl.set_epoch(0)
        mbs = list(dl.microbatches())
        assert len(mbs) == sum(len(s) for s in steps) > len(dl)
        assert [mb["sample_ids"].tolist() for mb in mbs] == [mb["sample_ids"].tolist() for s in steps for mb in s]
        per_rank.append(steps)
    assert len({len(s) for s in per_rank}) == 1
    assert_exactly_once([i for steps in per_rank for s in steps for i in _ids(s)], range(data["n"]))


def test_torch_positional_signature_batch_size_is_per_rank(data):
    # torch: DataLoader(dataset, batch_size, shuffle); the planning options beside them in options=
    dl = DataLoader(data["parquet"], 8, **records_from_keywords(dict(index_cache=data["index"], **PLAN)))
    assert dl.global_batch_size == 8
    assert len(dl) == int(np.ceil(data["n"] / 8)) == len(list(dl))
    two = [DataLoader(data["parquet"], 8, False, options=PlanOptions(num_stages=2, shuffle=False),
                      source=DataSource(index_cache=data["index"]), costing=Costing(cost_model="gpt", device="cpu"),
                      runtime=Runtime(world_size=2, rank=r))
           for r in range(2)]
    assert two[0].global_batch_size == 16  # 8 samples per rank per step, as torch's batch_size
    steps = [list(dl) for dl in two]
    assert len(steps[0]) == len(steps[1]) == int(np.ceil(data["n"] / 16))
    sizes = [len(_ids(a)) + len(_ids(b)) for a, b in zip(*steps)]
    assert sizes[:-1] == [16] * (len(sizes) - 1)
    with pytest.raises(TypeError, match="multiple values for argument 'batch_size'"):
        DataLoader(data["parquet"], 8, batch_size=8)
    with pytest.raises(TypeError, match="give one"):
        DataLoader(data["parquet"], 8, options=PlanOptions(global_batch_tokens=1000))


def test_shuffle_false_forms_steps_in_sample_order(data):
    kw = dict(index_cache=data["index"], global_batch_size=10, **PLAN)
    ordered = [sorted(_ids(s)) for s in DataLoader(data["parquet"], **records_from_keywords(dict(shuffle=False, **kw)))]
    assert ordered == [list(range(k, min(k + 10, data["n"]))) for k in range(0, data["n"], 10)]
    shuffled = [sorted(_ids(s)) for s in DataLoader(data["parquet"], **records_from_keywords(dict(shuffle=True, **kw)))]
    assert shuffled != ordered
    assert shuffled == [sorted(_ids(s)) for s in DataLoader(data["parquet"], **records_from_keywords(dict(**kw)))]  # True is the default
    with pytest.raises(ValueError, match="shuffle=True needs the indexed mode"):
        DataLoader(data["jsonl"], 10, shuffle=True, source=DataSource(mode="streaming"))


@pytest.mark.parametrize("name,value,hint", [
    ("sampler", object(), "shuffle=/PlanOptions(seed=)"),
    ("batch_sampler", object(), "batch_size="),
    ("collate_fn", lambda b: b, "collate='padded'"),
    ("generator", object(), "seed="),
])
def test_torch_arguments_dynabatch_does_itself_are_refused_with_what_to_use(data, name, value, hint):
    with pytest.raises(TypeError, match=f"does not take {name}=") as e:
        DataLoader(data["parquet"], **records_from_keywords(dict(global_batch_size=8, **{name: value})))
    assert hint in str(e.value)


def test_in_order_false_and_pin_memory_device_are_refused(data):
    with pytest.raises(ValueError, match="in_order=False"):
        DataLoader(data["parquet"], in_order=False, options=PlanOptions(global_batch_size=8))
    with pytest.raises(ValueError, match="pin_memory_device"):
        DataLoader(data["parquet"], pin_memory_device="cuda:1", options=PlanOptions(global_batch_size=8))


def _mark_worker(worker_id):  # module level: picklable for any start method
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    with open(os.path.join(os.environ["DYNABATCH_TEST_MARKS"], f"w{worker_id}"), "w") as f:
        f.write(str(info.num_workers))


def test_worker_init_fn_and_persistent_workers_reach_the_workers(data, tmp_path, monkeypatch):
    monkeypatch.setenv("DYNABATCH_TEST_MARKS", str(tmp_path))
    dl = DataLoader(data["parquet"],
                    **records_from_keywords(dict(index_cache=data["index"], global_batch_size=40, num_workers=2,
                                            worker_init_fn=_mark_worker, persistent_workers=True, **PLAN)))
    first = [_ids(s) for s in dl]
    assert sorted(os.listdir(tmp_path)) == ["w0", "w1"]
    assert first == [_ids(s) for s in DataLoader(data["parquet"],
                                                 **records_from_keywords(dict(index_cache=data["index"],
                                                                         global_batch_size=40, **PLAN)))]


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(global_batch_tokens=0), ValueError, "global_batch_tokens must be a positive integer \\(tokens\\), got 0"),
    (dict(global_batch_size=1.5), ValueError, "global_batch_size must be a positive integer \\(samples\\)"),
    (dict(batch_size=0), ValueError, "batch_size must be a positive number of samples per rank"),
    (dict(global_batch_tokens="4096"), ValueError, "global_batch_tokens must be a positive integer"),
    (dict(global_batch_size=8, max_len=-1), ValueError, "max_len must be a positive integer"),
    (dict(global_batch_size=8, seed="x"), TypeError, "seed must be an integer"),
    (dict(global_batch_size=8, shuffle="yes"), TypeError, "shuffle must be True or False"),
    (dict(global_batch_size=8, num_workers=1.5), ValueError, "num_workers must be an integer >= 0"),
    (dict(global_batch_size=8, plan_ahead=-1), ValueError, "plan_ahead must be an integer >= 0"),
    (dict(global_batch_size=8, num_workers=1, prefetch_factor=0), ValueError, "prefetch_factor must be a positive"),
    (dict(global_batch_size=8, chunk_size=0), ValueError, "chunk_size must be a positive integer"),
    (dict(global_batch_size=8, pad_to_multiple_of=0), ValueError, "pad_to_multiple_of must be a positive integer"),
    (dict(global_batch_size=8, timeout=-1), ValueError, "timeout must be a number of seconds"),
    (dict(global_batch_size=8, world_size=0), ValueError, "world_size must be a positive integer"),
    (dict(global_batch_size=8, world_size=2, rank=2), ValueError, "rank=2 is not a rank of world_size=2"),
    (dict(global_batch_size=8, collate="padding"), ValueError, "collation must be one of"),
    (dict(global_batch_size=8, bacth_size=3), TypeError, "unexpected keyword argument\\(s\\) \\['bacth_size'\\]"),
    (dict(), ValueError, "give the global batch size"),
])
def test_bad_arguments_fail_at_construction_with_a_clear_message(data, kwargs, error, message):
    with pytest.raises(error, match=message):
        DataLoader(data["parquet"], **records_from_keywords(dict(index_cache=data["index"], **kwargs)))


def test_too_many_positional_arguments(data):
    with pytest.raises(TypeError, match="positional arguments but 15 were given"):  # self, data, torch's 12
        DataLoader(data["parquet"], *([None] * 13))
