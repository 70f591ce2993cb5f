"""`MultiModelRunner`: K models trained on the same micro-batches of one data pass, on one pipeline.

Each rank is one stage device and holds stage ``s`` of every model: K *shards* (a shard is a model's
stage parameters, their gradients and the optimizer's state for them). Per step:

* **Order, from the plan alone.** Models are ordered longest-remaining-time-first from the plan's
  predicted seconds (`dynabatch.core.simulate.multimodel.lrtf_order`: micro-batch ``time_s`` summed x
  each model's ``time_scale``), and position ``p``'s micro-batch ``j`` becomes virtual micro-batch
  ``v = p * M + j``. The per-stage op orders over the ``K * M`` virtual micro-batches are
  `multimodel_orders` (1F1B over all of them with ``interleave=True``: stage 0 starts the next
  model while the last stage drains the previous one; model after model with ``interleave=False``).
  The communication program of each rank is `schedule.build_programs` of those orders, as for one
  model. Every input to this (the plan's shapes and seconds, ``time_scale``, K, the stage count) is
  the same on every rank, so every rank derives the same programs.
* **Why it cannot deadlock.** The programs are the single-model runner's construction applied to
  a valid op order over virtual micro-batches: both ends of every link post the same message
  sequence, sorted by the witness simulation's send times, so the globally first unfinished
  message is always at the head of both queues (`schedule.check_programs` verifies the K-model
  programs under strict NCCL FIFO semantics; the tests run it). The shard moves (spill, load,
  prefetch) are local to a rank, never wait for another rank, and are planned before the step's
  first transfer: a budget that cannot hold the shards an order needs at once raises a
  `ValueError` before any communication (and `PipelineAborted` on the other ranks).
* **Why it is bit-identical to training each model alone** with `PipelineRunner` (``gpipe`` or
  ``1f1b``, which run a model's micro-batches in ascending order): every model's forwards and
  backwards run on every stage in ascending micro-batch order, so each gradient is accumulated in
  the same order with the same operations; the gradients are scaled by the same
  ``1 / max(num_tokens, 1)`` with the same ``torch._foreach_mul_`` and the same optimizer steps on
  the same tensors; spilling copies tensors bit for bit.
* **The update.** With ``num_tokens`` (the step's real target tokens over all ranks: a loader
  `Step`'s ``target_tokens``) a model's update on a stage runs right after its last backward there,
  so its shard is resident once per step (Hydra); the counted tokens are checked against it at the
  end of the step. Without it, one all-reduce at the end of the step gives every model's count (as
  `PipelineRunner.step`), and the shards are updated one after another in LRTF order.
* **Spilling** (`dynabatch.pipeline.runtime.shards.ShardStore`): with ``memory_budget_bytes`` (per stage device), a shard's bytes
  (parameters + gradients + optimizer state; optimizer state predicted before it exists) must fit
  the budget (else `ValueError` naming the shard and its bytes). Shards not needed are kept in host
  memory (pinned on GPU) and brought back before their turn: the next shard in this stage's use
  sequence is prefetched as soon as the shard before it starts (when it fits, evicting the resident
  shard used furthest in the future); a shard not yet resident at its turn is loaded then. On GPU
  loads are ``non_blocking`` copies on a side stream that the compute stream waits for; on CPU the
  same code path moves the tensors between the model and host copies, so the budget is accounted
  exactly (`ShardStore.resident_bytes` measures the tensors the models and optimizers hold on the
  device, each storage once) and checked after every operation. Activations are not part of the
  budget (see `dynabatch.pipeline.measure.memory` for those).

``refit_time_scale`` refits each model's ``time_scale`` from measured shard times (one all-reduce,
so every rank keeps deriving the same order); ``refit_every=N`` calls it every N steps.
`dynabatch.core.plan.feedback.FeedbackLoop.record_step` takes a `MultiStepResult`: every model's measured
micro-batch times, each divided by its ``time_scale``, refit the plan's cost model (``DataLoader.feedback``
works unchanged), so the plan's seconds and the scales together follow what was measured. Bit-identity
holds where the kernels are deterministic (CPU; on CUDA with ``torch.use_deterministic_algorithms(True)``).

The step runs on the one interpreter of a stage's program (`dynabatch.pipeline.runtime.interpreter`):
`ManyModels` maps each virtual micro-batch to its model's stage module, makes the model's shard
resident before each op (`dynabatch.pipeline.runtime.residency.StepShards`) and runs each model's
update with `dynabatch.pipeline.runtime.update.update_stage`, which sums the gradients of parameters a
model shares between stages (`dynabatch.pipeline.runtime.tied`) first. Limits: one
pipeline replica (``num_replicas == 1``); flushed steps only (no flush-free streams); one scale per
model (a model's stages are priced in the plan's per-stage proportions); module buffers are not
spilled (the project's models have none); models must share the stage count (their cuts may differ).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ...core.simulate.multimodel import lrtf_order, multimodel_orders
from ..measure.timing import Clock, StepResult, StepTiming
from ..models.spec import check_batch
from .comm import CommEvent, P2P
from .config import RunnerConfig
from .guard import StepGuard
from .interpreter import Feed, Hooks, check_links, run_program
from .residency import StepShards
from .runner import PipelineRunner, microbatch_counts
from .schedule import build_programs, quantize_times
from .shards import ShardStore, shard_bytes
from .nonfinite import GradWatch, NonFiniteStep, check_update, reduce_step
from .update import gather_timings, update_stage

__all__ = ["MultiModelRunner", "MultiStepResult", "ShardStore", "shard_bytes"]  # the last two from .shards


# --------------------------------------------------------------------------- the runner


@dataclass(frozen=True)
class MultiStepResult:
    """One step of `MultiModelRunner.step`: ``results[k]`` is model ``k``'s `StepResult` (loss per real
    target token, tokens, this stage's times per micro-batch; ``timing.wait_s`` and ``timing.step_s``
    are the step's, shared by the models). ``order``: the LRTF model order of the step.
    ``peak_resident_bytes``: the most shard bytes measured on this device during the step;
    ``budget_bytes``: the budget (None: unlimited); ``spills``/``loads``/``prefetches``: shard moves on
    this device during the step (prefetches: loads issued before the shard's turn).
    ``time_scale[k]``: model ``k``'s seconds per plan second that the step's order used (what
    `dynabatch.core.plan.feedback.FeedbackLoop.record_step` divides model ``k``'s measured times by).
    ``moved_bytes``/``copy_s``: shard bytes the spills and loads copied on this device during the
    step and the seconds spent in them (on CPU the copies; on GPU issuing them)."""

    step: int
    results: tuple[StepResult, ...]
    order: tuple[int, ...]
    peak_resident_bytes: int
    budget_bytes: float | None
    spills: int
    loads: int
    prefetches: int
    time_scale: tuple[float, ...] = ()
    moved_bytes: int = 0
    copy_s: float = 0.0


class MultiModelRunner:
    """Trains K models on the same micro-batches, one pipeline, one data pass (module docstring).

    ``runners[k]``: model ``k``'s `PipelineRunner` on this rank (its stage, boundary and recompute
    setting; all on the same `DistContext`); ``optimizers[k]`` over ``runners[k].parameters()``.
    ``memory_budget_bytes``: shard bytes this stage device may hold (each rank passes its own; None:
    no limit). ``interleave``: 1F1B over all models' micro-batches (True) or model after model (False,
    one shard active per stage). ``time_scale[k]``: model ``k``'s seconds per plan second, what the
    LRTF order and the witness times use (default 1 for every model; `from_models` defaults to each
    model's parameter count over the largest, a proxy every rank computes alike).
    ``names[k]`` names model ``k`` in errors. ``recorder``/``debug_shapes``/``check_plan`` as for
    `PipelineRunner`. ``gather_timing`` (default: the first runner's ``RunnerConfig.gather_timing``):
    every rank's `StepTiming` of every model in each result's ``all_timings``, what a `FeedbackLoop`
    needs to refit the cost model identically on every rank. ``refit_every``: call
    `refit_time_scale` on the last ``refit_every`` steps after every ``refit_every`` steps (None: only
    when called), so the LRTF order follows the measured shard times."""

    def __init__(self, runners: Sequence[PipelineRunner], optimizers: Sequence, *,
                 memory_budget_bytes: float | None = None, interleave: bool = True,
                 time_scale: Sequence[float] | None = None, names: Sequence[str] | None = None,
                 recorder: Callable[[CommEvent], None] | None = None, debug_shapes: bool = False,
                 check_plan: bool = True, gather_timing: bool | None = None, refit_every: int | None = None):
        runners = list(runners)
        if not runners:
            raise ValueError("MultiModelRunner needs at least one model")
        if len(optimizers) != len(runners):
            raise ValueError(f"{len(runners)} models but {len(optimizers)} optimizers")
        ctx = runners[0].ctx
        if any(r.ctx is not ctx for r in runners):
            raise ValueError("every model's runner must use the same DistContext")
        if any(r.bypass is not None for r in runners):
            raise ValueError("MultiModelRunner runs every micro-batch on every stage: RunnerConfig(bypass_idle_stages="
                             "True) is for PipelineRunner")
        if ctx.num_replicas != 1:
            raise ValueError(f"MultiModelRunner runs one pipeline replica; this context has {ctx.num_replicas}")
        other = sorted({r.config.schedule for r in runners} - {"auto", "1f1b"})
        if other:  # its order is multimodel_ops: 1F1B over the models' virtual micro-batches, nothing else yet
            raise ValueError(f"MultiModelRunner runs 1F1B over the models' micro-batches (interleaved or model after "
                             f"model); RunnerConfig(schedule={other[0]!r}) is not supported here: use '1f1b' (or "
                             "'auto'), or train that model alone with PipelineRunner")
        self.ctx, self.runners, self.optimizers = ctx, runners, list(optimizers)
        self.K = len(runners)
        self.interleave = bool(interleave)
        self.check_plan = check_plan
        self.names = list(names) if names is not None else [f"model {k}" for k in range(self.K)]
        if time_scale is None:
            time_scale = np.ones(self.K)
        self.time_scale = np.asarray(time_scale, np.float64)
        if self.time_scale.shape != (self.K,) or not np.all(self.time_scale > 0):
            raise ValueError(f"time_scale must be {self.K} positive numbers, got {time_scale!r}")
        s = ctx.stage
        self.store = ShardStore([r.stage for r in runners], self.optimizers, ctx.device, memory_budget_bytes,
                                [f"{n} stage {s} (rank {ctx.rank})" for n in self.names])
        self.p2p = P2P(ctx, debug_shapes=debug_shapes, recorder=recorder)
        self.step_index = 0
        self.gather_timing = runners[0].config.gather_timing if gather_timing is None else bool(gather_timing)
        if refit_every is not None and int(refit_every) < 1:
            raise ValueError(f"refit_every must be >= 1 or None, got {refit_every!r}")
        self.refit_every = None if refit_every is None else int(refit_every)
        self._window: list[MultiStepResult] = []  # results since the last automatic refit
        self._programs: OrderedDict = OrderedDict()
        self.guard = StepGuard(ctx, "the multi-model runner", lambda: self.step_index)
        self.nonfinite = runners[0].config.nonfinite  # RunnerConfig.nonfinite of the first model's runner
        self.skipped_steps: list[tuple[int, int]] = []  # (step, model) updates skipped (nonfinite="skip")

    @classmethod
    def from_models(cls, models: Sequence, ctx, bounds, optimizer: Callable[[object, int], torch.optim.Optimizer], *,
                    config: RunnerConfig = RunnerConfig(schedule="1f1b"), time_scale: Sequence[float] | None = None,
                    memory_budget_bytes: float | None = None, interleave: bool = True,
                    names: Sequence[str] | None = None, recorder: Callable[[CommEvent], None] | None = None,
                    debug_shapes: bool = False, check_plan: bool = True, gather_timing: bool | None = None,
                    refit_every: int | None = None) -> "MultiModelRunner":
        """Keep this rank's stage of each `LayeredModel` in ``models`` (cut at ``bounds``: one list for
        all, or one per model), build each one's optimizer with ``optimizer(parameters, k)``; the
        default ``time_scale`` is each model's parameter count over the largest. The other keywords as
        `MultiModelRunner` takes them."""
        models = list(models)
        per_model = isinstance(bounds, (list, tuple)) and len(bounds) > 0 and not np.isscalar(bounds[0])
        per = list(bounds) if per_model else [bounds] * len(models)
        if len(per) != len(models):
            raise ValueError(f"{len(per)} cuts for {len(models)} models")
        runners = [PipelineRunner.from_model(m, ctx, b, config) for m, b in zip(models, per)]
        opts = [optimizer(r.parameters(), k) for k, r in enumerate(runners)]
        if time_scale is None:
            sizes = np.array([sum(p.numel() for layer in m.layers for p in layer.parameters()) for m in models], float)
            time_scale = sizes / sizes.max()
        return cls(runners, opts, time_scale=time_scale, memory_budget_bytes=memory_budget_bytes,
                   interleave=interleave, names=names, recorder=recorder, debug_shapes=debug_shapes,
                   check_plan=check_plan, gather_timing=gather_timing, refit_every=refit_every)

    # -- planning ------------------------------------------------------------------------------
    def order(self, times: np.ndarray) -> np.ndarray:
        """The LRTF model order for micro-batches predicted to take ``times`` seconds each."""
        return lrtf_order(self.time_scale * float(np.sum(times)))

    def _program(self, times: np.ndarray, M: int):
        order = self.order(times)
        S = self.ctx.num_stages
        vt = np.concatenate([self.time_scale[k] * times for k in order])
        units = quantize_times(vt)
        key = (S, M, self.interleave, order.tobytes(), units.tobytes())
        hit = self._programs.get(key)
        if hit is None:
            ops = multimodel_orders(S, self.K, M, interleave=self.interleave)
            hit = (build_programs(ops, units)[self.ctx.stage], ops, order)
            self._programs[key] = hit
            if len(self._programs) > 256:
                self._programs.popitem(last=False)
        return hit

    def programs(self, plan, collation: str | None = None):
        """(this rank's program, the op orders [S, 2KM], the model order) for ``plan``."""
        shapes = self.runners[0].shapes(plan, collation)
        return self._program(np.array([sh.time_s for sh in shapes]), len(shapes))

    def refit_time_scale(self, results: Sequence[MultiStepResult], *, digits: int = 3) -> np.ndarray:
        """Refit ``time_scale`` from measured times: each model's forward+backward seconds over
        ``results`` (this rank's), summed over every rank with one all-reduce (so every rank gets the
        same figures and keeps deriving the same order), divided by the largest and rounded to
        ``digits`` significant digits. Call it on every rank at the same step; returns the new scale."""
        mine = torch.zeros(self.K, dtype=torch.float64)
        for res in results:
            for k, r in enumerate(res.results):
                mine[k] += float(np.sum(r.timing.forward_s) + np.sum(r.timing.backward_s))
        mine = mine.to(self.ctx.device)

        def reduce():
            self.guard.all_reduce(mine, "in the all-reduce of measured shard times (waiting for every rank)",
                                  self.guard.everyone())
            return mine.cpu().numpy()

        total = self.guard.run(reduce)
        if not np.all(total > 0):
            raise ValueError(f"no measured time for some model: {total.tolist()} s")
        scale = total / total.max()
        scale = np.array([float(f"{x:.{digits}g}") for x in scale])
        self.time_scale = np.maximum(scale, 10.0 ** -digits)
        return self.time_scale

    # -- execution -----------------------------------------------------------------------------
    def step(self, plan, batches: Sequence[dict] | None = None, *, num_tokens: int | None = None,
             collation: str | None = None) -> MultiStepResult:
        """Train every model on this step's micro-batches (``plan`` and ``batches`` as
        `PipelineRunner.step` takes them; the first and last stage need ``batches``). ``num_tokens``:
        the step's real target tokens over all ranks, which lets each model update right after its
        last backward on each stage (see the module doc); checked against the heads' count.
        Errors end every rank as in `PipelineRunner.step`. With ``refit_every`` the step that
        completes a window of that many steps then refits ``time_scale`` (the next step's order)."""
        if num_tokens is not None and self.nonfinite == "skip":
            raise ValueError("RunnerConfig(nonfinite='skip') with num_tokens: each model updates right after its "
                             "last backward on each stage, before the stages could agree to skip; pass "
                             "num_tokens=None or use nonfinite='raise'")
        res, nonfinite = self.guard.run(lambda: self._step(plan, batches, num_tokens, collation))
        if nonfinite is not None:  # every rank decided alike (`nonfinite.reduce_step`): all raise it
            raise NonFiniteStep(nonfinite)
        if self.refit_every is not None:
            self._window.append(res)
            if len(self._window) >= self.refit_every:  # the same step on every rank: a collective
                window, self._window = self._window, []
                self.refit_time_scale(window)
        return res

    def _step(self, plan, batches, num_tokens, collation) -> MultiStepResult:
        t_step = time.perf_counter()
        ctx, store, step_k, K = self.ctx, self.store, self.step_index, self.K
        s, S = ctx.stage, ctx.num_stages
        ctx.monitor.set_state("busy", f"preparing multi-model step {step_k}")
        shapes = self.runners[0].shapes(plan, collation)
        M = len(shapes)
        if M == 0:
            raise ValueError(f"replica {ctx.replica} has no micro-batches in this step")
        needs_data = s == 0 or s == S - 1
        if needs_data and (batches is None or len(batches) != M):
            raise ValueError(f"stage {s} needs the {M} micro-batch dictionaries of this step, got "
                             f"{'None' if batches is None else len(batches)}")
        if needs_data:
            for j, (b, sh) in enumerate(zip(batches, shapes)):
                check_batch(b, sh, f"step {step_k} micro-batch {j}")
        program, ops, order = self._program(np.array([sh.time_s for sh in shapes]), M)
        early = num_tokens is not None
        shards = StepShards(store, program, order, M, ops[s], early, interleave=self.interleave, names=self.names,
                            monitor=ctx.monitor, stage=s, rank=ctx.rank, step=step_k)
        watches = [GradWatch(K * M, ctx.device, r.trainable) if self.nonfinite != "off" else None
                   for r in self.runners]
        hooks = ManyModels(self, shapes, batches if needs_data else None, order, shards,
                           float(num_tokens) if early else None, watches)
        self.p2p.step = step_k
        for r in self.runners:
            for p in r.stage.parameters():
                p.grad = None
            r.stage.recompute = r.recompute_layers(plan)
        if self.check_plan and S > 1:
            check_links(program, hooks, s, self.p2p, self.guard)
        clock = Clock(ctx.device)
        run = run_program(program, hooks, ctx=ctx, p2p=self.p2p, guard=self.guard, clock=clock, size=K * M,
                          groups=K * M)  # one loss per virtual micro-batch: a non-finite one is named
        position = np.argsort(order)  # model k ran as virtual micro-batches position[k] * M + j
        ranges = [(int(position[k]) * M, int(position[k]) * M + M) for k in range(K)]
        total_loss, counted, verdict, _ = reduce_step(self.guard, run.loss, run.tokens, ranges, watches,
                                                   f"multi-model step {step_k}", watches[0] is not None)
        bad = [k for k in range(K) if verdict is not None and verdict.bad(k)]
        if early:
            miscounted = [k for k in range(K) if counted[k] != float(num_tokens)]
            if miscounted:
                k = miscounted[0]
                raise ValueError(f"num_tokens={num_tokens} but the heads counted {counted[k]:.0f} real target "
                                 f"tokens for {self.names[k]} in step {step_k}: the updates used the wrong "
                                 f"normalizer")
        else:
            for k in shards.remaining():
                shards.use(k)
                if bad:  # on every rank alike; "raise": no model updates in this step, "skip": only the bad ones
                    if k in bad or self.nonfinite == "raise":
                        for p in self.runners[k].trainable():
                            p.grad = None
                        if self.nonfinite == "skip":
                            self.skipped_steps.append((step_k, k))
                        continue
                hooks.update(k, float(counted[k]))
        clock.resolve()
        step_s = time.perf_counter() - t_step
        results = []
        for k in range(K):
            n = float(counted[k])
            sl = slice(int(position[k]) * M, (int(position[k]) + 1) * M)
            timing = StepTiming(step_k, ctx.rank, s, ctx.replica, run.forward_s[sl].copy(), run.backward_s[sl].copy(),
                                run.wait_s, step_s, None, 0.0, int(self.runners[k].stage.recompute))
            # every rank's timings: the same all-gather as the single-model runner's, model by model
            every = gather_timings(self.guard, timing, microbatch_counts(plan, 1, M)) if self.gather_timing else None
            results.append(StepResult(step_k, float(total_loss[k]) * (1.0 / max(n, 1.0)), int(round(n)), timing,
                                      every))
            self.runners[k].step_index += 1
        self.step_index += 1
        spills, loads, prefetches, moved, copy_s = shards.moves()
        res = MultiStepResult(step_k, tuple(results), tuple(int(k) for k in order), int(store.peak_bytes),
                              store.budget, spills, loads, prefetches, tuple(float(x) for x in self.time_scale),
                              moved, copy_s)
        raising = bad and (self.nonfinite == "raise" or early)
        after = "the models had already updated" if early else "no rank updated any model in this step"
        return res, (verdict.message(f"multi-model step {step_k} of {self.names[bad[0]]}", bad[0], after=after)
                     if raising else None)


class ManyModels(Hooks):
    """The interpreter hooks of a multi-model step: virtual micro-batch ``v = p * M + j`` is micro-batch
    ``j`` of model ``order[p]``, run by that model's stage module; before each op the model's shard is
    made resident (`StepShards.use`); after a model's last backward here its update runs when
    ``num_tokens`` is known (early updates), and its first backward's gradients are measured."""

    def __init__(self, runner: MultiModelRunner, shapes, batches, order: np.ndarray, shards: StepShards,
                 num_tokens: float | None, watches):
        self.runner, self.order, self.shards, self.num_tokens = runner, order, shards, num_tokens
        self.watches = watches  # per model: its gradient flags per virtual micro-batch (`GradWatch`, or None)
        self.M = len(shapes)
        self.s = runner.ctx.stage
        self.first, self.last = self.s == 0, self.s == runner.ctx.num_stages - 1
        self.feed = Feed(batches, runner.ctx.device, keep=True)
        self.boundary: list[tuple] = []
        for v in range(len(order) * self.M):
            r = runner.runners[self.model(v)]
            sh = shapes[v % self.M]
            self.boundary.append((None if self.first else tuple(r.boundary(sh, r.stage.first_layer - 1)),
                                  None if self.last else tuple(r.boundary(sh, r.stage.last_layer))))
        self.grads_made: set[int] = set()  # models whose backward ran on this stage this step

    def model(self, v: int) -> int:
        """The model virtual micro-batch ``v`` belongs to."""
        return int(self.order[v // self.M])

    def module(self, v: int):
        return self.runner.runners[self.model(v)].stage

    def specs(self, v: int):
        return self.boundary[v]

    def describe(self, v: int) -> str:
        return (f"micro-batch {v % self.M} of {self.runner.names[self.model(v)]} (virtual {v}) of multi-model step "
                f"{self.runner.step_index}")

    def batch(self, v: int) -> dict | None:
        return self.feed.get(v % self.M) if self.first or self.last else None

    def starts(self, v: int) -> bool:
        return self.first

    def group(self, v: int) -> int:
        return v

    def before_op(self, v: int, forward: bool) -> None:
        self.shards.use(self.model(v))

    def after_backward(self, v: int) -> None:
        k = self.model(v)
        if self.watches[k] is not None:
            self.watches[k].after_backward(v)
        if k not in self.grads_made:  # a model's first backward here allocates its gradients; the
            self.grads_made.add(k)      # others accumulate in place, so the bytes change only then
            self.runner.store.observe()
        if self.num_tokens is not None and self.shards.update_due(k):
            self.update(k, self.num_tokens)

    def update(self, k: int, n_tokens: float) -> None:
        """Model ``k``'s update on this stage (its gradients are freed after); an early one (``num_tokens``
        known) is refused when the model's gradients here are not finite (`nonfinite.check_update`)."""
        r = self.runner
        if self.num_tokens is not None and self.watches[k] is not None:
            lo = int(np.argsort(self.order)[k]) * self.M
            check_update(self.watches[k], lo, lo + self.M, f"multi-model step {r.step_index} of {r.names[k]}",
                         self.s, r.ctx.rank)
        update_stage(r.guard, r.runners[k].trainable(), n_tokens, r.optimizers[k],
                     f"{r.names[k]}'s stage {self.s} (multi-model step {r.step_index})", ties=r.runners[k].ties,
                     free_grads=True)
        r.store.observe()
