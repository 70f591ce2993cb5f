"""Replaying a plan file: ``DataLoader(..., plan="plan.parquet")`` runs exactly the steps, ranks,
micro-batches and sample ids a plan file lists (written by ``dynabatch plan`` with
`plans_to_arrow`), after checking that it was made for this data and this job.

The file's schema metadata (agreed with the plan writer):

* ``dynabatch.plan_schema_version``, ``dynabatch.method``, ``dynabatch.collation``,
  ``dynabatch.num_ranks``, ``dynabatch.num_stages`` (written by `BatchPlan.to_arrow`);
* ``dynabatch.dataset_fingerprint``: ``Shapes.fingerprint()`` of the length index the plan was made
  from (either sorted by ``sample_id`` or in the index's own order: both are accepted);
* ``dynabatch.options``: JSON of the planning options (``method``, ``max_len``, ``batch_tokens``...);
* ``dynabatch.epochs``, ``dynabatch.seed``.

Rows: one per sample placement with the columns ``step`` (from 0, across epochs), ``rank``,
``microbatch`` (position in the rank's order), ``sample_id`` and optionally ``row``,
``input_len``, ``target_len``, ``real_tokens``, ``time_s`` and ``epoch``. Without an ``epoch``
column, an epoch ends where a sample would be seen a second time.

Refused with `PlanMismatchError` (a ValueError) naming what differs: another dataset
(fingerprint), world size, pipeline stages, method/collation, an explicitly given option that
differs, or sample ids missing from the data.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa

from ..core.batchplan import PLAN_SCHEMA_VERSION
from .steps import MicroBatchPlan, StepPlan, Timer

FINGERPRINT_KEY = "dynabatch.dataset_fingerprint"
NUM_RANKS_KEY = "dynabatch.num_ranks"
NUM_STAGES_KEY = "dynabatch.num_stages"
OPTIONS_KEY = "dynabatch.options"
EPOCHS_KEY = "dynabatch.epochs"
SEED_KEY = "dynabatch.seed"

#: Loader option -> names a plan's options may use for it.
OPTION_ALIASES = {
    "method": ("method",),
    "collation": ("collation", "collate"),
    "batch_tokens": ("batch_tokens", "global_batch_tokens", "tokens_per_batch"),
    "batch_size": ("batch_size", "global_batch_size", "samples_per_batch"),
    "max_len": ("max_len",),
    "max_target_len": ("max_target_len",),
    "seed": ("seed",),
    "family": ("family",),
    "drop_last": ("drop_last",),
    "pad_to_multiple_of": ("pad_to_multiple_of", "pad_multiple"),
}


try:  # one exception type for both plan readers (`dynabatch.offline` reads the same files)
    from ..planfile.reader import PlanMismatchError as _PlanMismatchBase
except ImportError:  # pragma: no cover - the offline commands are optional here
    _PlanMismatchBase = ValueError


class PlanMismatchError(_PlanMismatchBase):
    """A plan file does not belong to this dataset or job (a ValueError)."""


def _read_table(plan) -> tuple[pa.Table, str]:
    if isinstance(plan, pa.Table):
        return plan, "the plan table"
    path = os.fspath(plan)
    if not os.path.exists(path):
        raise FileNotFoundError(f"plan file {path} does not exist")
    try:
        if path.endswith((".arrow", ".feather", ".ipc")):
            with pa.memory_map(path) as mm:
                return pa.ipc.open_file(mm).read_all(), path
        import pyarrow.parquet as pq

        return pq.read_table(path), path
    except (pa.ArrowException, OSError) as e:
        raise PlanMismatchError(f"{path}: cannot read the plan file ({e})") from e


class PlanFile:
    """A plan table, grouped by step, with its run-level metadata."""

    def __init__(self, plan):
        table, self.name = _read_table(plan)
        self.meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
        version = self.meta.get("dynabatch.plan_schema_version")
        if version is None:
            raise PlanMismatchError(f"{self.name} is not a dynabatch plan (no dynabatch.plan_schema_version metadata)")
        if not version.isdigit() or int(version) != PLAN_SCHEMA_VERSION:
            raise PlanMismatchError(f"{self.name}: plan schema version {version} is not supported "
                                    f"(this dynabatch reads version {PLAN_SCHEMA_VERSION})")
        missing = [c for c in ("step", "rank", "microbatch", "sample_id") if c not in table.column_names]
        if missing:
            raise PlanMismatchError(f"{self.name}: the plan lacks the columns {missing}")
        cols = {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names
                if c in ("step", "rank", "microbatch", "sample_id", "row", "input_len", "target_len", "real_tokens",
                         "time_s", "memory_bytes", "epoch")}
        order = np.argsort(cols["step"], kind="stable")  # keeps the file's order inside a step
        self.cols = {c: v[order] for c, v in cols.items()}
        steps = self.cols["step"].astype(np.int64)
        self.steps, starts = np.unique(steps, return_index=True)
        self.bounds = np.append(starts, len(steps))
        if len(self.steps) and not np.array_equal(self.steps, np.arange(self.steps[0], self.steps[0] + len(self.steps))):
            gaps = np.setdiff1d(np.arange(self.steps[0], self.steps[-1] + 1), self.steps)[:5].tolist()
            raise PlanMismatchError(f"{self.name}: steps are not consecutive (missing {gaps})")
        self.num_ranks = self._int(NUM_RANKS_KEY)
        self.num_stages = self._int(NUM_STAGES_KEY)
        self.collation = self.meta.get("dynabatch.collation", "padded")
        self.method = self.meta.get("dynabatch.method")
        try:
            self.options = json.loads(self.meta.get(OPTIONS_KEY, "{}"))
        except json.JSONDecodeError as e:
            raise PlanMismatchError(f"{self.name}: {OPTIONS_KEY} is not valid JSON ({e})") from e
        self.epoch_of_step: np.ndarray | None = None

    def _int(self, key: str) -> int:
        value = self.meta.get(key)
        if value is None or not str(value).lstrip("-").isdigit():
            raise PlanMismatchError(f"{self.name}: metadata {key} is missing or not an integer ({value!r})")
        return int(value)

    def option(self, name: str):
        """The plan's value of a loader option (under any of its aliases), or None."""
        for alias in OPTION_ALIASES.get(name, (name,)):
            if alias in self.options:
                return self.options[alias]
        return None

    # -- checks --------------------------------------------------------------------------------
    def check(self, *, fingerprints, world_size: int, num_stages: int | None, explicit: dict, index) -> None:
        """Raise `PlanMismatchError` unless the plan fits this dataset and job."""
        fp = self.meta.get(FINGERPRINT_KEY)
        if fp is None:
            raise PlanMismatchError(
                f"{self.name} has no {FINGERPRINT_KEY} in its metadata, so it cannot be checked against the data; "
                "re-create it with `dynabatch plan` (which records the fingerprint of the length index)")
        if fp not in fingerprints:
            raise PlanMismatchError(
                f"{self.name} was made for another dataset: its {FINGERPRINT_KEY} is {fp}, but the length index "
                f"of this data has fingerprint {sorted(fingerprints)[0]} (different samples, token counts or "
                "tokenization settings); re-plan this data, or pass the index= the plan was made from")
        if self.num_ranks != world_size:
            raise PlanMismatchError(
                f"{self.name} was made for {self.num_ranks} data-parallel ranks ({NUM_RANKS_KEY}), but this job "
                f"has world_size={world_size}; make a plan for {world_size} ranks, or drop plan= to plan online")
        if num_stages is not None and self.num_stages != num_stages:
            raise PlanMismatchError(
                f"{self.name} was made for {self.num_stages} pipeline stages ({NUM_STAGES_KEY}), but the loader has "
                f"num_stages={num_stages}")
        for name, value in explicit.items():
            if value is None:
                continue
            planned = self.method if name == "method" and self.method else (
                self.collation if name == "collation" else self.option(name))
            if planned is not None and _norm(planned) != _norm(value):
                raise PlanMismatchError(
                    f"{self.name} was planned with {name}={planned!r}, but the loader was given {name}={value!r}; "
                    "drop the argument to use the plan's, or re-plan")
        ranks = self.cols["rank"]
        if len(ranks) and (ranks.min() < 0 or ranks.max() >= self.num_ranks):
            raise PlanMismatchError(f"{self.name}: rank column outside [0, {self.num_ranks})")
        ids = self.cols["sample_id"].astype(np.int64)
        pos = np.searchsorted(index.shapes.sample_id, ids)
        pos_c = np.minimum(pos, max(len(index) - 1, 0))
        bad = (pos >= len(index)) | (index.shapes.sample_id[pos_c] != ids) if len(index) else np.ones(len(ids), bool)
        if bad.any():
            raise PlanMismatchError(f"{self.name} lists {int(bad.sum())} sample ids that are not in the data "
                                    f"(e.g. {ids[bad][:3].tolist()})")
        self._assign_epochs(index)

    def _assign_epochs(self, index) -> None:
        if "epoch" in self.cols:
            first = self.cols["epoch"][self.bounds[:-1]].astype(np.int64)
            self.epoch_of_step = first - first.min() if len(first) else first
            return
        epochs = int(self.meta.get(EPOCHS_KEY, "0") or 0) if str(self.meta.get(EPOCHS_KEY, "")).isdigit() else 0
        out = np.zeros(len(self.steps), np.int64)
        if epochs != 1:
            seen = np.zeros(len(index), bool)
            e = 0
            ids = self.cols["sample_id"].astype(np.int64)
            for s in range(len(self.steps)):
                pos = np.searchsorted(index.shapes.sample_id, ids[self.bounds[s]:self.bounds[s + 1]])
                if seen[pos].any():
                    e += 1
                    seen[:] = False
                seen[pos] = True
                out[s] = e
        self.epoch_of_step = out

    # -- steps ---------------------------------------------------------------------------------
    @property
    def num_epochs(self) -> int:
        return int(self.epoch_of_step.max()) + 1 if len(self.steps) else 0


