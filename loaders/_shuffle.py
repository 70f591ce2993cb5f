"""Bounded shuffle buffer with a seeded, serializable random state."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np


def make_rng(*keys: int) -> np.random.Generator:
    """A PCG64 generator seeded from integer keys, e.g. (seed, epoch, slot, purpose)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(keys))))


def rng_from_state(state: dict) -> np.random.Generator:
    """A generator continuing from a saved ``bit_generator.state`` (copied, not shared)."""
    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = copy.deepcopy(state)
    return rng


class ShuffleBuffer:
    """Holds up to ``size`` items; once full, each new item evicts a random one.

    Items are ``(ref, sample)`` pairs; ``ref`` = (shard, position) lets a state dict store
    where the buffered samples came from instead of the samples themselves. The order of
    ``items`` matters for the next draws and is part of the state.
    """

    def __init__(self, size: int, rng: np.random.Generator):
        self.size = size
        self.rng = rng
        self.items: list[tuple[tuple[int, int], Any]] = []

    def __len__(self) -> int:
        return len(self.items)

    def push(self, item):
        """Add ``item``; return an evicted item once the buffer is full, else None."""
        if len(self.items) < self.size:
            self.items.append(item)
            return None
        j = int(self.rng.integers(len(self.items)))
        out, self.items[j] = self.items[j], item
        return out

    def pop(self):
        """Remove and return a random item (used to drain at the end of the data)."""
        j = int(self.rng.integers(len(self.items)))
        out = self.items[j]
        self.items[j] = self.items[-1]
        self.items.pop()
        return out
