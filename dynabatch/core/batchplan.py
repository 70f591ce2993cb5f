"""`BatchPlan` and `MicroBatch`: which samples go into which micro-batch on which rank, in
which order, with each micro-batch's padded shape and predicted cost.

A `BatchPlan` is columnar: per-sample placement arrays (`sample_ids`, `sample_row`) cut into
micro-batches by `mb_offsets`, and per-micro-batch arrays (rank, position within the rank,
shape, predicted time and memory). Micro-batches are stored rank by rank in execution order.
`to_arrow` writes one row per sample placement (the offline plan file format) with the schema
version in the table metadata; `from_arrow` reads it back exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

PLAN_SCHEMA_VERSION = 1
COLLATIONS = ("padded", "packed", "packed_rows")

_MB_COLUMNS = {
    # name: (dtype, meaning)
    "mb_rank": (np.int32, "data-parallel rank that runs the micro-batch"),
    "mb_order": (np.int32, "position of the micro-batch in its rank's execution order"),
    "mb_rows": (np.int64, "rows (padded) or sequences (packed) or packed rows (packed_rows)"),
    "mb_input_len": (np.int64, "padded main-stack length in tokens (packed: longest sample)"),
    "mb_target_len": (np.int64, "padded decoder length in tokens (packed: longest sample)"),
    "mb_vision_tiles": (np.int64, "vision tiles the ViT processes"),
    "mb_tokens": (np.int64, "tokens computed: rows * (input_len + target_len), or the packed total"),
    "mb_real_tokens": (np.int64, "tokens of real samples (no padding)"),
    "mb_time_s": (np.float64, "predicted forward+backward seconds on one stage"),
    "mb_memory_bytes": (np.float64, "predicted peak activation bytes on one stage"),
}

def _json_value(obj):
    """numpy scalars and arrays as their Python values in plan metadata; anything else as text."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


