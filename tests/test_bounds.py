"""The objective lower bound holds for every method and is tight for the DP."""

import numpy as np
import pytest

from dynabatch import CostModel, iteration_lower_bound, plan_microbatches, synthetic_shapes
from dynabatch.core.plan import METHODS, split_global_batches


@pytest.mark.parametrize("model,kind,max_len", [("gpt", "text", 2048), ("t5", "text", 2048), ("vlm", "vision", 8192)])
def test_bound_below_every_plan_and_close_to_dp(model, kind, max_len):
    shapes, _ = synthetic_shapes(kind, 3000, seed=1)
    cost = CostModel.preset(model)
    for k, idx in enumerate(split_global_batches(shapes, 32768, seed=k_seed(model))[:3]):
        batch = shapes.take(idx)
        kw = dict(num_stages=4, num_ranks=4, max_len=max_len, max_target_len=512)
        lb = iteration_lower_bound(batch, cost, **{k2: kw[k2] for k2 in ("num_stages", "max_len", "max_target_len")},
                                   num_ranks=4)
        objs = {m: plan_microbatches(batch, cost, method=m, **kw).objective_s for m in METHODS}
        assert min(objs.values()) >= lb * (1 - 1e-12), objs
        assert min(objs["dp"], objs["dp_varlen"]) <= 1.25 * lb


def k_seed(model):
    return {"gpt": 0, "t5": 1, "vlm": 2}[model]


def test_bound_grows_with_stages_and_shrinks_with_ranks():
    shapes, _ = synthetic_shapes("text", 2000, seed=0)
    cost = CostModel.preset("gpt")
    lb = lambda s, r: iteration_lower_bound(shapes.take(np.arange(300)), cost, num_stages=s, num_ranks=r,  # noqa: E731
                                            max_len=2048)
    assert lb(1, 4) < lb(4, 4) < lb(8, 4)
    assert lb(4, 8) < lb(4, 4)
