"""Loading only some layers' weights into a layered model built on the meta device.

`WeightSource` reads tensors by Hugging Face state-dict name from a ``save_pretrained`` folder
(``model.safetensors``, or shards listed in ``model.safetensors.index.json``), read lazily with
``safetensors.safe_open`` so a rank reads only its stage's tensors, or from an in-memory state
dict. `materialize` replaces the meta parameters of the chosen layers by the loaded tensors,
keeping one Parameter object for a tensor several of those layers share (tied weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

import torch
from torch import nn

from .common import HFLayeredModel
from .verify import FolderCheck, check_finite, open_checked, read_index, read_tensor

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightSource:
    """Tensors by Hugging Face state-dict name: a ``save_pretrained`` folder (safetensors, sharded or
    not) or a state dict (``Mapping[str, Tensor]``). ``where`` names it in error messages."""

    def __init__(self, source: str | Path | Mapping[str, torch.Tensor], *, verify: str | None = None):
        self._handles: dict[str, object] = {}
        self.renamed: dict[str, str] | None = None  # model name -> stored key, once bound to a model
        if isinstance(source, Mapping):
            self.state, self.files, self.where = source, {}, "the given state dict"
            self.check = None
            return
        folder = Path(source)
        self.state, self.where = None, str(folder)
        self.check = FolderCheck(folder, verify)  # `verify`'s policy: header, manifest, finite tensors
        if (folder / INDEX_FILE).is_file():
            self.files = {k: folder / f for k, f in read_index(folder / INDEX_FILE).items()}
        elif (folder / SINGLE_FILE).is_file():
            from safetensors import safe_open

            self.check.opened(folder / SINGLE_FILE)
            with safe_open(str(folder / SINGLE_FILE), framework="pt") as f:
                self.files = {k: folder / SINGLE_FILE for k in f.keys()}
        else:
            raise FileNotFoundError(f"{folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}: save the model with "
                                    "save_pretrained(..., safe_serialization=True)")
        for path in set(self.files.values()):
            if not path.is_file():
                raise FileNotFoundError(f"{INDEX_FILE} in {folder} lists shard {path.name}, which is missing")

    def keys(self) -> list[str]:
        """Every tensor name as stored."""
        return list(self.state if self.state is not None else self.files)

    def bind(self, hf_model: nn.Module) -> "WeightSource":
        """Read the stored names as ``hf_model``'s state-dict names (`names.stored_names`: transformers' own
        conversion mapping, e.g. LLaVA's ``language_model.model.*``) and refuse a checkpoint that is not
        this model's (`names.check_coverage`: tensors no layer takes, parameters nothing fills). Returns self."""
        from .names import check_coverage, stored_names

        self.renamed = stored_names(hf_model, self.keys(), self.where)
        check_coverage(hf_model, self.renamed, self.where)
        return self

    def name_of(self, names: Iterable[str]) -> str | None:
        """The stored key of the first of ``names`` (a parameter's state-dict name, then its aliases) this
        source holds (after `bind`, by the model's names)."""
        have = self.renamed if self.renamed is not None else (self.state if self.state is not None else self.files)
        found = next((n for n in names if n in have), None)
        return have[found] if found is not None and self.renamed is not None else found

    def get(self, name: str) -> torch.Tensor:
        """The tensor stored under ``name``, verified (`dynabatch.pipeline.models.hf.verify`: its file once,
        as it is first opened; the tensor finite): `DamagedWeights` names the file and what is wrong."""
        if self.state is not None:
            return check_finite(self.state[name], name, self.where)
        path = self.files[name]
        if str(path) not in self._handles:
            self.check.opened(path)
            self._handles[str(path)] = open_checked(path)
        return self.check.tensor(read_tensor(self._handles[str(path)], name, path), name, path)


def _holders(layers: Iterable[nn.Module]) -> dict[int, list[tuple[nn.Module, str]]]:
    """Parameter id -> every (module, attribute name) holding it among ``layers``."""
    out: dict[int, list[tuple[nn.Module, str]]] = {}
    seen_modules: set[int] = set()
    for layer in layers:
        for module in layer.modules():
            if id(module) in seen_modules:
                continue
            seen_modules.add(id(module))
            for name, p in module._parameters.items():
                if p is not None:
                    out.setdefault(id(p), []).append((module, name))
    return out


def materialize(model: HFLayeredModel, layers: range, source: WeightSource, device="cpu",
                dtype: torch.dtype | None = None) -> None:
    """Load layers ``layers`` of ``model`` (built on the meta device) from ``source`` onto ``device``.

    Every parameter of those layers becomes a real tensor read under its Hugging Face name (or an
    alias: ``lm_head.weight`` of a tied model is stored as ``model.embed_tokens.weight``); a tensor
    held by several of these layers stays one Parameter. ``dtype`` (default: the meta parameter's)
    converts floating tensors. A name the source lacks, or a tensor whose shape is not the one the
    config gives, is a ValueError naming the layer, the parameter and the source."""
    holders = _holders(model.layers[i] for i in layers)
    done: dict[int, nn.Parameter] = {}
    for i in layers:
        for path, names in model.keys[i].items():
            p = model.layers[i].get_parameter(path)
            if id(p) in done or not p.is_meta:
                continue
            key = source.name_of(names)
            if key is None:
                raise ValueError(f"{model.name}: layer {i} parameter {path} ({names[0]}) is not in {source.where} "
                                 "(under this name or any that transformers maps to it): the folder's weights are "
                                 "not those of its config.json")
            t = source.get(key)
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{model.name}: {key} has shape {list(t.shape)} in {source.where} but the config gives "
                                 f"{list(p.shape)} (layer {i}, {path}): the weights do not match the config")
            want = dtype if (dtype is not None and t.is_floating_point()) else p.dtype
            new = nn.Parameter(t.to(device=device, dtype=want).contiguous(), requires_grad=p.requires_grad)
            done[id(p)] = new
            for module, name in holders[id(p)]:
                module._parameters[name] = new
    for i in layers:
        for path, key in model.buffer_keys[i].items():  # persistent buffers the source holds (BART's logit bias)
            if source.name_of([key]) is not None:
                with torch.no_grad():
                    model.layers[i].get_buffer(path).copy_(source.get(key))
        model.layers[i].to(device)  # buffers (rotary frequencies, ...) follow the parameters


def parameter_bytes(layers: Iterable[nn.Module]) -> int:
    """Bytes of the distinct materialized (non-meta) parameters of ``layers`` (a shared one counted once)."""
    seen, total = set(), 0
    for layer in layers:
        for p in layer.parameters():
            if id(p) not in seen and not p.is_meta:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total
