"""Plan quality on 2-D (encoder-decoder) shapes and rank balance (issue 13, item 5).

T5 pads a micro-batch in both its input and its target length. The DP cuts a 1-D order into
micro-batches; sorting by each sample's own cost mixed short and long targets in one micro-batch
and ended ~7-8% above the objective lower bound on these shapes (1.12x on the real FLAN mixture);
ordering by geometric decoder-length class first brings it to ~6%. Ranks were balanced on the
closed form ``sum + (S-1) * max``, which left simulated makespans 1.5-3% apart; the final swaps
judged by simulation bring them to ~0.5% (padded) and ~1-2% (packed).
"""

from __future__ import annotations

import numpy as np
import pytest

from dynabatch import Shapes
from dynabatch.core.plan.bounds import objective_lower_bound
from dynabatch.core.cost.model import CostModel
from dynabatch.core.options import PlanOptions
from dynabatch.core.plan.planner import _decoder_classes, plan_microbatches, sample_order
from dynabatch.shape_sources import synthetic_shapes
from dynabatch.core.plan.steps import global_batches

OPTIONS = PlanOptions(global_batch_tokens=65536, max_len=2048, max_target_len=512, num_stages=4, num_ranks=8)
NUM_BATCHES = 6


def readme_shapes(n=6000, seed=0) -> Shapes:
    """README's T5-like shapes: lognormal inputs, short lognormal targets."""
    rng = np.random.default_rng(seed)
    return Shapes.from_lengths(np.minimum(rng.lognormal(5.4, 0.9, n).astype(int) + 1, 2048),
                               np.minimum(rng.lognormal(2.0, 1.2, n).astype(int) + 1, 512))


def datasets(model):
    kind = "vision" if model == "vlm" else "text"
    return {"readme": readme_shapes(), "synthetic": synthetic_shapes(kind, 6000, seed=0)[0]}


def plan_stats(model, data, method):
    """(mean obj/LB, mean rank imbalance, max rank imbalance) over the first 65,536-token steps."""
    cost = CostModel.preset(model)
    shapes = datasets(model)[data]
    opts = OPTIONS.replace(method=method, max_len=8192 if model == "vlm" else 2048)
    ratios, imb = [], []
    for pos in global_batches(shapes, cost, opts, 0)[:NUM_BATCHES]:
        batch = shapes.take(pos)
        plan = plan_microbatches(batch, cost, opts)
        lb = objective_lower_bound(batch, cost, num_stages=opts.num_stages, num_ranks=opts.num_ranks,
                                   max_len=opts.max_len, max_target_len=opts.max_target_len,
                                   collation=plan.collation)  # the padded bound for padded plans
        assert plan.objective_s >= lb * (1 - 1e-9)
        assert len(set(plan.microbatches_per_rank().tolist())) == 1  # equal counts kept by the swaps
        ratios.append(plan.objective_s / lb)
        imb.append(plan.rank_imbalance)
    return float(np.mean(ratios)), float(np.mean(imb)), float(np.max(imb))


@pytest.mark.parametrize("data", ["readme", "synthetic"])
def test_t5_dp_objective_close_to_bound(data):
    # against the varlen bound (which cannot see 2-D padding): sorted by own cost alone 1.0695 (readme)
    # and 1.0789 (synthetic), decoder classes 1.061, 1.060; against the padded bound: 1.029, 1.031
    ratio, _, _ = plan_stats("t5", data, "dp")
    assert ratio <= 1.04


@pytest.mark.parametrize("data", ["readme", "synthetic"])
def test_t5_dp_varlen_objective_unchanged(data):
    # packed micro-batches keep the plain order (1.0072 and 1.0046 against the varlen bound when it
    # wrongly required a multiple of the ranks as the micro-batch count; 1.0146 and 1.0119 against the
    # valid one, which minimizes over every count)
    ratio, _, _ = plan_stats("t5", data, "dp_varlen")
    assert ratio <= 1.02


@pytest.mark.parametrize("model", ["t5", "gpt", "vlm"])
@pytest.mark.parametrize("data", ["readme", "synthetic"])
def test_rank_imbalance_padded(model, data):
    # closed-form balance only: mean 1.018-1.045 (max up to 1.078); with the simulated swaps 1.003-1.008
    # for text, 1.013 for vlm's synthetic images (8192-token samples: coarse micro-batches)
    _, mean, worst = plan_stats(model, data, "dp")
    assert mean <= (1.015 if model == "vlm" else 1.01)
    assert worst <= 1.025


@pytest.mark.parametrize("model", ["t5", "gpt", "vlm"])
@pytest.mark.parametrize("data", ["readme", "synthetic"])
def test_rank_imbalance_packed(model, data):
    # closed-form balance only: mean 1.016-1.040; with the simulated swaps 1.003-1.021, 1.029 for
    # vlm's synthetic images (a step whose costliest image alone sets one rank apart stays at 1.085)
    _, mean, _ = plan_stats(model, data, "dp_varlen")
    assert mean <= (1.03 if (model, data) == ("vlm", "synthetic") else 1.025)


def test_decoder_classes_double():
    dec = np.array([0, 1, 16, 17, 32, 33, 64, 65, 512])
    assert _decoder_classes(dec, 8).tolist() == [0, 0, 0, 1, 1, 2, 2, 3, 5]
    assert _decoder_classes(dec, 32).tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 3]


def test_ordering_groups_decoder_classes_for_padded_t5_only():
    cost = CostModel.preset("t5")
    shapes = readme_shapes(500, seed=1)
    main, dec, tiles = cost.sample_dims(shapes, 2048, 512)
    padded = sample_order(cost, main, dec, tiles)
    assert sorted(padded.tolist()) == list(range(len(main)))
    assert np.all(np.diff(_decoder_classes(dec[padded], cost.pad_multiple)) >= 0)
    packed = sample_order(cost, main, dec, tiles, padded=False)
    own, _ = cost.padded(1, main, dec, tiles)
    assert np.all(np.diff(own[packed]) >= 0)


def test_plans_deterministic():
    cost = CostModel.preset("t5")
    shapes = readme_shapes()
    pos = global_batches(shapes, cost, OPTIONS, 0)[0]
    a = plan_microbatches(shapes.take(pos), cost, OPTIONS.replace(method="dp"))
    b = plan_microbatches(shapes.take(pos), cost, OPTIONS.replace(method="dp"))
    assert np.array_equal(a.sample_ids, b.sample_ids) and np.array_equal(a.mb_rank, b.mb_rank)
    assert np.array_equal(a.rank_time_s, b.rank_time_s)
