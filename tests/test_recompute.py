"""Per-stage activation recomputation (issue 14): the peak kernel, the planner's choice, the runner.

Rank-side workers (`grad_worker`, `memory_worker`) live in this file; `launch_local` runs them by
path on 2 gloo stages."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the workers import this file by path, and its neighbours

from dynabatch import PlanOptions, Shapes, plan_microbatches  # noqa: E402
from dynabatch.core.cost.model import CostModel
from dynabatch.core.kernels.recompute import stage_peaks, stage_peaks_reference
from dynabatch.core.kernels.simulate import schedule_kernel
from dynabatch.core.plan.recompute import StageMemory, recompute_costs
from dynabatch.pipeline import launch_local
from test_pipeline_dist import ok as _ok  # noqa: E402 (every rank exited 0 without a timeout; their results)
from dynabatch.loader.settings import records_from_keywords

TINY = {"gpt-tiny": dict(vocab=64, hidden=16, layers=4, heads=2, max_positions=256),
        "t5-tiny": dict(vocab=64, hidden=16, encoder_layers=2, decoder_layers=2, heads=2, max_positions=128)}


@pytest.mark.parametrize("code", [0, 1])
def test_stage_peaks_kernel_matches_reference(code):
    rng = np.random.default_rng(code)
    for S, m in [(1, 1), (2, 5), (4, 9), (3, 2)]:
        ops = schedule_kernel(S, m, code)
        mem = rng.uniform(0, 10, (S, m))
        out = np.empty(S)
        stage_peaks(ops, mem, out)
        assert np.allclose(out, stage_peaks_reference(ops, mem), rtol=0, atol=1e-12)
        # 1F1B holds at most S - s micro-batches on stage s, GPipe all of them
        held = min(S, m) if code == 1 else m
        assert out[0] <= np.sort(mem[0])[::-1][:held].sum() + 1e-12


def _shapes(n=160, seed=0):
    rng = np.random.default_rng(seed)
    return Shapes.from_lengths(rng.integers(64, 6000, n))


def _uniform_peaks(cost, shapes, opts, top):
    """Predicted per-stage peaks of the plan with k layers recomputed on every stage, k = 0..top."""
    out = []
    for k in range(top + 1):
        p = plan_microbatches(shapes, cost, opts.replace(recompute="none", device_memory_limit=None))
        peaks = _peaks_with(cost, p, np.full(p.num_stages, k))
        out.append(peaks)
    return np.array(out)


def _peaks_with(cost, plan, k):
    from dynabatch.core.plan.recompute import _peaks_and_times
    from dynabatch.core.cost.features import microbatch_features

    phi = microbatch_features(plan, cost)
    st, held, _ = recompute_costs(cost, phi, k)
    return _peaks_and_times(plan, st, held, cost.p2p_time(phi), cost.forward_fraction, np.inf)[0]


def test_adaptive_recomputes_fewer_layers_on_later_stages():
    """At a device limit where full recomputation is the only uniform choice that fits, the planner's
    per-stage choice fits every stage, recomputes fewer layers on the later 1F1B stages (which hold
    fewer micro-batches) and is faster than full recomputation."""
    cost = CostModel.preset("gpt", num_stages=4)
    shapes = _shapes()
    opts = PlanOptions(method="dp", num_stages=4, num_ranks=2, schedule="1f1b")
    top = int(StageMemory.analytic(cost, 4).max_layers()[0])
    peaks = _uniform_peaks(cost, shapes, opts, top).max(axis=1)  # [k]: the largest stage peak
    assert np.all(np.diff(peaks) < 0)
    limit = 0.5 * (peaks[-1] + peaks[-2])  # only k = top fits uniformly
    full = plan_microbatches(shapes, cost, opts.replace(recompute="full", device_memory_limit=limit))
    with pytest.raises(ValueError, match="stage 0 holds"):
        plan_microbatches(shapes, cost, opts.replace(recompute="none", device_memory_limit=limit))
    ada = plan_microbatches(shapes, cost, opts.replace(recompute="adaptive", device_memory_limit=limit))
    k = ada.options["recompute_layers"]
    assert all(p <= limit for p in ada.options["stage_peak_bytes"])
    assert k[-1] < top and k[0] >= k[-1] and sum(k) < 4 * top, k
    assert full.options["recompute_layers"] == [top] * 4
    assert ada.iteration_time_s < full.iteration_time_s
    # the prediction equals the recomputation of the recorded counts on the recorded plan
    assert np.allclose(_peaks_with(cost, ada, np.array(k)), ada.options["stage_peak_bytes"])
    # determinism
    again = plan_microbatches(shapes, cost, opts.replace(recompute="adaptive", device_memory_limit=limit))
    assert again.options == ada.options and np.array_equal(again.sample_ids, ada.sample_ids)


def test_recompute_prices_time_and_memory_per_stage():
    cost = CostModel.preset("gpt", num_stages=4)
    phi = cost.padded_features(np.array([4, 1]), np.array([2048, 512]), np.array([0, 0]), np.array([0, 0]))
    st0, m0, w0 = recompute_costs(cost, phi, [0, 0, 0, 0])
    st1, m1, w1 = recompute_costs(cost, phi, [4, 2, 0, 0])  # 4 layers per stage
    assert np.all(w0 == 0) and w1[0] > 0 and w1[3] == 0
    assert np.all(st1[0] > st0[0]) and np.all(st1[1] > st0[1]) and np.array_equal(st1[2:], st0[2:])
    # full recompute adds the forward share of the layers' time (no fixed per-micro-batch terms)
    assert np.all(st1[0] < st0[0] * (1 + cost.forward_fraction) + 1e-12)
    assert np.all(m1[0] < 0.2 * m0[0]) and np.all(m0[1] > m1[1]) and np.all(m1[1] > m1[0])
    with pytest.raises(ValueError, match="already prices full"):
        StageMemory.analytic(cost.with_model(recompute=True), 4)


def test_plan_file_keeps_the_choice():
    """The per-stage counts and predicted peaks travel in the plan file's step options, the runner
    reads them back per stage."""
    from dynabatch.core.plan.recompute import recompute_layers
    from dynabatch.planfile import plan_from_arrow, plans_to_arrow

    cost = CostModel.preset("gpt", num_stages=4)
    shapes = _shapes(80)
    opts = PlanOptions(method="dp", num_stages=4, num_ranks=2)
    none = plan_microbatches(shapes, cost, opts.replace(device_memory_limit=1e15))
    limit = 0.6 * max(none.options["stage_peak_bytes"])
    plans = [plan_microbatches(shapes, cost, opts.replace(recompute="adaptive", device_memory_limit=limit), step=i)
             for i in range(2)]
    back = plan_from_arrow(plans_to_arrow(plans), step=1)
    for key in ("recompute", "recompute_layers", "stage_peak_bytes", "device_memory_limit"):
        assert back.options[key] == plans[1].options[key], key
    assert [recompute_layers(back, s) for s in range(4)] == plans[1].options["recompute_layers"]
    assert recompute_layers(none, 0) == 0 and none.options["recompute_layers"] == [0, 0, 0, 0]
    assert np.allclose(back.stage_memory_bytes, plans[1].stage_memory_bytes)


def test_bad_recompute_options_are_refused():
    with pytest.raises(ValueError, match="unknown recompute"):
        PlanOptions(recompute="some")
    with pytest.raises(ValueError, match="needs device_memory_limit"):
        PlanOptions(recompute="adaptive")
    with pytest.raises(ValueError, match="device_memory_limit"):
        PlanOptions(device_memory_limit=-1)


# ---------------------------------------------------------------------------------------------
# 2 gloo stages


def grad_worker(rank, world, port):
    """Loss and gradients with recompute none / full / first layer only equal a single process's."""
    import torch

    from dynabatch.pipeline import PipelineRunner, RunnerConfig, init_pipeline, make_model, sequential_step
    from dynabatch.pipeline.models.vlm import vlm_tiny
    from test_pipeline_workers import replica_batches, synthetic_plan

    ctx = init_pipeline(2, rank=rank, world_size=world, master_port=port, timeout_s=30, abort_after_s=10)
    out = []
    cases = [("gpt-tiny", [0, 3, 6], "padded"), ("gpt-tiny", [0, 3, 6], "packed"), ("t5-tiny", [0, 3, 6], "padded"),
             ("vlm-tiny", None, "padded")]
    with ctx:
        for name, bounds, collation in cases:
            for policy in ["none", "full", (1, 1), (0, 2)]:
                if name == "vlm-tiny":
                    model = vlm_tiny(vocab=64, hidden=16, layers=2, heads=2, vision_hidden=16, vision_layers=2,
                                     vision_heads=2, max_positions=256, seed=1)
                    ref = vlm_tiny(vocab=64, hidden=16, layers=2, heads=2, vision_hidden=16, vision_layers=2,
                                   vision_heads=2, max_positions=256, seed=1)
                    bounds = [0, 4, len(model.layers)]
                else:
                    model = make_model(name, **TINY[name], seed=1)
                    ref = make_model(name, **TINY[name], seed=1)
                runner = PipelineRunner.from_model(model, ctx, bounds, RunnerConfig(schedule="1f1b", recompute=policy))
                rng = np.random.default_rng(3)
                if name == "vlm-tiny":
                    batches = _vlm_batches(model)
                    shapes = model.batch_shapes(batches)
                    res = runner.step(shapes, batches)
                    every = batches
                else:
                    plan = synthetic_plan(rng, collation=collation, num_ranks=1, num_stages=2, mbs=(3, 4),
                                          max_target=10 if name == "t5-tiny" else 0, step=0)
                    every = replica_batches(model, plan, 0, seed=0)
                    res = runner.step(plan, every)
                ref_loss, ref_n = sequential_step(ref.layers, every)
                lo = runner.stage.first_layer
                diff = scale = 0.0
                for i, layer in enumerate(runner.stage.layers):
                    for p, q in zip(layer.parameters(), ref.layers[lo + i].parameters()):
                        if q.grad is None:
                            continue
                        diff = max(diff, float((p.grad - q.grad).abs().max()))
                        scale = max(scale, float(q.grad.abs().max()))
                out.append({"case": f"{name}/{collation}/{policy}", "loss": res.loss, "ref": ref_loss,
                            "diff": diff, "scale": scale, "k": res.timing.recompute_layers,
                            "peak": res.timing.peak_saved_bytes, "tokens": res.num_tokens, "ref_tokens": ref_n})
    return out


