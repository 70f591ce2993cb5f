"""Faults in a running pipeline end every rank soon after ``timeout_s``, and every surviving rank's error
names the rank at fault and what it was doing: a rank that stalls (inside a layer, or before posting a
send), a rank killed by SIGKILL (also the rank hosting the store), a rank that raises, and ranks that
hold different plans (caught before any transfer, debug headers off). 2 and 4 stages, gloo on CPU.

Exit times are measured from the moment the fault starts (the culprit prints it) and checked against a
generous bound only (the machine is small and shared). The rank-side code is `fault` in
``test_pipeline_workers.py``.

Most of each run is spent waiting on purpose (for timeout_s to expire, the culprit to linger or be
ended), so the selected tests' launches start together, up to five at a time, when the module's
first test begins (``tests/prelaunch.py``); each test checks its own launch exactly as when it runs alone.
"""

import re
import time
from pathlib import Path

import pytest
from prelaunch import Prelaunch, job

from dynabatch.pipeline import launch_local

WORKERS = str(Path(__file__).with_name("test_pipeline_workers.py"))
TIMEOUT_S = 8.0  # the pipeline's liveness timeout in these runs
MARGIN_S = 30.0  # generous: how long after timeout_s a rank may take to exit on a busy 2-core machine
FAULT_STEP = 2
LAUNCHES = Prelaunch(parallel=5)
# about how long each scenario's launch takes (seconds, 2-core machine): the longest start first
WEIGHT = {"stall_layer": 14, "stall_send": 18, "kill": 6, "raise": 2, "raise_linger": 19, "shape": 8}


@pytest.fixture(scope="module", autouse=True)
def _launches(request):
    yield from LAUNCHES.started(request)


def _launch(stages, scenario, culprit, timeout_s):
    t0 = time.time()
    res = launch_local(f"{WORKERS}:fault", stages, args=(stages, scenario, culprit, FAULT_STEP, timeout_s),
                       timeout_s=timeout_s + MARGIN_S + 30)
    return t0, res


def fault_job(stages, scenario, culprit, timeout_s=TIMEOUT_S):
    return job(("fault", stages, scenario, culprit, timeout_s), _launch, stages, scenario, culprit, timeout_s,
               weight=WEIGHT[scenario] + stages)


def run_fault(stages, scenario, culprit, timeout_s=TIMEOUT_S):
    t0, res = LAUNCHES.result(fault_job(stages, scenario, culprit, timeout_s))
    marks = re.findall(r"DYNABATCH_FAULT_AT ([0-9.]+)", res[culprit].stderr)
    assert marks, f"the fault did not happen on rank {culprit}:\n{res[culprit].stderr[-3000:]}"
    fault_at = float(marks[0])
    exits = [t0 + r.wall_s - fault_at for r in res]
    print(f"{scenario} stages={stages} culprit={culprit} timeout_s={timeout_s}: exit s after the fault "
          + ", ".join(f"rank {r.rank} {e:.1f}{' (hung)' if r.timed_out else ''}" for r, e in zip(res, exits)))
    for r, e in zip(res, exits):
        assert not r.timed_out, f"rank {r.rank} hung:\n{r.stderr[-3000:]}"
        assert r.returncode != 0, f"rank {r.rank} exited 0:\n{r.stderr[-3000:]}"
        assert e < timeout_s + MARGIN_S, f"rank {r.rank} exited {e:.1f} s after the fault:\n{r.stderr[-3000:]}"
    return res, exits


def name(rank):
    return f"rank {rank} (stage {rank}, replica 0)"


def survivors(res, culprit):
    return [r for r in res if r.rank != culprit]


def assert_raised(r, *texts):
    """Rank ``r`` raised (not: was ended from outside) an error that contains every text."""
    err = r.stderr
    assert "Traceback" in err and "aborting: still blocked" not in err, f"rank {r.rank}:\n{err[-3000:]}"
    for t in texts:
        assert t in err, f"rank {r.rank} does not say {t!r}:\n{err[-3000:]}"


