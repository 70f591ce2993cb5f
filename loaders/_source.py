"""``Source``: a sharded, shuffled, resumable stream of normalized samples from one reader."""

from __future__ import annotations

import copy
import inspect
import logging
from collections import Counter
from collections.abc import Callable

from torch.utils.data import IterableDataset

from ._errors import ErrorPolicy
from ._fingerprints import file_fingerprints
from ._iterator import SlotIterator
from ._schema import Schema
from ._sharding import Layout, WorkUnit, cap_units, deal, shuffle_units, split_ranges, whole_shards
from ._shuffle import make_rng
from ._state import STATE_VERSION, check_layout, check_state
from ._types import ShardInfo, ShardReader

logger = logging.getLogger("loaders")

# make_rng purpose tags: keep the streams of different uses independent.
_FRESH, _REDEALT = 1, 2


#: `Source.fresh`'s default: the option stays as it is (None is a value: no cap).
KEEP = object()


class StatefulDataset(IterableDataset):
    """What ``Source`` and ``Mixture`` share: layout arguments, epoch, pending state."""

    _layout_args: tuple = (None, None, None, None)
    _pending: dict | None = None
    _iterator = None

    def with_layout(self, *, rank=None, world_size=None, worker_id=None, num_workers=None):
        """A copy reading the slot (rank, worker) given explicitly; shares the file index."""
        other = copy.copy(self)
        other._layout_args = (rank, world_size, worker_id, num_workers)
        other._pending = copy.deepcopy(self._pending)
        other._iterator = None
        return other

    def layout(self) -> Layout:
        """The slot read when iterating here and now (explicit args, else torch defaults)."""
        return Layout.resolve(*self._layout_args)

    def __getstate__(self):
        # An active iterator holds open generators; DataLoader workers start without it.
        d = self.__dict__.copy()
        d["_iterator"] = None
        return d

    # -- random access -------------------------------------------------------------

    def read(self, sample_ids) -> list[dict]:
        """The normalized samples with these ``sample_id`` s, in the given order (KeyError for an
        unknown id); same dicts as iterating yields. The reader is opened on first use (see
        `loaders.open_access` for what each format costs)."""
        from ._access import open_access

        if getattr(self, "_access", None) is None:
            self._access = open_access(self)
        return self._access.read(sample_ids)

    def fresh(self, *, shuffle=KEEP, shuffle_buffer=KEEP, seed=KEEP, max_samples_per_epoch=KEEP, on_error=KEEP):
        """A copy without a loaded state, positioned at the start of its epoch, with the options given
        changed (`KEEP`, the default: as they are; ``max_samples_per_epoch=None`` lifts a cap; e.g.
        ``fresh(shuffle=False, shuffle_buffer=0)`` reads in file order)."""
        other = copy.copy(self)
        other._pending, other._iterator = None, None
        changes = {"shuffle": shuffle, "shuffle_buffer": shuffle_buffer, "seed": seed,
                   "max_samples_per_epoch": max_samples_per_epoch, "on_error": on_error}
        for key, value in changes.items():
            if value is not KEEP:
                setattr(other, key, value)
        return other



