"""`RunPlan` and `load_run_plan`: read a whole run's offline plan (written by `dynabatch plan`)
step by step, and check that it belongs to the run about to replay it.

A DataLoader replaying a plan file does::

    run = load_run_plan("plan.parquet")
    run.check(dataset_fingerprint=index_shapes.fingerprint(), num_ranks=world_size,
              num_stages=pipeline_stages, options={"global_batch_tokens": 65536, "seed": 0})
    for k in range(run.num_steps):
        plan = run.step(k)                       # a BatchPlan
        for mb in plan.microbatches(rank=my_rank):
            ...                                  # mb.sample_ids, padded to mb.input_len tokens

`check` raises `PlanMismatchError` (a ValueError) naming every field that differs.

Metadata keys of a run plan file (all strings; JSON where noted):

    dynabatch.plan_schema_version  the BatchPlan row format (`dynabatch.PLAN_SCHEMA_VERSION`)
    dynabatch.run_plan_version     this run-level layout (`RUN_PLAN_VERSION`)
    dynabatch.method / collation / schedule / num_ranks / num_stages
    dynabatch.dataset_fingerprint  `Shapes.fingerprint()` of the planned index
    dynabatch.cost_model           JSON `CostModel.to_dict()` of the model that predicted the costs
    dynabatch.options              JSON: method, collation, max_len, max_target_len,
                                   global_batch_tokens, seed, epochs, tokenizer, drop_last, schedule,
                                   family (decoder/encoder_decoder, when known)
    dynabatch.epochs, dynabatch.seed
    dynabatch.steps_per_epoch      JSON list: steps of epoch 0, 1, ... (steps are numbered across epochs)
    dynabatch.rank_time_s          JSON {step: [simulated pipeline seconds of each rank]}
    dynabatch.step_options         JSON {"default": options of every step's BatchPlan, "steps": {step: exceptions}}
    dynabatch.task_names           JSON list that the task_id column indexes
    dynabatch.index                JSON: paths of the planned data/index, samples, whether it was scanned
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..core.batchplan import BatchPlan
from ..offline.inputs import FINGERPRINT_KEY, OfflineError

RUN_PLAN_VERSION = 1
_MISSING = object()


class PlanMismatchError(OfflineError):
    """A run plan that was made for another dataset, world layout or options."""


def _decode(meta) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in (meta or {}).items()}


@dataclass(frozen=True)
class RunPlan:
    """A whole run's plan: one row per sample placement (see `dynabatch plan --help` for the
    columns), plus the metadata described in the module docstring.

    ``table`` is the Arrow table (rows grouped by step, then rank, then micro-batch in execution
    order); ``path`` the file it was read from, if any. Times are seconds, memory bytes.
    """

    table: pa.Table
    path: str | None = None
    metadata: dict = field(init=False, repr=False)
    _starts: np.ndarray = field(init=False, repr=False)
    _steps: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        where = self.path or "run plan"
        meta = _decode(self.table.schema.metadata)
        for key in ("dynabatch.plan_schema_version", "dynabatch.run_plan_version", FINGERPRINT_KEY):
            if key not in meta:
                raise OfflineError(f"{where}: not a dynabatch run plan (no {key} in its metadata)")
        if meta["dynabatch.run_plan_version"] != str(RUN_PLAN_VERSION):
            raise OfflineError(f"{where}: run plan version {meta['dynabatch.run_plan_version']} is not supported "
                               f"(this dynabatch reads {RUN_PLAN_VERSION})")
        table = self.table
        steps = table.column("step").to_numpy()
        if len(steps) and np.any(np.diff(steps) < 0):  # rows were reordered: group them by step again
            table = table.take(pa.array(np.argsort(steps, kind="stable")))
            steps = table.column("step").to_numpy()
            object.__setattr__(self, "table", table)
        uniq, starts = np.unique(steps, return_index=True)
        object.__setattr__(self, "metadata", meta)
        object.__setattr__(self, "_steps", uniq)
        object.__setattr__(self, "_starts", np.append(starts, len(steps)).astype(np.int64))

    # -- run-level facts ---------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        """Steps in the plan (over all epochs)."""
        return len(self._steps)

    @property
    def steps(self) -> np.ndarray:
        """The step numbers, ascending (0 .. num_steps-1 for files written by `dynabatch plan`)."""
        return self._steps.copy()

    @property
    def num_ranks(self) -> int:
        """Data-parallel ranks (the world size of the data-parallel group)."""
        return int(self.metadata["dynabatch.num_ranks"])

    @property
    def num_stages(self) -> int:
        """Pipeline stages."""
        return int(self.metadata["dynabatch.num_stages"])

    @property
    def method(self) -> str:
        """Planning method (``dp``, ``dp_varlen`` or a baseline)."""
        return self.metadata["dynabatch.method"]

    @property
    def collation(self) -> str:
        """``padded``, ``packed`` or ``packed_rows``."""
        return self.metadata["dynabatch.collation"]

    @property
    def dataset_fingerprint(self) -> str:
        """`Shapes.fingerprint()` of the index the plan was made from."""
        return self.metadata[FINGERPRINT_KEY]

    @property
    def options(self) -> dict:
        """The run's planning options (``dynabatch.options``)."""
        return json.loads(self.metadata.get("dynabatch.options", "{}"))

    @property
    def epochs(self) -> int:
        """Epochs planned."""
        return int(self.metadata.get("dynabatch.epochs", 1))

    @property
    def seed(self) -> int:
        """Base seed: epoch ``e`` forms its global batches with seed ``seed + e``."""
        return int(self.metadata.get("dynabatch.seed", 0))

    @property
    def steps_per_epoch(self) -> list[int]:
        """Steps of each epoch, in order."""
        return list(json.loads(self.metadata.get("dynabatch.steps_per_epoch", json.dumps([self.num_steps]))))

    @property
    def task_names(self) -> list[str]:
        """Names that the ``task_id`` column indexes (empty when the index had none)."""
        return list(json.loads(self.metadata.get("dynabatch.task_names", "[]")))

    @property
    def index_info(self) -> dict:
        """Where the planned data came from (``paths``, ``samples``, ``scanned``)."""
        return json.loads(self.metadata.get("dynabatch.index", "{}"))

    def cost_model(self):
        """The `CostModel` that predicted the plan's times and memory."""
        from ..core.cost import CostModel

        return CostModel.from_dict(json.loads(self.metadata["dynabatch.cost_model"]))

    def epoch_of(self, step: int) -> int:
        """The epoch a step belongs to."""
        ends = np.cumsum(self.steps_per_epoch)
        e = int(np.searchsorted(ends, step, side="right"))
        if not 0 <= step < (ends[-1] if len(ends) else 0):
            raise ValueError(f"step {step} is not in the plan (0..{self.num_steps - 1})")
        return e

    def rank_times_s(self) -> np.ndarray:
        """[num_steps, num_ranks] simulated pipeline time of each rank at each step (seconds)."""
        raw = json.loads(self.metadata.get("dynabatch.rank_time_s", "{}"))
        return np.array([raw.get(str(int(s)), [0.0] * self.num_ranks) for s in self._steps], np.float64)

    def iteration_times_s(self) -> np.ndarray:
        """Predicted time of every step: its slowest rank (seconds)."""
        rt = self.rank_times_s()
        return rt.max(axis=1) if rt.size else np.zeros(self.num_steps)

    # -- steps -------------------------------------------------------------------------------
    def step_rows(self, step: int) -> pa.Table:
        """The placement rows of one step (a zero-copy slice of ``table``)."""
        k = int(np.searchsorted(self._steps, step))
        if k >= len(self._steps) or self._steps[k] != step:
            raise ValueError(f"step {step} is not in the plan (it holds steps {self._steps[0]}..{self._steps[-1]})"
                             if len(self._steps) else "the plan holds no steps")
        a, b = self._starts[k], self._starts[k + 1]
        return self.table.slice(int(a), int(b - a))

    def step(self, step: int) -> BatchPlan:
        """The `BatchPlan` of one step, equal to what `plan_microbatches` returned when planning."""
        plan = BatchPlan.from_arrow(self.step_rows(step), step=int(step))
        raw = json.loads(self.metadata.get("dynabatch.step_options", "{}"))
        opts = raw.get("steps", {}).get(str(int(step)), raw.get("default", plan.options))
        return dataclasses.replace(plan, options=dict(opts))

    # -- checks ------------------------------------------------------------------------------
    def check(self, *, dataset_fingerprint: str | None = None, num_ranks: int | None = None,
              num_stages: int | None = None, options: dict | None = None) -> None:
        """Raise `PlanMismatchError` (a ValueError) naming everything that differs between the plan
        and the given run: the dataset fingerprint (`Shapes.fingerprint()` of the index the loader
        reads), the data-parallel world size, the pipeline stages, and each given option (only the
        keys passed are compared, e.g. ``{"global_batch_tokens": 65536, "seed": 0}``)."""
        diffs = []
        if dataset_fingerprint is not None and str(dataset_fingerprint) != self.dataset_fingerprint:
            diffs.append(f"dataset fingerprint is {self.dataset_fingerprint} in the plan but {dataset_fingerprint} "
                         "here (the data, its tokenizer or its order changed)")
        if num_ranks is not None and int(num_ranks) != self.num_ranks:
            diffs.append(f"world size (data-parallel ranks) is {self.num_ranks} in the plan but {int(num_ranks)} here")
        if num_stages is not None and int(num_stages) != self.num_stages:
            diffs.append(f"pipeline stages are {self.num_stages} in the plan but {int(num_stages)} here")
        stored = self.options
        for key, value in (options or {}).items():
            have = stored.get(key, _MISSING)
            want = json.loads(json.dumps(value, default=str))
            if have is _MISSING:
                diffs.append(f"option {key!r} is not recorded in the plan (here {want!r})")
            elif have != want:
                diffs.append(f"option {key!r} is {have!r} in the plan but {want!r} here")
        if diffs:
            raise PlanMismatchError(f"{self.path or 'run plan'} does not match this run: " + "; ".join(diffs))

    def write(self, path) -> None:
        """Write the plan as Parquet (zstd); metadata is kept."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(self.table, str(path), compression="zstd")


def load_run_plan(path) -> RunPlan:
    """Read a plan file written by `dynabatch plan` / `RunPlan.write`; raises `OfflineError`
    (a ValueError) naming the file when it is not one."""
    try:
        table = pq.read_table(str(path))
    except (pa.ArrowInvalid, OSError) as e:
        raise OfflineError(f"{path}: cannot read a run plan ({e})") from None
    return RunPlan(table, str(path))
