"""Streaming mode: iterable sources, a local buffer per rank, one small exchange per step.

Each rank reads its own slots of the source (``loaders`` deals the data over ranks x DataLoader
workers, every sample exactly once). DataLoader workers (or the planning thread itself with
``num_workers=0``) tokenize ``chunk_size`` samples per tokenizer call and hand over `Chunk` s
together with their slot's source state; the planning thread consumes the chunks round-robin over
the slots into a FIFO buffer of tokenized samples. Then, for every step:

1. *Proposal*: the buffer's oldest samples up to this rank's share of the global batch
   (``global_batch_tokens / world_size`` tokens, or ``global_batch_size / world_size`` samples), planned with
   ``plan_microbatches(..., num_ranks=1)`` -> its predicted step time.
2. *Exchange 1* (`Collective.all_gather` of a few numbers): which ranks still have data, their
   proposed times and buffered amounts. All ranks empty: the epoch ends (on every rank at once).
   The cost target is the mean proposed time of the ranks with data.
3. *Selection*: the oldest samples whose predicted time meets the target (token mode; sample mode
   keeps the share); they are planned into micro-batches (``num_ranks=1``). Leftovers stay
   buffered: nothing is dropped.
4. *Exchange 2*: every rank's micro-batch count, real tokens, loss labels and samples. The step
   has ``max`` micro-batches on every rank: a rank with fewer (or with nothing left) adds
   placeholder micro-batches of zero real tokens (``is_padding=True``, labels all -100), so every
   rank runs the same number of forward/backward passes and no DDP collective hangs.

State (see `dynabatch.loader.state`): the planner snapshots, before each step's selection, the
source state of every slot as of its last consumed chunk, the round-robin position, which slots
are exhausted and the buffered sample ids, so a checkpoint holds positions and ids, not samples (sources without
random access, i.e. streaming HF datasets, store the buffered token ids instead).
"""

from __future__ import annotations

import logging
from collections import deque
import warnings
from dataclasses import dataclass, replace

import numpy as np

from ....core.options import PlanOptions
from ....core.plan.planner import PlanningError, plan_microbatches
from ....core.plan.steps import oversized_samples
from ....core.shapes import Shapes
from ...records import (CollateConfig, MicroBatchPlan, ReadyStep, StepPlan, Timer, TokSample, collate_step,
                            encode_samples, label_counts)

logger = logging.getLogger("dynabatch")


@dataclass
class Chunk:
    """Tokenized samples of one slot, and the slot's source state right after them.

    ``done``: the slot's data for the epoch is exhausted after these samples.
    """

    slot: int
    samples: list
    state: dict
    done: bool = False


class ChunkProducer:
    """Reads and tokenizes one rank's slots (slot = DataLoader worker, or 0 without workers).

    ``slot_states`` (slot -> loaders state) resume each slot exactly; ``global_state`` (a
    `loaders.merge_states` result, possibly with buffered ids added) re-deals the remaining data.
    """

    def __init__(self, source, formatter, *, rank: int, world_size: int, num_workers: int, epoch: int,
                 vision=None, keep_images: bool = False, chunk_size: int = 64, on_error: str = "raise",
                 slot_states: dict | None = None, global_state: dict | None = None):
        self.source = source
        self.formatter = formatter
        self.rank = rank
        self.world_size = world_size
        self.num_workers = num_workers
        self.epoch = epoch
        self.vision = vision
        self.keep_images = keep_images
        self.chunk_size = chunk_size
        self.on_error = on_error
        self.slot_states = slot_states or {}
        self.global_state = global_state

    @property
    def num_slots(self) -> int:
        return max(1, self.num_workers)

    def slot_source(self, slot: int):
        """The source positioned at the start (or resume point) of ``slot`` in this epoch."""
        src = self.source.with_layout(rank=self.rank, world_size=self.world_size, worker_id=slot,
                                      num_workers=self.num_workers)
        src.set_epoch(self.epoch)
        if slot in self.slot_states:
            src.load_state_dict(self.slot_states[slot])
        elif self.global_state is not None:
            src.load_state_dict(self.global_state)
        return src

    def initial_states(self) -> dict[int, dict]:
        """Every slot's source state before anything is read (what a checkpoint holds for a slot
        that has not delivered a chunk yet)."""
        return {s: self.slot_source(s).state_dict() for s in range(self.num_slots)}

    def iter_worker(self, worker: int, num_workers: int):
        """Chunks of slot ``worker``; the last one has ``done=True``."""
        src = self.slot_source(worker)
        batch: list[dict] = []
        for sample in src:
            batch.append(sample)
            if len(batch) >= self.chunk_size:
                toks = encode_samples(batch, self.formatter, self.vision, self.keep_images, self.on_error)
                yield Chunk(worker, toks, src.state_dict())
                batch = []
        toks = encode_samples(batch, self.formatter, self.vision, self.keep_images, self.on_error)
        yield Chunk(worker, toks, src.state_dict(), done=True)


