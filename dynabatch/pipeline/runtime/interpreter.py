"""The one interpreter of a stage's program: the `Post`/`Compute` instruction list that
`dynabatch.pipeline.runtime.schedule.build_programs` compiles from the step's ops, run on this rank.

`run_program` posts the sends and receives, runs the ops (forwards, backwards, the input part of a
split backward (input gradients, the graph kept) and its weight part (weight gradients), updates),
keeps the inbox (posted receives), the outbox (tensors waiting for their send), the saved activations
and the step's micro-batch dictionaries, waits, times each op (seconds) and meters the activation bytes
each forward keeps for backward (held until the backward's last part; a split backward's input part adds
the gradients it keeps for the weight part). It knows nothing about how the
ops are grouped into steps, models or updates: each way of running supplies a `Hooks` object, and the
interpreter calls it at fixed points:

* ``module(v)``, ``specs(v)``, ``describe(v)``: the stage module, boundary specs and name of virtual
  micro-batch ``v`` (one model: ``v`` is the micro-batch; many models: ``v`` maps to a model's stage);
* ``batch(v)``/``release(v)``: its dictionary on the device, and when this stage is done with it;
* ``starts(v)``/``enter(v, batch)``: whether ``v`` starts on this stage, and its input there when
  the stages before were bypassed (`dynabatch.pipeline.runtime.bypass`);
* ``before_op(v, forward)``: right before an op (many models: make the model's shard resident);
* ``forward_context(v, meter)``/``backward_context(v)``: around a forward and a backward
  (flush-free streams: the weight version it computes with);
* ``after_backward(v)``: after a backward and the posts that follow it, before the next op (where
  a stream or a model updates: the gradient sends of that backward are posted by then, so a peer
  never waits on this rank's update for them);
* ``group(v)``: which loss/token accumulator ``v``'s head output adds to;
* ``at(c)``: the hooks of model chunk ``c`` on this rank (interleaved schedules; ``chunks`` of them);
* ``run_update(k)``: an update op of the program (flush-free streams: step ``k``'s update on this stage).

Recomputation is the stage module's own setting (`PipelineStage.recompute`, set by the runner
before the program runs).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ...core.kernels import op_codes as oc
from ...core.schedule.ops import Op
from ..measure.memory import SavedBytes
from ..measure.timing import Clock
from ..models.spec import TensorSpec, as_tuple, to_device
from .schedule import Instruction, Message, Post, link_message
from .split_backward import input_part, weight_part


class Hooks:
    """What a way of running supplies to `run_program` (see the module docstring); subclasses
    implement ``module``, ``specs`` and ``describe``, the rest default to one model without extras."""

    #: Model chunks this rank holds (virtual stages ``c S + stage``; `at` gives each one's hooks).
    chunks = 1

    def at(self, chunk: int) -> "Hooks":
        """The hooks of model chunk ``chunk`` on this rank."""
        if chunk != 0:
            raise ValueError(f"this rank holds one model chunk; the program runs chunk {chunk}")
        return self

    def run_update(self, k: int) -> None:
        """Run the program's update op ``U{k}``."""
        raise NotImplementedError("this way of running lists no update op in its programs")

    def module(self, v: int):
        """The `PipelineStage` that runs virtual micro-batch ``v`` on this rank."""
        raise NotImplementedError(f"{type(self).__name__} must implement Hooks.module (see run_program)")

    def specs(self, v: int) -> tuple[Sequence[TensorSpec] | None, Sequence[TensorSpec] | None]:
        """``v``'s boundary specs at this stage's input and output (None at the first/last stage)."""
        raise NotImplementedError(f"{type(self).__name__} must implement Hooks.specs (see run_program)")

    def describe(self, v: int) -> str:
        """``v`` in the monitor's texts and errors (``micro-batch 3 of step 7``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement Hooks.describe (see run_program)")

    def batch(self, v: int) -> dict | None:
        """``v``'s micro-batch dictionary on the device, where this stage reads it (else None)."""
        return None

    def release(self, v: int, forward: bool) -> None:
        """This stage is done with ``v``'s dictionary for its ``forward`` (True) or its backward."""

    def starts(self, v: int) -> bool:
        """Whether ``v`` starts on this stage (no activation message comes in for it)."""
        return self.module(v).is_first

    def enter(self, v: int, batch: dict):
        """``v``'s state at this stage's input when it starts here past the first stage (bypass)."""
        raise NotImplementedError("this runner bypasses no stage")

    def before_op(self, v: int, forward: bool) -> None:
        """Called right before ``v``'s forward (``forward``) or backward."""

    def forward_context(self, v: int, meter: SavedBytes | None):
        """The context ``v``'s forward runs in (default: the meter's saved-tensor hooks)."""
        return meter.hooks() if meter is not None else contextlib.nullcontext()

    def backward_context(self, v: int):
        """The context ``v``'s backward runs in."""
        return contextlib.nullcontext()

    def after_backward(self, v: int) -> None:
        """Called after ``v``'s backward and the posts that follow it, before the next op."""

    def group(self, v: int) -> int:
        """Index of the loss/token accumulator ``v``'s loss adds to."""
        return 0


