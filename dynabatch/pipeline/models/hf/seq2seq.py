"""T5-family encoder-decoders (T5, mT5, UL2, Flan-T5: ``shared``, ``encoder.block``, ``decoder.block``,
``final_layer_norm`` per stack, ``lm_head``) as layered models.

Layers: ``[embedding, encoder block x n, encoder end, decoder block x m, head]``; each block wraps one
Hugging Face ``T5Block`` unchanged. The state after every layer is ``(encoder hidden [R, L, H],
decoder hidden [R, T, H], attention_mask [R, L] int64, decoder_attention_mask [R, T] int64)``: the
embedding layer embeds both sides (the decoder ids are needed only there), the encoder end applies
the encoder's final norm, so every decoder block attends to the finished encoder output.

T5 computes its relative position bias ``[1, heads, L, L]`` once, in block 0, and hands it to the
other blocks. Here every block computes it from the bias table (a `tied_parameters` entry: each
stage holds a copy of it), so only the hidden states and the two [R, L]/[R, T] masks cross a
stage boundary: nothing quadratic in the length.
"""

from __future__ import annotations

import torch
from torch import nn

from ..tiny import _t5_boundary as seq2seq_boundary, t5_random_batch
from .common import HFLayer, HFLayeredModel, UnsupportedModel, model_dtype, name_parameters, need, summed_cross_entropy
from .decoder import cost_config

WHAT = "T5-style encoder-decoder (shared, encoder.block, decoder.block, final_layer_norm, lm_head)"


def _masks():
    from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

    return create_bidirectional_mask, create_causal_mask


def decoder_masks(config, dec: torch.Tensor, dmask: torch.Tensor, enc: torch.Tensor, mask: torch.Tensor):
    """(causal self-attention mask, cross-attention mask) of a decoder layer, from the model's own mask
    functions, as the Hugging Face decoder stack builds them."""
    bidirectional, causal = _masks()
    return (causal(config=config, inputs_embeds=dec, attention_mask=dmask, cache=None),
            bidirectional(config=config, inputs_embeds=dec, attention_mask=mask, encoder_hidden_states=enc))


def relative_bias(table: nn.Embedding, attention: nn.Module, q_len: int, k_len: int) -> torch.Tensor:
    """T5's binned relative position bias ``[1, heads, q_len, k_len]`` from ``table`` (block 0's
    ``relative_attention_bias``), with ``attention``'s bucketing (bidirectional in the encoder)."""
    ctx = torch.arange(q_len, dtype=torch.long, device=table.weight.device)[:, None]
    mem = torch.arange(k_len, dtype=torch.long, device=table.weight.device)[None, :]
    buckets = attention._relative_position_bucket(mem - ctx, bidirectional=not attention.is_decoder,
                                                  num_buckets=attention.relative_attention_num_buckets,
                                                  max_distance=attention.relative_attention_max_distance)
    return table(buckets).permute([2, 0, 1]).unsqueeze(0)


