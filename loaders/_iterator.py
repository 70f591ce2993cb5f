"""The stateful iterator over one slot's work units for one epoch."""

from __future__ import annotations

import copy
import logging
from collections import Counter
from ._errors import ErrorPolicy, LoaderError, StateError
from ._sharding import Layout, WorkUnit
from ._shuffle import ShuffleBuffer, rng_from_state
from ._types import RawRecord

logger = logging.getLogger("loaders")

# Buffered positions further apart than this are re-read with separate range reads.
_REREAD_GAP = 256


class SlotIterator:
    """Yields normalized sample dicts; ``state_dict()`` between ``next()`` calls is exact.

    Reads its units in order, maps each record through the schema, and passes samples
    through the shuffle buffer. The state holds positions, not samples (except for
    sources without cheap random access), so it stays small.
    """

    def __init__(self, source, layout: Layout, state: dict, name: str, shard_offset: int = 0):
        self._src = source
        self._reader = source._reader
        self.layout = layout
        self.name = name
        self.shard_offset = shard_offset
        self._state_base = {k: state[k] for k in state if k not in _LIVE_KEYS}
        self.epoch = state["epoch"]
        self.units = [WorkUnit(*u) for u in state["units"]]
        self.unit_index, self.next_pos = state["cursor"]
        self.policy = ErrorPolicy(source.on_error, Counter(state["errors"]))
        self.yielded = state["yielded"]
        self.finished = state["finished"]
        self._rng = rng_from_state(state["rng"])
        self.buffer = ShuffleBuffer(source.shuffle_buffer, self._rng) if source.shuffle_buffer > 0 else None
        if state["buffer"]:
            self.buffer.items = self._restore_buffer(state)
        self._gen = self._run()

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return next(self._gen)

    @property
    def error_counts(self) -> dict[str, int]:
        """Bad inputs skipped so far in this epoch, by kind."""
        return dict(self.policy.counts)

    def state_dict(self) -> dict:
        """Position after the last sample returned by ``next`` (see ``Source.state_dict``)."""
        items = self.buffer.items if self.buffer is not None else []
        state = dict(self._state_base)
        state.update(
            units=[u.to_list() for u in self.units],
            cursor=[self.unit_index, self.next_pos],
            buffer=[list(ref) for ref, _ in items],
            buffer_samples=None if self._reader.random_access else copy.deepcopy([s for _, s in items]),
            rng=self._rng.bit_generator.state,
            yielded=self.yielded,
            errors=dict(self.policy.counts),
            finished=self.finished,
        )
        return state

    def make_sample(self, raw: RawRecord, shard: int, policy: ErrorPolicy) -> dict | None:
        """Map one raw record to the normalized sample dict; None when skipped as bad."""
        try:
            if raw.error is not None:
                raise raw.error
            m = self._src._schema(raw)
        except LoaderError as e:
            policy.handle(e)
            return None
        return normalized_sample(raw, m, shard + self.shard_offset, self.name)

    def _run(self):
        while self.unit_index < len(self.units):
            unit = self.units[self.unit_index]
            for raw in self._reader.read(unit.shard, self.next_pos, unit.stop):
                # State is updated before the yield, so a state_dict taken while suspended
                # at the yield describes exactly "everything up to this sample".
                self.next_pos = raw.position + 1
                sample = self.make_sample(raw, unit.shard, self.policy)
                if sample is None:
                    continue
                if self.buffer is not None:
                    out = self.buffer.push(((unit.shard, raw.position), sample))
                    if out is None:
                        continue
                    sample = out[1]
                self.yielded += 1
                yield sample
            self.unit_index += 1
            if self.unit_index < len(self.units):
                self.next_pos = self.units[self.unit_index].start
        while self.buffer:
            sample = self.buffer.pop()[1]
            self.yielded += 1
            yield sample
        self.finished = True
        self._log_epoch_end()

    def _log_epoch_end(self) -> None:
        counts = self._src._index_counts + self.policy.counts
        lay = self.layout
        where = f"source {self.name!r} epoch {self.epoch} rank {lay.rank}/{lay.world_size} worker {lay.worker_id}"
        if counts:
            logger.warning("%s: skipped bad inputs %s (%d samples delivered)", where, dict(counts), self.yielded)
        else:
            logger.debug("%s: done, %d samples, no bad inputs", where, self.yielded)

    def _restore_buffer(self, state: dict) -> list:
        refs = [tuple(r) for r in state["buffer"]]
        if not self._reader.random_access:
            return [(ref, sample) for ref, sample in zip(refs, copy.deepcopy(state["buffer_samples"]))]
        found = {}
        strict = ErrorPolicy("raise")
        for shard in sorted({s for s, _ in refs}):
            positions = sorted(p for s, p in refs if s == shard)
            wanted = set(positions)
            for lo, hi in reread_runs(positions):
                for raw in self._reader.read(shard, lo, hi + 1):
                    if raw.position in wanted:
                        try:
                            found[(shard, raw.position)] = self.make_sample(raw, shard, strict)
                        except LoaderError as e:
                            raise StateError(f"cannot re-read a buffered sample ({e}); did the data change?") from e
        lost = [r for r in refs if r not in found]
        if lost:
            raise StateError(f"buffered samples {lost[:5]} are no longer in the data; did the files change?")
        return [(ref, found[ref]) for ref in refs]


# Keys of a slot state that change while iterating (the rest is copied through).
_LIVE_KEYS = ("units", "cursor", "buffer", "buffer_samples", "rng", "yielded", "errors", "finished")


def reread_runs(positions: list[int]) -> list[tuple[int, int]]:
    """``(first, last)`` record positions (inclusive) of the runs to read again for the sorted ``positions``:
    neighbours at most ``_REREAD_GAP`` records apart share a run (one read instead of many seeks)."""
    out = []
    for p in positions:
        if out and p - out[-1][1] <= _REREAD_GAP:
            out[-1] = (out[-1][0], p)
        else:
            out.append((p, p))
    return out


def normalized_sample(raw: RawRecord, mapped, global_shard: int, source: str) -> dict:
    """The normalized sample dict of one mapped record: ``sample_id`` is
    ``(global_shard << 32) | position``; ``image_sizes`` and ``messages`` only when known."""
    sample = {
        "sample_id": (global_shard << 32) | raw.position,
        "key": raw.key,
        "inputs": mapped.inputs,
        "targets": mapped.targets,
        "task": mapped.task,
        "images": mapped.images,
    }
    if mapped.image_sizes is not None:
        sample["image_sizes"] = [tuple(s) for s in mapped.image_sizes]
    if mapped.messages is not None:
        sample["messages"] = mapped.messages
    sample["source"] = source
    sample["meta"] = mapped.meta
    return sample
