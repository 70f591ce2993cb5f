"""The one interpreter of a stage's program: the `Post`/`Compute` instruction list that
`dynabatch.pipeline.runtime.schedule.build_programs` derives from the plan, run on this rank.

`run_program` posts the sends and receives, runs the forwards and backwards, keeps the inbox (posted
receives), the outbox (tensors waiting for their send), the saved activations and the step's
micro-batch dictionaries, waits, times each op (seconds) and meters the activation bytes each
forward keeps for backward. It knows nothing about how the ops are grouped into steps, models or
updates: each way of running supplies a `Hooks` object, and the interpreter calls it at fixed points:

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
* ``group(v)``: which loss/token accumulator ``v``'s head output adds to.

Recomputation is the stage module's own setting (`PipelineStage.recompute`, set by the runner
before the program runs).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..measure.memory import SavedBytes
from ..measure.timing import Clock
from ..models.spec import TensorSpec, as_tuple, to_device
from .schedule import Instruction, Message, Post


class Hooks:
    """What a way of running supplies to `run_program` (see the module docstring); subclasses
    implement ``module``, ``specs`` and ``describe``, the rest default to one model without extras."""

    def module(self, v: int):
        """The `PipelineStage` that runs virtual micro-batch ``v`` on this rank."""
        raise NotImplementedError

    def specs(self, v: int) -> tuple[Sequence[TensorSpec] | None, Sequence[TensorSpec] | None]:
        """``v``'s boundary specs at this stage's input and output (None at the first/last stage)."""
        raise NotImplementedError

    def describe(self, v: int) -> str:
        """``v`` in the monitor's texts and errors (``micro-batch 3 of step 7``)."""
        raise NotImplementedError

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
    """What one program run measured on this stage: ``forward_s``/``backward_s`` [V] seconds per
    virtual micro-batch, ``saved_bytes`` [V] activation bytes each forward kept (0 when not metered),
    ``peak_bytes`` the most its in-flight micro-batches held at once, ``wait_s`` seconds blocked on
    transfers, ``loss``/``tokens`` float64 [G] sums of the head's token losses and target tokens per
    accumulator (last stage only; zeros elsewhere)."""

    forward_s: np.ndarray
    backward_s: np.ndarray
    saved_bytes: np.ndarray
    peak_bytes: float
    wait_s: float
    loss: torch.Tensor
    tokens: torch.Tensor


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
            links.setdefault(m.dst if m.src == stage else m.src, []).append(
                (m, message_specs(m, stage, *hooks.specs(m.microbatch))))
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
    state = _State(size, groups, ctx.device)
    pending: list[int] = []  # backwards whose after_backward hook is due before the next op
    for ins in program:
        mon.raise_if_failed()
        if isinstance(ins, Post):
            _post(ins.message, hooks, s, p2p, guard, state)
            continue
        for v in pending:
            hooks.after_backward(v)
        pending.clear()
        v = ins.microbatch
        hooks.before_op(v, ins.forward)
        if ins.forward:
            _forward(v, hooks, s, guard, clock, state, param_ptrs)
        else:
            _backward(v, hooks, s, ctx, guard, clock, state)
            pending.append(v)
    for v in pending:
        hooks.after_backward(v)
    for m, works in state.sent:
        peer = ctx.global_rank(m.dst)
        state.wait_s += guard.wait(works, f"waiting for rank {peer} to take {m.describe()} "
                                          f"({hooks.describe(m.microbatch)})", [peer])
    if state.inbox or state.outbox or state.saved:
        raise RuntimeError(f"internal error: the program ended with unmatched messages "
                           f"{list(state.inbox) + list(state.outbox)}")
    return StageRun(state.fwd_s, state.bwd_s, state.saved_b, state.peak_b, state.wait_s, state.loss, state.tokens)


class _State:
    """The interpreter's working state for one program run."""

    def __init__(self, size: int, groups: int, device: torch.device):
        self.inbox: dict[Message, tuple[list, list]] = {}
        self.outbox: dict[Message, list[torch.Tensor]] = {}
        self.sent: list[tuple[Message, list]] = []
        self.saved: dict[int, tuple] = {}
        self.fwd_s, self.bwd_s, self.saved_b = np.zeros(size), np.zeros(size), np.zeros(size)
        self.held_b = self.peak_b = 0.0
        self.wait_s = 0.0
        self.loss = torch.zeros(groups, dtype=torch.float64, device=device)
        self.tokens = torch.zeros(groups, dtype=torch.float64, device=device)


