"""Per-stage feedback: `FeedbackLoop(stage_reduce="per_stage")` refits each stage's time coefficients
(`CostModel.stage_time_coef`), so predicted per-stage times converge to the measured ones."""

import copy
import multiprocessing as mp
import sys
from pathlib import Path

import numpy as np
import pytest

from dynabatch import CostModel, Shapes, plan_microbatches
from dynabatch.core.plan.feedback import FeedbackLoop
from dynabatch.core.cost.fit import mape
from dynabatch.core.cost.stages import StageLayout
from dynabatch.pipeline.measure.timing import StepTiming

sys.path.insert(0, str(Path(__file__).parent))  # the launched workers import this file by path
from test_feedback import CFG, DEVICE, TRUE_B, FakeStep, _slowed

S = 3
KW = dict(num_stages=S, num_ranks=2, max_len=256)


def model():
    return CostModel(CFG, DEVICE)


def truth(cm):
    """3 stages that cost differently: stage 0 pays 2x per main token, stage 2 an extra fixed overhead."""
    base = cm.prior_time_coef * TRUE_B
    rows = np.repeat(base[None, :], S, axis=0)
    rows[0, 0] *= 2.0
    rows[2, 7] += 3.0 * base[7]
    return rows


def timings(plan, phi, rows, rng, noise=0.03):
    """Every rank's StepTiming of ``plan``: stage s of micro-batch j takes ``phi[j] @ rows[s]`` (+ noise)."""
    out = []
    for d in range(plan.num_ranks):
        sel = plan.mb_rank == d
        for s in range(len(rows)):
            t = phi[sel] @ rows[s] * rng.lognormal(0.0, noise, int(sel.sum()))
            out.append(StepTiming(0, d * len(rows) + s, s, d, t / 3, 2 * t / 3, 0.0, 1.0))
    return out


def run(loop, rows, steps=20, seed=0):
    rng = np.random.default_rng(seed)
    plans = []
    for k in range(steps):
        shapes = Shapes.from_lengths(input_tokens=rng.integers(4, 256, 48), target_tokens=np.zeros(48, int))
        plan = loop.plan(shapes, step=k, **KW)
        loop.record_step(FakeStep([], plan, shapes, k), timings(plan, loop.features(plan), rows, rng))
        loop.maybe_refit()
        plans.append(plan)
    return plans


def stage_errors(cm, rows, seed=99):
    """Per-stage MAPE of ``cm``'s predicted stage times on fresh micro-batches, against the truth."""
    rng = np.random.default_rng(seed)
    phi = cm.padded_features(rng.integers(1, 9, 300), rng.integers(1, 33, 300) * 8, 0, 0)
    pred = cm.stage_times(phi, S)
    return np.array([mape(pred[s], phi @ rows[s]) for s in range(S)])


def test_per_stage_loop_learns_each_stage_where_max_cannot():
    cm = model()
    rows = truth(cm)
    loop = FeedbackLoop(cm, refit_every=2, forgetting=0.9, stage_reduce="per_stage")
    start = stage_errors(cm, rows)
    plans = run(loop, rows)
    end = stage_errors(cm, rows)
    assert start.min() > 0.2 and np.all(end < 0.05), (start, end)
    # the refit rows: one per stage, time_coef their mean, one version per refit
    assert cm.stage_time_coef.shape == (S, len(cm.time_coef)) and cm.version == len(loop.history) == 10
    np.testing.assert_allclose(cm.time_coef, cm.stage_time_coef.mean(axis=0))
    row = loop.history[-1]
    assert len(row.stage_mape_before) == len(row.stage_mape_after) == S
    assert np.array_equal(np.array(row.stage_time_coef), cm.stage_time_coef)
    first, last = loop.step_errors[0].stage_mape, loop.step_errors[-1].stage_mape
    assert len(first) == S and max(last) < 0.1 < min(first), (first, last)
    # a uniform model with differing fitted rows is stage-aware: the planner prices every stage
    assert plans[0].stage_time_s is None and plans[-1].stage_time_s is not None
    assert cm.stage_aware and cm.layout.name == "uniform" and plans[-1].options["layout"]["name"] == "uniform"
    np.testing.assert_array_equal(plans[-1].mb_time_s, plans[-1].stage_time_s.max(axis=0))

    # the slowest-stage loop fits one row: it cannot tell the stages apart
    blind = model()
    run(FeedbackLoop(blind, refit_every=2, forgetting=0.9), rows)
    err = stage_errors(blind, rows)
    assert not blind.stage_aware and blind.stage_time_coef is None
    assert err.max() > 0.2 and err.max() > 5 * end.max(), (err, end)


