"""`plan_run`: the plan of a whole training run (every step, rank and micro-batch), made offline.

Global batches and plans come from `dynabatch.core.plan.steps` with the run's `PlanOptions`, the very
functions a `DataLoader` with the same options calls online, so a loader replaying the file yields
exactly what it would have planned itself:

* epoch ``e`` is `global_batches(shapes, cost, options, e)` (seed ``options.seed + e``);
* steps are numbered from 0 across epochs: epoch 0 holds steps ``0 .. n0-1``, epoch 1 steps
  ``n0 .. n0+n1-1``, and so on (``dynabatch.steps_per_epoch`` records the ``n_e``);
* step ``k`` is `plan_step(shapes, cost, options, batch_k, k)`; global batches are independent, so
  they are planned in parallel (`engines.map_parts`) and the result does not depend on the number
  of workers or the engine.

`RunPlanConfig` is what to plan (the request), `dynabatch.planfile.RunPlan` the plan file it becomes;
the other plan records: `dynabatch.core.batchplan`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from .. import __version__
from ..planfile.arrow import plans_to_arrow
from ..core.cost.model import CostModel
from ..core.options import UNSET, PlanOptions, given
from ..core.plan.planner import PlanningError
from ..core.shapes import Shapes
from ..core.plan.steps import global_batches, oversized_samples, plan_step, sample_tokens
from ..engines import map_parts, workers_for
from .inputs import Index, OfflineError
from ..planfile import format as fmt
from ..planfile.format import RUN_PLAN_VERSION
from ..planfile.reader import RunPlan


@dataclass(frozen=True, init=False)
class RunPlanConfig:
    """What to plan: the `PlanOptions` of every step, how many epochs, and how the index was
    tokenized (``tokenizer``, ``family``: recorded so a loader can check them).
    ``loader_differences``: options taken at ``dynabatch plan``'s own defaults where the
    DataLoader's differ (name -> text), recorded in the ``dynabatch.options`` metadata under
    ``loader_default_differences``.

    ``RunPlanConfig(options, epochs=2)``; the flat keywords of earlier releases
    (``RunPlanConfig(num_ranks=8, global_batch_tokens=65536, ...)``) still work for one release with
    a DeprecationWarning.
    """

    options: PlanOptions
    epochs: int = 1
    tokenizer: str | None = None
    family: str | None = None
    loader_differences: dict | None = None

    def __init__(self, options: PlanOptions | None = None, *, epochs: int = 1, tokenizer: str | None = None,
                 family: str | None = None, loader_differences: dict | None = None,
                 global_batch_tokens: int | None = UNSET, global_batch_size: int | None = UNSET,
                 max_len: int | None = UNSET, max_target_len: int | None = UNSET, method: str = UNSET,
                 method_options=UNSET, num_stages: int = UNSET, num_ranks: int = UNSET, schedule: str = UNSET,
                 memory_limit: float | None = UNSET, recompute: str = UNSET, device_memory_limit: float | None = UNSET,
                 flush: bool = UNSET, seed: int = UNSET, shuffle: bool = UNSET, drop_last: bool = UNSET,
                 equal_microbatches: bool = UNSET, max_caps: int = UNSET):
        # the deprecated flat form: every keyword after loader_differences is the PlanOptions field of its name
        flat = given({k: v for k, v in locals().items()
                      if k not in ("self", "options", "epochs", "tokenizer", "family", "loader_differences")})
        if flat:
            warnings.warn("RunPlanConfig(num_ranks=..., global_batch_tokens=..., ...) is deprecated: pass "
                          "RunPlanConfig(PlanOptions(...), epochs=...)", DeprecationWarning, stacklevel=2)
            options = (options or PlanOptions()).replace(**flat)
        if options is None:
            raise TypeError("RunPlanConfig needs the PlanOptions of the run")
        options.require_batch()
        if int(epochs) < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "epochs", int(epochs))
        object.__setattr__(self, "tokenizer", tokenizer)
        object.__setattr__(self, "family", family)
        object.__setattr__(self, "loader_differences", dict(loader_differences) if loader_differences else None)

    def __getattr__(self, name):  # the planning options read through, e.g. config.num_ranks
        if name in {f.name for f in dataclasses.fields(PlanOptions)} | {"collation"}:
            return getattr(self.options, name)
        raise AttributeError(name)

    def metadata_options(self) -> dict:
        """The ``dynabatch.options`` metadata: the plan options plus the run's epochs and tokenization."""
        out = {**self.options.to_dict(), "epochs": self.epochs, "tokenizer": self.tokenizer, "family": self.family}
        if self.loader_differences:
            out["loader_default_differences"] = self.loader_differences
        return out


