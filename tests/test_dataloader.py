"""dynabatch.DataLoader: indexed, streaming and replay modes on small generated data."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch

import loaders
import tokenization
from dynabatch import (CostModel, DataLoader, LoaderStateError, PlanMismatchError, Shapes, build_index,
                       plan_microbatches, split_global_batches)
from dynabatch.planfile import plans_to_arrow
from dynabatch.loader.collate import IGNORE_INDEX

from test_dataloader_data import (PLAN, assert_exactly_once, flat, ids_of, records, run_ranks, structure, uneven_jsonl,
                                  write_jsonl, write_parquet)
from dynabatch import Costing, DataSource, PlanOptions, Runtime
from dynabatch.loader.settings import records_from_keywords

TOKENS = 2000


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("dl")
    recs = records(260, seed=0)
    return {
        "dir": d,
        "parquet": write_parquet(d / "train.parquet", recs, row_group_size=24),
        "jsonl": write_jsonl(d / "train.jsonl", recs),
        "uneven": uneven_jsonl(str(d)),
        "n": len(recs),
        "index": str(d / "index.parquet"),
    }


def all_ids(path) -> list[int]:
    return [s["sample_id"] for s in loaders.open_source(path)]


def run_indexed(path, world, **kw):
    """Every rank's micro-batches of one epoch (ranks run one after another: no communication)."""
    return [list(DataLoader(path, **records_from_keywords(dict(world_size=world, rank=r, **kw))).microbatches()) for r in range(world)]


# -- indexed mode ---------------------------------------------------------------------------------

def test_indexed_four_ranks_with_workers_resume_on_two(data):
    kw = dict(global_batch_tokens=TOKENS, seed=5, index_cache=data["index"], **PLAN)
    first = [DataLoader(data["parquet"], **records_from_keywords(dict(world_size=4, rank=r, num_workers=2, **kw))) for r in range(4)]
    n_steps = len(first[0])
    assert n_steps >= 6 and all(len(dl) == n_steps for dl in first)
    stop = n_steps // 2
    delivered, states, seen = [], [], []
    for dl in first:
        got = []
        for b in dl.microbatches():
            got.append(b)
            if b["step"] == stop and b["microbatch"] == min(1, b["num_microbatches"] - 1):
                break  # checkpoint in the middle of a step
        states.append(json.loads(json.dumps(dl.state_dict())))  # states are JSON
        dl.close()
        seen.append(structure(got))
        delivered += ids_of(got)
    assert all(s == seen[0] for s in seen)  # same steps and micro-batch counts on every rank
    second = [DataLoader(data["parquet"], **records_from_keywords(dict(world_size=2, rank=r, num_workers=2, **kw))) for r in range(2)]
    rest = []
    for dl in second:
        dl.load_state_dict(states)  # the list of every rank's state: re-plans the rest for 2 ranks
        rest.append(list(dl.microbatches()))
    assert structure(rest[0]) == structure(rest[1])
    assert rest[0][0]["step"] == stop  # the half-done step is finished first, without its consumed samples
    delivered += ids_of(rest[0]) + ids_of(rest[1])
    assert_exactly_once(delivered, all_ids(data["parquet"]))
    assert first[0].epoch == 0 and second[0].epoch == 1  # a finished epoch advances


def test_indexed_exact_resume_on_same_world(data):
    kw = dict(global_batch_tokens=TOKENS, seed=2, index_cache=data["index"], **PLAN)
    whole = [[(b["step"], b["sample_ids"].tolist()) for b in rank] for rank in run_indexed(data["parquet"], 2, **kw)]
    for r in range(2):
        dl = DataLoader(data["parquet"], **records_from_keywords(dict(world_size=2, rank=r, **kw)))
        head = []
        for b in dl.microbatches():
            head.append((b["step"], b["sample_ids"].tolist()))
            if len(head) == 7:
                break
        state = dl.state_dict()
        again = DataLoader(data["parquet"], **records_from_keywords(dict(world_size=2, rank=r, **kw)))
        again.load_state_dict(state)
        assert head + [(b["step"], b["sample_ids"].tolist()) for b in again.microbatches()] == whole[r]


