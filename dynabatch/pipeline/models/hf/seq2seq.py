"""T5-family encoder-decoders (T5, mT5, UL2, Flan-T5: ``shared``, ``encoder.block``, ``decoder.block``,
``final_layer_norm`` per stack, ``lm_head``) as layered models.

Layers: ``[embedding, encoder block x n, encoder end, decoder block x m, head]``; each block wraps one
Hugging Face ``T5Block`` unchanged. The state after every layer is ``(encoder hidden [R, L, H],
decoder hidden [R, T, H], attention_mask [R, L] int64, decoder_attention_mask [R, T] int64)``: the
embedding layer embeds both sides (the decoder ids are needed only there), the encoder end applies
the encoder's final norm, so every decoder block attends to the finished encoder output.

T5 computes each stack's relative position bias ``[1, heads, L, L]`` once, in block 0, and hands it to
the other blocks. Here a stack's first block *on each stage* computes it from the bias table (a
`tied_parameters` entry: each stage holds a copy of it) and appends it to the state, the stage's later
blocks of that stack reuse it (the encoder end drops the encoder's), and the stage's last layer drops
it from what the stage sends (`stage_output`, called by `PipelineStage`): only the hidden states and
the two [R, L]/[R, T] masks cross a stage boundary, nothing quadratic in the length. A stack held by
one stage thus computes its bias once and sums its blocks' bias gradients in bias space before one
table backward, as Hugging Face does (bit for bit); a stack cut between stages sums the stages' table
gradients instead (the same sum in another order).

Packed micro-batches (``collate='packed'``, on any number of stages): the state is ``(encoder hidden [1, N, H],
decoder hidden [1, Nt, H], cu_seqlens [n + 1], decoder_cu_seqlens [n + 1])`` and every layer adds a
same-sample predicate to the model's own mask functions (`same_sample`); the bias of the whole row
is the samples' own within each sample (relative positions do not depend on where a sample starts).
"""

from __future__ import annotations

import torch
from torch import nn

from ..spec import MicroBatchShape, TensorSpec, packed_pair_seqlens
from ..contract import seq2seq_boundary as padded_seq2seq_boundary, seq2seq_random_batch
from .common import HFLayer, HFLayeredModel, UnsupportedModel, model_dtype, name_parameters, need, summed_cross_entropy
from .decoder import cost_config

WHAT = "T5-style encoder-decoder (shared, encoder.block, decoder.block, final_layer_norm, lm_head)"


def _masks():
    from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

    return create_bidirectional_mask, create_causal_mask


def _segments(cu: torch.Tensor, total: int) -> torch.Tensor:
    """Each token's sample index [total] from a packed row's ``cu_seqlens`` [n + 1]."""
    return torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device), (cu[1:] - cu[:-1]).long(),
                                   output_size=total)


def same_sample(q_cu: torch.Tensor, kv_cu: torch.Tensor, q_len: int, kv_len: int):
    """The mask predicate "query and key belong to the same sample" of packed rows (sample ``k`` of the
    queries is sample ``k`` of the keys), in the ``(batch, head, q, kv)`` form the model's own mask
    functions combine with theirs (``and_mask_function``): they then build the mask their attention
    implementation takes (a BlockMask under flex; SDPA and eager take a dense [1, 1, q, kv] mask)."""
    q_seg, kv_seg = _segments(q_cu, q_len), _segments(kv_cu, kv_len)

    def inner(batch_idx, head_idx, q_idx, kv_idx):
        return q_seg[q_idx] == kv_seg[kv_idx]

    return inner


def state_masks(config, h: torch.Tensor, state: tuple):
    """The bidirectional self-attention mask of an encoder layer from a padded state ``(enc, dec, mask,
    dmask)`` or a packed one ``(enc, dec, cu, dcu)`` (samples kept apart), with the model's mask function."""
    bidirectional, _ = _masks()
    if not is_packed(state):
        return bidirectional(config=config, inputs_embeds=h, attention_mask=state[2])
    cu = state[2]
    return bidirectional(config=config, inputs_embeds=h, attention_mask=None,
                         and_mask_function=same_sample(cu, cu, h.shape[1], h.shape[1]))


