"""Streaming mode: each rank plans from its own buffer and the ranks agree on each step with one
small collective (see `dynabatch.loader.modes.streaming.planner`); `StreamingMode` is its stateful iterator.

Mode state (nested in the DataLoader's under ``"streaming"``): ``identity``, ``layout``, ``epoch``,
``step``, ``step_in_epoch``, ``microbatch``, ``consumed``, ``fresh``, ``done`` (every micro-batch of
``step`` was yielded: the next step to yield is ``step + 1``), ``feed`` (the chunk feed:
``slots`` (slot -> ``loaders`` source state), ``rr``, ``exhausted``), ``buffer`` (``ids``, and
``encoded`` tokens for sources without random access) and ``shard_ranges`` of a mixture. A merged
state holds ``global``: a ``loaders`` global state with the buffered, unconsumed ids put back.
"""

from __future__ import annotations

import numpy as np

from ... import state as lstate
from ...ahead import Ahead
from ...collective import LocalCollective, TorchCollective
from .planner import ChunkFeed, ChunkProducer, StreamBuffer, StreamConfig, StreamingPlanner
from ..base import Context, Mode


def default_collective(rank: int, world_size: int, collective=None):
    """``collective``, else torch.distributed's (initialized), else a single rank's; checked against the layout."""
    if collective is None:
        import torch.distributed as dist

        if world_size == 1:
            collective = LocalCollective()
        elif dist.is_available() and dist.is_initialized():
            collective = TorchCollective()
        else:
            raise ValueError(f"the streaming mode with world_size={world_size} needs torch.distributed "
                             "(init_process_group) or an explicit collective=")
    if collective.world_size != world_size or collective.rank != rank:
        raise ValueError(f"the collective is rank {collective.rank} of {collective.world_size}, the loader rank "
                         f"{rank} of {world_size}")
    return collective


