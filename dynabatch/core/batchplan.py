"""`BatchPlan` and `MicroBatch`: which samples go into which micro-batch on which rank, in
which order, with each micro-batch's padded shape and predicted cost.

A `BatchPlan` is columnar: per-sample placement arrays (`sample_ids`, `sample_row`) cut into
micro-batches by `mb_offsets`, and per-micro-batch arrays (rank, position within the rank,
shape, predicted time and memory). Micro-batches are stored rank by rank in execution order.
Its on-disk form (one row per sample placement) is the plan-file format of `dynabatch.planfile`
(`plan_to_arrow`, `plan_from_arrow`, `plans_to_arrow`); `core` itself never reads or writes files.

The plan records, each carrying something the others do not (none is a copy of another):

* `BatchPlan` (here): one global batch planned over all ranks and stages, columnar: what
  `plan_microbatches` returns and a plan file's step reads back as.
* `MicroBatch` (here): one micro-batch of a `BatchPlan`, as a row (`BatchPlan.microbatch`).
* `dynabatch.planfile.RunPlan`: a whole run's plan file: every step's placement rows plus the
  run's metadata (options, data fingerprints, epochs), validated when read.
* `dynabatch.offline.runplan.RunPlanConfig`: what to plan offline (the `PlanOptions`, epochs, how
  the index was tokenized): the request `plan_run` turns into a `RunPlan`, not a plan.
* `dynabatch.loader.records.StepPlan` / `MicroBatchPlan`: one rank's share of one optimizer step as
  the DataLoader runs it: its `MicroBatch` es in execution order under the loader's collation
  (`MicroBatchPlan.of`), zero-token placeholders up to the step's count, the step's counters and
  the all-rank token totals the loss is normalized by.
* ``tokenization._format._TokenizedBatch`` is a tokenized batch, not a plan (renamed from
  ``_BatchPlan``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .kernels.objective import objective_kernel
from .options import COLLATIONS

#: Per-micro-batch fields: name -> (dtype, meaning).
MB_FIELDS = {
    "mb_rank": (np.int32, "data-parallel rank that runs the micro-batch"),
    "mb_order": (np.int32, "position of the micro-batch in its rank's execution order"),
    "mb_rows": (np.int64, "rows (padded), sequences (packed) or packed rows of the micro-batch"),
    "mb_input_len": (np.int64, "padded main-stack length, tokens (packed: longest sample)"),
    "mb_target_len": (np.int64, "padded decoder length, tokens"),
    "mb_vision_tiles": (np.int64, "image tiles the vision encoder processes"),
    "mb_tokens": (np.int64, "tokens computed: rows x (input_len + target_len), or the packed total (an "
                          "encoder-decoder's two rows)"),
    "mb_real_tokens": (np.int64, "tokens of the micro-batch's samples"),
    "mb_target_tokens": (np.int64, "decoder (target) tokens of the micro-batch's samples, summed: packed, the "
                                   "decoder row's length (0 without a decoder stack)"),
    "mb_time_s": (np.float64, "predicted forward+backward seconds of the micro-batch on one stage (per-stage "
                              "plans: on its slowest stage)"),
    "mb_memory_bytes": (np.float64, "predicted peak activation bytes of the micro-batch on one stage (per-stage "
                                    "plans: on its largest stage)"),
}


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
    target_tokens: int
    time_s: float
    memory_bytes: float


@dataclass(frozen=True)
class BatchPlan:
    """The plan of one global batch (or, concatenated, of many steps): see the module docstring.

    ``sample_row`` is the row of each sample inside its micro-batch (its own row for padded and
    packed collation, the packed row it shares for ``packed_rows``). ``rank_time_s`` is the
    simulated pipeline makespan of each rank; ``iteration_time_s`` their maximum. ``schedule`` is the
    concrete order those makespans were simulated with and the runner follows (``gpipe``, ``1f1b`` or
    ``adaptive``; planning with ``schedule="auto"`` records the one it chose for this step).
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
    mb_target_tokens: np.ndarray
    mb_time_s: np.ndarray
    mb_memory_bytes: np.ndarray
    rank_time_s: np.ndarray
    step: int = 0
    options: dict = field(default_factory=dict)
    #: Per-stage predictions ``[num_stages, M]`` (seconds, bytes), micro-batches in plan order: set by the
    #: planner's per-stage path (a cost model with a non-uniform `StageLayout`) and `evaluate_plan`;
    #: None when every stage costs ``mb_time_s`` / ``mb_memory_bytes``.
    stage_time_s: np.ndarray | None = None
    stage_memory_bytes: np.ndarray | None = None
    #: The op order the planner simulated, int32 ``[num_stages, M, 2]``: ``op_slots[s, j, 0]`` is the
    #: position of micro-batch ``j``'s forward in stage ``s``'s op list of ``j``'s rank, ``[s, j, 1]`` of
    #: its backward (`dynabatch.core.schedule.orders`, which derives it, records it and reads it back for the
    #: runner, inspect and recompute). None for plans of older plan files.
    op_slots: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.collation not in COLLATIONS:
            raise ValueError(f"collation must be one of {COLLATIONS}, got {self.collation!r}")
        m = len(self.mb_offsets) - 1
        if self.mb_offsets[0] != 0 or self.mb_offsets[-1] != len(self.sample_ids) or np.any(np.diff(self.mb_offsets) <= 0):
            raise ValueError("mb_offsets must start at 0, end at len(sample_ids) and increase strictly")
        for name in MB_FIELDS:
            if len(getattr(self, name)) != m:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {m} micro-batches")
        if len(self.rank_time_s) != self.num_ranks:
            raise ValueError("rank_time_s needs one entry per rank")
        for name in ("stage_time_s", "stage_memory_bytes"):
            v = getattr(self, name)
            if v is not None:
                v = np.asarray(v, np.float64)
                if v.shape != (self.num_stages, m):
                    raise ValueError(f"{name} must be [num_stages, M] = [{self.num_stages}, {m}], got {v.shape}")
                object.__setattr__(self, name, v)
        if self.op_slots is not None:
            v = np.asarray(self.op_slots, np.int32)
            if v.shape != (self.num_stages, m, 2):
                raise ValueError(f"op_slots must be [num_stages, M, 2] = [{self.num_stages}, {m}, 2], got {v.shape}")
            object.__setattr__(self, "op_slots", v)

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
        ranks plus (num_stages - 1) times the largest micro-batch (seconds; see `dynabatch.core.plan.bounds`)."""
        if self.num_microbatches == 0:
            return 0.0
        return float(objective_kernel(float(self.mb_time_s.sum()), float(self.mb_time_s.max()), self.num_ranks,
                                      self.num_stages))

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

    def rank_indices(self, rank: int) -> np.ndarray:
        """Indices (int64) of ``rank``'s micro-batches in its execution order (``mb_order``)."""
        idx = np.flatnonzero(self.mb_rank == rank)
        return idx[np.argsort(self.mb_order[idx], kind="stable")]

    def microbatch(self, k: int) -> MicroBatch:
        """Micro-batch ``k`` (an index into the ``mb_*`` columns) as a `MicroBatch`."""
        a, b = self.mb_offsets[k], self.mb_offsets[k + 1]
        return MicroBatch(
            step=self.step, rank=int(self.mb_rank[k]), index=int(self.mb_order[k]),
            sample_ids=self.sample_ids[a:b], sample_row=self.sample_row[a:b],
            rows=int(self.mb_rows[k]), input_len=int(self.mb_input_len[k]),
            target_len=int(self.mb_target_len[k]), vision_tiles=int(self.mb_vision_tiles[k]),
            tokens=int(self.mb_tokens[k]), real_tokens=int(self.mb_real_tokens[k]),
            target_tokens=int(self.mb_target_tokens[k]),
            time_s=float(self.mb_time_s[k]), memory_bytes=float(self.mb_memory_bytes[k]),
        )

    def microbatches(self, rank: int | None = None) -> list[MicroBatch]:
        """The micro-batches of ``rank`` (all ranks if None) in execution order."""
        idx = np.arange(self.num_microbatches) if rank is None else np.flatnonzero(self.mb_rank == rank)
        return [self.microbatch(k) for k in idx]

    def fingerprint(self) -> str:
        """A stable hash of the placement and shapes (identical plans have identical fingerprints)."""
        import hashlib

        h = hashlib.sha256()
        for arr in (self.sample_ids, self.sample_row, self.mb_offsets, self.mb_rank, self.mb_order, self.mb_rows,
                    self.mb_input_len, self.mb_target_len, self.mb_vision_tiles, self.mb_time_s):
            h.update(np.ascontiguousarray(arr).tobytes())
        if self.stage_time_s is not None:  # only per-stage plans: the fingerprints of others stay as they were
            h.update(np.ascontiguousarray(self.stage_time_s).tobytes())
        h.update(f"{self.method}|{self.collation}|{self.num_ranks}|{self.num_stages}|{self.step}".encode())
        return h.hexdigest()[:16]
