"""Replaying a plan file: ``DataLoader(..., plan="plan.parquet")`` runs exactly the steps, ranks,
micro-batches and sample ids a plan file lists (written by ``dynabatch plan``, or any table of
`plans_to_arrow`).

The file is read and validated by the one plan-file reader, `dynabatch.planfile.RunPlan` (the
format: `dynabatch.planfile.format`); the loader then calls ``run.check(...)`` with the length
index's fingerprints, its world size and pipeline stages, the options it was given explicitly (by
`PlanOptions` field name) and the data's sample ids. Everything refused raises
`dynabatch.PlanMismatchError` (a ValueError) naming what differs.

`ReplayPlanner` gives `IndexedPlanner`'s interface over a `RunPlan`: the file's steps, nothing
re-planned.
"""

from __future__ import annotations

import numpy as np

from ..planfile import format as fmt
from ..planfile.reader import PlanMismatchError, RunPlan, load_run_plan
from .records import MicroBatchPlan, StepPlan, Timer

__all__ = ["PlanMismatchError", "ReplayPlanner", "RunPlan", "load_run_plan"]

_STEP_COLUMNS = (fmt.RANK, fmt.MICROBATCH, fmt.SAMPLE_ID, fmt.ROW, "input_len", "target_len", "real_tokens", "time_s",
                 "memory_bytes")


class ReplayPlanner:
    """`IndexedPlanner`'s interface over a `RunPlan`: the file's steps, nothing re-planned."""

    def __init__(self, plan, index, cost, max_len=None, max_target_len=None):
        self.run = load_run_plan(plan)
        self.index = index
        self.world_size = self.run.num_ranks
        main, dec, _ = cost.sample_dims(index.shapes, max_len, max_target_len)
        self._real = (main + dec).astype(np.int64)
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
        if exclude is not None and len(exclude):
            raise ValueError("a replayed plan cannot resume a half-done step on another world size")
        run = self.run
        with Timer() as t:
            step = self.first_step(epoch) + k
            rows = run.step_rows(step)
            c = {name: rows.column(name).to_numpy() for name in _STEP_COLUMNS if name in rows.column_names}
            ids = c[fmt.SAMPLE_ID].astype(np.int64)
            pos = np.searchsorted(self.index.shapes.sample_id, ids)
            rank_col, mb_col = c[fmt.RANK].astype(np.int64), c[fmt.MICROBATCH].astype(np.int64)
            key = rank_col * (int(mb_col.max(initial=0)) + 1) + mb_col
            uniq, first, inv = np.unique(key, return_index=True, return_inverse=True)
            per_rank = np.bincount(rank_col[first], minlength=run.num_ranks)
            K = int(per_rank.max(initial=0))
            real_of_sample = c["real_tokens"].astype(np.int64) if "real_tokens" in c else None
            packed = run.collation == "packed"
            mbs = []
            mine = rank_col[first] == rank
            for j in np.flatnonzero(mine)[np.argsort(mb_col[first][mine], kind="stable")]:
                sel = np.flatnonzero(inv == j)
                rows_of = c[fmt.ROW][sel].astype(np.int64) if run.collation == "packed_rows" and fmt.ROW in c else None
                real = int(real_of_sample[sel[0]]) if real_of_sample is not None else int(self._real[pos[sel]].sum())
                mbs.append(MicroBatchPlan(
                    sample_ids=ids[sel], rows=rows_of,
                    input_len=int(c["input_len"][sel[0]]) if "input_len" in c and not packed else 0,
                    target_len=int(c["target_len"][sel[0]]) if "target_len" in c and not packed else 0,
                    real_tokens=real, predicted_time_s=float(c["time_s"][sel[0]]) if "time_s" in c else 0.0,
                    predicted_memory_bytes=float(c["memory_bytes"][sel[0]]) if "memory_bytes" in c else 0.0))
            mbs += [MicroBatchPlan(np.zeros(0, np.int64), is_padding=True)] * (K - len(mbs))
            if real_of_sample is not None:
                step_real = int(real_of_sample[first].sum())
            else:
                step_real = int(self._real[pos].sum())
        return StepPlan(step=int(step), epoch=epoch, step_in_epoch=k, collation=run.collation,
                        microbatches=tuple(mbs), step_real_tokens=step_real,
                        step_target_tokens=int(self.index.label_tokens[pos].sum()), step_samples=len(ids),
                        plan_time_s=t.s)
