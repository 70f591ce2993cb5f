"""`PipelineRunner`: execute one global batch's micro-batches on this rank's stage.

Each step: derive the stage op order (GPipe, 1F1B or memory-aware adaptive) and this stage's
communication program from the plan (identical on every rank: see `schedule`), run it with
asynchronous point-to-point transfers, accumulate gradients over the step's variable-shape
micro-batches, normalize the loss per real target token of the whole global batch, all-reduce the
gradients over data-parallel replicas, and take one optimizer step.

The step runs on the one interpreter of a stage's program (`dynabatch.pipeline.runtime.interpreter`)
with the hooks of one model (`dynabatch.pipeline.runtime.hooks.OneModel`); flush-free streams
(`dynabatch.pipeline.runtime.stream`) and many models (`dynabatch.pipeline.runtime.multimodel`) run
on it too. Parameters shared between stages (`dynabatch.pipeline.runtime.tied`) are summed over their
stages before every update.

Loss normalization: the head returns the *sum* of token losses; backward runs on those sums; at
the end one all-reduce over all ranks gives the global token count ``N`` (and the loss sum), and
the gradients are divided by ``N``. This equals ``sum(token losses) / N`` differentiated once,
whatever the micro-batch sizes — not a mean of per-micro-batch means.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np
import torch

from ...core.batchplan import BatchPlan, MicroBatch
from ...core.plan.recompute import recompute_layers
from ..measure.memory import param_pointers
from ..measure.timing import Clock, StepResult, StepTiming
from ..models.partition import PipelineStage, StagePartition, split_model
from ..models.spec import MicroBatchShape, TensorSpec, check_batch, plan_shapes
from .bypass import Bypass
from .chunks import chunk_ties, chunked, with_chunks
from .comm import CommEvent, DistContext, P2P
from .config import RunnerConfig
from .guard import StepGuard
from .hooks import OneModel
from .interpreter import check_links, run_program
from .nonfinite import GradWatch, NonFiniteStep, reduce_step
from .schedule import build_programs, quantize_times, runner_orders
from .setup_guard import setup_phase
from .stream import run_stream
from .tied import Ties
from .update import gather_timings, update_stage


def microbatch_counts(plan, num_replicas: int, M: int) -> np.ndarray:
    """Micro-batches each replica runs in ``plan`` (``M`` each for bare shapes)."""
    return plan.microbatches_per_rank() if isinstance(plan, BatchPlan) else np.full(num_replicas, M)


class PipelineRunner:
    """Runs steps of planned micro-batches on one stage of a pipeline (see the module docstring).

    ``stage`` is this rank's `PipelineStage` (already on ``ctx.device``), ``boundary(shape, layer)``
    the model's boundary `TensorSpec`s, ``recorder`` an optional hook receiving every posted
    point-to-point operation (`CommEvent`), ``bypass`` the model's `Bypass` (`from_model` makes it
    when ``config.bypass_idle_stages``), ``ties`` the model's parameters shared with other stages
    (`Ties`; `from_model` makes them from ``model.tied_parameters()``).
    """

    def __init__(self, stage: PipelineStage, boundary: Callable[[MicroBatchShape, int], Sequence[TensorSpec]],
                 ctx: DistContext, config: RunnerConfig = RunnerConfig(), *,
                 recorder: Callable[[CommEvent], None] | None = None, bypass: Bypass | None = None,
                 ties: Ties | None = None):
        if stage.is_first != (ctx.stage == 0) or stage.is_last != (ctx.stage == ctx.num_stages - 1):
            raise ValueError(f"rank {ctx.rank} is stage {ctx.stage} of {ctx.num_stages} but was given layers "
                             f"{stage.first_layer}..{stage.last_layer} of {stage.num_model_layers}")
        if config.bypass_idle_stages and bypass is None:
            raise ValueError("RunnerConfig(bypass_idle_stages=True) needs the model: use PipelineRunner.from_model "
                             "(or pass bypass=Bypass.of(model, bounds))")
        self.bypass = bypass if config.bypass_idle_stages else None
        self.stage = stage
        self.boundary = boundary
        self.ctx = ctx
        self.config = config
        self.ties = ties if ties is not None else Ties([])
        self.p2p = P2P(ctx, debug_shapes=config.debug_shapes, recorder=recorder)
        self.step_index = 0
        self.skipped_steps: list[int] = []  # steps skipped for a non-finite loss or gradient (nonfinite="skip")
        self.guard = StepGuard(ctx, "the runner", lambda: self.step_index)
        self._programs: OrderedDict = OrderedDict()
        self._param_ptrs = param_pointers([stage])
        self._wp = None
        #: The `StageRun` of the latest flushed step (its ops in order and their seconds, after the step).
        self.last_run = None

    @classmethod
    def from_model(cls, model, ctx: DistContext, bounds: Sequence[int] | StagePartition,
                   config: RunnerConfig = RunnerConfig(), *, recorder: Callable[[CommEvent], None] | None = None,
                   bypass: Bypass | None = None) -> "PipelineRunner":
        """Keep this rank's stage of ``model`` (a `dynabatch.pipeline.models.LayeredModel`) cut at
        ``bounds``, move it to ``ctx.device`` and build the runner. Collective when the model ties
        parameters across stages (`Ties.of`): every rank builds the same models in the same order. Under the
        failure monitor (`setup_guard`): an error here, or a rank failing or dying in its own set-up, stops
        every rank with an error naming the rank that failed first."""
        with setup_phase(ctx, f"building the runner of {getattr(model, 'name', 'the model')} (stage {ctx.stage})"):
            stages = split_model(model.layers, bounds)
            if len(stages) % ctx.num_stages:
                raise ValueError(f"bounds give {len(stages)} stages but the pipeline has {ctx.num_stages} (an "
                                 f"interleaved cut gives each stage the same number of chunks)")
            cut = [st.first_layer for st in stages] + [len(model.layers)]
            if config.bypass_idle_stages and bypass is None:
                bypass = Bypass.of(model, cut)
            stage = chunked(stages, ctx.num_stages, ctx.stage).to(ctx.device)
            ties = Ties.of(model, stage, cut, ctx) if len(stages) == ctx.num_stages else chunk_ties(model, cut)
            return cls(stage, model.boundary, ctx, config, recorder=recorder, bypass=bypass, ties=ties)

    def parameters(self):
        """Parameters of this rank's stage (give these to the optimizer)."""
        return self.stage.parameters()

    def recompute_layers(self, plan=None, override=None) -> int:
        """Layers of this stage the runner recomputes for ``plan`` (see `RunnerConfig.recompute`);
        ``override``: per-stage counts for this step (`step`'s ``recompute=``), taken before the config."""
        r, s, top = self.config.recompute, self.ctx.stage, self.stage.recomputable_layers
        if override is not None:
            r = tuple(int(x) for x in override)
        if r == "none":
            return 0
        if r == "full":
            return top
        if r == "auto":
            return min(recompute_layers(plan, s), top) if isinstance(plan, BatchPlan) else 0
        if len(r) != self.ctx.num_stages:
            raise ValueError(f"RunnerConfig.recompute has {len(r)} counts for {self.ctx.num_stages} stages")
        return min(r[s], top)

    # -- planning --------------------------------------------------------------------------------
    def entries(self, shapes: Sequence[MicroBatchShape]) -> np.ndarray:
        """int64 ``[M]``: the first stage each micro-batch runs on (all 0 without bypass)."""
        return self.bypass.entries(shapes) if self.bypass is not None else np.zeros(len(shapes), np.int64)

    def _program(self, shapes: Sequence[MicroBatchShape], plan=None) -> tuple[list, np.ndarray]:
        S, M = self.ctx.num_stages, len(shapes)
        times = np.array([sh.time_s for sh in shapes])
        units = quantize_times(times)
        mem = np.array([sh.memory_bytes for sh in shapes])
        entry = self.entries(shapes)
        orders = runner_orders(self.config.schedule, S, times, mem, plan,
                               self.plan_rank(plan) if isinstance(plan, BatchPlan) else self.ctx.replica,
                               self.config.memory_limit_bytes)
        key = (S, M, orders.tobytes(), units.tobytes(), entry.tobytes())
        hit = self._programs.get(key)
        if hit is None:
            hit = (build_programs(orders, units, entry)[self.ctx.stage], orders)
            self._programs[key] = hit
            if len(self._programs) > 512:
                self._programs.popitem(last=False)
        return hit

    def program(self, shapes: Sequence[MicroBatchShape], plan=None) -> list:
        """This stage's instruction list for ``shapes`` (of ``plan``, which picks the op order)."""
        return self._program(shapes, plan)[0]

    def orders(self, plan: BatchPlan | Sequence[MicroBatchShape]) -> np.ndarray:
        """The op orders [S, 2M] this runner would use for ``plan`` (this rank's replica)."""
        return self._program(self.shapes(plan), plan)[1]

    def plan_rank(self, plan: BatchPlan) -> int:
        """The rank of ``plan`` this replica runs: its replica index in a plan of every replica, 0 in a plan of
        one rank (this replica's own: the streaming loader plans each replica's share alone)."""
        R = self.ctx.num_replicas
        if plan.num_ranks == R:
            return self.ctx.replica
        if plan.num_ranks == 1:
            return 0
        raise ValueError(f"the plan is for {plan.num_ranks} data-parallel ranks but there are {R} pipeline replicas "
                         f"(rank {self.ctx.rank}, step {self.step_index}): plan for {R} ranks, or give each replica "
                         f"its own plan of one rank (a DataLoader with runtime=loader_runtime(ctx))")

    def shapes(self, plan, collation: str | None = None) -> list[MicroBatchShape]:
        """This replica's micro-batch shapes of ``plan`` (a `BatchPlan`, or a list of `MicroBatchShape` s or
        `MicroBatch` es, the latter with ``collation``)."""
        if isinstance(plan, BatchPlan):
            return plan_shapes(plan, self.plan_rank(plan))
        out = []
        for x in plan:
            if isinstance(x, MicroBatch):
                if collation is None:
                    raise ValueError("pass collation= with a list of MicroBatch")
                x = MicroBatchShape.from_microbatch(x, collation)
            out.append(x)
        return out

    # -- execution -------------------------------------------------------------------------------
    def step(self, plan: BatchPlan | Sequence[MicroBatchShape | MicroBatch], batches: Sequence[dict] | None = None, *,
             optimizer: torch.optim.Optimizer | None = None, collation: str | None = None,
             recompute: Sequence[int] | None = None) -> StepResult:
        """Run one global batch: this replica's micro-batches of ``plan`` through this stage, then
        the gradient all-reduce and (if given) ``optimizer.step()``.

        ``batches`` are the micro-batch dictionaries of this replica in plan order; the first and
        the last stage need them (inputs, labels), the others may pass None. Instead of a plan, a list
        of this replica's `MicroBatchShape`s or `MicroBatch`es (the latter with ``collation=``) works.
        ``recompute``: this step's recomputed layers per stage (e.g. a loader step's
        ``step.plan.options["recompute_layers"]`` when only its shapes are passed). A NaN or infinite loss or
        gradient raises `NonFiniteStep` on every rank, naming the step, stage and micro-batch, before any
        update (``RunnerConfig.nonfinite``; ``"skip"``: no rank updates, the step joins ``skipped_steps``).
        Raises the original exception on the rank where something failed and
        `PipelineAborted` (naming that rank and its error) on every other rank; a rank that makes no
        progress for ``timeout_s`` while others wait on it, or dies, ends every other rank with a
        `PipelineAborted` naming it and what it was doing (see `dynabatch.pipeline.runtime.failure`).
        """
        if not self.config.flush:
            raise ValueError("RunnerConfig(flush=False): give the steps to run_steps(...), which runs them as one "
                             "asynchronous stream")
        result, nonfinite = self.guard.run(lambda: self._step(plan, batches, optimizer, collation, recompute))
        if nonfinite is not None:  # every rank decided alike (`nonfinite.reduce_step`): all raise it
            raise NonFiniteStep(nonfinite)
        return result

    def run_steps(self, steps, *, optimizer: torch.optim.Optimizer, num_tokens=None,
                  collation: str | None = None) -> list[StepResult]:
        """Train several steps: ``steps`` is a sequence of ``(plan, batches)`` pairs as `step` takes them
        (a plan or this replica's shapes, and its micro-batch dictionaries). Returns one `StepResult` each.

        ``RunnerConfig(flush=True)`` (the default): `step` after `step`. ``flush=False``: the steps'
        micro-batches run as one 1F1B stream without a flush between steps. After the backward of a
        step's last micro-batch on this stage, the stage all-reduces its gradients over the
        data-parallel replicas, divides them by that step's ``num_tokens`` and calls
        ``optimizer.step()``, while earlier stages already run the next step's forwards. A forward
        whose backward comes after ``lag`` updates (`dynabatch.core.simulate.flushfree.update_lag`) computes
        with the weights `RunnerConfig.weight_prediction` says. ``num_tokens``: each step's real
        target tokens over all ranks (the loss normalizer; a loader `Step`'s ``target_tokens``),
        required: no stage may wait for the last stage's count before its own update. The per-step
        losses are all-reduced once, at the end of the stream, so they are the same on every rank.
        Recomputation follows ``RunnerConfig.recompute`` for the whole stream. ``gather_timing`` is
        not supported here; each result's ``timing.step_s`` is the time between this stage's updates."""
        steps = list(steps)
        if self.config.flush:
            return [self.step(p, b, optimizer=optimizer, collation=collation) for p, b in steps]
        return run_stream(self, steps, optimizer, num_tokens, collation)

    def weight_predictor(self, optimizer):
        """The stage's `WeightPredictor` for ``optimizer`` under ``RunnerConfig.weight_prediction`` (made
        once and kept; ``none`` keeps only the aliasing hooks)."""
        from .weight_prediction import WeightPredictor

        mode = self.config.weight_prediction or "none"
        wp = self._wp
        if wp is None or wp.optimizer is not optimizer or wp.mode != mode:
            if wp is not None:
                wp.close()
            wp = WeightPredictor(optimizer, mode, gradient=self.config.prediction_gradient)
            self._wp = wp
        return wp

    def trainable(self) -> list:
        """This stage's parameters that take gradients."""
        return [p for p in self.stage.parameters() if p.requires_grad]

    def one_model(self, shapes: Sequence[MicroBatchShape], batches: Sequence[dict] | None, step: int, *,
                  per_microbatch: bool = False) -> OneModel:
        """The interpreter hooks of ``shapes`` on this stage, after checking ``batches`` against them:
        the stages that read dictionaries (first, last, a bypass entry) need all of them. ``per_microbatch``:
        one loss accumulator per micro-batch (run with ``groups=len(shapes)``), else one."""
        ctx, stage, s = self.ctx, self.stage, self.ctx.stage
        M = len(shapes)
        if M == 0:
            raise ValueError(f"replica {ctx.replica} has no micro-batches in this step")
        entry = self.entries(shapes)
        needs_data = stage.is_first or stage.is_last or bool((entry == s).any())
        if needs_data and (batches is None or len(batches) != M):
            raise ValueError(f"stage {s} needs the {M} micro-batch dictionaries of this step, got "
                             f"{'None' if batches is None else len(batches)}"
                             + ("" if stage.is_first or stage.is_last else
                                " (it is the entry stage of micro-batches that bypass the stages before it)"))
        if needs_data and self.config.check_inputs:
            for j, (b, sh) in enumerate(zip(batches, shapes)):
                check_batch(b, sh, f"step {self.step_index} micro-batch {j}")
        watch = GradWatch(M, ctx.device, self.trainable) if self.config.nonfinite != "off" else None
        hooks = _Step(stage, s, self.boundary, shapes, batches if needs_data else None, entry, ctx.device,
                      self.bypass, self.step_index, watch=watch, per_microbatch=per_microbatch)
        return with_chunks(hooks, stage, s, self.boundary, shapes, batches if needs_data else None, ctx.device,
                           self.step_index)

    def start_program(self, program, hooks, recompute: int) -> Clock:
        """Before a program's first op: clear the gradients, run the plan check (`RunnerConfig.check_plan`)
        and set the stage's recomputed layers; returns the clock that times the program."""
        for p in self.trainable():
            p.grad = None
        self.p2p.step = self.step_index
        if self.config.check_plan and self.ctx.num_stages > 1:
            check_links(program, hooks, self.ctx.stage, self.p2p, self.guard)
        self.stage.recompute = recompute
        return Clock(self.ctx.device)

    def run(self, program, hooks, clock: Clock, size: int, groups: int = 1):
        """`run_program` of ``program`` on this stage (metering saved bytes per `RunnerConfig.measure_memory`)."""
        return run_program(program, hooks, ctx=self.ctx, p2p=self.p2p, guard=self.guard, clock=clock, size=size,
                           groups=groups, param_ptrs=self._param_ptrs if self.config.measure_memory else None)

    def _step(self, plan, batches, optimizer, collation, recompute) -> StepResult:
        t_step = time.perf_counter()
        ctx, stage, k = self.ctx, self.stage, self.step_index
        s = ctx.stage
        ctx.monitor.set_state("busy", f"preparing step {k}")
        shapes = self.shapes(plan, collation)
        hooks = self.one_model(shapes, batches, k, per_microbatch=True)
        program, _ = self._program(shapes, plan)
        clock = self.start_program(program, hooks, self.recompute_layers(plan, recompute))
        M = len(shapes)
        run = self.run(program, hooks, clock, M, groups=M)  # one loss per micro-batch: a bad one is named
        self.last_run = run
        loss, tokens, verdict, ran = reduce_step(self.guard, run.loss, run.tokens, [(0, M)], [hooks.watch],
                                                 f"step {k}", hooks.watch is not None)
        total_loss, n_tokens = float(loss[0]), float(tokens[0])
        bad = verdict is not None and verdict.bad()
        if bad:  # on every rank alike: no update anywhere (no gradient all-reduce, no optimizer step)
            for p in self.trainable():
                p.grad = None
            if self.config.nonfinite == "skip":
                self.skipped_steps.append(k)
        else:
            update_stage(self.guard, self.trainable(), n_tokens, optimizer, f"step {k}", ties=self.ties)
        clock.resolve()
        metered = self.config.measure_memory
        timing = StepTiming(k, ctx.rank, s, ctx.replica, run.forward_s, run.backward_s, run.wait_s,
                            time.perf_counter() - t_step, run.saved_bytes if metered else None, float(run.peak_bytes),
                            int(stage.recompute))
        all_timings = None
        if self.config.gather_timing:
            all_timings = gather_timings(self.guard, timing, ran[::ctx.num_stages])  # each replica's count
        self.step_index += 1
        peaks = (getattr(plan, "options", None) or {}).get("stage_peak_bytes")
        result = StepResult(timing.step, total_loss * (1.0 / max(n_tokens, 1.0)), int(round(n_tokens)), timing,
                            all_timings, float(peaks[s]) if peaks else None)
        return result, (verdict.message(f"step {k}") if bad and self.config.nonfinite == "raise" else None)


class _Step(OneModel):
    """The hooks of one model's step: this stage's gradient flags after each backward (``watch``: a
    `GradWatch`, None when unchecked) and, with ``per_microbatch``, one loss accumulator per micro-batch
    (a non-finite one is named; else one for the step, as `OneModel`)."""

    def __init__(self, *args, watch: GradWatch | None = None, per_microbatch: bool = False, **kw):
        super().__init__(*args, **kw)
        self.watch = watch
        self.per_microbatch = per_microbatch

    def group(self, v: int) -> int:
        return v if self.per_microbatch else 0

    def after_backward(self, v: int) -> None:
        if self.watch is not None:
            self.watch.after_backward(v)
