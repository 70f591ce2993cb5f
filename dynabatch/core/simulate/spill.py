"""Shards of K models spilled to host memory: the residency policy and its timing (bytes, seconds).

One stage device holds the K models' shards of that stage (a shard: a model's stage parameters,
their gradients and the optimizer's state) within a byte budget; the others live in host memory.
The policy, shared by the runner (`dynabatch.pipeline.runtime.shards.ShardStore`, driven by
`dynabatch.pipeline.MultiModelRunner`) and the simulator (`spill_timing`, called by
`dynabatch.core.simulate.multimodel.simulate_multimodel`), so both make the same moves:

* **Uses** (`shard_uses`): a stage's op list read as a sequence of shard uses ``(model, "op")``,
  with ``(model, "update")`` right after a model's last backward (updates early: the runner's
  ``num_tokens`` mode) or all updates after the op list in model order (updates at the end).
* **Windows** (`Residency`): a model's ops (and early update) form one window from its first to its
  last use; a late update is a window of its own. A shard must be resident through its window.
* **Moves** (`replay`): at each use of a shard that is not resident, spill what `pick_victims`
  names (resident shards outside the active windows, the one used furthest in the future first)
  and load it (a *demand* load, issued when the stage reaches that use). When a use starts a
  window, the next window's shard is *prefetched* if it fits after evicting (shards in the active
  windows, that one, and those used before it are kept); otherwise it waits for its own turn.
  Early updates run inside their window and move nothing.

`spill_timing` times those moves: every stage has one copy engine on which spills (device ->
host, ``bytes / spill_bytes_per_s``) and loads (host -> device, ``bytes / load_bytes_per_s``) run
one at a time in the order they are issued, overlapping compute; a use of a shard cannot start
before the shard's latest load has finished (`dynabatch.core.kernels.spill`). The step is timed in
steady state: the residency at its start is what the same step leaves behind when run once from the
runner's start (models by index, as many as fit the budget). The copy engine is a model: the runner
loads on a side stream but copies spills on the compute stream, so a spill that makes room for a
prefetch overlaps compute here and not there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..kernels.spill import DEMAND_LOAD, DEMAND_SPILL, PREFETCH_LOAD, PREFETCH_SPILL, pack_copies, spill_timing_kernel
from ..kernels.simulate import OK

__all__ = ["Residency", "SpillTiming", "copy_plan", "pick_victims", "replay", "shard_uses", "spill_timing"]


class Residency:
    """One step's shard uses on a stage, ``uses[i] = (model, "op" | "update")``, as windows: a model's
    ops (with its update when ``early``) form one window from its first to its last use; a late
    update (after the whole program) is a window of its own. `active` gives the models whose window
    holds use ``i`` (they must be resident), `next_use` the next use of each model at or after ``i``
    (the eviction order: furthest first), `next_window` the window that starts next after ``i`` when
    ``i`` starts one (what is prefetched)."""

    def __init__(self, uses: list[tuple[int, str]], K: int, early: bool):
        U = len(uses)
        self.windows: list[tuple[int, int, int]] = []  # (start, end, model)
        for k in range(K):
            ops = [i for i, (q, kind) in enumerate(uses) if q == k and (kind == "op" or early)]
            if ops:
                self.windows.append((ops[0], ops[-1], k))
            if not early:
                self.windows += [(i, i, k) for i, (q, kind) in enumerate(uses) if q == k and kind == "update"]
        self.windows.sort()
        self._active = np.zeros((U, K), bool)
        for a, b, k in self.windows:
            self._active[a:b + 1, k] = True
        nxt = np.full((U + 1, K), np.iinfo(np.int64).max, np.int64)
        for i in range(U - 1, -1, -1):
            nxt[i] = nxt[i + 1]
            nxt[i, uses[i][0]] = i
        self._next = nxt
        self._starts = {a: n for n, (a, _, _) in enumerate(self.windows)}

    def active(self, i: int) -> set[int]:
        return {int(k) for k in np.flatnonzero(self._active[i])}

    def next_use(self, i: int) -> dict[int, int]:
        big = np.iinfo(np.int64).max
        return {k: int(t) for k, t in enumerate(self._next[i]) if t != big}

    def next_window(self, i: int) -> tuple[int, int] | None:
        n = self._starts.get(i)
        if n is None or n + 1 >= len(self.windows):
            return None
        a, _, k = self.windows[n + 1]
        return a, k


def pick_victims(candidates, size_of: Callable[[int], float], free: float, need: float,
                 next_use: dict[int, float]) -> list[int] | None:
    """The shards to spill so that ``need`` more bytes fit when ``free`` bytes are free: from
    ``candidates`` (resident shards that may go), used furthest in the future first (never used
    again first; ties: higher index first), as few as reach ``need``. ``[]`` when it fits already;
    None when even spilling every candidate is not enough. ``size_of(k)``: shard ``k``'s bytes."""
    if free >= need:
        return []
    victims = sorted(candidates, key=lambda k: (-next_use.get(k, float("inf")), -k))
    if free + sum(size_of(k) for k in victims) < need:
        return None
    out = []
    for k in victims:
        if free >= need:
            break
        free += size_of(k)
        out.append(k)
    return out


