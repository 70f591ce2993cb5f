"""`dynabatch inspect --plot` (`dynabatch.planfile.plot`): the pack baseline and the lower bound beside
the plan, rank bars that show a 1% imbalance, the padding panel, one stage bar for a uniform layout, a
timeline legend, titles inside the figure; checked on the matplotlib objects."""

from __future__ import annotations

import numpy as np
import pytest

from dynabatch import CostModel, PlanOptions
from dynabatch.cli import main
from dynabatch.core.plan.bounds import iteration_lower_bound
from dynabatch.shape_sources import synthetic_shapes
from dynabatch.index import write_index
from dynabatch.offline import Index, RunPlanConfig, load_run_plan, plan_run
from dynabatch.planfile.plot import index_shapes, plot_plan


def _plan(tmp_path, kind, n, cost, **opts):
    shapes, names = synthetic_shapes(kind, n, seed=2)
    index = Index(shapes, names, [str(tmp_path / "index.parquet")], False)
    write_index(index, tmp_path / "index.parquet")
    cfg = RunPlanConfig(PlanOptions(drop_last=True, **opts), epochs=1)
    plan_run(index, cost, cfg, workers=1, progress=False).write(tmp_path / "plan.parquet")
    return load_run_plan(tmp_path / "plan.parquet"), shapes


@pytest.fixture(scope="module")
def uniform(tmp_path_factory):
    return _plan(tmp_path_factory.mktemp("uniform"), "text", 2500, CostModel.preset("t5", num_stages=4),
                 num_ranks=4, num_stages=4, global_batch_tokens=65536, max_len=2048, max_target_len=512)


def _axes(fig) -> dict:
    return {ax.get_gid(): ax for ax in fig.axes if ax.get_gid()}


def _line(ax, gid):
    (line,) = [ln for ln in ax.get_lines() if ln.get_gid() == gid]
    return line


def test_iteration_panel_has_pack_and_the_lower_bound(uniform, tmp_path):
    run, shapes = uniform
    fig = plot_plan(run, str(tmp_path / "p.png"), shapes=shapes)
    ax = _axes(fig)["iteration"]
    plan, pack, lb = (_line(ax, g).get_ydata() for g in ("plan", "pack", "lower_bound"))
    assert np.allclose(plan, run.iteration_times_s() * 1e3)
    assert len(pack) == len(lb) == run.num_steps
    assert np.all(lb <= plan + 1e-9) and np.all(lb <= pack + 1e-9)  # a bound of any plan
    assert np.mean(pack) > np.mean(plan)  # dp beats pack here (the README's claim)
    o = run.options
    k = int(run.steps[1])
    batch = shapes.take(np.searchsorted(shapes.sample_id, run.step(k).sample_ids))
    want = iteration_lower_bound(batch, run.cost_model(), num_stages=4, num_ranks=4, max_len=o.max_len,
                                 max_target_len=o.max_target_len,
                                 memory_limit=run.cost_model().memory_limit(4, 4))
    assert lb[1] == pytest.approx(want * 1e3)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("pack" in t for t in labels) and any("lower bound" in t for t in labels)


def test_rank_padding_stage_and_timeline_panels(uniform, tmp_path):
    run, shapes = uniform
    k = int(run.steps[0])
    fig = plot_plan(run, None, step=k, shapes=shapes)
    axes = _axes(fig)
    ranks = axes["ranks"]
    rt = run.step(k).rank_time_s
    tot = run.rank_times_s().sum(axis=0)
    dev = max(np.abs(rt / rt.mean() - 1).max(), np.abs(tot / tot.mean() - 1).max()) * 100
    # +-1% at least, else just above the largest deviation: a 1% imbalance is a visible bar
    assert ranks.get_ylim() == pytest.approx((-max(1.0, 1.25 * dev), max(1.0, 1.25 * dev)))
    step_bars = [p for p in ranks.patches if p.get_facecolor()[:3] == pytest.approx((1.0, 0.498, 0.0549), abs=1e-3)]
    assert [b.get_height() for b in step_bars] == pytest.approx((rt / rt.mean() - 1) * 100)
    pad = _line(axes["padding"], "plan").get_ydata()
    assert pad == pytest.approx([run.step(int(s)).padding_efficiency for s in run.steps])
    assert len(_line(axes["padding"], "pack").get_ydata()) == run.num_steps
    # uniform layout: one busy and one idle bar, not four identical stages
    assert len(axes["stage_busy"].patches) == 2
    assert "uniform" in axes["stage_busy"].get_title()
    legend = [t.get_text() for t in axes["timeline"].get_legend().get_texts()]
    assert legend[:2] == ["forward", "backward"]


def test_titles_fit_in_the_figure(uniform, tmp_path):
    run, shapes = uniform
    fig = plot_plan(run, str(tmp_path / "p.png"), shapes=shapes)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # the returned figure is closed: draw it again to measure its texts
    canvas.draw()
    renderer = canvas.get_renderer()
    box = fig.bbox
    for ax in fig.axes:
        t = ax.title.get_window_extent(renderer)
        assert box.x0 - 1 <= t.x0 and t.x1 <= box.x1 + 1, ax.get_title()
        if ax.get_gid() in ("ranks", "padding", "stage_busy", "shapes", "iteration"):  # within its own column
            a = ax.get_window_extent(renderer)
            assert t.width <= a.width * 1.3, ax.get_title()


def test_without_an_index_the_lines_are_left_out_and_the_title_says_so(tmp_path):
    shapes, names = synthetic_shapes("text", 1500, seed=4)
    cost = CostModel.preset("gpt", num_stages=2)
    cfg = RunPlanConfig(PlanOptions(num_ranks=2, num_stages=2, global_batch_tokens=32768, max_len=2048), epochs=1)
    run = plan_run(Index(shapes, names, ["synthetic"]), cost, cfg, workers=1, progress=False)
    fig = plot_plan(run, None)
    ax = _axes(fig)["iteration"]
    assert [ln.get_gid() for ln in ax.get_lines() if ln.get_gid()] == ["plan"]
    assert "length index" in ax.get_title()
    fig = plot_plan(run, None, shapes=shapes)  # given: the lines are there
    assert {"pack", "lower_bound"} <= {ln.get_gid() for ln in _axes(fig)["iteration"].get_lines()}


def test_inspect_finds_the_plans_index_and_refuses_another(uniform, tmp_path):
    run, shapes = uniform
    assert index_shapes(run) is not None  # the plan's own index file
    other, names = synthetic_shapes("text", 300, seed=9)
    write_index(Index(other, names, ["x"], False), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match="fingerprint"):
        index_shapes(run, str(tmp_path / "other.parquet"))
    out = tmp_path / "p.png"
    assert main(["inspect", run.path, "--plot", str(out)]) == 0 and out.read_bytes()[:4] == b"\x89PNG"
