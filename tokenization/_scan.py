"""Length scan: samples -> per-sample token counts as an Arrow length table."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

import numpy as np
import pyarrow as pa

from ._adapters import load_tokenizer
from ._format import ChatTemplate, Family, FormatConfig, OnError, plan_batch, sample_key
from ._protocol import Tokenizer
from ._vision import VisionPolicy

#: Columns and types of the length table (the contract with ``dynabatch.Shapes``).
SHAPE_SCHEMA = pa.schema(
    [
        ("sample_id", pa.int64()),
        ("input_tokens", pa.int32()),
        ("target_tokens", pa.int32()),
        ("vision_tokens", pa.int32()),
        ("task_id", pa.int32()),
    ]
)
#: Schema metadata key: JSON list of task names; ``task_id`` indexes it, -1 = unknown.
TASK_NAMES_KEY = b"dynabatch.task_names"
#: Schema metadata key: JSON object with the scan's `ScanStats`.
SCAN_STATS_KEY = b"dynabatch.scan_stats"
# Skipped samples named in the metadata; the count is always exact.
_MAX_SKIPPED_LISTED = 100


@dataclass(frozen=True)
class ScanStats:
    """What a scan did: rows written, samples skipped (with the first few keys and reasons)
    and rows whose text was truncated to the max lengths."""

    num_samples: int = 0
    num_skipped: int = 0
    num_truncated: int = 0
    skipped: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> bytes:
        """JSON bytes for the table metadata."""
        return json.dumps(
            {
                "num_samples": self.num_samples,
                "num_skipped": self.num_skipped,
                "num_truncated": self.num_truncated,
                "skipped": [list(s) for s in self.skipped],
            }
        ).encode()


def scan_stats(table: pa.Table) -> ScanStats:
    """The `ScanStats` stored in a length table's metadata (zeros if absent)."""
    raw = (table.schema.metadata or {}).get(SCAN_STATS_KEY)
    if raw is None:
        return ScanStats(num_samples=table.num_rows)
    d = json.loads(raw)
    return ScanStats(d["num_samples"], d["num_skipped"], d["num_truncated"], tuple(tuple(s) for s in d["skipped"]))


def task_names_of(table: pa.Table) -> list[str]:
    """The task names a length table's ``task_id`` column indexes."""
    raw = (table.schema.metadata or {}).get(TASK_NAMES_KEY)
    return [] if raw is None else list(json.loads(raw))


def _length_table(cols: dict[str, np.ndarray], task_names: Sequence[str], stats: ScanStats) -> pa.Table:
    arrays = [pa.array(np.asarray(cols[f.name], dtype=f.type.to_pandas_dtype()), type=f.type) for f in SHAPE_SCHEMA]
    schema = SHAPE_SCHEMA.with_metadata(
        {TASK_NAMES_KEY: json.dumps(list(task_names)).encode(), SCAN_STATS_KEY: stats.to_json()}
    )
    return pa.Table.from_arrays(arrays, schema=schema)


def _batches(samples: Iterable[dict], size: int) -> Iterable[list[dict]]:
    it = iter(samples)
    while batch := list(itertools.islice(it, size)):
        yield batch