class ChunkFeed:
    """Consumes chunks slot by slot, round-robin, skipping exhausted slots (deterministic order,
    whatever order the DataLoader workers deliver in)."""

    def __init__(self, producer: ChunkProducer, *, rr: int = 0, exhausted: list[bool] | None = None,
                 slot_states: dict | None = None, loader_kwargs: dict | None = None):
        self.producer = producer
        n = producer.num_slots
        self.rr = int(rr)
        self.exhausted = list(exhausted) if exhausted is not None else [False] * n
        self.slot_states = dict(slot_states) if slot_states is not None else producer.initial_states()
        self._queues = {s: deque() for s in range(n)}
        self._gens = None
        self._dl_iter = None
        if producer.num_workers == 0:
            self._gens = {0: producer.iter_worker(0, 1)}
        else:
            from torch.utils.data import DataLoader as TorchDataLoader

            from ..indexed.steps import WorkerSplitDataset
            from ...processes import WorkerInit, collate_as_is, start_workers

            kw = dict(loader_kwargs or {})
            kw["worker_init_fn"] = WorkerInit(kw.get("worker_init_fn"))  # workers die with this process
            dl = TorchDataLoader(WorkerSplitDataset(producer), batch_size=None, num_workers=producer.num_workers,
                                 collate_fn=collate_as_is, **kw)
            self._dl_iter = start_workers(lambda: iter(dl))  # forked while no thread compiles a kernel

    @property
    def done(self) -> bool:
        return all(self.exhausted)

    def next_chunk(self) -> Chunk | None:
        """The next chunk in round-robin slot order; None when every slot is exhausted."""
        n = len(self.exhausted)
        for _ in range(n):
            slot = self.rr
            self.rr = (self.rr + 1) % n
            if self.exhausted[slot]:
                continue
            chunk = self._get(slot)
            self.slot_states[slot] = chunk.state
            if chunk.done:
                self.exhausted[slot] = True
            return chunk
        return None

    def _get(self, slot: int) -> Chunk:
        if self._gens is not None:
            return next(self._gens[slot])
        q = self._queues[slot]
        while not q:
            try:
                chunk = next(self._dl_iter)
            except StopIteration:
                raise RuntimeError(f"DataLoader worker {slot} stopped without finishing its data") from None
            if not self.exhausted[chunk.slot]:
                self._queues[chunk.slot].append(chunk)
        return q.popleft()

    def close(self) -> None:
        if self._dl_iter is not None:
            shutdown = getattr(self._dl_iter, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self._dl_iter = None


class StreamBuffer:
    """FIFO of tokenized samples with columnar token counts for vectorized selection."""

    def __init__(self, cost, family: str, max_len=None, max_target_len=None):
        self.cost = cost
        self.family = family
        self.max_len = max_len
        self.max_target_len = max_target_len
        self.items: list[TokSample] = []
        self.ids = np.zeros(0, np.int64)
        self.inp = np.zeros(0, np.int64)
        self.tgt = np.zeros(0, np.int64)
        self.vis = np.zeros(0, np.int64)
        self.lab = np.zeros(0, np.int64)
        self.main = np.zeros(0, np.int64)  # main-stack tokens after max_len (cost model's view)
        self.dec = np.zeros(0, np.int64)
        self.tiles = np.zeros(0, np.int64)
        self.tok = np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self.items)

    def extend(self, toks: list[TokSample]) -> None:
        if not toks:
            return
        n = len(toks)
        inp = np.fromiter((t.input_tokens for t in toks), np.int64, count=n)
        tgt = np.fromiter((t.target_tokens for t in toks), np.int64, count=n)
        vis = np.fromiter((t.vision_tokens for t in toks), np.int64, count=n)
        lab = label_counts([t.enc for t in toks], self.family)
        ids = np.fromiter((t.sample_id for t in toks), np.int64, count=n)
        main, dec, tiles = self.cost.sample_dims(Shapes.from_lengths(inp, tgt, vis, sample_id=ids), self.max_len,
                                                 self.max_target_len)
        self.items.extend(toks)
        self.ids = np.concatenate([self.ids, ids])
        self.inp = np.concatenate([self.inp, inp])
        self.tgt = np.concatenate([self.tgt, tgt])
        self.vis = np.concatenate([self.vis, vis])
        self.lab = np.concatenate([self.lab, lab])
        self.main = np.concatenate([self.main, main])
        self.dec = np.concatenate([self.dec, dec])
        self.tiles = np.concatenate([self.tiles, tiles])
        self.tok = np.concatenate([self.tok, main + dec])

    def shapes(self, n: int | None = None) -> Shapes:
        sl = slice(0, len(self) if n is None else n)
        return Shapes.from_lengths(self.inp[sl], self.tgt[sl], self.vis[sl], sample_id=self.ids[sl])

    def take(self, n: int) -> list[TokSample]:
        """Remove and return the ``n`` oldest samples."""
        out = self.items[:n]
        self.items = self.items[n:]
        for name in ("ids", "inp", "tgt", "vis", "lab", "main", "dec", "tiles", "tok"):
            setattr(self, name, getattr(self, name)[n:])
        return out


