"""BART-style encoder-decoders (BART, mBART, PLBart: ``model.encoder``/``model.decoder`` with
``embed_tokens``, learned ``embed_positions``, ``layernorm_embedding``, ``layers``; ``lm_head``,
``final_logits_bias``) as layered models.

Layers: ``[embedding, encoder layer x n, (encoder end,) decoder layer x m, head]``: the embedding
layer embeds both sides (token + learned positions, embedding norm, dropout); an encoder end exists
where the encoder has a final ``layer_norm`` (mBART). The state after every layer is the T5 adapter's
``(encoder hidden [R, L, H], decoder hidden [R, T, H], attention_mask [R, L], decoder_attention_mask
[R, T])``; every layer builds its masks with the model's own mask functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..contract import seq2seq_random_batch
from .common import HFLayer, HFLayeredModel, UnsupportedModel, model_dtype, name_parameters, need, summed_cross_entropy
from .decoder import cost_config
from .seq2seq import decoder_masks, packed_state, seq2seq_boundary, state_masks

WHAT = "BART-style encoder-decoder (model.encoder/decoder with embed_tokens, embed_positions, layernorm_embedding, " \
       "layers; lm_head)"


class BartEmbedding(HFLayer):
    """Layer 0: each stack's input from ``input_ids`` / ``decoder_input_ids``: scaled token embedding +
    learned positions ``0..L-1``, embedding norm, dropout (the stack's rate)."""

    def __init__(self, model: nn.Module, name: str):
        enc, dec = model.encoder, model.decoder
        super().__init__({"enc_tokens": enc.embed_tokens, "enc_pos": enc.embed_positions,
                          "enc_norm": enc.layernorm_embedding, "dec_tokens": dec.embed_tokens,
                          "dec_pos": dec.embed_positions, "dec_norm": dec.layernorm_embedding})
        self.rates, self.model_name = (float(enc.dropout), float(dec.dropout)), name
        self.attn = model.config._attn_implementation
        self.train(model.training)

    def _side(self, ids, tokens, positions, norm, rate, pos=None) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device) if pos is None else pos[0]  # packed: per sample
        h = norm(tokens(ids) + positions(ids, 0, position_ids=pos))
        return F.dropout(h, p=rate, training=self.training)

    def forward(self, batch: dict) -> tuple:
        if "cu_seqlens" in batch:
            cu, dcu = packed_state(self.model_name, batch, self.attn)
            ids, dec = batch["input_ids"], batch["decoder_input_ids"]
            return (self._side(ids, self.enc_tokens, self.enc_pos, self.enc_norm, self.rates[0], batch["position_ids"]),
                    self._side(dec, self.dec_tokens, self.dec_pos, self.dec_norm, self.rates[1],
                               batch["decoder_position_ids"]), cu, dcu)
        if "position_ids" in batch or "decoder_input_ids" not in batch:
            raise ValueError(f"{self.model_name} takes padded or packed encoder-decoder micro-batches "
                             "(collate='padded' or 'packed', family='encoder_decoder'): rows holding several samples "
                             "would attend across them")
        ids, dec = batch["input_ids"], batch["decoder_input_ids"]
        mask, dmask = batch.get("attention_mask"), batch.get("decoder_attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask.long()
        dmask = torch.ones_like(dec) if dmask is None else dmask.long()
        return (self._side(ids, self.enc_tokens, self.enc_pos, self.enc_norm, self.rates[0]),
                self._side(dec, self.dec_tokens, self.dec_pos, self.dec_norm, self.rates[1]), mask, dmask)


class BartEncoderLayer(HFLayer):
    """One encoder layer with the bidirectional mask built here."""

    def __init__(self, block: nn.Module, config):
        super().__init__({"block": block})
        self.config = config

    def forward(self, state: tuple) -> tuple:
        out = self.block(state[0], state_masks(self.config, state[0], state))
        return ((out[0] if isinstance(out, tuple) else out), *state[1:])


class BartEncoderEnd(HFLayer):
    """The encoder's final ``layer_norm`` (mBART)."""

    def __init__(self, norm: nn.Module):
        super().__init__({"norm": norm})

    def forward(self, state: tuple) -> tuple:
        return (self.norm(state[0]), *state[1:])


class BartDecoderLayer(HFLayer):
    """One decoder layer: causal self-attention and cross-attention masks built here."""

    def __init__(self, block: nn.Module, config):
        super().__init__({"block": block})
        self.config = config

    def forward(self, state: tuple) -> tuple:
        enc, dec = state[0], state[1]
        self_mask, cross = decoder_masks(self.config, state)
        out = self.block(dec, self_mask, enc, encoder_attention_mask=cross, cache=None, use_cache=False)
        return (enc, (out[0] if isinstance(out, tuple) else out), *state[2:])


class BartHead(HFLayer):
    """Decoder final ``layer_norm`` where it exists, ``lm_head`` + ``final_logits_bias``, summed loss (no shift)."""

    def __init__(self, model: nn.Module):
        norm = getattr(model.model.decoder, "layer_norm", None)
        super().__init__({"norm": norm if norm is not None else nn.Identity(), "lm_head": model.lm_head})
        bias = getattr(model, "final_logits_bias", None)
        self.register_buffer("final_logits_bias", bias if bias is not None else torch.zeros(1, 1))

    def forward(self, state: tuple, batch: dict):
        logits = self.lm_head(self.norm(state[1])) + self.final_logits_bias
        return summed_cross_entropy(logits, batch["labels"], shift=False)


def bart_model(hf_model: nn.Module) -> HFLayeredModel:
    """A BART-style ``...ForConditionalGeneration`` as an `HFLayeredModel` sharing its parameters."""
    name = type(hf_model).__name__
    for part in ("model.encoder.embed_positions", "model.encoder.layernorm_embedding", "model.encoder.layers",
                 "model.decoder.embed_positions", "model.decoder.layers", "lm_head"):
        need(hf_model, part, WHAT, name)
    config = hf_model.config
    if (getattr(config, "encoder_layerdrop", 0) or getattr(config, "decoder_layerdrop", 0)) and hf_model.training:
        raise UnsupportedModel(f"{name}: layerdrop skips random layers per call, which a planned pipeline cannot "
                               "follow; set encoder_layerdrop = decoder_layerdrop = 0")
    enc, dec = hf_model.model.encoder, hf_model.model.decoder
    layers: list[HFLayer] = [BartEmbedding(hf_model.model, name)]
    layers += [BartEncoderLayer(b, enc.config) for b in enc.layers]
    if getattr(enc, "layer_norm", None) is not None:
        layers.append(BartEncoderEnd(enc.layer_norm))
    layers += [BartDecoderLayer(b, dec.config) for b in dec.layers]
    layers.append(BartHead(hf_model))
    names = name_parameters(hf_model, layers)
    dtype = model_dtype(hf_model)
    cost = cost_config(name, "encoder_decoder", config, dtype, layers=len(enc.layers), decoder_layers=len(dec.layers))
    return HFLayeredModel(name, "encoder_decoder", layers, seq2seq_boundary(int(config.d_model), dtype), cost,
                          seq2seq_random_batch(int(config.vocab_size)), hf_config=config, family="encoder_decoder",
                          **names)