def test_per_stage_rows_survive_copies_and_serialization_and_plan_the_same():
    cm = model()
    run(FeedbackLoop(cm, refit_every=2, stage_reduce="per_stage"), truth(cm), steps=6)
    shapes = Shapes.from_lengths(input_tokens=np.arange(4, 200, 4), target_tokens=np.zeros(49, int))
    ref = plan_microbatches(shapes, cm, **KW).fingerprint()
    for other in (CostModel.from_dict(cm.to_dict()), copy.deepcopy(cm), copy.copy(cm), cm.snapshot()):
        np.testing.assert_array_equal(other.stage_time_coef, cm.stage_time_coef)
        assert plan_microbatches(shapes, other, **KW).fingerprint() == ref
    # a scalar refit (assigning time_coef) drops the rows: plans are those of a model never refit per stage
    scalar = model()
    scalar.time_coef = cm.time_coef.copy()
    cm.time_coef = cm.time_coef.copy()
    assert cm.stage_time_coef is None and not cm.stage_aware
    assert plan_microbatches(shapes, cm, **KW).fingerprint() == plan_microbatches(shapes, scalar, **KW).fingerprint()


def test_a_stage_layout_model_refits_its_rows_and_keeps_zeros():
    """On a contiguous layout a stage without vision layers keeps zero vision coefficients."""
    cm = CostModel.preset("vlm", num_stages=4, layout="contiguous")
    prior = cm.stage_time_rows()
    assert np.array_equal(prior, cm.time_coef * cm.stage_scale_rows())
    loop = FeedbackLoop(cm, refit_every=1, stage_reduce="per_stage")
    rng = np.random.default_rng(1)
    phi = cm.packed_features(rng.integers(300, 3000, 40), np.zeros(40), rng.integers(0, 8, 40), np.arange(40))
    measured = cm.stage_times(phi) * np.array([[1.5], [1.0], [1.0], [0.8]])
    loop.record(phi, measured)
    row = loop.maybe_refit()
    assert row.stage_mape_after[0] < 0.05 < row.stage_mape_before[0]
    assert np.all(cm.stage_time_coef[prior == 0] == 0)
    np.testing.assert_allclose(cm.stage_times(phi), measured, rtol=0.05)
    with pytest.raises(ValueError, match="shape"):
        loop.record(phi, measured[0])
    # the layout's scale times time_coef still gives every stage's row (what the planner's DP candidates use)
    np.testing.assert_allclose(cm.time_coef * cm.stage_scale_rows(), cm.stage_time_coef, rtol=1e-12)


def _child(cm, go, conn):
    go.wait(30)
    conn.send((cm.version, None if cm.stage_time_coef is None else cm.stage_time_coef.copy()))


def test_forked_child_sees_a_per_stage_refit_made_after_the_fork():
    cm = model().share_memory()
    ctx = mp.get_context("fork")
    go = ctx.Event()
    a, b = ctx.Pipe()
    p = ctx.Process(target=_child, args=(cm, go, b))
    p.start()
    rows = truth(cm)
    cm.set_stage_time_coef(rows)
    go.set()
    assert a.poll(30)
    version, seen = a.recv()
    p.join(30)
    assert version == cm.version == 1
    np.testing.assert_array_equal(seen, rows)
    # another layout on a copy takes the copy off the shared rows, never the original
    other = copy.copy(cm).set_layout(StageLayout((1, 2, 3), (0, 0, 0), (0, 0, 0)))
    assert other.stage_time_coef is None and cm.stage_time_coef is not None


# ----------------------------------------------------------------------------- a real uneven pipeline


