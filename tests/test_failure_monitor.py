"""The pipeline's stall verdict (`FailureMonitor`, over an in-process store): a busy rank that keeps
computing, only slowly (starved on a shared machine), is not stalled; one blocked in a sleep, or
spinning without progress for ``timeout_s`` of CPU, is."""

import threading
import time

import pytest
import torch.distributed as dist

from dynabatch.pipeline.runtime.failure import FailureMonitor

TIMEOUT_S = 1.0
STATE = "in backward of micro-batch 0 of step 0"


def _spin(cpu_s: float) -> None:
    """Use ``cpu_s`` seconds of this thread's CPU, however long that takes on a busy machine."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def _slow(wall_s: float) -> None:
    """Compute in 4 ms bursts with 20 ms pauses for ``wall_s`` seconds: at most ~17% of a core."""
    end = time.monotonic() + wall_s
    while time.monotonic() < end:
        _spin(0.004)
        time.sleep(0.02)


def _verdict_after(work) -> tuple | None:
    """Rank 1 records a busy state and does ``work`` in its own thread; then rank 0 judges it."""
    store = dist.HashStore()
    mons = [FailureMonitor(store, store, rank=r, world_size=2, where=f"stage {r}", is_host=r == 0,
                           timeout_s=TIMEOUT_S, num_stages=2) for r in range(2)]
    done, published = threading.Event(), threading.Event()

    def rank1():
        mons[1].set_state("busy", STATE)
        work()
        done.set()
        published.wait(120)  # alive (its CPU clock readable) until its heartbeat is out

    t = threading.Thread(target=rank1)
    t.start()
    assert done.wait(120), "rank 1's work did not finish"
    mons[1]._heartbeat(store, time.monotonic())
    published.set()
    t.join()
    return mons[0]._verdict([1], time.monotonic())


def test_a_slow_but_working_rank_is_not_stalled():
    assert _verdict_after(lambda: _slow(2.5 * TIMEOUT_S)) is None


@pytest.mark.parametrize("work", ["sleep", "spin"])
def test_a_rank_without_progress_is_stalled(work):
    fn = (lambda: time.sleep(1.5 * TIMEOUT_S)) if work == "sleep" else (lambda: _spin(1.5 * TIMEOUT_S))
    culprit, message, dead = _verdict_after(fn)
    assert (culprit, dead) == (1, False)
    assert message.startswith(f"rank 1 (stage 1, replica 0) stalled for ") and STATE in message
