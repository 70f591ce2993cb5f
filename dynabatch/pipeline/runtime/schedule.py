"""The communication program each rank executes, compiled from the step's ops (`StepOps`), which come from
the plan alone (`dynabatch.core.schedule`), so that every rank derives the same thing.

A program is the rank's ops (`Compute`: forward, backward, the input and weight parts of a split
backward, an update) with the sends and receives they need (`Post` of a `Message`) placed among them.
Why a *program* and not just the order: NCCL matches point-to-point operations between two ranks
first-in first-out and ignores tags, and a posted operation blocks the ones posted after it on the same
communicator until its peer posts the match. So every pair of neighbouring stages must post the
messages between them in the same order, and the order must be executable. We get both from one
witness: simulate the step with small integer durations (identical on every rank, no float drift), give
every message the time its producer finishes, and let every rank post its messages sorted by ``(time,
tie-break)`` — with each compute placed at its start time. The globally first unfinished message is
then at the head of both endpoints' queues, so nothing can deadlock (`check_programs` verifies this
under strict one-queue-per-rank NCCL semantics).

With ``v`` model chunks per rank (interleaved schedules) the virtual stages ``q = c S + s`` form a ring
over the ranks: chunk ``c`` of the last rank sends its activations to chunk ``c + 1`` of rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...core.batchplan import BatchPlan
from ...core.kernels import op_codes as oc
from ...core.kernels.simulate import simulate_table_kernel
from ...core.options import SCHEDULES
from ...core.schedule.build import step_ops
from ...core.schedule.ops import Op, StepOps
from ...core.schedule.orders import plan_orders
from ...core.schedule.registry import schedule_info

#: Integer time units of the largest micro-batch's forward in the witness simulation.
TIME_LEVELS = 16


class ProgramError(RuntimeError):
    """A set of per-rank communication programs that mismatches or deadlocks under NCCL semantics."""


@dataclass(frozen=True, order=True)
class Message:
    """One boundary transfer: ``kind`` ``"act"`` (forward activations) or ``"grad"`` (gradients) of
    micro-batch ``microbatch`` between stages (ranks) ``src`` and ``dst``; ``chunk``: the chunk of the link's
    lower virtual stage (``b = chunk S + lower rank``: activations go ``b -> b + 1``, gradients back)."""

    microbatch: int
    kind: str
    src: int
    dst: int
    chunk: int = 0

    def describe(self) -> str:
        """``act F3 0->1`` style text (``.c1`` on chunk 1's link)."""
        op = "F" if self.kind == "act" else "B"
        return f"{self.kind} {op}{self.microbatch} {self.src}->{self.dst}" + (f" .c{self.chunk}" if self.chunk else "")


def link_message(j: int, kind: str, b: int, S: int) -> Message:
    """The message of micro-batch ``j`` over the link between virtual stages ``b`` and ``b + 1``."""
    lo, hi = b % S, (b + 1) % S
    return Message(j, kind, lo, hi, b // S) if kind == "act" else Message(j, kind, hi, lo, b // S)


@dataclass(frozen=True)
class Post:
    """Post (non-blocking) the send or the receive of ``message`` on this stage."""

    message: Message


@dataclass(frozen=True)
class Compute:
    """Run ``op`` (an `Op`: forward, backward, input or weight part of a backward, update); a compute that
    consumes a message first waits for its receive."""

    op: Op

    @property
    def microbatch(self) -> int:
        """The micro-batch index ``j`` (an update's step or model)."""
        return self.op.microbatch

    @property
    def forward(self) -> bool:
        """True for a forward."""
        return self.op.kind == oc.FORWARD

    @property
    def chunk(self) -> int:
        return self.op.chunk


Instruction = Post | Compute


def consumed(op: Op, s: int, S: int, Q: int, entry: int = 0) -> Message | None:
    """The message ``op`` on stage ``s`` waits for (None: none), of ``Q`` virtual stages; ``entry``: the stage
    the micro-batch starts on (bypass: no activation comes into it)."""
    q = op.chunk * S + s
    if op.kind == oc.FORWARD and q > entry:
        return link_message(op.microbatch, "act", q - 1, S)
    if op.kind in (oc.BACKWARD, oc.BACKWARD_INPUT) and q < Q - 1:
        return link_message(op.microbatch, "grad", q, S)
    return None


def produced(op: Op, s: int, S: int, Q: int, entry: int = 0) -> Message | None:
    """The message ``op`` on stage ``s`` sends (None: none)."""
    q = op.chunk * S + s
    if op.kind == oc.FORWARD and q < Q - 1:
        return link_message(op.microbatch, "act", q, S)
    if op.kind in (oc.BACKWARD, oc.BACKWARD_INPUT) and q > entry:
        return link_message(op.microbatch, "grad", q - 1, S)
    return None


def quantize_times(time_s, levels: int = TIME_LEVELS) -> np.ndarray:
    """Positive integer time units (int64, 1..``levels``) proportional to ``time_s`` seconds, so that the
    witness simulation is exact integer arithmetic on every rank; all ones when times are unknown."""
    t = np.asarray(time_s, np.float64)
    if t.size == 0 or not np.all(np.isfinite(t)) or t.max() <= 0:
        return np.ones(t.shape, np.int64)
    return np.maximum(1, np.rint(levels * t / t.max())).astype(np.int64)


def plan_schedule(configured: str, plan=None) -> tuple[str, float | None]:
    """The concrete order a runner configured with ``configured`` runs for ``plan`` (a `BatchPlan`, or None
    for bare shapes), and the plan's in-flight activation budget per stage in bytes (None when it records
    none).

    ``auto`` follows the order the plan records (the one the planner simulated, chosen per step when
    it planned with ``schedule="auto"``; 1F1B without a plan); a concrete name overrides the plan."""
    if configured not in SCHEDULES:
        raise ValueError(f"unknown schedule {configured!r}; choose one of {SCHEDULES}")
    recorded = getattr(plan, "schedule", None)
    options = getattr(plan, "options", None) or {}
    budget = options.get("stage_memory_bytes") if recorded == "adaptive" else None
    if configured != "auto":
        return configured, (budget if configured == "adaptive" else None)
    if recorded is not None:
        return schedule_info(recorded).name, budget
    return "1f1b", None


def stage_orders(schedule: str, num_stages: int, num_microbatches: int, *, time_s=None, memory_bytes=None,
                 memory_limit: float | None = None, p2p_s=0.0) -> StepOps:
    """The ops of ``schedule`` for bare shapes: `dynabatch.core.schedule.build.step_ops` with each
    micro-batch's predicted ``time_s`` seconds on every stage (split by the default forward share),
    ``p2p_s`` seconds per hop (unknown: 0), ``memory_bytes`` each and ``memory_limit`` in-flight bytes per
    stage (default ``S`` x the largest micro-batch; without valid memory figures every micro-batch counts
    1 and the limit is ``S``, 1F1B's stage-0 depth). A micro-batch over the limit still runs, alone."""
    S, M = int(num_stages), int(num_microbatches)
    t = np.ones(M) if time_s is None else np.asarray(time_s, np.float64)
    if t.shape != (M,) or not np.all(np.isfinite(t)) or t.min(initial=0) < 0:
        t = np.ones(M)
    mem = None if memory_bytes is None else np.asarray(memory_bytes, np.float64)
    if mem is None or mem.shape != (M,) or not np.all(np.isfinite(mem)) or mem.max(initial=0) <= 0:
        mem, memory_limit = None, float(S)
    limit = float(S * mem.max()) if memory_limit is None else float(memory_limit)
    return step_ops(schedule, S, M, stage_times=t, p2p_s=p2p_s, mem_bytes=None if mem is None else np.maximum(mem, 0),
                    memory_limit=limit)


def runner_orders(configured: str, num_stages: int, time_s, memory_bytes, plan=None, replica: int = 0,
                  memory_limit: float | None = None) -> StepOps:
    """The ops a runner configured with schedule ``configured`` (and, optionally, its own in-flight
    ``memory_limit`` bytes per stage) runs for replica ``replica``'s micro-batches (``time_s`` seconds and
    ``memory_bytes`` each, in execution order).

    With a `BatchPlan` whose recorded schedule is the one that runs, this is the op order the planner
    simulated and priced, read back from the plan (`dynabatch.core.schedule.orders.plan_orders`). A
    concrete name that overrides the plan, an adaptive order under another memory limit, or bare shapes
    get `stage_orders` on the micro-batches' figures: the same derivation (`step_ops`), never a second one."""
    schedule, budget = plan_schedule(configured, plan)
    if isinstance(plan, BatchPlan) and schedule == plan.schedule and not (
            schedule == "adaptive" and memory_limit is not None):
        return plan_orders(plan, replica)
    limit = budget if memory_limit is None else memory_limit
    return stage_orders(schedule, num_stages, len(time_s), time_s=time_s, memory_bytes=memory_bytes,
                        memory_limit=limit)


def _entries(entry, S: int, M: int) -> np.ndarray:
    """int64 ``[M]``: the first stage each micro-batch runs on (0 without bypass)."""
    e = np.zeros(M, np.int64) if entry is None else np.asarray(entry, np.int64)
    if e.shape != (M,) or e.min(initial=0) < 0 or e.max(initial=0) >= S:
        raise ValueError(f"entry must be {M} stage indices in 0..{S - 1}")
    return e


def as_step_ops(orders) -> StepOps:
    """``orders`` as `StepOps` (plain op codes int ``[S, 2M]`` are converted)."""
    return orders if isinstance(orders, StepOps) else StepOps.from_codes(np.asarray(orders, np.int64))


def witness(ops: StepOps, time_units) -> tuple[list[list[float]], np.ndarray]:
    """The witness simulation of ``ops``: forward ``u``, backward ``2u`` (split: ``u`` each part), updates no
    time, no transfer time; integer-valued floats (exact). Returns the start time of every op of every rank
    (list order) and the ``end`` array ``[Q, M, 2]`` (forwards, backwards or their input parts)."""
    S, M, Q = ops.num_stages, ops.num_microbatches, ops.num_virtual_stages
    u = np.broadcast_to(np.asarray(time_units, np.float64), (Q, M)).copy()
    start, end = np.empty((Q, M, 2)), np.empty((Q, M, 2))
    wstart, wend = np.empty((Q, M)), np.empty((Q, M))
    if simulate_table_kernel(u, 2 * u, oc.WEIGHT_SHARE, np.zeros(M), ops.kernel_table, start, end, wstart, wend) != 0:
        raise ProgramError(f"the {ops.schedule or 'given'} order cannot run: it deadlocks in the witness simulation")
    out = []
    for s in range(S):
        t, row = 0.0, []
        for op in ops.rank(s):
            q = op.chunk * S + s
            if op.kind == oc.UPDATE:
                row.append(t)
                continue
            begin = wstart[q, op.microbatch] if op.kind == oc.BACKWARD_WEIGHT else start[q, op.microbatch,
                                                                                          int(op.kind != oc.FORWARD)]
            row.append(float(begin))
            t = float(wend[q, op.microbatch] if op.kind == oc.BACKWARD_WEIGHT else end[q, op.microbatch,
                                                                                         int(op.kind != oc.FORWARD)])
        out.append(row)
    return out, end


def build_programs(orders, time_units=None, entry=None) -> list[list[Instruction]]:
    """The instruction list of every stage for the step's ops ``orders`` (a `StepOps`, or plain op codes;
    see the module docstring).

    ``time_units`` are the witness durations (positive integers per micro-batch; forward ``u``, backward
    ``2u``); only the relative order of posts depends on them, never correctness. ``entry`` [M]: the first
    stage micro-batch ``j`` runs on (default 0; one chunk per rank only). The stages before it have no op
    and no message for it (its idle leading layers are bypassed: the entry stage builds its input from the
    micro-batch dictionary). The witness still simulates the full orders; dropping a micro-batch's first
    ops and their messages from both ends of every link only removes dependencies, so the programs stay
    executable (`check_programs` with the same ``entry``).
    """
    ops = as_step_ops(orders)
    S, M, Q = ops.num_stages, ops.num_microbatches, ops.num_virtual_stages
    u = np.ones(M, np.int64) if time_units is None else np.asarray(time_units, np.int64)
    if u.shape != (M,) or u.min(initial=1) < 1:
        raise ValueError("time_units must be M positive integers")
    e = _entries(entry, S, M)
    if ops.num_chunks > 1 and (e.any() or S < 2):
        raise ValueError("model chunks run on two stages at least, and bypassed stages need one chunk per stage")
    starts, end = witness(ops, u)
    events: list[list[tuple]] = [[] for _ in range(S)]
    for s in range(S):
        for op, t in zip(ops.rank(s), starts[s]):
            if op.kind == oc.UPDATE or s >= e[op.microbatch]:
                events[s].append((t, 1, 0, Compute(op)))
    for b in range(Q - 1):
        for j in range(M):
            if b < e[j]:
                continue  # the link into micro-batch j's entry stage carries nothing for it
            for msg, t in ((link_message(j, "act", b, S), end[b, j, 0]), (link_message(j, "grad", b, S),
                                                                            end[b + 1, j, 1])):
                # the same key on both endpoints: (send time, messages before computes, global tie-break)
                key = (float(t), 0, (j, msg.kind, b), Post(msg))
                events[msg.src].append(key)
                events[msg.dst].append(key)
    return [[ev[3] for ev in sorted(rank, key=lambda ev: ev[:3])] for rank in events]


def check_programs(programs: list[list[Instruction]], entry=None) -> None:
    """Raise `ProgramError` unless the per-stage programs run to completion under strict NCCL-like
    semantics: one FIFO queue of posted operations per rank (across all peers); the head operation
    completes only together with the matching head operation (same message, opposite side) of its
    peer; a compute blocks until the receive of the message it consumes has completed; a send may
    only be posted after the compute that produces it. ``entry`` [M] as in `build_programs`: the
    forward of micro-batch ``j`` on its entry stage consumes no message."""
    S = len(programs)
    chunks = 1 + max([i.op.chunk for p in programs for i in p if isinstance(i, Compute)], default=0)
    Q = S * chunks
    ents = {} if entry is None else {j: int(x) for j, x in enumerate(entry)}
    queues: list[list[tuple[str, Message]]] = [[] for _ in range(S)]
    pc = [0] * S
    computed = [set() for _ in range(S)]
    received = [set() for _ in range(S)]
    posted = [set() for _ in range(S)]
    sends = [dict() for _ in range(S)]  # message -> the compute that produces it
    for s, prog in enumerate(programs):
        for ins in prog:
            if isinstance(ins, Post) and s not in (ins.message.src, ins.message.dst):
                raise ProgramError(f"stage {s} posts {ins.message.describe()}, which is not its message")
            if isinstance(ins, Compute):
                m = produced(ins.op, s, S, Q, ents.get(ins.microbatch, 0))
                if m is not None:
                    sends[s][m] = ins.op
    while True:
        moved = False
        for s in range(S):  # run each host until it blocks
            while pc[s] < len(programs[s]):
                ins = programs[s][pc[s]]
                if isinstance(ins, Post):
                    m = ins.message
                    side = "send" if m.src == s else "recv"
                    if (m, side) in posted[s]:
                        raise ProgramError(f"stage {s} posts the {side} of {m.describe()} twice")
                    if side == "send" and sends[s].get(m) not in computed[s]:
                        raise ProgramError(f"stage {s} posts the send of {m.describe()} before computing it")
                    posted[s].add((m, side))
                    queues[s].append((side, m))
                else:
                    op = ins.op
                    need = consumed(op, s, S, Q, ents.get(op.microbatch, 0))
                    first = Op(oc.FORWARD, op.microbatch, op.chunk, op.model)
                    if op.kind in (oc.BACKWARD, oc.BACKWARD_INPUT) and first not in computed[s]:
                        raise ProgramError(f"stage {s} runs {op.name} before {first.name}")
                    if op.kind == oc.BACKWARD_WEIGHT and Op(oc.BACKWARD_INPUT, op.microbatch, op.chunk,
                                                            op.model) not in computed[s]:
                        raise ProgramError(f"stage {s} runs {op.name} before its input part")
                    if need is not None and need not in received[s]:
                        break
                    computed[s].add(op)
                pc[s] += 1
                moved = True
        for s in range(S):  # match queue heads pairwise
            while queues[s]:
                side, m = queues[s][0]
                peer = m.dst if side == "send" else m.src
                if not queues[peer] or queues[peer][0] != ("recv" if side == "send" else "send", m):
                    break
                queues[s].pop(0)
                queues[peer].pop(0)
                received[m.dst].add(m)
                moved = True
        if not moved:
            break
    if all(pc[s] == len(programs[s]) and not queues[s] for s in range(S)):
        return
    stuck = []
    for s in range(S):
        what = "done" if pc[s] == len(programs[s]) else f"host at {programs[s][pc[s]]}"
        head = f"queue head {queues[s][0][0]} {queues[s][0][1].describe()}" if queues[s] else "queue empty"
        stuck.append(f"stage {s}: {what}, {head}")
    raise ProgramError("communication programs deadlock under NCCL semantics: " + "; ".join(stuck))


def naive_programs(orders) -> list[list[Instruction]]:
    """Programs that post each receive right before the compute that needs it and each send right
    after its compute. Correct for GPipe; deadlocks under NCCL for 1F1B (kept to show why
    `build_programs` exists, and to test `check_programs`)."""
    ops = as_step_ops(orders)
    S, Q = ops.num_stages, ops.num_virtual_stages
    progs = []
    for s in range(S):
        prog: list[Instruction] = []
        for op in ops.rank(s):
            need, made = consumed(op, s, S, Q), produced(op, s, S, Q)
            prog += ([Post(need)] if need else []) + [Compute(op)] + ([Post(made)] if made else [])
        progs.append(prog)
    return progs


def peer_sequences(program: list[Instruction], stage: int) -> dict[int, list[tuple[str, Message]]]:
    """The (side, message) sequence ``stage`` posts towards each peer stage, in program order."""
    out: dict[int, list[tuple[str, Message]]] = {}
    for ins in program:
        if isinstance(ins, Post):
            m = ins.message
            side = "send" if m.src == stage else "recv"
            out.setdefault(m.dst if side == "send" else m.src, []).append((side, m))
    return out


def warm_orders() -> None:
    """Load the numba kernels behind `runner_orders` and `build_programs` (their on-disk cache, or a
    compile) now: `init_pipeline` calls it before the failure monitor starts, so a first step that pays
    for it on a loaded machine is not judged stalled by the other ranks."""
    for schedule in (n for n in SCHEDULES if schedule_info(n).concrete):
        orders = runner_orders(schedule, 2, np.ones(2), np.ones(2))
        build_programs(orders, quantize_times(np.ones(2)))