@pytest.mark.parametrize("method", ["dp", "pad", "dp_varlen"])
def test_indexed_same_structure_on_every_rank(data, method):
    ranks = run_indexed(data["parquet"], 3, global_batch_tokens=TOKENS, method=method, index_cache=data["index"], **PLAN)
    shapes = [structure(r) for r in ranks]
    assert shapes[0] == shapes[1] == shapes[2]
    steps = sorted({s for s, _, _ in shapes[0]})
    assert steps == list(range(len(steps))) == list(range(len(DataLoader(data["parquet"],
                                                                         **records_from_keywords(dict(world_size=3, rank=0,
                                                                                                 global_batch_tokens=TOKENS,
                                                                                                 method=method,
                                                                                                 index_cache=data["index"],
                                                                                                 **PLAN))))))
    for s, m, k in shapes[0]:
        assert 0 <= m < k
    assert_exactly_once([i for r in ranks for i in ids_of(r)], all_ids(data["parquet"]))


def test_indexed_placeholders_when_a_batch_has_fewer_samples_than_ranks(data):
    # 260 samples in global batches of 64: the last one has 4 samples for 5 ranks
    ranks = run_indexed(data["parquet"], 5, global_batch_size=64, index_cache=data["index"], **PLAN)
    assert all(structure(r) == structure(ranks[0]) for r in ranks)
    last = [[b for b in r if b["step"] == 4] for r in ranks]
    pads = [b for r in last for b in r if b["is_padding"]]
    assert pads and all(b["real_tokens"] == 0 and (b["labels"] == IGNORE_INDEX).all() for b in pads)
    assert sum(len(b["sample_ids"]) for r in last for b in r) == 4
    assert_exactly_once([i for r in ranks for i in ids_of(r)], all_ids(data["parquet"]))


@pytest.mark.parametrize("model", ["gpt", "t5"])
def test_padded_shapes_equal_the_plan(data, model):
    dl = DataLoader(data["parquet"],
                    options=PlanOptions(global_batch_tokens=TOKENS, num_stages=2, max_len=256, max_target_len=32),
                    costing=Costing(cost_model=model, device="cpu"), runtime=Runtime(world_size=2, rank=1))
    planner = dl.mode_object.planner
    batches = list(dl.microbatches())
    by_step: dict[int, list] = {}
    for b in batches:
        by_step.setdefault(b["step"], []).append(b)
    assert len(by_step) == len(dl)
    index = dl.index
    for k, pos in enumerate(planner.batches(0)):
        plan, _ = planner.plan_global(pos, k)
        mine = [mb for mb in plan.microbatches() if mb.rank == 1]
        got = [b for b in by_step[k] if not b["is_padding"]]
        assert len(got) == len(mine)
        for b, mb in zip(got, sorted(mine, key=lambda m: m.index)):
            assert b["sample_ids"].tolist() == mb.sample_ids.tolist()
            assert tuple(b["input_ids"].shape) == (mb.rows, mb.input_len)
            if model == "t5":
                assert tuple(b["labels"].shape) == (mb.rows, mb.target_len)
                real = int(b["attention_mask"].sum() + b["decoder_attention_mask"].sum())
            else:
                real = int(b["attention_mask"].sum())
                # decoder-only: the prompt of every prompt/response row is masked, the response trained
                at = index.positions(b["sample_ids"].numpy())
                for row, (n, t) in enumerate(zip(index.shapes.input_tokens[at], index.shapes.target_tokens[at])):
                    if t >= 2:  # (plain-text samples have 1 target token, the EOS, and train on all)
                        assert (b["labels"][row, :n] == IGNORE_INDEX).all()
                        assert (b["labels"][row, n:n + t] != IGNORE_INDEX).all()
            assert real == b["real_tokens"] == mb.real_tokens
            # the plan's predictions travel with the batch (the pipeline runner's adaptive schedule needs them)
            assert b["predicted_time_s"] == mb.time_s > 0
            assert b["predicted_memory_bytes"] == mb.memory_bytes > 0


def test_step_totals_cover_all_ranks(data):
    ranks = run_indexed(data["parquet"], 3, global_batch_tokens=TOKENS, index_cache=data["index"], **PLAN)
    check_step_totals(ranks)


def check_step_totals(ranks):
    steps: dict[int, dict] = {}
    for r in ranks:
        for b in r:
            s = steps.setdefault(b["step"], {"labels": 0, "real": 0, "samples": 0, "meta": set()})
            s["labels"] += int((b["labels"] != IGNORE_INDEX).sum())
            s["real"] += b["real_tokens"]
            s["samples"] += len(b["sample_ids"])
            s["meta"].add((b["step_target_tokens"], b["step_real_tokens"], b["step_samples"]))
    for step, s in steps.items():
        assert len(s["meta"]) == 1, step  # every micro-batch of every rank says the same
        target, real, samples = s["meta"].pop()
        assert (target, real, samples) == (s["labels"], s["real"], s["samples"]), step


