"""What every Hugging Face adapter shares: the `HFLayeredModel` record, the layer wrapper base that
knows its parameters' Hugging Face names, the summed loss heads, and the refusal error.

An adapter wraps the modules of a ``transformers`` model object (no copy): the layered model's
parameters *are* the Hugging Face model's, so a tied weight (``lm_head.weight`` is
``embed_tokens.weight``) is one Parameter object in every layer that uses it. Each wrapper lists
no module of its own: `name_parameters` names every parameter as the Hugging Face state dict does
by finding the very Parameter object in the Hugging Face model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ....loader.token_loss import summed_cross_entropy
from ..layered import LayeredModel


class UnsupportedModel(TypeError):
    """A model the adapters cannot split: the message names its class and what is missing."""


class HFLayer(nn.Module):
    """Base of the adapter layers: ``sources`` maps attribute names to the Hugging Face modules the layer
    runs (registered as its sub-modules, not copied)."""

    def __init__(self, sources: dict[str, nn.Module]):
        super().__init__()
        for attr, module in sources.items():
            setattr(self, attr, module)


@dataclass
class HFLayeredModel(LayeredModel):
    """A `LayeredModel` made from a Hugging Face model by an adapter (`dynabatch.pipeline.models.hf`).

    ``hf_config``: the Hugging Face config (``save_pretrained`` writes it back); ``family``:
    ``decoder``, ``encoder_decoder`` or ``llava``; ``keys``: per layer, each parameter's local path
    -> its Hugging Face state-dict names (the name ``save_pretrained`` keeps first, then aliases);
    ``ties``: parameters held by several layers (see `tied_parameters`); ``buffer_keys``: per layer,
    each persistent buffer's local path -> its state-dict name (BART's ``final_logits_bias``).
    """

    hf_config: object = field(default=None, repr=False)
    family: str = ""
    keys: list[dict[str, tuple[str, ...]]] = field(default_factory=list, repr=False)
    ties: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    buffer_keys: list[dict[str, str]] = field(default_factory=list, repr=False)

    def packed_attention(self) -> str:
        """``"varlen"`` under a flash-attention or flex implementation (per sample), ``"dense"`` under SDPA
        or eager, which take the packed row whole with a mask (`dynabatch.CostModel.packed_attention`)."""
        cfg = getattr(self.hf_config, "text_config", None) or self.hf_config
        impl = str(getattr(cfg, "_attn_implementation", None) or "sdpa")
        return "varlen" if ("flash" in impl or "flex" in impl) else "dense"

    def tied_parameters(self) -> dict[str, list[tuple[int, str]]]:
        """Tie name (the Hugging Face state-dict name) -> [(global layer index, parameter path inside that
        layer module)] for every parameter used by more than one layer: tied input/output embeddings,
        T5's shared embedding and its relative attention bias tables (each stage holds a copy). Within one
        process those layers hold the same Parameter object; across stages each stage's copy gets the
        sum of the holders' gradients before an optimizer step (the runtime's job)."""
        return {k: list(v) for k, v in self.ties.items()}

    def param_keys(self, layer: int) -> dict[str, str]:
        """Local parameter path of layer ``layer`` -> the Hugging Face state-dict name it is saved under."""
        return {path: names[0] for path, names in self.keys[layer].items()}


def name_parameters(hf_model: nn.Module, layers: list[HFLayer]) -> dict:
    """``keys``, ``ties`` and ``buffer_keys`` of `HFLayeredModel` for ``layers`` wrapping modules of
    ``hf_model``: each parameter's Hugging Face names (first = the one ``named_parameters`` keeps for a
    shared tensor), the parameters several layers hold (by identity), the persistent buffers' names."""
    names: dict[int, list[str]] = {}
    for name, p in hf_model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    keys, holders = [], {}
    for i, layer in enumerate(layers):
        mine = {}
        for path, p in layer.named_parameters():
            found = names.get(id(p))
            if found is None:
                raise UnsupportedModel(f"{type(hf_model).__name__}: layer {i} ({type(layer).__name__}) holds "
                                       f"parameter {path} that is not a parameter of the model")
            mine[path] = tuple(found)
            holders.setdefault(found[0], []).append((i, path))
        keys.append(mine)
    ties = {k: v for k, v in holders.items() if len({i for i, _ in v}) > 1}
    persistent = set(hf_model.state_dict(keep_vars=True))
    buffers = {id(b): n for n, b in hf_model.named_buffers(remove_duplicate=False) if n in persistent}
    buffer_keys = [{path: buffers[id(b)] for path, b in layer.named_buffers() if id(b) in buffers} for layer in layers]
    return {"keys": keys, "ties": ties, "buffer_keys": buffer_keys}


def model_dtype(hf_model: nn.Module) -> torch.dtype:
    """The floating dtype of the model's parameters (the hidden states' dtype on every link)."""
    for p in hf_model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def need(obj, path: str, what: str, model_name: str):
    """Attribute ``path`` (dotted) of ``obj``, or `UnsupportedModel` naming the class and what is missing."""
    cur = obj
    for part in path.split("."):
        if not hasattr(cur, part) or getattr(cur, part) is None:
            raise UnsupportedModel(f"{model_name} is not a {what}: it has no `{path}`")
        cur = getattr(cur, part)
    return cur


__all__ = ["HFLayeredModel", "HFLayer", "UnsupportedModel", "summed_cross_entropy", "name_parameters"]
