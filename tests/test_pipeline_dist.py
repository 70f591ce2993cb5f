"""Multi-process pipeline runs over gloo on 127.0.0.1: correctness against a single process, 1,000-step
soak runs, per-peer operation order, failure propagation and debug shape headers.

Every test launches real processes through `dynabatch.pipeline.launch_local`; the rank-side code is
in ``test_pipeline_workers.py``. The ranks leave the 2 cores partly idle (they wait on each other, a
failing rank lingers, the others wait out abort_after_s), so the selected tests' launches start in
the background, two at a time, when the module's first test begins (``tests/prelaunch.py``), and the
runs that end normally share one launch (one process group) per topology: the 2-stage correctness
cases, 2-stage soak, feedback loop and partition search on 2 ranks; the 4-stage correctness cases and
soak on 4. Each test checks its own run's results exactly as when it runs alone.
"""

import functools
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prelaunch import Prelaunch, job, part  # noqa: E402

from dynabatch.pipeline.runtime import check_peer_sequences  # noqa: E402
from dynabatch.pipeline import launch_local  # noqa: E402

WORKERS = str(Path(__file__).with_name("test_pipeline_workers.py"))
SCHEDULES = ["gpipe", "1f1b", "adaptive"]
LAUNCHES = Prelaunch(parallel=2)


@pytest.fixture(scope="module", autouse=True)
def _launches(request):
    yield from LAUNCHES.started(request)


def launch(fn, nprocs, *args, timeout_s=120.0, weight=0.0):
    """The launch of worker ``fn`` on ``nprocs`` ranks, as a `prelaunch.Job` (``weight``: about its seconds)."""
    return job(repr((fn, nprocs, args, timeout_s)), launch_local, f"{WORKERS}:{fn}", nprocs, args=args,
               timeout_s=timeout_s, weight=weight)


def _several(nprocs, num_stages, calls):
    """One launch of `several` (``calls``: ``[worker, args]``); every rank exited 0 (`ok`); each call's
    per-rank results. The liveness timeout is the longest the workers had alone (a call ends with a
    heartbeat)."""
    res = ok(launch_local(f"{WORKERS}:several", nprocs, args=(num_stages, [list(c) for c in calls]), timeout_s=120))
    return [[r[i] for r in res] for i in range(len(calls))]


def shared(fn, nprocs, num_stages, *args, weight=0.0):
    """Worker ``fn(ctx, *args)`` (a run that ends normally) as a `prelaunch.Part` of the one launch of
    ``nprocs`` ranks and ``num_stages`` stages; its result is every rank's result (`ok` checked)."""
    return part(("several", nprocs, num_stages), (fn, args), functools.partial(_several, nprocs, num_stages),
                weight=weight)


def run(j):
    """Every rank's `ProcResult` of launch ``j`` (started in the background, or run now); for a part,
    every rank's result."""
    return LAUNCHES.result(j)


def ok(res):
    for r in res:
        assert not r.timed_out, f"rank {r.rank} hung:\n{r.stderr[-3000:]}"
        assert r.returncode == 0, f"rank {r.rank} failed:\n{r.stderr[-3000:]}"
    return [r.result for r in res]


