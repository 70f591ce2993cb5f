"""Pipeline checkpoints of Hugging Face models: each stage saves its part, one call merges the parts.

`save_stage` writes ``stage-SSSSS-of-NNNNN.safetensors`` (the stage's parameters under their
Hugging Face state-dict names; a tied parameter is saved by every stage holding it; never a NaN or an
infinity) with its checksum manifest and, from stage 0, ``config.json``. `merge_stages` verifies the
parts (`dynabatch.pipeline.models.hf.verify`), checks that every part is there and that the copies of
each tied parameter agree, and writes a ``save_pretrained`` folder that ``from_pretrained`` loads, with
a checksum manifest (``dynabatch-checksums.json``) that later loads verify.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from .common import HFLayeredModel
from .verify import MANIFEST, FolderCheck, all_finite, write_manifest
from .weights import INDEX_FILE

PART = "stage-{:05d}-of-{:05d}.safetensors"
_PART_RE = re.compile(r"stage-(\d{5})-of-(\d{5})\.safetensors$")


def save_stage(model: HFLayeredModel, layers: range, folder: str | Path, stage: int, num_stages: int) -> Path:
    """Write stage ``stage`` of ``num_stages`` (its layers ``layers``) to ``folder`` as one safetensors part
    (written to a temporary name, then renamed); stage 0 also writes ``config.json``. Returns the part."""
    from safetensors.torch import save_file

    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is not one of {num_stages} stages")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for i in layers:
        for path, key in model.param_keys(i).items():
            p = model.layers[i].get_parameter(path)
            if p.is_meta:
                raise ValueError(f"{model.name}: layer {i} ({path}) is not materialized on this rank; save the layers "
                                 "this stage holds")
            tensors.setdefault(key, p.detach().to("cpu").contiguous())
        for path, key in model.buffer_keys[i].items():
            tensors.setdefault(key, model.layers[i].get_buffer(path).to("cpu").contiguous())
    bad = [k for k, t in tensors.items() if not all_finite(t)]
    if bad:
        raise ValueError(f"{model.name}: stage {stage} of {num_stages} holds NaN or infinite values in {len(bad)} "
                         f"tensor(s) ({bad[:4]}); nothing was saved to {folder}: training diverged, keep the last "
                         f"good checkpoint (RunnerConfig(nonfinite=...) stops or skips a non-finite step)")
    part = folder / PART.format(stage, num_stages)
    tmp = part.with_name(part.name + f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"format": "pt", "layers": f"{layers.start}:{layers.stop}"})
    os.replace(tmp, part)
    # one manifest per part: the stages of one folder are saved by different ranks at once
    write_manifest(folder, [part], MANIFEST.replace(".json", f".{part.name.removesuffix('.safetensors')}.json"))
    if stage == 0:
        tmp = folder / f"config.json.tmp{os.getpid()}"
        model.hf_config.to_json_file(str(tmp))
        os.replace(tmp, folder / "config.json")
    return part


def _parts(folder: Path) -> list[Path]:
    found = {}
    for f in folder.iterdir():
        m = _PART_RE.match(f.name)
        if m:
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = f
    if not found:
        raise FileNotFoundError(f"{folder} holds no stage parts ({PART.format(0, 2)}, ...): save them with save_stage")
    if len(found) > 1:
        raise ValueError(f"{folder} holds parts of pipelines of {sorted(found)} stages; keep one checkpoint per folder")
    (n, parts), = found.items()
    missing = [PART.format(s, n) for s in range(n) if s not in parts]
    if missing:
        raise FileNotFoundError(f"{folder} lacks stage part(s) {missing} of {n}: every stage must save_stage")
    return [parts[s] for s in range(n)]


def _gather(parts: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    first: dict[str, int] = {}
    check = FolderCheck(parts[0].parent)  # the parts' headers and manifests, their tensors finite
    for s, part in enumerate(parts):
        check.opened(part)
        for key, t in load_file(str(part)).items():
            check.tensor(t, key, part)
            if key in state:
                if not torch.equal(state[key], t):
                    raise ValueError(f"tied parameter {key} differs between stage {first[key]} and stage {s}: sum "
                                     "tied gradients over their stages before each optimizer step (PipelineRunner.from_model does)")
                continue
            state[key], first[key] = t, s
    return state


def merge_stages(folder: str | Path, out: str | Path) -> Path:
    """Merge the stage parts in ``folder`` into a ``save_pretrained`` folder ``out`` (safetensors + config)
    that ``from_pretrained`` loads. A missing part, parameters missing from or unknown to the config's
    model, or tied copies that disagree are errors naming them."""
    from transformers import AutoConfig

    from .build import build_model

    folder = Path(folder)
    state = _gather(_parts(folder))
    config = AutoConfig.from_pretrained(str(folder))
    dtype = next(iter(state.values())).dtype
    model = build_model(config, empty=True, dtype=dtype)
    expected = {name for name, _ in model.named_parameters()}
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    buffers = set(model.state_dict(keep_vars=True)) - aliases  # persistent buffers: saved, may be absent
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected - buffers)
    if missing or extra:
        raise ValueError(f"the stage parts in {folder} do not match its config.json: missing {missing[:5]} "
                         f"({len(missing)}), unknown {extra[:5]} ({len(extra)})")
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:
        raise ValueError(f"the stage parts in {folder} do not match its config.json: {e}") from None
    model.tie_weights()
    still = [n for n, p in model.named_parameters() if p.is_meta]
    if still:
        raise ValueError(f"merging {folder}: {still[:5]} were not loaded")
    out = Path(out)
    model.save_pretrained(out)
    write_manifest(out, [f for f in out.iterdir() if f.name.endswith(".safetensors") or f.name == INDEX_FILE])
    return out