def test_determinism_and_seed(data):
    kw = dict(world_size=2, rank=1, global_batch_tokens=TOKENS, index_cache=data["index"], **PLAN)
    a = list(DataLoader(data["parquet"], **records_from_keywords(dict(seed=11, **kw))).microbatches())
    b = list(DataLoader(data["parquet"], **records_from_keywords(dict(seed=11, **kw))).microbatches())
    c = list(DataLoader(data["parquet"], **records_from_keywords(dict(seed=12, **kw))).microbatches())
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] or k == "plan_time_s"
    assert ids_of(a) != ids_of(c)


@pytest.mark.parametrize("kw", [dict(global_batch_tokens=TOKENS), dict(global_batch_tokens=TOKENS, drop_last=True),
                                dict(global_batch_size=40), dict(global_batch_size=40, drop_last=True)])
def test_len_is_the_number_of_steps(data, kw):
    dl = DataLoader(data["parquet"], **records_from_keywords(dict(index_cache=data["index"], **kw, **PLAN)))
    steps = list(dl.steps())
    assert len(steps) == len(DataLoader(data["parquet"],
                                        **records_from_keywords(dict(index_cache=data["index"], **kw, **PLAN)))) > 0
    assert [s[0]["step"] for s in steps] == list(range(len(steps)))
    assert all(len(s) == s[0]["num_microbatches"] for s in steps)
    if "batch_size" in kw:
        sizes = [sum(len(b["sample_ids"]) for b in s) for s in steps]
        assert sizes[:-1] == [40] * (len(sizes) - 1)
    n = sum(len(b["sample_ids"]) for s in steps for b in s)
    assert n == data["n"] or (kw.get("drop_last") and n < data["n"])


def test_hf_dataset_jsonl_index_and_epochs(data, tmp_path):
    import datasets

    recs = records(90, seed=4)
    ds = datasets.Dataset.from_list(recs)
    dl = DataLoader(ds, **records_from_keywords(dict(global_batch_tokens=TOKENS, world_size=2, rank=0, **PLAN)))
    assert dl.mode == "indexed"
    other = DataLoader(ds, **records_from_keywords(dict(global_batch_tokens=TOKENS, world_size=2, rank=1, **PLAN)))
    e0 = ids_of(list(dl.microbatches())) + ids_of(list(other.microbatches()))
    assert_exactly_once(e0, range(90))
    e1 = ids_of(list(dl.microbatches())) + ids_of(list(other.microbatches()))  # the next epoch: another order, the same samples
    assert_exactly_once(e1, range(90)) and e0 != e1
    # JSONL read by line offsets, with a prebuilt index (exact label counts)
    path = write_jsonl(tmp_path / "x.jsonl", recs)
    table = build_index(path, path=tmp_path / "x_index.parquet")
    assert "label_tokens" in table.column_names
    ranks = run_indexed(path, 2, global_batch_tokens=TOKENS, index=str(tmp_path / "x_index.parquet"), **PLAN)
    check_step_totals(ranks)
    assert_exactly_once([i for r in ranks for i in ids_of(r)], all_ids(path))


def test_scan_shapes_index_works_and_warns_on_lm_labels(data, caplog):
    table = tokenization.scan_shapes(loaders.open_source(data["parquet"]), "bytes")
    dl = DataLoader(data["parquet"], **records_from_keywords(dict(index=table, global_batch_tokens=TOKENS, **PLAN)))
    assert not dl.index.exact_labels
    with caplog.at_level("WARNING", logger="dynabatch"):
        assert_exactly_once(ids_of(list(dl.microbatches())), all_ids(data["parquet"]))
    assert "label_tokens" in caplog.text  # plain-text samples make the derived counts inexact


# -- replay ---------------------------------------------------------------------------------------

