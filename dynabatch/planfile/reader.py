"""`RunPlan` and `load_run_plan`: the one reader of plan files (the format is in
`dynabatch.planfile.format`), used by ``dynabatch inspect`` and by ``DataLoader(source=DataSource(plan=...))``.
A `RunPlan` is a whole run's plan; each of its steps reads back as a `dynabatch.core.batchplan.BatchPlan`
(the plan records and what each holds: `dynabatch.core.batchplan`).

Reading a plan::

    run = load_run_plan("plan.parquet")          # a path (Parquet or Arrow IPC) or a pyarrow.Table
    run.check(dataset_fingerprint=index_shapes.fingerprint(), num_ranks=world_size,
              num_stages=pipeline_stages, options={"global_batch_tokens": 65536, "seed": 0})
    for k in run.steps:
        plan = run.step(k)                       # a BatchPlan, equal to what the planner returned
        for mb in plan.microbatches(rank=my_rank):
            ...                                  # mb.sample_ids, padded to mb.input_len tokens

Loading refuses, with `PlanMismatchError` (a ValueError) naming the file and what is wrong: a table
that is no plan (no schema version, another version, missing columns or metadata), ranks outside
the world, steps that are not consecutive, a sample id placed twice in one epoch (naming both
steps and ranks), and a file whose rows no longer match the integrity record its writer left
(rows deleted, duplicated or changed by hand: naming the step and rank). `check` raises it naming
everything that differs from the run about to replay the plan.

Files of older releases load too: without ``dynabatch.run_plan_version``, without an ``epoch``
column (an epoch then ends where a sample would be seen a second time), with other names for the
global batch in ``dynabatch.options`` (read by `PlanOptions.from_dict`), without integrity record.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..core.batchplan import BatchPlan
from ..core.options import DEPRECATED_NAMES, PlanOptions
from . import format as fmt
from .arrow import plan_from_arrow, step_schedule
from .integrity import PlanMismatchError, verify_rows
from .format import PLAN_SCHEMA_VERSION, RUN_PLAN_VERSION

__all__ = ["PLAN_SCHEMA_VERSION", "RUN_PLAN_VERSION", "PlanMismatchError", "RunPlan", "load_run_plan"]

_OPTION_FIELDS = frozenset(f.name for f in dataclasses.fields(PlanOptions))


def _decode(meta) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in (meta or {}).items()}


def _norm(v):
    """Option values as compared: JSON form, integral floats and digit strings as ints."""
    v = json.loads(json.dumps(v, default=str))
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and v.lstrip("-").isdigit():
        return int(v)
    return v


@dataclass(frozen=True)
class RunPlan:
    """A whole run's plan: one row per sample placement, plus the metadata of
    `dynabatch.planfile.format`; validated when built (see the module docstring).

    ``table`` is the Arrow table (rows grouped by step, then rank, then micro-batch in execution
    order); ``path`` the file it was read from, if any. Times are seconds, memory bytes.
    """

    table: pa.Table
    path: str | None = None
    metadata: dict = field(init=False, repr=False)
    options: PlanOptions = field(init=False, repr=False)
    _raw_options: dict = field(init=False, repr=False)
    _starts: np.ndarray = field(init=False, repr=False)
    _steps: np.ndarray = field(init=False, repr=False)
    _epoch_of_step: np.ndarray = field(init=False, repr=False)
    _step_options: dict | None = field(init=False, repr=False, default=None)

    # -- loading -----------------------------------------------------------------------------
    def __post_init__(self) -> None:
        where = self.name
        meta = _decode(self.table.schema.metadata)
        object.__setattr__(self, "metadata", meta)
        version = meta.get(fmt.PLAN_SCHEMA_VERSION_KEY)
        if version is None:
            raise PlanMismatchError(f"{where} is not a dynabatch plan (no {fmt.PLAN_SCHEMA_VERSION_KEY} in its "
                                    "metadata)")
        if not version.isdigit() or int(version) != PLAN_SCHEMA_VERSION:
            raise PlanMismatchError(f"{where}: plan schema version {version} is not supported (this dynabatch "
                                    f"reads version {PLAN_SCHEMA_VERSION})")
        run_version = meta.get(fmt.RUN_PLAN_VERSION_KEY)
        if run_version is not None and run_version != str(RUN_PLAN_VERSION):
            raise PlanMismatchError(f"{where}: run plan version {run_version} is not supported (this dynabatch "
                                    f"reads {RUN_PLAN_VERSION})")
        missing = [c for c in fmt.REQUIRED_COLUMNS if c not in self.table.column_names]
        if missing:
            raise PlanMismatchError(f"{where}: the plan lacks the columns {missing}")
        num_ranks, num_stages = self._int(fmt.NUM_RANKS_KEY), self._int(fmt.NUM_STAGES_KEY)
        self._read_options(num_ranks, num_stages)

        table = self.table
        steps = table.column(fmt.STEP).to_numpy()
        if len(steps) and np.any(np.diff(steps) < 0):  # rows were reordered: group them by step again
            table = table.take(pa.array(np.argsort(steps, kind="stable")))
            steps = table.column(fmt.STEP).to_numpy()
            object.__setattr__(self, "table", table)
        starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]]) if len(steps) else np.zeros(0, np.int64)
        uniq = steps[starts].astype(np.int64)
        object.__setattr__(self, "_steps", uniq)
        object.__setattr__(self, "_starts", np.append(starts, len(steps)).astype(np.int64))
        if len(uniq) and uniq[-1] - uniq[0] + 1 != len(uniq):
            gaps = np.setdiff1d(np.arange(uniq[0], uniq[-1] + 1), uniq)
            raise PlanMismatchError(f"{where}: steps are not consecutive (missing {gaps[:5].tolist()}"
                                    f"{' ...' if len(gaps) > 5 else ''})")
        rank = table.column(fmt.RANK).to_numpy()
        if len(rank) and (rank.min() < 0 or rank.max() >= num_ranks):
            bad = int(np.flatnonzero((rank < 0) | (rank >= num_ranks))[0])
            raise PlanMismatchError(f"{where}: step {int(steps[bad])} has rank {int(rank[bad])}, outside the "
                                    f"plan's {num_ranks} data-parallel ranks")
        ids = table.column(fmt.SAMPLE_ID).to_numpy().astype(np.int64, copy=False)
        epoch_rows = self._assign_epochs(table, ids)
        verify_rows(self.name, self.metadata, table, steps, rank, ids, epoch_rows)

    def _int(self, key: str) -> int:
        value = self.metadata.get(key)
        if value is None or not str(value).lstrip("-").isdigit():
            raise PlanMismatchError(f"{self.name}: metadata {key} is missing or not an integer ({value!r})")
        return int(value)

    def _read_options(self, num_ranks: int, num_stages: int) -> None:
        meta = self.metadata
        try:
            raw = json.loads(meta.get(fmt.OPTIONS_KEY, "{}"))
        except json.JSONDecodeError as e:
            raise PlanMismatchError(f"{self.name}: {fmt.OPTIONS_KEY} is not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise PlanMismatchError(f"{self.name}: {fmt.OPTIONS_KEY} is not a JSON object")
        base: dict = {"num_ranks": num_ranks, "num_stages": num_stages}
        if fmt.METHOD_KEY in meta:
            base["method"] = meta[fmt.METHOD_KEY]
        if fmt.SCHEDULE_KEY in meta:
            base["schedule"] = meta[fmt.SCHEDULE_KEY]
        if str(meta.get(fmt.SEED_KEY, "")).lstrip("-").isdigit():
            base["seed"] = int(meta[fmt.SEED_KEY])
        try:
            options = PlanOptions.from_dict({**base, **raw})
        except (TypeError, ValueError) as e:
            raise PlanMismatchError(f"{self.name}: {fmt.OPTIONS_KEY} are not valid planning options ({e})") from None
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "_raw_options", {DEPRECATED_NAMES.get(k, k): v for k, v in raw.items()})

    def _assign_epochs(self, table: pa.Table, ids: np.ndarray) -> np.ndarray | None:
        """Epoch of every step (`_epoch_of_step`); returns the epoch of every row when the file says
        it (``epoch`` column, ``dynabatch.steps_per_epoch`` or one epoch), None when it is inferred."""
        n, starts = len(self._steps), self._starts
        known = True
        spe = self._json_list(fmt.STEPS_PER_EPOCH_KEY)
        if fmt.EPOCH in table.column_names:
            of_step = table.column(fmt.EPOCH).to_numpy()[starts[:-1]].astype(np.int64) if n else np.zeros(0, np.int64)
            if n:
                of_step -= of_step.min()
        elif spe is not None and sum(spe) == n and all(isinstance(x, int) and x >= 0 for x in spe):
            of_step = np.repeat(np.arange(len(spe), dtype=np.int64), spe)
        elif str(self.metadata.get(fmt.EPOCHS_KEY, "")).strip() == "1":
            of_step = np.zeros(n, np.int64)
        else:  # an epoch ends where a sample would be seen a second time
            known = False
            uniq = np.sort(ids)
            uniq = uniq[np.r_[True, uniq[1:] != uniq[:-1]]] if len(uniq) else uniq
            dense = np.searchsorted(uniq, ids)
            seen = np.zeros(len(uniq), bool)
            of_step = np.zeros(n, np.int64)
            e = 0
            for s in range(n):
                pos = dense[starts[s]:starts[s + 1]]
                if seen[pos].any():
                    e += 1
                    seen[:] = False
                seen[pos] = True
                of_step[s] = e
        if n and np.any(np.diff(of_step) < 0):
            s = int(np.flatnonzero(np.diff(of_step) < 0)[0]) + 1
            raise PlanMismatchError(f"{self.name}: epochs are not in step order (step {int(self._steps[s])} is in "
                                    f"epoch {int(of_step[s])}, after a step of epoch {int(of_step[s - 1])})")
        object.__setattr__(self, "_epoch_of_step", of_step)
        return np.repeat(of_step, np.diff(starts)) if known else None

    def _json_list(self, key: str):
        try:
            value = json.loads(self.metadata[key])
        except (KeyError, json.JSONDecodeError):
            return None
        return value if isinstance(value, list) else None

    # -- run-level facts ---------------------------------------------------------------------
    @property
    def name(self) -> str:
        """How messages name the plan: its path, or ``the plan table``."""
        return self.path or "the plan table"

    @property
    def num_steps(self) -> int:
        """Steps in the plan (over all epochs)."""
        return len(self._steps)

    @property
    def steps(self) -> np.ndarray:
        """The step numbers, ascending and consecutive (0 .. num_steps-1 for `dynabatch plan` files)."""
        return self._steps.copy()

    @property
    def num_ranks(self) -> int:
        """Data-parallel ranks (the world size of the data-parallel group)."""
        return int(self.metadata[fmt.NUM_RANKS_KEY])

    @property
    def num_stages(self) -> int:
        """Pipeline stages."""
        return int(self.metadata[fmt.NUM_STAGES_KEY])

    @property
    def method(self) -> str:
        """Planning method (``dp``, ``dp_varlen`` or a baseline)."""
        return self.metadata.get(fmt.METHOD_KEY) or self.options.method

    @property
    def collation(self) -> str:
        """``padded``, ``packed`` or ``packed_rows``."""
        return self.metadata.get(fmt.COLLATION_KEY, "padded")

    @property
    def schedule(self) -> str:
        """The pipeline schedule the plan was simulated with (``auto`` when steps differ: see
        `step_schedule`)."""
        return self.metadata.get(fmt.SCHEDULE_KEY) or self.options.schedule

    def step_schedule(self, step: int) -> str:
        """The concrete order (``gpipe``, ``1f1b``, ``adaptive``) step ``step`` was simulated with."""
        return step_schedule(self.metadata, step) if fmt.SCHEDULE_KEY in self.metadata else self.options.schedule

    @property
    def dataset_fingerprint(self) -> str | None:
        """`Shapes.fingerprint()` of the index the plan was made from (None when not recorded)."""
        return self.metadata.get(fmt.FINGERPRINT_KEY)

    @property
    def options_dict(self) -> dict:
        """The planning options as a plain dict (`PlanOptions.to_dict()`, with ``collation``) plus the
        run's recorded ``epochs``, ``tokenizer`` and ``family`` (None when not recorded)."""
        extras = {k: self._raw_options.get(k) for k in fmt.OPTION_EXTRAS}
        if extras["epochs"] is None:
            extras["epochs"] = self.epochs
        return {**self.options.to_dict(), "collation": self.collation, **extras}

    @property
    def tokenizer(self) -> str | None:
        """The tokenizer spec that counted the planned index, when recorded."""
        return self._raw_options.get("tokenizer")

    @property
    def data_files(self) -> list | None:
        """The planned data files (`loaders.file_fingerprints` of the index), None when not recorded."""
        raw = self.metadata.get(fmt.DATA_FILES_KEY)
        return None if raw is None else json.loads(raw)

    @property
    def tokenizer_hash(self) -> str | None:
        """`tokenization.tokenizer_fingerprint` of the tokenizer that counted the planned index, when recorded."""
        return self.metadata.get(fmt.TOKENIZER_HASH_KEY)

    def check_origin(self, source, tokenizer) -> None:
        """Refuse (`PlanMismatchError`, naming the plan file and the data file or both tokenizers) to
        replay the plan over ``source`` with ``tokenizer`` when it recorded other data files or
        another tokenizer."""
        from .. import integrity

        fix = "re-plan with `dynabatch plan` for this data and tokenizer, or use those the plan was made from"
        integrity.check_data_files(PlanMismatchError, self.name, self.data_files, source, fix)
        integrity.check_tokenizer(PlanMismatchError, self.name, self.tokenizer_hash, self.tokenizer, tokenizer, fix)

    @property
    def family(self) -> str | None:
        """``decoder`` or ``encoder_decoder``, when recorded."""
        return self._raw_options.get("family")

    @property
    def epochs(self) -> int:
        """Epochs planned."""
        value = self.metadata.get(fmt.EPOCHS_KEY, "")
        return int(value) if value.isdigit() else len(self.steps_per_epoch)

    @property
    def num_epochs(self) -> int:
        """Epochs that hold steps in the file."""
        return len(self.steps_per_epoch)

    @property
    def seed(self) -> int:
        """Base seed: epoch ``e`` forms its global batches with seed ``seed + e``."""
        return self.options.seed

    @property
    def steps_per_epoch(self) -> list[int]:
        """Steps of each epoch, in order."""
        if not len(self._epoch_of_step):
            return []
        return np.bincount(self._epoch_of_step).astype(int).tolist()

    def first_step(self, epoch: int) -> int:
        """The first step of an epoch."""
        spe = self.steps_per_epoch
        if not 0 <= epoch < len(spe):
            raise ValueError(f"{self.name} holds {len(spe)} epoch(s); epoch {epoch} is not in it")
        return int(self._steps[0]) + int(sum(spe[:epoch])) if self.num_steps else 0

    @property
    def task_names(self) -> list[str]:
        """Names that the ``task_id`` column indexes (empty when the index had none)."""
        return list(json.loads(self.metadata.get(fmt.TASK_NAMES_KEY, "[]")))

    @property
    def index_info(self) -> dict:
        """Where the planned data came from (``paths``, ``samples``, ``scanned``)."""
        return json.loads(self.metadata.get(fmt.INDEX_KEY, "{}"))

    def cost_model(self):
        """The `CostModel` that predicted the plan's times and memory (None when not recorded)."""
        from ..core.cost.model import CostModel

        raw = self.metadata.get(fmt.COST_MODEL_KEY)
        return None if raw is None else CostModel.from_dict(json.loads(raw))

    def epoch_of(self, step: int) -> int:
        """The epoch a step belongs to."""
        k = int(np.searchsorted(self._steps, step))
        if k >= len(self._steps) or self._steps[k] != step:
            raise ValueError(f"step {step} is not in the plan ({self._range()})")
        return int(self._epoch_of_step[k])

    def rank_times_s(self) -> np.ndarray:
        """[num_steps, num_ranks] simulated pipeline time of each rank at each step (seconds)."""
        raw = json.loads(self.metadata.get(fmt.RANK_TIME_KEY, "{}"))
        return np.array([raw.get(str(int(s)), [0.0] * self.num_ranks) for s in self._steps], np.float64)

    def iteration_times_s(self) -> np.ndarray:
        """Predicted time of every step: its slowest rank (seconds)."""
        rt = self.rank_times_s()
        return rt.max(axis=1) if rt.size else np.zeros(self.num_steps)

    # -- steps -------------------------------------------------------------------------------
    def _range(self) -> str:
        return f"it holds steps {self._steps[0]}..{self._steps[-1]}" if len(self._steps) else "it holds no steps"

    def step_rows(self, step: int) -> pa.Table:
        """The placement rows of one step (a zero-copy slice of ``table``)."""
        k = int(np.searchsorted(self._steps, step))
        if k >= len(self._steps) or self._steps[k] != step:
            raise ValueError(f"step {step} is not in the plan ({self._range()})")
        a, b = self._starts[k], self._starts[k + 1]
        return self.table.slice(int(a), int(b - a))

    def step(self, step: int) -> BatchPlan:
        """The `BatchPlan` of one step, equal to what `plan_microbatches` returned when planning."""
        try:
            plan = plan_from_arrow(self.step_rows(step), step=int(step))
        except ValueError as e:  # name the file (a plan of an older release lacking a column)
            raise PlanMismatchError(f"{self.name}: {e}") from None
        opts = self.step_options(step)
        return dataclasses.replace(plan, options=dict(plan.options if opts is None else opts))

    def step_options(self, step: int) -> dict | None:
        """The ``options`` of one step's `BatchPlan` (e.g. its ``recompute_layers``), read from the
        metadata without decoding the step's rows; None when the file records none."""
        if self._step_options is None:  # frozen: cache the decoded metadata once
            object.__setattr__(self, "_step_options", json.loads(self.metadata.get(fmt.STEP_OPTIONS_KEY, "{}")))
        raw = self._step_options
        opts = raw.get("steps", {}).get(str(int(step)), raw.get("default"))
        return None if opts is None else dict(opts)

    def recompute_summary(self) -> dict | None:
        """Per-stage recomputation over the run's steps (`dynabatch.core.plan.recompute`): policy, device
        limit (bytes), mean recomputed layers and max peak bytes per stage; None when it records none."""
        opts = [self.step_options(int(k)) or {} for k in self.steps]
        if not opts or "recompute_layers" not in opts[0]:
            return None
        return {"policy": opts[0].get("recompute"), "device_memory_limit": opts[0].get("device_memory_limit"),
                "mean_layers_per_stage": np.mean([o["recompute_layers"] for o in opts], axis=0).tolist(),
                "max_peak_bytes_per_stage": np.max([o["stage_peak_bytes"] for o in opts], axis=0).tolist()}

    # -- checks ------------------------------------------------------------------------------
    def recorded(self, name: str) -> bool:
        """Whether the file records option ``name`` (files of older releases record fewer)."""
        return name in ("method", "collation") or name in self._raw_options

    def option(self, name: str):
        """The plan's value of an option: a `PlanOptions` field, ``collation``, or a recorded extra
        (``epochs``, ``tokenizer``, ``family``); None when the file does not record it."""
        if name == "collation":
            return self.collation
        if name == "method":
            return self.method
        if not self.recorded(name):
            return None
        return getattr(self.options, name) if name in _OPTION_FIELDS else self._raw_options.get(name)

    def check(self, *, dataset_fingerprint=None, num_ranks: int | None = None, num_stages: int | None = None,
              options: dict | None = None, sample_ids=None) -> None:
        """Raise `PlanMismatchError` naming everything that differs between the plan and this run:

        * ``dataset_fingerprint``: `Shapes.fingerprint()` of the index the loader reads (a string, or
          several accepted ones); a plan that records none is refused;
        * ``num_ranks`` (the data-parallel world size) and ``num_stages``;
        * ``options``: ``{name: value}`` by `PlanOptions` field name (``global_batch_tokens``,
          ``max_len``...), ``collation`` or a recorded extra (``tokenizer``, ``family``, ``epochs``);
          None values and options the plan does not record are not compared;
        * ``sample_ids``: the ids of the data; the plan may only name those.
        """
        diffs = []
        if dataset_fingerprint is not None:
            accepted = [dataset_fingerprint] if isinstance(dataset_fingerprint, str) else sorted(dataset_fingerprint)
            fp = self.dataset_fingerprint
            if fp is None:
                diffs.append(f"it records no {fmt.FINGERPRINT_KEY}, so it cannot be checked against the data "
                             "(re-create it with `dynabatch plan`, which records the length index's fingerprint)")
            elif fp not in accepted:
                diffs.append(f"dataset fingerprint is {fp} in the plan but {accepted[0]} here: another dataset "
                             "(other samples, token counts or tokenization settings); re-plan this data, or use the "
                             "index the plan was made from")
        if num_ranks is not None and int(num_ranks) != self.num_ranks:
            diffs.append(f"world size (data-parallel ranks) is {self.num_ranks} in the plan but {int(num_ranks)} here")
        if num_stages is not None and int(num_stages) != self.num_stages:
            diffs.append(f"pipeline stages are {self.num_stages} in the plan but {int(num_stages)} here")
        for key, value in (options or {}).items():
            if value is None or not self.recorded(key):
                continue
            have, want = _norm(self.option(key)), _norm(value)
            if have != want:
                diffs.append(f"option {key!r} is {have!r} in the plan but {want!r} here")
        if sample_ids is not None:
            ids = self.table.column(fmt.SAMPLE_ID).to_numpy().astype(np.int64, copy=False)
            data = np.sort(np.asarray(sample_ids, np.int64))
            pos = np.minimum(np.searchsorted(data, ids), max(len(data) - 1, 0))
            bad = data[pos] != ids if len(data) else np.ones(len(ids), bool)
            if bad.any():
                diffs.append(f"it lists {int(bad.sum())} placements of sample ids that are not in the data "
                             f"(e.g. {sorted(set(ids[bad][:100].tolist()))[:3]})")
        if diffs:
            raise PlanMismatchError(f"{self.name} does not match this run: " + "; ".join(diffs))

    def write(self, path) -> None:
        """Write the plan as Parquet (zstd); metadata is kept."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(self.table, str(path), compression="zstd")


def load_run_plan(plan) -> RunPlan:
    """Read a plan: a path to a Parquet file (or Arrow IPC: ``.arrow``, ``.feather``, ``.ipc``)
    written by ``dynabatch plan`` / `RunPlan.write` / `plans_to_arrow`, or such a `pyarrow.Table`.

    Raises FileNotFoundError for a missing path and `PlanMismatchError` (a ValueError) naming the
    file when it cannot be read or is not a valid plan (see the module docstring)."""
    if isinstance(plan, RunPlan):
        return plan
    if isinstance(plan, pa.Table):
        return RunPlan(plan)
    path = os.fspath(plan)
    if not os.path.exists(path):
        raise FileNotFoundError(f"plan file {path} does not exist")
    try:
        if path.endswith((".arrow", ".feather", ".ipc")):
            with pa.memory_map(path) as mm:
                table = pa.ipc.open_file(mm).read_all()
        else:
            table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise PlanMismatchError(f"{path}: cannot read the plan file ({e})") from None
    return RunPlan(table, path)
