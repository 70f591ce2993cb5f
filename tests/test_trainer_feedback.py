"""Feedback on the data-parallel route (`dynabatch.integrations.feedback.StepFeedback`): measured
micro-batch times refit the loader's cost model under `DynabatchTrainer` and accelerate loops, every
rank refits the same way and plans the same steps, a resumed run plans as the uninterrupted one,
and each step's `StepMetrics` reach the Trainer's logs.

The 2-rank runs (one launch: `tests/dp_feedback_workers.py`) train a tiny Llama whose micro-batches
sleep a known cost (`Truth`) that the loader's prior gets wrong by 3x on long samples; the sleeps,
not the machine, set the times, so the checks hold on a busy 2-core machine (liveness bounds only).
"""

import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (Hugging Face Trainer)")
pytest.importorskip("accelerate", reason="needs accelerate")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dp_feedback_workers as workers  # noqa: E402

from dynabatch import CostModel, FeedbackLoop  # noqa: E402
from dynabatch.integrations import (FEEDBACK_STATE_NAME, MicroBatchTimer, StepFeedback,  # noqa: E402
                                    read_feedback_state, save_feedback_state)
from dynabatch.integrations.feedback import to_plan_order  # noqa: E402

WORKERS = str(Path(workers.__file__))
K = 3  # the workers' FeedbackLoop(refit_every=3)


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return workers.write_data(str(tmp_path_factory.mktemp("dpfb") / "train.parquet"))


def test_a_loop_state_loads_into_a_loop_that_refits_bit_for_bit_alike():
    """`FeedbackLoop.state_dict` mid-run (observations pending since the last refit) loaded into a fresh
    loop over a fresh prior: both then refit to the same coefficients, bit for bit, from the same
    later observations, and the loaded one keeps the version and history."""
    def fresh():
        cost = CostModel.preset("gpt", "cpu")
        cost.time_coef = workers.PRIOR
        return FeedbackLoop(cost, refit_every=3, forgetting=0.8)

    a = fresh()
    truth = workers.TRUTH

    def observe(loop, seed):
        r = np.random.default_rng(seed)
        phi = loop.cost_model.padded_features(r.integers(1, 5, 6), r.integers(1, 17, 6) * 8, 0, 0)
        loop.record(phi, phi @ truth * r.lognormal(0, 0.05, 6))
        loop.maybe_refit()

    for s in range(7):
        observe(a, s)
    state = json.loads(json.dumps(a.state_dict()))  # through JSON, as a checkpoint keeps it
    b = fresh()
    b.load_state_dict(state)
    start = fresh().cost_model.version  # setting the prior counted one
    assert b.cost_model.version == a.cost_model.version == start + 2 and len(b.history) == 2
    assert np.array_equal(b.cost_model.time_coef, a.cost_model.time_coef)
    for s in range(7, 12):
        observe(a, s)
        observe(b, s)
    assert len(a.history) == 4 and [r.observations for r in a.history] == [r.observations for r in b.history]
    assert np.array_equal(a.cost_model.time_coef, b.cost_model.time_coef)
    assert not np.array_equal(a.cost_model.time_coef, workers.PRIOR)
    with pytest.raises(ValueError, match="stage settings|made by a FeedbackLoop with"):
        FeedbackLoop(fresh().cost_model, stage_reduce="per_stage").load_state_dict(state)


def test_feedback_state_file_is_checked(tmp_path, data_path):
    fb = StepFeedback(workers.feedback_loader(data_path, 0, 1))
    path = tmp_path / FEEDBACK_STATE_NAME
    save_feedback_state(fb.state_dict(), path)
    assert read_feedback_state(path) == json.loads(json.dumps(fb.state_dict()))
    doc = json.loads(path.read_text())
    doc["state"]["loop"]["cost"]["time_coef"][0] *= 2
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="field loop.cost.time_coef does not match the integrity record"):
        read_feedback_state(path)


@pytest.mark.parametrize("runtime, message", [
    (dict(plan_ahead=2), "plan_ahead=2"),
    (dict(num_workers=1), "num_workers=1"),
    (dict(num_stages=2), "num_stages=1"),
])
def test_a_loader_that_plans_ahead_is_refused(data_path, runtime, message):
    """A planning thread/worker would plan with whichever coefficients it read: ranks would part."""
    import dynabatch
    from dynabatch import Costing, PlanOptions, Runtime, Tokenization

    cost = CostModel.preset("gpt", "cpu")
    loader = dynabatch.DataLoader(
        data_path, num_workers=runtime.get("num_workers", 0), feedback=FeedbackLoop(cost),
        options=PlanOptions(global_batch_tokens=600, max_len=128, num_stages=runtime.get("num_stages", 1)),
        tokenization=Tokenization(tokenizer="bytes"), costing=Costing(cost_model=cost, collate="padded"),
        runtime=Runtime(plan_ahead=runtime.get("plan_ahead", 0)))
    with pytest.raises(ValueError, match=message):
        StepFeedback(loader)
    loader.close()