def _vlm_batches(model):
    import torch

    gen = torch.Generator().manual_seed(5)
    out = []
    for rows, length, tiles in [(2, 12, [1, 2]), (3, 8, [0, 0, 0]), (1, 20, [3])]:
        ids = torch.randint(1, 64, (rows, length), generator=gen)
        b = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
             "image_tiles": torch.tensor(tiles)}
        if sum(tiles):
            b["pixel_values"] = torch.randn(sum(tiles), 3, model.tile_size, model.tile_size, generator=gen)
        out.append(b)
    return out


def test_gradients_equal_with_any_recompute_policy():
    res = _ok(launch_local(f"{__file__}:grad_worker", 2, timeout_s=180.0))
    seen = set()
    for rank, cases in enumerate(res):
        for c in cases:
            assert c["tokens"] == c["ref_tokens"], c
            assert abs(c["loss"] - c["ref"]) <= 1e-5 * abs(c["ref"]), c
            assert c["scale"] > 0 and c["diff"] <= 1e-5 * c["scale"] + 1e-9, c
            seen.add((rank, c["case"], c["k"]))
        by = {c["case"]: c for c in cases}
        for prefix in ("gpt-tiny/padded", "gpt-tiny/packed", "t5-tiny/padded", "vlm-tiny/padded"):
            none, full = by[f"{prefix}/none"], by[f"{prefix}/full"]
            assert none["k"] == 0 and full["k"] > 0
            # recomputation keeps only layer inputs: the metered bytes fall
            assert full["peak"] < 0.8 * none["peak"], (prefix, rank, none["peak"], full["peak"])
    assert len(seen) == 2 * 16


