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
