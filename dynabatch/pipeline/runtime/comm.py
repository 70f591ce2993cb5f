"""Process groups and point-to-point transfers between pipeline stages.

Layout: ``world = num_replicas x num_stages`` ranks, global rank ``replica * num_stages + stage``.
Each data-parallel replica has a pipeline group (its stages, for point-to-point transfers) and each
stage a data-parallel group (the same stage of every replica, for the gradient all-reduce).

Transfers use ``torch.distributed.batch_isend_irecv`` (NCCL on GPUs, gloo on CPU) with tag 0, so
gloo matches them first-in first-out per peer exactly like NCCL. Receive buffers are allocated
from the plan's shapes; nothing is negotiated at run time. Before a step's first transfer, both ends
of every link exchange one small fixed-size fingerprint of what they will send and receive on it
(`P2P.check_links`): ranks that hold different plans stop with a `ShapeMismatch` naming the
micro-batch and both shapes instead of crashing in the transport. ``debug_shapes=True``
additionally sends a small fixed-size header before every message and checks it against the
receiver's plan.
An optional ``recorder`` sees every posted operation in order (tests use it to check that both
ends of every link post the same sequence).
"""

from __future__ import annotations

import atexit
import hashlib
import inspect
import json
import os
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .failure import FailureMonitor
from .schedule import Message
from ..models.spec import TensorSpec

HEADER_LEN = 64
_PLAN_MAGIC = 0x5DB2
_PLAN_WORDS = 4
_HEADER_MAGIC = 0x5DB1
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
_MAX_DIMS = 6


class ShapeMismatch(RuntimeError):
    """A tensor or a peer's planned shapes (plan check, debug header) differ from this rank's plan."""


