"""Indexed mode: a length index of every sample, one global plan per step computed identically on
every rank, and random access to this rank's samples.

Every rank holds the same length index (`LengthIndex`: the Shapes columns, sorted by
``sample_id``, plus the loss-label count of each sample). Epoch ``e``'s global batches and each
step's plan come from `dynabatch.core.steps` (the functions ``dynabatch plan`` uses): cut by token
count only, so their membership does not depend on the world size; a rank keeps its own
micro-batches and loads only their samples. Nothing is communicated, so the plan is the same everywhere by construction.

Resuming on another world size re-plans the not-yet-consumed global batches on the new world
size; a step that was half done when the checkpoint was taken is re-planned without the samples
already consumed (the merged states of all ranks say which).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace

import numpy as np
import pyarrow as pa
from torch.utils.data import IterableDataset, get_worker_info

from .collate import IGNORE_INDEX
from ..core.cost import CostModel
from ..core.options import PlanOptions
from ..core.steps import global_batches, num_global_batches, plan_step
from ..core.shapes import SHAPES_SCHEMA, Shapes
from .steps import (CollateConfig, ReadyStep, StepPlan, Timer, collate_step, encode_samples,
                            label_counts, rank_step)
from .ahead import Ahead, ProcessAhead

logger = logging.getLogger("dynabatch")

#: Extra index column: labels of the sample that count in the loss after collation.
LABEL_COLUMN = "label_tokens"
#: Index table metadata: JSON of the tokenization settings the index was built with.
SETTINGS_KEY = b"dynabatch.index_settings"
_TASK_NAMES_KEY = b"dynabatch.task_names"
#: Token-cache columns (``large_list<int32>``, the `Formatter`'s ids after truncation): input ids,
#: then labels (decoder-only) or target ids (encoder-decoder).
TOKEN_COLUMNS = ("cached_input_ids", "cached_second_ids")
#: Index table metadata: JSON of the tokenization settings the cached token ids were made with.
TOKEN_SETTINGS_KEY = b"dynabatch.token_settings"
#: Default memory budget of the token cache (bytes of int32 ids held in memory).
TOKEN_CACHE_BUDGET = 2 << 30


class TokenCache:
    """Every sample's token ids after formatting and truncation, by length-index position:
    flat int32 arrays plus offsets (input ids; labels for decoder-only models, target ids for
    encoder-decoder ones). ``gather`` returns a micro-batch's concatenated ids without reading or
    tokenizing the records again; the collated tensors are exactly those of the uncached path."""

    def __init__(self, index: "LengthIndex", input_ids, input_offsets, second, second_offsets):
        self.index = index
        self.input_ids = np.asarray(input_ids, np.int32)
        self.input_offsets = np.asarray(input_offsets, np.int64)
        self.second = np.asarray(second, np.int32)
        self.second_offsets = np.asarray(second_offsets, np.int64)
        self._identity_ids = bool(len(index) == 0 or (index.shapes.sample_id[0] == 0 and
                                  index.shapes.sample_id[-1] == len(index) - 1))

    @property
    def nbytes(self) -> int:
        return int(self.input_ids.nbytes + self.second.nbytes + self.input_offsets.nbytes + self.second_offsets.nbytes)

    @staticmethod
    def _take(values: np.ndarray, offsets: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Concatenated slices ``values[offsets[p]:offsets[p+1]]`` for ``p`` in ``pos`` (one
        vectorized gather), and their lengths."""
        a = offsets[pos]
        lengths = offsets[pos + 1] - a
        total = int(lengths.sum())
        if len(pos) == 1 or total == 0:
            return values[int(a[0]) if len(a) else 0:][:total], lengths
        src = np.repeat(a - (np.cumsum(lengths) - lengths), lengths)
        src += np.arange(total, dtype=np.int64)
        return values[src], lengths

    def positions(self, sample_ids) -> np.ndarray:
        ids = np.asarray(sample_ids, np.int64)
        if self._identity_ids and len(ids) and ids.min() >= 0 and ids.max() < len(self.index):
            return ids
        return self.index.positions(ids)

    def gather(self, sample_ids, positions=None):
        """(input ids, input lengths, labels or target ids, their lengths) of these samples, in
        order: int32 arrays and int64 lengths (``positions``: their index positions, if known)."""
        pos = self.positions(sample_ids) if positions is None else np.asarray(positions, np.int64)
        flat, lengths = self._take(self.input_ids, self.input_offsets, pos)
        if self.second_offsets is self.input_offsets:
            return flat, lengths, self._take(self.second, self.input_offsets, pos)[0], lengths
        second, slen = self._take(self.second, self.second_offsets, pos)
        return flat, lengths, second, slen

    def label_counts(self, sample_ids, family: str) -> np.ndarray:
        """`label_counts` of these samples from the cached ids."""
        flat, lengths, second, slen = self.gather(sample_ids)
        if family == "encoder_decoder":
            return slen.astype(np.int64)
        trained = second != IGNORE_INDEX
        starts = np.cumsum(lengths) - lengths
        trained[starts[lengths > 0]] = False
        counts = np.zeros(len(lengths), np.int64)
        nz = lengths > 0
        counts[nz] = np.add.reduceat(trained.astype(np.int64), starts[nz])
        return counts

    @classmethod
    def from_encoded(cls, index: "LengthIndex", encs: dict, family: str) -> "TokenCache | None":
        """From ``{sample_id: EncodedSample}``; None when a sample of the index is missing."""
        ids = index.shapes.sample_id
        try:
            ordered = [encs[int(i)] for i in ids.tolist()]
        except KeyError:
            return None
        inp, off, second, soff = _flat_columns(ordered, family)
        return cls(index, inp, off, second, soff if family == "encoder_decoder" else off)

    @classmethod
    def from_table(cls, index: "LengthIndex", table: pa.Table, family: str) -> "TokenCache | None":
        """From an index table's token columns (see `TOKEN_COLUMNS`); None without them."""
        if not all(c in table.column_names for c in TOKEN_COLUMNS):
            return None
        cols = []
        for c in TOKEN_COLUMNS:
            arr = table.column(c).combine_chunks()
            if isinstance(arr, pa.ChunkedArray):
                arr = arr.chunk(0) if arr.num_chunks else pa.array([], pa.large_list(pa.int32()))
            offsets = arr.offsets.to_numpy().astype(np.int64)
            values = arr.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
            cols.append((values[offsets[0]:offsets[-1]] if len(offsets) else values[:0], offsets - offsets[0]))
        (inp, off), (second, soff) = cols
        tids = table.column("sample_id").to_numpy(zero_copy_only=False).astype(np.int64)
        if len(tids) != len(index) or not np.array_equal(tids, index.shapes.sample_id):
            pos = np.argsort(tids, kind="stable")
            if len(tids) != len(index) or not np.array_equal(tids[pos], index.shapes.sample_id):
                return None
            inp, lens = cls._take(inp, off, pos)
            off = np.concatenate([[0], np.cumsum(lens)])
            second, slens = cls._take(second, soff, pos)
            soff = np.concatenate([[0], np.cumsum(slens)])
        same = family == "decoder" and np.array_equal(off, soff)
        return cls(index, inp, off, second, off if same else soff)


