"""The DataLoader facade: one PlanOptions, deprecated names, nested mode states, Step objects, the
feedback hook, and dynabatch using only public `loaders` names."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

from dynabatch import CostModel, DataLoader, PlanOptions
from dynabatch.loader.modes import IndexedMode, StreamingMode
from dynabatch.loader.step import Step

from test_dataloader_data import PLAN, ids_of, records, write_jsonl, write_parquet
from dynabatch.loader.settings import records_from_keywords

TOKENS = 2000


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("facade")
    recs = records(120, seed=3)
    return {"parquet": write_parquet(d / "t.parquet", recs, row_group_size=24), "jsonl": write_jsonl(d / "t.jsonl", recs),
            "index": str(d / "index.parquet")}


def _same(a, b):
    return [ids_of([x]) for x in a] == [ids_of([x]) for x in b]


@pytest.mark.parametrize("old,new,value", [("batch_tokens", "global_batch_tokens", TOKENS),
                                           ("tokens_per_batch", "global_batch_tokens", TOKENS)])
def test_deprecated_keyword_warns_and_gives_the_same_batches(data, old, new, value):
    kw = dict(index_cache=data["index"], **PLAN)
    with pytest.warns(DeprecationWarning, match=f"{old}= is deprecated, use {new}="):
        before = list(DataLoader(data["parquet"], **records_from_keywords(dict(**{old: value}, **kw))))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        after = list(DataLoader(data["parquet"], **records_from_keywords(dict(**{new: value}, **kw))))
    assert before and _same(before, after)
    with pytest.raises(TypeError, match="deprecated name"):
        DataLoader(data["parquet"], **records_from_keywords(dict(**{old: value, new: value}, **kw)))


def test_options_record_equals_the_keywords(data):
    kw = dict(index_cache=data["index"], cost_model="gpt", device="cpu")
    opts = PlanOptions(global_batch_tokens=TOKENS, num_stages=2, seed=3, max_len=300)
    a = DataLoader(data["parquet"], **records_from_keywords(dict(options=opts, **kw)))
    b = DataLoader(data["parquet"],
                   **records_from_keywords(dict(global_batch_tokens=TOKENS, num_stages=2, seed=3, max_len=300, **kw)))
    assert a.options == b.options and a.options.num_ranks == 1
    assert _same(list(a), list(b))
    with pytest.raises(TypeError, match=r"in options= only, not also \['seed'\]"):
        DataLoader(data["parquet"], **records_from_keywords(dict(options=opts, seed=4, **kw)))
    with pytest.raises(TypeError, match="unexpected keyword"):
        DataLoader(data["parquet"], **records_from_keywords(dict(global_batch_tokens=TOKENS, num_stagez=2, **kw)))


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_state_nests_the_mode_state_and_a_mode_alone_round_trips(data, fmt):
    kw = dict(global_batch_tokens=TOKENS, **PLAN)
    if fmt == "parquet":
        kw["index_cache"] = data["index"]
    dl = DataLoader(data[fmt], **records_from_keywords(dict(**kw)))
    name = dl.mode
    assert name == ("indexed" if fmt == "parquet" else "streaming")
    it = iter(dl)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(dl.state_dict()))
    assert set(state) == {"format", "version", "mode", name, "integrity"} and state["mode"] == name
    inner = state[name]
    assert {"identity", "layout", "epoch", "step", "microbatch", "consumed"} <= set(inner)
    if name == "streaming":
        assert {"slots", "rr", "exhausted"} <= set(inner["feed"]) and "ids" in inner["buffer"]
    mode = dl.mode_object
    assert isinstance(mode, IndexedMode if name == "indexed" else StreamingMode)
    assert mode.state_dict() == inner
    dl.close()

    # a mode object alone: whole steps, each consumed once yielded; its state round-trips
    full = DataLoader(data[fmt], **records_from_keywords(dict(**kw))).mode_object
    want = [ids_of(r.batches) for r in full]
    m1 = DataLoader(data[fmt], **records_from_keywords(dict(**kw))).mode_object
    it1 = iter(m1)
    head = [ids_of(next(it1).batches) for _ in range(2)]
    ms = json.loads(json.dumps(m1.state_dict()))
    m1.close()
    m2 = DataLoader(data[fmt], **records_from_keywords(dict(**kw))).mode_object
    m2.load_state_dict(ms)
    assert m2.state_dict() == ms
    assert head + [ids_of(r.batches) for r in m2] == want


def test_steps_yield_step_objects_with_the_plan(data):
    dl = DataLoader(data["parquet"],
                    **records_from_keywords(dict(global_batch_tokens=TOKENS, index_cache=data["index"], world_size=2,
                                            rank=1, **PLAN)))
    steps = list(dl.steps())
    assert steps and all(isinstance(s, Step) and isinstance(s, list) for s in steps)
    for k, s in enumerate(steps):
        assert s.step == k and s.rank == 1 and s.epoch == 0 and s.cost_version == 0
        assert s.plan.num_ranks <= 2 and s.plan.step == k
        assert sorted(s.shapes.sample_id.tolist()) == sorted(s.plan.sample_ids.tolist())
        assert s.target_tokens == s[0]["step_target_tokens"]
        mine = set(s.plan.sample_ids[s.plan.mb_rank[__import__("numpy").repeat(
            range(s.plan.num_microbatches), __import__("numpy").diff(s.plan.mb_offsets))] == 1].tolist()) \
            if s.plan.num_ranks == 2 else None
        if mine is not None:
            assert set(ids_of(list(s))) == mine
    stream = next(iter(DataLoader(data["jsonl"], **records_from_keywords(dict(global_batch_tokens=TOKENS, **PLAN))).steps()))
    assert stream.plan is not None and len(stream.shapes) == len(stream.plan.sample_ids)


class _Loop:
    def __init__(self, cost):
        self.cost_model, self.calls = cost, []

    def record_step(self, step, result):
        self.calls.append(("record", step.step, result))

    def maybe_refit(self):
        self.calls.append(("refit",))
        return "row"


def test_feedback_hook_and_its_errors(data):
    cost = CostModel.preset("gpt", "cpu", num_stages=2)
    kw = dict(global_batch_tokens=TOKENS, index_cache=data["index"], cost_model=cost, device="cpu", num_stages=2)
    plain = DataLoader(data["parquet"], **records_from_keywords(dict(**kw)))
    with pytest.raises(RuntimeError, match="no FeedbackLoop"):
        plain.feedback({})
    with pytest.raises(ValueError, match="cost model object"):
        DataLoader(data["parquet"],
                   **records_from_keywords(dict(feedback=_Loop(CostModel.preset("gpt", "cpu", num_stages=2)), **kw)))
    loop = _Loop(cost)
    dl = DataLoader(data["parquet"], **records_from_keywords(dict(feedback=loop, plan_ahead=0, **kw)))
    with pytest.raises(RuntimeError, match="after DataLoader.steps"):
        dl.feedback({})
    it = dl.steps()
    next(it)
    second = next(it)
    assert dl.feedback("measured") == "row"
    assert loop.calls == [("record", second.step, "measured"), ("refit",)]
    dl.close()


def test_dynabatch_uses_only_public_loaders_names():
    root = Path(__file__).resolve().parent.parent / "dynabatch"
    bad = re.compile(r"\._reader\b|\._children\b|\._pending\b|\._offsets\b|from loaders\._|loaders\._\w")
    hits = [f"{p.relative_to(root)}:{i}: {line.strip()}" for p in root.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert not hits, "\n".join(hits)
