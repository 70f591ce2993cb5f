"""Records shared by the indexed and streaming modes: a step's plan for one rank, tokenized
samples, and the step -> collated micro-batch dicts conversion.

A `StepPlan` is what one rank runs in one optimizer step: its micro-batches in execution order
(padded with zero-token placeholders up to the step's micro-batch count, which is the same on every
rank) and the whole global batch's token and sample counts (all ranks), for loss normalization; a
`MicroBatchPlan` is one planned `dynabatch.core.batchplan.MicroBatch` under the loader's collation
(`MicroBatchPlan.of`). How these relate to the other plan records: `dynabatch.core.batchplan`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from . import pixels as _pixels
from ..core.batchplan import BatchPlan, MicroBatch
from .collate import IGNORE_INDEX, FlatIds, collate_packed, collate_padded, flat_ids, placeholder_batch


@dataclass(frozen=True)
class MicroBatchPlan:
    """One micro-batch of one rank: sample ids in row order and the plan's padded shape.

    ``rows`` is each sample's row for packed-rows collation (None otherwise); ``input_len`` and
    ``target_len`` are the plan's padded lengths in tokens (0: derive from the samples);
    ``real_tokens`` the plan's count of real tokens (input + target + vision);
    ``predicted_time_s`` the cost model's forward+backward seconds on one stage and
    ``predicted_memory_bytes`` its activation bytes on one stage.
    """

    sample_ids: np.ndarray
    rows: np.ndarray | None = None
    input_len: int = 0
    target_len: int = 0
    real_tokens: int = 0
    predicted_time_s: float = 0.0
    predicted_memory_bytes: float = 0.0
    is_padding: bool = False

    @classmethod
    def of(cls, mb: MicroBatch, collation: str) -> "MicroBatchPlan":
        """The loader's record of the planned micro-batch ``mb`` under ``collation``: per-sample rows only for
        ``packed_rows``, no padded lengths for ``packed`` (the samples' own are used)."""
        lengths = collation != "packed"
        return cls(sample_ids=mb.sample_ids.copy(), rows=mb.sample_row.copy() if collation == "packed_rows" else None,
                   input_len=mb.input_len if lengths else 0, target_len=mb.target_len if lengths else 0,
                   real_tokens=mb.real_tokens, predicted_time_s=mb.time_s, predicted_memory_bytes=mb.memory_bytes)

    @classmethod
    def placeholder(cls) -> "MicroBatchPlan":
        """A zero-token micro-batch that fills a rank's step up to the step's micro-batch count."""
        return cls(np.zeros(0, np.int64), is_padding=True)


@dataclass(frozen=True)
class StepPlan:
    """One rank's share of one optimizer step (see the module docstring).

    ``step`` counts from 0 across epochs; ``step_in_epoch`` within the epoch. ``step_real_tokens``,
    ``step_target_tokens`` (labels that count in the loss) and ``step_samples`` cover all ranks.
    ``plan_time_s`` is the wall time spent planning the step (seconds).
    """

    step: int
    epoch: int
    step_in_epoch: int
    collation: str
    microbatches: tuple[MicroBatchPlan, ...]
    step_real_tokens: int
    step_target_tokens: int
    step_samples: int
    plan_time_s: float = 0.0
    #: index positions of `sample_ids` (indexed mode, when the planner computed them), else None
    positions: np.ndarray | None = None
    #: the step's `BatchPlan`: the global plan (indexed mode), this rank's own plan (streaming), None
    #: for a replayed plan file
    plan: BatchPlan | None = None
    #: `Shapes` of the samples of ``plan`` (set by the mode that made the plan), else None
    shapes: object = None
    #: ``getattr(cost_model, "version", 0)`` when the step was planned
    cost_version: int = 0

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    def sample_ids(self) -> np.ndarray:
        """This rank's sample ids of the step, micro-batch by micro-batch."""
        parts = [mb.sample_ids for mb in self.microbatches]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


@dataclass
class TokSample:
    """A tokenized sample: the `EncodedSample` plus what collation needs of its images.

    ``tiles`` is the sample's vision tile count under the vision policy (0 without images);
    ``images`` keeps the image references only when pixels will be decoded.
    """

    sample_id: int
    enc: object
    tiles: int = 0
    images: list | None = None

    @property
    def input_tokens(self) -> int:
        return int(self.enc.input_tokens)

    @property
    def target_tokens(self) -> int:
        return int(self.enc.target_tokens)

    @property
    def vision_tokens(self) -> int:
        return int(self.enc.vision_tokens)


def label_tokens(enc, family: str) -> int:
    """Labels of one sample that count in the loss after collation (the first is masked for
    decoder-only models, see `dynabatch.loader.collate`)."""
    if family == "encoder_decoder":
        return len(enc.target_ids)
    labels = enc.labels if enc.labels is not None else enc.input_ids
    return int(np.count_nonzero(labels[1:] != IGNORE_INDEX))


def label_counts(encs: Sequence, family: str) -> np.ndarray:
    """`label_tokens` of many samples at once (one pass over their concatenated labels)."""
    if not len(encs):
        return np.zeros(0, np.int64)
    if family == "encoder_decoder":
        return np.fromiter((len(e.target_ids) for e in encs), np.int64, count=len(encs))
    labels = [e.labels if e.labels is not None else e.input_ids for e in encs]
    lengths = np.fromiter((len(a) for a in labels), np.int64, count=len(labels))
    trained = np.concatenate(labels) != IGNORE_INDEX
    starts = np.cumsum(lengths) - lengths
    trained[starts[lengths > 0]] = False  # the first label of each sample is masked at collation
    counts = np.zeros(len(encs), np.int64)
    nz = lengths > 0
    counts[nz] = np.add.reduceat(trained.astype(np.int64), starts[nz])
    return counts


def encode_samples(samples: Sequence[dict], formatter, vision, keep_images: bool,
                   on_error: str = "raise") -> list[TokSample]:
    """Tokenize samples with one batched tokenizer call; skipped samples (``on_error="skip"``)
    are left out."""
    encoded = formatter.encode_batch(samples, on_error=on_error)
    keep = [i for i, e in enumerate(encoded) if e is not None]
    kept = [samples[i] for i in keep]
    tiles = _pixels.sample_tiles(kept, vision) if vision is not None else np.zeros(len(kept), np.int64)
    return [TokSample(int(encoded[i].sample_id), encoded[i], int(t),
                      list(samples[i].get("images") or []) if keep_images else None)
            for i, t in zip(keep, tiles)]


def rank_step(plan: BatchPlan, rank: int, *, epoch: int, step_in_epoch: int, step_target_tokens: int,
              plan_time_s: float = 0.0, rank_map: np.ndarray | None = None) -> StepPlan:
    """This rank's `StepPlan` from a global `BatchPlan`: its micro-batches in execution order,
    padded with placeholders up to the largest per-rank count (equal on every rank).

    ``rank_map`` maps the plan's ranks to loader ranks (a global batch with fewer samples than
    ranks is planned on fewer ranks; the others only get placeholders).
    """
    mb_rank = plan.mb_rank if rank_map is None else np.asarray(rank_map)[plan.mb_rank]
    counts = np.bincount(mb_rank, minlength=rank + 1)
    K = int(counts.max(initial=0))
    mine = np.flatnonzero(mb_rank == rank)
    mine = mine[np.argsort(plan.mb_order[mine], kind="stable")]
    mbs = [MicroBatchPlan.of(plan.microbatch(k), plan.collation) for k in mine]
    mbs += [MicroBatchPlan.placeholder()] * (K - len(mbs))
    return StepPlan(step=int(plan.step), epoch=epoch, step_in_epoch=step_in_epoch, collation=plan.collation,
                    microbatches=tuple(mbs), step_real_tokens=int(plan.mb_real_tokens.sum()),
                    step_target_tokens=int(step_target_tokens), step_samples=len(plan.sample_ids),
                    plan_time_s=plan_time_s, plan=plan)


@dataclass(frozen=True)
class CollateConfig:
    """How micro-batches are collated: layout, model family, special ids and vision handling.

    ``collation`` is the plan's (``padded``, ``packed``, ``packed_rows``); ``pad_to_multiple_of``
    is also the placeholder length (tokens).
    """

    collation: str
    family: str
    pad_id: int
    pad_to_multiple_of: int = 8
    decoder_start_token_id: int | None = None
    vision: object = None
    load_pixels: bool = False
    pixel_mean: tuple = _pixels.IMAGENET_MEAN
    pixel_std: tuple = _pixels.IMAGENET_STD


@dataclass
class ReadyStep:
    """A collated step: this rank's micro-batch dicts plus what the loader's state needs."""

    step: StepPlan
    batches: list
    snapshot: dict | None = None  # streaming: the planner's state before this step
    load_time_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def pin_memory(self) -> "ReadyStep":
        """Page-locked copies of the tensors (called by the torch DataLoader's pin-memory thread)."""
        batches = [{k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in b.items()}
                   for b in self.unpacked().batches]
        return ReadyStep(self.step, batches, self.snapshot, self.load_time_s, self.extra)

    def packed(self, shared: bool = True) -> "ReadyStep":
        """The same step with every tensor of every micro-batch copied into one byte buffer
        (`PackedBatches`): a DataLoader worker hands a whole step over as one pickled array
        instead of one shared-memory segment per tensor."""
        if isinstance(self.batches, PackedBatches):
            return self
        return ReadyStep(self.step, PackedBatches.pack(self.batches, shared), self.snapshot, self.load_time_s, self.extra)

    def unpacked(self) -> "ReadyStep":
        """The micro-batch dicts again (tensors are views of the step's buffer; no copy)."""
        if not isinstance(self.batches, PackedBatches):
            return self
        return ReadyStep(self.step, self.batches.unpack(), self.snapshot, self.load_time_s, self.extra)


class PackedBatches:
    """A step's micro-batch dicts with their tensors laid out in one contiguous uint8 tensor
    (8-byte aligned; one shared-memory segment when a worker hands it over); ``spec`` holds each
    dict with tensors replaced by (offset, dtype, shape)."""

    __slots__ = ("buffer", "spec")

    def __init__(self, buffer: np.ndarray, spec: list):
        self.buffer, self.spec = buffer, spec

    def __len__(self) -> int:
        return len(self.spec)

    @classmethod
    def pack(cls, batches: list, shared: bool = True) -> "PackedBatches":
        parts, spec, off = [], [], 0
        for b in batches:
            entry = {}
            for k, v in b.items():
                if isinstance(v, torch.Tensor) and not v.requires_grad and v.device.type == "cpu":
                    a = np.ascontiguousarray(v.numpy())
                    entry[k] = _TensorSlot(off, a.dtype.str, a.shape)
                    parts.append((off, a))
                    off += -(-a.nbytes // 8) * 8
                else:
                    entry[k] = v
            spec.append(entry)
        buf = torch.empty(off, dtype=torch.uint8) if shared else np.empty(off, np.uint8)
        view = buf.numpy() if shared else buf
        for o, a in parts:
            view[o:o + a.nbytes] = a.reshape(-1).view(np.uint8)
        return cls(buf, spec)

    def unpack(self) -> list:
        buf = self.buffer.numpy() if isinstance(self.buffer, torch.Tensor) else self.buffer
        out = []
        for entry in self.spec:
            b = {}
            for k, v in entry.items():
                if isinstance(v, _TensorSlot):
                    dt = np.dtype(v.dtype)
                    n = int(np.prod(v.shape, dtype=np.int64)) * dt.itemsize
                    b[k] = torch.from_numpy(buf[v.offset:v.offset + n].view(dt).reshape(v.shape))
                else:
                    b[k] = v
            out.append(b)
        return out


@dataclass(frozen=True)
class _TensorSlot:
    offset: int
    dtype: str
    shape: tuple


class ShapeMismatch(Warning):
    """The samples are longer than the plan said (the length index is stale or was built with
    other tokenization settings)."""


def collate_step(step: StepPlan, samples: Mapping[int, TokSample] | None, cfg: CollateConfig,
                 on_mismatch=None, gather=None) -> list[dict]:
    """Collate every micro-batch of a `StepPlan` and attach the metadata keys.

    ``samples`` maps sample id -> `TokSample` (at least this rank's samples of the step); or
    ``gather(sample_ids, positions)`` returns the step's concatenated ids directly (``(input ids,
    lengths, labels or target ids, lengths)`` in `StepPlan.sample_ids` order: the token cache;
    text only).
    ``on_mismatch(message)`` is called when a sample is longer than the plan's padded length.
    """
    out = []
    K = step.num_microbatches
    if gather is not None:  # one gather for the whole step, then per micro-batch slices (views)
        ids = step.sample_ids()
        flat_all, len_all, second_all, slen_all = gather(ids, step.positions)
        counts = [len(mb.sample_ids) for mb in step.microbatches]
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        ends = np.concatenate([[0], np.cumsum(len_all)]).astype(np.int64)
        sends = ends if slen_all is len_all else np.concatenate([[0], np.cumsum(slen_all)]).astype(np.int64)
    for i, mb in enumerate(step.microbatches):
        toks: list[TokSample] = []
        if mb.is_padding:
            batch = placeholder_batch(cfg.collation, family=cfg.family, pad_id=cfg.pad_id,
                                      length=cfg.pad_to_multiple_of,
                                      decoder_start_token_id=cfg.decoder_start_token_id)
            real = 0
        else:
            if gather is not None:
                a, b = bounds[i], bounds[i + 1]
                lengths = len_all[a:b]
                flat = FlatIds(flat_all[ends[a]:ends[b]], lengths, second_all[sends[a]:sends[b]],
                               lengths if slen_all is len_all else slen_all[a:b])
                has_vision = False
            else:
                toks = [samples[int(s)] for s in mb.sample_ids]
                flat = flat_ids([t.enc for t in toks], cfg.family)
                has_vision = any(t.vision_tokens for t in toks)
            if cfg.collation == "packed":
                batch = collate_packed(flat, family=cfg.family, pad_id=cfg.pad_id,
                                       decoder_start_token_id=cfg.decoder_start_token_id)
            else:
                # The plan's main length counts vision tokens: without image placeholders the model
                # inserts them itself, so the text ids are padded to their own longest row; with
                # placeholders (image_token_id) the ids hold them, and that row is the merged one.
                want_in = 0 if has_vision else mb.input_len
                batch = collate_padded(flat, family=cfg.family, pad_id=cfg.pad_id,
                                       pad_to_multiple_of=cfg.pad_to_multiple_of, input_len=want_in,
                                       target_len=mb.target_len, rows=mb.rows,
                                       decoder_start_token_id=cfg.decoder_start_token_id)
                if on_mismatch is not None and not has_vision and mb.input_len and (
                        batch["input_ids"].shape[1] > mb.input_len
                        or ("decoder_input_ids" in batch and batch["decoder_input_ids"].shape[1] > mb.target_len)):
                    on_mismatch(f"step {step.step} micro-batch {i}: samples need {tuple(batch['input_ids'].shape)} "
                                f"but the plan padded to {mb.input_len} (target {mb.target_len}) tokens")
            real = mb.real_tokens
        if cfg.vision is not None:
            batch["image_tiles"] = torch.tensor([t.tiles for t in toks], dtype=torch.int64)
            if cfg.load_pixels:
                batch["pixel_values"] = _pixels.pixel_values([t.images or [] for t in toks], cfg.vision,
                                                             cfg.pixel_mean, cfg.pixel_std)
        batch.update(
            step=step.step, epoch=step.epoch, microbatch=i, num_microbatches=K, real_tokens=int(real),
            step_real_tokens=step.step_real_tokens, step_target_tokens=step.step_target_tokens,
            step_samples=step.step_samples, predicted_time_s=float(mb.predicted_time_s),
            predicted_memory_bytes=float(mb.predicted_memory_bytes),
            plan_time_s=float(step.plan_time_s), is_padding=bool(mb.is_padding),
            sample_ids=torch.from_numpy(np.asarray(mb.sample_ids, np.int64).copy()),
        )
        out.append(batch)
    return out


class Timer:
    """``with Timer() as t: ...`` then ``t.s`` (seconds)."""

    def __enter__(self):
        self._t = time.perf_counter()
        self.s = 0.0
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self._t
        return False