@dataclass
class StreamConfig:
    """Planning settings of the streaming mode: the loader's `PlanOptions` (``num_ranks`` is the
    world size) plus what only streaming has (``buffer_tokens``: lookahead in tokens)."""

    cost: object
    options: PlanOptions
    rank: int
    buffer_tokens: int | None = None

    @property
    def world_size(self) -> int:
        return self.options.num_ranks

    @property
    def total(self) -> float:
        """The global batch: samples (``global_batch_size``) or tokens (``global_batch_tokens``)."""
        o = self.options
        return o.global_batch_size if o.global_batch_size is not None else o.global_batch_tokens

    @property
    def share(self) -> float:
        """This rank's nominal share of a global batch (tokens, or samples in sample mode)."""
        return self.total / self.world_size

    @property
    def buffer_target(self) -> float:
        """Buffered amount (tokens, or samples) kept before each step: lookahead for selection."""
        if self.buffer_tokens is not None and self.options.global_batch_size is None:
            return max(float(self.buffer_tokens), self.share)
        return 2.0 * self.share


def _marginal_cost(cost, buf: StreamBuffer) -> np.ndarray:
    """Per-sample share of a micro-batch's time (seconds) without the fixed per-micro-batch cost."""
    phi = cost.packed_features(buf.main, buf.dec, buf.tiles, np.arange(len(buf)))
    phi[:, 7] = 0.0
    phi[:, 8] = 0.0
    return np.maximum(cost.time(phi), 1e-12)