def uneven_worker(rank, world, port, steps):
    """gpt-tiny with 4 blocks split 1 + 3 over 2 gloo stages (every block sleeps a cost the prior does
    not know): a per-stage loop fed the gathered timings of every step."""
    import torch

    from dynabatch.pipeline import (PipelineRunner, RunnerConfig, init_pipeline, make_model, split_model,
                                    stage_cost_model)
    from dynabatch.pipeline.models import plan_shapes

    torch.set_num_threads(1)
    with init_pipeline(2, rank=rank, world_size=world, master_port=port, timeout_s=30, abort_after_s=10) as ctx:
        model = make_model("gpt-tiny", vocab=64, hidden=64, layers=4, heads=2, max_positions=4096, seed=0)
        cost = stage_cost_model(model, 2, "cpu")  # uniform: 2 blocks per stage
        fb = FeedbackLoop(cost, refit_every=3, forgetting=0.9, stage_reduce="per_stage")
        layers = [_slowed(layer) if 0 < i < 5 else layer for i, layer in enumerate(model.layers)]  # the blocks
        runner = PipelineRunner(split_model(layers, [0, 2, 6])[ctx.stage], model.boundary, ctx,
                                RunnerConfig(gather_timing=True))
        opt = torch.optim.SGD(runner.parameters(), lr=0.05)
        rng = np.random.default_rng(0)  # the same global batches on every rank
        limit = float(cost.padded(8, 256)[1][0])
        prints = []
        for k in range(steps):
            shapes = Shapes.from_lengths(input_tokens=rng.integers(8, 256, 32), target_tokens=np.zeros(32, int))
            plan = fb.plan(shapes, num_stages=2, max_len=256, memory_limit=limit, step=k, method="dp")
            prints.append(plan.fingerprint())
            batches = [model.random_batch(sh, torch.Generator().manual_seed(100 * k + j))
                       for j, sh in enumerate(plan_shapes(plan, 0))]
            result = runner.step(plan, batches, optimizer=opt)
            fb.record_step(FakeStep(batches, plan, shapes, k), result)
            fb.maybe_refit()
        return {"stage_mape": [list(e.stage_mape) for e in fb.step_errors], "version": cost.version,
                "rows": cost.stage_time_coef.tolist(), "prints": prints, "aware": cost.stage_aware,
                "first_before": list(fb.history[0].stage_mape_before)}


def test_per_stage_feedback_on_a_real_uneven_two_stage_pipeline():
    """Every rank refits the same per-stage rows from the gathered timings, plans the same plans, and
    each stage's prediction error falls well below the prior's."""
    from dynabatch.pipeline import launch_local

    steps = 15
    res = launch_local(f"{__file__}:uneven_worker", 2, args=(steps,), timeout_s=120)
    for r in res:
        assert r.returncode == 0 and not r.timed_out, r.stderr[-3000:]
    a, b = (r.result for r in res)
    assert a["rows"] == b["rows"] and a["prints"] == b["prints"] and a["version"] == b["version"] == steps // 3
    assert a["aware"]
    err = np.array(a["stage_mape"])  # [steps, 2]
    end = np.median(err[-5:], axis=0)
    print("per-stage MAPE: first refit's before", np.round(a["first_before"], 3), "-> median of the last 5",
          np.round(end, 3))
    assert np.all(np.isfinite(err))
    assert np.all(end < 0.7 * np.array(a["first_before"])), (a["first_before"], end)
    rows = np.array(a["rows"])
    assert rows[1] @ np.r_[2048, 0, 0, 0, 0, 0, 0, 1, 0, 0] > 1.5 * rows[0] @ np.r_[2048, 0, 0, 0, 0, 0, 0, 1, 0, 0]


# ----------------------------------------------------------------------------- zeros of the stage layout


def test_fit_relative_frees_a_zero_prior_coefficient_only_where_scale_says():
    rng = np.random.default_rng(3)
    phi = np.c_[rng.uniform(1, 9, 60), rng.uniform(100, 2000, 60), np.ones(60)]
    truth = np.array([2e-3, 3e-7, 5e-4])
    y = phi @ truth
    prior = np.array([1e-3, 0.0, 1e-3])
    kept = fit_relative_(phi, y, prior)
    assert kept[1] == 0.0  # a zero prior stays 0 without a scale
    freed = fit_relative_(phi, y, prior, scale=np.array([0.0, 1e-5, 0.0]))
    np.testing.assert_allclose(freed, truth, rtol=1e-3)
    assert mape(phi @ freed, y) < 1e-3 < mape(phi @ kept, y)
    # a freed column the data does not need is pulled to 0 (no cost from nothing), and never negative
    np.testing.assert_allclose(fit_relative_(phi, phi[:, [0, 2]] @ truth[[0, 2]], prior,
                                             scale=np.array([0.0, 1e-5, 0.0]))[1], 0.0, atol=1e-12)
    # robust_fit passes the scale through; without one it is fit_relative's old answer exactly
    from dynabatch.core.cost.fit import robust_fit

    w = np.ones(60)
    np.testing.assert_allclose(robust_fit(phi, y, w, prior, prior, scale=np.array([0, 1e-5, 0])), truth, rtol=0.02)
    np.testing.assert_array_equal(robust_fit(phi, y, w, prior, prior), robust_fit(phi, y, w, prior, prior, scale=None))