def write_plan(path, data_path, world, epochs=2, method="dp", fingerprint=None, stages=2):
    table = tokenization.scan_shapes(loaders.open_source(data_path), "bytes")
    shapes = Shapes.from_arrow(table)
    cost = CostModel.preset("gpt", "cpu", num_stages=stages)
    plans, step = [], 0
    for epoch in range(epochs):
        for pos in split_global_batches(shapes, TOKENS, seed=100 + epoch):
            plans.append(plan_microbatches(shapes.take(pos), cost, num_stages=stages, num_ranks=world, method=method,
                                           step=step, equal_microbatches=False))
            step += 1
    meta = {"dynabatch.dataset_fingerprint": fingerprint or shapes.fingerprint(),
            "dynabatch.num_ranks": str(world), "dynabatch.num_stages": str(stages),
            "dynabatch.options": json.dumps({"method": method, "batch_tokens": TOKENS, "seed": 100}),
            "dynabatch.epochs": str(epochs), "dynabatch.seed": "100"}
    pq.write_table(plans_to_arrow(plans, metadata=meta), path)
    return plans


def test_replay_yields_exactly_the_planned_ids(data, tmp_path):
    plan_path = str(tmp_path / "plan.parquet")
    plans = write_plan(plan_path, data["parquet"], world=2, method="pad")
    got = {0: [], 1: []}
    for r in range(2):
        dl = DataLoader(data["parquet"],
                        **records_from_keywords(dict(plan=plan_path, world_size=2, rank=r, index_cache=data["index"],
                                                **PLAN)))
        assert dl.method == "pad" and dl.collation == "padded"
        for epoch in range(2):
            dl.set_epoch(epoch)
            got[r] += [(b["step"], b["microbatch"], b["sample_ids"].tolist(), b["predicted_memory_bytes"])
                       for b in dl.microbatches()]
    for r in range(2):
        want = []
        for p in plans:
            mbs = p.microbatches(r)
            K = int(p.microbatches_per_rank().max())
            want += [(p.step, i, mbs[i].sample_ids.tolist() if i < len(mbs) else [],
                      mbs[i].memory_bytes if i < len(mbs) else 0.0) for i in range(K)]
        assert got[r] == want


def test_replay_refuses_a_foreign_or_tampered_plan(data, tmp_path):
    plan_path = str(tmp_path / "plan.parquet")
    write_plan(plan_path, data["parquet"], world=2, epochs=1)
    kw = dict(index_cache=data["index"], **PLAN)
    with pytest.raises(PlanMismatchError, match=r"world size \(data-parallel ranks\) is 2 in the plan but 4 here"):
        DataLoader(data["parquet"], **records_from_keywords(dict(plan=plan_path, world_size=4, rank=0, **kw)))
    table = pq.read_table(plan_path)
    meta = dict(table.schema.metadata)
    meta[b"dynabatch.dataset_fingerprint"] = b"0123456789abcdef"
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "tampered.parquet")
    with pytest.raises(PlanMismatchError, match="metadata entry dynabatch.dataset_fingerprint does not match"):
        DataLoader(data["parquet"],  # edited after writing: its integrity record refuses it
                   **records_from_keywords(dict(plan=str(tmp_path / "tampered.parquet"), world_size=2, rank=0, **kw)))

    def written(meta, path):  # the plan a writer would have written for another dataset (a fresh record)
        from dynabatch.planfile import format as fmt

        meta = {k: v for k, v in meta.items() if k != fmt.INTEGRITY_KEY.encode()}
        meta.update({k.encode(): v.encode() for k, v in fmt.integrity_metadata(
            table.replace_schema_metadata(meta), 2).items()})
        pq.write_table(table.replace_schema_metadata(meta), path)

    written(meta, tmp_path / "tampered.parquet")
    with pytest.raises(PlanMismatchError, match="dataset fingerprint is 0123456789abcdef in the plan.*another dataset"):
        DataLoader(data["parquet"],
                   **records_from_keywords(dict(plan=str(tmp_path / "tampered.parquet"), world_size=2, rank=0, **kw)))
    del meta[b"dynabatch.dataset_fingerprint"]
    written(meta, tmp_path / "nofp.parquet")
    with pytest.raises(PlanMismatchError, match="records no dynabatch.dataset_fingerprint"):
        DataLoader(data["parquet"], **records_from_keywords(dict(plan=str(tmp_path / "nofp.parquet"), world_size=2, rank=0, **kw)))
    with pytest.raises(PlanMismatchError, match="pipeline stages are 2 in the plan but 4 here"):
        DataLoader(data["parquet"], options=PlanOptions(num_stages=4),
                   source=DataSource(plan=plan_path, index_cache=data["index"]),
                   costing=Costing(cost_model="gpt", device="cpu"), runtime=Runtime(rank=0, world_size=2))
    with pytest.raises(PlanMismatchError, match=f"option 'global_batch_tokens' is {TOKENS} in the plan but "
                                                f"{2 * TOKENS} here"):
        DataLoader(data["parquet"],
                   **records_from_keywords(dict(plan=plan_path, world_size=2, rank=0, global_batch_tokens=2 * TOKENS, **kw)))
    # an edited plan: a row duplicated places its sample twice in one epoch
    import pyarrow as pa

    rows = list(range(table.num_rows))
    edited = table.take(pa.array(rows[:5] + [4] + rows[5:]))
    step, rank, mb, sid = (table.column(c)[4].as_py() for c in ("step", "rank", "microbatch", "sample_id"))
    with pytest.raises(PlanMismatchError, match=f"sample id {sid} appears 2 times in epoch 0 "
                                                rf"\(step {step} rank {rank} micro-batch {mb} and step {step}"):
        DataLoader(data["parquet"], **records_from_keywords(dict(plan=edited, world_size=2, rank=0, **kw)))  # a pyarrow.Table works as well as a path
    with pytest.raises(PlanMismatchError, match=f"step {step} rank {rank} holds"):
        DataLoader(data["parquet"],
                   **records_from_keywords(dict(plan=table.take(pa.array(rows[:4] + rows[5:])), world_size=2, rank=0, **kw)))
    # other data: the fingerprint of its index differs
    other = write_parquet(tmp_path / "other.parquet", records(50, seed=9))
    with pytest.raises(PlanMismatchError, match="another dataset"):
        DataLoader(other, **records_from_keywords(dict(plan=plan_path, world_size=2, rank=0, **PLAN)))


