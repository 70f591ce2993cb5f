"""BatchPlan: Arrow round trip, schema version, columns, MicroBatch views, validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynabatch import Shapes
from dynabatch.core.batchplan import MB_FIELDS, BatchPlan
from dynabatch.planfile import PLAN_SCHEMA_VERSION, plan_from_arrow, plan_to_arrow, plans_to_arrow
from dynabatch.planfile.arrow import steps_in
from dynabatch.core.cost.model import CostModel
from dynabatch.core.plan.planner import METHODS, plan_microbatches

VERSION_KEY = b"dynabatch.plan_schema_version"
ARRAYS = ("sample_ids", "sample_row", "mb_offsets", "rank_time_s") + tuple(MB_FIELDS)


def make_plan(method="dp", preset="t5", ranks=3, stages=4, step=7, seed=0, n=50):
    rng = np.random.default_rng(seed)
    inp = np.clip(rng.lognormal(5.0, 1.0, n), 1, 3000).astype(np.int32)
    tgt = np.clip(rng.lognormal(3.5, 1.0, n), 1, 600).astype(np.int32)
    vis = rng.integers(0, 3, n) * 256 if preset == "vlm" else None
    sh = Shapes.from_lengths(inp, tgt, vis, sample_id=rng.permutation(n).astype(np.int64) * 3 + 10**12)
    kw = {"max_len": 4096, "max_target_len": 1024} if method in ("pack", "pack_varlen") else {}
    return plan_microbatches(sh, CostModel.preset(preset), num_stages=stages, num_ranks=ranks, method=method,
                             step=step, **kw)


def assert_same_plan(a: BatchPlan, b: BatchPlan):
    for name in ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(x, y, err_msg=name)
    for name in ("method", "collation", "num_ranks", "num_stages", "schedule", "step", "options"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.fingerprint() == b.fingerprint()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("preset", ["t5", "vlm"])
def test_arrow_round_trip_reproduces_every_array(method, preset):
    plan = make_plan(method, preset)
    assert plan.num_microbatches > 1
    table = plan_to_arrow(plan)
    assert table.num_rows == len(plan.sample_ids)
    back = plan_from_arrow(table)
    assert_same_plan(plan, back)
    assert back.iteration_time_s == plan.iteration_time_s
    # and rebuilt from plain Python values with the same metadata
    assert_same_plan(plan, plan_from_arrow(pa.table(table.to_pydict()).replace_schema_metadata(
        table.schema.metadata)))


def test_parquet_round_trip(tmp_path):
    plan = make_plan("dp_varlen", ranks=2, step=0)
    pq.write_table(plan_to_arrow(plan), tmp_path / "plan.parquet")
    assert_same_plan(plan, plan_from_arrow(pq.read_table(tmp_path / "plan.parquet")))


def test_columns_and_metadata():
    plan = make_plan("dp", ranks=3, step=7)
    t = plan_to_arrow(plan)
    for name, typ in (("step", pa.int64()), ("rank", pa.int32()), ("microbatch", pa.int32()),
                      ("row", pa.int32()), ("sample_id", pa.int64())):
        assert name in t.column_names
        assert t.schema.field(name).type == typ, name
    for name in MB_FIELDS:
        if name not in ("mb_rank", "mb_order"):
            assert name[3:] in t.column_names
    assert set(t.column("step").to_pylist()) == {7}
    np.testing.assert_array_equal(t.column("sample_id").to_numpy(), plan.sample_ids)
    # each row's rank/microbatch are those of the micro-batch holding that sample
    sizes = np.diff(plan.mb_offsets)
    np.testing.assert_array_equal(t.column("rank").to_numpy(), np.repeat(plan.mb_rank, sizes))
    np.testing.assert_array_equal(t.column("microbatch").to_numpy(), np.repeat(plan.mb_order, sizes))
    meta = t.schema.metadata
    assert meta[VERSION_KEY] == str(PLAN_SCHEMA_VERSION).encode()
    assert meta[b"dynabatch.method"] == b"dp" and meta[b"dynabatch.num_ranks"] == b"3"


def test_table_without_schema_version_is_refused():
    t = plan_to_arrow(make_plan())
    meta = {k: v for k, v in t.schema.metadata.items() if k != VERSION_KEY}
    with pytest.raises(ValueError, match="plan_schema_version"):
        plan_from_arrow(t.replace_schema_metadata(meta))
    with pytest.raises(ValueError, match="plan_schema_version"):
        plan_from_arrow(t.replace_schema_metadata(None))


@pytest.mark.parametrize("version", [str(PLAN_SCHEMA_VERSION + 1), "0"])
def test_table_with_wrong_schema_version_is_refused(version):
    t = plan_to_arrow(make_plan())
    meta = {**t.schema.metadata, VERSION_KEY: version.encode()}
    with pytest.raises(ValueError, match=rf"version {version}\b.*not supported"):
        plan_from_arrow(t.replace_schema_metadata(meta))


@pytest.mark.parametrize("version", [b"v1", b"1.0", b"", b" 1"])
def test_table_with_garbled_schema_version_is_refused_clearly(version):
    t = plan_to_arrow(make_plan())
    meta = {**t.schema.metadata, VERSION_KEY: version}
    with pytest.raises(ValueError, match="schema version"):
        plan_from_arrow(t.replace_schema_metadata(meta))


def test_multi_step_table_needs_a_step():
    a, b = make_plan(step=0), make_plan(step=1, seed=1)
    t = pa.concat_tables([plan_to_arrow(a), plan_to_arrow(b).replace_schema_metadata(plan_to_arrow(a).schema.metadata)])
    with pytest.raises(ValueError, match="steps"):
        plan_from_arrow(t)
    with pytest.raises(ValueError, match="step 5"):
        plan_from_arrow(t, step=5)
    assert_same_plan(a, plan_from_arrow(t, step=0))
    back = plan_from_arrow(t, step=1)
    for name in ("sample_ids", "sample_row", "mb_offsets") + tuple(MB_FIELDS):
        np.testing.assert_array_equal(getattr(back, name), getattr(b, name), err_msg=name)


def test_plans_to_arrow_keeps_every_steps_plan():
    plans = [make_plan(step=k, seed=k) for k in (0, 1, 5)]
    t = plans_to_arrow(plans, metadata={"dynabatch.dataset": "abc"})
    assert t.schema.metadata[b"dynabatch.dataset"] == b"abc"
    np.testing.assert_array_equal(steps_in(t), [0, 1, 5])
    for p in plans:
        back = plan_from_arrow(t, step=p.step)
        assert_same_plan(p, back)
        np.testing.assert_array_equal(back.rank_time_s, p.rank_time_s)
    with pytest.raises(ValueError, match="steps"):
        plan_from_arrow(t)
    with pytest.raises(ValueError, match="same step"):
        plans_to_arrow([plans[0], make_plan(step=0, seed=3)])
    with pytest.raises(ValueError, match="method"):
        plans_to_arrow([plans[0], make_plan("kk", step=9)])
    with pytest.raises(ValueError):
        plans_to_arrow([])


def test_microbatch_views_match_arrays():
    plan = make_plan("pack", ranks=2)
    mbs = plan.microbatches()
    assert len(mbs) == plan.num_microbatches
    for k, mb in enumerate(mbs):
        a, b = plan.mb_offsets[k], plan.mb_offsets[k + 1]
        np.testing.assert_array_equal(mb.sample_ids, plan.sample_ids[a:b])
        assert (mb.rank, mb.index, mb.rows, mb.time_s) == (plan.mb_rank[k], plan.mb_order[k], plan.mb_rows[k],
                                                         plan.mb_time_s[k])
        assert mb.step == plan.step
    for r in range(plan.num_ranks):
        own = plan.microbatches(r)
        assert [m.index for m in own] == list(range(plan.microbatches_per_rank()[r]))
        assert all(m.rank == r for m in own)
    assert plan.padding_efficiency <= 1.0


def test_fingerprint_sees_placement_changes():
    plan = make_plan()
    ids = plan.sample_ids.copy()
    ids[[0, -1]] = ids[[-1, 0]]
    assert dataclasses.replace(plan, sample_ids=ids).fingerprint() != plan.fingerprint()
    assert dataclasses.replace(plan, step=plan.step + 1).fingerprint() != plan.fingerprint()
    assert dataclasses.replace(plan).fingerprint() == plan.fingerprint()


def test_constructor_validates():
    plan = make_plan()
    with pytest.raises(ValueError, match="collation"):
        dataclasses.replace(plan, collation="zigzag")
    with pytest.raises(ValueError, match="mb_offsets"):
        dataclasses.replace(plan, mb_offsets=plan.mb_offsets + 1)
    bad = plan.mb_offsets.copy()
    bad[1] = bad[0]
    with pytest.raises(ValueError, match="mb_offsets"):
        dataclasses.replace(plan, mb_offsets=bad)
    with pytest.raises(ValueError, match="mb_time_s"):
        dataclasses.replace(plan, mb_time_s=plan.mb_time_s[:-1])
    with pytest.raises(ValueError, match="rank_time_s"):
        dataclasses.replace(plan, rank_time_s=np.zeros(plan.num_ranks + 1))


def _older_release(table: pa.Table) -> pa.Table:
    """``table`` as an older release wrote it: no target_tokens column, its integrity record made without it."""
    from dynabatch.planfile import format as fmt

    meta = {k.decode(): v.decode() for k, v in table.schema.metadata.items() if k.decode() != fmt.INTEGRITY_KEY}
    old = table.drop_columns(["target_tokens"]).replace_schema_metadata(meta)
    return old.replace_schema_metadata({**meta, **fmt.integrity_metadata(old, int(meta[fmt.NUM_RANKS_KEY]))})


def test_plan_file_of_an_older_release_without_target_tokens(tmp_path):
    """A plan without decoder tokens (decoder-only: target_len 0) reads exactly, 0 decoder tokens per
    micro-batch; an encoder-decoder plan, whose decoder totals the file does not hold, is refused naming the
    file, the column and the fix."""
    from dynabatch import PlanMismatchError, load_run_plan

    gpt = make_plan("dp_varlen", preset="gpt", step=0)
    assert gpt.num_microbatches > 1 and not gpt.mb_target_tokens.any()
    pq.write_table(_older_release(plans_to_arrow([gpt])), tmp_path / "gpt.parquet")
    assert_same_plan(gpt, load_run_plan(tmp_path / "gpt.parquet").step(0))
    t5 = make_plan("dp_varlen", preset="t5", step=0)
    assert (t5.mb_target_tokens > 0).all()
    pq.write_table(_older_release(plans_to_arrow([t5])), tmp_path / "t5.parquet")
    with pytest.raises(PlanMismatchError, match=r"t5\.parquet: step 0 .* no target_tokens column .*`dynabatch plan`"):
        load_run_plan(tmp_path / "t5.parquet").step(0)
