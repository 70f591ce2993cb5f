"""`dynabatch.planfile.inspect`: histogram buckets, task shares and the summary of a small run plan."""

from __future__ import annotations

import re

import numpy as np
import pytest

from dynabatch import CostModel, PlanOptions
from dynabatch.cli import main
from dynabatch.core.schedule.build import adaptive_order
from dynabatch.core.schedule.registry import AUTO_PREFERENCE
from dynabatch.core.simulate.pipeline import simulate_pipeline
from dynabatch.core.cost.features import microbatch_features
from dynabatch.planfile.inspect import (format_summary, microbatch_columns, shape_histogram, stage_busy,
                                        step_timeline, summarize_plan, task_share)
from dynabatch.planfile.plot import plot_plan
from dynabatch.offline import Index, RunPlanConfig, load_run_plan, plan_run
from dynabatch.shape_sources import synthetic_shapes


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
    # T5: the decoder's tokens, from the plans' per-micro-batch totals (each sample's target tokens)
    target = sum(int(p.mb_target_tokens.sum()) for p in plans)
    shapes, _ = synthetic_shapes("text", 3000, seed=2)  # the run's samples: each one's target tokens, truncated
    placed = run.table.column("sample_id").to_numpy()
    assert s["target_tokens"] == target == int(np.minimum(shapes.target_tokens[placed], 512).sum()) > 0
    assert s["target_tokens_per_microbatch_max"] == max(int(p.mb_target_tokens.max()) for p in plans)
    assert re.search(rf"decoder \(target\) tokens +{target:,} \({100 * target / real:.1f}% of the real tokens", text)


# -- per-stage busy time and the simulated timeline --------------------------------------------------


def _vlm_run(tmp_path_factory, schedule: str, n: int = 1200):
    shapes, names = synthetic_shapes("vision", n, seed=3)
    cost = CostModel.preset("vlm", num_stages=4, layout="contiguous")
    cfg = RunPlanConfig(PlanOptions(num_ranks=2, num_stages=4, global_batch_tokens=65536, max_len=8192,
                                    schedule=schedule, drop_last=True), epochs=1)
    path = tmp_path_factory.mktemp("vlm") / "plan.parquet"
    plan_run(Index(shapes, names, ["synthetic"]), cost, cfg, workers=1, progress=False).write(path)
    return load_run_plan(path)


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory):
    """A contiguous-layout VLM plan (vision layers on stages 0-1, the LLM on 2-3) written to a file;
    ``auto``: each step records the concrete schedule it chose."""
    return _vlm_run(tmp_path_factory, "auto")


@pytest.fixture(scope="module")
def vlm_runs(tmp_path_factory, vlm_run):
    """The auto run, and the same samples planned under one named schedule (``runs(name)``)."""
    cache = {}

    def runs(schedule):
        if any(vlm_run.step_schedule(s) == schedule for s in vlm_run.steps):
            return vlm_run
        if schedule not in cache:
            cache[schedule] = _vlm_run(tmp_path_factory, schedule, 400)
        return cache[schedule]
    return runs


def _reference_sim(run, step, rank):
    """The rank's schedule simulated here from the plan's columns, independently of `step_timeline`."""
    plan, cost = run.step(step), run.cost_model()
    idx = np.flatnonzero(plan.mb_rank == rank)
    idx = idx[np.argsort(plan.mb_order[idx])]
    st = plan.stage_time_s[:, idx] if plan.stage_time_s is not None else np.tile(plan.mb_time_s[idx], (plan.num_stages, 1))
    fwd = st * cost.forward_fraction
    bwd = st - fwd
    p2p = cost.p2p_time(microbatch_features(plan, cost))[idx]
    order = plan.schedule
    if order == "adaptive":
        order = adaptive_order(fwd, bwd, plan.mb_memory_bytes[idx], plan.options["stage_memory_bytes"], p2p_s=p2p,
                               oversize="alone")
    return simulate_pipeline(fwd, bwd, schedule=order, p2p_s=p2p), st