@dataclass
class StageRun:
    """What one program run measured on this stage: ``chunk_forward_s`` [C, V] and ``chunk_backward_s``
    [C, 2, V] seconds per chunk and virtual micro-batch (``[:, 0]`` the backward or its input part,
    ``[:, 1]`` its weight part), ``saved_bytes`` [V] activation bytes each forward kept (0 when not
    metered), ``peak_bytes`` the most its in-flight micro-batches held at once, ``wait_s`` seconds blocked
    on transfers, ``loss``/``tokens`` float64 [G] sums of the head's token losses and target tokens per
    accumulator (last stage only; zeros elsewhere), ``executed`` the ops run in order and ``op_s`` their
    seconds. Read the seconds after the clock's ``resolve`` (GPU events)."""

    chunk_forward_s: np.ndarray
    chunk_backward_s: np.ndarray
    saved_bytes: np.ndarray
    peak_bytes: float
    wait_s: float
    loss: torch.Tensor
    tokens: torch.Tensor
    executed: list
    op_s: np.ndarray

    @property
    def forward_s(self) -> np.ndarray:
        """[V] forward seconds per virtual micro-batch (its chunks summed)."""
        return self.chunk_forward_s.sum(axis=0)

    @property
    def backward_s(self) -> np.ndarray:
        """[V] backward seconds per virtual micro-batch (chunks and parts summed)."""
        return self.chunk_backward_s.sum(axis=(0, 1))

    def op_times(self) -> list[tuple[Op, float]]:
        """``(op, seconds)`` of every op this stage ran, in order."""
        return [(op, float(t)) for op, t in zip(self.executed, self.op_s)]


def message_specs(m: Message, stage: int, spec_in, spec_out) -> list[TensorSpec]:
    """The tensors of ``m`` as ``stage`` sends or receives them (a gradient message carries the
    boundary tensors that need a gradient)."""
    if m.src == stage:
        return list(spec_out) if m.kind == "act" else [sp for sp in spec_in if sp.requires_grad]
    return list(spec_in) if m.kind == "act" else [sp for sp in spec_out if sp.requires_grad]


def check_links(program: Sequence[Instruction], hooks: Hooks, stage: int, p2p, guard) -> None:
    """The plan check before a program's first transfer: both ends of every link compare what they
    will exchange (`P2P.check_links`)."""
    links: dict[int, list] = {}
    for ins in program:
        if isinstance(ins, Post):
            m = ins.message
            h = hooks.at(_chunk_at(m, stage)) if hooks.chunks > 1 else hooks
            links.setdefault(m.dst if m.src == stage else m.src, []).append(
                (m, message_specs(m, stage, *h.specs(m.microbatch))))
    with guard.communicating():
        p2p.check_links(links)


class Feed:
    """A step's micro-batch dictionaries, moved to ``device`` when first read. ``keep``: hold every
    moved dictionary until the program ends (read by several virtual micro-batches); otherwise
    `drop` frees it."""

    def __init__(self, batches: Sequence[dict] | None, device: torch.device, keep: bool = False):
        self.batches = batches
        self.device = device
        self.keep = keep
        self.moved: dict[int, dict] = {}

    def get(self, j: int) -> dict:
        """Dictionary ``j`` on the device."""
        if j not in self.moved:
            self.moved[j] = to_device(self.batches[j], self.device)
        return self.moved[j]

    def drop(self, j: int) -> None:
        """Free dictionary ``j``'s device copy (unless ``keep``)."""
        if not self.keep:
            self.moved.pop(j, None)