def _flat_columns(encs, family: str):
    """Flat int32 ids and int64 offsets of input ids and labels / target ids of EncodedSamples."""
    def flat(arrays):
        lengths = np.fromiter((len(a) for a in arrays), np.int64, count=len(arrays))
        values = np.concatenate(arrays).astype(np.int32, copy=False) if len(arrays) else np.zeros(0, np.int32)
        return values, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    inp, off = flat([e.input_ids for e in encs])
    if family == "encoder_decoder":
        second, soff = flat([e.target_ids for e in encs])
    else:
        second, soff = flat([e.labels if e.labels is not None else e.input_ids for e in encs])
    return inp, off, second, soff


def token_cache_bytes(shapes, family: str) -> int:
    """Upper bound of the token cache's memory (int32 ids; untruncated lengths)."""
    inp = shapes.input_tokens.astype(np.int64).sum()
    tgt = shapes.target_tokens.astype(np.int64).sum()
    return int(4 * (2 * (inp + tgt) if family == "decoder" else inp + tgt) + 16 * len(shapes))


@dataclass(frozen=True)
class LengthIndex:
    """Token counts of every sample of the dataset, sorted by ``sample_id``.

    ``label_tokens`` counts each sample's loss labels; ``exact_labels`` is False when the index
    had no such column and the counts were derived from ``target_tokens`` (exact for
    prompt/response and chat samples, not for plain-text language-modelling samples, whose every
    token is trained). ``fingerprint`` is ``Shapes.fingerprint()`` of the sorted index;
    ``fingerprints`` also holds the fingerprint of the index in the order it was given.
    """

    shapes: Shapes
    label_tokens: np.ndarray
    exact_labels: bool
    fingerprint: str
    fingerprints: frozenset = field(default_factory=frozenset)
    settings: dict | None = None

    def __len__(self) -> int:
        return len(self.shapes)

    def positions(self, sample_ids) -> np.ndarray:
        """Positions of ``sample_ids`` in the index; KeyError for ids not in it."""
        ids = np.asarray(sample_ids, np.int64)
        pos = np.searchsorted(self.shapes.sample_id, ids)
        pos_c = np.minimum(pos, max(len(self.shapes) - 1, 0))
        bad = (pos >= len(self.shapes)) | (self.shapes.sample_id[pos_c] != ids) if len(self.shapes) else np.ones(len(ids), bool)
        if bad.any():
            raise KeyError(f"sample ids {ids[bad][:5].tolist()} are not in the length index")
        return pos


