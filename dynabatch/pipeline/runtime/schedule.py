"""Per-stage op orders (GPipe, 1F1B, memory-aware adaptive) and the communication program each
rank executes, computed from the plan alone so that every rank derives the same thing.

Op encoding is the simulator's: ``j + 1`` is the forward of micro-batch ``j``, ``-(j + 1)`` its
backward; an order is an int32 ``[S, 2M]`` array.

Why a *program* and not just an order: NCCL matches point-to-point operations between two ranks
first-in first-out and ignores tags, and a posted operation blocks the ones posted after it on the
same communicator until its peer posts the match. So every pair of neighbouring stages must post
the messages between them in the same order, and the order must be executable. We get both from
one witness: simulate the step with small integer durations (identical on every rank, no float
drift), give every message the time its producer finishes, and let every rank post its messages
sorted by ``(time, tie-break)`` — with each compute placed at its start time. The globally first
unfinished message is then at the head of both endpoints' queues, so nothing can deadlock
(`check_programs` verifies this under strict one-queue-per-rank NCCL semantics).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...core.batchplan import BatchPlan
from ...core.options import SCHEDULES
from ...core.schedule.orders import plan_orders
from ...core.schedule.schedules import adaptive_order
from ...core.simulate.pipeline import pipeline_schedule, simulate_pipeline

#: Integer time units of the largest micro-batch's forward in the witness simulation.
TIME_LEVELS = 16


class ProgramError(RuntimeError):
    """A set of per-rank communication programs that mismatches or deadlocks under NCCL semantics."""


@dataclass(frozen=True, order=True)
class Message:
    """One boundary transfer: ``kind`` ``"act"`` (forward activations, ``src = dst - 1``) or ``"grad"``
    (gradients, ``src = dst + 1``) of micro-batch ``microbatch`` between stages ``src`` and ``dst``."""

    microbatch: int
    kind: str
    src: int
    dst: int

    def describe(self) -> str:
        """``act F3 0->1`` style text."""
        op = "F" if self.kind == "act" else "B"
        return f"{self.kind} {op}{self.microbatch} {self.src}->{self.dst}"


@dataclass(frozen=True)
class Post:
    """Post (non-blocking) the send or the receive of ``message`` on this stage."""

    message: Message


@dataclass(frozen=True)
class Compute:
    """Run op ``op`` (``j + 1`` forward, ``-(j + 1)`` backward of micro-batch ``j``); a compute that
    consumes a message first waits for its receive."""

    op: int

    @property
    def microbatch(self) -> int:
        """The micro-batch index ``j``."""
        return abs(self.op) - 1

    @property
    def forward(self) -> bool:
        """True for a forward."""
        return self.op > 0


Instruction = Post | Compute


def quantize_times(time_s, levels: int = TIME_LEVELS) -> np.ndarray:
    """Positive integer time units (int64, 1..``levels``) proportional to ``time_s`` seconds, so that the
    witness simulation is exact integer arithmetic on every rank; all ones when times are unknown."""
    t = np.asarray(time_s, np.float64)
    if t.size == 0 or not np.all(np.isfinite(t)) or t.max() <= 0:
        return np.ones(t.shape, np.int64)
    return np.maximum(1, np.rint(levels * t / t.max())).astype(np.int64)


def adaptive_orders(num_stages: int, time_units, memory_bytes=None, memory_limit: float | None = None) -> np.ndarray:
    """Memory-aware op orders, int32 ``[S, 2M]``: `dynabatch.core.schedule.schedules.adaptive_order` (the order
    the simulator and the planner use) on the witness times, forward ``u_j`` and backward ``2 u_j``
    units on every stage, no transfer time.

    ``memory_bytes`` [M] and ``memory_limit`` bytes in flight per stage (default ``S`` x the largest
    micro-batch); without valid memory figures every micro-batch counts 1 and the limit is ``S``
    (1F1B's stage-0 depth). A micro-batch larger than the limit still runs, alone. The result never
    deadlocks (the last stage always drains) and is checked by the simulator.
    """
    u = np.asarray(time_units, np.int64)
    S, M = int(num_stages), len(u)
    if S < 1 or M < 1:
        raise ValueError("adaptive_orders needs at least one stage and one micro-batch")
    mem = None if memory_bytes is None else np.asarray(memory_bytes, np.float64)
    if mem is None or mem.shape != (M,) or not np.all(np.isfinite(mem)) or mem.max() <= 0:
        mem, memory_limit = np.ones(M), float(S)
    fwd = np.broadcast_to(u.astype(np.float64), (S, M))
    ops = adaptive_order(fwd, 2 * fwd, np.maximum(mem, 0.0), memory_limit, oversize="alone")
    simulate_pipeline(np.ones(M), np.ones(M), schedule=ops)  # raises PipelineDeadlock if invalid
    return ops


def plan_schedule(configured: str, plan=None) -> tuple[str, float | None]:
    """The concrete order (``gpipe``, ``1f1b``, ``adaptive``) a runner configured with ``configured``
    runs for ``plan`` (a `BatchPlan`, or None for bare shapes), and the plan's in-flight activation
    budget per stage in bytes (None when it records none).

    ``auto`` follows the order the plan records (the one the planner simulated, chosen per step when
    it planned with ``schedule="auto"``; 1F1B without a plan); a concrete name overrides the plan."""
    if configured not in SCHEDULES:
        raise ValueError(f"unknown schedule {configured!r}; choose one of {SCHEDULES}")
    recorded = getattr(plan, "schedule", None)
    options = getattr(plan, "options", None) or {}
    budget = options.get("stage_memory_bytes") if recorded == "adaptive" else None
    if configured != "auto":
        return configured, (budget if configured == "adaptive" else None)
    if recorded in ("gpipe", "1f1b", "adaptive"):
        return recorded, budget
    return "1f1b", None


def stage_orders(schedule: str, num_stages: int, num_microbatches: int, *, time_s=None, memory_bytes=None,
                 memory_limit: float | None = None) -> np.ndarray:
    """Op orders int32 ``[S, 2M]`` for ``schedule`` ``gpipe``, ``1f1b`` or ``adaptive`` (which uses the
    plan's predicted ``time_s`` seconds and ``memory_bytes`` per micro-batch and ``memory_limit``
    bytes of in-flight activations per stage; see `adaptive_orders`)."""
    if schedule in ("gpipe", "1f1b"):
        return pipeline_schedule(num_stages, num_microbatches, schedule)
    if schedule == "adaptive":
        units = quantize_times(np.ones(num_microbatches) if time_s is None else time_s)
        return adaptive_orders(num_stages, units, memory_bytes, memory_limit)
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")


def runner_orders(configured: str, num_stages: int, time_s, memory_bytes, plan=None, replica: int = 0,
                  memory_limit: float | None = None) -> np.ndarray:
    """Op orders int32 ``[S, 2M]`` a runner configured with schedule ``configured`` (and, optionally,
    its own in-flight ``memory_limit`` bytes per stage) runs for replica ``replica``'s micro-batches
    (``time_s`` seconds and ``memory_bytes`` each, in execution order).

    With a `BatchPlan` whose recorded schedule is the one that runs, this is the op order the planner
    simulated and priced, read back from the plan (`dynabatch.core.schedule.orders.plan_orders`): the same
    derivation, never a second one. A concrete name that overrides the plan, an adaptive order under
    another memory limit, or bare shapes get `stage_orders` on the micro-batches' figures."""
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


def build_programs(orders: np.ndarray, time_units=None, entry=None) -> list[list[Instruction]]:
    """The instruction list of every stage for op orders ``orders`` (see the module docstring).

    ``time_units`` are the witness durations (positive integers per micro-batch; forward ``u``,
    backward ``2u``); only the relative order of posts depends on them, never correctness.
    ``entry`` [M]: the first stage micro-batch ``j`` runs on (default 0). The stages before it have
    no op and no message for it (its idle leading layers are bypassed: the entry stage builds its
    input from the micro-batch dictionary). The witness still simulates the full orders; dropping a
    micro-batch's first ops and their messages from both ends of every link only removes
    dependencies, so the programs stay executable (`check_programs` with the same ``entry``).
    """
    orders = np.asarray(orders, np.int32)
    S, two_m = orders.shape
    M = two_m // 2
    u = np.ones(M, np.int64) if time_units is None else np.asarray(time_units, np.int64)
    if u.shape != (M,) or u.min(initial=1) < 1:
        raise ValueError("time_units must be M positive integers")
    e = _entries(entry, S, M)
    fwd = np.broadcast_to(u.astype(np.float64), (S, M))
    sim = simulate_pipeline(fwd, 2 * fwd, schedule=orders)  # integer-valued floats: exact
    start, end = sim.start_s, sim.end_s
    events: list[list[tuple]] = [[] for _ in range(S)]
    for s in range(S):
        for op in orders[s]:
            j, k = abs(int(op)) - 1, int(op < 0)
            if s >= e[j]:
                events[s].append((float(start[s, j, k]), 1, 0, Compute(int(op))))
    for s in range(S - 1):
        for j in range(M):
            if s < e[j]:
                continue  # the link into micro-batch j's entry stage carries nothing for it
            for msg, t in ((Message(j, "act", s, s + 1), end[s, j, 0]), (Message(j, "grad", s + 1, s), end[s + 1, j, 1])):
                # the same key on both endpoints: (send time, messages before computes, global tie-break)
                key = (float(t), 0, (j, msg.kind, min(msg.src, msg.dst)), Post(msg))
                events[msg.src].append(key)
                events[msg.dst].append(key)
    return [[e[3] for e in sorted(ev, key=lambda e: e[:3])] for ev in events]


def check_programs(programs: list[list[Instruction]], entry=None) -> None:
    """Raise `ProgramError` unless the per-stage programs run to completion under strict NCCL-like
    semantics: one FIFO queue of posted operations per rank (across all peers); the head operation
    completes only together with the matching head operation (same message, opposite side) of its
    peer; a compute blocks until the receive of the message it consumes has completed; a send may
    only be posted after the compute that produces it. ``entry`` [M] as in `build_programs`: the
    forward of micro-batch ``j`` on its entry stage consumes no message."""
    S = len(programs)
    ents = {} if entry is None else {j: int(x) for j, x in enumerate(entry)}
    queues: list[list[tuple[str, Message]]] = [[] for _ in range(S)]
    pc = [0] * S
    computed = [set() for _ in range(S)]
    received = [set() for _ in range(S)]
    posted = [set() for _ in range(S)]
    for s, prog in enumerate(programs):
        for ins in prog:
            if isinstance(ins, Post) and s not in (ins.message.src, ins.message.dst):
                raise ProgramError(f"stage {s} posts {ins.message.describe()}, which is not its message")
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
                    if side == "send" and (m.microbatch + 1) * (1 if m.kind == "act" else -1) not in computed[s]:
                        raise ProgramError(f"stage {s} posts the send of {m.describe()} before computing it")
                    posted[s].add((m, side))
                    queues[s].append((side, m))
                else:
                    j = ins.microbatch
                    need = None
                    if ins.forward and s > ents.get(j, 0):
                        need = Message(j, "act", s - 1, s)
                    elif not ins.forward and s < S - 1:
                        need = Message(j, "grad", s + 1, s)
                    if not ins.forward and ins.op * -1 not in computed[s]:
                        raise ProgramError(f"stage {s} runs B{j} before F{j}")
                    if need is not None and need not in received[s]:
                        break
                    computed[s].add(ins.op)
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


def naive_programs(orders: np.ndarray) -> list[list[Instruction]]:
    """Programs that post each receive right before the compute that needs it and each send right
    after its compute. Correct for GPipe; deadlocks under NCCL for 1F1B (kept to show why
    `build_programs` exists, and to test `check_programs`)."""
    orders = np.asarray(orders)
    S = orders.shape[0]
    progs = []
    for s in range(S):
        prog: list[Instruction] = []
        for op in orders[s]:
            j = abs(int(op)) - 1
            if op > 0:
                if s > 0:
                    prog.append(Post(Message(j, "act", s - 1, s)))
                prog.append(Compute(int(op)))
                if s < S - 1:
                    prog.append(Post(Message(j, "act", s, s + 1)))
            else:
                if s < S - 1:
                    prog.append(Post(Message(j, "grad", s + 1, s)))
                prog.append(Compute(int(op)))
                if s > 0:
                    prog.append(Post(Message(j, "grad", s, s - 1)))
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
    for schedule in ("gpipe", "1f1b", "adaptive"):
        orders = runner_orders(schedule, 2, np.ones(2), np.ones(2))
        build_programs(orders, quantize_times(np.ones(2)))
