"""Tiny trainable models in plain torch, each an ordered list of layers the runner can split.

``gpt-tiny`` is a GPT-style decoder, ``t5-tiny`` a T5-style encoder-decoder (learned absolute
positions instead of T5's relative bias, to stay small). Both accept the micro-batch dictionaries
Hugging Face collators produce (padded: ``input_ids``/``attention_mask``/``labels``, plus
``decoder_input_ids`` for the encoder-decoder; packed/varlen: ``input_ids`` ``[1, total]``,
``position_ids``, ``cu_seqlens``, ``max_seqlen``, ``labels``, and for the encoder-decoder the
targets' row with ``decoder_input_ids``, ``decoder_position_ids``, ``decoder_cu_seqlens``).

Layer contract (what `dynabatch.pipeline` needs from any model):

* ``layers[0](batch) -> state``: the embedding reads the micro-batch dictionary;
* ``layers[i](state) -> state`` for the middle layers;
* ``layers[-1](state, batch) -> (loss_sum, num_tokens)``: the head returns the **sum** of token
  losses and the number of target tokens it counted (the runner normalizes over the whole step).

``state`` is a tuple of tensors whose shapes the model's ``boundary(shape, layer)`` function
predicts from the plan alone. Padded GPT: ``(hidden [rows, L, H], segments [rows, L])``;
packed GPT: ``(hidden [1, N, H], position_ids [1, N], cu_seqlens [n + 1] int32)``; T5:
``(encoder hidden [rows, L, H], decoder hidden [rows, T, H], encoder segments [rows, L], decoder
segments [rows, T])``, packed: one row of ``tokens`` (N) encoder and one of ``target_tokens`` (Nt)
decoder tokens, ``(hidden [1, N, H], hidden [1, Nt, H], segments [1, N], segments [1, Nt])``. The
state layout is the same after every layer, so any cut is valid.

``segments`` (`segment_ids`) number the samples of a row from 1 and are 0 on padding: with one
sample per row they equal the attention mask; in packed rows (the ``pack`` baseline, where
``position_ids`` restart at every sample) a token attends only to tokens of its own sample, and a
T5 decoder token only to its own sample's encoder tokens, so packed rows train the same function
as one sample per row (as T5X's segment ids do). Attention masks are plain boolean masks, dense
over the row (which is what packing to fixed rows costs without a variable-length kernel).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...core.cost.model import ModelConfig
from .layered import LayeredModel
from .spec import MicroBatchShape, TensorSpec, packed_pair_seqlens

MODELS = ("gpt-tiny", "t5-tiny", "vlm-tiny")  # vlm-tiny: dynabatch.pipeline.models.vlm
IGNORE_INDEX = -100


# ---------------------------------------------------------------------------------------------
# attention helpers


def _eye(n: int, device) -> torch.Tensor:
    return torch.eye(n, dtype=torch.bool, device=device)


def _segments(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Sequence id of every packed token from ``cu_seqlens`` [n + 1]."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths, output_size=total)


def segment_ids(mask: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Sample number of every token of a [rows, L] batch (1, 2, ... within each row; 0 on padding).

    Without ``position_ids`` every row holds one sample (the attention mask as int64); with them a
    new sample starts wherever a real token has position 0 (packed rows)."""
    real = mask.bool()
    if position_ids is None:
        return real.long()
    return torch.cumsum(real & (position_ids == 0), dim=-1) * real