def _plan_chunk(context, chunk):
    """Worker: plan a few consecutive steps; PlanningError messages gain the step and epoch."""
    shapes, cost, options = context
    out = []
    for step, epoch, positions in chunk:
        try:
            out.append(plan_step(shapes, cost, options, positions, step))
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
        batches = global_batches(shapes, cost, config.options, e)
        per_epoch.append(len(batches))
        steps.extend((len(steps), e, b) for b in batches)
    if not steps:
        tok = int(sample_tokens(shapes, cost, config.options).sum())
        raise OfflineError(f"the data ({len(shapes)} samples, {tok} tokens after truncation) holds less than one "
                           f"full global batch ({config.global_batch_tokens or config.global_batch_size}); lower "
                           "--global-batch-tokens or keep the last batch")
    warning = oversized_samples(shapes, cost, config.options)
    if warning is not None:
        warnings.warn(warning, UserWarning, stacklevel=2)
    most = max(len(b) for _, _, b in steps)
    if most < config.num_ranks:  # plan_step plans a batch of fewer samples than ranks on fewer ranks
        raise OfflineError(f"every global batch holds at most {most} samples, fewer than the {config.num_ranks} ranks "
                           f"asked for: the plan would be for {most} ranks; raise --global-batch-tokens/"
                           "--global-batch-size or lower --num-ranks")
    workers = workers_for(sum(len(b) for _, _, b in steps), workers, engine)
    size = max(1, min(16, math.ceil(len(steps) / (8 * workers))))
    chunks = [steps[i:i + size] for i in range(0, len(steps), size)]
    results = map_parts(_plan_chunk, chunks, (shapes, cost, config.options), engine=engine, workers=workers,
                        progress=progress, desc="plan", unit="step", weights=[len(c) for c in chunks])
    plans = [p for part in results for p in part]
    default_opts = plans[0].options
    step_opts = {str(p.step): p.options for p in plans if p.options != default_opts}
    meta = {  # the keys are documented in dynabatch.planfile.format
        fmt.RUN_PLAN_VERSION_KEY: str(RUN_PLAN_VERSION),
        fmt.CREATED_BY_KEY: f"dynabatch {__version__}",
        fmt.FINGERPRINT_KEY: index.fingerprint,
        fmt.COST_MODEL_KEY: json.dumps(cost.to_dict()),
        fmt.OPTIONS_KEY: json.dumps(config.metadata_options(), sort_keys=True),
        fmt.EPOCHS_KEY: str(config.epochs),
        fmt.SEED_KEY: str(config.seed),
        fmt.STEPS_PER_EPOCH_KEY: json.dumps(per_epoch),
        fmt.STEP_OPTIONS_KEY: json.dumps({"default": default_opts, "steps": step_opts}, sort_keys=True, default=str),
        fmt.TASK_NAMES_KEY: json.dumps(index.task_names),
        fmt.INDEX_KEY: json.dumps({"paths": index.paths, "samples": len(shapes), "scanned": index.scanned,
                                   "scan": index.scan_options}, sort_keys=True),
    }
    if getattr(index, "data_files", None) is not None:  # what the plan depends on, checked by the replay loader
        meta[fmt.DATA_FILES_KEY] = json.dumps(index.data_files)
    if getattr(index, "tokenizer_hash", None) is not None:
        meta[fmt.TOKENIZER_HASH_KEY] = index.tokenizer_hash
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
    main, dec, _ = cost.sample_dims(shapes, config.max_len, config.max_target_len)
    tok = (main + dec)[pos]
    table = table.append_column("sample_tokens", pa.array(tok.astype(np.int32)))
    meta = {k.decode(): v.decode() for k, v in meta.items() if k.decode() != fmt.INTEGRITY_KEY}
    table = table.replace_schema_metadata(meta)
    meta.update(fmt.integrity_metadata(table, int(meta[fmt.NUM_RANKS_KEY])))  # now with the sample columns
    return table.replace_schema_metadata(meta)
