"""Schedules in the simulator, the planner, the plan file and the runner: the memory-aware adaptive
order (one definition, `dynabatch.core.schedule.build`), and ``schedule="auto"`` choosing per step."""

import dataclasses
import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch import CostModel, PlanOptions, Shapes, plan_microbatches
from dynabatch.core.cost.model import device_preset
from dynabatch.core.kernels.schedules import (
    OK,
    adaptive_kernel,
    adaptive_reference,
    order_ranks_schedule,
    order_ranks_schedule_reference,
    order_ranks_stages,
    order_ranks_stages_reference,
    stage_candidates,
    stage_candidates_reference,
)
from dynabatch.core.options import SCHEDULES
from dynabatch.core.schedule.registry import AUTO_PREFERENCE
from dynabatch.core.schedule.build import adaptive_order
from dynabatch.core.simulate.pipeline import pipeline_schedule, simulate_pipeline
from dynabatch.planfile import format as fmt
from dynabatch.planfile.arrow import plan_from_arrow, plan_to_arrow, plans_to_arrow

# Two stages, four micro-batches: adaptive (more in flight) beats 1F1B, which beats GPipe.
ADAPT_F = [[2.0, 2.0, 2.0, 4.0], [1.0, 2.0, 1.0, 2.0]]
ADAPT_B = [[4.0, 3.0, 2.0, 4.0], [3.0, 4.0, 1.0, 2.0]]
# Two stages, four micro-batches: GPipe is the fastest, but holds all four on each stage.
GPIPE_F = [[2.0, 4.0, 4.0, 4.0], [4.0, 1.0, 3.0, 3.0]]
GPIPE_B = [[4.0, 2.0, 1.0, 2.0], [2.0, 3.0, 1.0, 4.0]]


def _check_valid(ops, fwd, bwd, p2p, mem, limit):
    S, M = np.shape(fwd)
    for row in ops:  # every F_j and B_j once per stage, F_j before B_j
        assert sorted(row.tolist()) == sorted(list(range(-M, 0)) + list(range(1, M + 1)))
        assert all(row.tolist().index(j + 1) < row.tolist().index(-(j + 1)) for j in range(M))
    sim = simulate_pipeline(fwd, bwd, schedule=ops, p2p_s=p2p, mem_bytes=mem)  # dependencies: no deadlock
    assert np.all(sim.peak_inflight_bytes <= limit + 1e-9)
    return sim


@settings(max_examples=80, deadline=None)
@given(S=st.integers(1, 5), M=st.integers(1, 10), seed=st.integers(0, 10_000))
def test_adaptive_order_is_valid_within_memory_and_equals_its_reference(S, M, seed):
    rng = np.random.default_rng(seed)
    fwd, bwd = rng.uniform(0.1, 1.0, (S, M)), rng.uniform(0.1, 2.0, (S, M))
    p2p, mem = rng.uniform(0.0, 0.1, M), rng.uniform(1.0, 4.0, M)
    limit = float(rng.uniform(mem.max(), 5 * mem.max()))
    ops = adaptive_order(fwd, bwd, mem, limit, p2p_s=p2p)
    _check_valid(ops, fwd, bwd, p2p, mem, limit)
    assert np.array_equal(ops, adaptive_order(fwd, bwd, mem, limit, p2p_s=p2p))  # deterministic
    ref = adaptive_reference(fwd.tolist(), bwd.tolist(), p2p.tolist(), mem.tolist(), limit, False)
    assert ops.tolist() == ref
    # the list schedule's own times are what the simulator gives for the order
    sim = simulate_pipeline(fwd, bwd, schedule="adaptive", p2p_s=p2p, mem_bytes=mem, memory_limit=limit)
    assert sim.schedule == "adaptive" and np.array_equal(sim.ops.codes(), ops)


def test_a_micro_batch_over_the_limit_is_a_clear_error_or_runs_alone():
    fwd = np.ones((3, 4))
    mem = np.array([1.0, 1.0, 10.0, 1.0])
    with pytest.raises(ValueError, match="micro-batch 2 alone holds 10 bytes.*over the memory limit of 3"):
        adaptive_order(fwd, 2 * fwd, mem, 3.0)
    with pytest.raises(ValueError, match="over the memory limit"):
        simulate_pipeline(fwd, 2 * fwd, schedule="adaptive", mem_bytes=mem, memory_limit=3.0)
    ops = adaptive_order(fwd, 2 * fwd, mem, 3.0, oversize="alone")
    sim = simulate_pipeline(fwd, 2 * fwd, schedule=ops, mem_bytes=mem)
    assert sim.peak_inflight_bytes.max() == 10.0  # it ran with nothing else in flight
    codes = np.zeros((3, 8), np.int32)
    assert adaptive_kernel(fwd, 2 * fwd, np.zeros(4), mem, 3.0, True, codes) == OK
    assert np.array_equal(codes, ops)