def _same_sample(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[rows, 1, Lq, Lk]: query and key belong to the same sample and the key is not padding."""
    return (q[:, None, :, None] == k[:, None, None, :]) & (k[:, None, None, :] > 0)


def padded_self_mask(segments: torch.Tensor, causal: bool) -> torch.Tensor:
    """Boolean [rows, 1, L, L] mask (True = may attend) from [rows, L] `segment_ids` (a 0/1 padding
    mask is the one-sample-per-row case): a token sees the real tokens of its own sample. The
    diagonal is always allowed so a fully padded query row never softmaxes over nothing (NaN)."""
    L = segments.shape[1]
    seg = segments.long()
    allowed = _same_sample(seg, seg)
    if causal:
        allowed = allowed & torch.ones(L, L, dtype=torch.bool, device=seg.device).tril()
    return allowed | _eye(L, seg.device)


def cross_mask(query_segments: torch.Tensor, key_segments: torch.Tensor) -> torch.Tensor:
    """Boolean [rows, 1, T, L] cross-attention mask: a decoder token sees its own sample's encoder
    tokens. A query with no such key (padding) sees every key, so softmax never gets an empty row."""
    allowed = _same_sample(query_segments.long(), key_segments.long())
    return allowed | ~allowed.any(-1, keepdim=True)


def packed_self_mask(cu_seqlens: torch.Tensor, total: int, causal: bool) -> torch.Tensor:
    """Block-diagonal boolean [1, 1, N, N] mask of packed sequences (causal inside each block)."""
    seg = _segments(cu_seqlens, total)
    allowed = seg[:, None] == seg[None, :]
    if causal:
        allowed = allowed & torch.ones(total, total, dtype=torch.bool, device=seg.device).tril()
    return allowed[None, None]


class Attention(nn.Module):
    """Multi-head attention (self or cross) with a boolean mask."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden {hidden} is not divisible by heads {heads}")
        self.heads = heads
        self.q = nn.Linear(hidden, hidden)
        self.kv = nn.Linear(hidden, 2 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, mem: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        r, n, h = x.shape
        m = mem.shape[1]
        q = self.q(x).view(r, n, self.heads, -1).transpose(1, 2)
        k, v = self.kv(mem).view(r, m, 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.out(y.transpose(1, 2).reshape(r, n, h))


class MLP(nn.Module):
    """Two-layer GELU feed-forward block."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


# ---------------------------------------------------------------------------------------------
# GPT-style decoder


class GPTEmbedding(nn.Module):
    """Token + learned position embedding; turns the micro-batch dict into the GPT state."""

    def __init__(self, vocab: int, hidden: int, max_positions: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_positions, hidden)

    def forward(self, batch: dict) -> tuple:
        ids = batch["input_ids"]
        if "cu_seqlens" in batch:
            cu = batch["cu_seqlens"].to(torch.int32)
            pos = batch.get("position_ids")
            if pos is None:  # restart positions at every packed sequence
                seg = _segments(cu, ids.shape[1])
                pos = (torch.arange(ids.shape[1], device=ids.device) - cu.long()[seg])[None]
            pos = pos.long()
            return self.tok(ids) + self.pos(pos), pos, cu
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask.long()
        pos = batch.get("position_ids")
        seg = segment_ids(mask, pos)
        if pos is None:  # works for left and right padding
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
        return self.tok(ids) + self.pos(pos.long()), seg


class _SelfAttentionBlock(nn.Module):
    """Pre-LayerNorm self-attention + feed-forward block (shared by the GPT and T5 encoder blocks)."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ffn)

    def _block(self, h: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        x = self.ln1(h)
        h = h + self.attn(x, x, allowed)
        return h + self.mlp(self.ln2(h))


class GPTBlock(_SelfAttentionBlock):
    """Pre-LayerNorm causal transformer block; passes masks through untouched."""

    def forward(self, state: tuple) -> tuple:
        h = state[0]
        if len(state) == 3:  # packed: (h, position_ids, cu_seqlens)
            allowed = packed_self_mask(state[2], h.shape[1], causal=True)
        else:
            allowed = padded_self_mask(state[1], causal=True)
        return (self._block(h, allowed), *state[1:])


class GPTHead(nn.Module):
    """Final LayerNorm, LM head and summed next-token cross-entropy.

    Labels follow Hugging Face's causal-LM convention: ``labels`` are aligned with ``input_ids`` and
    the model shifts them (position t predicts labels[t + 1]); -100 is ignored. For packed inputs a
    prediction across a sequence boundary (next position id 0) is ignored as well.
    """

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.lm = nn.Linear(hidden, vocab)

    def forward(self, state: tuple, batch: dict):
        logits = self.lm(self.ln(state[0]))[:, :-1]
        target = batch["labels"][:, 1:].long()
        if len(state) == 3:
            target = target.masked_fill(state[1][:, 1:] == 0, IGNORE_INDEX)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
        return loss, (target != IGNORE_INDEX).sum()


def _gpt_boundary(hidden: int, dtype: torch.dtype):
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


def gpt_random_batch(vocab: int):
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


def gpt_tiny(*, vocab: int = 512, hidden: int = 256, layers: int = 4, heads: int = 4, ffn: int | None = None,
             max_positions: int = 2048, dtype: torch.dtype = torch.float32, seed: int = 0) -> LayeredModel:
    """A GPT-style decoder as ``[embedding, block x layers, head]`` (about 3.4M parameters by default).

    ``seed`` fixes the initialization so every rank can build the same model and keep its stage.
    """
    ffn = ffn or 4 * hidden
    torch.manual_seed(seed)
    mods: list[nn.Module] = [GPTEmbedding(vocab, hidden, max_positions)]
    mods += [GPTBlock(hidden, heads, ffn) for _ in range(layers)]
    mods.append(GPTHead(hidden, vocab))
    for m in mods:
        m.to(dtype)
    cfg = ModelConfig("gpt-tiny", "decoder", hidden=hidden, attn_dim=hidden, kv_dim=hidden, ffn=ffn,
                      layers=layers, flash_attention=False, dtype_bytes=torch.empty((), dtype=dtype).element_size())
    return LayeredModel("gpt-tiny", "decoder", mods, _gpt_boundary(hidden, dtype), cfg, gpt_random_batch(vocab))


# ---------------------------------------------------------------------------------------------
# T5-style encoder-decoder


class T5Embedding(nn.Module):
    """Shared token embedding plus separate learned positions for encoder and decoder."""

    def __init__(self, vocab: int, hidden: int, max_positions: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.enc_pos = nn.Embedding(max_positions, hidden)
        self.dec_pos = nn.Embedding(max_positions, hidden)

    def forward(self, batch: dict) -> tuple:
        ids, dec = batch["input_ids"], batch["decoder_input_ids"]
        pos, dpos = batch.get("position_ids"), batch.get("decoder_position_ids")
        if "cu_seqlens" in batch:
            seg, dseg = _packed_segments(batch)
        else:
            mask = batch.get("attention_mask")
            mask = torch.ones_like(ids) if mask is None else mask.long()
            dmask = batch.get("decoder_attention_mask")
            dmask = torch.ones_like(dec) if dmask is None else dmask.long()
            if (pos is None) != (dpos is None):
                raise ValueError("t5-tiny: packed rows need both position_ids and decoder_position_ids "
                                 "(the collator's packed_rows layout)")
            seg, dseg = segment_ids(mask, pos), segment_ids(dmask, dpos)
        if pos is None:
            pos = torch.arange(ids.shape[1], device=ids.device)
            dpos = torch.arange(dec.shape[1], device=dec.device)
        enc = self.tok(ids) + self.enc_pos(pos.long())
        dech = self.tok(dec) + self.dec_pos(dpos.long())
        return enc, dech, seg, dseg


def _packed_segments(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, N] and [1, Nt] sample numbers (from 1) of a packed encoder-decoder micro-batch (``collate='packed'``,
    ``family='encoder_decoder'``): the segments of one packed row, so the padded masks keep the samples apart."""
    cu, dcu = packed_pair_seqlens("t5-tiny", batch)
    if "position_ids" not in batch or "decoder_position_ids" not in batch:
        raise ValueError("t5-tiny: a packed micro-batch needs both position_ids (collate='packed' with "
                         "family='encoder_decoder')")
    return (_segments(cu, batch["input_ids"].shape[1])[None] + 1,
            _segments(dcu, batch["decoder_input_ids"].shape[1])[None] + 1)


class T5EncoderBlock(_SelfAttentionBlock):
    """Bidirectional self-attention block on the encoder hidden states; the decoder states pass through."""

    def forward(self, state: tuple) -> tuple:
        enc, dec, mask, dmask = state
        return self._block(enc, padded_self_mask(mask, causal=False)), dec, mask, dmask


class T5DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention to the (normalized) encoder states, feed-forward."""

    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.self_attn = Attention(hidden, heads)
        self.ln_mem = nn.LayerNorm(hidden)  # stands in for T5's final encoder norm, per block
        self.ln2 = nn.LayerNorm(hidden)
        self.cross = Attention(hidden, heads)
        self.ln3 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ffn)

    def forward(self, state: tuple) -> tuple:
        enc, dec, mask, dmask = state
        x = self.ln1(dec)
        dec = dec + self.self_attn(x, x, padded_self_mask(dmask, causal=True))
        dec = dec + self.cross(self.ln2(dec), self.ln_mem(enc), cross_mask(dmask, mask))
        dec = dec + self.mlp(self.ln3(dec))
        return enc, dec, mask, dmask


class T5Head(nn.Module):
    """Final LayerNorm, LM head and summed cross-entropy over ``labels`` [rows, T] (no shift: the
    collator's ``decoder_input_ids`` are the labels shifted right; -100 is ignored)."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.lm = nn.Linear(hidden, vocab)

    def forward(self, state: tuple, batch: dict):
        logits = self.lm(self.ln(state[1]))
        target = batch["labels"].long()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
        return loss, (target != IGNORE_INDEX).sum()


def _t5_boundary(hidden: int, dtype: torch.dtype):
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


def t5_random_batch(vocab: int):
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


def t5_tiny(*, vocab: int = 512, hidden: int = 256, encoder_layers: int = 2, decoder_layers: int = 2,
            heads: int = 4, ffn: int | None = None, max_positions: int = 2048, dtype: torch.dtype = torch.float32,
            seed: int = 0) -> LayeredModel:
    """A T5-style encoder-decoder as ``[embedding, encoder x n, decoder x m, head]`` (about 3.5M
    parameters by default); encoder hidden states travel with the decoder states across stages."""
    ffn = ffn or 4 * hidden
    torch.manual_seed(seed)
    mods: list[nn.Module] = [T5Embedding(vocab, hidden, max_positions)]
    mods += [T5EncoderBlock(hidden, heads, ffn) for _ in range(encoder_layers)]
    mods += [T5DecoderBlock(hidden, heads, ffn) for _ in range(decoder_layers)]
    mods.append(T5Head(hidden, vocab))
    for m in mods:
        m.to(dtype)
    cfg = ModelConfig("t5-tiny", "encoder_decoder", hidden=hidden, attn_dim=hidden, kv_dim=hidden, ffn=ffn,
                      layers=encoder_layers, decoder_layers=decoder_layers, flash_attention=False,
                      dtype_bytes=torch.empty((), dtype=dtype).element_size())
    return LayeredModel("t5-tiny", "encoder_decoder", mods, _t5_boundary(hidden, dtype), cfg, t5_random_batch(vocab))


def make_model(name: str, **overrides) -> LayeredModel:
    """A tiny model by name (``gpt-tiny``, ``t5-tiny`` or ``vlm-tiny``); keyword arguments override its sizes."""
    if name == "gpt-tiny":
        return gpt_tiny(**overrides)
    if name == "t5-tiny":
        return t5_tiny(**overrides)
    if name == "vlm-tiny":
        from .vlm import vlm_tiny  # vlm imports this module

        return vlm_tiny(**overrides)
    raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")


def count_parameters(model: LayeredModel) -> int:
    """Number of parameters (elements) of all layers."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["MODELS", "LayeredModel", "gpt_tiny", "t5_tiny", "make_model", "count_parameters",
           "padded_self_mask", "packed_self_mask", "cross_mask", "segment_ids"]