def _norm(v):
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and v.lstrip("-").isdigit():
        return int(v)
    return v


class ReplayPlanner:
    """`IndexedPlanner`'s interface over a `PlanFile`: the file's steps, nothing re-planned."""

    def __init__(self, plan: PlanFile, index, cost, max_len=None, max_target_len=None):
        self.plan_file = plan
        self.index = index
        self.world_size = plan.num_ranks
        main, dec, _ = cost.sample_dims(index.shapes, max_len, max_target_len)
        self._real = (main + dec).astype(np.int64)
        e = plan.epoch_of_step
        self._epoch_first = {int(x): int(np.flatnonzero(e == x)[0]) for x in np.unique(e)}
        self._epoch_count = {int(x): int((e == x).sum()) for x in np.unique(e)}

    def num_steps(self, epoch: int) -> int:
        if epoch not in self._epoch_count:
            raise ValueError(f"the plan {self.plan_file.name} holds {self.plan_file.num_epochs} epoch(s); "
                             f"epoch {epoch} is not in it")
        return self._epoch_count[epoch]

    def first_step(self, epoch: int) -> int:
        self.num_steps(epoch)
        return int(self.plan_file.steps[self._epoch_first[epoch]])

    def plan(self, epoch: int, k: int, rank: int, exclude=None) -> StepPlan:
        if exclude is not None and len(exclude):
            raise ValueError("a replayed plan cannot resume a half-done step on another world size")
        pf = self.plan_file
        with Timer() as t:
            s = self._epoch_first[epoch] + k
            a, b = pf.bounds[s], pf.bounds[s + 1]
            c = {name: v[a:b] for name, v in pf.cols.items()}
            ids = c["sample_id"].astype(np.int64)
            pos = np.searchsorted(self.index.shapes.sample_id, ids)
            rank_col, mb_col = c["rank"].astype(np.int64), c["microbatch"].astype(np.int64)
            key = rank_col * (int(mb_col.max(initial=0)) + 1) + mb_col
            uniq, first, inv = np.unique(key, return_index=True, return_inverse=True)
            per_rank = np.bincount(rank_col[first], minlength=pf.num_ranks)
            K = int(per_rank.max(initial=0))
            real_of_sample = c["real_tokens"].astype(np.int64) if "real_tokens" in c else None
            mbs = []
            for j in np.flatnonzero(rank_col[first] == rank)[np.argsort(mb_col[first][rank_col[first] == rank],
                                                                      kind="stable")]:
                sel = np.flatnonzero(inv == j)
                rows = c["row"][sel].astype(np.int64) if pf.collation == "packed_rows" and "row" in c else None
                real = int(real_of_sample[sel[0]]) if real_of_sample is not None else int(self._real[pos[sel]].sum())
                mbs.append(MicroBatchPlan(
                    sample_ids=ids[sel], rows=rows,
                    input_len=int(c["input_len"][sel[0]]) if "input_len" in c and pf.collation != "packed" else 0,
                    target_len=int(c["target_len"][sel[0]]) if "target_len" in c and pf.collation != "packed" else 0,
                    real_tokens=real, predicted_time_s=float(c["time_s"][sel[0]]) if "time_s" in c else 0.0,
                    predicted_memory_bytes=float(c["memory_bytes"][sel[0]]) if "memory_bytes" in c else 0.0))
            mbs += [MicroBatchPlan(np.zeros(0, np.int64), is_padding=True)] * (K - len(mbs))
            if real_of_sample is not None:
                step_real = int(real_of_sample[first].sum())
            else:
                step_real = int(self._real[pos].sum())
        return StepPlan(step=int(pf.steps[s]), epoch=epoch, step_in_epoch=k, collation=pf.collation,
                        microbatches=tuple(mbs), step_real_tokens=step_real,
                        step_target_tokens=int(self.index.label_tokens[pos].sum()), step_samples=len(ids),
                        plan_time_s=t.s)
