"""Collation: `tokenization.EncodedSample` s -> model inputs shaped like the Hugging Face collators'.

Two layouts, both built with numpy scatters over the concatenated ids of a micro-batch (one
``np.concatenate`` per micro-batch, no loop over tokens):

* `collate_padded`: one row per sample, right-padded to the micro-batch's longest sample rounded up
  to ``pad_to_multiple_of`` (or to the plan's padded length). Decoder-only: ``input_ids``,
  ``attention_mask``, ``labels``; encoder-decoder adds ``decoder_input_ids`` (labels shifted right
  behind the decoder start id) and ``decoder_attention_mask``. With ``rows=`` several samples share
  a row (the ``pack`` baseline's fixed-length rows) and ``position_ids`` (``decoder_position_ids``
  too, encoder-decoder) restart at each sample.
* `collate_packed`: all samples of the micro-batch in one row of ``T`` tokens, as
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` does: ``input_ids``/``labels``/
  ``position_ids`` of shape [1, T], ``position_ids`` restarting at 0 per sample, ``cu_seqlens``
  (int32, [n+1]) and ``max_seqlen`` (tokens) for variable-length attention kernels; decoder-only
  batches repeat them under Hugging Face's names ``cu_seq_lens_q``/``cu_seq_lens_k`` and
  ``max_length_q``/``max_length_k`` (see `model_inputs`).

Labels are -100 (`IGNORE_INDEX`) on padding, on prompts (the `Formatter` masks them) and, for
decoder-only models, on the first token of every sample. Hugging Face causal-LM models shift the
labels inside (position t predicts label t+1), so a sample's first label is never predicted in the
padded layout and would be predicted from the previous sample in the packed layout;
``DataCollatorWithFlattening`` masks it for that reason. Masking it in both layouts makes
``(labels != -100).sum()`` exactly the number of loss terms, which is what per-token loss
normalization (`step_target_tokens`) needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..core.kernels.rows import pad_rows

IGNORE_INDEX = -100

#: Hugging Face's names of the packed sample boundaries (``FlashAttentionKwargs``).
FLASH_ATTN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

#: Keys of a collated micro-batch that a Hugging Face model's ``forward`` accepts.
MODEL_INPUT_KEYS = (
    "input_ids", "attention_mask", "labels", "position_ids", "decoder_input_ids",
    "decoder_attention_mask", "pixel_values", *FLASH_ATTN_KEYS,
)


def model_inputs(batch: Mapping, keys: Sequence[str] = MODEL_INPUT_KEYS) -> dict:
    """The model inputs of a collated micro-batch, so that ``model(**model_inputs(batch))`` works;
    the metadata (``step``, ``sample_ids``, ``cu_seqlens``, ...) stays out.

    Padded: ``input_ids``, ``attention_mask``, ``labels`` (+ ``position_ids`` for packed rows,
    + the ``decoder_*`` tensors for encoder-decoder, + ``pixel_values``). Packed decoder-only:
    ``input_ids``, ``labels``, ``position_ids`` [1, T], the flash-attention kwargs
    ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32 [n+1]) and ``max_length_q``/``max_length_k``
    (tokens), plus ``use_cache=False``. Hugging Face causal LMs take the four kwargs through
    ``**kwargs``: ``flash_attention_2``/``_3`` run varlen attention on them, ``sdpa``/``eager``/
    ``flex_attention`` ignore them and build the block-diagonal causal mask from the restarting
    ``position_ids`` instead (``masking_utils.find_packed_sequence_indices``), which they only do
    without an ``attention_mask`` and without a KV cache; hence ``use_cache=False`` (a cache is
    built whenever ``config.use_cache`` is true, the default, and the samples would then attend
    to each other). Packed encoder-decoder batches have no Hugging Face varlen path (T5, BART
    attend across the row): use them with dynabatch's own models or padded collation.
    """
    out = {k: batch[k] for k in keys if k in batch}
    pixels = out.get("pixel_values")
    if pixels is not None and pixels.shape[0] == 0:  # a text-only micro-batch: HF vision towers refuse 0 images
        del out["pixel_values"]
    if "cu_seq_lens_q" in out and "attention_mask" not in out:
        out["use_cache"] = False
    return out


def _round_up(x: int, multiple: int) -> int:
    return -(-int(x) // multiple) * multiple if multiple > 1 else int(x)


def _flatten(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Concatenated values (int64), per-array lengths and start offsets of ragged 1-D arrays."""
    lengths = np.fromiter((len(a) for a in arrays), np.int64, count=len(arrays))
    flat = np.concatenate(arrays).astype(np.int64, copy=False) if len(arrays) else np.zeros(0, np.int64)
    starts = np.cumsum(lengths) - lengths
    return flat, lengths, starts


