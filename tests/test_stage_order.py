"""`insertion_search` (numba) against its plain-Python reference, and `refine_orders` on per-stage plans."""

import numpy as np
import pytest

from dynabatch import PlanOptions, Shapes, plan_microbatches
from dynabatch.core.cost.model import CostModel
from dynabatch.core.kernels.simulate import schedule_kernel
from dynabatch.core.kernels.stage_order import insertion_search, insertion_search_reference
from dynabatch.core.plan.stage_plan import refine_orders


@pytest.mark.parametrize("seed", range(6))
def test_kernel_matches_reference(seed):
    rng = np.random.default_rng(seed)
    S, k = int(rng.integers(2, 5)), int(rng.integers(2, 8))
    st = rng.uniform(0.1, 1.0, (S, k))
    st[: S // 2, rng.random(k) < 0.4] *= 0.05  # some micro-batches skip most of the front stages
    p2p = rng.uniform(0, 0.05, k)
    movable = st[S // 2:].sum(axis=0) > st[: S // 2].sum(axis=0)
    for code in (0, 1):
        ops = schedule_kernel(S, k, code)
        order = np.arange(k, dtype=np.int64)
        got = insertion_search(st, p2p, 1 / 3, ops, order, movable, 2)
        ref_order, ref = insertion_search_reference(st, p2p, 1 / 3, ops, np.arange(k), movable, 2)
        assert list(order) == ref_order and got == pytest.approx(ref, rel=1e-12)
        assert sorted(order) == list(range(k))


def test_moves_lower_the_makespan_and_keep_the_rest():
    """Three text-only micro-batches (no front-stage time) behind ten vision-heavy ones: moving them in
    between the vision-heavy ones fills the back stages' idle time (17.6 -> 17.0 s)."""
    st = np.zeros((4, 13))
    st[:2, :10], st[2:, :10], st[2:, 10:] = 1.2, 0.8, 1.5
    ops = schedule_kernel(4, 13, 1)
    order = np.arange(13, dtype=np.int64)
    movable = np.arange(13) >= 10
    start = insertion_search_reference(st, np.zeros(13), 1 / 3, ops, list(range(13)), np.zeros(13, bool), 1)[1]
    got = insertion_search(st, np.zeros(13), 1 / 3, ops, order, movable, 2)
    assert start == pytest.approx(17.6) and got == pytest.approx(17.0)
    assert sorted(order) == list(range(13)) and list(order[:3]) == [0, 1, 2]
    # only movable micro-batches move: the vision-heavy ones keep their relative order
    assert [int(j) for j in order if j < 10] == list(range(10))


def test_refine_orders_on_a_vision_text_mix():
    """Stage-aware vlm plans of an image+text / text-only mix: refining never slows a rank, changes no
    rank's micro-batches, and on this mix lowers the step time."""
    from dynabatch.core.plan.stage_plan import evaluate_plan

    rng = np.random.default_rng(0)
    n = 240
    tiles = np.where(rng.random(n) < 0.5, rng.integers(1, 9, n), 0)
    text = rng.integers(40, 2000, n)
    shapes = Shapes.from_lengths(text, vision_tokens=tiles * 256)
    cost = CostModel.preset("vlm", num_stages=4, layout="contiguous")
    plan = plan_microbatches(shapes, cost, PlanOptions(method="dp", num_stages=4, num_ranks=2, max_len=8192))
    assert plan.schedule in ("1f1b", "gpipe")
    # the same plan with each rank's order reversed, then refined
    blocks = [np.flatnonzero(plan.mb_rank == r) for r in range(plan.num_ranks)]
    from dynabatch.core.plan.stage_plan import _permuted

    rev = np.concatenate([b[::-1] for b in blocks])
    shuffled = evaluate_plan(_permuted(plan, rev, plan.rank_time_s), cost)
    refined = refine_orders(shuffled, cost)
    assert np.all(refined.rank_time_s <= shuffled.rank_time_s + 1e-12)
    assert refined.iteration_time_s < shuffled.iteration_time_s
    again = evaluate_plan(refined, cost)  # its recorded times are what its order simulates to
    assert np.allclose(again.rank_time_s, refined.rank_time_s)
    for r in range(plan.num_ranks):
        a = refined.mb_offsets
        ids = lambda p: sorted(int(i) for k in np.flatnonzero(p.mb_rank == r)
                               for i in p.sample_ids[p.mb_offsets[k]:p.mb_offsets[k + 1]])
        assert ids(refined) == ids(plan)
        assert a[-1] == len(refined.sample_ids)