def memory_worker(rank, world, port, fractions):
    """FLAN-like generated records through the DataLoader (byte tokens, padded, 2 stages) planned with
    the measured stage memory of gpt-tiny: per device limit, the metered peak of every stage under the
    planner's choice, under no recomputation and the predicted peaks."""
    import torch

    from dynabatch import DataLoader, datagen
    from dynabatch.pipeline import PipelineRunner, RunnerConfig, init_pipeline, make_model, stage_cost_model
    from dynabatch.pipeline.measure.memory import measured_stage_memory

    ctx = init_pipeline(2, rank=rank, world_size=world, master_port=port, timeout_s=60, abort_after_s=10)
    bounds = [0, 3, 6]
    out = {"levels": []}
    with ctx:
        model = make_model("gpt-tiny", **{**TINY["gpt-tiny"], "vocab": 320}, seed=1)  # byte tokens + specials
        cost = stage_cost_model(model, 2, "cpu")
        cost.stage_memory_model = measured_stage_memory(model, bounds, cost)
        records = datagen.text_records(48, seed=3)
        common = dict(tokenizer="bytes", collate="padded", global_batch_tokens=3000, max_len=256, num_stages=2,
                      cost_model=cost, rank=0, world_size=1, seed=0, progress=False)
        base = DataLoader(records, **records_from_keywords(dict(**common, device_memory_limit=1e15)))
        steps = list(base)[:3]
        top = max(max(s.plan.options["stage_peak_bytes"]) for s in steps)
        runner = PipelineRunner.from_model(model, ctx, bounds, RunnerConfig(schedule="1f1b"))
        for frac in fractions:
            limit = frac * top
            loader = DataLoader(records,
                                **records_from_keywords(dict(**common, recompute="adaptive", device_memory_limit=limit)))
            level = {"limit": limit, "steps": []}
            for step, none_step in zip(list(loader)[:3], steps):
                res = runner.step(step.plan, list(step))
                ref = runner.step(none_step.plan, list(none_step))  # the plan that ignores the limit
                level["steps"].append({"k": step.plan.options["recompute_layers"],
                                       "planned": res.planned_peak_bytes, "measured": res.timing.peak_saved_bytes,
                                       "none_planned": ref.planned_peak_bytes,
                                       "none_measured": ref.timing.peak_saved_bytes})
            out["levels"].append(level)
    return out