def test_measured_times_reach_the_loop_in_plan_order(data_path):
    """Times set by hand (``phi @ TRUTH`` of the micro-batch each was measured on, in the step's
    execution order) are recorded against the features of that same micro-batch, placeholders and
    nothing else left out; the metrics count the plan's tokens and micro-batches."""
    loader = workers.feedback_loader(data_path, 0, 1)
    fb = StepFeedback(loader)
    step = next(iter(loader))
    plan = step.plan
    mine = plan.rank_indices(0)
    assert len(mine) >= 3
    phi = fb.loop.features(plan, step.shapes)[mine]
    timer = MicroBatchTimer(len(step), torch.device("cpu"))
    timer.forward_s[:len(mine)] = phi @ workers.TRUTH / 3
    timer.backward_s[:len(mine)] = 2 * phi @ workers.TRUTH / 3
    m = fb.record(step, timer, torch.tensor(1.5))
    last = fb.loop.last
    assert np.allclose(last.measured_s, last.phi @ workers.TRUTH, rtol=1e-12)
    assert len(last.measured_s) == len(mine) == m.observations == m.real_microbatches
    assert m.microbatches == len(step) and m.tokens == int(plan.mb_real_tokens.sum())
    assert m.padding_efficiency == pytest.approx(plan.padding_efficiency)
    assert m.target_tokens == step.target_tokens and m.loss == 1.5
    assert m.predicted_imbalance == pytest.approx(1.0) and m.measured_imbalance == pytest.approx(1.0)
    assert m.cost_mape == pytest.approx(np.mean(np.abs(plan.mb_time_s[mine] / (phi @ workers.TRUTH) - 1)))
    assert math.isnan(m.step_s) and not m.refit and fb.take() == [m] and fb.take() == []
    assert m.cost_version == step.cost_version  # nothing refit after one step
    # a plan whose execution order is not its order (a plan file may hold one): the times follow the order
    shuffled = dataclasses.replace(plan, mb_order=plan.mb_order.copy())
    shuffled.mb_order[mine] = shuffled.mb_order[mine][::-1]
    executed = shuffled.rank_indices(0)
    assert list(executed) == list(mine[::-1])
    in_plan = to_plan_order(shuffled, 0, np.concatenate([executed.astype(float), [-1.0]]))  # + a placeholder
    assert list(in_plan) == [*mine.astype(float), -1.0]
    assert list(to_plan_order(shuffled, 1, [5.0, 6.0])) == [5.0, 6.0]  # a rank the batch was not planned on
    loader.close()


def test_a_streaming_loader_feeds_every_ranks_features(data_path, tmp_path):
    """The streaming mode plans each rank's own share: feedback sends the micro-batches' features with
    the times (so every rank can refit from all of them); recorded against the right features."""
    import pyarrow.parquet as pq

    import dynabatch
    from dynabatch import Costing, PlanOptions, Runtime, Tokenization

    jsonl = tmp_path / "own.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in pq.read_table(data_path).to_pylist()))
    cost = CostModel.preset("gpt", "cpu")
    cost.time_coef = workers.PRIOR
    loader = dynabatch.DataLoader(str(jsonl), feedback=FeedbackLoop(cost, refit_every=3),
                                  options=PlanOptions(global_batch_tokens=1800, max_len=workers.MAX_LEN, num_stages=1,
                                                      memory_limit=8e9),
                                  tokenization=Tokenization(tokenizer="bytes"),
                                  costing=Costing(cost_model=cost, collate="padded"), runtime=Runtime(plan_ahead=0))
    assert loader.mode == "streaming"
    fb = StepFeedback(loader)
    step = next(iter(loader))
    mine = step.plan.rank_indices(0)
    phi = fb.loop.features(step.plan, step.shapes)[mine]
    timer = MicroBatchTimer(len(step), torch.device("cpu"))
    timer.forward_s[:len(mine)], timer.backward_s[:len(mine)] = phi @ workers.TRUTH / 3, 2 * phi @ workers.TRUTH / 3
    m = fb.record(step, timer, torch.tensor(2.0))
    assert m.observations == len(mine) == len(fb.loop.last.measured_s) > 1
    assert np.allclose(fb.loop.last.measured_s, fb.loop.last.phi @ workers.TRUTH, rtol=1e-12)
    loader.close()


def _same(x, y) -> bool:
    """Equal, nan included (the ranks' results come through JSON: nan is another object each time)."""
    return json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True)


@pytest.fixture(scope="module")
def two_ranks(data_path, tmp_path_factory):
    from dynabatch.pipeline import launch_local

    out = tmp_path_factory.mktemp("dpfb_runs")
    res = launch_local(f"{WORKERS}:trainer_feedback", 2, args=(data_path, str(out)), idle_timeout_s=180)
    for r in res:
        assert not r.timed_out, f"rank {r.rank} hung:\n{r.stderr[-3000:]}"
        assert r.returncode == 0, f"rank {r.rank} failed:\n{r.stderr[-3000:]}"
    return [r.result for r in res]


