"""Tiny trainable models in plain torch, each an ordered list of layers the runner can split (their shared
blocks and masks: `dynabatch.pipeline.models.blocks`; the state layouts and random batches:
`dynabatch.pipeline.models.contract`; by name: `dynabatch.pipeline.models.zoo`).

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

import torch
import torch.nn.functional as F
from torch import nn

from ...core.cost.model import ModelConfig
from .blocks import (MLP, Attention, GPTBlock, GPTHead, SelfAttentionBlock, cross_mask, packed_sequence_ids,
                     padded_self_mask, segment_ids)
from .contract import IGNORE_INDEX, decoder_boundary, decoder_random_batch, seq2seq_boundary, seq2seq_random_batch
from .layered import LayeredModel
from .spec import packed_pair_seqlens



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
                seg = packed_sequence_ids(cu, ids.shape[1])
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
    return LayeredModel("gpt-tiny", "decoder", mods, decoder_boundary(hidden, dtype), cfg, decoder_random_batch(vocab))


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
    return (packed_sequence_ids(cu, batch["input_ids"].shape[1])[None] + 1,
            packed_sequence_ids(dcu, batch["decoder_input_ids"].shape[1])[None] + 1)


class T5EncoderBlock(SelfAttentionBlock):
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
    return LayeredModel("t5-tiny", "encoder_decoder", mods, seq2seq_boundary(hidden, dtype), cfg, seq2seq_random_batch(vocab))


def count_parameters(model: LayeredModel) -> int:
    """Number of parameters (elements) of all layers."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["count_parameters", "gpt_tiny", "t5_tiny"]