def test_vlm_plan_has_per_stage_costs(vlm_run):
    plan = vlm_run.step(0)
    assert plan.stage_time_s is not None and plan.stage_time_s.shape == (4, plan.num_microbatches)
    st = plan.stage_time_s
    text = plan.mb_vision_tiles == 0
    assert text.any() and np.all(st[0, text] < 0.1 * st[3, text])  # text-only: (almost) nothing on stage 0
    heavy = plan.mb_vision_tiles >= 9
    assert heavy.any() and np.any(st[0, heavy] > 1.1 * st[3, heavy])  # many tiles: slower on stage 0
    assert {vlm_run.step_schedule(k) for k in vlm_run.steps} <= set(AUTO_PREFERENCE)  # auto chose per step


def test_stage_busy_sums_each_ranks_stage_times(vlm_run):
    steps = vlm_run.steps
    for k in (int(steps[0]), int(steps[-1])):
        plan = vlm_run.step(k)
        b = stage_busy(vlm_run, k)
        assert b["per_stage_predictions"] and b["layout"]["name"] == "contiguous"
        for r in range(plan.num_ranks):
            want = plan.stage_time_s[:, plan.mb_rank == r].sum(axis=1)
            got = b["ranks"][r]
            assert np.allclose(got["busy_s"], want, rtol=1e-12)
            assert np.allclose(got["idle_s"], plan.rank_time_s[r] - want, rtol=1e-9, atol=1e-9)
            assert np.allclose(got["utilization"], want / plan.rank_time_s[r])
            assert np.ptp(got["busy_s"]) > 1e-3 * max(got["busy_s"])  # the stages differ
    total = sum(vlm_run.step(int(k)).stage_time_s.sum(axis=1) for k in steps) / vlm_run.num_ranks
    assert np.allclose(b["run"]["busy_s"], total)
    assert b["run"]["time_s"] == pytest.approx(vlm_run.iteration_times_s().sum())


@pytest.mark.parametrize("schedule", ["1f1b", "adaptive", "zb-h1"])
def test_timeline_is_the_simulated_schedule(vlm_runs, schedule, tmp_path):
    vlm_run = vlm_runs(schedule)
    k = next(int(s) for s in vlm_run.steps if vlm_run.step_schedule(s) == schedule)
    plan = vlm_run.step(k)
    for r in range(plan.num_ranks):
        tl = step_timeline(vlm_run, k, r)
        assert tl["schedule"] == schedule and tl["per_stage"]
        assert tl["makespan_s"] == pytest.approx(plan.rank_time_s[r], rel=1e-9)  # what the planner simulated
        assert np.allclose(tl["busy_s"], plan.stage_time_s[:, plan.mb_rank == r].sum(axis=1))
    r = int(np.argmax(plan.rank_time_s))
    ref, st = _reference_sim(vlm_run, k, r)
    out = tmp_path / "plan.png"
    fig = plot_plan(vlm_run, str(out), step=k)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axes = {ax.get_gid(): ax for ax in fig.axes}
    boxes = {p.get_gid(): p for p in axes["timeline"].patches if p.get_gid()}
    S, M = st.shape
    split = ref.weight_start_s is not None  # a split backward: its weight parts are drawn too
    assert len(boxes) == (3 if split else 2) * S * M and split == (schedule == "zb-h1")
    for s in range(S):
        for j in range(M):
            parts = [(ref.start_s[s, j, k], ref.end_s[s, j, k], n) for k, n in ((0, "F"), (1, "B"))]
            if split:
                parts.append((ref.weight_start_s[s, j], ref.weight_end_s[s, j], "W"))
            for a, b, name in parts:
                box = boxes[f"s{s}:{name}{j}"]
                assert box.get_x() == pytest.approx(a * 1e3, abs=1e-9)
                assert box.get_x() + box.get_width() == pytest.approx(b * 1e3, abs=1e-9)
                assert box.get_y() + box.get_height() / 2 == pytest.approx(s)
    # the drawn boxes are the per-stage costs: a vision-heavy micro-batch is longer on stage 0 than on stage 3
    width = lambda s, j: sum(boxes[f"s{s}:{n}{j}"].get_width() for n in ("FBW" if split else "FB"))  # noqa: E731
    j, t = int(np.argmax(st[0] / st[3])), int(np.argmin(st[0] / st[3]))
    assert width(0, j) == pytest.approx(st[0, j] * 1e3) and width(0, j) > 1.03 * width(3, j)
    assert width(0, t) == pytest.approx(st[0, t] * 1e3) and width(0, t) < width(3, t)
    bars = [p for p in axes["stage_busy"].patches]
    busy = stage_busy(vlm_run, k)["ranks"][r]
    assert [b.get_height() for b in bars[:S]] == pytest.approx(np.array(busy["busy_s"]) * 1e3)
    assert [b.get_height() for b in bars[S:2 * S]] == pytest.approx(np.array(busy["idle_s"]) * 1e3, abs=1e-6)