def _post(m: Message, hooks: Hooks, s: int, p2p, guard, state: _State) -> None:
    mon = guard.ctx.monitor
    specs = message_specs(m, s, *hooks.specs(m.microbatch))
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


def _take_input(state: _State, m: Message, specs, guard, what: str):
    """The activation message ``m``: wait for it and mark the tensors that need a gradient."""
    bufs, works = state.inbox.pop(m)
    peer = guard.ctx.global_rank(m.src)
    state.wait_s += guard.wait(works, f"waiting for {m.describe()} from rank {peer} ({what})", [peer])
    for b, sp in zip(bufs, specs):
        if sp.requires_grad:
            b.requires_grad_(True)
    return bufs, (bufs[0] if len(bufs) == 1 else tuple(bufs))


def _forward(v: int, hooks: Hooks, s: int, guard, clock: Clock, state: _State, param_ptrs) -> None:
    stage, what = hooks.module(v), hooks.describe(v)
    spec_in, _ = hooks.specs(v)
    starts = hooks.starts(v)
    batch = hooks.batch(v)
    if starts:
        x, inputs = None, []
    else:
        inputs, x = _take_input(state, Message(v, "act", s - 1, s), spec_in, guard, what)
    guard.ctx.monitor.set_state("busy", f"in forward of {what}")
    t0 = clock.start()
    meter = SavedBytes(param_ptrs) if param_ptrs is not None else None
    stage.meter = meter
    try:
        with hooks.forward_context(v, meter):
            if starts and not stage.is_first:  # the bypassed idle layers, then this stage's
                x = hooks.enter(v, batch)
            out = stage(x, batch)
    finally:
        stage.meter = None
    if meter is not None:
        state.saved_b[v] = meter.bytes
        state.held_b += meter.bytes
        state.peak_b = max(state.peak_b, state.held_b)
    clock.stop(t0, state.fwd_s, v)
    if stage.is_last:
        loss_v, ntok_v = out
        g = hooks.group(v)
        state.loss[g] += loss_v.detach().to(torch.float64)
        state.tokens[g] += torch.as_tensor(ntok_v, device=state.tokens.device).to(torch.float64)
        state.saved[v] = (inputs, loss_v)
    else:
        outs = as_tuple(out)
        state.saved[v] = (inputs, outs)
        state.outbox[Message(v, "act", s, s + 1)] = [o.detach().contiguous() for o in outs]
    if not stage.is_first and not stage.is_last:
        hooks.release(v, True)


def _backward(v: int, hooks: Hooks, s: int, ctx, guard, clock: Clock, state: _State) -> None:
    stage, what = hooks.module(v), hooks.describe(v)
    spec_in, spec_out = hooks.specs(v)
    inputs, outs = state.saved.pop(v)
    if stage.is_last:
        ctx.monitor.set_state("busy", f"in backward of {what}")
        t0 = clock.start()
        with hooks.backward_context(v):
            outs.backward()
        clock.stop(t0, state.bwd_s, v)
    else:
        m = Message(v, "grad", s + 1, s)
        bufs, works = state.inbox.pop(m)
        peer = ctx.global_rank(s + 1)
        state.wait_s += guard.wait(works, f"waiting for {m.describe()} from rank {peer} ({what})", [peer])
        grad_outs = [o for o, sp in zip(outs, spec_out) if sp.requires_grad]
        pairs = [(o, g) for o, g in zip(grad_outs, bufs) if o.requires_grad]
        ctx.monitor.set_state("busy", f"in backward of {what}")
        t0 = clock.start()
        with hooks.backward_context(v):
            if pairs:
                torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        clock.stop(t0, state.bwd_s, v)
    state.held_b -= state.saved_b[v]
    if not hooks.starts(v):
        state.outbox[Message(v, "grad", s, s - 1)] = [
            (b.grad if b.grad is not None else torch.zeros_like(b)) for b, sp in zip(inputs, spec_in)
            if sp.requires_grad]
    hooks.release(v, False)