def scan_shapes(
    samples: Iterable[dict],
    tokenizer: Tokenizer | str,
    *,
    family: Family = "decoder",
    vision: VisionPolicy | None = None,
    batch_size: int = 1024,
    max_input_tokens: int | None = None,
    max_target_tokens: int | None = None,
    max_total_tokens: int | None = None,
    truncation_side: Literal["right", "left"] = "right",
    add_bos: bool = False,
    chat_template: ChatTemplate | None = None,
    task_names: Sequence[str] | None = None,
    on_error: OnError = "raise",
    progress: bool = False,
) -> pa.Table:
    """Token counts of every sample as a length table (see `SHAPE_SCHEMA`).

    Samples are tokenized ``batch_size`` at a time with one batched tokenizer call each,
    formatted exactly as `Formatter` does (same family, max lengths and truncation), so a
    row equals the counts of the corresponding `EncodedSample`. Columns: ``input_tokens``
    and ``target_tokens`` (text tokens after truncation; decoder-only keeps prompt and
    response separate, and the planner sums them), ``vision_tokens`` (sum over the
    sample's images under ``vision``; 0 without a policy) and ``task_id`` (index into
    ``task_names``; -1 for a task not listed or missing). Without ``task_names`` the names
    are collected in order of first appearance; pass them explicitly when scanning shards
    separately, or merge shard tables with `concat_length_tables`. The schema metadata
    holds the task names and the `ScanStats` (read them with `task_names_of` /
    `scan_stats`). ``tokenizer`` may be a `load_tokenizer` spec (handy in process pools:
    one call per shard). ``on_error="skip"`` drops samples with bad fields or unreadable
    images and counts them; ``progress=True`` shows a tqdm bar.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    tok = load_tokenizer(tokenizer)
    cfg = FormatConfig(
        family=family,
        max_input_tokens=max_input_tokens,
        max_target_tokens=max_target_tokens,
        max_total_tokens=max_total_tokens,
        truncation_side=truncation_side,
        add_bos=add_bos,
        chat_template=chat_template or ChatTemplate(),
    )
    if add_bos and tok.bos_id is None:
        raise ValueError(f"add_bos=True but tokenizer {tok.name!r} has no BOS token")
    fixed_tasks = task_names is not None
    names: list[str] = list(task_names or [])
    task_index = {n: i for i, n in enumerate(names)}
    parts: dict[str, list[np.ndarray]] = {name: [] for name in [*SHAPE_SCHEMA.names, "_truncated"]}
    skipped: list[tuple[str, str]] = []
    num_skipped = 0

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(samples) if hasattr(samples, "__len__") else None, unit="sample", desc="scan_shapes")
    try:
        for batch in _batches(samples, batch_size):
            plan = plan_batch(batch, tok, cfg, vision, on_error, with_ids=False)
            task_ids = np.empty(len(plan.index), dtype=np.int32)
            for k, pos in enumerate(plan.index):
                task = batch[pos].get("task")
                if task and task not in task_index and not fixed_tasks:
                    task_index[task] = len(names)
                    names.append(task)
                task_ids[k] = task_index.get(task, -1) if task else -1
            for col, values in (
                ("sample_id", plan.sample_id),
                ("input_tokens", plan.input_tokens),
                ("target_tokens", plan.target_tokens),
                ("vision_tokens", plan.vision_tokens),
                ("task_id", task_ids),
                ("_truncated", plan.truncated),
            ):
                parts[col].append(values)
            num_skipped += len(plan.skipped)
            room = _MAX_SKIPPED_LISTED - len(skipped)
            skipped.extend((str(sample_key(batch[i])), str(exc)) for i, exc in plan.skipped[:room])
            if bar is not None:
                bar.update(len(batch))
    finally:
        if bar is not None:
            bar.close()

    cols = {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in parts.items()}
    stats = ScanStats(
        num_samples=len(cols["sample_id"]),
        num_skipped=num_skipped,
        num_truncated=int(np.count_nonzero(cols["_truncated"])),
        skipped=tuple(skipped),
    )
    return _length_table(cols, names, stats)


def concat_length_tables(tables: Sequence[pa.Table]) -> pa.Table:
    """Concatenate length tables (e.g. one per shard), re-indexing ``task_id`` onto the union
    of their task names (in order of first appearance) and summing their `ScanStats`."""
    names: list[str] = []
    index: dict[str, int] = {}
    cols: dict[str, list[np.ndarray]] = {f.name: [] for f in SHAPE_SCHEMA}
    stats = [scan_stats(t) for t in tables]
    for t in tables:
        local = task_names_of(t)
        for n in local:
            if n not in index:
                index[n] = len(names)
                names.append(n)
        # Slot -1 of the lookup maps unknown (-1) to -1.
        remap = np.array([index[n] for n in local] + [-1], dtype=np.int32)
        for f in SHAPE_SCHEMA:
            cols[f.name].append(t.column(f.name).to_numpy())
        cols["task_id"][-1] = remap[cols["task_id"][-1]]
    merged = {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in cols.items()}
    total = ScanStats(
        num_samples=sum(s.num_samples for s in stats),
        num_skipped=sum(s.num_skipped for s in stats),
        num_truncated=sum(s.num_truncated for s in stats),
        skipped=tuple(itertools.islice((k for s in stats for k in s.skipped), _MAX_SKIPPED_LISTED)),
    )
    return _length_table(merged, names, total)