def decoder_masks(config, state: tuple):
    """(causal self-attention mask, cross-attention mask) of a decoder layer, from the model's own mask
    functions as the Hugging Face decoder stack builds them; a packed state keeps every decoder token to
    its own sample's decoder tokens (causally) and encoder tokens."""
    bidirectional, causal = _masks()
    enc, dec = state[0], state[1]
    if not is_packed(state):
        mask, dmask = state[2], state[3]
        return (causal(config=config, inputs_embeds=dec, attention_mask=dmask, cache=None),
                bidirectional(config=config, inputs_embeds=dec, attention_mask=mask, encoder_hidden_states=enc))
    cu, dcu = state[2], state[3]
    T, L = dec.shape[1], enc.shape[1]
    return (causal(config=config, inputs_embeds=dec, attention_mask=None, cache=None,
                   and_mask_function=same_sample(dcu, dcu, T, T)),
            bidirectional(config=config, inputs_embeds=dec, attention_mask=None, encoder_hidden_states=enc,
                          and_mask_function=same_sample(dcu, cu, T, L)))


def is_packed(state: tuple) -> bool:
    """True for a packed encoder-decoder state ``(enc [1, N, H], dec [1, Nt, H], cu [n + 1] int32, dcu
    [n + 1] int32)``; a padded one carries [rows, len] int64 masks instead."""
    return state[2].dim() == 1