class StreamingPlanner:
    """Runs the per-step protocol of the module docstring for one rank."""

    def __init__(self, cfg: StreamConfig, collective, collate: CollateConfig):
        self.cfg = cfg
        self.coll = collective
        self.collate = collate
        self._warned = False  # the oversized-sample warning is said once per epoch

    def _plan(self, shapes: Shapes, step: int):
        c = self.cfg
        o = c.options
        limit = o.memory_limit if o.memory_limit is not None else c.cost.memory_limit(o.num_stages, c.world_size)
        try:
            return plan_microbatches(shapes, c.cost, replace(o, num_ranks=1, memory_limit=limit), step=step)
        except PlanningError as e:
            raise PlanningError(f"rank {c.rank}, step {step}: {e}") from e

    def _warn_oversized(self, toks: list[TokSample]) -> None:
        """The indexed mode's one-line warning (`oversized_samples`) for the first samples read that outweigh
        the global batch in tokens (each is then a step of its own, over the budget); once per epoch."""
        if self._warned or not toks:
            return
        n = len(toks)
        shapes = Shapes.from_lengths(np.fromiter((t.input_tokens for t in toks), np.int64, count=n),
                                     np.fromiter((t.target_tokens for t in toks), np.int64, count=n),
                                     np.fromiter((t.vision_tokens for t in toks), np.int64, count=n))
        warning = oversized_samples(shapes, self.cfg.cost, self.cfg.options)
        if warning is not None:
            self._warned = True
            warnings.warn(f"rank {self.cfg.rank}: {warning.replace(f' of {n} samples', ' samples read so far')}",
                          UserWarning, stacklevel=2)

    def _units(self, buf: StreamBuffer) -> np.ndarray:
        return np.ones(len(buf), np.int64) if self.cfg.options.global_batch_size is not None else buf.tok

    def run(self, feed: ChunkFeed, buf: StreamBuffer, *, epoch: int, step: int, step_in_epoch: int,
            snapshot_extra=None):
        """ReadyStep items until every rank is out of data (same count on every rank)."""
        c = self.cfg
        while True:
            with Timer() as fill_t:
                while not feed.done and float(self._units(buf).sum()) < c.buffer_target:
                    chunk = feed.next_chunk()
                    if chunk is None:
                        break
                    buf.extend(chunk.samples)
                    self._warn_oversized(chunk.samples)
            # Taken after the fill, so every sample this step can consume is in the buffer: a resume
            # re-reads the buffer, finds it full, and re-plans this very step.
            snapshot = {"slots": dict(feed.slot_states), "rr": feed.rr, "exhausted": list(feed.exhausted),
                        "buffer_ids": buf.ids.copy(), "epoch": epoch, "step": step, "step_in_epoch": step_in_epoch}
            if snapshot_extra is not None:
                snapshot.update(snapshot_extra(buf))
            with Timer() as t:
                units = self._units(buf)
                cum = np.cumsum(units)
                has = len(buf) > 0
                n_prop = min(int(np.searchsorted(cum, c.share - 1e-9)) + 1, len(buf)) if has else 0
                t_prop = self._plan(buf.shapes(n_prop), step).iteration_time_s if n_prop else 0.0
                g1 = self.coll.all_gather(np.array([float(has), t_prop, float(cum[-1]) if has else 0.0,
                                                    float(feed.done)]))
                if g1[:, 0].sum() == 0:
                    return
                sample_mode = c.options.global_batch_size is not None
                if c.options.drop_last and g1[:, 3].all() and g1[:, 2].sum() < c.total:
                    logger.info("epoch %d: dropping the last %d buffered %s of rank %d (drop_last=True)", epoch,
                                int(cum[-1]) if has else 0, "samples" if sample_mode else "tokens", c.rank)
                    return
                n = self._select(buf, n_prop, t_prop, g1) if has else 0
                version = getattr(c.cost, "version", 0)
                shapes = buf.shapes(n)
                plan = self._plan(shapes, step) if n else None
                buf_lab = buf.lab
                chosen = buf.take(n)
                k_r = plan.num_microbatches if plan is not None else 0
                lab = int(buf_lab[:n].sum())
                real = int(plan.mb_real_tokens.sum()) if plan is not None else 0
                g2 = self.coll.all_gather(np.array([float(k_r), float(real), float(lab), float(n)]))
                K = int(g2[:, 0].max())
                mbs = [MicroBatchPlan.of(mb, plan.collation) for mb in plan.microbatches(0)] if plan is not None else []
                mbs += [MicroBatchPlan.placeholder()] * (K - len(mbs))
                collation = plan.collation if plan is not None else self.collate.collation
                sp = StepPlan(step=step, epoch=epoch, step_in_epoch=step_in_epoch, collation=collation,
                              microbatches=tuple(mbs), step_real_tokens=int(round(g2[:, 1].sum())),
                              step_target_tokens=int(round(g2[:, 2].sum())), step_samples=int(round(g2[:, 3].sum())),
                              plan_time_s=0.0, plan=plan, shapes=shapes if plan is not None else None,
                              cost_version=int(version))
            sp = replace(sp, plan_time_s=t.s)
            with Timer() as ct:
                batches = collate_step(sp, {x.sample_id: x for x in chosen}, self.collate)
            yield ReadyStep(sp, batches, snapshot=snapshot, load_time_s=fill_t.s + ct.s)
            step += 1
            step_in_epoch += 1

    def _select(self, buf: StreamBuffer, n_prop: int, t_prop: float, g1: np.ndarray) -> int:
        """How many of the oldest buffered samples this rank takes (see the module docstring)."""
        c = self.cfg
        if c.options.global_batch_size is not None or n_prop == 0:
            return n_prop
        active = g1[:, 0] > 0
        target = float(g1[active, 1].mean())
        marginal = _marginal_cost(c.cost, buf)
        cum = np.cumsum(marginal)
        if cum[n_prop - 1] <= 0 or t_prop <= 0:
            return n_prop
        scale = t_prop / cum[n_prop - 1]  # predicted seconds per unit of marginal cost for this buffer
        n = int(np.searchsorted(cum * scale, target - 1e-12)) + 1
        # Stay near the token share: the time target balances ranks, it must not change the batch size.
        return int(np.clip(n, max(1, (n_prop + 1) // 2), min(len(buf), 2 * n_prop)))
