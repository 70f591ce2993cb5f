"""`dynabatch.planfile.inspect`: histogram buckets, task shares and the summary of a small run plan."""

from __future__ import annotations

import numpy as np
import pytest

from dynabatch import CostModel, PlanOptions
from dynabatch.planfile.inspect import format_summary, microbatch_columns, shape_histogram, summarize_plan, task_share
from dynabatch.offline import Index, RunPlanConfig, plan_run
from dynabatch.core.shape_sources import synthetic_shapes


@pytest.fixture(scope="module")
def run():
    shapes, names = synthetic_shapes("text", 3000, seed=2)
    cost = CostModel.preset("t5", num_stages=2)
    cfg = RunPlanConfig(PlanOptions(num_ranks=4, num_stages=2, global_batch_tokens=65536, max_len=2048,
                                    max_target_len=512, drop_last=True), epochs=1)
    return plan_run(Index(shapes, names, ["synthetic"]), cost, cfg, workers=1, progress=False)


def test_shape_histogram_buckets():
    rows = np.array([1, 1, 2, 3, 4, 9])
    length = np.array([100, 128, 129, 256, 1000, 3000])
    h = shape_histogram(rows, length)
    assert h["row_edges"][:5] == [1, 2, 4, 8, 16] and h["length_edges"][:3] == [128, 256, 512]
    c = np.array(h["counts"])
    assert c.sum() == 6
    assert c[0, 0] == 2  # one row, <= 128 tokens (128 itself included)
    assert c[1, 1] == 2  # 2-3 rows, (128, 256]
    assert c[2, 3] == 1  # 4-7 rows, (512, 1024]
    assert c[3, 5] == 1  # 8-15 rows, (2048, 4096]


def test_task_share_and_microbatches(run):
    share = task_share(run, top=3)
    assert len(share["top"]) == 3 and share["other"]["tasks"] == share["num_tasks"] - 3
    total = sum(r["share"] for r in share["top"]) + share["other"]["share"]
    assert total == pytest.approx(1.0)
    assert [r["tokens"] for r in share["top"]] == sorted((r["tokens"] for r in share["top"]), reverse=True)
    mb = microbatch_columns(run)
    plans = [run.step(k) for k in range(run.num_steps)]
    assert len(mb["rows"]) == sum(p.num_microbatches for p in plans)
    assert np.array_equal(mb["time_s"], np.concatenate([p.mb_time_s for p in plans]))


def test_summary_figures_match_the_plans(run):
    s = summarize_plan(run)
    plans = [run.step(k) for k in range(run.num_steps)]
    real = sum(int(p.mb_real_tokens.sum()) for p in plans)
    computed = sum(int(p.mb_tokens.sum()) for p in plans)
    assert s["padding_efficiency"] == pytest.approx(real / computed)
    it = np.array([p.iteration_time_s for p in plans])
    assert s["iteration_time_s"]["mean"] == pytest.approx(it.mean())
    assert s["step_detail"]["step"] == int(np.argmax(it))  # default: the slowest step
    assert s["rank_imbalance"]["mean"] == pytest.approx(np.mean([p.rank_imbalance for p in plans]))
    assert s["model"] == "t5" and s["ranks"] == 4 and s["stages"] == 2
    text = format_summary(s)
    assert f"{s['padding_efficiency']:.3f}" in text and "token share by task" in text