def run_program(program: Sequence[Instruction], hooks: Hooks, *, ctx, p2p, guard, clock: Clock, size: int,
                groups: int = 1, param_ptrs: set[int] | None = None) -> StageRun:
    """Run this rank's ``program`` over ``size`` virtual micro-batches (see the module docstring) and
    wait for its sends. ``groups``: loss/token accumulators; ``param_ptrs``: meter each forward's
    saved activation bytes, leaving out these parameter storages (None: no metering)."""
    s, mon = ctx.stage, ctx.monitor
    n_ops = sum(1 for ins in program if not isinstance(ins, Post))
    chunks = 1 + max((ins.op.chunk for ins in program if not isinstance(ins, Post)), default=0)
    if chunks != hooks.chunks:
        raise ValueError(f"the step's order runs {chunks} model chunk(s) per stage but this stage holds "
                         f"{hooks.chunks}: cut the model into {chunks} x num_stages pieces for it (interleaved "
                         "schedules), or plan with a schedule of one chunk")
    state = _State(size, groups, ctx.device, hooks.chunks, n_ops)
    pending: list[int] = []  # backwards whose after_backward hook is due before the next op
    for ins in program:
        mon.raise_if_failed()
        if isinstance(ins, Post):
            _post(ins.message, hooks, s, p2p, guard, state)
            continue
        for v in pending:
            hooks.after_backward(v)
        pending.clear()
        op, v = ins.op, ins.op.microbatch
        if op.kind == oc.UPDATE:
            t0 = clock.start()
            hooks.run_update(v)
            _ran(state, clock, op, t0)
            continue
        h = hooks.at(op.chunk) if hooks.chunks > 1 else hooks
        h.before_op(v, op.kind == oc.FORWARD)
        if op.kind == oc.FORWARD:
            _forward(op, hooks, h, ctx, guard, clock, state, param_ptrs)
        elif op.kind == oc.BACKWARD_WEIGHT:
            _backward_weight(op, hooks, h, ctx, clock, state)
            pending.append(v)
        else:
            _backward(op, hooks, h, ctx, guard, clock, state)
            if op.kind == oc.BACKWARD:
                pending.append(v)
    for v in pending:
        hooks.after_backward(v)
    for m, works in state.sent:
        peer = ctx.global_rank(m.dst)
        state.wait_s += guard.wait(works, f"waiting for rank {peer} to take {m.describe()} "
                                          f"({hooks.describe(m.microbatch)})", [peer])
    if state.inbox or state.outbox or state.saved or state.weights:
        raise RuntimeError(f"internal error: the program ended with unmatched messages "
                           f"{list(state.inbox) + list(state.outbox)}")
    return StageRun(state.fwd_s, state.bwd_s, state.saved_b, state.peak_b, state.wait_s, state.loss, state.tokens,
                    state.executed, state.op_s)


class _State:
    """The interpreter's working state for one program run."""

    def __init__(self, size: int, groups: int, device: torch.device, chunks: int, n_ops: int):
        self.inbox: dict[Message, tuple[list, list]] = {}
        self.outbox: dict[Message, list[torch.Tensor]] = {}
        self.sent: list[tuple[Message, list]] = []
        self.saved: dict[tuple[int, int], tuple] = {}    # (micro-batch, chunk) -> (inputs, outputs)
        self.weights: dict[tuple[int, int], tuple] = {}  # split backwards: what the weight part runs
        self.fwd_s, self.bwd_s = np.zeros((chunks, size)), np.zeros((chunks, 2, size))
        self.saved_b = np.zeros(size)
        self.chunk_b: dict[tuple[int, int], float] = {}
        self.held_b = self.peak_b = 0.0
        self.wait_s = 0.0
        self.loss = torch.zeros(groups, dtype=torch.float64, device=device)
        self.tokens = torch.zeros(groups, dtype=torch.float64, device=device)
        self.executed: list[Op] = []
        self.op_s = np.zeros(n_ops)


