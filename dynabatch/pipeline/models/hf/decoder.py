"""Decoder-only causal LMs on the common Hugging Face layout (Llama, Mistral, Qwen2/Qwen3, Gemma 1-3):
``model.embed_tokens``, ``model.layers``, ``model.norm``, ``model.rotary_emb`` and ``lm_head``.

Layers: ``[embedding, decoder layer x n, head]`` where each middle layer wraps one Hugging Face
decoder layer unchanged. Boundary state (shapes from the plan alone):

* padded (one sample per row): ``(hidden [R, L, H], attention_mask [R, L] int64)`` (positions
  ``0..L-1``, as the model's forward takes them without ``position_ids``);
* packed (``collate='packed'``, all samples in one row): ``(hidden [1, N, H], position_ids [1, N]
  int64, cu_seqlens [n + 1] int32)``.

Each decoder layer builds its attention input the way the Hugging Face model does, with the
model's own mask functions (``create_causal_mask`` / ``create_sliding_window_causal_mask`` for its
``layer_types``) and rotary embedding. Packed rows pass no attention mask and restarting
``position_ids``: the mask functions then build the per-sample causal pattern for the model's
attention implementation (a BlockMask under flex, a boolean mask under SDPA/eager), and a
flash-attention implementation gets ``cu_seq_lens_q/k`` and ``max_length_q/k`` for its varlen
kernel. dynabatch builds no attention mask itself.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ....core.cost import ModelConfig
from ..contract import decoder_boundary, decoder_random_batch
from .common import HFLayer, HFLayeredModel, UnsupportedModel, model_dtype, name_parameters, need, summed_cross_entropy

WHAT = "decoder-only causal LM on the common layout (model.embed_tokens, model.layers, model.norm, " \
       "model.rotary_emb, lm_head)"


def _mask_functions():
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    return {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def layer_kinds(config, n: int) -> list[str]:
    """Each decoder layer's attention kind (``full_attention``/``sliding_attention``), as the model's
    forward picks its mask: ``config.layer_types`` where the config has them, else Mistral's rule
    (``sliding_window`` set: every layer slides)."""
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return list(kinds)[:n]
    return ["sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"] * n


def _unpack_state(state: tuple):
    """(hidden, attention_mask or None, position_ids, cu_seqlens or None) of a padded or packed state."""
    if len(state) == 3:
        return state[0], None, state[1], state[2]
    h, mask = state
    return h, mask, torch.arange(h.shape[1], device=h.device)[None], None


def packed_kwargs(cu: torch.Tensor | None, attn_implementation: str) -> dict:
    """The flash-attention varlen arguments of a packed row (only for flash kernels, which take them; the
    mask functions derive the samples from ``position_ids`` for the others)."""
    if cu is None or "flash" not in str(attn_implementation):
        return {}
    longest = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


class DecoderEmbedding(HFLayer):
    """Layer 0: ``embed_tokens`` of the micro-batch's ``input_ids``; position ids as the model's forward
    takes them (the batch's, else ``0..L-1``)."""

    def __init__(self, embed: nn.Module, name: str):
        super().__init__({"embed": embed})
        self.model_name = name

    def forward(self, batch: dict) -> tuple:
        ids = batch["input_ids"]
        h = self.embed(ids)
        pos = batch.get("position_ids")
        if "cu_seqlens" in batch:
            if pos is None:
                raise ValueError(f"{self.model_name}: a packed micro-batch needs position_ids (collate='packed')")
            return h, pos.long(), batch["cu_seqlens"].to(torch.int32)
        if pos is not None:
            raise ValueError(f"{self.model_name}: rows holding several samples (collate='packed_rows') would attend "
                             "across samples in a Hugging Face model; use collate='packed' (varlen) or 'padded'")
        mask = batch.get("attention_mask")
        return h, torch.ones_like(ids) if mask is None else mask.long()


class DecoderBlock(HFLayer):
    """One Hugging Face decoder layer with its mask and rotary embedding computed from the state."""

    def __init__(self, block: nn.Module, rotary: nn.Module, config, kind: str):
        super().__init__({"block": block, "rotary": rotary})
        self.config, self.kind = config, kind
        self.mask_fn = _mask_functions()[kind]
        self.rotary_kind = "layer_type" in inspect.signature(rotary.forward).parameters

    def forward(self, state: tuple) -> tuple:
        h, mask, pos, cu = _unpack_state(state)
        attn = self.mask_fn(config=self.config, inputs_embeds=h, attention_mask=mask, cache=None, position_ids=pos)
        rope = self.rotary(h, pos, self.kind) if self.rotary_kind else self.rotary(h, pos)
        out = self.block(h, attention_mask=attn, position_ids=pos, position_embeddings=rope, use_cache=False,
                         **packed_kwargs(cu, self.config._attn_implementation))
        out = out[0] if isinstance(out, tuple) else out
        return (out, *state[1:])


class DecoderHead(HFLayer):
    """Final norm, ``lm_head`` (logit soft-capping where the config has it) and the summed shifted
    next-token loss, as ``ForCausalLMLoss`` with ``num_items_in_batch`` = 1."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, softcap: float | None):
        super().__init__({"norm": norm, "lm_head": lm_head})
        self.softcap = softcap

    def forward(self, state: tuple, batch: dict):
        logits = self.lm_head(self.norm(state[0]))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return summed_cross_entropy(logits, batch["labels"], shift=True)


def cost_config(name: str, kind: str, config, dtype: torch.dtype, *, layers: int | None = None,
                decoder_layers: float = 0.0, vision_hidden: int = 0, vision_attn_dim: int = 0, vision_ffn: int = 0,
                vision_layers: float = 0.0, tile_patches: int = 0, tile_tokens: int = 0) -> ModelConfig:
    """The cost model's `ModelConfig` of a Hugging Face text config (whole model as one stage): ``layers``
    (default the config's layer count) and the decoder and vision sizes as `ModelConfig` has them."""
    hidden = int(getattr(config, "hidden_size", None) or config.d_model)
    heads = int(getattr(config, "num_attention_heads", None) or config.num_heads)
    head_dim = int(getattr(config, "head_dim", None) or getattr(config, "d_kv", None) or hidden // heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    ffn = int(getattr(config, "intermediate_size", None) or getattr(config, "d_ff", None)
              or getattr(config, "encoder_ffn_dim", 4 * hidden))
    layers = layers or int(getattr(config, "num_hidden_layers", None) or config.num_layers)
    gated = bool(getattr(config, "hidden_act", None) in ("silu", "gelu_pytorch_tanh") or
                 getattr(config, "is_gated_act", False))
    return ModelConfig(name, kind, hidden=hidden, attn_dim=heads * head_dim, kv_dim=kv * head_dim, ffn=ffn,
                       layers=layers, gated_ffn=gated, flash_attention=False,
                       dtype_bytes=torch.empty((), dtype=dtype).element_size(), decoder_layers=decoder_layers,
                       vision_hidden=vision_hidden, vision_attn_dim=vision_attn_dim, vision_ffn=vision_ffn,
                       vision_layers=vision_layers, tile_patches=tile_patches, tile_tokens=tile_tokens)


def decoder_parts(hf_model: nn.Module) -> nn.Module:
    """The inner model holding embed_tokens/layers/norm/rotary_emb, or `UnsupportedModel` naming what is
    missing."""
    name = type(hf_model).__name__
    prefix = getattr(hf_model, "base_model_prefix", "model") or "model"
    inner = getattr(hf_model, prefix, None)
    if inner is None:
        raise UnsupportedModel(f"{name} is not a {WHAT}: it has no `{prefix}` inner model")
    for part in ("embed_tokens", "layers", "norm", "rotary_emb"):
        need(inner, part, WHAT, f"{name}.{prefix}")
    need(hf_model, "lm_head", WHAT, name)
    if not isinstance(inner.layers, nn.ModuleList) or not len(inner.layers):
        raise UnsupportedModel(f"{name} is not a {WHAT}: `{prefix}.layers` is not a non-empty ModuleList")
    sig = inspect.signature(inner.layers[0].forward).parameters
    if "position_embeddings" not in sig:
        raise UnsupportedModel(f"{name} is not a {WHAT}: its decoder layer {type(inner.layers[0]).__name__} takes "
                               "no position_embeddings (rotary embedding computed outside the layers)")
    if getattr(hf_model.config, "use_bidirectional_attention", False):
        raise UnsupportedModel(f"{name}: use_bidirectional_attention=True is not a causal LM")
    return inner


def decoder_model(hf_model: nn.Module) -> HFLayeredModel:
    """A decoder-only Hugging Face causal LM as an `HFLayeredModel` ``[embedding, layer x n, head]``
    sharing the model's parameters (see the module docstring for the boundary state)."""
    inner = decoder_parts(hf_model)
    config, name = hf_model.config, type(hf_model).__name__
    blocks = list(inner.layers)
    layers: list[HFLayer] = [DecoderEmbedding(inner.embed_tokens, name)]
    layers += [DecoderBlock(block, inner.rotary_emb, config, kind)
               for block, kind in zip(blocks, layer_kinds(config, len(blocks)))]
    layers.append(DecoderHead(inner.norm, hf_model.lm_head, getattr(config, "final_logit_softcapping", None)))
    names = name_parameters(hf_model, layers)
    dtype = model_dtype(hf_model)
    hidden = int(config.hidden_size)
    return HFLayeredModel(name, "decoder", layers, decoder_boundary(hidden, dtype),
                          cost_config(name, "decoder", config, dtype), decoder_random_batch(int(config.vocab_size)),
                          hf_config=config, family="decoder", **names)
