"""The data loader of a pipeline replica (data x pipeline parallelism): `loader_runtime(ctx)` is the
``Runtime`` a rank gives its `dynabatch.DataLoader`, so that each of the ``num_replicas`` pipelines reads its
own share of the data (loader rank = the replica, world size = the replicas) and every stage of one replica
plans the same steps.

The streaming planner agrees on each step with one small collective among the loader ranks. Here those are
the same stage of every replica: each stage ``s`` has its own group of replicas (`ReplicaCollective`, a
dedicated gloo group per stage, created by every rank in the same order), and the stages of one replica,
holding the same data share and the same inputs, compute the same plan. Its exchanges run under the failure
monitor: on the main thread (``plan_ahead=0``) watched like a step's wait (`setup_guard`), on the planning
thread polled against a published failure, so a replica that failed or died stops the others' planning with
its error instead of leaving them in gloo.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from ...loader.collective import TorchCollective
from .failure import PipelineAborted
from .setup_guard import setup_all_reduce, setup_call


class ReplicaCollective(TorchCollective):
    """The planning collective of this rank's stage over the pipeline replicas of ``ctx`` (module doc):
    ``rank`` is the replica, ``world_size`` the number of replicas. Collective to construct: every rank calls
    it at the same point."""

    def __init__(self, ctx):
        S, R = ctx.num_stages, ctx.num_replicas
        mine = None
        for s in range(S):  # every rank creates every stage's group, in the same order
            ranks = [d * S + s for d in range(R)]
            g = setup_call(ctx, lambda r=ranks: dist.new_group(r, backend="gloo"),
                           f"in the creation of the data loader's group of stage {s} over the replicas",
                           ranks if ctx.rank in ranks else ())
            if s == ctx.stage:
                mine = g
        super().__init__(group=mine)
        self.ctx = ctx
        self.peers = [d * S + ctx.stage for d in range(R)]

    def all_gather(self, values: np.ndarray) -> np.ndarray:
        v = np.asarray(values, np.float64).ravel()
        k = len(v)
        buf = torch.zeros(self.world_size * k, dtype=torch.float64)
        buf[self.rank * k:(self.rank + 1) * k] = torch.from_numpy(v)
        mon = self.ctx.monitor
        text = f"in the data loader's planning exchange (stage {self.ctx.stage} of every replica)"
        if threading.current_thread() is threading.main_thread():
            setup_all_reduce(self.ctx, buf, text, self.peers, group=self.group)
        else:  # the planning thread: the monitor's waits belong to the main thread
            mon.raise_if_failed()
            work = dist.all_reduce(buf, group=self.group, async_op=True)
            while not work.is_completed():
                if mon.failure is not None:
                    raise PipelineAborted(mon.failure)
                time.sleep(mon.poll_s)
            work.wait()
        return buf.numpy().reshape(self.world_size, k)


def loader_runtime(ctx, *, plan_ahead: int = 2, plan_processes: int | None = None, buffer_tokens: int | None = None,
                   chunk_size: int = 64):
    """``dynabatch.Runtime`` for this rank's data loader: the replica's share (``rank=ctx.replica``,
    ``world_size=ctx.num_replicas``) and, with several replicas, their `ReplicaCollective` (collective: every
    rank calls it at the same point). The keywords: the other ``Runtime`` fields, as it documents them."""
    from ...loader.settings import Runtime

    collective = ReplicaCollective(ctx) if ctx.num_replicas > 1 else None
    return Runtime(rank=ctx.replica, world_size=ctx.num_replicas, collective=collective, plan_ahead=plan_ahead,
                   plan_processes=plan_processes, buffer_tokens=buffer_tokens, chunk_size=chunk_size)