def check_correctness(results, world, stages):
    for rank, out in enumerate(results):
        assert out["cases"], "no cases ran"
        for c in out["cases"]:
            what = f"rank {rank} {c['model']} {c['collation']} {c['schedule']} step {c['step']}"
            assert c["tokens"] == c["ref_tokens"], what
            assert abs(c["loss"] - c["ref_loss"]) <= 1e-6 * abs(c["ref_loss"]), what
            assert c["grad_scale"] > 0, what
            assert c["max_grad_diff"] <= 1e-5 * c["grad_scale"] + 1e-9, (what, c["max_grad_diff"], c["grad_scale"])
    # the stages of one replica derived the same op orders from the plan alone
    for d in range(world // stages):
        replica = results[d * stages:(d + 1) * stages]
        for c in zip(*[out["cases"] for out in replica]):
            assert all(x["orders"] == c[0]["orders"] for x in c)
    for key in results[0]["comm"]:
        per_rank = {r: {int(p): seq for p, seq in results[r]["comm"][key].items()} for r in range(world)}
        check_peer_sequences(per_rank)


TWO_STAGE_CASES = [["gpt-tiny", [0, 2, 5], "padded", False], ["gpt-tiny", [0, 3, 5], "packed", False],
                   ["t5-tiny", [0, 3, 6], "padded", True], ["t5-tiny", [0, 2, 6], "packed", True]]
TWO_STAGES = shared("correctness", 2, 2, TWO_STAGE_CASES, SCHEDULES, 2, False, weight=3)


@LAUNCHES.plan(lambda: [TWO_STAGES])
def test_two_stages_match_single_process_all_schedules():
    """gpt-tiny padded and packed, t5-tiny padded and packed (its two rows' totals from the plan; with debug
    headers): 2-stage loss and gradients equal a single-process run of the same micro-batches, for gpipe,
    1f1b and adaptive."""
    results = run(TWO_STAGES)
    check_correctness(results, 2, 2)
    seen = {(c["model"], c["collation"], c["schedule"]) for c in results[0]["cases"]}
    assert len(seen) == 12


DATA_PARALLEL = launch("correctness", 4, 2, [["t5-tiny", [0, 3, 6], "padded", False]], SCHEDULES, 1, True, weight=8)


@LAUNCHES.plan(lambda: [DATA_PARALLEL])
def test_data_parallel_with_planner_matches_single_process():
    """2 stages x 2 replicas, t5-tiny, micro-batches planned by plan_microbatches: gradients after the
    data-parallel all-reduce equal the single-process gradients of the whole global batch."""
    results = ok(run(DATA_PARALLEL))
    check_correctness(results, 4, 2)


FOUR_STAGES = shared("correctness", 4, 4, [["gpt-tiny", [0, 2, 3, 4, 5], "padded", False]], SCHEDULES, 1, False,
                     weight=5)


@LAUNCHES.plan(lambda: [FOUR_STAGES])
def test_four_stages_uneven_replicas_match_single_process():
    """4 stages, gpt-tiny, random micro-batch counts: every stage's gradients are right."""
    results = run(FOUR_STAGES)
    check_correctness(results, 4, 4)


SOAK = {stages: shared("soak", stages, stages, 1000, SCHEDULES, True, weight=4 * stages) for stages in (2, 4)}


@pytest.mark.parametrize("stages", [2, 4])
@LAUNCHES.plan(lambda stages: [SOAK[stages]])
def test_thousand_variable_steps_no_hang(stages):
    """1,000 steps of 1-2 random-shape micro-batches, cycling gpipe/1f1b/adaptive, finish well within
    the time limit, and both ends of every link posted the same operation sequence. The length is the point:
    each step draws a new plan and schedule, and a hang or a drift of the two ends' post orders that only
    some sequence of them triggers needs many steps to show. The price, measured alone: the 4-stage launch
    (almost all of it this soak) ~43 CPU-s over its 4 ranks, about 10 ms per step and rank."""
    results = run(SOAK[stages])
    assert all(r["steps"] == 1000 and r["finite"] for r in results)
    per_rank = {r: {int(p): seq for p, seq in results[r]["comm"].items()} for r in range(stages)}
    check_peer_sequences(per_rank)
    assert sum(len(v) for v in per_rank[0].values()) >= 2000  # at least 1 act + 1 grad per step


FAILING = launch("failing", 4, 2, 1, 3, 0.0, timeout_s=40, weight=8)
LINGERING = launch("failing", 2, 2, 1, 3, 8.0, timeout_s=40, weight=12)


@LAUNCHES.plan(lambda: [FAILING])
def test_failing_rank_stops_every_rank_with_its_error():
    """2 stages x 2 replicas; rank 1 raises in step 3: every process exits non-zero within the
    timeout, and every rank's error names rank 1's exception."""
    res = run(FAILING)
    for r in res:
        assert not r.timed_out, f"rank {r.rank} hung:\n{r.stderr[-2000:]}"
        assert r.returncode != 0, f"rank {r.rank} exited 0"
        assert "boom from rank 1 at step 3" in r.stderr, f"rank {r.rank}:\n{r.stderr[-2000:]}"
    assert "ValueError" in res[1].stderr
    # the others end soon after the failing rank (worker timeout_s=20, abort_after_s=3)
    assert max(r.wall_s for r in res) - res[1].wall_s < 10.0
    for r in (res[0], res[2], res[3]):
        assert "rank 1 (stage 1, replica 0) failed: ValueError" in r.stderr


@LAUNCHES.plan(lambda: [LINGERING])
def test_failing_rank_that_stays_alive_cannot_hang_the_others():
    """The failing rank's process lingers 8 s before exiting (as if it caught the error): the other
    rank, waiting on it, raises PipelineAborted with its error text soon after the failure (its wait
    is watched, so it is not left blocked until the watchdog ends it)."""
    res = run(LINGERING)
    assert res[1].returncode != 0 and not res[1].timed_out
    assert res[0].returncode != 0 and not res[0].timed_out
    assert "boom from rank 1 at step 3" in res[0].stderr
    assert "PipelineAborted: rank 1 (stage 1, replica 0) failed: ValueError" in res[0].stderr
    assert "aborting: still blocked" not in res[0].stderr
    assert res[0].wall_s < res[1].wall_s, (res[0].wall_s, res[1].wall_s)  # it did not wait out the 8 s linger


WRONG_PLAN = launch("wrong_plan", 2, 1, timeout_s=40, weight=4)


@LAUNCHES.plan(lambda: [WRONG_PLAN])
def test_debug_headers_catch_a_wrong_planned_shape():
    """Rank 1 holds a plan whose first micro-batch is 8 tokens longer; with debug headers both ranks
    stop with a ShapeMismatch that states both shapes."""
    res = run(WRONG_PLAN)
    for r in res:
        assert not r.timed_out and r.returncode != 0
        assert "ShapeMismatch" in r.stderr and "the ranks do not hold the same plan" in r.stderr, r.stderr[-2000:]
    assert "planned to receive act F0 0->1" in res[1].stderr


FEEDBACK = shared("feedback_run", 2, 2, 24, weight=3)


@LAUNCHES.plan(lambda: [FEEDBACK])
def test_feedback_loop_in_a_real_pipeline_plans_with_measured_costs():
    """Plan -> run (timings gathered from every rank) -> FeedbackLoop.record -> refit -> plan the next
    batch: every rank ends with the same coefficients (so they keep agreeing on the plan), which
    moved away from the analytic prior, and the prediction error stays sane."""
    res = run(FEEDBACK)
    a, b = res
    assert a["coef"] == b["coef"] and a["history"] == b["history"]
    assert len(a["history"]) == 6
    assert a["consistent"] and b["consistent"]
    assert not np.allclose(a["coef"], a["prior"], rtol=0.05)
    assert np.mean(a["errors"][-8:]) < 0.6


PARTITION = shared("partition_search", 2, 2, False, weight=1)
PARTITION_MISMATCH = launch("partition_search", 2, True, timeout_s=60, weight=4)


@LAUNCHES.plan(lambda: [PARTITION])
def test_search_partition_gives_every_rank_the_same_split():
    """Each rank profiles a different layer as slow: alone they would split differently (and a
    pipeline whose ranks disagree on the split deadlocks); averaged, they agree."""
    a, b = run(PARTITION)
    assert a["alone"] != b["alone"]
    assert a["bounds"] == b["bounds"] and a["makespan"] == b["makespan"]


@LAUNCHES.plan(lambda: [PARTITION_MISMATCH])
def test_search_partition_refuses_different_micro_batch_counts():
    res = run(PARTITION_MISMATCH)
    for r in res:
        assert r.returncode != 0 and not r.timed_out
        assert "different numbers of micro-batches" in r.stderr, r.stderr[-2000:]
