"""`from_hf`: a Hugging Face model object, config or ``save_pretrained`` folder as an `HFLayeredModel`.

The family is recognized by structure (which modules the model has), not by class name: a model
with a vision tower, projector and language model is LLaVA-style; an encoder-decoder has T5 stacks
(``encoder.block``) or BART-style ones (``model.encoder.layers``); anything else must have
``model.embed_tokens``/``layers``/``norm``/``rotary_emb`` and ``lm_head`` (a decoder). Any
other model is refused (`UnsupportedModel`) with its class and what it lacks, never split wrongly.

A config or folder is built on the meta device (parameters only: buffers such as rotary
frequencies are computed for real), and only the requested layers are then loaded (`materialize`),
so a rank holds just its stage's parameters plus the ones its layers share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from .common import HFLayeredModel, UnsupportedModel
from .decoder import decoder_model
from .weights import WeightSource, materialize


def _config_of(source):
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source
    path = Path(source)
    if not (path.is_file() or (path / "config.json").is_file()):
        raise FileNotFoundError(f"{path}: no config.json (expected a save_pretrained folder or a config.json file)")
    return AutoConfig.from_pretrained(str(path))


def model_class(config):
    """The Hugging Face class a config builds: its ``architectures[0]`` when ``transformers`` has it, else
    the Auto class of its kind (seq2seq, image-text-to-text, causal LM)."""
    import transformers

    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    if getattr(config, "is_encoder_decoder", False):
        return transformers.AutoModelForSeq2SeqLM
    if getattr(config, "vision_config", None) is not None:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def build_model(config, *, empty: bool, dtype: torch.dtype | None = None) -> nn.Module:
    """The Hugging Face model of ``config``: on the meta device (``empty``; buffers real) or randomly
    initialized (seed it with ``torch.manual_seed``), in ``dtype`` (default: torch's default dtype)."""
    from accelerate import init_empty_weights

    cls = model_class(config)
    old = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        if empty:
            with init_empty_weights(include_buffers=False):
                model = cls.from_config(config) if hasattr(cls, "from_config") else cls._from_config(config)
        else:
            model = cls.from_config(config) if hasattr(cls, "from_config") else cls._from_config(config)
    finally:
        torch.set_default_dtype(old)
    model.tie_weights()  # not done under init_empty_weights; the ties must exist before the layers are named
    return model


def adapt(hf_model: nn.Module) -> HFLayeredModel:
    """The `HFLayeredModel` of a Hugging Face model object (sharing its parameters), by structure."""
    if getattr(hf_model, "config", None) is None:
        raise UnsupportedModel(f"{type(hf_model).__name__} is not a transformers model (it has no `config`): wrap a "
                               "PreTrainedModel, or write a LayeredModel for it (dynabatch.pipeline.models)")
    inner = getattr(hf_model, "model", None)
    if getattr(inner, "vision_tower", None) is not None or getattr(hf_model, "vision_tower", None) is not None:
        from .llava import llava_model

        return llava_model(hf_model)
    if getattr(hf_model.config, "is_encoder_decoder", False):
        if getattr(getattr(hf_model, "encoder", None), "block", None) is not None:
            from .seq2seq import seq2seq_model

            return seq2seq_model(hf_model)
        from .bart import bart_model

        return bart_model(hf_model)
    return decoder_model(hf_model)


def from_hf(source, *, layers: range | None = None, weights: str | Path | Mapping[str, torch.Tensor] | None = None,
            dtype: torch.dtype | None = None, attn_implementation: str | None = None, seed: int | None = None,
            device="cpu") -> HFLayeredModel:
    """A Hugging Face model as a pipeline `LayeredModel` (`HFLayeredModel`).

    ``source``: a ``transformers`` model object (wrapped as is: the layered model shares its
    parameters), a config, a ``save_pretrained`` folder or a ``config.json`` path. From a folder
    the weights are read from its safetensors (``weights``: another folder or a state dict
    instead); from a config without ``weights`` the model is randomly initialized with ``seed``
    (every rank builds the same). ``layers``: materialize only these layers (a rank's stage, e.g.
    ``StagePartition.layers_of(stage)``); the others stay on the meta device. ``dtype``: parameter
    dtype (default torch's default); ``attn_implementation``: ``sdpa``, ``eager``, ``flex_attention``,
    ``flash_attention_2``, ... (default: the config's); ``device``: where loaded weights are placed
    (a randomly initialized model stays on the CPU until the runner moves its stage)."""
    if isinstance(source, nn.Module):
        if layers is not None or weights is not None:
            raise ValueError("from_hf(model object) wraps the model as it is: pass a config or folder to load a stage")
        return adapt(source)
    config = _config_of(source)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    random_init = weights is None and (not isinstance(source, (str, Path)) or Path(source).is_file())
    if random_init:
        if seed is not None:
            torch.manual_seed(seed)
        model = adapt(build_model(config, empty=False, dtype=dtype))
        return model if layers is None else _drop_others(model, layers)
    src = WeightSource(weights if weights is not None else source)
    hf_model = build_model(config, empty=True, dtype=dtype)
    src.bind(hf_model)  # stored names as transformers maps them; a checkpoint of another config is refused
    model = adapt(hf_model)
    model.weights = src  # load_stage reads the stage's layers from the same, checked source
    materialize(model, range(len(model.layers)) if layers is None else layers, src, device=device, dtype=dtype)
    return model


def _drop_others(model: HFLayeredModel, layers: range) -> HFLayeredModel:
    """Move the layers outside ``layers`` to the meta device (a randomly initialized rank keeps its stage)."""
    keep = {id(p) for i in layers for p in model.layers[i].parameters()}
    for i, layer in enumerate(model.layers):
        if i not in layers:
            for module in layer.modules():
                for name, p in module._parameters.items():
                    if p is not None and id(p) not in keep:
                        module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
    return model


__all__ = ["from_hf", "adapt", "build_model", "UnsupportedModel"]