def index_settings(formatter, vision, source=None) -> dict:
    """The tokenization settings an index depends on (a rebuilt index must match them)."""
    cfg = formatter.config
    out = {
        "tokenizer": getattr(formatter.tokenizer, "name", type(formatter.tokenizer).__name__),
        "vocab_size": int(getattr(formatter.tokenizer, "vocab_size", 0)),
        "family": cfg.family, "max_input_tokens": cfg.max_input_tokens, "max_target_tokens": cfg.max_target_tokens,
        "max_total_tokens": cfg.max_total_tokens, "truncation_side": cfg.truncation_side, "add_bos": cfg.add_bos,
        "chat_template": repr(cfg.chat_template), "vision": repr(vision),
    }
    if source is not None:
        out["source_fingerprint"] = source._reader.fingerprint()
    return out


def _untruncated(formatter):
    """The same formatter without max lengths (the index holds full lengths, as `dynabatch scan`)."""
    from dataclasses import replace

    from tokenization import Formatter

    cfg = replace(formatter.config, max_input_tokens=None, max_target_tokens=None, max_total_tokens=None)
    return Formatter(formatter.tokenizer, cfg, vision=formatter.vision)


def _would_truncate(cfg, inp: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    """Samples whose text a `FormatConfig`'s max lengths cut (vision tokens never count)."""
    cut = np.zeros(len(inp), bool)
    if cfg.max_input_tokens is not None:
        cut |= inp > cfg.max_input_tokens
    if cfg.max_target_tokens is not None:
        cut |= tgt > cfg.max_target_tokens
    if cfg.max_total_tokens is not None:
        cut |= inp + tgt > cfg.max_total_tokens
    return cut


def scan_source(source, formatter, *, vision=None, batch_size: int = 512, on_error: str = "raise",
                keep_tokens: bool = False, token_budget: int | None = None) -> pa.Table:
    """Scan a whole `loaders.Source` once: a length table in ``sample_id`` order.

    The Shapes columns hold *full* token counts with task ids indexing the sorted task names, i.e.
    the same table ``dynabatch scan`` writes for the same tokenizer, family and vision policy (so
    plan files made from either match the same fingerprint); the planner applies ``max_len`` /
    ``max_target_len`` itself. ``label_tokens`` counts the loss labels under ``formatter``'s max
    lengths (samples that get truncated are encoded a second time to count them exactly). The
    metadata records the tokenization settings. Costs one tokenization pass over the data,
    ``batch_size`` samples per tokenizer call. ``keep_tokens`` (text only) also keeps every
    sample's token ids under ``formatter``'s max lengths in the `TOKEN_COLUMNS` (the token cache
    `DataLoader` collates from instead of reading and tokenizing the records again); past
    ``token_budget`` bytes of ids it stops keeping them (the table then has no token columns).
    """
    if getattr(source, "max_samples_per_epoch", None) is not None:
        raise ValueError("the indexed mode plans every sample of the source; a source with max_samples_per_epoch "
                         "(a per-epoch cap) only works in the streaming mode (mode='streaming')")
    src = source.with_layout(rank=0, world_size=1, worker_id=0, num_workers=0)
    # The natural (unshuffled) order is sample_id order, whatever shuffling the source does itself.
    src.shuffle, src.shuffle_buffer, src._pending = False, 0, None
    src.set_epoch(0)
    full = _untruncated(formatter)
    family = formatter.config.family
    cols: dict[str, list] = {k: [] for k in (*SHAPES_SCHEMA, LABEL_COLUMN)}
    task_names: list[str] = []
    batch: list[dict] = []
    keep_tokens = keep_tokens and vision is None and formatter.vision is None
    kept: list = []  # per flush: (input, offsets, second, offsets)
    kept_bytes = 0

    def flush():
        nonlocal keep_tokens, kept_bytes
        toks = encode_samples(batch, full, None, False, on_error=on_error)
        by_id = {int(s["sample_id"]): s for s in batch}
        n = len(toks)
        ids = np.fromiter((t.sample_id for t in toks), np.int64, count=n)
        inp = np.fromiter((t.input_tokens for t in toks), np.int64, count=n)
        tgt = np.fromiter((t.target_tokens for t in toks), np.int64, count=n)
        labels = label_counts([t.enc for t in toks], family)
        cut = np.flatnonzero(_would_truncate(formatter.config, inp, tgt))
        if len(cut):
            again = formatter.encode_batch([by_id[int(ids[k])] for k in cut])
            labels[cut] = label_counts(again, family)
        if keep_tokens:
            encs = [t.enc for t in toks]
            for j, k in enumerate(cut.tolist()):
                encs[k] = again[j]
            kept.append(_flat_columns(encs, family))
            kept_bytes += kept[-1][0].nbytes + kept[-1][2].nbytes + 16 * len(encs)
            if token_budget is not None and kept_bytes > token_budget:
                keep_tokens = False
                kept.clear()
        cols["sample_id"].append(ids)
        cols["input_tokens"].append(inp)
        cols["target_tokens"].append(tgt)
        cols["vision_tokens"].append(np.fromiter((t.vision_tokens for t in toks), np.int64, count=n))
        task_names.extend(by_id[int(i)].get("task") or "" for i in ids.tolist())
        cols[LABEL_COLUMN].append(labels)
        batch.clear()

    for sample in src:
        batch.append(sample)
        if len(batch) >= batch_size:
            flush()
    if batch:
        flush()
    # task_id indexes the sorted task names ("" = unknown = -1), as `dynabatch scan` numbers them
    names, inverse = np.unique(np.asarray(task_names, dtype=object).astype(str), return_inverse=True)
    known = [str(x) for x in names if x]
    shift = 1 if len(names) and names[0] == "" else 0
    cols["task_id"] = [np.asarray(inverse, np.int64).ravel() - shift]
    arrays = {k: (np.concatenate(v) if v else np.zeros(0)).astype(SHAPES_SCHEMA.get(k, np.dtype(np.int32)))
              for k, v in cols.items()}
    order = np.argsort(arrays["sample_id"], kind="stable")
    table = pa.table({k: pa.array(v[order]) for k, v in arrays.items()})
    meta = {}
    if keep_tokens:
        for j, name in ((0, TOKEN_COLUMNS[0]), (2, TOKEN_COLUMNS[1])):
            values = np.concatenate([k[j] for k in kept]) if kept else np.zeros(0, np.int32)
            lens = np.concatenate([np.diff(k[j + 1]) for k in kept]) if kept else np.zeros(0, np.int64)
            offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            vals, lens = TokenCache._take(values, offs, order)
            col = pa.LargeListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)),
                                                pa.array(vals, pa.int32()))
            table = table.append_column(name, col)
        meta[TOKEN_SETTINGS_KEY] = json.dumps(index_settings(formatter, vision, source), sort_keys=True).encode()
    meta.update({SETTINGS_KEY: json.dumps(index_settings(formatter, vision, source), sort_keys=True).encode(),
            _TASK_NAMES_KEY: json.dumps(known).encode(),
            b"dynabatch.dataset_fingerprint": Shapes.from_arrow(table).fingerprint().encode()})
    return table.replace_schema_metadata(meta)