def test_static_names_cannot_stand_for_the_dynamic_orders():
    with pytest.raises(ValueError, match="depends on the micro-batches"):
        pipeline_schedule(2, 3, "adaptive")
    with pytest.raises(ValueError, match="depends on the micro-batches"):
        pipeline_schedule(2, 3, "auto")
    assert "auto" in SCHEDULES and PlanOptions(schedule="auto").schedule == "auto"


def test_adaptive_beats_1f1b_with_uneven_stages_and_room_in_memory():
    mem = np.ones(4)
    runs = {s: simulate_pipeline(ADAPT_F, ADAPT_B, schedule=s, mem_bytes=mem, memory_limit=4.0)
            for s in ("gpipe", "1f1b", "adaptive")}
    assert runs["adaptive"].makespan_s == 23.0 and runs["1f1b"].makespan_s == 27.0 and runs["gpipe"].makespan_s == 28.0
    assert runs["adaptive"].peak_inflight.max() > runs["1f1b"].peak_inflight.max()
    # limited to one micro-batch in flight the adaptive order gains nothing over 1F1B
    tight = simulate_pipeline(ADAPT_F, ADAPT_B, schedule="adaptive", mem_bytes=mem, memory_limit=1.0)
    assert tight.makespan_s > runs["1f1b"].makespan_s - 1e-9
    auto = simulate_pipeline(ADAPT_F, ADAPT_B, schedule="auto", mem_bytes=mem, memory_limit=4.0)
    every = {s: simulate_pipeline(ADAPT_F, ADAPT_B, schedule=s, mem_bytes=mem, memory_limit=4.0) for s in AUTO_PREFERENCE}
    assert auto.makespan_s == min(r.makespan_s for r in every.values()) < runs["1f1b"].makespan_s


def test_auto_takes_gpipe_only_when_its_memory_fits():
    mem = np.ones(4)
    auto = AUTO_PREFERENCE
    roomy = simulate_pipeline(GPIPE_F, GPIPE_B, schedule="auto", mem_bytes=mem, memory_limit=4.0)
    tight = simulate_pipeline(GPIPE_F, GPIPE_B, schedule="auto", mem_bytes=mem, memory_limit=3.0)
    alone = {s: simulate_pipeline(GPIPE_F, GPIPE_B, schedule=s, mem_bytes=mem, memory_limit=3.0) for s in auto}
    assert alone["gpipe"].makespan_s == 29.0 == min(alone[s].makespan_s for s in ("gpipe", "1f1b", "adaptive"))
    assert roomy.makespan_s == min(r.makespan_s for r in alone.values())  # every order fits 4 in flight
    assert tight.schedule != "gpipe" and tight.peak_inflight_bytes.max() <= 3.0
    feasible = [r for s, r in alone.items() if r.peak_inflight_bytes.max() <= 3.0]  # not gpipe, nor zb-h2 (4)
    assert alone["gpipe"].peak_inflight_bytes.max() > 3.0 and alone["zb-h2"].peak_inflight_bytes.max() > 3.0
    assert tight.makespan_s == min(f.makespan_s for f in feasible)


def test_rank_ordering_kernel_equals_reference():
    rng = np.random.default_rng(5)
    for it in range(40):
        m, ranks, S = int(rng.integers(1, 14)), int(rng.integers(1, 4)), int(rng.integers(1, 5))
        t, p, mem = rng.uniform(0.1, 1, m), rng.uniform(0, 0.05, m), rng.uniform(1, 5, m)
        rank_of = rng.integers(0, ranks, m).astype(np.int32)
        for code in (0, 1, 2):
            got = order_ranks_schedule(t, p, mem, rank_of, ranks, 1 / 3, S, code, 8.0, bool(it % 2))
            ref = order_ranks_schedule_reference(t, p, mem, rank_of, ranks, 1 / 3, S, code, 8.0, bool(it % 2))
            assert got[0].tolist() == ref[0]
            assert np.allclose(got[1], ref[1]) and np.allclose(got[2], ref[2])


