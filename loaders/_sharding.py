"""Work units and how one epoch's units are split, shuffled, capped and dealt to slots.

A *slot* is one (rank, DataLoader worker) pair; there are ``world_size * max(1, num_workers)``
of them, numbered rank-major. A *work unit* is a row range ``[start, stop)`` of one shard.
Every slot builds the same unit list from the same inputs, so no communication is needed:

    shards -> split into ~units_per_slot units per slot (balanced by rows)
           -> shuffle unit order by (seed, epoch)
           -> cut at the per-epoch cap (if any)
           -> deal: each unit goes to the slot with the fewest rows so far
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

import numpy as np

from ._types import ShardInfo

#: A sample id is ``(global shard << POSITION_BITS) | position in the shard``.
POSITION_BITS = 32
POSITION_MASK = (1 << POSITION_BITS) - 1


def split_sample_ids(sample_ids) -> tuple[np.ndarray, np.ndarray]:
    """(shard, position) arrays of sample ids (``(shard << 32) | position``)."""
    ids = np.asarray(sample_ids, np.int64)
    return ids >> POSITION_BITS, ids & POSITION_MASK

# Stop position of a unit whose shard length is unknown (streaming sources).
UNBOUNDED = 1 << 62


@dataclass(frozen=True, order=True)
class WorkUnit:
    """Rows ``[start, stop)`` of shard ``shard``; ``stop == UNBOUNDED`` means "to the end"."""

    shard: int
    start: int
    stop: int

    @property
    def rows(self) -> int | None:
        """Row count, or None when the shard length is unknown."""
        return None if self.stop >= UNBOUNDED else self.stop - self.start

    def to_list(self) -> list[int]:
        """``[shard, start, stop]``, the JSON form used in state dicts."""
        return [self.shard, self.start, self.stop]


@dataclass(frozen=True)
class Layout:
    """Which slot this iterator is: ``rank`` of ``world_size`` and ``worker_id`` of ``num_workers``.

    ``num_workers == 0`` means iteration in the main process (one slot per rank).
    """

    rank: int = 0
    world_size: int = 1
    worker_id: int = 0
    num_workers: int = 0

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")
        if not 0 <= self.worker_id < max(1, self.num_workers):
            raise ValueError(f"worker_id {self.worker_id} is not in [0, num_workers={self.num_workers})")

    @property
    def workers_per_rank(self) -> int:
        """Slots per rank: ``num_workers``, or 1 when iterating in the main process."""
        return max(1, self.num_workers)

    @property
    def num_slots(self) -> int:
        """Total number of (rank, worker) slots."""
        return self.world_size * self.workers_per_rank

    @property
    def slot(self) -> int:
        """This slot's index, rank-major."""
        return self.rank * self.workers_per_rank + self.worker_id

    def to_list(self) -> list[int]:
        """``[rank, world_size, worker_id, num_workers]``, the JSON form used in state dicts."""
        return [self.rank, self.world_size, self.worker_id, self.num_workers]

    @classmethod
    def resolve(cls, rank=None, world_size=None, worker_id=None, num_workers=None) -> Layout:
        """Fill unset fields from ``torch.distributed`` (when initialized) and ``get_worker_info()``."""
        if world_size is None:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                world_size = dist.get_world_size()
                rank = dist.get_rank() if rank is None else rank
            else:
                world_size = 1
        if num_workers is None:
            if worker_id is not None:
                raise ValueError("worker_id needs num_workers")
            from torch.utils.data import get_worker_info

            info = get_worker_info()
            worker_id, num_workers = (info.id, info.num_workers) if info is not None else (0, 0)
        return cls(rank or 0, world_size, worker_id or 0, num_workers)


def whole_shards(shards: list[ShardInfo]) -> list[WorkUnit]:
    """One range per non-empty shard, covering all of it."""
    return [WorkUnit(s.index, 0, UNBOUNDED if s.num_rows is None else s.num_rows)
            for s in shards if s.num_rows != 0]


def split_ranges(ranges: list[WorkUnit], shards: list[ShardInfo], num_slots: int,
                 units_per_slot: int) -> list[WorkUnit]:
    """Split ranges into units of about equal row count, ~``units_per_slot`` per slot.

    Each range gets its row share of ``num_slots * units_per_slot`` units. Only data sizes
    and the slot count matter, so every slot computes the same list. Ranges of non-seekable
    shards (gzip, zstd) get only their share of ``num_slots`` units, because each unit
    starting mid-file must decompress and discard everything before it.
    Cuts snap to a nearby Parquet row-group start when there is one.
    """
    total = sum(r.rows for r in ranges if r.rows is not None)
    units = []
    for r in ranges:
        if r.rows is None:
            units.append(r)
            continue
        info = shards[r.shard]
        target = num_slots * (units_per_slot if info.seekable else 1)
        # This range's share of the target unit count, rounded up, so one big file alone
        # still yields at least one unit per slot.
        k = max(1, min(r.rows, -(-target * r.rows // max(total, 1))))
        cuts = [r.start + (i * r.rows) // k for i in range(k + 1)]
        cuts = _snap(cuts, info.boundaries, r.rows // k // 2)
        units += [WorkUnit(r.shard, a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
    return units


def _snap(cuts: list[int], boundaries: tuple[int, ...], tolerance: int) -> list[int]:
    if not boundaries or tolerance <= 0:
        return cuts
    out = [cuts[0]]
    for c in cuts[1:-1]:
        i = bisect.bisect_left(boundaries, c)
        near = [b for b in boundaries[max(0, i - 1):i + 1] if abs(b - c) <= tolerance]
        out.append(min(near, key=lambda b: abs(b - c)) if near else c)
    out.append(cuts[-1])
    return sorted(set(out))


def shuffle_units(units: list[WorkUnit], seed: int, epoch: int) -> list[WorkUnit]:
    """Units in an order that depends only on (seed, epoch)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, 0])))
    return [units[i] for i in rng.permutation(len(units))]


def cap_units(units: list[WorkUnit], cap: int) -> tuple[list[WorkUnit], int]:
    """Keep the first ``cap`` rows of ``units`` (in order); returns (kept units, total rows)."""
    if any(u.rows is None for u in units):
        raise ValueError("a per-epoch cap needs row counts, which this source does not know")
    total = sum(u.rows for u in units)
    kept, left = [], cap
    for u in units:
        if left <= 0:
            break
        kept.append(u if u.rows <= left else WorkUnit(u.shard, u.start, u.start + left))
        left -= kept[-1].rows
    return kept, total


def deal(units: list[WorkUnit], num_slots: int) -> list[list[WorkUnit]]:
    """Give each unit, in order, to the slot with the fewest rows so far (ties: lowest slot)."""
    slots: list[list[WorkUnit]] = [[] for _ in range(num_slots)]
    heap = [(0, s) for s in range(num_slots)]
    for u in units:
        load, s = heapq.heappop(heap)
        slots[s].append(u)
        heapq.heappush(heap, (load + (u.rows if u.rows is not None else 1), s))
    return slots


def merge_ranges(ranges: list[WorkUnit]) -> list[WorkUnit]:
    """Sort ranges and join the ones that touch or overlap."""
    out: list[WorkUnit] = []
    for r in sorted(ranges):
        if r.stop <= r.start:
            continue
        if out and out[-1].shard == r.shard and r.start <= out[-1].stop:
            last = out.pop()
            r = WorkUnit(r.shard, last.start, max(last.stop, r.stop))
        out.append(r)
    return out