def encode_all(source, formatter, *, batch_size: int = 512, on_error: str = "raise") -> dict:
    """``{sample_id: EncodedSample}`` of a whole source under ``formatter`` (one tokenization pass,
    natural order): the token cache of an index that came without one."""
    src = source.with_layout(rank=0, world_size=1, worker_id=0, num_workers=0)
    src.shuffle, src.shuffle_buffer, src._pending = False, 0, None
    src.set_epoch(0)
    out: dict = {}
    batch: list[dict] = []
    for sample in src:
        batch.append(sample)
        if len(batch) >= batch_size:
            out.update((int(e.sample_id), e) for e in formatter.encode_batch(batch, on_error=on_error) if e is not None)
            batch.clear()
    if batch:
        out.update((int(e.sample_id), e) for e in formatter.encode_batch(batch, on_error=on_error) if e is not None)
    return out


def read_index_table(index) -> pa.Table:
    """A length table from a path (Parquet or Arrow IPC), an Arrow table or `Shapes`."""
    if isinstance(index, Shapes):
        return index.to_arrow()
    if isinstance(index, pa.Table):
        return index
    path = os.fspath(index)
    if path.endswith((".arrow", ".feather", ".ipc")):
        with pa.memory_map(path) as mm:
            return pa.ipc.open_file(mm).read_all()
    import pyarrow.parquet as pq

    return pq.read_table(path)