def test_inspect_cli_prints_per_stage_busy(vlm_run, tmp_path, capsys):
    k = int(vlm_run.steps[0])
    out = tmp_path / "p.png"
    assert main(["inspect", vlm_run.path, "--step", str(k), "--plot", str(out)]) == 0
    text = capsys.readouterr().out
    assert out.is_file() and "per-stage busy time, step 0" in text and "contiguous layout" in text
    plan = vlm_run.step(k)
    busy = plan.stage_time_s[:, plan.mb_rank == 0].sum(axis=1)
    row = next(line for line in text.splitlines() if line.strip().startswith("0  ") and " / " in line)
    for s in range(4):
        assert f"{busy[s] * 1e3:.1f} / {(plan.rank_time_s[0] - busy[s]) * 1e3:.1f}" in row
    assert main(["inspect", vlm_run.path, "--step", str(k), "--json"]) == 0
    js = __import__("json").loads(capsys.readouterr().out)
    assert js["stage_busy"]["ranks"][0]["busy_s"] == pytest.approx(busy.tolist())


def test_uniform_plan_stages_are_equal(run, tmp_path):
    s = summarize_plan(run)
    b = s["stage_busy"]
    plan = run.step(b["step"])
    assert not b["per_stage_predictions"] and b["layout"] == "uniform"
    for r, rb in enumerate(b["ranks"]):
        assert np.allclose(rb["busy_s"], plan.mb_time_s[plan.mb_rank == r].sum())  # every stage the same
        assert np.ptp(rb["busy_s"]) == 0
    assert np.ptp(b["run"]["busy_s"]) == 0
    assert "no per-stage predictions (uniform layout)" in format_summary(s)
    tl = step_timeline(run, b["step"])
    assert tl["makespan_s"] == pytest.approx(plan.iteration_time_s, rel=1e-9)
    ref, _ = _reference_sim(run, b["step"], tl["rank"])
    assert np.allclose(tl["start_s"], ref.start_s) and np.allclose(tl["end_s"], ref.end_s)


def test_dynabatch_plan_layout_contiguous_writes_per_stage_predictions(tmp_path):
    """`dynabatch plan --layout contiguous` plans with per-stage costs, and inspect reports them."""
    import pyarrow.parquet as _pq

    from dynabatch.shape_sources import synthetic_shapes
    from dynabatch.cli import main

    shapes, _ = synthetic_shapes("vision", 600, seed=4)
    index = tmp_path / "vlm_index.parquet"
    _pq.write_table(shapes.to_arrow(), index)
    out = tmp_path / "plan.parquet"
    assert main(["plan", str(index), "--model", "vlm", "--device", "h200", "--layout", "contiguous", "--ranks", "2",
                 "--stages", "4", "--global-batch-tokens", "200000", "--max-len", "8192", "--no-progress",
                 "--out", str(out)]) == 0
    run = load_run_plan(str(out))
    plan = run.step(int(run.steps[0]))
    assert plan.stage_time_s is not None and plan.stage_time_s.shape == (4, plan.num_microbatches)
    busy = stage_busy(run, int(run.steps[0]))
    assert busy is not None
    assert main(["plan", str(index), "--model", "vlm", "--layout", "contiguous", "--out", str(tmp_path / "x.parquet"),
                 "--no-progress", "--stages", "4", "--ranks", "2"]) == 0
    with pytest.raises(SystemExit):
        main(["plan", str(index), "--layout", "diagonal", "--out", str(tmp_path / "y.parquet")])
