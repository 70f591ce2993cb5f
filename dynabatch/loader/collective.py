"""The one small collective the streaming planner needs: every rank shares a few numbers.

`Collective.all_gather(values)` takes this rank's float64 vector of ``k`` numbers and returns the
``[world_size, k]`` matrix of every rank's vector (counts and seconds: small integers are exact in
float64). Three implementations:

* `LocalCollective`: one rank, no communication.
* `TorchCollective`: ``torch.distributed``. Each rank writes its vector into its own slot of a
  zero ``[world_size * k]`` tensor and one ``all_reduce(SUM)`` fills every slot, so it works on
  every backend. It runs on a dedicated gloo group: the planner calls it from a background thread
  while training issues its own collectives on the default group, and two threads issuing
  collectives on one group could interleave differently on different ranks.
* `ThreadCollective`: several ranks in one process (one thread each), for tests and single-host
  experiments; ``ThreadCollective.create(world_size)`` returns one handle per rank.
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Collective(Protocol):
    """What the streaming planner needs from the communication layer."""

    rank: int
    world_size: int

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        """Every rank's ``values`` (same length on all ranks) as a float64 ``[world_size, k]`` array."""
        ...


class LocalCollective:
    """The trivial collective of a single rank."""

    rank = 0
    world_size = 1

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(values, np.float64).reshape(1, -1).copy()


class TorchCollective:
    """``torch.distributed`` collective on a dedicated group (see the module docstring).

    Construct it on every rank at the same point of the program (creating a group is itself a
    collective call); ``group`` overrides the dedicated gloo group.
    """

    def __init__(self, group=None):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TorchCollective needs an initialized torch.distributed process group")
        self._dist = dist
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        import torch

        v = np.asarray(values, np.float64).ravel()
        k = len(v)
        buf = torch.zeros(self.world_size * k, dtype=torch.float64)
        buf[self.rank * k:(self.rank + 1) * k] = torch.from_numpy(v)
        if self._dist.get_backend(self.group) == "nccl":  # only reached with a user-given nccl group
            buf = buf.cuda()
        self._dist.all_reduce(buf, op=self._dist.ReduceOp.SUM, group=self.group)
        return buf.cpu().numpy().reshape(self.world_size, k)

    def __getstate__(self):
        raise TypeError("TorchCollective cannot be pickled (it holds a process group)")


class _ThreadShared:
    def __init__(self, world_size: int, timeout: float):
        self.slots: list = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout)


class ThreadCollective:
    """In-process fake: ``world_size`` ranks, one thread each, exchanging through shared memory.

    ``timeout`` (seconds) breaks the exchange with an error instead of hanging when a rank never
    arrives (a bug in the caller, or a rank that raised).
    """

    def __init__(self, rank: int, world_size: int, shared: _ThreadShared):
        self.rank = rank
        self.world_size = world_size
        self._shared = shared

    @classmethod
    def create(cls, world_size: int, timeout: float = 120.0) -> list["ThreadCollective"]:
        """One handle per rank, all sharing one exchange."""
        shared = _ThreadShared(world_size, timeout)
        return [cls(r, world_size, shared) for r in range(world_size)]

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        sh = self._shared
        try:
            sh.slots[self.rank] = np.asarray(values, np.float64).ravel().copy()
            sh.barrier.wait()  # everyone has written
            out = np.stack(sh.slots)
            sh.barrier.wait()  # everyone has read: the slots may be reused
        except threading.BrokenBarrierError:
            raise RuntimeError(f"ThreadCollective: rank {self.rank} waited for the other ranks in vain "
                               "(a rank stopped or took a different number of steps)") from None
        return out

    def abort(self) -> None:
        """Break the exchange (wakes the other ranks with an error)."""
        self._shared.barrier.abort()

    def __getstate__(self):
        raise TypeError("ThreadCollective only works inside one process")
