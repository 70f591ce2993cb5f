"""LLaVA-style vision-language models (``model.vision_tower`` a CLIP/SigLIP-style ViT, ``model.multi_modal_projector``,
``model.language_model`` on the decoder layout, ``lm_head``) as layered models.

Layers, vision first: ``[vision embedding, ViT layer x k, projector, merge, decoder layer x n, head]``
where ``k`` is the ViT depth the model reads its features from (``vision_feature_layer``; the deeper
ViT layers and the post-norm are held by the projector layer so checkpoints are complete, but never
run: the Hugging Face model's loss does not depend on them either, so they are frozen
(``requires_grad=False``) and no optimizer step (weight decay included) changes them). The micro-batches are the
`DataLoader`'s vision micro-batches with image placeholders (``image_token_id=`` the model's
``config.image_token_id``): ``input_ids``/``attention_mask``/``labels`` [R, L], ``image_tiles`` [R]
(one tile per image) and ``pixel_values`` [T, 3, S, S]. The merge writes the projected features at
the placeholder positions in order, as the model's ``masked_scatter`` does.

Boundary state: after a vision layer ``(features [T, P, Hv] (projector: [T, tile_tokens, H]), ids [R,
L], attention_mask [R, L])``; from the merge on, the decoder's padded state. A micro-batch without
tiles carries an empty ``[0, P, Hv]`` feature tensor and its vision layers do not compute
(`idle_layers`: the runner's bypass skips stages holding only those).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..spec import MicroBatchShape, TensorSpec
from ..vlm import VisionLanguageModel, placeholder_mask, vlm_random_batch
from .common import HFLayer, HFLayeredModel, UnsupportedModel, model_dtype, name_parameters, need
from .decoder import DecoderBlock, DecoderHead, cost_config, decoder_boundary, layer_kinds

WHAT = "LLaVA-style model (model.vision_tower, model.multi_modal_projector, model.language_model, lm_head)"


class VisionEmbedding(HFLayer):
    """Layer 0: patch embedding (+ pre-norm where the ViT has one) of ``pixel_values``; passes the text on."""

    def __init__(self, tower: nn.Module, tile_tokens: int, image_token_id: int, name: str):
        pre = getattr(tower, "pre_layrnorm", None)
        super().__init__({"embed": tower.embeddings, "pre": pre if pre is not None else nn.Identity()})
        self.tile_tokens, self.image_token_id, self.model_name = tile_tokens, image_token_id, name
        self.positions = int(tower.embeddings.num_positions)

    def forward(self, batch: dict) -> tuple:
        if "cu_seqlens" in batch or "position_ids" in batch:
            raise ValueError(f"{self.model_name} takes padded micro-batches with one sample per row (collate='padded')")
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask.long()
        tiles = int(batch["image_tiles"].sum()) if "image_tiles" in batch else 0
        ph = placeholder_mask(batch, self.tile_tokens, self.image_token_id)
        if (ph is None) != (tiles == 0):
            raise ValueError(f"{self.model_name}: the micro-batch has {tiles} image tile(s) but "
                             f"{0 if ph is None else int(ph.sum())} image placeholder tokens (image_token_id "
                             f"{self.image_token_id}): build the DataLoader with image_token_id={self.image_token_id}")
        w = self.embed.patch_embedding.weight
        if tiles == 0:
            return w.new_zeros(0, self.positions, w.shape[0]), ids, mask
        return self.pre(self.embed(batch["pixel_values"])), ids, mask


class VisionBlock(HFLayer):
    """One ViT encoder layer over the patches of each tile (no mask); skipped on 0 tiles."""

    def __init__(self, block: nn.Module):
        super().__init__({"block": block})

    def forward(self, state: tuple) -> tuple:
        if state[0].shape[0] == 0:
            return state
        out = self.block(state[0], None)
        return (out[0] if isinstance(out, tuple) else out, *state[1:])


class Projector(HFLayer):
    """Feature selection (``default``: drop the class token) and ``multi_modal_projector``; also holds the
    unused deeper ViT layers and post-norm (never run)."""

    def __init__(self, projector: nn.Module, unused: dict[str, nn.Module], drop_cls: bool, hidden: int):
        super().__init__({"projector": projector, **unused})
        self.drop_cls, self.hidden = drop_cls, hidden
        for module in unused.values():
            module.requires_grad_(False)

    def forward(self, state: tuple) -> tuple:
        feat = state[0]
        if feat.shape[0] == 0:
            n = feat.shape[1] - int(self.drop_cls)
            return (feat.new_zeros(0, n, self.hidden), *state[1:])
        return (self.projector(feat[:, 1:] if self.drop_cls else feat), *state[1:])


class Merge(HFLayer):
    """Token embedding of the ids with the projected tile features scattered at the placeholders; the
    decoder's padded state."""

    def __init__(self, embed: nn.Module, image_token_id: int):
        super().__init__({"embed": embed})
        self.image_token_id = image_token_id

    def forward(self, state: tuple) -> tuple:
        feat, ids, mask = state
        h = self.embed(ids)
        if feat.shape[0]:
            where = (ids == self.image_token_id).unsqueeze(-1).expand_as(h)
            h = h.masked_scatter(where, feat.reshape(-1, feat.shape[-1]).to(h.dtype))
        return h, mask