def write_index_table(table: pa.Table, path) -> None:
    """Write a length table as Parquet atomically (write to a temporary name, then rename)."""
    import pyarrow.parquet as pq

    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def load_index(index, family: str, max_len: int | None = None, max_target_len: int | None = None,
               bos: int = 0) -> LengthIndex:
    """A `LengthIndex` from anything `read_index_table` reads. Without a ``label_tokens`` column
    the label counts are derived from ``target_tokens`` (see `LengthIndex`)."""
    table = read_index_table(index)
    given = Shapes.from_arrow(table)
    order = np.argsort(given.sample_id, kind="stable")
    shapes = given.take(order)
    dup = np.flatnonzero(np.diff(shapes.sample_id) == 0)
    if len(dup):
        raise ValueError(f"the length index repeats sample_id {int(shapes.sample_id[dup[0]])}")
    if LABEL_COLUMN in table.column_names:
        labels = table.column(LABEL_COLUMN).to_numpy(zero_copy_only=False).astype(np.int64)[order]
        exact = True
    else:
        labels = derived_labels(shapes, family, max_len, max_target_len, bos)
        exact = False
    meta = table.schema.metadata or {}
    settings = json.loads(meta[SETTINGS_KEY]) if SETTINGS_KEY in meta else None
    fp = shapes.fingerprint()
    return LengthIndex(shapes, labels, exact, fp, frozenset({fp, given.fingerprint(), *_task_variants(shapes)}),
                       settings)


def _task_variants(shapes: Shapes) -> list[str]:
    """Fingerprints of the same index under the other task numberings scanners use: tasks numbered
    by first appearance in sample_id order (`tokenization.scan_shapes` over a source), and no task
    ids at all. Task ids do not change plans, so a plan made from either is still this data's."""
    t = shapes.task_id
    known = t >= 0
    uniq, first = np.unique(t[known], return_index=True)
    remap = np.full(int(t.max(initial=-1)) + 2, -1, np.int32)  # the last slot keeps -1 at -1
    remap[uniq[np.argsort(first)]] = np.arange(len(uniq), dtype=np.int32)
    out = []
    for task_id in (remap[t], np.full(len(t), -1, np.int32)):
        out.append(Shapes(shapes.sample_id, shapes.input_tokens, shapes.target_tokens, shapes.vision_tokens,
                          task_id).fingerprint())
    return out


def derived_labels(shapes: Shapes, family: str, max_len=None, max_target_len=None, bos: int = 0) -> np.ndarray:
    """Loss labels per sample from token counts alone: the target tokens left after truncation
    (the input is cut first, as `tokenization` does), minus the first label when the input is
    empty. Exact for prompt/response and chat samples; plain-text samples (every token trained)
    cannot be told apart from their counts."""
    inp = shapes.input_tokens.astype(np.int64)
    tgt = shapes.target_tokens.astype(np.int64)
    if family == "encoder_decoder":
        return tgt if max_target_len is None else np.minimum(tgt, max_target_len)
    if max_len is not None:
        over = np.maximum(inp + tgt - int(max_len), 0)
        tgt = tgt - np.maximum(over - np.maximum(inp - bos, 0), 0)
    return np.maximum(tgt - ((inp == 0) & (tgt > 0)), 0)


