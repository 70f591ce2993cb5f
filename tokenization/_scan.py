"""Length scan: samples -> per-sample token counts as an Arrow length table.

`scan_shapes` is the one tokenize-and-count pass over records: ``dynabatch scan``/``plan``, the
DataLoader's own index and ``dynabatch.build_index`` all run it (``dynabatch.index.scan`` maps it
over parts of a source and merges the parts with `concat_length_tables`)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Sequence

import numpy as np
import pyarrow as pa

from ._adapters import load_tokenizer
from ._chat import ChatOption, ChatRenderer, resolve_chat
from ._config import Family, FormatConfig, OnError
from ._format import tokenize_batch
from ._protocol import IGNORE_INDEX, Tokenizer
from ._segments import PART_TARGET, sample_key
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
#: Optional column (``label_config``): loss labels of each sample once formatted for training.
LABEL_COLUMN = "label_tokens"
#: Optional ``large_list<int32>`` columns (``keep_ids``): input ids, then labels (decoder-only) or
#: target ids (encoder-decoder), as `Formatter` makes them under ``label_config``.
ID_COLUMNS = ("cached_input_ids", "cached_second_ids")
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


def _length_table(cols: dict[str, np.ndarray], task_names: Sequence[str], stats: ScanStats,
                  extra: dict[str, pa.Array | pa.ChunkedArray] | None = None) -> pa.Table:
    arrays = [pa.array(np.asarray(cols[f.name], dtype=f.type.to_pandas_dtype()), type=f.type) for f in SHAPE_SCHEMA]
    fields = list(SHAPE_SCHEMA)
    for name, arr in (extra or {}).items():
        arrays.append(arr)
        fields.append(pa.field(name, arr.type))
    meta = {TASK_NAMES_KEY: json.dumps(list(task_names)).encode(), SCAN_STATS_KEY: stats.to_json()}
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=meta))


def ragged_take(values: np.ndarray, starts, lengths) -> np.ndarray:
    """``values[s:s + n]`` for every ``(s, n)`` of ``zip(starts, lengths)``, concatenated (one gather)."""
    starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    if len(starts) == 1 or total == 0:
        return values[int(starts[0]) if len(starts) else 0:][:total]
    src = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    src += np.arange(total, dtype=np.int64)
    return values[src]


def count_labels(second: np.ndarray, lengths, family: Family) -> np.ndarray:
    """Loss labels per sample from flat ids (``lengths`` per sample): encoder-decoder, every target
    id; decoder-only, the labels that are not ``IGNORE_INDEX``, less the first one of each sample
    (it has no preceding token once labels are shifted)."""
    lengths = np.asarray(lengths, np.int64)
    if family == "encoder_decoder":
        return lengths.copy()
    trained = np.asarray(second) != IGNORE_INDEX
    starts = np.cumsum(lengths) - lengths
    nz = lengths > 0
    trained[starts[nz]] = False
    counts = np.zeros(len(lengths), np.int64)
    counts[nz] = np.add.reduceat(trained.astype(np.int64), starts[nz])
    return counts


def _plan_ids(plan, family: Family) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(input ids, lengths, labels or target ids, lengths) of a batch plan's samples, flat."""
    seg_len = np.fromiter(map(len, plan.seg_ids), np.int64, count=len(plan.seg_ids))

    def flat(sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = [a for a, keep in zip(plan.seg_ids, sel) if keep]
        values = np.concatenate(ids).astype(np.int32, copy=False) if ids else np.zeros(0, np.int32)
        return values, np.bincount(plan.seg_sample[sel], weights=seg_len[sel], minlength=len(plan.index)).astype(np.int64)

    if family == "decoder":
        values, lengths = flat(np.ones(len(seg_len), bool))
        labels = values.copy()
        labels[np.repeat(~plan.seg_trained, seg_len)] = IGNORE_INDEX
        given = [j for j, lab in enumerate(plan.seg_labels) if lab is not None]
        starts = np.cumsum(seg_len) - seg_len
        for j in given:  # labels of pre-tokenized rows, as given
            labels[starts[j]:starts[j] + seg_len[j]] = plan.seg_labels[j]
        return values, lengths, labels, lengths
    # encoder-decoder: image placeholder runs (PART_VISION) are in the input ids
    return (*flat(plan.seg_part != PART_TARGET), *flat(plan.seg_part == PART_TARGET))


def _would_cut(cfg: FormatConfig, inp: np.ndarray, tgt: np.ndarray, vis: np.ndarray) -> np.ndarray:
    """Samples whose text ``cfg``'s max lengths may cut or whose images they may refuse (a superset;
    vision tokens count towards the max lengths, as in `FormatConfig`)."""
    cut = np.zeros(len(inp), bool)
    for limit, n in ((cfg.max_input_tokens, inp + vis), (cfg.max_target_tokens, tgt),
                     (cfg.max_total_tokens, inp + tgt + vis)):
        if limit is not None:
            cut |= n > limit
    return cut


def _trained_ids(batch: list[dict], plan, tok: Tokenizer, cfg: FormatConfig, label_cfg: FormatConfig,
                 vision: VisionPolicy | None, on_error: OnError, chat: ChatRenderer):
    """(`_plan_ids` of a batch as formatted with ``label_cfg``, mask of ``plan``'s rows that ``label_cfg``
    refuses, their ``(batch position, SampleError)``): ids of samples that ``cfg`` kept whole and
    ``label_cfg`` does not cut are reused, the others are formatted again. A refused sample (image
    placeholders that ``label_cfg``'s max lengths leave no room for) raises, or with ``on_error="skip"``
    is left out of the ids (the caller drops its row)."""
    flat = _plan_ids(plan, cfg.family)
    refused = np.zeros(len(plan.index), bool)
    redo = np.flatnonzero(plan.truncated | _would_cut(label_cfg, plan.input_tokens, plan.target_tokens,
                                                      plan.vision_tokens))
    if label_cfg == cfg or not len(redo):
        return flat, refused, []
    again_plan = tokenize_batch([batch[i] for i in plan.index[redo]], tok, label_cfg, vision, on_error, chat=chat)
    errors = [(int(plan.index[redo[j]]), exc) for j, exc in again_plan.skipped]
    refused[redo[[j for j, _ in again_plan.skipped]]] = True
    redo = redo[again_plan.index]
    again = _plan_ids(again_plan, cfg.family)
    out: list[np.ndarray] = []
    ok = ~refused
    for j in (0, 2):
        lengths = flat[j + 1].copy()
        starts = np.cumsum(lengths) - lengths
        starts[redo] = len(flat[j]) + np.cumsum(again[j + 1]) - again[j + 1]
        lengths[redo] = again[j + 1]
        out += [ragged_take(np.concatenate([flat[j], again[j]]), starts[ok], lengths[ok]), lengths[ok]]
    return tuple(out), refused, errors


def _id_column(values: list[np.ndarray], lengths: list[np.ndarray]) -> pa.Array:
    lens = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    flat = np.concatenate(values) if values else np.zeros(0, np.int32)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat, pa.int32()))


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
    chat_template: ChatOption = None,
    pretokenized: bool | None = None,
    task_names: Sequence[str] | None = None,
    on_error: OnError = "raise",
    progress: bool | None = False,
    progress_total: int | None = None,
    progress_desc: str = "scan_shapes",
    label_config: FormatConfig | None = None,
    keep_ids: bool = False,
    ids_budget: int | None = None,
    image_token_id: int | None = None,
    ids_sink: Callable[..., None] | None = None,
) -> pa.Table:
    """Token counts of every sample as a length table (see `SHAPE_SCHEMA`).

    Samples are tokenized ``batch_size`` at a time with one batched tokenizer call each,
    formatted exactly as `Formatter` does (same family, max lengths, truncation and
    ``pretokenized`` rule, see `FormatConfig`), so a row equals the counts of the
    corresponding `EncodedSample`. Columns: ``input_tokens``
    and ``target_tokens`` (text tokens after truncation; decoder-only keeps prompt and
    response separate, and the planner sums them), ``vision_tokens`` (sum over the
    sample's images under ``vision``; 0 without a policy) and ``task_id`` (index into
    ``task_names``; -1 for a task not listed or missing). Without ``task_names`` the names
    are collected in order of first appearance; pass them explicitly when scanning shards
    separately, or merge shard tables with `concat_length_tables`. The schema metadata
    holds the task names and the `ScanStats` (read them with `task_names_of` /
    `scan_stats`). ``tokenizer`` may be a `load_tokenizer` spec (handy in process pools:
    one call per shard). ``on_error="skip"`` drops samples with bad fields or unreadable
    images and counts them; ``progress=True`` shows a tqdm bar (``None``: only when stderr is a
    terminal) of
    ``progress_total`` samples (default ``len(samples)`` when known) named ``progress_desc``.

    ``label_config`` (a `FormatConfig` of the same family: how the samples are formatted for
    training, e.g. with other max lengths) adds the `LABEL_COLUMN`: each sample's loss labels
    under it (see `count_labels`); with ``keep_ids`` also its token ids under it (`ID_COLUMNS`),
    unless they pass ``ids_budget`` bytes (the table then has no id columns); ``ids_sink`` (with
    ``label_config``, instead of ``keep_ids``) receives them batch by batch, nothing is kept:
    ``ids_sink(sample_ids, input_ids, input_lengths, second_ids, second_lengths)`` (flat int32 ids,
    int64 lengths; second: labels, or target ids for encoder-decoder). The samples are
    tokenized once; only those that ``label_config`` cuts are formatted a second time. Vision
    tokens count towards the max lengths (`FormatConfig`): a sample whose vision tokens the max
    lengths (the scan's, or ``label_config``'s) leave no room for is refused: it raises, or with
    ``on_error="skip"`` has no row and counts as skipped.

    ``chat_template``: how conversations (``messages``) are rendered, as `FormatConfig.chat_template`
    (``label_config`` must have the same).

    ``image_token_id``: image placeholders in the ids (`FormatConfig.image_token_id`; needs
    ``vision``), default ``label_config``'s (placeholders change the text that is tokenized, so
    the scan and ``label_config`` must agree). ``input_tokens``/``target_tokens`` still count text
    only and ``vision_tokens`` the placeholders.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    tok = load_tokenizer(tokenizer)
    if label_config is not None and label_config.image_token_id is not None:
        if image_token_id is None:
            image_token_id = label_config.image_token_id
        elif image_token_id != label_config.image_token_id:
            raise ValueError(f"image_token_id={image_token_id} but label_config.image_token_id="
                             f"{label_config.image_token_id}: the scan and label_config must insert the same "
                             "placeholders")
    if image_token_id is not None and vision is None:
        raise ValueError("image_token_id needs a vision policy (vision=DynamicTiling() or FixedResolution())")
    cfg = FormatConfig(family=family, max_input_tokens=max_input_tokens, max_target_tokens=max_target_tokens,
                       max_total_tokens=max_total_tokens, truncation_side=truncation_side, add_bos=add_bos,
                       chat_template=chat_template, pretokenized=pretokenized, image_token_id=image_token_id)
    if add_bos and tok.bos_id is None:
        raise ValueError(f"add_bos=True but tokenizer {tok.name!r} has no BOS token")
    chat = resolve_chat(chat_template, tok, family)
    if label_config is not None and label_config.chat_template != chat_template:
        raise ValueError(f"label_config.chat_template={label_config.chat_template!r:.60} but the scan's is "
                         f"{chat_template!r:.60}: the scan and label_config must render conversations alike")
    if label_config is not None and label_config.family != family:
        raise ValueError(f"label_config.family is {label_config.family!r} but the scan's family is {family!r}")
    if keep_ids and label_config is None:
        raise ValueError("keep_ids=True needs a label_config (the formatting the ids are kept under)")
    fixed_tasks = task_names is not None
    names: list[str] = list(task_names or [])
    task_index = {n: i for i, n in enumerate(names)}
    parts: dict[str, list[np.ndarray]] = {name: [] for name in [*SHAPE_SCHEMA.names, "_truncated", LABEL_COLUMN]}
    kept: list[tuple[np.ndarray, ...]] = []
    kept_bytes = 0
    skipped: list[tuple[str, str]] = []
    num_skipped = 0

    bar = None
    if progress is not False:  # None: a bar only when stderr is a terminal (tqdm's disable=None)
        from tqdm.auto import tqdm

        total = len(samples) if hasattr(samples, "__len__") else progress_total
        bar = tqdm(total=total, unit="sample", desc=progress_desc, disable=None if progress is None else False,
                   dynamic_ncols=True)
    try:
        for batch in _batches(samples, batch_size):
            plan = tokenize_batch(batch, tok, cfg, vision, on_error, with_ids=label_config is not None, chat=chat)
            refused, errors = np.zeros(len(plan.index), bool), []
            if label_config is not None:
                ids, refused, errors = _trained_ids(batch, plan, tok, cfg, label_config, vision, on_error, chat)
            task_ids = np.empty(len(plan.index), dtype=np.int32)
            for k, pos in enumerate(plan.index):
                if refused[k]:
                    continue
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
                parts[col].append(values[~refused])
            if label_config is not None:
                parts[LABEL_COLUMN].append(count_labels(ids[2], ids[3], family))
                if ids_sink is not None:
                    ids_sink(plan.sample_id[~refused], *ids)
                elif keep_ids:
                    kept.append(ids)
                    kept_bytes += ids[0].nbytes + ids[2].nbytes + 16 * len(ids[1])
                    keep_ids = ids_budget is None or kept_bytes <= ids_budget
                    if not keep_ids:
                        kept.clear()
            lost = sorted(plan.skipped + errors, key=lambda e: e[0])
            num_skipped += len(lost)
            room = _MAX_SKIPPED_LISTED - len(skipped)
            skipped.extend((str(sample_key(batch[i])), str(exc)) for i, exc in lost[:room])
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
    extra: dict[str, pa.Array] = {}
    if label_config is not None:
        extra[LABEL_COLUMN] = pa.array(cols[LABEL_COLUMN].astype(np.int32), pa.int32())
    if keep_ids:
        for name, j in zip(ID_COLUMNS, (0, 2)):
            extra[name] = _id_column([k[j] for k in kept], [k[j + 1] for k in kept])
    return _length_table(cols, names, stats, extra)


def concat_length_tables(tables: Sequence[pa.Table]) -> pa.Table:
    """Concatenate length tables (e.g. one per shard), re-indexing ``task_id`` onto the union
    of their task names (in order of first appearance) and summing their `ScanStats`. Other
    columns (`LABEL_COLUMN`, `ID_COLUMNS`) are kept when every table has them."""
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
    others = [c for c in (tables[0].column_names if tables else []) if c not in SHAPE_SCHEMA.names]
    extra = {c: pa.chunked_array([ch for t in tables for ch in t.column(c).chunks], tables[0].schema.field(c).type)
             for c in others if all(c in t.column_names for t in tables)}
    return _length_table(merged, names, total, extra)
