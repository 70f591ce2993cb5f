"""The one representation of a step's ops (`dynabatch.core.schedule`): the registry, the op-table kernels
against their plain references, the table simulator against its reference, and the places that derive
an order (one: the warm-up rule is written in `dynabatch.core.kernels.op_tables` only)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch import PlanOptions
from dynabatch.core.kernels import op_codes as oc
from dynabatch.core.kernels.op_tables import (codes_table, codes_table_reference, multimodel_table,
                                              multimodel_table_reference, static_table, static_table_reference,
                                              table_codes, table_codes_reference)
from dynabatch.core.kernels.simulate import (inflight_table_kernel, inflight_table_reference, makespan_table_kernel,
                                             makespan_table_reference, simulate_table_kernel, simulate_table_reference)
from dynabatch.core.kernels.times import chunk_times, chunk_times_reference
from dynabatch.core.schedule import REGISTRY, SCHEDULE_NAMES, Op, StepOps, schedule_info, step_ops
from dynabatch.core.simulate.pipeline import simulate_pipeline
from dynabatch.pipeline.models.partition import LayerCosts, partition_makespan
from dynabatch.pipeline.runtime.schedule import plan_schedule

ROOT = Path(__file__).resolve().parents[1]
STATIC = [info.code for info in REGISTRY.values() if info.static]


def _rows(table):
    return [[tuple(r) for r in row] for row in np.asarray(table).tolist()]


def test_registry_names_every_schedule_once_and_unknown_names_raise():
    assert tuple(REGISTRY) == SCHEDULE_NAMES and len(set(SCHEDULE_NAMES)) == len(SCHEDULE_NAMES)
    assert len({i.code for i in REGISTRY.values()}) == len(REGISTRY)
    assert PlanOptions(schedule="1f1b").schedule == "1f1b"
    for call in (lambda: schedule_info("zb-v2"), lambda: step_ops("zb-v2", 2, 3),
                 lambda: simulate_pipeline(np.ones(2), np.ones(2), num_stages=2, schedule="zb-v2"),
                 lambda: PlanOptions(schedule="zb-v2"), lambda: plan_schedule("zb-v2"),
                 lambda: partition_makespan(LayerCosts(np.ones((3, 2)), np.ones((3, 2))), [0, 1, 3],
                                            schedule="zb-v2")):
        with pytest.raises(ValueError, match="zb-v2"):
            call()
    with pytest.raises(ValueError, match="concrete"):
        step_ops("auto", 2, 3)


@pytest.mark.parametrize("code", STATIC)
def test_static_tables_equal_their_references_and_never_deadlock(code):
    for S in range(1, 7):
        for M in range(1, 13):
            table = static_table(np.int64(code), S, M)
            assert _rows(table) == [list(r) for r in static_table_reference(code, S, M)], (code, S, M)
            v = table[:, :, oc.CHUNK].max() + 1
            f = np.ones((S * v, M)) / v
            span = makespan_table_kernel(f, 2 * f, oc.WEIGHT_SHARE, np.zeros(M), table)
            assert np.isfinite(span), (code, S, M)
            ops = StepOps("x", S, M, int(v), table)
            ops.check()  # every op of every chunk once, in dependency order


def test_multimodel_and_plain_code_tables_equal_their_references():
    for S, K, M, inter in ((1, 1, 1, True), (3, 2, 4, True), (3, 2, 4, False), (4, 3, 2, False)):
        assert _rows(multimodel_table(S, K, M, inter)) == multimodel_table_reference(S, K, M, inter)
    rng = np.random.default_rng(0)
    for _ in range(50):
        S, M = int(rng.integers(1, 5)), int(rng.integers(1, 6))
        codes = rng.integers(-M - 1, M + 2, (S, 2 * M)).astype(np.int32)  # int32, as the library passes them
        assert _rows(codes_table(codes, M)) == codes_table_reference(codes, M)
    plain = step_ops("1f1b", 3, 4)
    back, ok = table_codes(plain.kernel_table)  # the writable table the library hands kernels
    assert ok and back.tolist() == table_codes_reference(plain.table)
    assert np.array_equal(StepOps.from_codes(back).table, plain.table)


def _random_times(rng, Q, M):
    return rng.uniform(0.0, 2.0, (Q, M)), rng.uniform(0.0, 4.0, (Q, M)), rng.uniform(0.0, 0.5, M)


@settings(max_examples=60, deadline=None)
@given(code=st.sampled_from(STATIC), S=st.integers(1, 5), M=st.integers(1, 9), seed=st.integers(0, 10_000),
       shuffle=st.booleans())
def test_table_simulator_equals_its_reference(code, S, M, seed, shuffle):
    """Random times per virtual stage; the registered orders, or one rank's list shuffled (mostly a deadlock):
    start/end times, deadlocks, makespans and in-flight peaks agree with the plain sweep."""
    rng = np.random.default_rng(seed)
    table = static_table(np.int64(code), S, M).copy()
    v = int(table[:, :, oc.CHUNK].max()) + 1
    if shuffle:
        s = int(rng.integers(S))
        table[s] = table[s][rng.permutation(table.shape[1])]
    fwd, bwd, p2p = _random_times(rng, S * v, M)
    out = [np.empty((S * v, M, 2)), np.empty((S * v, M, 2)), np.empty((S * v, M)), np.empty((S * v, M))]
    status = simulate_table_kernel(fwd, bwd, oc.WEIGHT_SHARE, p2p, table, *out)
    ref = simulate_table_reference(fwd, bwd, oc.WEIGHT_SHARE, p2p, table.tolist())
    assert (status == 1) == ref[4]
    for got, want in zip(out, ref[:4]):
        assert np.array_equal(got, want)
    span = makespan_table_kernel(fwd, bwd, oc.WEIGHT_SHARE, p2p, table)
    want = makespan_table_reference(fwd, bwd, oc.WEIGHT_SHARE, p2p, table.tolist())
    assert span == want or (np.isnan(span) and np.isnan(want))
    mem = rng.uniform(1.0, 5.0, M)
    pn, pb = np.empty(S, np.int64), np.empty(S)
    if not shuffle:
        inflight_table_kernel(table, mem, v, pn, pb)
        rn, rb = inflight_table_reference(table.tolist(), mem, v)
        assert pn.tolist() == rn and np.allclose(pb, rb, rtol=0, atol=1e-12)
    assert np.array_equal(chunk_times(fwd[:S], v), chunk_times_reference(fwd[:S], v))


def test_bad_rows_are_refused_as_bad_input():
    table = step_ops("1f1b", 2, 2).table.copy()
    table[1, 0, oc.MICROBATCH] = 7
    out = [np.empty((2, 2, 2)), np.empty((2, 2, 2)), np.empty((2, 2)), np.empty((2, 2))]
    assert simulate_table_kernel(np.ones((2, 2)), np.ones((2, 2)), 0.5, np.zeros(2), table, *out) == 2
    with pytest.raises(ValueError, match="micro-batch 7|lists Op"):
        StepOps("x", 2, 2, 1, table).check()


def test_step_ops_view_names_each_op():
    ops = step_ops("1f1b", 2, 3)
    assert [op.name for op in ops.rank(0)] == ["F0", "F1", "B0", "F2", "B1", "B2"]
    assert [op.name for op in ops.rank(1)] == ["F0", "B0", "F1", "B1", "F2", "B2"]
    assert ops.rank(0)[0] == Op(oc.FORWARD, 0) and not ops.split and ops.num_chunks == 1
    assert ops.codes().tolist() == [[1, 2, -1, 3, -2, -3], [1, -1, 2, -2, 3, -3]]
    assert ops == StepOps.from_codes(ops.codes()) and ops.tobytes() == step_ops("1f1b", 2, 3).tobytes()


def test_the_1f1b_warm_up_rule_and_the_orders_are_written_once():
    """``min(S - s - 1, M)`` (any spelling) appears in the op-table kernels only (the kernel and, beside it,
    its plain reference); no other module builds a schedule's op list."""
    rule = re.compile(r"min\(\s*\w+\s*-\s*\w+\s*-\s*1\s*,")
    where = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "dynabatch").rglob("*.py") if rule.search(p.read_text()))
    assert where == ["dynabatch/core/kernels/op_tables.py"], where
    text = (ROOT / "dynabatch/core/kernels/op_tables.py").read_text()
    assert len(rule.findall(text)) == 2  # `warmup_forwards` and the reference's restatement
    assert not (ROOT / "dynabatch/core/schedule/schedules.py").exists()
    runtime = (ROOT / "dynabatch/pipeline/runtime/schedule.py").read_text()
    assert "def adaptive_orders" not in runtime and "adaptive_kernel" not in runtime