@dataclass
class DistContext:
    """This rank's place in the pipeline x data-parallel layout and its process groups.

    ``device`` is where tensors live (``cuda:k`` with NCCL, ``cpu`` with gloo); ``monitor`` is the
    failure side channel. Use as a context manager (or call `close`) so that the rank hosting the
    store waits for the others at the end and an exception in the training loop is published.
    """

    rank: int
    world_size: int
    num_stages: int
    backend: str
    device: torch.device
    store: object
    pp_group: object
    replica_group: object
    monitor: FailureMonitor
    timeout_s: float
    owns_process_group: bool = True
    _closed: bool = field(default=False, repr=False)

    @property
    def num_replicas(self) -> int:
        """Data-parallel replicas (pipelines): what `PlanOptions.num_ranks` counts (a plan's rank ``r`` is
        replica ``r``; in the runtime, "rank" is a process)."""
        return self.world_size // self.num_stages

    @property
    def dp_group(self) -> object:
        """Deprecated name of `replica_group` ("dp" names the dynamic-programming planner only)."""
        import warnings

        warnings.warn("DistContext.dp_group is deprecated: use replica_group (this stage's group over the replicas)",
                      DeprecationWarning, stacklevel=2)
        return self.replica_group

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.rank % self.num_stages

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica."""
        return self.rank // self.num_stages

    def global_rank(self, stage: int, replica: int | None = None) -> int:
        """Global rank of ``stage`` in ``replica`` (this rank's replica by default)."""
        return (self.replica if replica is None else replica) * self.num_stages + stage

    def where(self) -> str:
        """``stage s, replica d`` for messages."""
        return f"stage {self.stage}, replica {self.replica}"

    def fail(self, exc: BaseException) -> BaseException:
        """Publish ``exc`` (raised outside the runner, e.g. by the data loader) as this rank's failure
        so every other rank stops with its text; returns the exception to raise."""
        return self.monitor.report(exc)

    def close(self) -> None:
        """Finish: check in with the other ranks, stop the watchdog, destroy the process group."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self.monitor.close()
        # after a failure a helper thread may still be blocked in a gloo wait: leave the group alone
        if self.owns_process_group and dist.is_initialized() and not self.monitor.failure:
            try:
                dist.destroy_process_group()
            except Exception:
                pass

    def __enter__(self) -> "DistContext":
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and not self.monitor.failure:
            self.monitor.report(exc)
        if exc is None:
            self.close()
        else:
            self.monitor.stop()
        return False


def _env_int(name: str, default: int | None) -> int | None:
    v = os.environ.get(name)
    return int(v) if v is not None else default


def init_pipeline(num_stages: int, *, rank: int | None = None, world_size: int | None = None,
                  master_addr: str | None = None, master_port: int | None = None, backend: str | None = None,
                  device=None, timeout_s: float = 120.0, abort_after_s: float | None = 5.0,
                  poll_s: float = 0.05) -> DistContext:
    """Initialize ``torch.distributed`` for ``num_stages``-stage pipelines x data parallelism.

    ``rank``/``world_size``/``master_addr``/``master_port`` default to the ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT`` environment variables (torchrun). ``backend`` defaults to NCCL
    when CUDA is available, gloo otherwise; ``device`` to ``cuda:LOCAL_RANK`` or ``cpu``.
    ``timeout_s`` (seconds) is the liveness timeout: a rank that makes no progress for that long
    while others wait on it (or whose heartbeat stops) ends every rank with an error naming it and
    what it was doing (see `dynabatch.pipeline.runtime.failure`); with gloo the process-group timeout is set
    well above it (a backstop), with NCCL it is ``timeout_s``. ``abort_after_s`` bounds how long a
    rank may stay blocked after another rank failed. If a default process group already exists it is
    reused.
    """
    from .schedule import warm_orders

    warm_orders()  # before the monitor: the kernels' load is set-up, not a stalled first step
    owns = not dist.is_initialized()
    if owns:
        rank = _env_int("RANK", 0) if rank is None else int(rank)
        world_size = _env_int("WORLD_SIZE", 1) if world_size is None else int(world_size)
        master_addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        master_port = int(master_port if master_port is not None else os.environ.get("MASTER_PORT", 29500))
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=(rank == 0),
                              timeout=timedelta(seconds=timeout_s))
        if device is None:
            device = torch.device(f"cuda:{_env_int('LOCAL_RANK', rank % max(torch.cuda.device_count(), 1))}") \
                if backend == "nccl" else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # device_id (torch >= 2.3) binds the NCCL communicators to this rank's GPU eagerly
        kw = {"device_id": device} if backend == "nccl" and "device_id" in inspect.signature(
            dist.init_process_group).parameters else {}
        # gloo: liveness (FailureMonitor.wait) ends stalls after timeout_s with a named culprit; the
        # group's own timeout (which would raise from a collective still making progress) is a backstop
        pg_timeout = timeout_s if backend == "nccl" else 2 * timeout_s + 30
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout), **kw)
    else:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        backend = dist.get_backend()
        store = dist.distributed_c10d._get_default_store()
        device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu"))
    if num_stages < 1 or world_size % num_stages:
        raise ValueError(f"world size {world_size} is not a multiple of num_stages {num_stages}")
    replicas = world_size // num_stages
    try:
        watch_store = store.clone()
    except Exception:  # stores without clone(): share the client (TCPStore clients are locked)
        watch_store = store
    where = f"stage {rank % num_stages}, replica {rank // num_stages}"
    monitor = FailureMonitor(store, watch_store, rank=rank, world_size=world_size, where=where, is_host=(rank == 0),
                             poll_s=poll_s, abort_after_s=abort_after_s, timeout_s=timeout_s, num_stages=num_stages,
                             threaded_waits=(backend != "nccl"))
    monitor.start()
    # the groups are set-up collectives of every rank: watched (`setup_guard`), so a rank that dies or raises
    # meanwhile stops the others with its name instead of leaving them in gloo's rendezvous
    from .setup_guard import setup_call

    pp_group, replica_group = setup_call(SimpleNamespace(monitor=monitor, rank=rank),
                                    lambda: _pipeline_groups(rank, num_stages, replicas),
                                    "in the creation of the pipeline's process groups", range(world_size))
    ctx = DistContext(rank, world_size, num_stages, backend, device, store, pp_group, replica_group, monitor,
                      float(timeout_s), owns)
    # Without an explicit close() the store's host could exit while others finish their last step;
    # at interpreter exit every rank checks in and the host waits for them (skipped after a failure).
    atexit.register(ctx.close)
    if backend == "nccl":
        # NCCL wants the first operation on a communicator to involve all its ranks
        dist.barrier(group=pp_group)
        dist.barrier(group=replica_group)
    return ctx


def _pipeline_groups(rank: int, num_stages: int, replicas: int):
    """(this rank's pipeline group, its replica group: its stage on every data-parallel replica); every rank
    creates every group, in one order."""
    pp_group = replica_group = None
    for d in range(replicas):
        g = dist.new_group([d * num_stages + s for s in range(num_stages)])
        if rank // num_stages == d:
            pp_group = g
    for s in range(num_stages):
        g = dist.new_group([d * num_stages + s for d in range(replicas)])
        if rank % num_stages == s:
            replica_group = g
    return pp_group, replica_group


# ---------------------------------------------------------------------------------------------
# point-to-point


@dataclass(frozen=True)
class CommEvent:
    """One posted operation: ``side`` ``send``/``recv``, towards global rank ``peer``, carrying
    ``label`` (e.g. ``act F3 0->1`` or ``header ...``) with these shapes and dtypes."""

    rank: int
    peer: int
    side: str
    label: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]


class CommRecorder:
    """Collects every rank-local `CommEvent` per peer, in posting order (a ``recorder`` hook)."""

    def __init__(self) -> None:
        self.events: list[CommEvent] = []

    def __call__(self, event: CommEvent) -> None:
        self.events.append(event)

    def per_peer(self) -> dict[int, list[tuple]]:
        """Peer global rank -> [(side, label, shapes, dtypes), ...] in posting order."""
        out: dict[int, list[tuple]] = {}
        for e in self.events:
            out.setdefault(e.peer, []).append((e.side, e.label, [list(s) for s in e.shapes], list(e.dtypes)))
        return out

    def clear(self) -> None:
        """Forget recorded events."""
        self.events.clear()


def check_peer_sequences(per_rank: dict[int, dict[int, list]]) -> None:
    """Raise AssertionError unless, for every pair of ranks, the operations one posts towards the other
    mirror the other's exactly (a send where the peer has a receive of the same label, shapes and
    dtypes, position by position). ``per_rank`` maps rank -> `CommRecorder.per_peer()` output."""
    flip = {"send": "recv", "recv": "send"}
    for a, peers in per_rank.items():
        for b, seq in peers.items():
            other = per_rank.get(b, {}).get(a, [])
            if len(other) != len(seq):
                raise AssertionError(f"rank {a} posts {len(seq)} operations towards rank {b}, which posts {len(other)} back")
            for k, (x, y) in enumerate(zip(seq, other)):
                if (flip[x[0]], *x[1:]) != tuple(y):
                    raise AssertionError(f"operation {k} between ranks {a} and {b} does not pair: {x} vs {y}")


def _encode_header(msg: Message, step: int, specs: Sequence[TensorSpec]) -> torch.Tensor:
    h = torch.full((HEADER_LEN,), -1, dtype=torch.int64)
    vals = [_HEADER_MAGIC, step, msg.microbatch, 0 if msg.kind == "act" else 1, len(specs)]
    for sp in specs:
        if len(sp.shape) > _MAX_DIMS:
            raise ValueError(f"debug headers carry at most {_MAX_DIMS} dimensions per tensor")
        vals += [_DTYPES.index(sp.dtype), len(sp.shape), *sp.shape, *([-1] * (_MAX_DIMS - len(sp.shape)))]
    if len(vals) > HEADER_LEN:
        raise ValueError("too many tensors in one message for the debug header")
    h[: len(vals)] = torch.tensor(vals, dtype=torch.int64)
    return h


def _decode_header(h: torch.Tensor) -> str:
    v = h.tolist()
    if v[0] != _HEADER_MAGIC:
        return f"<not a dynabatch header: {v[:8]}...>"
    n, k, parts = v[4], 5, []
    for _ in range(n):
        dt, nd = v[k], v[k + 1]
        shape = v[k + 2:k + 2 + nd]
        parts.append(f"{shape} {str(_DTYPES[dt]).replace('torch.', '') if 0 <= dt < len(_DTYPES) else dt}")
        k += 2 + _MAX_DIMS
    return f"step {v[1]} micro-batch {v[2]} {'act' if v[3] == 0 else 'grad'}: [" + ", ".join(parts) + "]"


class P2P:
    """Posts the sends and receives of pipeline `Message`s for one rank of a `DistContext`."""

    def __init__(self, ctx: DistContext, *, debug_shapes: bool = False,
                 recorder: Callable[[CommEvent], None] | None = None):
        self.ctx = ctx
        self.debug_shapes = debug_shapes
        self.recorder = recorder
        self.step = 0

    def _record(self, peer: int, side: str, label: str, tensors: Sequence[torch.Tensor]) -> None:
        if self.recorder is not None:
            self.recorder(CommEvent(self.ctx.rank, peer, side, label, tuple(tuple(t.shape) for t in tensors),
                                    tuple(str(t.dtype).replace("torch.", "") for t in tensors)))

    def _post(self, ops: list) -> list:
        return dist.batch_isend_irecv(ops) if ops else []

    def send(self, msg: Message, tensors: Sequence[torch.Tensor], specs: Sequence[TensorSpec]) -> list:
        """Post the send of ``msg`` (to the peer stage in this replica); returns the work handles.
        ``tensors`` must match ``specs`` (checked locally: no communication)."""
        if len(tensors) != len(specs) or not all(sp.matches(t) for sp, t in zip(specs, tensors)):
            got = ", ".join(f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in tensors)
            want = ", ".join(sp.describe() for sp in specs)
            raise ShapeMismatch(f"stage {self.ctx.stage} (rank {self.ctx.rank}) produced [{got}] for {msg.describe()} "
                                f"(micro-batch {msg.microbatch} of step {self.step}) but the plan says [{want}]; "
                                f"nothing was sent")
        peer = self.ctx.global_rank(msg.dst)
        ops = []
        if self.debug_shapes:
            header = _encode_header(msg, self.step, specs).to(self.ctx.device)
            self._record(peer, "send", f"header {msg.describe()}", [header])
            ops.append(dist.P2POp(dist.isend, header, peer, self.ctx.pp_group))
        self._record(peer, "send", msg.describe(), tensors)
        ops += [dist.P2POp(dist.isend, t, peer, self.ctx.pp_group) for t in tensors]
        return self._post(ops)

    def recv(self, msg: Message, specs: Sequence[TensorSpec]) -> tuple[list[torch.Tensor], list]:
        """Post the receive of ``msg`` into fresh buffers shaped by ``specs``; returns (buffers, works).
        In debug mode this first receives and checks the sender's header (a host sync)."""
        peer = self.ctx.global_rank(msg.src)
        if self.debug_shapes:
            header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.ctx.device)
            self._record(peer, "recv", f"header {msg.describe()}", [header])
            self.ctx.monitor.wait(self._post([dist.P2POp(dist.irecv, header, peer, self.ctx.pp_group)]),
                                  f"waiting for the debug header of {msg.describe()} from rank {peer} "
                                  f"(micro-batch {msg.microbatch} of step {self.step})", [peer])
            expected = _encode_header(msg, self.step, specs)
            if not torch.equal(header.cpu(), expected):
                raise ShapeMismatch(
                    f"stage {self.ctx.stage} (rank {self.ctx.rank}) planned to receive {msg.describe()} of step "
                    f"{self.step} as [{', '.join(sp.describe() for sp in specs)}] but stage {msg.src} (rank {peer}) "
                    f"sent {_decode_header(header.cpu())}: the ranks do not hold the same plan")
        bufs = [sp.empty(self.ctx.device) for sp in specs]
        self._record(peer, "recv", msg.describe(), bufs)
        return bufs, self._post([dist.P2POp(dist.irecv, b, peer, self.ctx.pp_group) for b in bufs])

    # -- plan check ------------------------------------------------------------------------------
    def check_links(self, links: dict[int, list[tuple[Message, Sequence[TensorSpec]]]]) -> None:
        """Verify, before any transfer of the step, that both ends of every link expect the same
        messages: ``links`` maps a neighbour stage to this rank's messages with it, in posting order,
        with the specs this rank sends or expects. Each end sends the other a fixed-size fingerprint
        (one small message per direction and step); only when they differ are the descriptions
        exchanged, to raise a `ShapeMismatch` naming the first differing micro-batch and both shapes."""
        ctx = self.ctx
        mine, fps, ops, order = {}, {}, [], sorted(links)
        for st in order:
            peer = ctx.global_rank(st)
            desc = [[m.describe(), m.microbatch, [[list(sp.shape), str(sp.dtype).replace("torch.", "")] for sp in specs]]
                    for m, specs in links[st]]
            raw = json.dumps(desc).encode()
            digest = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") & ((1 << 62) - 1)
            mine[st] = (desc, raw, torch.tensor([_PLAN_MAGIC, len(desc), digest, len(raw)], dtype=torch.int64))
            theirs = torch.empty(_PLAN_WORDS, dtype=torch.int64, device=ctx.device)
            fps[st] = theirs
            send = (dist.isend, mine[st][2].to(ctx.device), "send")
            recv = (dist.irecv, theirs, "recv")
            # the lower rank sends first, the higher receives first: both ends post mirrored sequences
            for fn, t, side in ((send, recv) if ctx.rank < peer else (recv, send)):
                self._record(peer, side, "plan check", [t])
                ops.append(dist.P2POp(fn, t, peer, ctx.pp_group))
        if not ops:
            return
        peers = [ctx.global_rank(st) for st in order]
        ctx.monitor.wait(self._post(ops), f"checking the plan of step {self.step} with ranks {peers}", peers)
        bad = [st for st in order if not torch.equal(fps[st].cpu(), mine[st][2])]
        if not bad:
            return
        # slow path: exchange the descriptions of the links that differ
        ops, got = [], {}
        for st in bad:
            peer = ctx.global_rank(st)
            n = int(fps[st][3].item())
            got[st] = torch.empty(max(n, 0), dtype=torch.uint8, device=ctx.device)
            send = (dist.isend, torch.frombuffer(bytearray(mine[st][1]), dtype=torch.uint8).to(ctx.device))
            recv = (dist.irecv, got[st])
            for fn, t in ((send, recv) if ctx.rank < peer else (recv, send)):
                ops.append(dist.P2POp(fn, t, peer, ctx.pp_group))
        ctx.monitor.wait(self._post(ops), f"comparing the plan of step {self.step} with ranks "
                                          f"{[ctx.global_rank(st) for st in bad]}", [ctx.global_rank(st) for st in bad])
        st = bad[0]
        theirs = json.loads(bytes(got[st].cpu().tolist()).decode())
        raise ShapeMismatch(self._plan_difference(st, mine[st][0], theirs))

    def _plan_difference(self, st: int, mine: list, theirs: list) -> str:
        ctx = self.ctx
        me, other = f"stage {ctx.stage} (rank {ctx.rank})", f"stage {st} (rank {ctx.global_rank(st)})"

        def shapes(entry):
            return "[" + ", ".join(f"{shape} {dtype}" for shape, dtype in entry[2]) + "]"

        tail = (f"the ranks do not hold the same plan (step {self.step}; caught by the plan check before any "
                f"transfer)")
        for a, b in zip(mine, theirs):
            if a == b:
                continue
            if a[0] != b[0]:
                return (f"{me} next exchanges {a[0]} (micro-batch {a[1]}) with {other}, which next exchanges "
                        f"{b[0]} (micro-batch {b[1]}): {tail}")
            label = a[0]
            sending = label.endswith(f"{ctx.stage}->{st}")
            if sending:
                return (f"{me} will send {label} (micro-batch {a[1]}) as {shapes(a)} but {other} planned to receive "
                        f"{label} as {shapes(b)}: {tail}")
            return (f"{me} planned to receive {label} (micro-batch {a[1]}) as {shapes(a)} but {other} will send "
                    f"{label} as {shapes(b)}: {tail}")
        return (f"{me} exchanges {len(mine)} messages with {other} in this step, which exchanges {len(theirs)}: "
                f"{tail}")
