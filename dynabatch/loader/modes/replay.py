"""Replay mode: the steps of a plan file, exactly, through the indexed mode's machinery (reading by
``sample_id``, token cache, workers). ``DataLoader(..., source=DataSource(plan="plan.parquet"))`` runs
exactly the steps, ranks, micro-batches and sample ids a plan file lists (written by ``dynabatch plan``,
or any table of `plans_to_arrow`).

The file is read and validated by the one plan-file reader, `dynabatch.planfile.RunPlan` (the
format: `dynabatch.planfile.format`); `build_replay` calls ``run.check(...)`` with the length index's
fingerprints, its world size and pipeline stages, the options given explicitly (by `PlanOptions`
field name) and the data's sample ids. Everything refused raises `dynabatch.PlanMismatchError` (a
ValueError) naming what differs.

`ReplayPlanner` gives `IndexedPlanner`'s interface over a `RunPlan`: the file's steps, nothing
re-planned. Its state is the indexed mode's, nested under ``"replay"``; a half-done step cannot move
to another world size.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...planfile.reader import PlanMismatchError, RunPlan, load_run_plan
from ..records import StepPlan, Timer
from .base import Context
from .indexed import IndexedMode, check_not_empty, open_index
from .indexed.steps import index_rank_step

__all__ = ["PlanMismatchError", "ReplayMode", "ReplayPlanner", "RunPlan", "build_replay", "load_run_plan"]


class ReplayPlanner:
    """`IndexedPlanner`'s interface over a `RunPlan`: the file's steps, nothing re-planned."""

    def __init__(self, plan, index):
        self.run = load_run_plan(plan)
        self.index = index
        self.world_size = self.run.num_ranks
        self._per_epoch = self.run.steps_per_epoch

    def num_steps(self, epoch: int) -> int:
        if not 0 <= epoch < len(self._per_epoch):
            raise ValueError(f"the plan {self.run.name} holds {len(self._per_epoch)} epoch(s); "
                             f"epoch {epoch} is not in it")
        return self._per_epoch[epoch]

    def first_step(self, epoch: int) -> int:
        self.num_steps(epoch)
        return self.run.first_step(epoch)

    def plan(self, epoch: int, k: int, rank: int, exclude=None) -> StepPlan:
        """This rank's plan of step ``k`` of ``epoch``: the file's `BatchPlan` of that step, cut for
        ``rank`` exactly as the indexed mode cuts a plan it made itself (`rank_step`)."""
        if exclude is not None and len(exclude):
            raise ValueError("a replayed plan cannot resume a half-done step on another world size")
        with Timer() as t:
            plan = self.run.step(self.first_step(epoch) + k)
            ids = plan.sample_ids
            pos = self.index.positions(ids) if len(ids) else np.zeros(0, np.int64)
            sp = index_rank_step(self.index, plan, pos, rank, epoch=epoch, step_in_epoch=k)
        return dataclasses.replace(sp, plan_time_s=t.s)


class ReplayMode(IndexedMode):
    """`IndexedMode` over a `ReplayPlanner` (the file's steps, nothing re-planned)."""

    name = "replay"


def build_replay(ctx: Context, run, explicit: dict, index=None, index_cache=None) -> ReplayMode:
    """Check ``run`` (a `dynabatch.planfile.RunPlan`) against the data and the job
    (`PlanMismatchError`) and replay it."""
    run.check_origin(ctx.source, ctx.formatter.tokenizer)
    idx, table, tokens = open_index(ctx, index, index_cache)
    check_not_empty(ctx, len(idx), table)
    o = ctx.options
    run.check(dataset_fingerprint=idx.fingerprints, num_ranks=ctx.world_size, num_stages=o.num_stages,
              options=explicit, sample_ids=idx.shapes.sample_id)
    planner = ReplayPlanner(run, idx)
    return ReplayMode(ctx, idx, planner, tokens, run.dataset_fingerprint)
