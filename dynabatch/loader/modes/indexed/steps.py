"""Indexed mode: a length index of every sample, one global plan per step computed identically on
every rank, and random access to this rank's samples.

Every rank holds the same length index (`LengthIndex`: the Shapes columns, sorted by
``sample_id``, plus the loss-label count of each sample). Epoch ``e``'s global batches and each
step's plan come from `dynabatch.core.plan.steps` (the functions ``dynabatch plan`` uses): cut by token
count only, so their membership does not depend on the world size; a rank keeps its own
micro-batches and loads only their samples. Nothing is communicated, so the plan is the same everywhere by construction.

Resuming on another world size re-plans the not-yet-consumed global batches on the new world
size; a step that was half done when the checkpoint was taken is re-planned without the samples
already consumed (the merged states of all ranks say which).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from ....core.cost.model import CostModel
from ....core.options import PlanOptions
from ....core.plan.steps import global_batches, num_global_batches, plan_step
# The length index, its scan and the token cache live in `dynabatch.index`; re-exported here for the loader.
from ....index import (LABEL_COLUMN, SETTINGS_KEY, TOKEN_COLUMNS,  # noqa: F401
                     TOKEN_SETTINGS_KEY, LengthIndex, TokenCache, derived_labels, encode_all, index_settings,
                     read_index, read_index_table, scan_source, token_cache_bytes, write_index)
from ...records import (CollateConfig, ReadyStep, StepPlan, Timer, collate_step, encode_samples,
                            label_counts, rank_step)
from ...ahead import Ahead, ProcessAhead

logger = logging.getLogger("dynabatch")


def load_index(index, family: str, max_len: int | None = None, max_target_len: int | None = None,
               bos: int = 0) -> LengthIndex:
    """`dynabatch.index.read_index` sorted by ``sample_id``, with label counts for ``family``."""
    return read_index(index, family=family, max_len=max_len, max_target_len=max_target_len, bos=bos)


def write_index_table(table, path) -> None:
    """`dynabatch.index.write_index` (atomic, with the integrity record)."""
    write_index(table, path)


def index_rank_step(index: LengthIndex, plan, pos: np.ndarray, rank: int, *, epoch: int, step_in_epoch: int,
                    rank_map: np.ndarray | None = None) -> StepPlan:
    """`rank_step` of a global plan whose samples sit at index positions ``pos``, with what the
    indexed and replay modes add: the step's label tokens, its `Shapes` and this rank's positions."""
    sp = rank_step(plan, rank, epoch=epoch, step_in_epoch=step_in_epoch, rank_map=rank_map,
                   step_target_tokens=int(index.label_tokens[pos].sum()))
    ids = sp.sample_ids()
    positions = index.positions(ids) if len(ids) else np.zeros(0, np.int64)
    return replace(sp, shapes=index.shapes.take(pos), positions=positions)


class IndexedPlanner:
    """Global batches of each epoch and their plans (see the module docstring), made by the same
    `dynabatch.core.plan.steps` functions ``dynabatch plan`` uses, from ``options`` (a `PlanOptions`
    whose ``num_ranks`` is the loader's world size)."""

    def __init__(self, index: LengthIndex, cost: CostModel, options: PlanOptions):
        options.require_batch()
        self.index = index
        self.cost = cost
        self.options = options
        self._cache: dict[int, list[np.ndarray]] = {}
        self._counts: dict[int, int] = {}

    # -- global batches ----------------------------------------------------------------------
    def batches(self, epoch: int) -> list[np.ndarray]:
        """Index positions of each global batch of ``epoch``."""
        if epoch not in self._cache:
            parts = global_batches(self.index.shapes, self.cost, self.options, epoch)
            if len(self._cache) >= 2:
                self._cache.pop(next(iter(self._cache)))
            self._cache[epoch] = parts
            self._counts[epoch] = len(parts)
        return self._cache[epoch]

    def num_steps(self, epoch: int) -> int:
        """Steps (global batches) in ``epoch``."""
        if epoch not in self._counts:
            n = num_global_batches(len(self.index), self.options)
            if n is None:
                self.batches(epoch)
            else:
                self._counts[epoch] = n
        return self._counts[epoch]

    def first_step(self, epoch: int) -> int:
        """Global step number of ``epoch``'s first step (steps count from 0 across epochs)."""
        return sum(self.num_steps(e) for e in range(epoch))

    # -- plans -------------------------------------------------------------------------------
    def plan(self, epoch: int, k: int, rank: int, exclude: np.ndarray | None = None) -> StepPlan:
        """This rank's plan of step ``k`` of ``epoch``; ``exclude``: sample ids already consumed
        (a step resumed half-way on another world size)."""
        with Timer() as t:
            pos = self.batches(epoch)[k]
            if exclude is not None and len(exclude):
                pos = pos[~np.isin(self.index.shapes.sample_id[pos], exclude)]
            plan, rank_map = self.plan_global(pos, self.first_step(epoch) + k)
            sp = index_rank_step(self.index, plan, pos, rank, epoch=epoch, step_in_epoch=k, rank_map=rank_map)
        return replace(sp, plan_time_s=t.s)

    def plan_global(self, pos: np.ndarray, step: int):
        """The global `BatchPlan` of the samples at index positions ``pos`` (all ranks), and the map
        from the plan's ranks to loader ranks (None when they are the same)."""
        plan = plan_step(self.index.shapes, self.cost, self.options, pos, step)
        return plan, (None if plan.num_ranks == self.options.num_ranks else np.arange(plan.num_ranks))


class IndexedSteps:
    """Steps of one epoch for one rank, planned ahead in a thread, loaded and collated.

    An `torch.utils.data.IterableDataset` in spirit: with DataLoader workers, worker ``w`` of
    ``n`` produces the steps ``start + w, start + w + n, ...``; the main process puts them back in
    order. ``plan_ahead`` is how many steps the planning thread runs ahead of loading.
    """

    def __init__(self, planner, access, formatter, collate: CollateConfig, *, rank: int, vision=None,
                 load_pixels: bool = False, on_error: str = "raise", plan_ahead: int = 2, exact_labels: bool = True,
                 tokens: TokenCache | None = None, plan_processes: int = 0):
        self.planner = planner
        self.plan_processes = plan_processes
        self.tokens = tokens
        self.access = access
        self.formatter = formatter
        self.collate = collate
        self.rank = rank
        self.vision = vision
        self.load_pixels = load_pixels
        self.on_error = on_error
        self.plan_ahead = plan_ahead
        self.exact_labels = exact_labels
        self.epoch = 0
        self.start = 0
        self.exclude: np.ndarray | None = None
        self._warned: set = set()

    def configure(self, epoch: int, start: int, exclude: np.ndarray | None) -> None:
        """Iterate ``epoch`` from step ``start`` (``exclude``: ids already consumed of that step)."""
        self.epoch, self.start, self.exclude = int(epoch), int(start), exclude

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    def iter_worker(self, worker: int, num_workers: int):
        """ReadyStep items of the steps this worker owns, in order."""
        epoch, start, exclude = self.epoch, self.start, self.exclude
        ks = range(start + worker, self.planner.num_steps(epoch), max(num_workers, 1))

        def plans(steps=ks):
            for k in steps:
                yield self.planner.plan(epoch, k, self.rank, exclude if k == start else None)

        name = f"dynabatch-plan-r{self.rank}w{worker}"
        P = int(self.plan_processes)
        if P > 0 and get_worker_info() is None:
            ahead = _Interleaved([ProcessAhead(lambda p=p: plans(ks[p::P]), max(self.plan_ahead, 4), name=f"{name}p{p}")
                                  for p in range(P)])
        else:
            ahead = Ahead(plans, self.plan_ahead, name=name)
        try:
            for sp in ahead:
                yield self.load(sp)
        finally:
            ahead.close()

    def load(self, sp: StepPlan) -> ReadyStep:
        """Read, tokenize and collate this rank's samples of a planned step."""
        if self.tokens is not None:
            return self._load_cached(sp)
        with Timer() as t:
            ids = sp.sample_ids()
            samples = self.access.read(ids) if len(ids) else []
            toks = encode_samples(samples, self.formatter, self.vision, self.load_pixels, on_error="raise")
            by_id = {t.sample_id: t for t in toks}
            batches = collate_step(sp, by_id, self.collate, on_mismatch=lambda m: self._warn_once(
                "shape", f"{m}; the length index does not match the tokenization (stale index, or built with "
                         "other settings): batches are padded to fit, but the plan's costs are off"))
            self._check_labels(sp, toks)
        return ReadyStep(sp, batches, load_time_s=t.s)

    def _load_cached(self, sp: StepPlan) -> ReadyStep:
        """Collate a planned step from the token cache (no record reads, no tokenization)."""
        with Timer() as t:
            batches = collate_step(sp, None, self.collate, gather=self.tokens.gather, on_mismatch=lambda m: self._warn_once(
                "shape", f"{m}; the length index does not match the tokenization (stale index, or built with "
                         "other settings): batches are padded to fit, but the plan's costs are off"))
            if not self.exact_labels and "labels" not in self._warned:
                ids = sp.sample_ids()
                if len(ids):
                    index = self.planner.index
                    want = index.label_tokens[index.positions(ids)]
                    if not np.array_equal(want, self.tokens.label_counts(ids, self.collate.family)):
                        self._warn_labels()
        return ReadyStep(sp, batches, load_time_s=t.s)

    def _warn_labels(self) -> None:
        self._warn_once("labels", "step_target_tokens is derived from the length index's target_tokens, which "
                        "does not count every loss label of these samples (plain-text samples train on every "
                        "token); build the index with dynabatch.build_index (adds label_tokens) for exact counts")

    def _check_labels(self, sp: StepPlan, toks) -> None:
        if self.exact_labels or "labels" in self._warned or not toks:
            return
        index = self.planner.index
        ids = np.fromiter((t.sample_id for t in toks), np.int64, count=len(toks))
        want = index.label_tokens[index.positions(ids)]
        got = label_counts([t.enc for t in toks], self.collate.family)
        if not np.array_equal(want, got):
            self._warn_labels()


class _Interleaved:
    """Items of several `ProcessAhead` s taken round-robin (process ``p`` plans steps ``p, p + P,
    ...`` of the worker's share), i.e. in step order."""

    def __init__(self, aheads: list):
        self.aheads = aheads
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.aheads[self.i % len(self.aheads)])
        self.i += 1
        return item

    def close(self, wait: float = 0.0) -> None:
        for a in self.aheads:
            a.close(wait)


class WorkerSplitDataset(IterableDataset):
    """A `torch.utils.data.IterableDataset` over an object with ``iter_worker(worker, num_workers)``
    (`IndexedSteps`, the streaming chunk producer): each DataLoader worker gets its own share."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        it = iter(self.inner.iter_worker(w, n))
        if info is None:
            return it
        # In a worker process: hand each collated step over as one buffer (see ReadyStep.packed)
        return (x.packed() if isinstance(x, ReadyStep) else x for x in it)
