"""Weighted, capped, resumable mixture of sources (FLAN-style task mixing)."""

from __future__ import annotations

import copy
import logging
from collections import Counter

import numpy as np

from ._errors import StateError
from ._iterator import SlotIterator
from ._sharding import Layout
from ._shuffle import make_rng, rng_from_state
from ._source import Source, StatefulDataset
from ._state import STATE_VERSION, check_layout

logger = logging.getLogger("loaders")

_MIX_TAG, _MIX_REDEALT_TAG = 3, 4


class Mixture(StatefulDataset):
    """Interleave named sources: each next sample comes from source ``n`` with probability
    ``weights[n] / sum(weights of sources not yet exhausted)``.

    - ``weights``: mixing rates (any positive scale). Default: proportional to each source's
      (capped) row count, i.e. examples-proportional mixing; equal when counts are unknown.
    - ``caps``: ``{name: n}`` keeps at most ``n`` examples of that source per epoch (a
      different subset each epoch when the source shuffles); cuts are logged and
      available from ``cap_report()``.
    - When a source runs out, mixing continues over the rest with renormalized weights
      until all are exhausted, so an epoch still delivers every (capped) sample exactly once.
    - ``sample_id`` stays unique across sources: each source's shard indices are shifted
      by the shard counts of the sources listed before it; ``"source"`` is the mixture name.
    - Layout arguments as for ``Source``; the sources' own layout arguments are ignored.
    """

    def __init__(self, sources: dict[str, Source], weights: dict[str, float] | None = None,
                 caps: dict[str, int] | None = None, *, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, worker_id: int | None = None,
                 num_workers: int | None = None):
        super().__init__()
        self.names = list(sources)
        caps = dict(caps or {})
        unknown = (set(weights or {}) | set(caps)) - set(self.names)
        if not self.names or unknown:
            raise ValueError(f"mixture needs sources; unknown names in weights/caps: {sorted(unknown)}")
        self._children: dict[str, Source] = {}
        for name, src in sources.items():
            child = copy.copy(src)
            child._pending, child._iterator = None, None
            if name in caps:
                if src.num_rows is None:
                    raise ValueError(f"cap for {name!r} needs known row counts")
                child.max_samples_per_epoch = int(caps[name])
            self._children[name] = child
        self.caps = caps
        if weights is None:
            rows = [self._rows(n) for n in self.names]
            weights = dict(zip(self.names, rows)) if None not in rows else dict.fromkeys(self.names, 1.0)
        missing = [n for n in self.names if n not in weights]
        if missing or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"weights must be >= 0 for every source (missing: {missing}) with a positive sum")
        self.weights = {n: float(weights[n]) for n in self.names}
        self.seed = int(seed)
        self._layout_args = (rank, world_size, worker_id, num_workers)
        offsets, total = {}, 0
        for name in self.names:
            offsets[name], total = total, total + self._children[name].num_shards
        self._offsets = offsets
        self.epoch = 0
        self._pending: dict | None = None
        self._iterator: MixtureIterator | None = None

    def _rows(self, name: str) -> int | None:
        child = self._children[name]
        rows = child.num_rows
        if rows is None or child.max_samples_per_epoch is None:
            return rows
        return min(rows, child.max_samples_per_epoch)

    @property
    def sources(self) -> dict[str, Source]:
        """The mixed sources (copies carrying the caps), by name."""
        return dict(self._children)

    @property
    def shard_ranges(self) -> dict[str, tuple[int, int]]:
        """``{name: (first, end)}``: the global shard indices of each source in ``sample_id`` s."""
        return {n: (self._offsets[n], self._offsets[n] + self._children[n].num_shards) for n in self.names}

    @property
    def num_shards(self) -> int:
        """Shards over all sources."""
        return sum(c.num_shards for c in self._children.values())

    @property
    def supports_random_access(self) -> bool:
        """Whether every source re-reads samples by ``sample_id`` cheaply."""
        return all(c.supports_random_access for c in self._children.values())

    map_style = False

    def fingerprint(self) -> dict[str, str]:
        """``{name: Source.fingerprint()}`` of the mixed sources."""
        return {n: c.fingerprint() for n, c in self._children.items()}

    @property
    def num_rows(self) -> int | None:
        """Rows delivered per epoch (after caps); None when a source's size is unknown."""
        rows = [self._rows(n) for n in self.names if self.weights[n] > 0]
        return None if None in rows else sum(rows)

    @property
    def error_counts(self) -> dict[str, int]:
        """Skipped bad inputs by kind, summed over the sources (this process only)."""
        total = Counter()
        for name, child in self._children.items():
            total.update(child._index_counts)
            if self._iterator is not None:
                total.update(self._iterator.children[name].policy.counts)
        return dict(total)

    def cap_report(self) -> dict[str, dict[str, int]]:
        """``{name: {"kept": n, "total": m}}`` for every capped source."""
        return {n: self._children[n].cap_report() for n in self.caps}

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch for the mixing draws and every source."""
        if self._pending is not None and self._pending["epoch"] != epoch:
            self._pending = None
        self.epoch = int(epoch)

    def _open(self, layout: Layout, consume: bool = True) -> MixtureIterator:
        state = self._pending
        if consume:
            self._pending = None
        for name in self.names:
            self._children[name].epoch = self.epoch
        if state is None or state["type"] == "mixture_global":
            tag = _MIX_TAG if state is None else _MIX_REDEALT_TAG
            rng = make_rng(self.seed, self.epoch, layout.slot, layout.num_slots, tag).bit_generator.state
            active = [n for n in self.names if self.weights[n] > 0]
            counts = dict.fromkeys(self.names, 0)
            child_states = state["children"] if state else dict.fromkeys(self.names)
            if layout.slot == 0:
                for name, rep in self.cap_report().items():
                    logger.info("mixture: %r capped at %d of %d examples in epoch %d",
                                name, rep["kept"], rep["total"], self.epoch)
        else:
            check_layout(state, layout.to_list())
            rng, active, counts, child_states = state["rng"], state["active"], state["counts"], state["children"]
        children = {
            n: self._children[n].open_iterator(layout, copy.deepcopy(child_states[n]), name=n,
                                               shard_offset=self._offsets[n])
            for n in self.names
        }
        return MixtureIterator(self, layout, children, rng, list(active), dict(counts))

    def __iter__(self) -> MixtureIterator:
        self._iterator = self._open(self.layout())
        return self._iterator

    def state_dict(self) -> dict:
        """Mixing RNG, exhausted sources, counts and every source's state (see ``Source.state_dict``)."""
        if self._iterator is not None and self._iterator.epoch == self.epoch:
            return self._iterator.state_dict()
        return self._open(self.layout(), consume=False).state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()`` of the same slot or ``merge_states`` of all slots."""
        if not isinstance(state, dict) or state.get("type") not in ("mixture", "mixture_global"):
            raise StateError(f"not a mixture state: type {state.get('type') if isinstance(state, dict) else state!r}")
        if state.get("version") != STATE_VERSION or state["names"] != self.names:
            raise StateError(f"mixture state is for sources {state.get('names')}, this mixture has {self.names}")
        if state["seed"] != self.seed or state.get("weights", self.weights) != self.weights:
            raise StateError("mixture state was saved with a different seed or weights")
        for name in self.names:
            self._children[name]._check(state["children"][name])
        self.epoch = state["epoch"]
        self._pending = copy.deepcopy(state)
        self._iterator = None


class MixtureIterator:
    """Draws the source of each next sample; exact ``state_dict()`` between ``next`` calls."""

    def __init__(self, mixture: Mixture, layout: Layout, children: dict[str, SlotIterator],
                 rng_state: dict, active: list[str], counts: dict[str, int]):
        self._mix = mixture
        self.layout = layout
        self.epoch = mixture.epoch
        self.children = children
        self.active = active
        self.counts = counts
        self._rng = rng_from_state(rng_state)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        weights = self._mix.weights
        while self.active:
            w = np.array([weights[n] for n in self.active])
            cum = np.cumsum(w / w.sum())
            i = min(int(np.searchsorted(cum, self._rng.random(), side="right")), len(self.active) - 1)
            name = self.active[i]
            try:
                sample = next(self.children[name])
            except StopIteration:
                self.active.pop(i)
                logger.info("mixture: %r exhausted after %d samples (epoch %d, slot %d); "
                            "continuing with %s", name, self.counts[name], self.epoch,
                            self.layout.slot, self.active)
                continue
            self.counts[name] += 1
            return sample
        raise StopIteration

    def state_dict(self) -> dict:
        """The mixture's position; its ``children`` hold each source's slot state."""
        return {
            "version": STATE_VERSION,
            "type": "mixture",
            "names": self._mix.names,
            "seed": self._mix.seed,
            "weights": dict(self._mix.weights),
            "epoch": self.epoch,
            "layout": self.layout.to_list(),
            "rng": self._rng.bit_generator.state,
            "active": list(self.active),
            "counts": dict(self.counts),
            "children": {n: it.state_dict() for n, it in self.children.items()},
        }
