"""A `BatchPlan` in the plan-file row format and back: one row per sample placement.

`plan_to_arrow` writes one step, `plans_to_arrow` a whole run (with the integrity record), and
`plan_from_arrow` reads one step back exactly. Columns and metadata keys are those of `format`.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from ..core.batchplan import MB_FIELDS, BatchPlan
from . import format as fmt

#: Per-stage `BatchPlan` fields, written (as fixed-size lists of ``num_stages`` float64) only when set.
STAGE_FIELDS = ("stage_time_s", "stage_memory_bytes")
#: Column of the recorded op order (`BatchPlan.op_slots`, ``[S, M, 2]``): ``2 S`` int32 per row, stage-major.
OP_SLOTS = "op_slots"
#: Arrow column of a micro-batch field where it is not the field name without ``mb_``.
_ARROW_NAME = {"mb_order": fmt.MICROBATCH}


def _column(field: str) -> str:
    return _ARROW_NAME.get(field, field[3:])


def _json_value(obj):
    """numpy scalars and arrays as their Python values in plan metadata; anything else as text."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


def _decode(meta) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in (meta or {}).items()}


def plan_to_arrow(plan: BatchPlan) -> pa.Table:
    """One row per sample placement: step, rank, microbatch (position within the rank), row,
    sample_id, plus the micro-batch's shape and predicted cost columns; metadata carries the
    schema version, method, collation, world layout, rank times and options."""
    sizes = np.diff(plan.mb_offsets)
    per_sample = {_column(name): np.repeat(getattr(plan, name), sizes) for name in MB_FIELDS}
    cols = {
        fmt.STEP: np.full(len(plan.sample_ids), plan.step, np.int64),
        fmt.RANK: per_sample.pop(fmt.RANK),
        fmt.MICROBATCH: per_sample.pop(fmt.MICROBATCH),
        fmt.ROW: plan.sample_row.astype(np.int32),
        fmt.SAMPLE_ID: plan.sample_ids.astype(np.int64),
    }
    cols.update(per_sample)
    for name in STAGE_FIELDS:  # per-stage predictions (per-stage plans only): a list of S values per row
        v = getattr(plan, name)
        if v is not None:
            flat = np.ascontiguousarray(np.repeat(v.T, sizes, axis=0)).ravel()
            cols[name] = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float64()), plan.num_stages)
    if plan.op_slots is not None:
        per_mb = plan.op_slots.transpose(1, 0, 2).reshape(plan.num_microbatches, 2 * plan.num_stages)
        flat = np.ascontiguousarray(np.repeat(per_mb, sizes, axis=0)).ravel()
        cols[OP_SLOTS] = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.int32()), 2 * plan.num_stages)
    meta = {
        fmt.PLAN_SCHEMA_VERSION_KEY: str(fmt.PLAN_SCHEMA_VERSION),
        fmt.METHOD_KEY: plan.method,
        fmt.COLLATION_KEY: plan.collation,
        fmt.NUM_RANKS_KEY: str(plan.num_ranks),
        fmt.NUM_STAGES_KEY: str(plan.num_stages),
        fmt.SCHEDULE_KEY: plan.schedule,
        fmt.STEP_SCHEDULE_KEY: json.dumps({str(plan.step): plan.schedule}),
        fmt.RANK_TIME_KEY: json.dumps({str(plan.step): plan.rank_time_s.tolist()}),
        fmt.OPTIONS_KEY: json.dumps(plan.options, sort_keys=True, default=_json_value),
    }
    return pa.table(cols).replace_schema_metadata(meta)


def steps_in(table: pa.Table) -> np.ndarray:
    """The step numbers a plan table holds, in ascending order."""
    return np.unique(table.column(fmt.STEP).to_numpy())