class StreamingMode(Mode):
    """Steps of the streaming mode (see the module docstring)."""

    name = "streaming"

    def __init__(self, ctx: Context):
        s, o, src = ctx.settings, ctx.options, ctx.source
        self.collective = default_collective(ctx.rank, ctx.world_size, s.collective)
        self.chunk_size = int(s.chunk_size)
        self.config = StreamConfig(cost=ctx.cost, options=o, rank=ctx.rank, buffer_tokens=s.buffer_tokens)
        ranges = getattr(src, "shard_ranges", None)
        self.shard_ranges = {n: list(r) for n, r in ranges.items()} if ranges is not None else None
        self.random_access = bool(src.supports_random_access)
        identity = {"source": src.fingerprint(), "method": o.method, "collation": o.collation,
                    "global_batch_tokens": o.global_batch_tokens, "global_batch_size": o.global_batch_size,
                    "drop_last": o.drop_last, "max_len": o.max_len, "max_target_len": o.max_target_len,
                    "num_stages": o.num_stages, "chunk_size": self.chunk_size, "buffer_tokens": s.buffer_tokens}
        super().__init__(ctx, identity)

    def _first_step(self) -> int:
        return int((self._resume or {}).get("step", self._epoch_start_step))

    def _generate(self):
        ctx, s, epoch = self.ctx, self.ctx.settings, self.epoch
        r = self._resume or {}
        if r.get("epoch", epoch) != epoch:
            r = {}
        self._resume = None
        fresh = not r or r.get("fresh")
        step = int(r.get("step", 0))
        step_in_epoch = 0 if fresh else int(r.get("step_in_epoch", 0))
        skip = 0
        producer_kw = dict(rank=ctx.rank, world_size=ctx.world_size, num_workers=ctx.num_workers, epoch=epoch,
                           vision=ctx.vision, keep_images=s.load_pixels, chunk_size=self.chunk_size,
                           on_error=s.on_error)
        o = ctx.options
        buf = StreamBuffer(ctx.cost, ctx.family, o.max_len, o.max_target_len)
        loader_kwargs = {k: v for k, v in s.loader_kwargs.items() if v is not None}
        if not fresh and r.get("global") is not None:
            producer = ChunkProducer(ctx.source, ctx.formatter, global_state=r["global"], **producer_kw)
            feed = ChunkFeed(producer, loader_kwargs=loader_kwargs)
        elif not fresh:
            f = r["feed"]
            slots = {int(k): v for k, v in f["slots"].items()}
            producer = ChunkProducer(ctx.source, ctx.formatter, slot_states=slots, **producer_kw)
            feed = ChunkFeed(producer, rr=f["rr"], exhausted=f["exhausted"], slot_states=slots,
                             loader_kwargs=loader_kwargs)
            buf.extend(self._restore_buffer(r["buffer"]))
            skip = int(r.get("microbatch", 0))
        else:
            producer = ChunkProducer(ctx.source, ctx.formatter, **producer_kw)
            feed = ChunkFeed(producer, loader_kwargs=loader_kwargs)
        self._closers.append(lambda wait: feed.close())
        planner = StreamingPlanner(self.config, self.collective, ctx.collate)
        extra = None
        if not self.random_access:
            extra = lambda b: {"buffer_encoded": lstate.encoded_to_json(b.items)}  # noqa: E731
        ahead = Ahead(lambda: planner.run(feed, buf, epoch=epoch, step=step, step_in_epoch=step_in_epoch,
                                          snapshot_extra=extra), s.plan_ahead, name=f"dynabatch-stream-r{ctx.rank}",
                      drain=True)  # never abandon a collective the other ranks' planners are in
        self._closers.insert(0, lambda wait: ahead.close(wait=10.0 if wait else 0.0))
        first = True
        for ready in ahead:
            k_skip = skip if first else 0
            pos = {"epoch": epoch, "step_in_epoch": ready.step.step_in_epoch, "step": ready.step.step,
                   "microbatch": k_skip, "consumed": [mb.sample_ids for mb in ready.step.microbatches[:k_skip]],
                   "snapshot": ready.snapshot, "next_step": ready.step.step, "done": False}
            first = False
            yield ready, k_skip, pos
        feed.close()

    def _restore_buffer(self, b: dict):
        if b.get("encoded") is not None:
            return lstate.encoded_from_json(b["encoded"])
        ids = np.asarray(b.get("ids", []), np.int64)
        if not len(ids):
            return []
        from loaders import open_access

        from ...records import encode_samples

        samples = open_access(self.ctx.source, generic=True).read(ids)
        toks = encode_samples(samples, self.ctx.formatter, self.ctx.vision, self.ctx.settings.load_pixels,
                              on_error="raise")
        if [t.sample_id for t in toks] != ids.tolist():
            raise lstate.LoaderStateError("buffered samples changed since the checkpoint (did the data change?)")
        return toks

    def _fresh_state(self, epoch: int, step: int) -> dict:
        out = super()._fresh_state(epoch, step)
        out["shard_ranges"] = self.shard_ranges
        return out

    def _position_state(self, p: dict, consumed: list) -> dict:
        snap = p["snapshot"]
        buffer = {"ids": lstate._ids(snap["buffer_ids"])}
        if "buffer_encoded" in snap:
            buffer["encoded"] = snap["buffer_encoded"]
        # the position stays at the step's start (its buffer snapshot) even when the step was yielded
        # whole: the next step's snapshot may not be planned yet; ``done`` says the step is over
        return self._state(epoch=p["epoch"], step=p["step"], step_in_epoch=p["step_in_epoch"],
                           microbatch=p["microbatch"], consumed=consumed, done=bool(p["done"]),
                           feed={"slots": {str(k): v for k, v in snap["slots"].items()}, "rr": snap["rr"],
                                 "exhausted": snap["exhausted"]},
                           buffer=buffer, shard_ranges=self.shard_ranges)

    def _resume_from(self, s: dict) -> dict:
        if s.get("merged"):
            # A merged streaming state always re-deals the remaining data over the new layout.
            partial = any(s["microbatch"])
            return {"epoch": s["epoch"], "step": s["step"] + (1 if partial else 0),
                    "step_in_epoch": s["step_in_epoch"] + (1 if partial else 0), "global": s["global"]}
        self._check_same_layout(s, "by the streaming mode")
        return s
