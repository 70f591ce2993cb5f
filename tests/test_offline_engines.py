"""`dynabatch.engines.map_parts` (local engine): order, context, errors."""

from __future__ import annotations

import pytest

from dynabatch.offline import map_parts


def _scaled(context, item):
    if item == "boom":
        raise ValueError("part boom: bad input")
    return context * item


@pytest.mark.parametrize("workers", [1, 2])
def test_results_in_item_order(workers):
    items = list(range(17))
    assert map_parts(_scaled, items, 3, workers=workers, progress=False, weights=[1] * 17) == [3 * i for i in items]


def test_worker_error_is_reraised():
    with pytest.raises(ValueError, match="part boom: bad input"):
        map_parts(_scaled, [1, 2, "boom", 4], 1, workers=2, progress=False)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown engine"):
        map_parts(_scaled, [1], 1, engine="spark")
    with pytest.raises(ValueError, match="workers must be >= 1"):
        map_parts(_scaled, [1], 1, workers=0)


_STARTED = "imported"  # set to "forked" in the test: a forked worker inherits it, a spawned one imports it anew


def _how_started(context, item):
    return _STARTED


def test_workers_are_not_forked_from_a_process_running_other_threads():
    """A busy second thread: forking mid-way through its work can crash the child (a segfault in the
    child's garbage collector was seen when the suite's threads were running), so the workers are
    spawned; with no other thread, this process forks them (cheapest)."""
    import threading

    from dynabatch import engines

    global _STARTED
    _STARTED = "forked"
    stop = threading.Event()
    busy = threading.Thread(target=lambda: [list(range(1000)) for _ in iter(stop.is_set, True)], daemon=True)
    busy.start()
    try:
        assert map_parts(_how_started, list(range(4)), None, workers=2, progress=False) == ["imported"] * 4
    finally:
        stop.set()
        busy.join()
        _STARTED = "imported"
    if not engines._other_threads():  # pytest-xdist workers run another thread (execnet's): then nothing forks
        _STARTED = "forked"
        try:
            assert map_parts(_how_started, list(range(4)), None, workers=2, progress=False) == ["forked"] * 4
        finally:
            _STARTED = "imported"