def test_stage_rank_ordering_kernel_equals_reference():
    """Per-stage times: the candidate orders and each rank's chosen order, makespan and peak equal the
    plain-Python reference, with stages that skip micro-batches (zero time) and tied times."""
    rng = np.random.default_rng(7)
    for it in range(60):
        m, ranks, S = int(rng.integers(1, 16)), int(rng.integers(1, 4)), int(rng.integers(1, 5))
        t = rng.uniform(0.05, 1, (S, m))
        if it % 3 == 0:
            t[: max(S // 2, 1), rng.random(m) < 0.5] = 0.0  # front stages skip some micro-batches
        if it % 4 == 0:
            t = np.round(t, 1)  # ties
        p, mem = rng.uniform(0, 0.05, m), rng.uniform(1, 5, m)
        rank_of = rng.integers(0, ranks, m).astype(np.int32)
        assert stage_candidates(t).tolist() == stage_candidates_reference(t)
        for code in (0, 1, 2):
            got = order_ranks_stages(t, p, mem, rank_of, ranks, 1 / 3, code, 8.0, bool(it % 2))
            ref = order_ranks_stages_reference(t, p, mem, rank_of, ranks, 1 / 3, code, 8.0, bool(it % 2))
            assert got[0].tolist() == ref[0]
            assert np.allclose(got[1], ref[1]) and np.allclose(got[2], ref[2])
    # Johnson's rule and the alternation on a hand example: (front, back) = (1, 3), (3, 1), (2, 2), (0, 4)
    cands = stage_candidates(np.array([[1.0, 3.0, 2.0, 0.0], [3.0, 1.0, 2.0, 4.0]]))
    assert cands[8].tolist() == [3, 0, 2, 1]  # front < back ascending front, then descending back
    assert cands[9].tolist() == [3, 1, 0, 2]  # most back-heavy, most front-heavy, next of each


# --------------------------------------------------------------------------- planner and plan file


def _setup(n=300, seed=0):
    from dynabatch.core.cost.model import model_preset

    cost = CostModel(model_preset("gpt"), device_preset("a100-80gb"))
    rng = np.random.default_rng(seed)
    shapes = Shapes.from_lengths(input_tokens=rng.integers(16, 2048, n))
    return shapes, cost


def _plan(schedule, memory_limit=None, **kw):
    shapes, cost = _setup()
    return plan_microbatches(shapes, cost, num_stages=4, num_ranks=2, method="dp", max_len=2048, schedule=schedule,
                             memory_limit=memory_limit, **kw)


def test_planner_auto_records_the_fastest_order_that_fits():
    shapes, cost = _setup()
    limit = cost.memory_limit(4, 2)
    plans = {s: _plan(s) for s in AUTO_PREFERENCE}
    auto = _plan("auto")
    assert auto.schedule in AUTO_PREFERENCE
    budget = 4 * limit

    def peak(p):  # the largest in-flight bytes on any stage of any rank
        out = 0.0
        for r in range(p.num_ranks):
            mine = np.flatnonzero(p.mb_rank == r)
            t, m = p.mb_time_s[mine], p.mb_memory_bytes[mine]
            fwd = t * cost.forward_fraction
            kw = dict(memory_limit=budget) if p.schedule == "adaptive" else {}
            sim = simulate_pipeline(fwd, t - fwd, num_stages=4, schedule=p.schedule, mem_bytes=m,
                                    p2p_s=cost.p2p_time(cost.padded_features(p.mb_rows[mine], p.mb_input_len[mine],
                                                                              p.mb_target_len[mine],
                                                                              p.mb_vision_tiles[mine])), **kw)
            assert np.isclose(sim.makespan_s, p.rank_time_s[r])  # the planner simulated this order
            out = max(out, float(sim.peak_inflight_bytes.max()))
        return out

    fits = {s: p.iteration_time_s for s, p in plans.items() if peak(p) <= budget}
    assert "gpipe" not in fits  # the whole step's activations on a stage: too much
    assert auto.schedule == min(fits, key=fits.get)
    chosen = plans[auto.schedule]
    assert auto.fingerprint() == chosen.fingerprint() and np.array_equal(auto.rank_time_s, chosen.rank_time_s)
    assert plans["adaptive"].options["stage_memory_bytes"] == budget
    # with memory for every micro-batch at once gpipe is simulated as it is, and counted as fitting
    roomy = _plan("auto", memory_limit=limit * 1e3)
    assert roomy.iteration_time_s <= min(_plan(s, memory_limit=limit * 1e3).iteration_time_s
                                         for s in AUTO_PREFERENCE) + 1e-12


def _ipc(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def test_plan_file_keeps_each_steps_schedule_and_reads_old_files():
    a = _plan("auto")
    b = dataclasses.replace(_plan("gpipe"), step=1)
    one = plan_to_arrow(a)
    assert plan_from_arrow(one).schedule == a.schedule
    both = plans_to_arrow([a, b])
    meta = {k.decode(): v.decode() for k, v in both.schema.metadata.items()}
    assert meta[fmt.SCHEDULE_KEY] == ("auto" if a.schedule != "gpipe" else "gpipe")
    assert plan_from_arrow(both, step=0).schedule == a.schedule
    assert plan_from_arrow(both, step=1).schedule == "gpipe"
    old = {k: v for k, v in both.schema.metadata.items() if k.decode() != fmt.STEP_SCHEDULE_KEY}
    old[fmt.SCHEDULE_KEY.encode()] = b"1f1b"
    assert plan_from_arrow(both.replace_schema_metadata(old), step=1).schedule == "1f1b"  # older release


def test_auto_plans_are_byte_identical_for_the_same_seed():
    from dynabatch.core.plan.planner import split_global_batches

    shapes, cost = _setup(n=600)
    outs = []
    for _ in range(2):
        plans = []
        for k, pos in enumerate(split_global_batches(shapes, 65536, seed=3)):
            sub = shapes.take(pos)
            plans.append(plan_microbatches(sub, cost, num_stages=4, num_ranks=2, method="dp", max_len=2048,
                                           schedule="auto", step=k))
        outs.append(_ipc(plans_to_arrow(plans)))
    assert outs[0] == outs[1]


# --------------------------------------------------------------------------- runner (2 stages over gloo)


def runner_follows_plan(rank, world, port, seed):
    """Worker: run one plan recorded as gpipe and one as adaptive with the default RunnerConfig
    (``auto``); report the orders used and loss/gradients against a single process."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_pipeline_workers import TINY, replica_batches, synthetic_plan

    from dynabatch.pipeline import PipelineRunner, RunnerConfig, init_pipeline, make_model, sequential_step

    ctx = init_pipeline(2, rank=rank, world_size=world, master_port=port, timeout_s=30, abort_after_s=10)
    out = []
    with ctx:
        rng = np.random.default_rng(seed)
        for step, schedule in enumerate(("gpipe", "adaptive")):
            plan = dataclasses.replace(synthetic_plan(rng, collation="padded", num_ranks=1, num_stages=2, mbs=(4, 4),
                                                      step=step), schedule=schedule)
            model = make_model("gpt-tiny", **TINY["gpt-tiny"], seed=1)
            ref = make_model("gpt-tiny", **TINY["gpt-tiny"], seed=1)
            runner = PipelineRunner.from_model(model, ctx, [0, 2, 5], RunnerConfig())
            batches = replica_batches(model, plan, 0, seed=step)
            res = runner.step(plan, batches)
            ref_loss, _ = sequential_step(ref.layers, batches)
            lo = runner.stage.first_layer
            diff = max(float((p.grad - q.grad).abs().max()) for i, layer in enumerate(runner.stage.layers)
                       for p, q in zip(layer.parameters(), ref.layers[lo + i].parameters()))
            out.append({"schedule": schedule, "orders": runner.orders(plan).codes().tolist(), "loss": res.loss,
                        "ref_loss": ref_loss, "diff": diff, "time_s": plan.mb_time_s.tolist(),
                        "mem": plan.mb_memory_bytes.tolist()})
    return out


def test_runner_follows_the_schedule_the_plan_records():
    from dynabatch.pipeline import launch_local
    from dynabatch.pipeline.runtime.schedule import stage_orders

    res = launch_local(f"{Path(__file__)}:runner_follows_plan", 2, args=(11,), timeout_s=120)
    for r in res:
        assert not r.timed_out and r.returncode == 0, r.stderr[-3000:]
    for out in (r.result for r in res):
        gp, ad = out
        assert gp["orders"] == pipeline_schedule(2, 4, "gpipe").tolist() != pipeline_schedule(2, 4, "1f1b").tolist()
        t, mem = np.array(ad["time_s"]), np.array(ad["mem"])
        assert ad["orders"] == stage_orders("adaptive", 2, 4, time_s=t, memory_bytes=mem).codes().tolist()
        assert ad["orders"] != pipeline_schedule(2, 4, "1f1b").tolist()  # more in flight than 1F1B
        for case in out:
            assert abs(case["loss"] - case["ref_loss"]) <= 1e-6 * abs(case["ref_loss"]) and case["diff"] < 1e-5