# -- streaming mode -------------------------------------------------------------------------------

def streaming(path, world, rank, coll, **kw):
    src = loaders.JsonlSource(path, shuffle=True, shuffle_buffer=8, seed=3)
    opts = dict(global_batch_tokens=TOKENS, chunk_size=16, **PLAN)
    opts.update(kw)
    return DataLoader(src, **records_from_keywords(dict(world_size=world, rank=rank, collective=coll, **opts)))


def test_streaming_four_ranks_with_workers_resume_on_two(data):
    def phase1(r, coll):
        dl = streaming(data["uneven"], 4, r, coll, num_workers=2, chunk_size=4)
        assert dl.mode == "streaming"
        got = []
        for b in dl.microbatches():
            got.append(b)
            # late in a step: its consumed samples include some read while planning that step
            if b["step"] == 3 and b["microbatch"] == max(b["num_microbatches"] - 2, 0):
                break
        state = json.loads(json.dumps(dl.state_dict()))
        dl.close()
        return got, state

    first = run_ranks(4, phase1)
    assert all(structure(g) == structure(first[0][0]) for g, _ in first)
    states = [s for _, s in first]
    assert max(len(json.dumps(s)) for s in states) < 20_000  # positions and ids, not samples

    def phase2(r, coll):
        dl = streaming(data["uneven"], 2, r, coll, num_workers=1, chunk_size=4)
        dl.load_state_dict(states)
        return list(dl.microbatches())

    second = run_ranks(2, phase2)
    assert structure(second[0]) == structure(second[1])
    delivered = [i for g, _ in first for i in ids_of(g)] + [i for g in second for i in ids_of(g)]
    assert_exactly_once(delivered, all_ids(data["uneven"]))


def test_streaming_uneven_ranks_same_structure_and_totals(data):
    out = run_ranks(3, lambda r, coll: list(streaming(data["uneven"], 3, r, coll).microbatches()))
    assert structure(out[0]) == structure(out[1]) == structure(out[2])
    assert any(b["is_padding"] for r in out for b in r)  # a rank ran dry and padded
    for r in out:
        for b in r:
            if b["is_padding"]:
                assert b["real_tokens"] == 0 and (b["labels"] == IGNORE_INDEX).all()
    check_step_totals(out)
    assert_exactly_once([i for r in out for i in ids_of(r)], all_ids(data["uneven"]))


