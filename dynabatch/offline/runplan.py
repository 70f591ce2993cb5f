"""`plan_run`: the plan of a whole training run (every step, rank and micro-batch), made offline.

Seeding and step numbering (what a loader replaying the file relies on):

* epoch ``e`` cuts the index into global batches with
  ``split_global_batches(shapes, global_batch_tokens, seed=seed + e, tokens=sample_tokens(...),
  drop_last=drop_last)``: a seeded random permutation of all samples, cut each time a batch's
  own tokens (main + decoder tokens after truncation to ``max_len``/``max_target_len``) reach
  ``global_batch_tokens``. With ``drop_last`` (the default) the last, smaller batch of each
  epoch is left out.
* steps are numbered from 0 across epochs: epoch 0 holds steps ``0 .. n0-1``, epoch 1 steps
  ``n0 .. n0+n1-1``, and so on (``dynabatch.steps_per_epoch`` records the ``n_e``).
* step ``k`` is ``plan_microbatches(shapes.take(batch_k), cost, num_stages=, num_ranks=,
  method=, max_len=, max_target_len=, schedule=, step=k)``; global batches are independent,
  so they are planned in parallel (`engines.map_parts`) and the result does not depend on the
  number of workers or the engine.

`plan_step` re-plans one step exactly as `plan_run` did (used by the tests, and handy to
check a file against the current code).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa

from .. import __version__
from ..core.baselines import BASELINE_COLLATION
from ..core.batchplan import plans_to_arrow
from ..core.cost import CostModel
from ..core.plan import METHODS, SCHEDULES, PlanningError, plan_microbatches, split_global_batches
from ..core.shapes import Shapes
from .engines import default_workers, map_parts
from .inputs import FINGERPRINT_KEY, Index, OfflineError
from ..planfile.reader import RUN_PLAN_VERSION, RunPlan


@dataclass(frozen=True)
class RunPlanConfig:
    """What to plan: world layout, global batch size in tokens, epochs, seed, method.

    ``max_len``/``max_target_len`` truncate each sample's main-stack/decoder tokens (as the
    trainer will); ``tokenizer`` and ``family`` (how the index was tokenized, when known) are
    only recorded in the options so a loader can check them.
    """

    num_ranks: int = 8
    num_stages: int = 4
    global_batch_tokens: int = 65536
    epochs: int = 1
    seed: int = 0
    method: str = "dp"
    max_len: int | None = 2048
    max_target_len: int | None = 512
    schedule: str = "1f1b"
    drop_last: bool = True
    tokenizer: str | None = None
    family: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {METHODS}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {tuple(SCHEDULES)}")
        for name in ("num_ranks", "num_stages", "global_batch_tokens", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def collation(self) -> str:
        """How micro-batches are collated: ``padded`` (dp), ``packed`` (dp_varlen) or the baseline's."""
        return {"dp": "padded", "dp_varlen": "packed"}.get(self.method) or BASELINE_COLLATION[self.method]

    def options(self) -> dict:
        """The ``dynabatch.options`` metadata: everything a loader may check."""
        d = asdict(self)
        for k in ("num_ranks", "num_stages"):
            d.pop(k)
        d["collation"] = self.collation
        return d


def sample_tokens(shapes: Shapes, cost: CostModel, config: RunPlanConfig) -> np.ndarray:
    """Tokens each sample costs the model after truncation: main + decoder tokens (int64)."""
    main, dec, _ = cost.sample_dims(shapes, config.max_len, config.max_target_len)
    return main + dec


def global_batches(shapes: Shapes, cost: CostModel, config: RunPlanConfig, epoch: int) -> list[np.ndarray]:
    """Positions (into ``shapes``) of each global batch of ``epoch`` (see the module docstring)."""
    return split_global_batches(shapes, config.global_batch_tokens, seed=config.seed + epoch,
                                tokens=sample_tokens(shapes, cost, config), drop_last=config.drop_last)


def plan_step(shapes: Shapes, cost: CostModel, config: RunPlanConfig, positions: np.ndarray, step: int):
    """The `BatchPlan` of one global batch (``positions`` into ``shapes``), numbered ``step``."""
    return plan_microbatches(shapes.take(np.asarray(positions)), cost, num_stages=config.num_stages,
                             num_ranks=config.num_ranks, method=config.method, max_len=config.max_len,
                             max_target_len=config.max_target_len, schedule=config.schedule, step=int(step))