#: Arrow column of a micro-batch field where it is not the field name without ``mb_``.
_ARROW_NAME = {"mb_order": "microbatch"}


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a plan: its samples (in row order) and shape, in tokens and seconds."""

    step: int
    rank: int
    index: int
    sample_ids: np.ndarray
    sample_row: np.ndarray
    rows: int
    input_len: int
    target_len: int
    vision_tiles: int
    tokens: int
    real_tokens: int
    time_s: float
    memory_bytes: float


@dataclass(frozen=True)
class BatchPlan:
    """The plan of one global batch (or, concatenated, of many steps): see the module docstring.

    ``sample_row`` is the row of each sample inside its micro-batch (its own row for padded and
    packed collation, the packed row it shares for ``packed_rows``). ``rank_time_s`` is the
    simulated pipeline makespan of each rank; ``iteration_time_s`` their maximum.
    """

    method: str
    collation: str
    num_ranks: int
    num_stages: int
    schedule: str
    sample_ids: np.ndarray
    sample_row: np.ndarray
    mb_offsets: np.ndarray
    mb_rank: np.ndarray
    mb_order: np.ndarray
    mb_rows: np.ndarray
    mb_input_len: np.ndarray
    mb_target_len: np.ndarray
    mb_vision_tiles: np.ndarray
    mb_tokens: np.ndarray
    mb_real_tokens: np.ndarray
    mb_time_s: np.ndarray
    mb_memory_bytes: np.ndarray
    rank_time_s: np.ndarray
    step: int = 0
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.collation not in COLLATIONS:
            raise ValueError(f"collation must be one of {COLLATIONS}, got {self.collation!r}")
        m = len(self.mb_offsets) - 1
        if self.mb_offsets[0] != 0 or self.mb_offsets[-1] != len(self.sample_ids) or np.any(np.diff(self.mb_offsets) <= 0):
            raise ValueError("mb_offsets must start at 0, end at len(sample_ids) and increase strictly")
        for name in _MB_COLUMNS:
            if len(getattr(self, name)) != m:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {m} micro-batches")
        if len(self.rank_time_s) != self.num_ranks:
            raise ValueError("rank_time_s needs one entry per rank")

    # -- summaries --------------------------------------------------------------------------
    @property
    def num_microbatches(self) -> int:
        """Micro-batches in the plan, over all ranks."""
        return len(self.mb_offsets) - 1

    @property
    def iteration_time_s(self) -> float:
        """Predicted time of the step: the slowest rank's simulated pipeline makespan (seconds)."""
        return float(self.rank_time_s.max()) if len(self.rank_time_s) else 0.0

    @property
    def objective_s(self) -> float:
        """The balanced pipeline objective the planner minimizes: total micro-batch time over the
        ranks plus (num_stages - 1) times the largest micro-batch (seconds; see `dynabatch.core.bounds`)."""
        if self.num_microbatches == 0:
            return 0.0
        return float(self.mb_time_s.sum() / self.num_ranks + (self.num_stages - 1) * self.mb_time_s.max())

    @property
    def rank_imbalance(self) -> float:
        """Slowest rank's time over the mean rank time (1.0 = perfectly balanced)."""
        mean = float(self.rank_time_s.mean())
        return self.iteration_time_s / mean if mean > 0 else 1.0

    @property
    def padding_efficiency(self) -> float:
        """Real tokens / computed tokens (1.0 = no padding)."""
        total = int(self.mb_tokens.sum())
        return int(self.mb_real_tokens.sum()) / total if total else 1.0

    def microbatches_per_rank(self) -> np.ndarray:
        """Number of micro-batches of each rank."""
        return np.bincount(self.mb_rank, minlength=self.num_ranks)

    def microbatches(self, rank: int | None = None) -> list[MicroBatch]:
        """The micro-batches of ``rank`` (all ranks if None) in execution order."""
        idx = np.arange(self.num_microbatches) if rank is None else np.flatnonzero(self.mb_rank == rank)
        out = []
        for k in idx:
            a, b = self.mb_offsets[k], self.mb_offsets[k + 1]
            out.append(MicroBatch(
                step=self.step, rank=int(self.mb_rank[k]), index=int(self.mb_order[k]),
                sample_ids=self.sample_ids[a:b], sample_row=self.sample_row[a:b],
                rows=int(self.mb_rows[k]), input_len=int(self.mb_input_len[k]),
                target_len=int(self.mb_target_len[k]), vision_tiles=int(self.mb_vision_tiles[k]),
                tokens=int(self.mb_tokens[k]), real_tokens=int(self.mb_real_tokens[k]),
                time_s=float(self.mb_time_s[k]), memory_bytes=float(self.mb_memory_bytes[k]),
            ))
        return out

    def fingerprint(self) -> str:
        """A stable hash of the placement and shapes (identical plans have identical fingerprints)."""
        import hashlib

        h = hashlib.sha256()
        for arr in (self.sample_ids, self.sample_row, self.mb_offsets, self.mb_rank, self.mb_order, self.mb_rows,
                    self.mb_input_len, self.mb_target_len, self.mb_vision_tiles, self.mb_time_s):
            h.update(np.ascontiguousarray(arr).tobytes())
        h.update(f"{self.method}|{self.collation}|{self.num_ranks}|{self.num_stages}|{self.step}".encode())
        return h.hexdigest()[:16]

    # -- Arrow ------------------------------------------------------------------------------
    def to_arrow(self) -> pa.Table:
        """One row per sample placement: step, rank, microbatch (position within the rank), row,
        sample_id, plus the micro-batch's shape and predicted cost columns; metadata carries the
        schema version, method, collation, world layout, rank times and options."""
        sizes = np.diff(self.mb_offsets)
        per_sample = {_ARROW_NAME.get(name, name[3:]): np.repeat(getattr(self, name), sizes) for name in _MB_COLUMNS}
        cols = {
            "step": np.full(len(self.sample_ids), self.step, np.int64),
            "rank": per_sample.pop("rank"),
            "microbatch": per_sample.pop("microbatch"),
            "row": self.sample_row.astype(np.int32),
            "sample_id": self.sample_ids.astype(np.int64),
        }
        cols.update(per_sample)
        meta = {
            "dynabatch.plan_schema_version": str(PLAN_SCHEMA_VERSION),
            "dynabatch.method": self.method,
            "dynabatch.collation": self.collation,
            "dynabatch.num_ranks": str(self.num_ranks),
            "dynabatch.num_stages": str(self.num_stages),
            "dynabatch.schedule": self.schedule,
            "dynabatch.rank_time_s": json.dumps({str(self.step): self.rank_time_s.tolist()}),
            "dynabatch.options": json.dumps(self.options, sort_keys=True, default=_json_value),
        }
        return pa.table(cols).replace_schema_metadata(meta)

    @staticmethod
    def steps_in(table: pa.Table) -> np.ndarray:
        """The step numbers a plan table holds, in ascending order."""
        return np.unique(table.column("step").to_numpy())

    @classmethod
    def from_arrow(cls, table: pa.Table, step: int | None = None) -> "BatchPlan":
        """Read the plan of one step (the only step if ``step`` is None) from `to_arrow`'s table."""
        meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
        version = meta.get("dynabatch.plan_schema_version")
        if version is None:
            raise ValueError("not a dynabatch plan table: no dynabatch.plan_schema_version in its metadata")
        if not version.isdigit() or int(version) != PLAN_SCHEMA_VERSION:
            raise ValueError(f"plan schema version {version} is not supported (this dynabatch reads {PLAN_SCHEMA_VERSION})")
        steps = table.column("step").to_numpy()
        if step is None:
            uniq = np.unique(steps)
            if len(uniq) != 1:
                raise ValueError(f"the table holds {len(uniq)} steps; pass step=")
            step = int(uniq[0])
        sel = np.flatnonzero(steps == step)
        if len(sel) == 0:
            raise ValueError(f"step {step} is not in the plan")
        col = {name: table.column(name).to_numpy()[sel] for name in table.column_names}
        rank, order = col["rank"].astype(np.int32), col["microbatch"].astype(np.int32)
        change = np.flatnonzero((np.diff(rank) != 0) | (np.diff(order) != 0)) + 1
        starts = np.concatenate(([0], change))
        offsets = np.concatenate((starts, [len(sel)])).astype(np.int64)
        mb = {name: col[_ARROW_NAME.get(name, name[3:])][starts].astype(dtype) for name, (dtype, _) in _MB_COLUMNS.items()}
        num_ranks = int(meta["dynabatch.num_ranks"])
        rank_times = json.loads(meta.get("dynabatch.rank_time_s", "{}")).get(str(step), [0.0] * num_ranks)
        return cls(
            method=meta["dynabatch.method"], collation=meta["dynabatch.collation"], num_ranks=num_ranks,
            num_stages=int(meta["dynabatch.num_stages"]), schedule=meta["dynabatch.schedule"],
            sample_ids=col["sample_id"].astype(np.int64), sample_row=col["row"].astype(np.int32),
            mb_offsets=offsets, rank_time_s=np.asarray(rank_times, np.float64), step=step,
            options=json.loads(meta.get("dynabatch.options", "{}")), **mb,
        )


