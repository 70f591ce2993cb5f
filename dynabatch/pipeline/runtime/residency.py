"""One multi-model step's shard uses on this stage and the moves that serve them (bytes): which model's
shard each op and update uses, the check that the order fits the device budget before any transfer,
and, at each use, the load of a spilled shard and the prefetch of the next one
(`dynabatch.core.simulate.spill.Residency`: the policy the K-model simulator replays). Used by
`dynabatch.pipeline.runtime.multimodel` as its ``before_op`` hook."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...core.simulate.multimodel import active_peak
from ...core.simulate.spill import Residency
from .schedule import Post


class StepShards:
    """The shard uses of one step on this stage (module doc).

    ``store``: the stage's `ShardStore`; ``program``: this stage's instructions over ``K * M`` virtual
    micro-batches; ``order``: the step's model order (position ``p`` runs model ``order[p]``);
    ``stage_ops``: this stage's op order (for the budget check); ``early``: each model updates right
    after its last backward here (else all update at the end, in ``order``); ``names``: the models'
    names; ``where``: ``stage s (rank r)`` and ``step`` for the texts."""

    def __init__(self, store, program: Sequence, order: np.ndarray, M: int, stage_ops: np.ndarray, early: bool, *,
                 interleave: bool, names: Sequence[str], monitor, stage: int, rank: int, step: int):
        K = len(order)
        self.store, self.names, self.monitor, self.stage, self.step = store, names, monitor, stage, step
        self.uses: list[tuple[int, str]] = []
        left = np.full(K, M * 2)
        for ins in program:
            if not isinstance(ins, Post):
                k = int(order[ins.microbatch // M])
                self.uses.append((k, "op"))
                left[k] -= 1
                if early and left[k] == 0:
                    self.uses.append((k, "update"))
        if not early:
            self.uses += [(int(k), "update") for k in order]
        store.check_budget()
        if store.budget is not None:
            need, n = active_peak(stage_ops, M, np.array([store.full_bytes(int(k)) for k in order], float),
                                  updates_at_end=not early)
            if need > store.budget:
                raise ValueError(f"stage {stage} (rank {rank}) must hold {n} shards at once under the "
                                 f"{'interleaved' if interleave else 'model-after-model'} order ({int(need)} "
                                 f"bytes) but the device memory budget is {int(store.budget)} bytes; raise "
                                 f"memory_budget_bytes" + (" or use interleave=False" if interleave else ""))
        self.plan = Residency(self.uses, K, early)
        self.start = (store.spills, store.loads, store.prefetches, store.moved_bytes, store.copy_s)
        store.peak_bytes = store.observe()
        self.cursor = 0

    def use(self, k: int) -> None:
        """The next use is model ``k``'s: make its shard resident; at the start of its window prefetch
        the shard of the next window (one shard ahead) when it fits."""
        store, mon, s, i = self.store, self.monitor, self.stage, self.cursor
        self.cursor += 1
        if not store.resident[k]:
            mon.set_state("busy", f"loading {self.names[k]}'s stage {s} (step {self.step})")
            if not store.make_room(store.full_bytes(k), self.plan.active(i) | {k}, self.plan.next_use(i)):
                raise RuntimeError(f"internal error: no room for {self.names[k]} on stage {s}")
            store.load(k)
            store.observe()  # bytes change only at loads, first backwards and updates: measured there
        store.ready(k)
        nxt = self.plan.next_window(i)
        if nxt is not None and not store.resident[nxt[1]]:
            at, q = nxt
            fut = self.plan.next_use(i)
            keep = self.plan.active(i) | {q} | {r for r, t in fut.items() if t < at}
            if store.make_room(store.full_bytes(q), keep, fut):
                mon.set_state("busy", f"prefetching {self.names[q]}'s stage {s} (step {self.step})")
                store.load(q, prefetch=True)
                store.observe()

    def update_due(self, k: int) -> bool:
        """Whether the next use is model ``k``'s early update (its shard is resident: it just ran its
        last backward); consumes the use when it is."""
        if self.cursor < len(self.uses) and self.uses[self.cursor] == (k, "update"):
            self.cursor += 1
            return True
        return False

    def remaining(self) -> list[int]:
        """The models whose uses are left (the end-of-step updates), in order."""
        return [k for k, _ in self.uses[self.cursor:]]

    def moves(self) -> tuple[int, int, int, int, float]:
        """(spills, loads, prefetches, moved bytes, copy seconds) on this device since the step began."""
        st = self.store
        now = (st.spills, st.loads, st.prefetches, st.moved_bytes, st.copy_s)
        return tuple(a - b for a, b in zip(now, self.start))