def fit_relative_(phi, y, prior, scale=None):
    from dynabatch.core.cost.fit import fit_relative

    return fit_relative(phi, y, np.ones(len(y)), prior, 1e-6, scale)


def vlm_split():
    """vlm-tiny's cost model on its runner split (4 ViT blocks | 2 GPT blocks) and the per-stage law of
    a vision stage that also pays per language token (the layout bookkeeping of every micro-batch) and
    a language stage that also pays per vision token (the merge): neither is in the layout's prior."""
    from dynabatch.bench.train_vlm import VLM_SIZES, layout_of, modality_bounds
    from dynabatch.pipeline import make_model, stage_cost_model

    m = make_model("vlm-tiny", **VLM_SIZES, seed=0)
    cost = stage_cost_model(m, 2, "cpu").set_layout(layout_of(m, modality_bounds(m, 2)))
    rows = np.zeros((2, len(cost.time_coef)))
    #            n_main  q_main   n_vis   q_vis   one     has_vis
    rows[0, [0, 5, 6, 7, 8]] = [2e-7, 2.6e-5, 1.6e-8, 4e-4, 3.8e-3]
    rows[1, [0, 1, 5, 7, 8]] = [3e-5, 4e-8, 1.5e-6, 4.1e-3, 2e-4]
    return cost, rows, m


def vlm_steps(cost, rows, steps, seed=0, noise=0.03):
    """``steps`` steps of 24 micro-batches, half text-only, timed on both stages by the law ``rows``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        tiles = np.where(rng.random(24) < 0.5, 0, rng.integers(1, 40, 24))
        phi = cost.padded_features(rng.integers(1, 9, 24), rng.integers(2, 256, 24) * 8, 0, tiles)
        out.append((phi, (phi @ rows.T).T * rng.lognormal(0.0, noise, (2, 24))))
    return out


@pytest.mark.parametrize("fit_zeros", [True, False])
def test_per_stage_refit_fits_each_stage_of_a_vision_language_split(fit_zeros):
    """Each stage's own law is recovered per stage (the vision stage's text-only micro-batches included)
    with fit_layout_zeros; without it the layout's zeros stay and the vision stage's text-only
    micro-batches, whose time grows with their tokens, keep a large error; a slowest-stage refit cannot
    price either stage."""
    from dynabatch.bench.train_vlm import stage_computes

    cost, rows, m = vlm_split()
    prior = cost.stage_time_rows()
    loop = FeedbackLoop(cost, refit_every=2, forgetting=0.8, stage_reduce="per_stage", fit_layout_zeros=fit_zeros)
    for phi, Y in vlm_steps(cost, rows, 16):
        loop.record(phi, Y)
        loop.maybe_refit()
    (phi, Y), = vlm_steps(cost, rows, 1, seed=7, noise=0.0)
    P = cost.stage_times(phi)
    comp = stage_computes(m, [0, 6, 10], phi)
    err = [[mape(P[s][c], Y[s][c]) for c in (comp[s], ~comp[s]) if c.any()] for s in range(2)]
    assert comp[1].all() and 0 < comp[0].sum() < len(phi)  # the vision stage skips the text-only ones
    if fit_zeros:
        # (the vision stage's computing micro-batches within the ridge's pull towards a prior 16x off)
        assert err[0][0] < 0.05 and err[0][1] < 0.02 and err[1][0] < 0.02, err
        assert cost.stage_time_coef[0, 0] > 0 and cost.stage_time_coef[1, 5] > 0  # learned beyond the layout
        assert np.all(cost.stage_time_coef[:, [2, 3, 4]] == 0)  # no stage prices decoder features: still 0
    else:
        assert np.all(cost.stage_time_coef[prior == 0] == 0)
        assert err[0][0] < 0.05 and err[1][0] < 0.02, err  # each stage's own law, as far as its prior allows
        assert err[0][1] > 0.15, err  # but the vision stage's text-only micro-batches grow with their tokens
    blind = vlm_split()[0]
    mx = FeedbackLoop(blind, refit_every=2, forgetting=0.8, stage_reduce="max")
    for phi_k, Y_k in vlm_steps(blind, rows, 16):
        mx.record(phi_k, Y_k.max(axis=0))
        mx.maybe_refit()
    Pb = blind.stage_times(phi)
    assert mape(Pb[0], Y[0]) > 1.0  # priced as the slowest stage: the vision stage is off by multiples


def test_fit_layout_zeros_needs_per_stage():
    with pytest.raises(ValueError, match="per_stage"):
        FeedbackLoop(model(), fit_layout_zeros=True)