@pytest.mark.parametrize("stages,culprit", [(2, 1), (4, 2)])
@LAUNCHES.plan(lambda stages, culprit: [fault_job(stages, "stall_layer", culprit)])
def test_rank_stalled_inside_a_layer(stages, culprit):
    """The culprit sleeps forever in its forward of micro-batch 1: every other rank raises within
    timeout_s + a margin naming it (with 4 stages: not a neighbour that waits on it), and the culprit
    itself is ended."""
    res, _ = run_fault(stages, "stall_layer", culprit)
    for r in survivors(res, culprit):
        assert_raised(r, "PipelineAborted", f"{name(culprit)} stalled for",
                      f"in forward of micro-batch 1 of step {FAULT_STEP}")


@LAUNCHES.plan(lambda: [fault_job(4, "stall_send", 1)])
def test_rank_stalled_before_sending_four_stages():
    """Stage 1 of 4 sleeps forever before posting its send of act F1: stages 0 and 2 wait on it
    directly, stage 3 through stage 2; all of them blame stage 1."""
    res, _ = run_fault(4, "stall_send", 1)
    for r in survivors(res, 1):
        assert_raised(r, "PipelineAborted", f"{name(1)} stalled for", "act F1 1->2", f"step {FAULT_STEP}")


@pytest.mark.parametrize("stages,culprit", [(2, 1), (4, 2)])
@LAUNCHES.plan(lambda stages, culprit: [fault_job(stages, "kill", culprit)])
def test_rank_killed(stages, culprit):
    """SIGKILL in the middle of a step: the others raise an error saying that the rank died and what
    it was last doing (not a raw gloo error), within timeout_s + a margin."""
    res, _ = run_fault(stages, "kill", culprit)
    assert res[culprit].returncode == -9
    for r in survivors(res, culprit):
        assert_raised(r, "PipelineAborted", f"{name(culprit)} died")


@LAUNCHES.plan(lambda: [fault_job(2, "kill", 0)])
def test_store_host_killed():
    """Rank 0 hosts the coordination store: when it is killed, rank 1 still names it."""
    res, _ = run_fault(2, "kill", 0)
    assert_raised(res[1], "PipelineAborted", f"{name(0)}", "died")


@pytest.mark.parametrize("stages,culprit,scenario", [(2, 1, "raise"), (4, 2, "raise_linger")])
@LAUNCHES.plan(lambda stages, culprit, scenario: [fault_job(stages, scenario, culprit)])
def test_rank_raises(stages, culprit, scenario):
    """The culprit raises inside a layer (with 4 stages its process then stays alive 15 s, as if it had
    caught the error): it exits with its own error, and every other rank raises PipelineAborted with
    that error's text soon after (none is left blocked until it is killed)."""
    res, exits = run_fault(stages, scenario, culprit)
    assert "ValueError: boom" in res[culprit].stderr
    for r in survivors(res, culprit):
        assert_raised(r, "PipelineAborted", f"{name(culprit)} failed: ValueError: boom from rank {culprit}")
        assert exits[r.rank] < TIMEOUT_S + MARGIN_S


@pytest.mark.parametrize("stages,culprit", [(2, 1), (4, 2)])
@LAUNCHES.plan(lambda stages, culprit: [fault_job(stages, "shape", culprit)])
def test_ranks_with_different_plans_fail_before_the_transfer(stages, culprit):
    """The culprit's micro-batch 1 is 8 tokens longer than everyone else's (debug headers off): no rank
    is killed by gloo; every rank raises a ShapeMismatch naming the micro-batch and both shapes."""
    res, _ = run_fault(stages, "shape", culprit)
    for r in res:
        assert r.returncode == 1, f"rank {r.rank} ended with {r.returncode}:\n{r.stderr[-3000:]}"
        assert_raised(r, "ShapeMismatch", "micro-batch 1", "the ranks do not hold the same plan", f"rank {culprit}")
        m = re.search(r"\[\[(\d+), (\d+), 16\] float32.*?\[\[(\d+), (\d+), 16\] float32", r.stderr)
        assert m, f"rank {r.rank} does not state both shapes:\n{r.stderr[-3000:]}"
        assert m.group(1) == m.group(3) and abs(int(m.group(2)) - int(m.group(4))) == 8, m.group(0)