class T5Embedding(HFLayer):
    """Layer 0: ``shared`` embedding of ``input_ids`` and ``decoder_input_ids``, each stack's dropout."""

    def __init__(self, model: nn.Module, name: str):
        super().__init__({"embed": model.shared, "enc_drop": model.encoder.dropout, "dec_drop": model.decoder.dropout})
        self.model_name = name

    def forward(self, batch: dict) -> tuple:
        if "cu_seqlens" in batch or "position_ids" in batch:
            raise ValueError(f"{self.model_name}: T5 attends across the samples of a packed row (no varlen path in "
                             "transformers); use collate='padded'")
        if "decoder_input_ids" not in batch:
            raise ValueError(f"{self.model_name}: the micro-batch has no decoder_input_ids (collate with "
                             "family='encoder_decoder')")
        ids, dec = batch["input_ids"], batch["decoder_input_ids"]
        mask = batch.get("attention_mask")
        dmask = batch.get("decoder_attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask.long()
        dmask = torch.ones_like(dec) if dmask is None else dmask.long()
        return self.enc_drop(self.embed(ids)), self.dec_drop(self.embed(dec)), mask, dmask


class T5EncoderBlock(HFLayer):
    """One encoder ``T5Block`` with the bidirectional mask and the relative bias computed here."""

    def __init__(self, block: nn.Module, first: nn.Module, config):
        super().__init__({"block": block, "bias": first.relative_attention_bias})
        self.attention = [first]  # block 0's attention for its bucketing (a list: not a sub-module)
        self.config = config

    def forward(self, state: tuple) -> tuple:
        enc, dec, mask, dmask = state
        bidirectional, _ = _masks()
        attn = bidirectional(config=self.config, inputs_embeds=enc, attention_mask=mask)
        bias = relative_bias(self.bias, self.attention[0], enc.shape[1], enc.shape[1])
        return self.block(enc, attn, bias)[0], dec, mask, dmask


class T5EncoderEnd(HFLayer):
    """The encoder's final norm and dropout on the encoder hidden states."""

    def __init__(self, stack: nn.Module):
        super().__init__({"norm": stack.final_layer_norm, "drop": stack.dropout})

    def forward(self, state: tuple) -> tuple:
        enc, dec, mask, dmask = state
        return self.drop(self.norm(enc)), dec, mask, dmask


class T5DecoderBlock(HFLayer):
    """One decoder ``T5Block``: causal self-attention with the relative bias computed here,
    cross-attention to the encoder output (no bias, as in T5)."""

    def __init__(self, block: nn.Module, first: nn.Module, config):
        super().__init__({"block": block, "bias": first.relative_attention_bias})
        self.attention = [first]
        self.config = config

    def forward(self, state: tuple) -> tuple:
        enc, dec, mask, dmask = state
        self_mask, cross = decoder_masks(self.config, dec, dmask, enc, mask)
        bias = relative_bias(self.bias, self.attention[0], dec.shape[1], dec.shape[1])
        return enc, self.block(dec, self_mask, bias, enc, cross, None)[0], mask, dmask


class T5Head(HFLayer):
    """Decoder final norm and dropout, the tied-embedding output scaling, ``lm_head``, summed loss (no shift:
    ``decoder_input_ids`` are the labels shifted right)."""

    def __init__(self, model: nn.Module):
        super().__init__({"norm": model.decoder.final_layer_norm, "drop": model.decoder.dropout, "lm_head": model.lm_head})
        self.scale = model.model_dim ** -0.5 if getattr(model.config, "scale_decoder_outputs", False) else None

    def forward(self, state: tuple, batch: dict):
        h = self.drop(self.norm(state[1]))
        if self.scale is not None:
            h = h * self.scale
        return summed_cross_entropy(self.lm_head(h), batch["labels"], shift=False)


def seq2seq_model(hf_model: nn.Module) -> HFLayeredModel:
    """A T5-family ``...ForConditionalGeneration`` as an `HFLayeredModel` sharing its parameters."""
    name = type(hf_model).__name__
    for part in ("shared", "encoder.block", "decoder.block", "encoder.final_layer_norm", "decoder.final_layer_norm",
                 "lm_head"):
        need(hf_model, part, WHAT, name)
    enc, dec = hf_model.encoder, hf_model.decoder
    enc_first, dec_first = enc.block[0].layer[0].SelfAttention, dec.block[0].layer[0].SelfAttention
    if not getattr(enc_first, "has_relative_attention_bias", False):
        raise UnsupportedModel(f"{name} is not a {WHAT}: encoder block 0 has no relative attention bias")
    layers: list[HFLayer] = [T5Embedding(hf_model, name)]
    layers += [T5EncoderBlock(block, enc_first, enc.config) for block in enc.block]
    layers.append(T5EncoderEnd(enc))
    layers += [T5DecoderBlock(block, dec_first, dec.config) for block in dec.block]
    layers.append(T5Head(hf_model))
    names = name_parameters(hf_model, layers)
    config, dtype = hf_model.config, model_dtype(hf_model)
    cost = cost_config(name, "encoder_decoder", config, dtype, layers=len(enc.block), decoder_layers=len(dec.block))
    return HFLayeredModel(name, "encoder_decoder", layers, seq2seq_boundary(int(config.d_model), dtype), cost,
                          t5_random_batch(int(config.vocab_size)), hf_config=config, family="encoder_decoder",
                          **names)
