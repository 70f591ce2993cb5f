"""Flush-free streams of steps on one stage (`PipelineRunner.run_steps` with ``RunnerConfig(flush=False)``):
the steps' micro-batches as one program on the interpreter, compiled from the stream's ops
(`dynabatch.core.schedule.build.stream_ops`: 1F1B over the stream with each step's update, the order the
flush-free simulator prices), with the hooks of one model plus `StreamHooks`: the weights each forward and
backward computes with (`dynabatch.pipeline.runtime.weight_prediction.WeightPredictor`) and this stage's
update ops. Seconds, tokens, bytes."""

from __future__ import annotations

import time

import numpy as np

from ...core.schedule.build import stream_ops
from ...core.simulate.flushfree import update_lag
from ..measure.timing import StepResult, StepTiming
from .hooks import OneModel
from .nonfinite import NonFiniteStep, check_update, reduce_step
from .schedule import build_programs, quantize_times
from .update import update_stage


class StreamHooks:
    """The hooks of a stream: ``base`` (`OneModel` over the steps' concatenated micro-batches) for every
    hook but those below, plus: ``ends`` (each step's exclusive end),
    ``lags`` [S, V] (updates between each micro-batch's forward and backward on every stage),
    ``tokens`` (each step's global real target tokens), ``predictor`` (the stage's `WeightPredictor`),
    and the update: ``update(k)`` runs this stage's update of the stream's step ``k`` (the program's
    update op, `run_update`). ``done``: updates run so far; ``update_t``: when each ran (``perf_counter``)."""

    chunks = 1

    def __init__(self, base: OneModel, ends: np.ndarray, lags: np.ndarray, predictor, update):
        self.base = base
        self.ends = ends
        self.lags = lags
        self.predictor = predictor
        self.update = update
        self.step_of = np.repeat(np.arange(len(ends)), np.diff(np.concatenate(([0], ends))))
        self.done = 0
        self.update_t: list[float] = []

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    def at(self, chunk: int):
        """These hooks (a stream runs one model chunk per stage)."""
        if chunk != 0:
            raise ValueError("a flush-free stream runs one model chunk per stage")
        return self

    def forward_context(self, v: int, meter):
        """``v``'s forward with the weights `RunnerConfig.weight_prediction` says, ``lag`` updates ahead."""
        return self.predictor.forward(v, int(self.lags[self.base.s, v]), pack=meter.pack if meter is not None else None,
                                      unpack=meter.unpack if meter is not None else None)

    def backward_context(self, v: int):
        """``v``'s backward with the weight version the predictor keeps for it."""
        return self.predictor.backward(v)

    def after_backward(self, v: int) -> None:
        """After a backward on this stage: its gradient flags."""
        if self.base.watch is not None:
            self.base.watch.after_backward(v)

    def run_update(self, k: int) -> None:
        """The program's ``U{k}`` (after the backward of step ``k``'s last micro-batch on this stage): the
        stage's update (refused when this stage's gradients of the step are not finite:
        `nonfinite.check_update`)."""
        if k != self.done:
            raise RuntimeError(f"internal error: the stream's update U{k} came after {self.done} updates")
        self.update(k)
        self.update_t.append(time.perf_counter())
        self.done += 1

    def group(self, v: int) -> int:
        """``v`` itself: one loss accumulator per micro-batch (summed per step at the end; a non-finite
        one is named)."""
        return v


def run_stream(runner, steps, optimizer, num_tokens, collation) -> list[StepResult]:
    """`PipelineRunner.run_steps` with ``flush=False`` (see there)."""
    if optimizer is None:
        raise ValueError("run_steps with flush=False needs the stage's optimizer (it updates inside the stream)")
    if num_tokens is None or len(num_tokens) != len(steps):
        raise ValueError(f"run_steps with flush=False needs num_tokens: the real target tokens of each of the "
                         f"{len(steps)} steps over all ranks")
    if not steps:
        return []
    shapes, batches, ends = [], [], []
    for plan, b in steps:
        sh = runner.shapes(plan, collation)
        if not sh:
            raise ValueError(f"replica {runner.ctx.replica} has no micro-batches in step {len(ends)} of the stream")
        shapes += sh
        batches += list(b) if b is not None else [None] * len(sh)
        ends.append(len(shapes))
    ends = np.asarray(ends, np.int64)
    tokens = np.asarray(num_tokens, np.float64)
    predictor = runner.weight_predictor(optimizer)
    needs_data = runner.stage.is_first or runner.stage.is_last
    out, nonfinite = runner.guard.run(lambda: _run(runner, shapes, batches if needs_data else None, ends, tokens,
                                                   predictor, optimizer))
    if nonfinite is not None:  # known to every rank from the loss reduction: all raise it
        raise NonFiniteStep(nonfinite)
    return out


def _run(runner, shapes, batches, ends, tokens, predictor, optimizer) -> tuple[list[StepResult], str | None]:
    t_step = time.perf_counter()
    ctx, k0 = runner.ctx, runner.step_index
    ctx.monitor.set_state("busy", f"preparing step {k0}")
    params = runner.trainable()

    def update(k: int) -> None:
        if hooks.base.watch is not None:  # no other stage could agree: a bad step raises here (module doc)
            lo = int(ends[k - 1]) if k else 0
            check_update(hooks.base.watch, lo, int(ends[k]), f"stream step {k0 + k}", ctx.stage, ctx.rank)
        update_stage(runner.guard, params, float(tokens[k]), optimizer, f"stream step {k0 + k}", ties=runner.ties,
                     free_grads=True)

    hooks = StreamHooks(runner.one_model(shapes, batches, k0), ends, update_lag(ends, ctx.num_stages), predictor,
                        update)
    times = np.array([sh.time_s for sh in shapes])
    program = build_programs(stream_ops(ctx.num_stages, ends), quantize_times(times), runner.entries(shapes))[ctx.stage]
    clock = runner.start_program(program, hooks, runner.recompute_layers(None))
    run = runner.run(program, hooks, clock, len(shapes), groups=len(shapes))
    clock.resolve()
    K = len(ends)
    if hooks.done != K:
        raise RuntimeError(f"internal error: the stream updated {hooks.done} of its {K} steps")
    starts = np.concatenate(([0], ends[:-1]))
    watch = hooks.base.watch
    losses, _, verdict, _ = reduce_step(runner.guard, run.loss, run.tokens, list(zip(starts.tolist(), ends.tolist())),
                                        [watch] * K, "a flush-free stream", watch is not None)
    bad = [k for k in range(K) if verdict is not None and verdict.bad(k)]  # a loss only: gradients raised before
    nonfinite = verdict.message(f"stream step {k0 + bad[0]}", bad[0], after="the stages had already updated") \
        if bad else None
    marks = [t_step] + hooks.update_t
    saved = run.saved_bytes if runner.config.measure_memory else None
    out = []
    for k, (a, b) in enumerate(zip(starts, ends)):
        timing = StepTiming(k0 + k, ctx.rank, ctx.stage, ctx.replica, run.forward_s[a:b].copy(),
                            run.backward_s[a:b].copy(), run.wait_s / K, marks[k + 1] - marks[k],
                            None if saved is None else saved[a:b].copy(), 0.0, int(runner.stage.recompute))
        n = float(tokens[k])
        out.append(StepResult(k0 + k, float(losses[k]) * (1.0 / max(n, 1.0)), int(round(n)), timing, None, None,
                              float(predictor.peak_bytes)))
    runner.step_index += K
    return out, nonfinite