def test_measured_activation_bytes_stay_under_the_planned_limit():
    """On FLAN-like DataLoader micro-batches, 2 gloo stages: with the planner's per-stage recompute
    the bytes each stage's in-flight micro-batches keep (metered by saved-tensor hooks) never exceed
    the device limit the planner was given, while the same steps planned without recomputation do;
    the plan's predicted peak bounds the measured one."""
    res = _ok(launch_local(f"{__file__}:memory_worker", 2, args=([0.45, 0.7],), timeout_s=240.0))
    over = 0
    for rank, out in enumerate(res):
        for level in out["levels"]:
            for s in level["steps"]:
                assert s["measured"] <= level["limit"], (rank, level["limit"], s)
                assert s["measured"] <= s["planned"] * (1 + 1e-9), s
                assert s["none_measured"] <= s["none_planned"] * (1 + 1e-9), s
                over += s["none_measured"] > level["limit"]
    assert over >= 4, "the limits must be tight enough that ignoring them breaks them"
    # per stage, not uniform: some steps recompute fewer than all 2 + 2 layers, and the stages differ
    # (here the last stage, whose head keeps vocabulary-wide logits, can need more than the first)
    ks = [tuple(s["k"]) for out in res for level in out["levels"] for s in level["steps"]]
    assert any(sum(k) < 4 for k in ks) and any(k[0] != k[1] for k in ks) and any(sum(k) > 0 for k in ks), ks


def test_partition_search_respects_the_memory_limit():
    """The time-balanced split keeps 2 x 20 bytes on stage 0 under 1F1B; under a 25-byte limit the search
    moves a memory-heavy layer off it, and refuses when nothing fits."""
    from dynabatch.pipeline.models import LayerCosts
    from dynabatch.pipeline import balanced_partition

    t = np.ones((4, 2))
    costs = LayerCosts(t, 2 * t, memory_bytes=np.array([[10.0, 10], [10, 10], [1, 1], [1, 1]]))
    assert balanced_partition(costs, 2).bounds == (0, 2, 4)
    assert balanced_partition(costs, 2, memory_limit=25.0).bounds == (0, 1, 4)
    assert balanced_partition(costs, 2, memory_limit=25.0, exhaustive_limit=0).bounds == (0, 1, 4)
    with pytest.raises(ValueError, match="memory_limit"):
        balanced_partition(costs, 2, memory_limit=5.0)


