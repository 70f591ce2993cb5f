"""A LLaVA-style Hugging Face model as a graph of two components (Spindle's component graph, for the
multi-task executor `dynabatch.pipeline.multitask`):

* ``vit``: the vision tower (patch embedding, the ViT layers up to ``vision_feature_layer``) and the
  multi-modal projector: ``pixel_values`` [T, 3, S, S] -> projected features [T, tile_tokens, H];
* ``backbone``: the language model: token embedding with the projected features written at the image
  placeholders (``masked_scatter``, as the model's own forward), the decoder layers, the final norm and
  ``lm_head`` with the summed next-token loss.

Tasks (`dynabatch.core.multitask.zoo.vision_language_graph` of the model's cost config): ``text`` (backbone
only: a micro-batch without tiles never touches the vision tower) and ``image_text`` (vit -> backbone). The
components wrap the layers of `dynabatch.pipeline.models.hf.llava.llava_model` (no copy: the parameters are
the Hugging Face model's), so a one-process run of both equals the model's own loss and gradients.
"""

from __future__ import annotations

import torch
from torch import nn

from ....core.multitask.graph import ComponentGraph
from ....core.multitask.zoo import vision_language_graph
from ..component_model import ComponentModel, TaskShape
from ..contract import IGNORE_INDEX
from ..spec import TensorSpec
from .build import from_hf
from .common import UnsupportedModel


class VisionComponent(nn.Module):
    """``vit``: the adapter's vision layers (embedding, ViT layers, projector) on the micro-batch's tiles;
    returns the projected features [T, tile_tokens, H]."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, inputs: dict, batch: dict) -> torch.Tensor:
        state = self.layers[0](batch)
        for layer in self.layers[1:]:
            state = layer(state)
        return state[0]


class LanguageComponent(nn.Module):
    """``backbone``: the adapter's merge, decoder layers and head; reads the ``vit`` features on an image+text
    micro-batch (none on a text-only one) and returns ``(summed loss, target tokens)``."""

    def __init__(self, layers: list[nn.Module], tile_tokens: int, hidden: int):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.tile_tokens, self.hidden = tile_tokens, hidden

    def forward(self, inputs: dict, batch: dict):
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask.long()
        feat = inputs.get("vit")
        if feat is None:  # text only: the merge writes no features
            w = self.layers[0].embed.weight
            feat = w.new_zeros(0, self.tile_tokens, self.hidden)
        state = (feat, ids, mask)
        for layer in self.layers[:-1]:
            state = layer(state)
        return self.layers[-1](state, batch)


def llava_graph(source, *, dtype: torch.dtype | None = None, seed: int | None = 0,
                attn_implementation: str | None = None) -> tuple[ComponentGraph, ComponentModel]:
    """(`ComponentGraph`, `ComponentModel`) of a LLaVA-style model: ``source`` a ``transformers`` model object
    (wrapped, sharing its parameters) or a ``LlavaConfig`` (randomly initialized with ``seed``: every rank
    builds the same; ``dtype``, ``attn_implementation`` as `from_hf`). The graph's components are ``vit`` and
    ``backbone`` (module doc); a parameter shared between them (none in LLaVA) is refused, as each component
    group updates its own."""
    if isinstance(source, nn.Module):
        layered = from_hf(source)
    else:
        layered = from_hf(source, dtype=dtype, seed=seed, attn_implementation=attn_implementation)
    if getattr(layered, "family", "") != "llava":
        raise UnsupportedModel(f"llava_graph needs a LLaVA-style model (vision tower, projector, language model), "
                               f"got {layered.name} ({layered.family or 'unknown family'})")
    n = layered.vision_layers
    for tie, uses in layered.tied_parameters().items():
        sides = {i < n for i, _ in uses}
        if len(sides) > 1:
            raise UnsupportedModel(f"{layered.name}: parameter {tie!r} is shared by the vision tower and the language "
                                   "model; the two components update their parameters in different groups")
    hidden = int(layered.hf_config.text_config.hidden_size)
    tt = layered.tile_tokens
    dt = next(p for p in layered.parameters()).dtype
    modules = {"vit": VisionComponent(layered.layers[:n]),
               "backbone": LanguageComponent(layered.layers[n:], tt, hidden)}

    def output_spec(name: str, shape: TaskShape) -> TensorSpec | None:
        if name == "vit":
            return TensorSpec((shape.tiles, tt, hidden), dt, True)
        if name == "backbone":
            return None
        raise KeyError(f"{layered.name}'s graph has no component {name!r} (components: vit, backbone)")

    def shape_of(batch: dict, task: str) -> TaskShape:
        R, L = batch["input_ids"].shape
        tiles = int(batch["image_tiles"].sum()) if "image_tiles" in batch else 0
        return TaskShape(task, int(R), int(L), int(L), tiles)

    def targets(name: str, batch: dict) -> int:
        if name != "backbone":
            raise KeyError(f"{layered.name}: {name!r} is no head of the graph (the backbone holds the LM head)")
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    def random_batch(path, rows: int, text_len: int, generator: torch.Generator | None = None, tiles: int = 0,
                     audio_frames: int = 0) -> dict:
        from ..spec import MicroBatchShape

        t = tiles if "vit" in path else 0
        return layered.random_batch(MicroBatchShape("padded", rows, text_len + t * tt, tiles=t), generator)

    def sample_tokens(batch: dict) -> tuple[list, list, list]:
        total = batch["attention_mask"].long().sum(1) if "attention_mask" in batch else \
            torch.full((len(batch["input_ids"]),), batch["input_ids"].shape[1])
        tiles = batch.get("image_tiles")
        vision = torch.zeros_like(total) if tiles is None else tiles.long().reshape(total.shape) * tt
        return (total - vision).tolist(), vision.tolist(), [0] * len(total)  # the placeholders are the vision tokens

    model = ComponentModel(f"{layered.name} (2 components)", modules, output_spec, shape_of, targets, random_batch,
                           sample_tokens)
    return vision_language_graph(layered.config), model


__all__ = ["LanguageComponent", "VisionComponent", "llava_graph"]
