"""Checkpoint tensor names -> the model's state-dict names, as ``transformers`` itself maps them, and the
check that a checkpoint and a config describe the same model.

A folder written by ``save_pretrained`` does not always use the in-memory names: transformers 5.x saves
LLaVA as ``language_model.model.*`` / ``vision_tower.*`` / ``multi_modal_projector.*`` (the layout of the
published checkpoints) and renames them to ``model.language_model.*``, ``model.vision_tower.*`` ... on
load. `stored_names` applies the model's own conversion mapping
(``transformers.conversion_mapping.get_model_conversion_mapping``: the renamings ``from_pretrained``
applies, and its base-model prefix rule), so every layout ``from_pretrained`` reads loads here too,
without a list of our own. A mapping entry that converts tensors (concatenates, splits) rather than
renaming them is refused with what to do.

`check_coverage` then compares the two sides by name: checkpoint tensors that no parameter or buffer of
the config's model takes (4-layer weights under a config edited to 2 layers) and parameters that no
tensor fills are errors naming them, before a single tensor is read.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn


class CheckpointMismatch(ValueError):
    """A checkpoint whose tensors are not those of the config's model; the message names them."""


def _conversions(hf_model: nn.Module):
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # an older transformers: its checkpoints use the in-memory names
        return [], []
    transforms = get_model_conversion_mapping(hf_model)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


def stored_names(hf_model: nn.Module, keys: Iterable[str], where: str) -> dict[str, str]:
    """The model's state-dict name of every checkpoint key in ``keys`` (``{model name: stored key}``), by the
    model's conversion mapping and base-model prefix, as ``from_pretrained`` renames them."""
    keys = list(keys)
    expected = hf_model.state_dict(keep_vars=True)
    renamings, converters = _conversions(hf_model)
    if not renamings and not converters:
        return {k: k for k in keys}
    from transformers.core_model_loading import rename_source_key

    prefix = getattr(hf_model, "base_model_prefix", None) or None
    out: dict[str, str] = {}
    for key in keys:
        name, converted = rename_source_key(key, renamings, converters, base_model_prefix=prefix,
                                            meta_state_dict=expected)
        if converted is not None:
            raise CheckpointMismatch(
                f"{where}: tensor {key} is stored in a layout that transformers converts on load ({converted}); "
                f"dynabatch reads tensors as they are. Load the folder once with {type(hf_model).__name__}"
                ".from_pretrained(...) and save_pretrained() it, then train from the saved folder")
        out[name] = key
    return out


def check_coverage(hf_model: nn.Module, names: dict[str, str], where: str) -> None:
    """Refuse a checkpoint (``names``: model name -> stored key) whose tensors are not the config's model's:
    stored tensors no parameter or persistent buffer takes, and parameters no stored tensor fills (a tied
    parameter is filled by any one of its names)."""
    state = set(hf_model.state_dict(keep_vars=True))
    aliases: dict[int, list[str]] = {}
    for name, p in hf_model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    unfilled = sorted(group[0] for group in aliases.values() if not any(n in names for n in group))
    extra = sorted(names[n] for n in names if n not in state)
    if not unfilled and not extra:
        return
    config = getattr(hf_model, "config", None)
    layers = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                     "num_hidden_layers", None)
    said = [f"{where} does not hold the weights of its config's {type(hf_model).__name__}"
            + (f" (config: num_hidden_layers={layers})" if layers is not None else "")]
    if extra:
        said.append(f"{len(extra)} stored tensor(s) no layer of the config takes, e.g. {extra[:4]}")
    if unfilled:
        said.append(f"{len(unfilled)} parameter(s) no stored tensor fills, e.g. {unfilled[:4]}")
    said.append("the config.json was edited or belongs to another checkpoint: restore the config saved with "
                "these weights (or save the model again with save_pretrained)")
    raise CheckpointMismatch(said[0] + ": " + "; ".join(said[1:]))


__all__ = ["CheckpointMismatch", "check_coverage", "stored_names"]
