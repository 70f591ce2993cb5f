"""`dynabatch bench schedules`: every schedule simulated on the same dp plans (`dynabatch.bench.schedules`)."""

import json

import numpy as np
import pytest

from dynabatch.bench.schedules import SCHEDULES, format_schedules, run_schedules_bench, simulate_schedules
from dynabatch.cli import main
from dynabatch.core.cost.model import CostModel
from dynabatch.core.options import PlanOptions
from dynabatch.core.plan.steps import global_batches, plan_step
from dynabatch.core.simulate.pipeline import simulate_pipeline
from dynabatch.shape_sources import synthetic_shapes


def test_rows_compare_every_schedule_on_the_same_plans():
    shapes, _ = synthetic_shapes("text", 3000, seed=1)
    rows = run_schedules_bench(shapes, "gpt", stages=(4,), ranks=(8,), num_batches=2)
    by = {r.schedule: r for r in rows}
    assert set(by) == set(SCHEDULES) and by["1f1b"].speedup_vs_1f1b == 1.0 and by["1f1b"].peak_vs_1f1b == 1.0
    assert by["zb-h1"].speedup_vs_1f1b > 1.0 and by["zb-h1"].peak_vs_1f1b == 1.0  # 1F1B's memory, less bubble
    assert by["zb-h1"].bubble_share < by["1f1b"].bubble_share
    assert all(r.iteration_s >= r.bound_s for r in rows)
    text = format_schedules(rows)
    assert "4 stages x 8 ranks" in text and "zb-h1" in text and "interleaved" in text


def test_one_plan_per_rank_equals_the_simulator():
    """A rank's simulated makespan under 1F1B is the plan's own (planned under 1F1B), and each schedule's is
    `simulate_pipeline` of that rank's figures."""
    shapes, _ = synthetic_shapes("text", 2000, seed=2)
    cost = CostModel.preset("gpt", num_stages=4)
    opts = PlanOptions(global_batch_tokens=65536, max_len=2048, num_stages=4, num_ranks=4, method="dp",
                       schedule="1f1b", drop_last=True)
    plan = plan_step(shapes, cost, opts, global_batches(shapes, cost, opts)[0], step=0)
    sims = simulate_schedules(plan, cost)
    assert sims["1f1b"][0] == pytest.approx(plan.iteration_time_s, rel=1e-12)
    r = int(np.argmax(plan.rank_time_s))
    idx = plan.rank_indices(r)
    st = plan.stage_time_s if plan.stage_time_s is not None else np.tile(plan.mb_time_s, (4, 1))
    f = st[:, idx] * cost.forward_fraction
    zb = simulate_pipeline(f, st[:, idx] - f, schedule="zb-h1", p2p_s=cost.transfer_time(plan.mb_tokens[idx]))
    assert sims["zb-h1"][0] >= zb.makespan_s - 1e-12


def test_command_prints_json(capsys):
    assert main(["bench", "schedules", "--samples", "1500", "--num-stages", "4", "--num-ranks", "8", "--batches", "1",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {r["schedule"] for r in out["rows"]} == set(SCHEDULES) and out["model"] == "gpt"


def test_a_measured_split_prices_the_split_backwards_only():
    shapes, _ = synthetic_shapes("text", 2000, seed=2)
    cost = CostModel.preset("gpt", num_stages=4)
    opts = PlanOptions(global_batch_tokens=65536, max_len=2048, num_stages=4, num_ranks=4, method="dp",
                       schedule="1f1b", drop_last=True)
    plan = plan_step(shapes, cost, opts, global_batches(shapes, cost, opts)[0], step=0)
    base = simulate_schedules(plan, cost)
    assert simulate_schedules(plan, cost, split=(0.5, 1.0)) == base
    dear = simulate_schedules(plan, cost, split=(0.45, 1.3))
    assert dear["1f1b"] == base["1f1b"] and dear["interleaved"] == base["interleaved"]
    assert dear["zb-h1"][0] > base["zb-h1"][0] and dear["zb-h2"][0] > base["zb-h2"][0]