def packed_state(name: str, batch: dict, attn_implementation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(encoder ``cu_seqlens``, decoder ``decoder_cu_seqlens``) of a packed encoder-decoder micro-batch
    (``collate='packed'``), checked: as many samples on both sides, one row each."""
    cu, dcu = packed_pair_seqlens(name, batch)
    if "flash" in str(attn_implementation):
        raise ValueError(f"{name}: packed encoder-decoder micro-batches under {attn_implementation} are not supported "
                         "(its cross-attention needs separate query/key cu_seqlens); use sdpa, eager or flex_attention")
    return cu.to(torch.int32), dcu.to(torch.int32)


def seq2seq_boundary(hidden: int, dtype: torch.dtype):
    """The stage-boundary specs of the T5 and BART adapters: the padded state's (t5-tiny's), or the packed
    state ``(enc [1, tokens, H], dec [1, target_tokens, H], cu_seqlens [rows + 1] int32, decoder_cu_seqlens
    [rows + 1] int32)`` (the plan states both rows' token totals)."""
    padded = padded_seq2seq_boundary(hidden, dtype)

    def boundary(shape: MicroBatchShape, layer: int):
        if not shape.packed:
            return padded(shape, layer)
        if shape.target_tokens < 1:
            raise ValueError("a packed encoder-decoder micro-batch needs its decoder token total (target_tokens >= 1; "
                             "the plan's target_tokens, or batch_shapes of the collated micro-batches)")
        cu = TensorSpec((shape.rows + 1,), torch.int32)
        return (TensorSpec((1, shape.tokens, hidden), dtype, True),
                TensorSpec((1, shape.target_tokens, hidden), dtype, True), cu, cu)

    return boundary


def relative_bias(table: nn.Embedding, attention: nn.Module, q_len: int, k_len: int) -> torch.Tensor:
    """T5's binned relative position bias ``[1, heads, q_len, k_len]`` from ``table`` (block 0's
    ``relative_attention_bias``), with ``attention``'s bucketing (bidirectional in the encoder)."""
    ctx = torch.arange(q_len, dtype=torch.long, device=table.weight.device)[:, None]
    mem = torch.arange(k_len, dtype=torch.long, device=table.weight.device)[None, :]
    buckets = attention._relative_position_bucket(mem - ctx, bidirectional=not attention.is_decoder,
                                                  num_buckets=attention.relative_attention_num_buckets,
                                                  max_distance=attention.relative_attention_max_distance)
    return table(buckets).permute([2, 0, 1]).unsqueeze(0)


BOUNDARY = 4  # the state a stage sends: (enc, dec, mask, dmask) or (enc, dec, cu, dcu); a 5th entry is the bias


class T5Layer(HFLayer):
    """A T5 adapter layer: its state may carry the current stack's relative bias (module doc)."""

    @staticmethod
    def stage_output(state: tuple) -> tuple:
        """What a stage ending with this layer sends: the state without the bias, which stays on the stage."""
        return state[:BOUNDARY]


def stage_bias(layer: nn.Module, state: tuple, h: torch.Tensor) -> torch.Tensor:
    """The stack's relative bias for ``layer``'s block: the one an earlier block of this stage put in the
    state, or computed here from the stage's copy of the table (the stack's first block on this stage)."""
    if len(state) > BOUNDARY:
        return state[BOUNDARY]
    return relative_bias(layer.bias, layer.attention[0], h.shape[1], h.shape[1])


class T5Embedding(T5Layer):
    """Layer 0: ``shared`` embedding of ``input_ids`` and ``decoder_input_ids``, each stack's dropout."""

    def __init__(self, model: nn.Module, name: str):
        super().__init__({"embed": model.shared, "enc_drop": model.encoder.dropout, "dec_drop": model.decoder.dropout})
        self.model_name, self.attn = name, model.config._attn_implementation

    def forward(self, batch: dict) -> tuple:
        if "cu_seqlens" in batch:
            cu, dcu = packed_state(self.model_name, batch, self.attn)
            enc, dec = self.embed(batch["input_ids"]), self.embed(batch["decoder_input_ids"])
            return self.enc_drop(enc), self.dec_drop(dec), cu, dcu
        if "position_ids" in batch:
            raise ValueError(f"{self.model_name}: rows holding several samples (collate='packed_rows') would attend "
                             "across samples; use collate='packed' or 'padded'")
        if "decoder_input_ids" not in batch:
            raise ValueError(f"{self.model_name}: the micro-batch has no decoder_input_ids (collate with "
                             "family='encoder_decoder')")
        ids, dec = batch["input_ids"], batch["decoder_input_ids"]
        mask = batch.get("attention_mask")
        dmask = batch.get("decoder_attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask.long()
        dmask = torch.ones_like(dec) if dmask is None else dmask.long()
        return self.enc_drop(self.embed(ids)), self.dec_drop(self.embed(dec)), mask, dmask


class T5EncoderBlock(T5Layer):
    """One encoder ``T5Block`` with the bidirectional mask and the stage's encoder bias (`stage_bias`)."""

    def __init__(self, block: nn.Module, first: nn.Module, config):
        super().__init__({"block": block, "bias": first.relative_attention_bias})
        self.attention = [first]  # block 0's attention for its bucketing (a list: not a sub-module)
        self.config = config

    def forward(self, state: tuple) -> tuple:
        enc = state[0]
        # packed: the bias of the whole row; within a sample it is the sample's own (relative positions
        # do not depend on where the sample starts), across samples the mask hides it. T5's attention adds
        # the [1, heads, N, N] bias to its scores (eager only), so the row's mask costs no more than the bias
        attn = state_masks(self.config, enc, state)
        bias = stage_bias(self, state, enc)
        return (self.block(enc, attn, bias)[0], *state[1:BOUNDARY], bias)


class T5EncoderEnd(T5Layer):
    """The encoder's final norm and dropout on the encoder hidden states (the encoder's bias dropped)."""

    def __init__(self, stack: nn.Module):
        super().__init__({"norm": stack.final_layer_norm, "drop": stack.dropout})

    def forward(self, state: tuple) -> tuple:
        return (self.drop(self.norm(state[0])), *state[1:BOUNDARY])


class T5DecoderBlock(T5Layer):
    """One decoder ``T5Block``: causal self-attention with the stage's decoder bias (`stage_bias`),
    cross-attention to the encoder output (no bias, as in T5)."""

    def __init__(self, block: nn.Module, first: nn.Module, config):
        super().__init__({"block": block, "bias": first.relative_attention_bias})
        self.attention = [first]
        self.config = config

    def forward(self, state: tuple) -> tuple:
        enc, dec = state[0], state[1]
        self_mask, cross = decoder_masks(self.config, state)
        bias = stage_bias(self, state, dec)
        return (enc, self.block(dec, self_mask, bias, enc, cross, None)[0], *state[2:BOUNDARY], bias)


class T5Head(T5Layer):
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
                          seq2seq_random_batch(int(config.vocab_size)), hf_config=config, family="encoder_decoder",
                          **names)
