"""The model contract every layered model stands on, the tiny models and the Hugging Face adapters alike:

* ``IGNORE_INDEX`` (-100): a label that is no loss term (the collators' and Hugging Face's);
* `decoder_boundary` / `seq2seq_boundary`: the specs of the state a decoder-only or encoder-decoder model
  passes between its layers (what crosses a stage boundary), known from a micro-batch's shape alone;
* `decoder_random_batch` / `seq2seq_random_batch`: micro-batches of exactly a given `MicroBatchShape`,
  in the collators' layouts (for profiles and tests);
* `check_bounds`: stage bounds (layer offsets) that cut a model's layers into stages.

The layer contract itself is `dynabatch.pipeline.models.layered`'s.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .spec import MicroBatchShape, TensorSpec

IGNORE_INDEX = -100


def check_bounds(bounds: Sequence[int], n_layers: int) -> tuple[int, ...]:
    """``bounds`` as a tuple of layer offsets, checked: they rise strictly from 0 to ``n_layers`` (stage
    ``s`` holds layers ``bounds[s]`` to ``bounds[s + 1] - 1``, one layer at least). Raises ValueError."""
    b = tuple(int(x) for x in bounds)
    if len(b) < 2 or b[0] != 0 or b[-1] != n_layers or any(y <= x for x, y in zip(b[:-1], b[1:])):
        raise ValueError(f"bounds must rise strictly from 0 to {n_layers} (one layer at least per stage), got {b}")
    return b


def decoder_boundary(hidden: int, dtype: torch.dtype):
    """The decoder state's specs (gpt-tiny, Hugging Face decoder adapters): padded ``(hidden, [rows, L]
    int64)``, packed ``(hidden [1, N], position_ids [1, N], cu_seqlens [n + 1])``."""
    def boundary(shape: MicroBatchShape, layer: int) -> tuple[TensorSpec, ...]:
        if shape.packed:
            n = shape.tokens
            return (TensorSpec((1, n, hidden), dtype, True), TensorSpec((1, n), torch.int64),
                    TensorSpec((shape.rows + 1,), torch.int32))
        if shape.target_len:
            raise ValueError("a decoder-only model has no decoder tokens; its plan must have target_len 0")
        r, L = shape.rows, shape.input_len
        return TensorSpec((r, L, hidden), dtype, True), TensorSpec((r, L), torch.int64)
    return boundary


def _random_lengths(gen: torch.Generator, rows: int, longest: int) -> list[int]:
    """Row lengths whose maximum is ``longest`` (row 0 is the longest)."""
    rest = torch.randint(1, longest + 1, (rows - 1,), generator=gen).tolist()
    return [longest] + rest


def _random_packed_lengths(gen: torch.Generator, n: int, total: int) -> list[int]:
    """``n`` positive lengths summing to ``total`` (a random composition)."""
    if n > total:
        raise ValueError(f"cannot pack {n} sequences into {total} tokens")
    cuts = torch.randperm(total - 1, generator=gen)[: n - 1] + 1
    bounds = [0] + sorted(cuts.tolist()) + [total]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def decoder_random_batch(vocab: int):
    """Random decoder-only micro-batches: ``make(shape, generator) -> dict`` padded or packed."""
    def make(shape: MicroBatchShape, generator: torch.Generator | None = None) -> dict:
        gen = generator or torch.Generator().manual_seed(0)
        if shape.packed:
            lengths = _random_packed_lengths(gen, shape.rows, shape.tokens)
            ids = torch.randint(0, vocab, (1, shape.tokens), generator=gen)
            cu = torch.tensor(np.concatenate(([0], np.cumsum(lengths))), dtype=torch.int32)
            pos = torch.cat([torch.arange(n) for n in lengths])[None]
            labels = ids.clone().masked_fill(pos == 0, IGNORE_INDEX)  # HF's flattening collator
            return {"input_ids": ids, "position_ids": pos, "cu_seqlens": cu, "max_seqlen": max(lengths),
                    "labels": labels}
        lengths = _random_lengths(gen, shape.rows, shape.input_len)
        ids = torch.randint(0, vocab, (shape.rows, shape.input_len), generator=gen)
        mask = (torch.arange(shape.input_len)[None] < torch.tensor(lengths)[:, None]).long()
        return {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}
    return make


def seq2seq_boundary(hidden: int, dtype: torch.dtype):
    """The encoder-decoder state's specs (t5-tiny; the Hugging Face T5/BART adapters' padded state): both
    hidden states and both [rows, len] masks; t5-tiny's packed state is one row of each side
    (``tokens`` and ``target_tokens`` long) with their segments."""
    def boundary(shape: MicroBatchShape, layer: int) -> tuple[TensorSpec, ...]:
        if shape.target_len < 1 or (shape.packed and shape.target_tokens < 1):
            raise ValueError("an encoder-decoder micro-batch needs decoder tokens (target_len >= 1; packed: the "
                             "plan's decoder total, target_tokens >= 1)")
        r, L, T = (1, shape.tokens, shape.target_tokens) if shape.packed else \
            (shape.rows, shape.input_len, shape.target_len)
        return (TensorSpec((r, L, hidden), dtype, True), TensorSpec((r, T, hidden), dtype, True),
                TensorSpec((r, L), torch.int64), TensorSpec((r, T), torch.int64))
    return boundary


def seq2seq_random_batch(vocab: int):
    """Random encoder-decoder micro-batches: ``make(shape, generator) -> dict`` padded or packed."""
    def make(shape: MicroBatchShape, generator: torch.Generator | None = None) -> dict:
        gen = generator or torch.Generator().manual_seed(0)
        if shape.packed:  # the DataLoader's packed seq2seq layout of random samples
            from ...loader.collate import FlatIds, collate_packed

            lin = _random_packed_lengths(gen, shape.rows, shape.tokens)
            lt = _random_packed_lengths(gen, shape.rows, shape.target_tokens)
            ids = torch.randint(1, vocab, (shape.tokens,), generator=gen).numpy()
            tgt = torch.randint(1, vocab, (shape.target_tokens,), generator=gen).numpy()
            return collate_packed(FlatIds(ids, np.array(lin), tgt, np.array(lt)), family="encoder_decoder")
        r, L, T = shape.rows, shape.input_len, shape.target_len
        lin = _random_lengths(gen, r, L)
        lt = _random_lengths(gen, r, T)
        mask = (torch.arange(L)[None] < torch.tensor(lin)[:, None]).long()
        dmask = (torch.arange(T)[None] < torch.tensor(lt)[:, None]).long()
        ids = torch.randint(1, vocab, (r, L), generator=gen) * mask
        labels = torch.randint(1, vocab, (r, T), generator=gen)
        dec = torch.cat([torch.zeros(r, 1, dtype=torch.long), labels[:, :-1]], dim=1) * dmask
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec,
                "labels": labels.masked_fill(dmask == 0, IGNORE_INDEX)}
    return make


__all__ = ["IGNORE_INDEX", "check_bounds", "decoder_boundary", "decoder_random_batch", "seq2seq_boundary",
           "seq2seq_random_batch"]