class Source(StatefulDataset):
    """Iterable of normalized sample dicts read from one ``ShardReader``.

    Each iterator covers one slot (rank x DataLoader worker) for the current epoch;
    the union over all slots is every sample exactly once. Options (all keyword):

    - ``name``: the ``"source"`` field of every sample (default: the format name).
    - ``mapping``, ``image_root``, ``check_images``: see ``Schema``.
    - ``on_error``: ``"raise"`` (default) or ``"skip"``; skipped inputs are counted in
      ``error_counts`` and logged (logger ``"loaders"``) at the end of each epoch.
    - ``shuffle``: shuffle the work-unit order by (seed, epoch). ``shuffle_buffer``: samples
      held for within-slot shuffling (0 = none). ``seed``: base seed for both.
    - ``units_per_slot``: work units per slot (more = better balance, more seeks).
    - ``max_samples_per_epoch``: cut each epoch at this many rows, taken from the
      (shuffled) unit order, so a different subset is used each epoch.
    - ``rank``/``world_size``: default to ``torch.distributed`` when initialized, else 0/1;
      ``worker_id``/``num_workers``: default to ``torch.utils.data.get_worker_info()``.
    """

    def __init__(
        self,
        reader: ShardReader,
        *,
        name: str | None = None,
        mapping: str | dict | Callable = "auto",
        image_root: str | None = None,
        check_images: bool = True,
        on_error: str = "raise",
        shuffle: bool = False,
        shuffle_buffer: int = 0,
        seed: int = 0,
        units_per_slot: int = 4,
        max_samples_per_epoch: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        worker_id: int | None = None,
        num_workers: int | None = None,
    ):
        super().__init__()
        if shuffle_buffer < 0 or units_per_slot < 1:
            raise ValueError("shuffle_buffer must be >= 0 and units_per_slot >= 1")
        self._reader = reader
        self.name = name or reader.default_name
        self._schema = Schema(mapping, image_root, check_images)
        self._schema.storage = getattr(reader, "storage", None)
        self.on_error = ErrorPolicy(on_error).on_error
        self.shuffle = bool(shuffle)
        self.shuffle_buffer = int(shuffle_buffer)
        self.seed = int(seed)
        self.units_per_slot = int(units_per_slot)
        self.max_samples_per_epoch = max_samples_per_epoch
        if max_samples_per_epoch is not None and self.num_rows is None:
            raise ValueError(f"source {self.name!r}: max_samples_per_epoch needs known row counts")
        self._layout_args = (rank, world_size, worker_id, num_workers)
        self.epoch = 0
        self._pending: dict | None = None
        self._iterator: SlotIterator | None = None
        policy = ErrorPolicy(on_error)
        for err in reader.index_errors:
            policy.handle(err)
            logger.warning("source %r: skipping damaged input: %s", self.name, err)
        self._index_counts: Counter = policy.counts

    # -- description -------------------------------------------------------------

    @property
    def shards(self) -> list[ShardInfo]:
        """The shards (files), in sample-id order."""
        return self._reader.shards

    @property
    def num_shards(self) -> int:
        """Number of shards (files, or HF data shards)."""
        return len(self._reader.shards)

    @property
    def supports_random_access(self) -> bool:
        """Whether re-reading a few samples by ``sample_id`` is cheap (False for streaming HF
        datasets, which re-stream from the shard start)."""
        return bool(self._reader.random_access)

    @property
    def map_style(self) -> bool:
        """Whether the data is map-style (Parquet, Arrow IPC or a HF ``datasets.Dataset``): row
        counts are known up front and any row is read without a scan."""
        from ._arrow import ArrowIPCReader, ParquetReader
        from ._hf import HFDatasetReader

        return isinstance(self._reader, (ParquetReader, ArrowIPCReader, HFDatasetReader))

    def fingerprint(self) -> str:
        """Hash of the shard list (names, sizes, row counts; version tags of remote files): equal
        fingerprints mean the same data for states and length indices."""
        return self._reader.fingerprint()

    @property
    def num_rows(self) -> int | None:
        """Total positions over all shards (JSONL lines, rows, tar samples); None if unknown."""
        rows = [s.num_rows for s in self._reader.shards]
        return None if any(r is None for r in rows) else sum(rows)

    @property
    def error_counts(self) -> dict[str, int]:
        """Skipped bad inputs by kind: found while indexing plus in this process's current epoch.

        With DataLoader workers each worker counts its own (they are logged per worker).
        """
        counts = Counter(self._index_counts)
        if self._iterator is not None:
            counts.update(self._iterator.policy.counts)
        return dict(counts)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, shards={self.num_shards}, "
                f"rows={self.num_rows}, epoch={self.epoch})")

    # -- layout and planning -----------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (changes unit order, shuffle buffer draws and capped subset)."""
        if self._pending is not None and self._pending["epoch"] != epoch:
            # Not a warning: with DataLoader workers the main process never consumes the state.
            logger.info("source %r: set_epoch(%d) drops the loaded state of epoch %d",
                        self.name, epoch, self._pending["epoch"])
            self._pending = None
        self.epoch = int(epoch)

    def _all_units(self, num_slots: int, epoch: int) -> list[WorkUnit]:
        units = split_ranges(whole_shards(self.shards), self.shards, num_slots, self.units_per_slot)
        if self.shuffle:
            units = shuffle_units(units, self.seed, epoch)
        if self.max_samples_per_epoch is not None:
            units, _ = cap_units(units, self.max_samples_per_epoch)
            # The cut can leave fewer (coarse) units than slots: split what is kept again.
            units = split_ranges(units, self.shards, num_slots, self.units_per_slot)
        return units

    def plan(self, layout: Layout | None = None, epoch: int | None = None) -> list[WorkUnit]:
        """The work units one slot reads in an epoch (fresh start), in reading order."""
        layout = layout or self.layout()
        units = self._all_units(layout.num_slots, self.epoch if epoch is None else epoch)
        return deal(units, layout.num_slots)[layout.slot]

    def cap_report(self) -> dict[str, int] | None:
        """``{"kept": n, "total": m}`` rows per epoch when ``max_samples_per_epoch`` cuts; else None."""
        if self.max_samples_per_epoch is None:
            return None
        total = self.num_rows
        return {"kept": min(total, self.max_samples_per_epoch), "total": total}

    # -- state -------------------------------------------------------------------

    def _settings(self) -> dict:
        return {
            "name": self.name,
            "fingerprint": self.fingerprint(),
            "files": file_fingerprints(self),
            "num_shards": self.num_shards,
            "num_rows": self.num_rows,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer": self.shuffle_buffer,
            "units_per_slot": self.units_per_slot,
            "cap": self.max_samples_per_epoch,
        }

    def _start_state(self, layout: Layout, units: list[WorkUnit], tag: int, errors=None) -> dict:
        state = self._settings()
        state.update(
            version=STATE_VERSION, type="slot", epoch=self.epoch, layout=layout.to_list(),
            units=[u.to_list() for u in units], cursor=[0, units[0].start if units else 0],
            buffer=[], buffer_samples=None, yielded=0, errors=dict(errors or {}), finished=False,
            rng=make_rng(self.seed, self.epoch, layout.slot, layout.num_slots, tag).bit_generator.state,
        )
        return state

    def _initial_state(self, layout: Layout) -> dict:
        pending = self._pending
        if pending is None:
            return self._start_state(layout, self.plan(layout), _FRESH)
        if pending["type"] == "slot":
            check_layout(pending, layout.to_list())
            return copy.deepcopy(pending)
        # A global state: deal the remaining ranges to this layout's slots.
        ranges = [WorkUnit(*r) for r in pending["remaining"]]
        units = split_ranges(ranges, self.shards, layout.num_slots, self.units_per_slot)
        if self.shuffle:
            units = shuffle_units(units, self.seed, self.epoch)
        mine = deal(units, layout.num_slots)[layout.slot]
        # Carried-over error counts go to slot 0 only, so summing slots stays right.
        return self._start_state(layout, mine, _REDEALT, pending["errors"] if layout.slot == 0 else None)

    def open_iterator(self, layout: Layout, state: dict | None = None, name: str | None = None,
                      shard_offset: int = 0) -> SlotIterator:
        """An iterator for ``layout`` from ``state`` (or this source's pending/fresh state).

        ``name`` overrides the ``"source"`` field and ``shard_offset`` shifts shard indices in
        ``sample_id`` (both used by ``Mixture`` to keep ids unique across sources).
        """
        if state is None:
            state = self._initial_state(layout)
            self._pending = None
        else:
            self._check(state)
            if state["type"] == "slot":
                check_layout(state, layout.to_list())
            else:
                saved, self._pending = self._pending, state
                state = self._initial_state(layout)
                self._pending = saved
        return SlotIterator(self, layout, state, name or self.name, shard_offset)

    def __iter__(self) -> SlotIterator:
        self._iterator = self.open_iterator(self.layout())
        return self._iterator

    def state_dict(self) -> dict:
        """Exact position of this slot's stream: resume with ``load_state_dict``.

        Taken between samples, it makes a resumed iterator yield exactly the rest of the
        stream (shuffle buffer included). The buffer is stored as (shard, position) refs and
        re-read on resume; sources without cheap random access store the samples instead.
        Combine all slots' states with ``merge_states`` to resume on another world layout.
        """
        if self._iterator is not None and self._iterator.epoch == self.epoch:
            return self._iterator.state_dict()
        return copy.deepcopy(self._initial_state(self.layout()))

    def _check(self, state: dict) -> None:
        check_state(state, self._settings(), ("slot", "global"), self)

    def load_state_dict(self, state: dict) -> None:
        """Resume from a ``state_dict()`` of the same slot, or from ``merge_states(...)``.

        Raises ``StateError`` when the state belongs to other files, seed, settings, or
        (for a per-slot state) another rank/world size.
        """
        self._check(state)
        if state["type"] == "slot":
            rank, world_size = state["layout"][:2]
            here = Layout.resolve(*self._layout_args[:2], 0, 0)
            if (here.rank, here.world_size) != (rank, world_size):
                check_layout(state, [here.rank, here.world_size, *state["layout"][2:]])
        self.epoch = state["epoch"]
        self._pending = copy.deepcopy(state)
        self._iterator = None


def with_source_options(fn):
    """Give ``fn`` (a source's ``__init__`` or `loaders.open_source`, whose ``**options`` it hands to
    `Source.__init__` unchanged) the signature a reader sees: its own parameters, then every
    keyword-only option of `Source.__init__` by name, default and annotation. The options are
    declared once, on `Source`; ``help()`` and ``inspect.signature`` show each one, and a keyword
    `Source` does not take is still refused there by name."""
    own = inspect.signature(fn)
    params = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    names = {p.name for p in params}
    params += [p for p in inspect.signature(Source.__init__).parameters.values()
               if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in names]
    fn.__signature__ = own.replace(parameters=params)
    return fn