def shard_uses(row, order, num_microbatches: int, updates_at_end: bool) -> list[tuple[int, str]]:
    """A stage's uses of its shards, ``(model, "op" | "update")``, for its op list ``row`` (virtual
    codes; virtual micro-batch ``v`` belongs to model ``order[v // num_microbatches]``): one use per
    op; a model's update right after its last op, or (``updates_at_end``) all after the list in
    ``order``. What `dynabatch.pipeline.MultiModelRunner` runs."""
    M = int(num_microbatches)
    left = {int(k): 0 for k in order}
    for op in row:
        left[int(order[(abs(int(op)) - 1) // M])] += 1
    uses = []
    for op in row:
        k = int(order[(abs(int(op)) - 1) // M])
        uses.append((k, "op"))
        left[k] -= 1
        if not updates_at_end and left[k] == 0:
            uses.append((k, "update"))
    return uses + ([(int(k), "update") for k in order] if updates_at_end else [])


def replay(uses: list[tuple[int, str]], sizes: Sequence[float], budget: float, updates_at_end: bool,
           resident: Sequence[bool]) -> tuple[list[tuple[int, int, int]], list[bool]]:
    """The runner's moves over ``uses`` (module doc) on a device of ``budget`` bytes holding the
    models ``resident`` at the start; ``sizes[k]``: model ``k``'s shard bytes. Returns the copies
    ``(use index, kind, model)`` in issue order (kinds `DEMAND_SPILL`, `DEMAND_LOAD`,
    `PREFETCH_SPILL`, `PREFETCH_LOAD` of `dynabatch.core.kernels.spill`) and the residency after."""
    K = len(sizes)
    plan = Residency(uses, K, not updates_at_end)
    resident = [bool(r) for r in resident]
    copies: list[tuple[int, int, int]] = []

    def bring(i, k, keep, next_use, prefetch):
        free = budget - sum(sizes[q] for q in range(K) if resident[q])
        victims = pick_victims([q for q in range(K) if resident[q] and q not in keep], sizes.__getitem__, free,
                               sizes[k], next_use)
        if victims is None:
            return False
        for q in victims:
            resident[q] = False
            copies.append((i, PREFETCH_SPILL if prefetch else DEMAND_SPILL, q))
        resident[k] = True
        copies.append((i, PREFETCH_LOAD if prefetch else DEMAND_LOAD, k))
        return True

    for i, (k, kind) in enumerate(uses):
        if kind == "update" and not updates_at_end:
            continue  # inside k's window, right after its last backward: nothing moves
        if not resident[k] and not bring(i, k, plan.active(i) | {k}, plan.next_use(i), False):
            raise RuntimeError(f"internal error: no room for shard {k} at use {i} (budget {budget} bytes)")
        nxt = plan.next_window(i)
        if nxt is not None and not resident[nxt[1]]:
            at, q = nxt
            future = plan.next_use(i)
            bring(i, q, plan.active(i) | {q} | {r for r, t in future.items() if t < at}, future, True)
    return copies, resident


@dataclass(frozen=True)
class SpillTiming:
    """Outcome of `spill_timing` (per stage ``[S]`` arrays): ``makespan_s`` the step with its copies
    and stalls (s); ``load_s`` seconds the copy engine spent copying (loads and spills);
    ``stall_s`` compute seconds lost waiting for a load; ``loads`` / ``spills`` / ``prefetches``
    shard moves (prefetches: the loads issued before the shard's turn, counted in ``loads``)."""

    makespan_s: float
    load_s: np.ndarray
    stall_s: np.ndarray
    loads: np.ndarray
    spills: np.ndarray
    prefetches: np.ndarray


def copy_plan(ops, order, num_microbatches: int, shard_bytes, budget_bytes, load_bytes_per_s: float,
              spill_bytes_per_s: float, updates_at_end: bool) -> tuple[list[list[tuple]], np.ndarray]:
    """The copies of one steady-state step (module doc) as `spill_timing_kernel` takes them:
    ``copies[s]`` a list of ``(use, kind, shard position, seconds)`` in issue order (use: op position
    or ``2N + u`` for late update ``u``) and ``upd`` int64 ``[S, L]`` the late updates' shard
    positions. ``ops`` int32 ``[S, 2KM]``, ``order`` the model of each position, ``shard_bytes``
    ``[K, S]`` by model (bytes), ``budget_bytes`` ``[S]`` (bytes), bandwidths in bytes per second."""
    S, two_n = np.shape(ops)
    K, M = len(order), int(num_microbatches)
    pos = np.empty(K, np.int64)
    pos[np.asarray(order, np.int64)] = np.arange(K)
    copies = []
    for s in range(S):
        uses = shard_uses(ops[s], order, M, updates_at_end)
        sizes = [float(shard_bytes[k, s]) for k in range(K)]
        budget = float(budget_bytes[s])
        resident = [True] * K  # the runner's start: spill models from the last until the rest fit
        for k in reversed(range(K)):
            if sum(sz for sz, r in zip(sizes, resident) if r) <= budget:
                break
            resident[k] = False
        _, resident = replay(uses, sizes, budget, updates_at_end, resident)  # one step to reach steady state
        moves, _ = replay(uses, sizes, budget, updates_at_end, resident)
        slot, n_ops = [], 0  # use index -> the kernel's use: op position, or 2N + late update number
        for _, kind in uses:
            slot.append(n_ops if kind == "op" else two_n + len(slot) - n_ops)
            n_ops += kind == "op"
        copies.append([(slot[i], kind, int(pos[k]),
                        sizes[k] / (load_bytes_per_s if kind in (DEMAND_LOAD, PREFETCH_LOAD) else spill_bytes_per_s))
                       for i, kind, k in moves])
    upd = np.tile(np.arange(K, dtype=np.int64), (S, 1)) if updates_at_end else np.zeros((S, 0), np.int64)
    return copies, upd


def spill_timing(vf, vb, vp, ops, order, num_microbatches: int, shard_bytes, budget_bytes, load_bytes_per_s: float,
                 spill_bytes_per_s: float, updates_at_end: bool) -> SpillTiming:
    """Time one step with the moves of the module doc (`copy_plan`). ``vf``/``vb`` ``[S, K*M]``
    seconds of the virtual micro-batches, ``vp`` ``[K*M]`` seconds per hop; the rest as `copy_plan`
    (``inf`` bandwidth: free copies). The budget must hold what the order needs at once (the
    caller checks it with `dynabatch.core.simulate.multimodel.active_peak`)."""
    S, N = np.shape(vf)
    copies, upd = copy_plan(ops, order, num_microbatches, shard_bytes, budget_bytes, load_bytes_per_s,
                            spill_bytes_per_s, updates_at_end)
    ncopy, cuse, ckind, cshard, cdur = pack_copies(copies)
    start, end = np.empty((S, N, 2)), np.empty((S, N, 2))
    upd_t, cstart, cend, stall = np.empty(upd.shape), np.empty(cdur.shape), np.empty(cdur.shape), np.empty(S)
    code = spill_timing_kernel(np.ascontiguousarray(vf, np.float64), np.ascontiguousarray(vb, np.float64),
                               np.ascontiguousarray(vp, np.float64), np.ascontiguousarray(ops, np.int32),
                               int(num_microbatches), upd, ncopy, cuse, ckind, cshard, cdur, start, end, upd_t, cstart,
                               cend, stall)
    if code != OK:
        raise RuntimeError(f"internal error: the spill timing kernel returned {code}")
    counts = [np.array([sum(c[1] in kinds for c in cs) for cs in copies], np.int64)
              for kinds in ((DEMAND_LOAD, PREFETCH_LOAD), (DEMAND_SPILL, PREFETCH_SPILL), (PREFETCH_LOAD,))]
    busy = np.array([sum(c[3] for c in cs) for cs in copies])
    return SpillTiming(float(max(end.max(), upd_t.max(initial=-np.inf))), busy, stall, *counts)