def test_streaming_deterministic_and_exact_resume_same_layout(data):
    def whole(r, coll):
        return [(b["step"], b["microbatch"], b["sample_ids"].tolist()) for b in flat(streaming(data["uneven"], 2, r, coll))]

    def cut(r, coll):
        dl = streaming(data["uneven"], 2, r, coll)
        head = []
        for b in dl.microbatches():
            head.append((b["step"], b["microbatch"], b["sample_ids"].tolist()))
            if b["step"] == 2 and b["microbatch"] == 0:
                break
        return head, dl.state_dict()

    a = run_ranks(2, whole)
    assert run_ranks(2, whole) == a  # deterministic: same seed and data, same batches
    b = run_ranks(2, cut)

    def rest(r, coll):
        dl = streaming(data["uneven"], 2, r, coll)
        dl.load_state_dict(b[r][1])
        return [(x["step"], x["microbatch"], x["sample_ids"].tolist()) for x in dl.microbatches()]

    c = run_ranks(2, rest)
    for r in range(2):
        assert b[r][0] + c[r] == a[r]


def test_streaming_single_rank_packed_and_samples_mode(data):
    dl = DataLoader(data["jsonl"], **records_from_keywords(dict(global_batch_size=32, collate="packed", **PLAN)))
    assert dl.mode == "streaming" and dl.method == "dp_varlen"
    with pytest.raises(TypeError):
        len(dl)
    steps = list(dl.steps())
    sizes = [sum(len(b["sample_ids"]) for b in s) for s in steps]
    assert sizes[:-1] == [32] * (len(sizes) - 1)
    for s in steps:
        for b in s:
            cu = b["cu_seqlens"]
            assert cu[-1] == b["input_ids"].shape[1] == b["real_tokens"]
            assert b["max_seqlen"] == int((cu[1:] - cu[:-1]).max())
    assert_exactly_once([i for s in steps for i in ids_of(s)], all_ids(data["jsonl"]))


# -- misc -----------------------------------------------------------------------------------------

def test_vision_tiles_and_pixels(tmp_path):
    import datasets
    from PIL import Image
    import io

    def png(w, h):
        buf = io.BytesIO()
        Image.new("RGB", (w, h), (200, 10, 10)).save(buf, "PNG")
        return buf.getvalue()

    sizes = [(448, 448), (896, 448), (1344, 448), (300, 900)]
    rows = [{"inputs": f"describe {i}", "targets": "a box", "image": {"bytes": png(*sizes[i % 4]), "path": None}}
            for i in range(12)]
    tiling = tokenization.DynamicTiling(tile_size=28, patch_size=14, tokens_per_tile=16)
    dl = DataLoader(datasets.Dataset.from_list(rows),
                    **records_from_keywords(dict(global_batch_tokens=400, vision=tiling, load_pixels=True, **PLAN)))
    want = {i: int(tiling.num_tiles(*sizes[i % 4])) for i in range(12)}
    seen = 0
    for b in dl.microbatches():
        tiles = b["image_tiles"].tolist()
        assert tiles == [want[i] for i in b["sample_ids"].tolist()]
        assert b["pixel_values"].shape == (sum(tiles), 3, 28, 28)
        seen += len(tiles)
    assert seen == 12


def test_argument_errors(data):
    with pytest.raises(ValueError, match=r"give the global batch size: options=PlanOptions\(global_batch_tokens="):
        DataLoader(data["parquet"], **records_from_keywords(dict(**PLAN)))
    # a method other than PlanOptions' default must agree with the collation (the default follows it)
    with pytest.raises(ValueError, match="method 'pack' plans 'packed_rows' micro-batches, but collate='packed'"):
        DataLoader(data["parquet"],
                   **records_from_keywords(dict(global_batch_tokens=TOKENS, method="pack", collate="packed", **PLAN)))
    with pytest.raises(ValueError, match="torch.distributed"):
        DataLoader(data["jsonl"], **records_from_keywords(dict(global_batch_tokens=TOKENS, world_size=2, rank=0, **PLAN)))
    dl = DataLoader(data["parquet"],
                    **records_from_keywords(dict(global_batch_tokens=TOKENS, world_size=2, rank=0,
                                            index_cache=data["index"], **PLAN)))
    it = iter(dl)
    next(it)
    next(it)
    mid = dl.state_dict()
    other = DataLoader(data["parquet"],
                       **records_from_keywords(dict(global_batch_tokens=TOKENS, world_size=3, rank=0,
                                               index_cache=data["index"], **PLAN)))
    if mid["indexed"]["microbatch"]:
        with pytest.raises(LoaderStateError, match="list of every rank"):
            other.load_state_dict(mid)
    seeded = DataLoader(data["parquet"],
                        **records_from_keywords(dict(global_batch_tokens=TOKENS, world_size=2, rank=0, seed=1,
                                                index_cache=data["index"], **PLAN)))
    with pytest.raises(LoaderStateError, match="seed"):
        seeded.load_state_dict(mid)