class IndexedPlanner:
    """Global batches of each epoch and their plans (see the module docstring), made by the same
    `dynabatch.core.steps` functions ``dynabatch plan`` uses, from ``options`` (a `PlanOptions`
    whose ``num_ranks`` is the loader's world size)."""

    def __init__(self, index: LengthIndex, cost: CostModel, options: PlanOptions):
        options.require_batch()
        self.index = index
        self.cost = cost
        self.options = options
        self._cache: dict[int, list[np.ndarray]] = {}
        self._counts: dict[int, int] = {}

    # -- global batches ----------------------------------------------------------------------
    def batches(self, epoch: int) -> list[np.ndarray]:
        """Index positions of each global batch of ``epoch``."""
        if epoch not in self._cache:
            parts = global_batches(self.index.shapes, self.cost, self.options, epoch)
            if len(self._cache) >= 2:
                self._cache.pop(next(iter(self._cache)))
            self._cache[epoch] = parts
            self._counts[epoch] = len(parts)
        return self._cache[epoch]

    def num_steps(self, epoch: int) -> int:
        """Steps (global batches) in ``epoch``."""
        if epoch not in self._counts:
            n = num_global_batches(len(self.index), self.options)
            if n is None:
                self.batches(epoch)
            else:
                self._counts[epoch] = n
        return self._counts[epoch]

    def first_step(self, epoch: int) -> int:
        """Global step number of ``epoch``'s first step (steps count from 0 across epochs)."""
        return sum(self.num_steps(e) for e in range(epoch))

    # -- plans -------------------------------------------------------------------------------
    def plan(self, epoch: int, k: int, rank: int, exclude: np.ndarray | None = None) -> StepPlan:
        """This rank's plan of step ``k`` of ``epoch``; ``exclude``: sample ids already consumed
        (a step resumed half-way on another world size)."""
        with Timer() as t:
            pos = self.batches(epoch)[k]
            if exclude is not None and len(exclude):
                pos = pos[~np.isin(self.index.shapes.sample_id[pos], exclude)]
            plan, rank_map = self.plan_global(pos, self.first_step(epoch) + k)
            sp = rank_step(plan, rank, epoch=epoch, step_in_epoch=k, plan_time_s=0.0, rank_map=rank_map,
                           step_target_tokens=int(self.index.label_tokens[pos].sum()))
            ids = sp.sample_ids()
            positions = self.index.positions(ids) if len(ids) else np.zeros(0, np.int64)
        return replace(sp, plan_time_s=t.s, positions=positions)

    def plan_global(self, pos: np.ndarray, step: int):
        """The global `BatchPlan` of the samples at index positions ``pos`` (all ranks), and the map
        from the plan's ranks to loader ranks (None when they are the same)."""
        plan = plan_step(self.index.shapes, self.cost, self.options, pos, step)
        return plan, (None if plan.num_ranks == self.options.num_ranks else np.arange(plan.num_ranks))


