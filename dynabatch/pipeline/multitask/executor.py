"""`SpindleExecutor`: one training step of a multi-task multi-modal `ComponentModel` on the ranks of an
`Allocation` (Spindle's per-component device groups, run in wavefronts).

Each micro-batch carries one task; its task's path says which components it runs through. `route` (the
planning core's routing rule, shared with the simulator) gives each component's group ranks their
micro-batches. Every rank walks one global order of work items, ``(wave, topological index, micro-batch)``:

* forward, first to last: for each item it holds it receives the micro-batch's inputs from the ranks that
  ran the producing components (receive buffers from ``output_spec(producer, shape)``: both ends compute
  the shape from the micro-batch, nothing is negotiated), runs the component, and posts its output to the
  ranks that run each consumer on that micro-batch's path (asynchronously; waited before the backward);
* backward, last to first: a head runs backward on its summed loss; any other item receives its output's
  gradient from its consumers (summed when several read it), runs backward, and posts the gradients of its
  inputs back to their producers.

Sends are asynchronous and each rank waits only for receives whose senders come earlier in the one global
order, so no rank waits on a rank that waits on it. Each message has its own tag (edge x micro-batch x
direction): two ranks may post their messages to each other in different orders, so the executor runs on
gloo, which matches by tag (NCCL, which does not, is refused). A micro-batch never touches a component its task skips: no compute, no message, and a
component no micro-batch of the step reaches does no all-reduce either (its gradients stay None).

The gradients of each component are summed over its group (one flat all-reduce per component group;
every rank of a group holds the same weights, broadcast from the group's first rank when the executor is
built). A rank posts a component's all-reduce (asynchronously, on the group's own process group) as soon
as its last backward item of that component is done, and goes on with the backward of the components before
it while the all-reduce runs (as DDP's gradient buckets and Megatron's overlap-grad-reduce do); the handles
are waited before the optimizer step. That is sound because a component's backward touches only its own
parameters (its inputs are detached leaves; a parameter shared by two components is refused). Then they are
scaled by ``1 / N`` (``N``: the step's target tokens, the heads' `ComponentModel.targets` summed
over the step's micro-batches, known before any forward; scaling after the sums, as the pipeline runner
does, keeps the result one process's ``d(sum of losses) / N`` also where a model computes a part in lower
precision, e.g. a float32 softmax), so every parameter's gradient equals one process's; one optimizer step per
global batch. The world sums the losses once (`SpindleStep.loss`). Every wait is watched by the failure
monitor (`dynabatch.pipeline.runtime.failure`): a rank that fails stops its peers with its error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ...core.multitask.graph import ComponentGraph
from ...core.multitask.routing import route
from ..models.component_model import ComponentModel, TaskShape
from ..runtime.guard import StepGuard
from .setup import SpindleContext, check_allocation

FORWARD, BACKWARD = 0, 1


@dataclass(frozen=True)
class SpindleEvent:
    """One thing a rank did in a step: ``kind`` ``compute`` (forward or backward of ``component`` on micro-batch
    ``microbatch``), ``send`` or ``recv`` (of the ``edge`` (producer, consumer) message of that micro-batch,
    to or from ``peer``), or ``all_reduce`` (of ``component``'s gradients over its group); ``direction``
    ``forward`` or ``backward``."""

    kind: str
    component: str
    microbatch: int
    direction: str
    peer: int = -1
    edge: tuple[str, str] = ()


@dataclass
class SpindleStep:
    """One step's outcome on one rank: ``loss`` (the step's summed loss over its ``num_tokens`` targets, the
    world's sum), per component this rank holds its measured compute seconds (``forward_s``, ``backward_s``:
    the component's forward and backward on its micro-batches here, waits excluded, by the executor's ``clock``), the micro-batches it ran
    (``microbatches``) and the forward + backward seconds of each (``microbatch_s[component][mb]``), seconds waited on transfers and all-reduces (``wait_s``), the step's wall seconds
    (``wall_s``), and what it did (``events``, `SpindleEvent`)."""

    loss: float
    num_tokens: int
    forward_s: dict[str, float]
    backward_s: dict[str, float]
    microbatches: dict[str, tuple[int, ...]]
    microbatch_s: dict[str, dict[int, float]]
    wait_s: float
    wall_s: float
    events: list[SpindleEvent] = field(default_factory=list, repr=False)

    @property
    def component_seconds(self) -> dict[str, float]:
        """Measured compute seconds (forward + backward) of each component this rank holds."""
        return {c: self.forward_s[c] + self.backward_s[c] for c in self.forward_s}


@dataclass
class _Item:
    component: str
    mb: int
    inputs: dict = field(default_factory=dict)  # producer -> leaf tensor (requires grad) fed to the component
    out: object = None                           # output tensor, or the head's loss sum
    seconds: float = 0.0                         # its forward + backward compute


def task_of(batch: dict, index: int) -> str:
    """The one task of micro-batch ``index``'s samples (its ``tasks`` entry); ValueError when it has none or
    mixes tasks (plan the step with one task per micro-batch, as `StepSamples.pack` does)."""
    tags = batch.get("tasks")
    if tags is None or isinstance(tags, str) or len(tags) == 0:
        raise ValueError(f"micro-batch {index} has no 'tasks' entry: read it from a DataLoader over a TaskMixture, "
                         "or pass step(batches, tasks=[...])")
    if len(set(tags)) != 1:
        raise ValueError(f"micro-batch {index} mixes tasks {sorted(set(tags))}: the executor runs one task per "
                         "micro-batch (its path through the components); plan one task per micro-batch")
    return str(tags[0])


class SpindleExecutor:
    """Runs steps of a `ComponentModel` on this rank's share of an `Allocation` (see the module doc).

    ``model``: every component's module (this rank uses and updates those it holds; the others stay
    untouched); ``graph``: the components' dependency edges and tasks (`dynabatch.core.multitask`);
    ``ctx``: from `init_spindle`; ``optimizer``: ``optimizer(parameters) -> torch.optim.Optimizer`` over the
    parameters of the components this rank holds (None: steps leave the gradients and update nothing);
    ``clock``: what the component seconds are read from (``time.perf_counter``: wall seconds;
    ``time.thread_time``: this thread's CPU seconds, which on a CPU shared with other processes leaves out the
    time the rank was preempted; torch computes on the calling thread with ``torch.set_num_threads(1)``)."""

    def __init__(self, model: ComponentModel, graph: ComponentGraph, ctx: SpindleContext, *,
                 optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        check_allocation(ctx.allocation, graph, ctx.world_size)
        if ctx.dist.backend != "gloo":
            # two ranks may exchange several messages whose posting orders differ at the two ends (a rank's
            # components run in wave order at each end); gloo matches them by tag, NCCL ignores tags
            raise NotImplementedError(f"the multi-task executor runs on gloo (its messages are matched by tag, which "
                                      f"{ctx.dist.backend} ignores); init_spindle(..., backend='gloo')")
        owner: dict[int, str] = {}
        for c in graph.names:
            for name, prm in model.component(c).named_parameters():
                other = owner.setdefault(id(prm), c)
                if other != c:
                    # each group all-reduces its own component's gradients, as soon as its backward is done
                    raise ValueError(f"parameter {name!r} of component {c!r} is also a parameter of {other!r}: the "
                                     f"multi-task executor reduces each component's gradients in its own group; "
                                     f"untie it or make the two one component")
        self.model, self.graph, self.ctx, self.clock = model, graph, ctx, clock
        self.allocation = ctx.allocation
        topo = {n: i for i, n in enumerate(graph.order())}
        self.index = {n: i for i, n in enumerate(graph.names)}
        self.order = sorted(graph.names, key=lambda n: (self.allocation.placement(n).wave, topo[n]))
        self.held = tuple(n for n in self.order if ctx.rank in self.allocation.placement(n).ranks)
        self.steps = 0
        self.guard = StepGuard(ctx, "the multi-task executor", lambda: self.steps)
        self._broadcast_weights()
        params = [p for c in self.held for p in model.component(c).parameters() if p.requires_grad]
        self.optimizer = optimizer(params) if optimizer is not None and params else None

    # -- set-up ----------------------------------------------------------------------------------
    def _broadcast_weights(self) -> None:
        """Every rank of a group starts from the group's first rank's weights (as DDP does)."""
        def run():
            works = []
            for c in self.held:
                g = self.ctx.groups.get(c)
                if g is None:
                    continue
                for p in self.model.component(c).parameters():
                    works.append(dist.broadcast(p.data, self.allocation.placement(c).ranks[0], group=g,
                                                async_op=True))
            peers = sorted({r for c in self.held for r in self.allocation.placement(c).ranks})
            self.guard.wait(works, "for the component groups' weight broadcast", peers)
        self.ctx.monitor.set_state("busy", "broadcasting the component groups' weights")
        self.guard.run(run)

    # -- one step --------------------------------------------------------------------------------
    def step(self, batches: Sequence[dict], tasks: Sequence[str] | None = None, *,
             cost_s: Mapping[str, Sequence[float]] | None = None) -> SpindleStep:
        """Forward and backward of the step's micro-batches ``batches`` (dicts; ``tasks[i]`` is micro-batch i's
        task; None: each micro-batch's ``tasks`` entry, the `DataLoader`'s tags of a `TaskMixture`, whose samples
        must share one task), the gradient all-reduce in each component group and one optimizer step (module
        doc). Every rank passes the same micro-batches, tasks and ``cost_s`` (predicted seconds per component
        and micro-batch, `route`'s balance; None: each micro-batch counts the same)."""
        tasks = [task_of(b, i) for i, b in enumerate(batches)] if tasks is None else list(tasks)
        if len(batches) != len(tasks):
            raise ValueError(f"{len(batches)} micro-batches but {len(tasks)} tasks: tag each micro-batch with one task")
        for t in tasks:
            self.graph.task(t)
        out = self.guard.run(lambda: self._step(list(batches), list(tasks), cost_s))
        self.steps += 1
        return out

    def _owners(self, tasks: list[str], cost_s) -> dict[str, dict[int, int]]:
        """component -> micro-batch -> the global rank that runs it there (from `route`, checked)."""
        routes = route(self.allocation, self.graph, tasks, cost_s=cost_s)
        owners: dict[str, dict[int, int]] = {}
        for c in self.graph.names:
            ranks = self.allocation.placement(c).ranks
            per = routes.get(c, tuple(() for _ in ranks))
            if len(per) != len(ranks):
                raise RuntimeError(f"route() gave component {c!r} {len(per)} rank lists for its {len(ranks)} ranks")
            own = {i: r for r, mbs in zip(ranks, per) for i in mbs}
            want = {i for i, t in enumerate(tasks) if c in self.graph.reaches(t)}
            if set(own) != want or sum(map(len, per)) != len(want):
                raise RuntimeError(f"route() must give each micro-batch whose task reaches {c!r} to exactly one of its "
                                   f"ranks: got {per} for micro-batches {sorted(want)}")
            owners[c] = own
        return owners

    def _tag(self, producer: str, consumer: str, mb: int, direction: int) -> int:
        C = len(self.index)
        return ((mb * C + self.index[producer]) * C + self.index[consumer]) * 2 + direction

    def _step(self, batches: list[dict], tasks: list[str], cost_s) -> SpindleStep:
        t_step = time.perf_counter()
        me, mon, model, graph = self.ctx.rank, self.ctx.monitor, self.model, self.graph
        k = self.steps
        mon.set_state("busy", f"preparing multi-task step {k}")
        shapes: list[TaskShape] = [model.shape_of(b, t) for b, t in zip(batches, tasks)]
        paths = [graph.reaches(t) for t in tasks]
        owners = self._owners(tasks, cost_s)
        heads = [[c for c in p if not set(graph.consumers(c)) & set(p)] for p in paths]
        total = sum(model.targets(h, b) for hs, b in zip(heads, batches) for h in hs)
        if total < 1:
            raise ValueError(f"multi-task step {k}: its {len(batches)} micro-batches hold no target token")
        for c in self.held:
            for p in model.component(c).parameters():
                p.grad = None
        items = [_Item(c, i) for c in self.held for i in sorted(i for i, r in owners[c].items() if r == me)]
        fwd = {c: 0.0 for c in self.held}
        bwd = {c: 0.0 for c in self.held}
        events: list[SpindleEvent] = []
        waited = 0.0
        sends: list = []
        local = {}  # (component, mb) -> item, for hand-offs between components on this rank
        loss_sum = torch.zeros((), dtype=torch.float64)
        counted = 0

        def consumers(c: str, i: int) -> list[str]:
            return [q for q in graph.consumers(c) if q in paths[i]]

        def producers(c: str, i: int) -> list[str]:
            return [p for p in graph.component(c).inputs if p in paths[i]]

        # forward, first to last
        for it in items:
            c, i = it.component, it.mb
            recvs, works, peers = {}, [], []
            for p in producers(c, i):
                src = owners[p][i]
                if src == me:
                    it.inputs[p] = local[(p, i)].out.detach().requires_grad_(True)
                    continue
                spec = model.output_spec(p, shapes[i])
                buf = spec.empty(self.ctx.device)
                if buf.numel():
                    works.append(dist.irecv(buf, src, tag=self._tag(p, c, i, FORWARD)))
                    peers.append(src)
                    events.append(SpindleEvent("recv", c, i, "forward", src, (p, c)))
                recvs[p] = buf
            waited += self.guard.wait(works, f"for the inputs of {c} on micro-batch {i} of step {k}", peers)
            for p, buf in recvs.items():
                it.inputs[p] = buf.requires_grad_(model.output_spec(p, shapes[i]).requires_grad)
            mon.set_state("busy", f"in forward of {c} on micro-batch {i} ({tasks[i]}) of step {k}")
            t0 = self.clock()
            y = model.component(c)(it.inputs, batches[i])
            it.seconds = self.clock() - t0
            fwd[c] += it.seconds
            events.append(SpindleEvent("compute", c, i, "forward"))
            if not consumers(c, i):  # a head: (loss sum, targets)
                loss, n = y
                it.out = loss
                loss_sum += loss.detach().to(torch.float64)
                counted += int(n)
                continue
            spec = model.output_spec(c, shapes[i])
            if not spec.matches(y):
                raise RuntimeError(f"component {c!r} returned {list(y.shape)} {y.dtype} on micro-batch {i} ({tasks[i]}) "
                                   f"but its output_spec says {spec.describe()}: the receivers allocate the spec")
            it.out = y
            local[(c, i)] = it
            payload = y.detach().contiguous()
            for q in consumers(c, i):
                dst = owners[q][i]
                if dst != me and payload.numel():
                    sends.append(dist.isend(payload, dst, tag=self._tag(c, q, i, FORWARD)))
                    events.append(SpindleEvent("send", c, i, "forward", dst, (c, q)))
        waited += self.guard.wait(sends, f"for the forward sends of step {k}", self._peers(owners))
        sends = []

        # backward, last to first, component by component; a component's gradient all-reduce is posted as soon
        # as this rank's last backward of it is done and runs while the rank goes on with the components before
        # it (their backward touches none of its parameters: inputs arrive as detached leaves)
        consumed = {}  # (producer, mb) -> [grad tensors from local consumers]
        reduce = _Reduction({c for t in tasks for c in graph.reaches(t)})
        mine = {c: [it for it in items if it.component == c] for c in self.held}
        # the walk: each held component's items, last to first, then its name: where its all-reduce is posted
        walk = [x for c in reversed(self.held) for x in (*reversed(mine[c]), c)]
        for it in walk:
            if isinstance(it, str):
                self._post_reduce(it, reduce, events)
                continue
            c, i = it.component, it.mb
            if not consumers(c, i):
                grad_out, target = None, it.out
            else:
                spec = model.output_spec(c, shapes[i])
                grads, works, peers = list(consumed.pop((c, i), [])), [], []
                for q in consumers(c, i):
                    dst = owners[q][i]
                    if dst == me:
                        continue
                    buf = spec.empty(self.ctx.device)
                    if buf.numel():
                        works.append(dist.irecv(buf, dst, tag=self._tag(c, q, i, BACKWARD)))
                        peers.append(dst)
                        events.append(SpindleEvent("recv", c, i, "backward", dst, (c, q)))
                    grads.append(buf)
                waited += self.guard.wait(works, f"for the output gradient of {c} on micro-batch {i} of step {k}",
                                          peers)
                grad_out, target = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0], it.out
            mon.set_state("busy", f"in backward of {c} on micro-batch {i} ({tasks[i]}) of step {k}")
            t0 = self.clock()
            if target.requires_grad:
                torch.autograd.backward(target, grad_out)
            dt = self.clock() - t0
            it.seconds += dt
            bwd[c] += dt
            events.append(SpindleEvent("compute", c, i, "backward"))
            for p, leaf in it.inputs.items():
                g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                src = owners[p][i]
                if src == me:
                    consumed.setdefault((p, i), []).append(g)
                elif g.numel():
                    sends.append(dist.isend(g.contiguous(), src, tag=self._tag(p, c, i, BACKWARD)))
                    events.append(SpindleEvent("send", p, i, "backward", src, (p, c)))
        waited += self.guard.wait(sends, f"for the backward sends of step {k}", self._peers(owners))

        # data parallel inside each component group (posted above); the world's loss
        waited += self._finish_reduce(reduce, k, 1.0 / total)
        totals = torch.stack([loss_sum, torch.tensor(float(counted), dtype=torch.float64)])
        waited += self.guard.all_reduce(totals, f"for the loss sum of step {k}", self.guard.everyone())
        if int(round(float(totals[1]))) != total:
            raise RuntimeError(f"multi-task step {k}: the heads counted {int(totals[1])} targets but the model's "
                               f"targets() give {total}: a head's targets() disagrees with its loss")
        if self.optimizer is not None:
            mon.set_state("busy", f"in the optimizer step of step {k}")
            self.optimizer.step()
        mbs = {c: tuple(it.mb for it in items if it.component == c) for c in self.held}
        per_mb = {c: {it.mb: it.seconds for it in items if it.component == c} for c in self.held}
        return SpindleStep(float(totals[0]) / total, total, fwd, bwd, mbs, per_mb, waited,
                           time.perf_counter() - t_step, events)

    def _peers(self, owners) -> list[int]:
        return sorted({r for per in owners.values() for r in per.values()} - {self.ctx.rank})

    def _post_reduce(self, c: str, reduce: "_Reduction", events: list) -> None:
        """Post held component ``c``'s gradient all-reduce over its group (one flat tensor; asynchronous), or
        nothing when the step reached no micro-batch of it or its group is this rank alone."""
        g = self.ctx.groups.get(c)
        params = [p for p in self.model.component(c).parameters() if p.requires_grad]
        if g is None:
            reduce.alone.append(params)
            return
        if c not in reduce.reached:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        reduce.works.append(dist.all_reduce(flat, group=g, async_op=True))
        reduce.flats.append((params, flat))
        reduce.peers |= set(self.allocation.placement(c).ranks)
        events.append(SpindleEvent("all_reduce", c, -1, "backward"))

    def _finish_reduce(self, reduce: "_Reduction", k: int, scale: float) -> float:
        """Wait for the posted all-reduces (once, before the optimizer step), put each component's summed
        gradients back into its parameters and multiply every held gradient by ``scale``; seconds waited."""
        waited = self.guard.wait(reduce.works, f"for the component groups' gradient all-reduce of step {k}",
                                 sorted(reduce.peers - {self.ctx.rank}))
        for params in reduce.alone:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        for params, flat in reduce.flats:
            at = 0
            for p in params:
                n = p.numel()
                p.grad = flat[at:at + n].view_as(p) * scale
                at += n
        return waited


@dataclass
class _Reduction:
    """The gradient all-reduces one step posts: ``reached`` (components some micro-batch of the step reaches),
    ``works`` (their async handles), ``flats`` ((parameters, flat gradient) of each), ``peers`` (ranks they
    involve) and ``alone`` (parameters of held components whose group is this rank alone: only scaled)."""

    reached: set
    works: list = field(default_factory=list)
    flats: list = field(default_factory=list)
    peers: set = field(default_factory=set)
    alone: list = field(default_factory=list)


__all__ = ["SpindleEvent", "SpindleExecutor", "SpindleStep", "task_of"]