def _ran(state: _State, clock: Clock, op: Op, t0) -> None:
    """Log ``op`` as run from ``t0`` (its seconds in ``op_s``)."""
    clock.stop(t0, state.op_s, len(state.executed))
    state.executed.append(op)


def _post(m: Message, hooks: Hooks, s: int, p2p, guard, state: _State) -> None:
    mon = guard.ctx.monitor
    h = hooks.at(_chunk_at(m, s)) if hooks.chunks > 1 else hooks
    specs = message_specs(m, s, *h.specs(m.microbatch))
    what = hooks.describe(m.microbatch)
    if m.src == s:
        tensors = state.outbox.pop(m)
        mon.set_state("busy", f"posting the send of {m.describe()} ({what})")
        with guard.communicating():
            state.sent.append((m, p2p.send(m, tensors, specs)))
    else:
        mon.set_state("busy", f"posting the receive of {m.describe()} ({what})")
        with guard.communicating():
            state.inbox[m] = p2p.recv(m, specs)


def _chunk_at(m: Message, s: int) -> int:
    """The chunk of this stage ``s`` that sends or receives ``m`` (its link joins virtual stages ``b`` and
    ``b + 1``, ``b = chunk S + lower rank``)."""
    lower = m.src if m.kind == "act" else m.dst
    return m.chunk if s == lower else m.chunk + (1 if s < lower else 0)


def _take_input(state: _State, m: Message, specs, guard, what: str):
    """The activation message ``m``: wait for it and mark the tensors that need a gradient."""
    bufs, works = state.inbox.pop(m)
    peer = guard.ctx.global_rank(m.src)
    state.wait_s += guard.wait(works, f"waiting for {m.describe()} from rank {peer} ({what})", [peer])
    for b, sp in zip(bufs, specs):
        if sp.requires_grad:
            b.requires_grad_(True)
    return bufs, (bufs[0] if len(bufs) == 1 else tuple(bufs))


def _forward(op: Op, top: Hooks, hooks: Hooks, ctx, guard, clock: Clock, state: _State, param_ptrs) -> None:
    """A forward on chunk ``op.chunk`` (``hooks``: that chunk's; ``top``: the step's, which give the weights'
    context and the loss accumulator)."""
    v, c, s, S = op.microbatch, op.chunk, ctx.stage, ctx.num_stages
    q = c * S + s
    stage, what = hooks.module(v), top.describe(v)
    spec_in, _ = hooks.specs(v)
    starts = hooks.starts(v)
    batch = hooks.batch(v)
    if starts:
        x, inputs = None, []
    else:
        inputs, x = _take_input(state, link_message(v, "act", q - 1, S), spec_in, guard, what)
    guard.ctx.monitor.set_state("busy", f"in forward of {what}" + (f" (chunk {c})" if top.chunks > 1 else ""))
    t0 = clock.start()
    meter = SavedBytes(param_ptrs) if param_ptrs is not None else None
    stage.meter = meter
    try:
        with top.forward_context(v, meter):
            if starts and not stage.is_first:  # the bypassed idle layers, then this stage's
                x = hooks.enter(v, batch)
            out = stage(x, batch)
    finally:
        stage.meter = None
    if meter is not None:
        state.saved_b[v] += meter.bytes
        state.chunk_b[(v, c)] = meter.bytes
        state.held_b += meter.bytes
        state.peak_b = max(state.peak_b, state.held_b)
    clock.stop(t0, state.fwd_s[c], v)
    _ran(state, clock, op, t0)
    if stage.is_last:
        loss_v, ntok_v = out
        g = top.group(v)
        state.loss[g] += loss_v.detach().to(torch.float64)
        state.tokens[g] += torch.as_tensor(ntok_v, device=state.tokens.device).to(torch.float64)
        state.saved[(v, c)] = (inputs, loss_v)
    else:
        outs = as_tuple(out)
        state.saved[(v, c)] = (inputs, outs)
        state.outbox[link_message(v, "act", q, S)] = [o.detach().contiguous() for o in outs]
    if not stage.is_first and not stage.is_last:
        hooks.release(v, True)