class IndexedSteps:
    """Steps of one epoch for one rank, planned ahead in a thread, loaded and collated.

    An `torch.utils.data.IterableDataset` in spirit: with DataLoader workers, worker ``w`` of
    ``n`` produces the steps ``start + w, start + w + n, ...``; the main process puts them back in
    order. ``plan_ahead`` is how many steps the planning thread runs ahead of loading.
    """

    def __init__(self, planner, access, formatter, collate: CollateConfig, *, rank: int, vision=None,
                 load_pixels: bool = False, on_error: str = "raise", plan_ahead: int = 2, exact_labels: bool = True,
                 tokens: TokenCache | None = None, plan_processes: int = 0):
        self.planner = planner
        self.plan_processes = plan_processes
        self.tokens = tokens
        self.access = access
        self.formatter = formatter
        self.collate = collate
        self.rank = rank
        self.vision = vision
        self.load_pixels = load_pixels
        self.on_error = on_error
        self.plan_ahead = plan_ahead
        self.exact_labels = exact_labels
        self.epoch = 0
        self.start = 0
        self.exclude: np.ndarray | None = None
        self._warned: set = set()

    def configure(self, epoch: int, start: int, exclude: np.ndarray | None) -> None:
        """Iterate ``epoch`` from step ``start`` (``exclude``: ids already consumed of that step)."""
        self.epoch, self.start, self.exclude = int(epoch), int(start), exclude

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    def iter_worker(self, worker: int, num_workers: int):
        """ReadyStep items of the steps this worker owns, in order."""
        epoch, start, exclude = self.epoch, self.start, self.exclude
        ks = range(start + worker, self.planner.num_steps(epoch), max(num_workers, 1))

        def plans(steps=ks):
            for k in steps:
                yield self.planner.plan(epoch, k, self.rank, exclude if k == start else None)

        name = f"dynabatch-plan-r{self.rank}w{worker}"
        P = int(self.plan_processes)
        if P > 0 and get_worker_info() is None:
            ahead = _Interleaved([ProcessAhead(lambda p=p: plans(ks[p::P]), max(self.plan_ahead, 4), name=f"{name}p{p}")
                                  for p in range(P)])
        else:
            ahead = Ahead(plans, self.plan_ahead, name=name)
        try:
            for sp in ahead:
                yield self.load(sp)
        finally:
            ahead.close()

    def load(self, sp: StepPlan) -> ReadyStep:
        """Read, tokenize and collate this rank's samples of a planned step."""
        if self.tokens is not None:
            return self._load_cached(sp)
        with Timer() as t:
            ids = sp.sample_ids()
            samples = self.access.read(ids) if len(ids) else []
            toks = encode_samples(samples, self.formatter, self.vision, self.load_pixels, on_error="raise")
            by_id = {t.sample_id: t for t in toks}
            batches = collate_step(sp, by_id, self.collate, on_mismatch=lambda m: self._warn_once(
                "shape", f"{m}; the length index does not match the tokenization (stale index, or built with "
                         "other settings): batches are padded to fit, but the plan's costs are off"))
            self._check_labels(sp, toks)
        return ReadyStep(sp, batches, load_time_s=t.s)

    def _load_cached(self, sp: StepPlan) -> ReadyStep:
        """Collate a planned step from the token cache (no record reads, no tokenization)."""
        with Timer() as t:
            batches = collate_step(sp, None, self.collate, gather=self.tokens.gather, on_mismatch=lambda m: self._warn_once(
                "shape", f"{m}; the length index does not match the tokenization (stale index, or built with "
                         "other settings): batches are padded to fit, but the plan's costs are off"))
            if not self.exact_labels and "labels" not in self._warned:
                ids = sp.sample_ids()
                if len(ids):
                    index = self.planner.index
                    want = index.label_tokens[index.positions(ids)]
                    if not np.array_equal(want, self.tokens.label_counts(ids, self.collate.family)):
                        self._warn_labels()
        return ReadyStep(sp, batches, load_time_s=t.s)

    def _warn_labels(self) -> None:
        self._warn_once("labels", "step_target_tokens is derived from the length index's target_tokens, which "
                        "does not count every loss label of these samples (plain-text samples train on every "
                        "token); build the index with dynabatch.build_index (adds label_tokens) for exact counts")

    def _check_labels(self, sp: StepPlan, toks) -> None:
        if self.exact_labels or "labels" in self._warned or not toks:
            return
        index = self.planner.index
        ids = np.fromiter((t.sample_id for t in toks), np.int64, count=len(toks))
        want = index.label_tokens[index.positions(ids)]
        got = label_counts([t.enc for t in toks], self.collate.family)
        if not np.array_equal(want, got):
            self._warn_once("labels", "step_target_tokens is derived from the length index's target_tokens, which "
                            "does not count every loss label of these samples (plain-text samples train on every "
                            "token); build the index with dynabatch.build_index (adds label_tokens) for exact counts")


class _Interleaved:
    """Items of several `ProcessAhead` s taken round-robin (process ``p`` plans steps ``p, p + P,
    ...`` of the worker's share), i.e. in step order."""

    def __init__(self, aheads: list):
        self.aheads = aheads
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.aheads[self.i % len(self.aheads)])
        self.i += 1
        return item

    def close(self, wait: float = 0.0) -> None:
        for a in self.aheads:
            a.close(wait)


class WorkerSplitDataset(IterableDataset):
    """A `torch.utils.data.IterableDataset` over an object with ``iter_worker(worker, num_workers)``
    (`IndexedSteps`, the streaming chunk producer): each DataLoader worker gets its own share."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        it = iter(self.inner.iter_worker(w, n))
        if info is None:
            return it
        # In a worker process: hand each collated step over as one buffer (see ReadyStep.packed)
        return (x.packed() if isinstance(x, ReadyStep) else x for x in it)