def plan_from_arrow(table: pa.Table, step: int | None = None) -> BatchPlan:
    """Read the plan of one step (the only step if ``step`` is None) from a plan table."""
    meta = _decode(table.schema.metadata)
    version = meta.get(fmt.PLAN_SCHEMA_VERSION_KEY)
    if version is None:
        raise ValueError(f"not a dynabatch plan table: no {fmt.PLAN_SCHEMA_VERSION_KEY} in its metadata")
    if not version.isdigit() or int(version) != fmt.PLAN_SCHEMA_VERSION:
        raise ValueError(f"plan schema version {version} is not supported (this dynabatch reads "
                         f"{fmt.PLAN_SCHEMA_VERSION})")
    steps = table.column(fmt.STEP).to_numpy()
    if step is None:
        uniq = np.unique(steps)
        if len(uniq) != 1:
            raise ValueError(f"the table holds {len(uniq)} steps; pass step=")
        step = int(uniq[0])
    sel = np.flatnonzero(steps == step)
    if len(sel) == 0:
        raise ValueError(f"step {step} is not in the plan")
    col = {name: table.column(name).to_numpy()[sel] for name in table.column_names
           if name not in STAGE_FIELDS and name != OP_SLOTS}
    rank, order = col[fmt.RANK].astype(np.int32), col[fmt.MICROBATCH].astype(np.int32)
    change = np.flatnonzero((np.diff(rank) != 0) | (np.diff(order) != 0)) + 1
    starts = np.concatenate(([0], change))
    offsets = np.concatenate((starts, [len(sel)])).astype(np.int64)
    mb = {name: col[_column(name)][starts].astype(dtype) for name, (dtype, _) in MB_FIELDS.items()
          if name != "mb_target_tokens" or _column(name) in col}
    if "mb_target_tokens" not in mb:
        mb["mb_target_tokens"] = _older_target_tokens(mb["mb_target_len"], step)
    for name in STAGE_FIELDS:
        if name in table.column_names:
            rows = table.column(name).combine_chunks().take(pa.array(sel[starts]))
            mb[name] = np.asarray(rows.flatten().to_numpy(zero_copy_only=False), np.float64).reshape(
                len(starts), -1).T
    if OP_SLOTS in table.column_names:
        rows = table.column(OP_SLOTS).combine_chunks().take(pa.array(sel[starts]))
        mb["op_slots"] = np.asarray(rows.flatten().to_numpy(zero_copy_only=False), np.int32).reshape(
            len(starts), -1, 2).transpose(1, 0, 2)
    num_ranks = int(meta[fmt.NUM_RANKS_KEY])
    rank_times = json.loads(meta.get(fmt.RANK_TIME_KEY, "{}")).get(str(step), [0.0] * num_ranks)
    return BatchPlan(
        method=meta[fmt.METHOD_KEY], collation=meta[fmt.COLLATION_KEY], num_ranks=num_ranks,
        num_stages=int(meta[fmt.NUM_STAGES_KEY]), schedule=step_schedule(meta, step),
        sample_ids=col[fmt.SAMPLE_ID].astype(np.int64), sample_row=col[fmt.ROW].astype(np.int32),
        mb_offsets=offsets, rank_time_s=np.asarray(rank_times, np.float64), step=step,
        options=json.loads(meta.get(fmt.OPTIONS_KEY, "{}")), **mb,
    )


def _older_target_tokens(target_len: np.ndarray, step: int) -> np.ndarray:
    """``mb_target_tokens`` of a plan file of an older release (no ``target_tokens`` column): 0 where a
    micro-batch has no decoder tokens (``target_len`` 0: decoder-only and vision-language plans), which is
    exact; an encoder-decoder plan's decoder totals were not recorded and cannot be derived from the file."""
    if np.any(target_len > 0):
        raise ValueError(f"step {step} of this plan has micro-batches with decoder tokens (target_len > 0) but the "
                         "file has no target_tokens column (each micro-batch's decoder token total, which older "
                         "releases did not write); re-create the plan file with `dynabatch plan`")
    return np.zeros(len(target_len), np.int64)


def step_schedule(meta: dict[str, str], step: int) -> str:
    """The concrete schedule of ``step`` recorded in decoded plan metadata (``dynabatch.step_schedule``;
    files of older releases: ``dynabatch.schedule``)."""
    return json.loads(meta.get(fmt.STEP_SCHEDULE_KEY, "{}")).get(str(int(step)), meta[fmt.SCHEDULE_KEY])


def plans_to_arrow(plans: "list[BatchPlan]", metadata: dict[str, str] | None = None) -> pa.Table:
    """One table holding several steps' plans (a whole run), readable step by step with
    `plan_from_arrow(table, step=k)`. The plans must share method, collation and world layout;
    each step's schedule (``dynabatch.schedule`` says ``auto`` when they differ) and rank times
    are kept, and the integrity record
    (`dynabatch.planfile.format.integrity_metadata`) lets a reader notice rows edited afterwards.
    ``metadata`` adds run-level entries (dataset fingerprint, cost model, options...)."""
    if not plans:
        raise ValueError("plans_to_arrow needs at least one plan")
    steps = [p.step for p in plans]
    if len(set(steps)) != len(steps):
        raise ValueError("plans_to_arrow: two plans have the same step number")
    tables = [plan_to_arrow(p) for p in plans]
    # a step of fewer samples than ranks is planned on fewer ranks (`dynabatch.core.plan.steps.plan_step`):
    # the run's world size is the largest, and such a step's other ranks hold no micro-batch
    world = max(p.num_ranks for p in plans)
    first = _decode(tables[0].schema.metadata)
    first[fmt.NUM_RANKS_KEY] = str(world)
    rank_times, schedules = {}, {}
    for p, t in zip(plans, tables):
        meta = _decode(t.schema.metadata)
        meta[fmt.NUM_RANKS_KEY] = str(world)
        for key in fmt.SHARED_KEYS:
            if meta[key] != first[key]:
                raise ValueError(f"step {p.step} differs in {key}: {meta[key]!r} vs {first[key]!r}")
        rank_times[str(p.step)] = p.rank_time_s.tolist() + [0.0] * (world - p.num_ranks)
        schedules[str(p.step)] = p.schedule
    merged = dict(first)
    merged[fmt.RANK_TIME_KEY] = json.dumps(rank_times)
    merged[fmt.SCHEDULE_KEY] = plans[0].schedule if len(set(schedules.values())) == 1 else "auto"
    merged[fmt.STEP_SCHEDULE_KEY] = json.dumps(schedules)
    merged.update(metadata or {})
    merged.pop(fmt.INTEGRITY_KEY, None)
    table = pa.concat_tables([t.replace_schema_metadata(None) for t in tables]).replace_schema_metadata(merged)
    merged.update(fmt.integrity_metadata(table, world))
    return table.replace_schema_metadata(merged)