def test_plan_files_of_dynabatch_plan_replay_and_match_online_plans(data, tmp_path):
    """Interop with the offline commands: a `dynabatch scan` index and a `dynabatch plan` file."""
    runplan = pytest.importorskip("dynabatch.offline.runplan")
    scan = pytest.importorskip("dynabatch.offline.scan")
    from dynabatch import PlanOptions
    from dynabatch.offline.inputs import read_index

    scanned = scan.scan_dataset([data["parquet"]], scan.ScanConfig(), workers=1, progress=False)
    scanned.write(tmp_path / "index.parquet")
    built = build_index(data["parquet"])  # the loader's own index: same shapes, same fingerprint
    assert built.schema.metadata[b"dynabatch.dataset_fingerprint"] == \
        scanned.table.schema.metadata[b"dynabatch.dataset_fingerprint"]
    cost = CostModel.preset("gpt", "cpu", num_stages=2)
    cfg = runplan.RunPlanConfig(PlanOptions(num_ranks=2, num_stages=2, global_batch_tokens=TOKENS, seed=4, max_len=256,
                                            drop_last=True), epochs=2)
    run = runplan.plan_run(read_index([str(tmp_path / "index.parquet")]), cost, cfg, workers=1, progress=False)
    run.write(tmp_path / "plan.parquet")
    for index in (str(tmp_path / "index.parquet"), None):  # with the scan's index, and scanning itself
        dl = DataLoader(data["parquet"], source=DataSource(plan=str(tmp_path / "plan.parquet"), index=index),
                        costing=Costing(cost_model="gpt", device="cpu"), runtime=Runtime(world_size=2, rank=1))
        assert dl.max_len == 256 and dl.num_stages == 2
        got = []
        for epoch in range(2):
            dl.set_epoch(epoch)
            got += [b["sample_ids"].tolist() for b in dl.microbatches() if not b["is_padding"]]
        assert got == [mb.sample_ids.tolist() for k in range(run.num_steps) for mb in run.step(k).microbatches(1)]
        dl.set_epoch(0)
        for k, step in enumerate(dl.steps()):  # each replayed step carries the file's plan of that step
            assert step.plan.fingerprint() == run.step(k).fingerprint()
            assert sorted(step.shapes.sample_id.tolist()) == sorted(step.plan.sample_ids.tolist())
            assert [b["sample_ids"].tolist() for b in step if not b["is_padding"]] == \
                [mb.sample_ids.tolist() for mb in step.plan.microbatches(1)]
    # the online indexed mode plans exactly what `dynabatch plan` planned for the same settings
    online = DataLoader(data["parquet"],
                        **records_from_keywords(dict(world_size=2, rank=1, global_batch_tokens=TOKENS, seed=4,
                                                drop_last=True, max_len=256, **PLAN)))
    got = [b["sample_ids"].tolist() for b in online.microbatches() if not b["is_padding"]]
    steps0 = run.steps_per_epoch[0]
    assert got == [mb.sample_ids.tolist() for k in range(steps0) for mb in run.step(k).microbatches(1)]


def test_streaming_ranks_stopping_together_never_leave_a_planner_waiting(data):
    """Planners run ahead by steps taken, not by timing: when every rank stops after the same step,
    every planner has entered the same collectives, so closing never waits for a missing peer."""
    import time

    def stop_early(r, coll):
        durations = []
        for _ in range(2):
            dl = streaming(data["uneven"], 3, r, coll, plan_ahead=4, global_batch_tokens=1000)
            for b in dl.microbatches():
                if r:
                    time.sleep(0.01)  # rank 0 stops at once, the others are slower
                if b["step"] == 1 and b["microbatch"] == 0:
                    break
            t0 = time.perf_counter()
            dl.close()
            durations.append(time.perf_counter() - t0)
        return durations

    closes = run_ranks(3, stop_early, timeout=30)
    assert max(max(d) for d in closes) < 5.0, closes