def _plan_chunk(context, chunk):
    """Worker: plan a few consecutive steps; PlanningError messages gain the step and epoch."""
    shapes, cost, config = context
    out = []
    for step, epoch, positions in chunk:
        try:
            out.append(plan_step(shapes, cost, config, positions, step))
        except PlanningError as e:
            raise PlanningError(f"step {step} (epoch {epoch}): {e}") from None
    return out


def plan_run(index: Index | Shapes, cost: CostModel, config: RunPlanConfig, *, engine: str = "local",
             workers: int | None = None, progress: bool = True) -> RunPlan:
    """Plan every step of ``config.epochs`` epochs over ``index`` and return the `RunPlan`
    (write it with ``.write(path)``). Raises `OfflineError` when the data holds no global batch
    and `PlanningError` (naming the step) when a step cannot be planned."""
    if isinstance(index, Shapes):
        index = Index(index, [], [], False)
    shapes = index.shapes
    steps, per_epoch = [], []
    for e in range(config.epochs):
        batches = global_batches(shapes, cost, config, e)
        per_epoch.append(len(batches))
        steps.extend((len(steps), e, b) for b in batches)
    if not steps:
        tok = int(sample_tokens(shapes, cost, config).sum())
        raise OfflineError(f"the data ({len(shapes)} samples, {tok} tokens after truncation) holds less than one "
                           f"global batch of {config.global_batch_tokens} tokens; lower --global-batch-tokens")
    workers = workers or default_workers()
    size = max(1, min(16, math.ceil(len(steps) / (8 * workers))))
    chunks = [steps[i:i + size] for i in range(0, len(steps), size)]
    results = map_parts(_plan_chunk, chunks, (shapes, cost, config), engine=engine, workers=workers,
                        progress=progress, desc="plan", unit="step", weights=[len(c) for c in chunks])
    plans = [p for part in results for p in part]
    default_opts = plans[0].options
    step_opts = {str(p.step): p.options for p in plans if p.options != default_opts}
    meta = {
        "dynabatch.run_plan_version": str(RUN_PLAN_VERSION),
        "dynabatch.created_by": f"dynabatch {__version__}",
        FINGERPRINT_KEY: index.fingerprint,
        "dynabatch.cost_model": json.dumps(cost.to_dict()),
        "dynabatch.options": json.dumps(config.options(), sort_keys=True),
        "dynabatch.epochs": str(config.epochs),
        "dynabatch.seed": str(config.seed),
        "dynabatch.steps_per_epoch": json.dumps(per_epoch),
        "dynabatch.step_options": json.dumps({"default": default_opts, "steps": step_opts}, sort_keys=True,
                                             default=str),
        "dynabatch.task_names": json.dumps(index.task_names),
        "dynabatch.index": json.dumps({"paths": index.paths, "samples": len(shapes), "scanned": index.scanned,
                                       "scan": index.scan_options}, sort_keys=True),
    }
    table = plans_to_arrow(plans, meta)
    return RunPlan(_with_sample_columns(table, shapes, cost, config, per_epoch))


def _with_sample_columns(table: pa.Table, shapes: Shapes, cost: CostModel, config: RunPlanConfig,
                         per_epoch: list[int]) -> pa.Table:
    """Append per-placement ``epoch``, ``task_id`` (when the index has tasks) and ``sample_tokens``."""
    ids = table.column("sample_id").to_numpy()
    sorter = np.argsort(shapes.sample_id, kind="stable")
    pos = sorter[np.searchsorted(shapes.sample_id, ids, sorter=sorter)]
    epoch_of_step = np.repeat(np.arange(len(per_epoch), dtype=np.int32), per_epoch)
    meta = table.schema.metadata
    table = table.append_column("epoch", pa.array(epoch_of_step[table.column("step").to_numpy()]))
    if np.any(shapes.task_id >= 0):
        table = table.append_column("task_id", pa.array(shapes.task_id[pos].astype(np.int32)))
    tok = sample_tokens(shapes, cost, config)[pos]
    table = table.append_column("sample_tokens", pa.array(tok.astype(np.int32)))
    return table.replace_schema_metadata(meta)