def _grad_pairs(op: Op, hooks: Hooks, ctx, guard, state: _State, outs, what: str):
    """(outputs, their gradients) the backward of ``op`` starts from: the loss on the last virtual stage,
    else the outputs that need a gradient and the gradient message's tensors."""
    v, stage = op.microbatch, hooks.module(op.microbatch)
    if stage.is_last:
        return [outs], [None]
    S = ctx.num_stages
    m = link_message(v, "grad", op.chunk * S + ctx.stage, S)
    bufs, works = state.inbox.pop(m)
    peer = ctx.global_rank(m.src)
    state.wait_s += guard.wait(works, f"waiting for {m.describe()} from rank {peer} ({what})", [peer])
    _, spec_out = hooks.specs(v)
    grad_outs = [o for o, sp in zip(outs, spec_out) if sp.requires_grad]
    pairs = [(o, g) for o, g in zip(grad_outs, bufs) if o.requires_grad]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _send_input_grads(op: Op, hooks: Hooks, ctx, state: _State, grads) -> None:
    """Queue the gradients of this chunk's inputs (``grads``, one per input that takes one; None: zeros)
    for the previous virtual stage (nothing when the micro-batch starts here)."""
    v, S = op.microbatch, ctx.num_stages
    if hooks.starts(v):
        return
    state.outbox[link_message(v, "grad", op.chunk * S + ctx.stage - 1, S)] = [
        g if g is not None else torch.zeros_like(b) for b, g in zip(*grads)]


def _backward(op: Op, top: Hooks, hooks: Hooks, ctx, guard, clock: Clock, state: _State) -> None:
    """A whole backward (``B``), or the input part of a split one (``Bi``: input gradients only, the graph
    kept for the weight part); ``hooks``/``top`` as in `_forward`."""
    v, c = op.microbatch, op.chunk
    what = top.describe(v)
    spec_in, _ = hooks.specs(v)
    inputs, outs = state.saved.pop((v, c))
    outputs, grads = _grad_pairs(op, hooks, ctx, guard, state, outs, what)
    split = op.kind == oc.BACKWARD_INPUT
    ctx.monitor.set_state("busy", f"in {'input-gradient ' if split else ''}backward of {what}"
                          + (f" (chunk {c})" if top.chunks > 1 else ""))
    takes = [b for b, sp in zip(inputs, spec_in or ()) if sp.requires_grad]
    t0 = clock.start()
    with top.backward_context(v):
        if split:
            want = [b for b in takes if b.requires_grad]
            module = hooks.module(v)
            got, work = input_part(outputs, grads, want, [p for p in module.parameters() if p.requires_grad],
                                   rewalk=getattr(module, "recompute", 0) > 0)
            by_id = {id(b): g for b, g in zip(want, got)}
            input_grads = [by_id.get(id(b)) for b in takes]
        elif outputs:
            torch.autograd.backward(outputs, grads)
    clock.stop(t0, state.bwd_s[c, 0], v)
    _ran(state, clock, op, t0)
    if split:
        state.weights[(v, c)] = work
        if (v, c) in state.chunk_b:  # metered: the kept gradients are held until the weight part, too
            state.chunk_b[(v, c)] += work.kept_bytes
            state.held_b += work.kept_bytes
            state.peak_b = max(state.peak_b, state.held_b)
    else:
        input_grads = [b.grad for b in takes]
        _release(state, v, c)
    _send_input_grads(op, hooks, ctx, state, (takes, input_grads))
    hooks.release(v, False)


def _backward_weight(op: Op, top: Hooks, hooks: Hooks, ctx, clock: Clock, state: _State) -> None:
    """The weight part of a split backward (``W``): this chunk's parameter gradients from the gradients its
    input part kept (`dynabatch.pipeline.runtime.split_backward`), accumulated into ``.grad`` as a whole
    backward does; then the graph is freed."""
    v, c = op.microbatch, op.chunk
    work = state.weights.pop((v, c))
    ctx.monitor.set_state("busy", f"in weight-gradient backward of {top.describe(v)}"
                          + (f" (chunk {c})" if top.chunks > 1 else ""))
    t0 = clock.start()
    with top.backward_context(v):
        weight_part(work)
    clock.stop(t0, state.bwd_s[c, 1], v)
    _ran(state, clock, op, t0)
    _release(state, v, c)


def _release(state: _State, v: int, c: int) -> None:
    """The activations ``v`` kept on chunk ``c`` are free."""
    state.held_b -= state.chunk_b.pop((v, c), 0.0)