@dataclass
class HFVisionLanguageModel(HFLayeredModel, VisionLanguageModel):
    """An `HFLayeredModel` with the vision fields of `VisionLanguageModel` (``tile_tokens``, ``tile_size``,
    ``vision_layers``, ``image_token_id``, ``batch_shapes``, ``idle_layers``)."""


def _boundary(n_vision: int, patches: int, vision_hidden: int, hidden: int, tile_tokens: int, dtype):
    text = decoder_boundary(hidden, dtype)

    def boundary(shape: MicroBatchShape, layer: int) -> tuple[TensorSpec, ...]:
        if shape.packed or shape.target_len:
            raise ValueError("a LLaVA model takes padded decoder micro-batches (collation padded, target_len 0)")
        if layer >= n_vision:
            return text(shape, layer)
        R, L, T = shape.rows, shape.input_len, shape.tiles
        feat = (TensorSpec((T, patches, vision_hidden), dtype, True) if layer < n_vision - 1 else
                TensorSpec((T, tile_tokens, hidden), dtype, True))
        return feat, TensorSpec((R, L), torch.int64), TensorSpec((R, L), torch.int64)
    return boundary


def _depth(config, n_layers: int, name: str) -> int:
    k = config.vision_feature_layer
    if not isinstance(k, int):
        raise UnsupportedModel(f"{name}: vision_feature_layer={k!r} (features from several ViT layers) is not supported")
    depth = k if k >= 0 else n_layers + 1 + k
    if not 0 < depth <= n_layers:
        raise UnsupportedModel(f"{name}: vision_feature_layer={k} is outside the ViT's {n_layers} layers")
    return depth


def llava_model(hf_model: nn.Module) -> HFVisionLanguageModel:
    """A LLaVA-style ``...ForConditionalGeneration`` as a layered model sharing its parameters."""
    name = type(hf_model).__name__
    for part in ("model.vision_tower", "model.multi_modal_projector", "model.language_model.embed_tokens",
                 "model.language_model.layers", "model.language_model.norm", "model.language_model.rotary_emb",
                 "lm_head"):
        need(hf_model, part, WHAT, name)
    config = hf_model.config
    tower = hf_model.model.vision_tower
    tower = getattr(tower, "vision_model", tower)  # a vision model that wraps its transformer
    blocks = need(tower, "encoder.layers", WHAT, f"{name}.vision_tower")
    depth = _depth(config, len(blocks), name)
    drop_cls = config.vision_feature_select_strategy == "default"
    image_token_id = int(config.image_token_id)
    patches = int(tower.embeddings.num_positions)
    tile_tokens = patches - int(drop_cls)
    lm, text = hf_model.model.language_model, config.text_config
    hidden = int(text.hidden_size)
    layers: list[HFLayer] = [VisionEmbedding(tower, tile_tokens, image_token_id, name)]
    layers += [VisionBlock(b) for b in blocks[:depth]]
    unused = {f"unused{i}": blocks[i] for i in range(depth, len(blocks))}
    if getattr(tower, "post_layernorm", None) is not None:
        unused["post_norm"] = tower.post_layernorm
    layers.append(Projector(hf_model.model.multi_modal_projector, unused, drop_cls, hidden))
    n_vision = len(layers)
    layers.append(Merge(lm.embed_tokens, image_token_id))
    layers += [DecoderBlock(block, lm.rotary_emb, text, kind)
               for block, kind in zip(lm.layers, layer_kinds(text, len(lm.layers)))]
    layers.append(DecoderHead(lm.norm, hf_model.lm_head, getattr(text, "final_logit_softcapping", None)))
    names = name_parameters(hf_model, layers)
    dtype = model_dtype(hf_model)
    vc = config.vision_config
    vh = int(vc.hidden_size)
    cost = cost_config(name, "vision_language", text, dtype, vision_hidden=vh, vision_attn_dim=vh,
                       vision_ffn=int(vc.intermediate_size), vision_layers=depth, tile_patches=patches,
                       tile_tokens=tile_tokens)
    tile_size = int(vc.image_size)
    vocab = int(text.vocab_size)
    make = vlm_random_batch(min(vocab, image_token_id), tile_tokens, tile_size, image_token_id)
    return HFVisionLanguageModel(name, "vision_language", layers, _boundary(n_vision, patches, vh, hidden, tile_tokens,
                                                                              dtype),
                                 cost, make, hf_config=config, family="llava", **names,
                                 tile_tokens=tile_tokens, tile_size=tile_size, vision_layers=n_vision,
                                 image_token_id=image_token_id)
