"""A non-finite loss or gradient in a step stops training naming the step, the stage and the micro-batch on
every rank, before any update (``RunnerConfig(nonfinite="raise")``, the default), or skips the step on every
rank alike, counted, with the weights unchanged (``"skip"``). 2 gloo stages of the tiny GPT: micro-batch 1 of
step 1 is made infinite (its activations scaled by inf before the last stage's head: a non-finite loss) or
its gradient on stage 0 (an infinite gradient, the loss finite); flushed `PipelineRunner` steps and
`MultiModelRunner` steps share one launch (the ranks agree, so they carry on after each case); a flush-free
stream, where the stage that finds it raises and the failure protocol stops the other, has its own."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prelaunch import Prelaunch, job  # noqa: E402

LAUNCHES = Prelaunch(parallel=2)
BOUNDS = [0, 2, 5]  # gpt-tiny: embedding + block | 2 blocks + head
BAD_STEP, BAD_MB = 1, 1


def _model(seed=0):
    from test_pipeline_workers import TINY

    from dynabatch.pipeline import make_model

    return make_model("gpt-tiny", **TINY["gpt-tiny"], seed=seed)


def _steps(model, ctx, n):
    """``n`` steps of 3 micro-batches: (shapes, this rank's dictionaries, target tokens of the step)."""
    from test_pipeline_workers import synthetic_plan

    from dynabatch.pipeline.models import plan_shapes

    rng = np.random.default_rng(3)
    out = []
    for k in range(n):
        shapes = plan_shapes(synthetic_plan(rng, collation="padded", num_ranks=1, num_stages=2, mbs=(3, 3), step=k), 0)
        batches = [model.random_batch(sh, torch.Generator().manual_seed(10 * k + j)) for j, sh in enumerate(shapes)]
        out.append((shapes, batches, sum(int(b["labels"].ne(-100).sum()) for b in batches)))
    return out


class Inject:
    """Makes micro-batch ``BAD_MB`` of step ``BAD_STEP`` non-finite on this rank: ``kind="loss"`` scales the last
    stage's input to its head by inf (stage 1), ``kind="grad"`` the gradient of stage 0's first parameter."""

    def __init__(self, stage, rank, kind):
        self.step, self.calls = -1, 0
        if kind == "loss" and rank == 1:
            stage.layers[-1].register_forward_pre_hook(self._forward)
        if kind == "grad" and rank == 0:
            next(iter(stage.parameters())).register_hook(self._grad)

    def at(self, step):
        self.step, self.calls = step, 0

    def _hit(self):
        self.calls += 1
        return self.step == BAD_STEP and self.calls == BAD_MB + 1

    def _forward(self, module, args):
        if not self._hit():
            return None
        x = args[0]  # the hidden states, or a tuple of them and what travels with them
        x = (x[0] * float("inf"), *x[1:]) if isinstance(x, (tuple, list)) else x * float("inf")
        return (x, *args[1:])

    def _grad(self, g):
        return g * float("inf") if self._hit() else None


def _snapshot(params):
    return [p.detach().clone() for p in params]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def flushed_worker(rank, world, port):
    """The flushed cases in one process group: raise (loss, gradient), skip, and many models (raise, skip)."""
    from dynabatch.pipeline import MultiModelRunner, PipelineRunner, RunnerConfig, init_pipeline
    from dynabatch.pipeline.runtime.nonfinite import NonFiniteStep

    out = {}
    with init_pipeline(2, rank=rank, world_size=world, master_port=port, timeout_s=60) as ctx:
        for case, kind, mode in (("raise_loss", "loss", "raise"), ("raise_grad", "grad", "raise"),
                                 ("skip_loss", "loss", "skip")):
            model = _model()
            runner = PipelineRunner.from_model(model, ctx, BOUNDS, RunnerConfig(schedule="1f1b", nonfinite=mode))
            opt = torch.optim.SGD(runner.parameters(), lr=0.1)
            inject = Inject(runner.stage, rank, kind)
            rec = {"errors": [], "changed": []}
            for k, (shapes, batches, _) in enumerate(_steps(model, ctx, 3)):
                inject.at(k)
                before = _snapshot(runner.parameters())
                try:
                    res = runner.step(shapes, batches, optimizer=opt)
                    rec.setdefault("losses", []).append(res.loss)
                except NonFiniteStep as e:
                    rec["errors"].append([k, str(e)])
                rec["changed"].append(not _same(before, runner.parameters()))
            rec["skipped"] = runner.skipped_steps
            out[case] = rec
        for mode in ("raise", "skip"):
            models = [_model(seed) for seed in (0, 1)]
            mm = MultiModelRunner.from_models(models, ctx, BOUNDS, lambda ps, k: torch.optim.SGD(ps, lr=0.1),
                                              config=RunnerConfig(schedule="1f1b", nonfinite=mode))
            inject = Inject(mm.runners[1].stage, rank, "loss")  # model 1 only
            rec = {"errors": [], "changed": []}
            for k, (shapes, batches, _) in enumerate(_steps(models[0], ctx, 2)):
                inject.at(k)
                before = [_snapshot(r.parameters()) for r in mm.runners]
                try:
                    mm.step(shapes, batches)
                except NonFiniteStep as e:
                    rec["errors"].append([k, str(e)])
                rec["changed"].append([not _same(b, r.parameters()) for b, r in zip(before, mm.runners)])
            rec["skipped"] = mm.skipped_steps
            out[f"multi_{mode}"] = rec
    return out


def stream_worker(rank, world, port):
    """A flush-free stream of 3 steps whose step 1 has a non-finite loss at micro-batch 1."""
    from dynabatch.pipeline import PipelineRunner, RunnerConfig, init_pipeline

    with init_pipeline(2, rank=rank, world_size=world, master_port=port, timeout_s=60, abort_after_s=10) as ctx:
        model = _model()
        runner = PipelineRunner.from_model(model, ctx, BOUNDS, RunnerConfig(flush=False))
        opt = torch.optim.SGD(runner.parameters(), lr=0.1)
        inject = Inject(runner.stage, rank, "loss")
        steps = _steps(model, ctx, 3)
        inject.at(BAD_STEP)  # the stream's forwards of every step count: step 1's micro-batch 1 is the 5th
        inject.calls = -3
        runner.run_steps([(s, b) for s, b, _ in steps], optimizer=opt, num_tokens=[n for *_, n in steps])
    return {"finished": True}


def _launch(target):
    from dynabatch.pipeline import launch_local

    return launch_local(f"{__file__}:{target}", 2, idle_timeout_s=180)


FLUSHED = job("flushed", _launch, "flushed_worker", weight=2.0)
STREAM = job("stream", _launch, "stream_worker", weight=1.0)


@pytest.fixture(scope="module", autouse=True)
def _launches(request):
    yield from LAUNCHES.started(request)


def _flushed():
    res = LAUNCHES.result(FLUSHED)
    for r in res:
        assert r.returncode == 0 and r.result is not None, f"rank {r.rank}:\n{r.stderr[-3000:]}"
    return [r.result for r in res]


def _raised_once(rec) -> str:
    """The text of the one NonFiniteStep of a case, raised in the bad step."""
    assert [k for k, _ in rec["errors"]] == [BAD_STEP], rec
    return rec["errors"][0][1]


@LAUNCHES.plan(lambda: [FLUSHED])
def test_non_finite_loss_raises_on_every_rank_before_any_update():
    for rank, out in enumerate(_flushed()):
        rec = out["raise_loss"]
        msg = _raised_once(rec)
        assert msg.startswith(f"step {BAD_STEP}: the loss of micro-batch {BAD_MB} (replica 0) is not finite") and \
            "on stage 1 (rank 1)" in msg and "no rank updated its weights" in msg, msg
        assert rec["changed"] == [True, False, True], rec  # nothing applied in the bad step; training goes on
        assert all(np.isfinite(x) for x in rec["losses"]) and rec["skipped"] == []


@LAUNCHES.plan(lambda: [FLUSHED])
def test_non_finite_gradient_names_its_stage_and_micro_batch():
    for out in _flushed():
        rec = out["raise_grad"]
        msg = _raised_once(rec)
        assert msg.startswith(f"step {BAD_STEP}: the gradients of stage 0 (rank 0, replica 0) are not finite") and \
            f"after the backward of micro-batch {BAD_MB}" in msg, msg
        assert rec["changed"] == [True, False, True], rec


@LAUNCHES.plan(lambda: [FLUSHED])
def test_skip_counts_the_step_and_leaves_the_weights_unchanged():
    for out in _flushed():
        rec = out["skip_loss"]
        assert rec["errors"] == [] and rec["skipped"] == [BAD_STEP], rec
        assert rec["changed"] == [True, False, True], rec
        assert not np.isfinite(rec["losses"][BAD_STEP]) and np.isfinite(rec["losses"][BAD_STEP + 1])


@LAUNCHES.plan(lambda: [FLUSHED])
def test_many_models_raise_or_skip_the_bad_model_alike_on_every_rank():
    for out in _flushed():
        rec = out["multi_raise"]
        msg = _raised_once(rec)
        assert f"multi-model step {BAD_STEP} of model 1: the loss of micro-batch {BAD_MB}" in msg, msg
        assert rec["changed"] == [[True, True], [False, False]], rec
        rec = out["multi_skip"]
        assert rec["errors"] == [] and rec["skipped"] == [[BAD_STEP, 1]], rec
        assert rec["changed"] == [[True, True], [True, False]], rec


@LAUNCHES.plan(lambda: [STREAM])
def test_flush_free_stream_stops_every_rank_naming_the_stream_step():
    res = LAUNCHES.result(STREAM)
    for r in res:
        assert not r.timed_out and r.returncode != 0, f"rank {r.rank}:\n{r.stderr[-3000:]}"
        assert f"stream step {BAD_STEP}: the gradients of stage" in r.stderr and \
            f"after the backward of micro-batch {BAD_MB}" in r.stderr, r.stderr[-3000:]
    assert "NonFiniteStep" in res[1].stderr  # the last stage finds it first, at its update of step 1
    assert "PipelineAborted" in res[0].stderr or "NonFiniteStep" in res[0].stderr


def test_skip_is_refused_where_the_stages_cannot_agree():
    from dynabatch.pipeline import RunnerConfig

    with pytest.raises(ValueError, match="nonfinite='skip' needs flushed steps"):
        RunnerConfig(flush=False, nonfinite="skip")
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        RunnerConfig(nonfinite="ignore")