def _positions(lengths: np.ndarray, starts: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    """For every element of the flattened arrays: the array it belongs to and its index in it."""
    owner = np.repeat(np.arange(len(lengths)), lengths)
    within = np.arange(total, dtype=np.int64) - starts[owner]
    return owner, within


def _row_layout(lengths: np.ndarray, rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Row of each sample, the column its first token lands in, the number of rows and the longest
    row. Without ``rows`` every sample has its own row; with ``rows`` samples sharing a row are laid
    out one after another in their order in the micro-batch."""
    n = len(lengths)
    if rows is None:
        return np.arange(n), np.zeros(n, np.int64), n, int(lengths.max(initial=0))
    rows = np.asarray(rows, np.int64)
    if len(rows) != n:
        raise ValueError(f"rows has {len(rows)} entries for {n} samples")
    order = np.argsort(rows, kind="stable")
    sorted_len = lengths[order]
    cum = np.cumsum(sorted_len) - sorted_len  # running offset over the samples sorted by row
    first = np.searchsorted(rows[order], rows[order], side="left")  # first sample of each row
    col = np.empty(n, np.int64)
    col[order] = cum - cum[first]
    nrows = int(rows.max(initial=-1)) + 1
    row_len = np.bincount(rows, weights=lengths, minlength=nrows).astype(np.int64)
    return rows, col, nrows, int(row_len.max(initial=0))


def _scatter(flat, owner, within, row, col, shape, fill) -> np.ndarray:
    out = np.full(shape, fill, np.int64)
    if len(flat):
        out[row[owner], col[owner] + within] = flat
    return out


def _shift_right(flat: np.ndarray, starts: np.ndarray, start_id: int) -> np.ndarray:
    """Per-array shift right behind ``start_id`` (the decoder input of teacher forcing)."""
    out = np.empty_like(flat)
    if len(flat):
        out[1:] = flat[:-1]
        out[starts[starts < len(flat)]] = start_id
    return out


def _labels_of(samples) -> list[np.ndarray]:
    return [s.labels if s.labels is not None else s.input_ids for s in samples]


def _rows(flat, lengths: np.ndarray, L: int, fill: int, with_mask: bool):
    """(values [n, L] int64, attention mask [n, L] int64 or None) via the `pad_rows` kernel; `_dense`
    is the boolean-mask numpy path the tests compare it with."""
    n = len(lengths)
    out = np.empty((n, L), np.int64)
    mask = np.empty((n, L) if with_mask else (0, 0), np.int64)
    pad_rows(np.asarray(flat, np.int64), lengths, fill, out, mask)
    return out, (mask if with_mask else None)


def _dense(flat: np.ndarray, mask: np.ndarray, fill: int) -> np.ndarray:
    """Rows of ``mask``'s shape: ``flat`` where ``mask`` is True (row-major order), else ``fill``.
    ``flat`` holds each row's values contiguously, in row order (one sample per row)."""
    out = np.full(mask.shape, fill, np.int64)
    out[mask] = flat
    return out


def _first_masked(lab: np.ndarray, lengths: np.ndarray, starts: np.ndarray) -> np.ndarray:
    lab = np.array(lab, np.int64, copy=True)
    lab[starts[lengths > 0]] = IGNORE_INDEX
    return lab


def _check_family(family: str) -> None:
    if family not in ("decoder", "encoder_decoder"):
        raise ValueError(f"family must be 'decoder' or 'encoder_decoder', got {family!r}")


@dataclass(frozen=True)
class FlatIds:
    """A micro-batch's samples as concatenated int64 ids, the input of both collations.

    ``ids``/``lengths``: the samples' input ids one after another and their lengths (tokens);
    ``second``/``second_lengths``: their labels (decoder-only, aligned with the input ids) or
    target ids (encoder-decoder). A loader that gathers a whole step's ids at once slices them
    into one `FlatIds` per micro-batch instead of building per-sample arrays."""

    ids: np.ndarray
    lengths: np.ndarray
    second: np.ndarray
    second_lengths: np.ndarray


def flat_ids(samples: Sequence, family: str) -> FlatIds:
    """The `FlatIds` of `EncodedSample` s: labels (input ids where a sample has none) for
    ``family="decoder"``, target ids for ``"encoder_decoder"``."""
    _check_family(family)
    ids, lengths, _ = _flatten([s.input_ids for s in samples])
    if family == "decoder":
        return FlatIds(ids, lengths, _flatten(_labels_of(samples))[0], lengths)
    second, second_lengths, _ = _flatten([s.target_ids for s in samples])
    return FlatIds(ids, lengths, second, second_lengths)


def _as_flat(samples: Sequence | FlatIds, family: str) -> FlatIds:
    _check_family(family)
    return samples if isinstance(samples, FlatIds) else flat_ids(samples, family)


def _targets(flat: FlatIds, pad_id: int, decoder_start_token_id: int | None):
    """Encoder-decoder target side: (decoder start id, target ids int64, their lengths, their starts)."""
    start_id = pad_id if decoder_start_token_id is None else int(decoder_start_token_id)
    tlen = np.asarray(flat.second_lengths, np.int64)
    return start_id, np.asarray(flat.second, np.int64), tlen, np.cumsum(tlen) - tlen


def collate_padded(
    samples: Sequence | FlatIds,
    *,
    family: str = "decoder",
    pad_id: int = 0,
    pad_to_multiple_of: int = 1,
    input_len: int | None = None,
    target_len: int | None = None,
    decoder_start_token_id: int | None = None,
    rows: Sequence[int] | np.ndarray | None = None,
    mask_first_label: bool = True,
) -> dict[str, torch.Tensor]:
    """Right-padded batch of `EncodedSample` s (or their `FlatIds`), as int64 tensors.

    ``input_len``/``target_len`` (tokens) pad to at least these lengths (the plan's padded shape);
    otherwise the longest row is rounded up to ``pad_to_multiple_of``. Decoder-only: ``input_ids``,
    ``attention_mask``, ``labels`` of shape [rows, L]. Encoder-decoder: ``input_ids`` and
    ``attention_mask`` [rows, L], ``labels``, ``decoder_input_ids`` (labels shifted right behind
    ``decoder_start_token_id``, default ``pad_id``, padding as ``pad_id``) and
    ``decoder_attention_mask`` [rows, T]. ``rows`` puts several samples in one row (packed rows);
    ``position_ids`` (and, encoder-decoder, ``decoder_position_ids``) then restart at each sample, so
    a model can tell the samples of a row apart (`dynabatch.pipeline.models.segment_ids`). See the module
    docstring for the label rule.
    """
    fl = _as_flat(samples, family)
    mult = max(int(pad_to_multiple_of or 1), 1)
    flat, second = np.asarray(fl.ids, np.int64), fl.second
    lengths = np.asarray(fl.lengths, np.int64)
    out: dict[str, torch.Tensor] = {}
    if rows is None:  # one sample per row: one kernel pass fills values and mask
        L = max(_round_up(int(lengths.max(initial=0)), mult), int(input_len or 0))
        ids, am = _rows(flat, lengths, L, pad_id, True)
        out["input_ids"] = torch.from_numpy(ids)
        out["attention_mask"] = torch.from_numpy(am)
        if family == "decoder":
            lab, _ = _rows(second, lengths, L, IGNORE_INDEX, False)
            if mask_first_label and L:
                lab[:, 0] = IGNORE_INDEX  # every sample starts its own row (empty rows are all -100)
            out["labels"] = torch.from_numpy(lab)
            return out
        start_id, tflat, tlen, tstarts = _targets(fl, pad_id, decoder_start_token_id)
        T = max(_round_up(int(tlen.max(initial=0)), mult), int(target_len or 0))
        lab, tmask = _rows(tflat, tlen, T, IGNORE_INDEX, True)
        out["labels"] = torch.from_numpy(lab)
        dec, _ = _rows(_shift_right(tflat, tstarts, start_id), tlen, T, pad_id, False)
        out["decoder_input_ids"] = torch.from_numpy(dec)
        out["decoder_attention_mask"] = torch.from_numpy(tmask)
        return out
    starts = np.cumsum(lengths) - lengths
    owner, within = _positions(lengths, starts, len(flat))
    row, col, nrows, longest = _row_layout(lengths, rows)
    L = max(_round_up(longest, mult), int(input_len or 0))
    out["input_ids"] = torch.from_numpy(_scatter(flat, owner, within, row, col, (nrows, L), pad_id))
    out["attention_mask"] = torch.from_numpy(
        _scatter(np.ones_like(flat), owner, within, row, col, (nrows, L), 0))
    out["position_ids"] = torch.from_numpy(_scatter(within, owner, within, row, col, (nrows, L), 0))
    if family == "decoder":
        lab = _first_masked(second, lengths, starts) if mask_first_label else np.asarray(second, np.int64)
        out["labels"] = torch.from_numpy(_scatter(lab, owner, within, row, col, (nrows, L), IGNORE_INDEX))
        return out
    start_id, tflat, tlen, tstarts = _targets(fl, pad_id, decoder_start_token_id)
    towner, twithin = _positions(tlen, tstarts, len(tflat))
    trow, tcol, _, tlongest = _row_layout(tlen, rows)
    T = max(_round_up(tlongest, mult), int(target_len or 0))
    out["labels"] = torch.from_numpy(_scatter(tflat, towner, twithin, trow, tcol, (nrows, T), IGNORE_INDEX))
    out["decoder_input_ids"] = torch.from_numpy(
        _scatter(_shift_right(tflat, tstarts, start_id), towner, twithin, trow, tcol, (nrows, T), pad_id))
    out["decoder_attention_mask"] = torch.from_numpy(
        _scatter(np.ones_like(tflat), towner, twithin, trow, tcol, (nrows, T), 0))
    out["decoder_position_ids"] = torch.from_numpy(_scatter(twithin, towner, twithin, trow, tcol, (nrows, T), 0))
    return out


def _within(lengths: np.ndarray, starts: np.ndarray, total: int) -> np.ndarray:
    """Each element's index inside its own array (positions restarting at 0 per sample)."""
    return np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)


def _flash_kwargs(cu: torch.Tensor, longest: int) -> dict:
    """``cu_seqlens``/``max_seqlen`` under the names of Hugging Face's ``FlashAttentionKwargs``."""
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def collate_packed(
    samples: Sequence | FlatIds,
    *,
    family: str = "decoder",
    pad_id: int = 0,
    decoder_start_token_id: int | None = None,
    mask_first_label: bool = True,
) -> dict:
    """All samples in one row, as ``DataCollatorWithFlattening`` (``return_flash_attn_kwargs``) does;
    ``samples`` are `EncodedSample` s or their `FlatIds`.

    Decoder-only: ``input_ids``, ``labels``, ``position_ids`` (int64, [1, T]) with positions
    restarting at 0 per sample, ``cu_seqlens`` (int32, [n+1]: each sample's start, then T) and
    ``max_seqlen`` (int, the longest sample in tokens), the same boundaries again under Hugging
    Face's names ``cu_seq_lens_q``/``cu_seq_lens_k`` (the same tensor) and ``max_length_q``/
    ``max_length_k``. The first label of every sample is -100 (the separator of
    ``DataCollatorWithFlattening``): a causal LM's shifted loss then never predicts a sample's first
    token from the previous sample (``mask_first_label=False`` keeps it, for models that do not
    shift). Encoder-decoder: the same for the encoder side plus ``labels``, ``decoder_input_ids``
    (shifted right per sample), ``decoder_position_ids``, ``decoder_cu_seqlens`` and
    ``decoder_max_seqlen``; no Hugging Face names (no HF encoder-decoder model reads them).
    """
    fl = _as_flat(samples, family)
    flat = np.asarray(fl.ids, np.int64)
    lengths = np.asarray(fl.lengths, np.int64)
    starts = np.cumsum(lengths) - lengths
    cu, longest = torch.from_numpy(np.append(starts, len(flat)).astype(np.int32)), int(lengths.max(initial=0))
    out: dict = {
        "input_ids": torch.from_numpy(flat.reshape(1, -1)),
        "position_ids": torch.from_numpy(_within(lengths, starts, len(flat)).reshape(1, -1)),
        "cu_seqlens": cu,
        "max_seqlen": longest,
    }
    if family == "decoder":
        lab = _first_masked(fl.second, lengths, starts) if mask_first_label else np.asarray(fl.second, np.int64)
        out["labels"] = torch.from_numpy(lab.reshape(1, -1))
        out.update(_flash_kwargs(cu, longest))
        return out
    start_id, tflat, tlen, tstarts = _targets(fl, pad_id, decoder_start_token_id)
    out["labels"] = torch.from_numpy(tflat.reshape(1, -1))
    out["decoder_input_ids"] = torch.from_numpy(_shift_right(tflat, tstarts, start_id).reshape(1, -1))
    out["decoder_position_ids"] = torch.from_numpy(_within(tlen, tstarts, len(tflat)).reshape(1, -1))
    out["decoder_cu_seqlens"] = torch.from_numpy(np.append(tstarts, len(tflat)).astype(np.int32))
    out["decoder_max_seqlen"] = int(tlen.max(initial=0))
    return out


def placeholder_batch(collation: str, *, family: str = "decoder", pad_id: int = 0, length: int = 8,
                      decoder_start_token_id: int | None = None) -> dict:
    """A dummy micro-batch with zero real tokens: one row of ``length`` pad tokens, every label -100.

    Emitted on a rank that has nothing left for a step so that every rank still runs the same
    number of forward/backward passes (no DDP hang). The attention mask is all ones so attention
    kernels never see a fully masked row (which gives NaN); the loss is exactly 0 because no label
    counts (sum the loss over tokens, do not average it).
    """
    length = max(int(length), 1)
    ids = torch.full((1, length), pad_id, dtype=torch.int64)
    ignore = torch.full((1, length), IGNORE_INDEX, dtype=torch.int64)
    start = pad_id if decoder_start_token_id is None else int(decoder_start_token_id)
    if collation == "packed":
        cu = torch.tensor([0, length], dtype=torch.int32)
        out = {"input_ids": ids, "position_ids": torch.arange(length).reshape(1, -1),
               "cu_seqlens": cu, "max_seqlen": length, "labels": ignore}
        if family == "decoder":
            out.update(_flash_kwargs(cu, length))
        if family == "encoder_decoder":
            out.update(decoder_input_ids=torch.full((1, length), start, dtype=torch.int64),
                       decoder_position_ids=torch.arange(length).reshape(1, -1),
                       decoder_cu_seqlens=torch.tensor([0, length], dtype=torch.int32),
                       decoder_max_seqlen=length)
        return out
    out = {"input_ids": ids, "attention_mask": torch.ones((1, length), dtype=torch.int64), "labels": ignore}
    if collation == "packed_rows":
        out["position_ids"] = torch.arange(length).reshape(1, -1)
    if family == "encoder_decoder":
        dec = torch.full((1, length), pad_id, dtype=torch.int64)
        dec[0, 0] = start
        out.update(decoder_input_ids=dec, decoder_attention_mask=torch.ones((1, length), dtype=torch.int64))
        if collation == "packed_rows":
            out["decoder_position_ids"] = torch.arange(length).reshape(1, -1)
    return out


def count_label_tokens(batch: Mapping) -> int:
    """Labels that count in the loss (not -100) in a collated micro-batch."""
    return int((batch["labels"] != IGNORE_INDEX).sum())
