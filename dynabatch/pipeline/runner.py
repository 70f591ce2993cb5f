"""`PipelineRunner`: execute one global batch's micro-batches on this rank's stage.

Each step: derive the stage op order (GPipe, 1F1B or memory-aware adaptive) and this stage's
communication program from the plan (identical on every rank: see `schedule`), run it with
asynchronous point-to-point transfers, accumulate gradients over the step's variable-shape
micro-batches, normalize the loss per real target token of the whole global batch, all-reduce the
gradients over data-parallel replicas, and take one optimizer step.

Loss normalization: the head returns the *sum* of token losses; backward runs on those sums; at
the end one all-reduce over all ranks gives the global token count ``N`` (and the loss sum), and
the gradients are divided by ``N``. This equals ``sum(token losses) / N`` differentiated once,
whatever the micro-batch sizes — not a mean of per-micro-batch means.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..core.batchplan import BatchPlan, MicroBatch
from ..core.plan.recompute import recompute_layers
from .bypass import Bypass
from .comm import CommEvent, DistContext, P2P
from .guard import GuardedSteps
from .memory import SavedBytes, param_pointers
from .partition import PipelineStage, StagePartition, split_model
from .schedule import SCHEDULES, Message, Post, build_programs, quantize_times, runner_orders
from .reference import sequential_step  # noqa: F401 (the one-process reference, public from here too)
from .spec import PlanMismatch  # noqa: F401 (public from here too)
from .spec import MicroBatchShape, TensorSpec, _as_tuple, _to_device, check_batch, plan_shapes
from .stream import run_stream, stream_results, stream_update
from .timing import StepResult, StepTiming, _Clock


@dataclass(frozen=True)
class RunnerConfig:
    """How the runner executes a step.

    ``schedule``: ``auto`` (default: the order each plan records, 1F1B for bare shapes), or ``gpipe``,
    ``1f1b``, ``adaptive`` to override the plan (`schedule.plan_schedule`). ``memory_limit_bytes``:
    in-flight activation bytes per stage for ``adaptive`` (default the plan's recorded budget, else
    ``num_stages`` x the step's largest micro-batch). ``debug_shapes``: send a header before every
    message and check it against the receiver's plan. ``gather_timing``: all-gather every rank's `StepTiming` into each step's result
    (what `dynabatch.core.plan.feedback.FeedbackLoop` needs on every rank). ``check_inputs``: check the
    micro-batch dictionaries against the plan before running. ``check_plan``: before the step's first
    transfer, both ends of every link compare a small fingerprint of the messages and shapes they
    expect (one tiny message per link and direction); ranks holding different plans then stop with a
    `ShapeMismatch` naming the micro-batch and both shapes instead of crashing in the transport.
    ``recompute``: ``auto`` (default: the per-stage counts the plan records in
    ``options["recompute_layers"]``, none without), ``none``, ``full`` (every recomputable layer), or
    one count per stage (the first k recomputable layers run under ``torch.utils.checkpoint``; see
    `dynabatch.core.plan.recompute`). ``measure_memory``: meter the activation bytes each micro-batch keeps
    for backward (`dynabatch.pipeline.memory.SavedBytes`) and report the step's peak.
    ``flush``: False makes `run_steps` run its steps as one asynchronous 1F1B stream (PipeOptim): stage
    ``s`` starts the next step's forwards while later stages finish this one, and applies its update
    as soon as its part of a step is done. ``weight_prediction`` then says what a forward whose
    backward comes after an update computes with: None (the current, stale weights), ``"stash"``
    (the backward gets the forward's version back) or ``"predict"`` (the weights predicted from the
    optimizer's own rule, `dynabatch.pipeline.weight_prediction.WeightPredictor`, with future
    gradients from ``prediction_gradient``). ``bypass_idle_stages``: a micro-batch skips the stages
    holding only layers idle for it (`dynabatch.pipeline.bypass`: no op, no message there; its entry
    stage starts it from its dictionary, so a middle entry stage needs the step's dictionaries too);
    flushed steps of `from_model` runners only.
    """

    schedule: str = "auto"
    memory_limit_bytes: float | None = None
    debug_shapes: bool = False
    gather_timing: bool = False
    check_inputs: bool = True
    check_plan: bool = True
    recompute: str | tuple[int, ...] = "auto"
    measure_memory: bool = True
    flush: bool = True
    weight_prediction: str | None = None
    prediction_gradient: str = "last"
    bypass_idle_stages: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.weight_prediction not in (None, "none", "stash", "predict"):
            raise ValueError(f"weight_prediction must be None, 'stash' or 'predict', got {self.weight_prediction!r}")
        if self.bypass_idle_stages and not self.flush:
            raise ValueError("bypass_idle_stages runs flushed steps only (flush=True)")
        if not self.flush and self.schedule not in ("auto", "1f1b"):
            raise ValueError(f"flush=False runs asynchronous 1F1B; schedule={self.schedule!r} is not 1f1b")
        r = self.recompute
        if isinstance(r, str):
            if r not in ("auto", "none", "full"):
                raise ValueError(f"recompute must be 'auto', 'none', 'full' or per-stage counts, got {r!r}")
        else:
            counts = tuple(int(x) for x in r)
            if any(c < 0 for c in counts) or any(c != x for c, x in zip(counts, r)):
                raise ValueError(f"recompute counts must be integers >= 0, got {r!r}")
            object.__setattr__(self, "recompute", counts)


class PipelineRunner(GuardedSteps):
    """Runs steps of planned micro-batches on one stage of a pipeline (see the module docstring).

    ``stage`` is this rank's `PipelineStage` (already on ``ctx.device``), ``boundary(shape, layer)``
    the model's boundary `TensorSpec`s, ``recorder`` an optional hook receiving every posted
    point-to-point operation (`CommEvent`), ``bypass`` the model's `Bypass` (`from_model` makes it
    when ``config.bypass_idle_stages``).
    """

    def __init__(self, stage: PipelineStage, boundary: Callable[[MicroBatchShape, int], Sequence[TensorSpec]],
                 ctx: DistContext, config: RunnerConfig = RunnerConfig(), *,
                 recorder: Callable[[CommEvent], None] | None = None, bypass: Bypass | None = None):
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
        self.p2p = P2P(ctx, debug_shapes=config.debug_shapes, recorder=recorder)
        self.step_index = 0
        self._programs: OrderedDict = OrderedDict()
        self._in_comm = False
        self._param_ptrs = param_pointers([stage])

    @classmethod
    def from_model(cls, model, ctx: DistContext, bounds: Sequence[int] | StagePartition,
                   config: RunnerConfig = RunnerConfig(), **kw) -> "PipelineRunner":
        """Keep this rank's stage of ``model`` (a `dynabatch.pipeline.models.LayeredModel`) cut at
        ``bounds``, move it to ``ctx.device`` and build the runner."""
        stages = split_model(model.layers, bounds)
        if len(stages) != ctx.num_stages:
            raise ValueError(f"bounds give {len(stages)} stages but the pipeline has {ctx.num_stages}")
        if config.bypass_idle_stages and "bypass" not in kw:
            kw["bypass"] = Bypass.of(model, [st.first_layer for st in stages] + [len(model.layers)])
        return cls(stages[ctx.stage].to(ctx.device), model.boundary, ctx, config, **kw)

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
        orders = runner_orders(self.config.schedule, S, times, mem, plan, self.ctx.replica,
                               self.config.memory_limit_bytes)
        key = (S, M, orders.tobytes(), units.tobytes(), entry.tobytes())
        hit = self._programs.get(key)
        if hit is None:
            hit = (build_programs(orders, units, entry)[self.ctx.stage], orders)
            self._programs[key] = hit
            if len(self._programs) > 512:
                self._programs.popitem(last=False)
        return hit

    def orders(self, plan: BatchPlan | Sequence[MicroBatchShape]) -> np.ndarray:
        """The op orders [S, 2M] this runner would use for ``plan`` (this rank's replica)."""
        return self._program(self._shapes(plan), plan)[1]

    def _shapes(self, plan, collation: str | None = None) -> list[MicroBatchShape]:
        if isinstance(plan, BatchPlan):
            if plan.num_ranks != self.ctx.num_replicas:
                raise ValueError(f"the plan is for {plan.num_ranks} data-parallel ranks but there are "
                                 f"{self.ctx.num_replicas} pipeline replicas")
            return plan_shapes(plan, self.ctx.replica)
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
        ``step.plan.options["recompute_layers"]`` when only its shapes are passed). Raises the original exception on the rank where something failed and
        `PipelineAborted` (naming that rank and its error) on every other rank; a rank that makes no
        progress for ``timeout_s`` while others wait on it, or dies, ends every other rank with a
        `PipelineAborted` naming it and what it was doing (see `dynabatch.pipeline.failure`).
        """
        if not self.config.flush:
            raise ValueError("RunnerConfig(flush=False): give the steps to run_steps(...), which runs them as one "
                             "asynchronous stream")
        return self._guarded(lambda: self._step(plan, batches, optimizer, collation, recompute))

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

    def _links(self, program, spec_in, spec_out) -> dict[int, list]:
        """Neighbour stage -> [(message, specs)] in posting order (what `P2P.check_links` compares)."""
        s, links = self.ctx.stage, {}
        for ins in program:
            if isinstance(ins, Post):
                m = ins.message
                links.setdefault(m.dst if m.src == s else m.src, []).append((m, self._specs(m, spec_in, spec_out)))
        return links

    def _specs(self, m: Message, spec_in, spec_out):
        if m.src == self.ctx.stage:
            return spec_out[m.microbatch] if m.kind == "act" else \
                [sp for sp in spec_in[m.microbatch] if sp.requires_grad]
        return spec_in[m.microbatch] if m.kind == "act" else \
            [sp for sp in spec_out[m.microbatch] if sp.requires_grad]

    def _step(self, plan, batches, optimizer, collation, recompute, stream=None):
        """One step, or with ``stream`` (`_Stream`, from `run_steps`) several steps' micro-batches as one
        1F1B program with an update at each step's end on this stage (returns a list of StepResult)."""
        t_step = time.perf_counter()
        ctx, stage, mon = self.ctx, self.stage, self.ctx.monitor
        s, k = ctx.stage, self.step_index
        mon.set_state("busy", f"preparing step {k}")
        shapes = self._shapes(plan, collation)
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
        program, _ = self._program(shapes, plan)
        self.p2p.step = self.step_index
        spec_in = [tuple(self.boundary(sh, stage.first_layer - 1)) for sh in shapes] if not stage.is_first else None
        spec_out = [tuple(self.boundary(sh, stage.last_layer)) for sh in shapes] if not stage.is_last else None
        params = [p for p in stage.parameters() if p.requires_grad]
        for p in params:
            p.grad = None
        if self.config.check_plan and ctx.num_stages > 1:
            self._in_comm = True
            self.p2p.check_links(self._links(program, spec_in, spec_out))
            self._in_comm = False

        clock = _Clock(ctx.device)
        fwd_s, bwd_s = np.zeros(M), np.zeros(M)
        stage.recompute = self.recompute_layers(plan, recompute)
        metered = self.config.measure_memory
        saved_b = np.zeros(M)
        held_b = peak_b = 0.0
        wait_s = 0.0
        inbox: dict[Message, tuple[list, list]] = {}
        outbox: dict[Message, list[torch.Tensor]] = {}
        sent: list = []
        saved: dict[int, tuple] = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
        tokens = torch.zeros((), dtype=torch.float64, device=ctx.device)
        data = [None] * M

        wp = None if stream is None else stream.predictor
        for ins in program:
            mon.raise_if_failed()
            if isinstance(ins, Post):
                m = ins.message
                specs = self._specs(m, spec_in, spec_out)
                if m.src == s:
                    tensors = outbox.pop(m)
                    mon.set_state("busy", f"posting the send of {m.describe()} (micro-batch {m.microbatch} of step {k})")
                    self._in_comm = True
                    sent.append((m, tensors, self.p2p.send(m, tensors, specs)))
                    self._in_comm = False
                else:
                    mon.set_state("busy", f"posting the receive of {m.describe()} (micro-batch {m.microbatch} of "
                                          f"step {k})")
                    self._in_comm = True
                    inbox[m] = self.p2p.recv(m, specs)
                    self._in_comm = False
                continue
            j = ins.microbatch
            starts = entry[j] == s  # this stage starts micro-batch j (the first stage, or its bypass entry)
            if (stage.is_first or stage.is_last or starts) and data[j] is None:
                data[j] = _to_device(batches[j], ctx.device)
            if ins.forward:
                if starts:
                    x, inputs = None, []
                else:
                    inputs, x, waited = self._take_input(inbox, Message(j, "act", s - 1, s), spec_in[j],
                                                         f"micro-batch {j} of step {k}")
                    wait_s += waited
                mon.set_state("busy", f"in forward of micro-batch {j} of step {k}")
                t0 = clock.start()
                meter = SavedBytes(self._param_ptrs) if metered else None
                if wp is not None:  # flush-free: the weights this forward computes with, and aliasing hooks
                    hooks = wp.forward(j, int(stream.lags[s, j]), pack=meter.pack if metered else None,
                                       unpack=meter.unpack if metered else None)
                else:
                    hooks = meter.hooks() if metered else contextlib.nullcontext()
                stage.meter = meter
                try:
                    with hooks:
                        if starts and not stage.is_first:  # the bypassed idle layers, then this stage's
                            x = self.bypass.enter(data[j], stage.first_layer)
                        out = stage(x, data[j])
                finally:
                    stage.meter = None
                if metered:
                    saved_b[j] = meter.bytes
                    held_b += meter.bytes
                    peak_b = max(peak_b, held_b)
                clock.stop(t0, fwd_s, j)
                if stage.is_last:
                    loss_j, ntok_j = out
                    if stream is not None:
                        stream.loss[int(np.searchsorted(stream.ends, j, side="right"))] += float(loss_j.detach())
                    loss_sum += loss_j.detach().to(torch.float64)
                    tokens += torch.as_tensor(ntok_j, device=ctx.device).to(torch.float64)
                    saved[j] = (inputs, loss_j)
                else:
                    outs = _as_tuple(out)
                    saved[j] = (inputs, outs)
                    outbox[Message(j, "act", s, s + 1)] = [o.detach().contiguous() for o in outs]
                if not stage.is_first and not stage.is_last:
                    data[j] = None
            else:
                inputs, outs = saved.pop(j)
                back = wp.backward(j) if wp is not None else contextlib.nullcontext()
                if stage.is_last:
                    mon.set_state("busy", f"in backward of micro-batch {j} of step {k}")
                    t0 = clock.start()
                    with back:
                        outs.backward()
                    clock.stop(t0, bwd_s, j)
                else:
                    m = Message(j, "grad", s + 1, s)
                    bufs, works = inbox.pop(m)
                    peer = ctx.global_rank(s + 1)
                    wait_s += self._wait(works, f"waiting for {m.describe()} from rank {peer} (micro-batch {j} of "
                                                f"step {k})", [peer])
                    grad_outs = [o for o, sp in zip(outs, spec_out[j]) if sp.requires_grad]
                    pairs = [(o, g) for o, g in zip(grad_outs, bufs) if o.requires_grad]
                    mon.set_state("busy", f"in backward of micro-batch {j} of step {k}")
                    t0 = clock.start()
                    with back:
                        if pairs:
                            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
                    clock.stop(t0, bwd_s, j)
                held_b -= saved_b[j]
                if not starts:
                    outbox[Message(j, "grad", s, s - 1)] = [
                        (b.grad if b.grad is not None else torch.zeros_like(b)) for b, sp in zip(inputs, spec_in[j])
                        if sp.requires_grad]
                data[j] = None
                if stream is not None and stream.done < len(stream.ends) and j + 1 == stream.ends[stream.done]:
                    stream_update(self, stream, params, optimizer)  # this stage's part of a step is done
        for m, _, works in sent:
            peer = ctx.global_rank(m.dst)
            wait_s += self._wait(works, f"waiting for rank {peer} to take {m.describe()} (micro-batch "
                                        f"{m.microbatch} of step {k})", [peer])
        if inbox or outbox or saved:
            raise RuntimeError(f"internal error: step ended with unmatched messages {list(inbox) + list(outbox)}")
        if stream is not None:
            return stream_results(self, stream, fwd_s, bwd_s, saved_b if metered else None, wait_s, t_step)

        # one all-reduce over every rank: [sum of token losses, real target tokens]
        mon.raise_if_failed()
        everyone = range(ctx.world_size)
        stats = torch.stack([loss_sum, tokens])
        self._in_comm = True
        self._wait([dist.all_reduce(stats, async_op=True)], f"in the loss all-reduce of step {k} (waiting for "
                                                            f"every rank)", everyone)
        self._in_comm = False
        mon.set_state("busy", f"scaling the gradients of step {k}")
        total_loss, n_tokens = stats.tolist()
        scale = 1.0 / max(n_tokens, 1.0)
        grads = []
        for p in params:
            if p.grad is None:  # unused this step: the flattened layout must match across replicas
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if grads:
            if ctx.num_replicas > 1:
                mon.raise_if_failed()
                flat = _flatten_dense_tensors(grads)
                self._in_comm = True
                self._wait([dist.all_reduce(flat, group=ctx.dp_group, async_op=True)],
                           f"in the gradient all-reduce of step {k} (waiting for stage {s} of every replica)",
                           [ctx.global_rank(s, d) for d in range(ctx.num_replicas)])
                self._in_comm = False
                flat.mul_(scale)
                for g, r in zip(grads, _unflatten_dense_tensors(flat, grads)):
                    g.copy_(r)
            else:
                torch._foreach_mul_(grads, scale)
        if optimizer is not None:
            mon.set_state("busy", f"in optimizer.step() of step {k}")
            optimizer.step()
        clock.resolve()
        timing = StepTiming(self.step_index, ctx.rank, s, ctx.replica, fwd_s, bwd_s, wait_s,
                            time.perf_counter() - t_step, saved_b if metered else None, float(peak_b),
                            int(stage.recompute))
        all_timings = self._gather(timing, plan, M) if self.config.gather_timing else None
        self.step_index += 1
        peaks = (getattr(plan, "options", None) or {}).get("stage_peak_bytes")
        return StepResult(timing.step, total_loss * scale, int(round(n_tokens)), timing, all_timings,
                          float(peaks[s]) if peaks else None)

    def _gather(self, timing: StepTiming, plan, M: int) -> tuple[StepTiming, ...]:
        ctx = self.ctx
        counts = plan.microbatches_per_rank() if isinstance(plan, BatchPlan) else np.full(ctx.num_replicas, M)
        width = int(counts.max())
        mine = torch.zeros(4, max(width, 3) + 1, dtype=torch.float64)
        mine[0, :M] = torch.from_numpy(timing.forward_s)
        mine[1, :M] = torch.from_numpy(timing.backward_s)
        mine[2, 0], mine[2, 1] = timing.wait_s, timing.step_s
        mine[2, 2], mine[2, 3] = timing.peak_saved_bytes, timing.recompute_layers
        if timing.saved_bytes is not None:
            mine[3, :M] = torch.from_numpy(timing.saved_bytes)
        mine = mine.to(ctx.device)
        out = [torch.empty_like(mine) for _ in range(ctx.world_size)]
        self._in_comm = True
        self._wait([dist.all_gather(out, mine, async_op=True)], f"gathering the timings of step {timing.step} "
                                                                 f"(waiting for every rank)", range(ctx.world_size))
        self._in_comm = False
        res = []
        for r, t in enumerate(out):
            t = t.cpu().numpy()
            d, st = r // ctx.num_stages, r % ctx.num_stages
            k = int(counts[d])
            res.append(StepTiming(timing.step, r, st, d, t[0, :k].copy(), t[1, :k].copy(), float(t[2, 0]), float(t[2, 1]),
                                  t[3, :k].copy() if timing.saved_bytes is not None else None, float(t[2, 2]),
                                  int(t[2, 3])))
        return tuple(res)
