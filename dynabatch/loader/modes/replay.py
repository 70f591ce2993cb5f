"""Replay mode: the steps of a plan file (`dynabatch.planfile.RunPlan`), exactly, through the
indexed mode's machinery (reading by ``sample_id``, token cache, workers). Its state is the indexed
mode's, nested under ``"replay"``; a half-done step cannot move to another world size."""

from __future__ import annotations

from ..replay_planner import ReplayPlanner
from .base import Context
from .indexed import IndexedMode, check_not_empty, open_index


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