def test_a_wrong_prior_is_refit_within_k_steps_under_the_trainer(two_ranks):
    """Costs 3x the prior's on long samples: after the first refit (k=3 steps) the planner's
    predictions of the next steps are far closer to what was measured, and the refit coefficients
    price the squared length several times higher relative to the tokens than the prior did."""
    a, b = (r["full"] for r in two_ranks)
    seen = a["seen"]
    assert [s["step"] for s in seen] == list(range(12))
    v0 = seen[0]["version"]  # the prior's version (setting it counted)
    assert a["history"][0]["step"] == K - 1 and [s["version"] for s in seen[:K + 1]] == [v0] * K + [v0 + 1]
    assert min(s["microbatches"] for s in seen) >= 2  # some micro-batches' backward measured, not estimated
    errors = {step: mape for step, mape, _ in a["errors"]}
    before = np.mean([errors[s] for s in range(K)])
    after = np.mean([errors[s] for s in range(K + 1, 12)])
    assert before > 0.3, before
    assert after < 0.5 * before, (before, after)
    ratio = lambda c: c[1] / c[0]  # noqa: E731
    assert ratio(seen[-1]["coef"]) > 2.5 * ratio(workers.PRIOR)


def test_the_refit_changes_what_the_planner_plans(two_ranks, data_path):
    """The refit reaches the plans: the steps planned before it are exactly the prior's plans of the
    same global batches (planned here, in this process, without feedback), and most of those planned
    after it group or place the samples otherwise (the long ones priced 3x dearer)."""
    seen = two_ranks[0]["full"]["seen"]
    prior = workers.prior_plans(data_path, 2, len(seen))
    for s in seen[:K]:
        assert (s["plan"], s["cuts"]) == prior[s["step"]], s["step"]
    changed = [s["step"] for s in seen[K:] if s["cuts"] != prior[s["step"]][1]]
    assert len(changed) >= (len(seen) - K) / 2, changed


def test_both_ranks_plan_and_refit_alike_and_log_the_same_metrics(two_ranks):
    for run in ("full", "resumed"):
        a, b = (r[run] for r in two_ranks)
        assert [s["plan"] for s in a["seen"]] == [s["plan"] for s in b["seen"]], run
        assert [s["coef"] for s in a["seen"]] == [s["coef"] for s in b["seen"]], run
        assert _same(a["history"], b["history"]) and _same(a["errors"], b["errors"])
        assert _same([s["metrics"] for s in a["seen"]], [s["metrics"] for s in b["seen"]])
        keys = [k for k in a["logs"][0] if k.startswith("dynabatch/")]
        assert {"dynabatch/padding_efficiency", "dynabatch/measured_imbalance", "dynabatch/cost_mape",
                "dynabatch/predicted_imbalance", "dynabatch/tokens", "dynabatch/microbatches"} <= set(keys)
        for la, lb in zip(a["logs"], b["logs"]):
            assert _same({k: la[k] for k in keys if k in la}, {k: lb[k] for k in keys if k in lb})
    a = two_ranks[0]["full"]
    for log, s in zip(a["logs"], a["seen"]):  # the Trainer's loss is the mean over ranks, as the metrics'
        assert log["loss"] == pytest.approx(s["metrics"]["loss"], rel=1e-5)
        assert log["dynabatch/microbatches"] == s["microbatches"]
        assert 0 < log["dynabatch/padding_efficiency"] <= 1 and log["dynabatch/measured_imbalance"] >= 1
        assert 0 <= log.get("dynabatch/data_wait_share", 0) < 0.5  # planned on demand: waits are milliseconds


def test_a_resumed_run_plans_as_the_uninterrupted_one(two_ranks):
    """Resumed from checkpoint-7: the steps planned before its own first refit (7, 8) are planned exactly
    as the uninterrupted run planned them (the refit coefficients came back bit for bit), and that
    refit sees as many observations as the uninterrupted run's (the pending ones came back too)."""
    for r in two_ranks:
        assert FEEDBACK_STATE_NAME in r["saved"]
        full, resumed = r["full"], r["resumed"]
        assert [s["step"] for s in resumed["seen"]] == list(range(7, 12))
        same = {s["step"]: s for s in full["seen"]}
        for s in resumed["seen"][:2]:
            assert (s["plan"], s["version"]) == (same[s["step"]]["plan"], same[s["step"]]["version"])
        assert _same(resumed["history"][:2], full["history"][:2])  # the saved refits
        first = lambda h: (h["step"], h["observations"], h["window"])  # noqa: E731  (its own first refit)
        assert first(resumed["history"][2]) == first(full["history"][2]) and resumed["history"][2]["step"] == 8


def test_the_accelerate_helper_returns_the_same_metrics_on_both_ranks(two_ranks):
    """`StepFeedback.backward` in an accelerate loop: the same `StepMetrics` on both ranks, a refit after
    k steps, and ``accelerator.save_state``/``load_state`` carry the refit state (registered for checkpointing)."""
    assert all(r["accelerate"]["restored"] for r in two_ranks)
    a, b = (r["accelerate"]["steps"] for r in two_ranks)
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert _same(x, y)
        assert x["microbatches"] >= 2 and x["observations"] > 0 and x["tokens"] > 0
    assert [x["refit"] for x in a] == [False] * (K - 1) + [True, False]
    assert a[K - 1]["cost_version"] == a[0]["cost_version"] + 1