def test_plan_command_records_and_reports_recompute(tmp_path, capsys):
    """``dynabatch plan --recompute adaptive --device-memory-limit``: every step of the file records its
    per-stage counts and peaks within the limit, and the summary reports them."""
    import json

    from dynabatch import datagen, load_run_plan
    from dynabatch.cli import main

    data = tmp_path / "flan.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in datagen.text_records(600, seed=1)))
    out = tmp_path / "plan.parquet"
    limit = 2 * 2**30
    assert main(["plan", str(data), "--out", str(out), "--stages", "4", "--ranks", "2", "--global-batch-tokens",
                 "65536", "--recompute", "adaptive", "--device-memory-limit", "2GiB", "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    run = load_run_plan(str(out))
    ks = [run.step_options(int(k))["recompute_layers"] for k in run.steps]
    peaks = [run.step_options(int(k))["stage_peak_bytes"] for k in run.steps]
    assert len(ks) == run.num_steps and all(max(p) <= limit for p in peaks)
    assert any(k[0] > 0 for k in ks) and all(k[-1] <= k[0] for k in ks)
    assert summary["recompute"]["policy"] == "adaptive" and summary["recompute"]["device_memory_limit"] == limit
    assert run.step(int(run.steps[0])).options["recompute_layers"] == ks[0]


def test_feedback_refits_the_time_without_recomputation():
    """Steps run with full recomputation, measured 1.3x slower than the model says: the refit learns the
    1.3x of the time without recomputation (the planner adds recomputation itself), not 1.3 x (1 + f),
    which would count the recomputed forward twice in the next plans."""
    from dynabatch import FeedbackLoop
    from dynabatch.pipeline.measure import StepTiming

    from dynabatch.core.cost.features import microbatch_features

    cost = CostModel.preset("gpt", num_stages=2)
    truth = CostModel.preset("gpt", num_stages=2)  # the model without recomputation, 1.3x slower
    shapes = _shapes(120, seed=3)
    opts = PlanOptions(method="dp", num_stages=2, num_ranks=1, recompute="full", device_memory_limit=1e15)
    f = cost.forward_fraction
    prior = cost.time_coef.copy()
    loop = FeedbackLoop(cost, refit_every=1, forgetting=1.0)
    for step in range(3):
        plan = plan_microbatches(shapes, cost, opts, step=step)
        assert plan.options["recompute_layers"] == [4, 4]
        base = 1.3 * truth.stage_times(microbatch_features(plan, truth), 2)
        # every layer recomputed: the backward runs the forward once more
        timings = [StepTiming(step, s, s, 0, f * base[s], (1 - f) * base[s] + f * base[s], 0.0, 1.0)
                   for s in range(2)]
        loop.record(plan, timings)
        loop.maybe_refit()
    ratio = cost.time_coef[prior > 0] / prior[prior > 0]
    assert np.allclose(ratio, 1.3, rtol=0.02), ratio


def test_adaptive_with_auto_schedule_picks_the_order_too():
    """schedule="auto" under adaptive recomputation: the plan's order is one of the concrete ones, it
    fits the device limit, and it is no slower than adaptive recomputation with 1F1B fixed."""
    cost = CostModel.preset("gpt", num_stages=4)
    shapes = _shapes(160, seed=5)
    opts = PlanOptions(method="dp", num_stages=4, num_ranks=2)
    peak = max(plan_microbatches(shapes, cost, opts.replace(device_memory_limit=1e15)).options["stage_peak_bytes"])
    limit = 0.4 * peak
    auto = plan_microbatches(shapes, cost, opts.replace(schedule="auto", recompute="adaptive",
                                                        device_memory_limit=limit))
    fixed = plan_microbatches(shapes, cost, opts.replace(schedule="1f1b", recompute="adaptive",
                                                         device_memory_limit=limit))
    from dynabatch.core.schedule.registry import AUTO_PREFERENCE

    assert auto.schedule in AUTO_PREFERENCE  # zero-bubble too: its weight parts keep the activations, priced
    assert max(auto.options["stage_peak_bytes"]) <= limit
    assert auto.iteration_time_s <= fixed.iteration_time_s + 1e-12