_SHARED_META = ("dynabatch.plan_schema_version", "dynabatch.method", "dynabatch.collation", "dynabatch.num_ranks",
                "dynabatch.num_stages", "dynabatch.schedule")


def plans_to_arrow(plans: "list[BatchPlan]", metadata: dict[str, str] | None = None) -> pa.Table:
    """One table holding several steps' plans (a whole run), readable step by step with
    `BatchPlan.from_arrow(table, step=k)`. The plans must share method, collation, world layout
    and schedule; each step's rank times are kept. ``metadata`` adds run-level entries (dataset
    fingerprint, cost model, options...)."""
    if not plans:
        raise ValueError("plans_to_arrow needs at least one plan")
    steps = [p.step for p in plans]
    if len(set(steps)) != len(steps):
        raise ValueError("plans_to_arrow: two plans have the same step number")
    tables = [p.to_arrow() for p in plans]
    first = {k.decode(): v.decode() for k, v in tables[0].schema.metadata.items()}
    rank_times = {}
    for p, t in zip(plans, tables):
        meta = {k.decode(): v.decode() for k, v in t.schema.metadata.items()}
        for key in _SHARED_META:
            if meta[key] != first[key]:
                raise ValueError(f"step {p.step} differs in {key}: {meta[key]!r} vs {first[key]!r}")
        rank_times[str(p.step)] = p.rank_time_s.tolist()
    merged = dict(first)
    merged["dynabatch.rank_time_s"] = json.dumps(rank_times)
    merged.update(metadata or {})
    return pa.concat_tables([t.replace_schema_metadata(None) for t in tables]).replace_schema_metadata(merged)
