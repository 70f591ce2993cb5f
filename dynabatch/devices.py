"""Which device preset this machine is, for the `DataLoader`'s ``device="auto"`` (its default).

* `resolve_device`: ``"auto"`` -> the preset of the CUDA device when torch sees one
  (``torch.cuda.get_device_name``: A100 -> ``a100-80gb`` or ``a100-40gb`` by its memory, H100/H800 ->
  ``h100``, H200/GH200 -> ``h200``; another GPU -> the preset closest in memory, with a warning),
  else ``"cpu"`` (the measured CPU profile). Any other name is returned as given.
* `check_device`: a `DeviceMismatchWarning` when an explicit GPU preset does not match this
  machine (no CUDA GPU, or a GPU of another known preset). Only the loader checks: offline planning
  (``dynabatch plan``, ``dynabatch bench plan``, `CostModel.preset`) plans for other hardware on
  purpose and keeps ``a100-80gb`` as its default.
* `loader_cost_model`: the DataLoader's cost model from its ``cost_model=`` and ``device=``. With
  no ``cost_model`` it is ``gpt`` on a GPU and the CPU-sized ``gpt-tiny`` (``t5-tiny`` for an
  encoder-decoder) on the ``cpu``: DynaPipe's GPT costs 21 ms per token on the ``cpu`` preset, so
  a micro-batch's fixed cost is worth 23 tokens and batching barely pays. A GPU-scale preset
  (``gpt``, ``t5``, ``vlm``) named with ``device="auto"`` on a machine without a GPU is planned for
  ``a100-80gb``, as before ``"auto"`` existed (``t5`` and ``vlm`` do not even fit a CPU's memory),
  with a warning.

Every warning is issued once per process per case. torch is imported lazily (the planning core,
`dynabatch.core`, stays torch-free and takes the resolved name); asking for the CUDA device's name
initializes CUDA in this process.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from dataclasses import dataclass

from .core.cost.presets import DEVICE_PRESETS, GPU_PRESETS, MODEL_PRESETS, GiB, device_preset

#: The model preset of the DataLoader's default cost model on the ``cpu``, by family.
CPU_DEFAULT_MODEL = {"decoder": "gpt-tiny", "encoder_decoder": "t5-tiny"}
#: Where ``device="auto"`` plans a GPU-scale model preset on a machine without a GPU.
OFFLINE_DEFAULT_DEVICE = "a100-80gb"
PROFILE_HINT = ("measure this machine with `dynabatch profile --device cuda --out costs.json` and pass "
                "cost_model=CostModel.load('costs.json') (see docs/cost_model.md)")

_warned: set = set()
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


class DeviceMismatchWarning(UserWarning):
    """The device preset planned for is not this machine's hardware (or was only guessed)."""


@dataclass(frozen=True)
class Hardware:
    """This process's accelerator: the CUDA device's name and memory (bytes), or None for none."""

    gpu: str | None = None
    memory_bytes: float | None = None


def detect_hardware() -> Hardware:
    """The current CUDA device (``torch.cuda``), or ``Hardware()`` without torch or CUDA."""
    try:
        import torch
    except ImportError:
        return Hardware()
    try:
        if not torch.cuda.is_available():
            return Hardware()
        try:
            index = torch.cuda.current_device()
        except Exception:  # noqa: BLE001 - a mocked or partial CUDA setup: the first device
            index = 0
        name = str(torch.cuda.get_device_name(index))
        try:
            memory = float(torch.cuda.get_device_properties(index).total_memory)
        except Exception:  # noqa: BLE001 - name known, memory not: still a GPU
            memory = None
        return Hardware(name, memory)
    except Exception as e:  # noqa: BLE001 - a broken CUDA setup plans for the CPU, and says so
        _warn_once(("cuda-error", type(e).__name__), f"torch.cuda failed ({type(e).__name__}: {e}); device='auto' "
                   "plans for the cpu preset")
        return Hardware()


def gpu_preset(name: str, memory_bytes: float | None = None) -> tuple[str, bool]:
    """(device preset, whether the GPU is one the preset describes) for a CUDA device name.

    A GPU no preset describes gets the GPU preset closest to its memory (``a100-80gb`` when the
    memory is unknown)."""
    n = name.lower()
    if "h200" in n:  # H200, GH200
        return "h200", True
    if "h100" in n or "h800" in n:
        return "h100", True
    if "a100" in n or "a800" in n:
        return ("a100-40gb" if memory_bytes is not None and memory_bytes < 60 * GiB else "a100-80gb"), True
    if not memory_bytes:
        return "a100-80gb", False
    return min(GPU_PRESETS, key=lambda p: abs(math.log(DEVICE_PRESETS[p].memory_bytes / memory_bytes))), False


def resolve_device(device: str = "auto", *, hardware: Hardware | None = None) -> str:
    """A device preset name: ``device`` itself (validated), or for ``"auto"`` this machine's.

    ``hardware`` (default `detect_hardware`) is what the machine has. An unknown GPU gets the
    closest preset by memory and a `DeviceMismatchWarning` saying which, and how to measure it."""
    if device != "auto":
        device_preset(device)  # ValueError listing the presets
        return device
    hw = detect_hardware() if hardware is None else hardware
    if hw.gpu is None:
        return "cpu"
    preset, known = gpu_preset(hw.gpu, hw.memory_bytes)
    if not known:
        mem = f"{hw.memory_bytes / GiB:.0f} GiB" if hw.memory_bytes else "memory unknown"
        _warn_once(("unknown-gpu", hw.gpu), f"no device preset describes this GPU ({hw.gpu!r}, {mem}): "
                   f"device='auto' plans with {preset!r}, the preset closest in memory; {PROFILE_HINT}")
    return preset


def check_device(device: str, *, hardware: Hardware | None = None) -> None:
    """Warn (`DeviceMismatchWarning`, once per process per case) when ``device``, an explicit GPU
    preset, is not this machine's: no CUDA GPU, or a GPU another preset describes. The ``cpu``
    preset and GPUs no preset describes are not checked."""
    if device not in GPU_PRESETS:
        return
    hw = detect_hardware() if hardware is None else hardware
    if hw.gpu is None:
        _warn_once(("mismatch", device, None), f"device={device!r} plans for that GPU, but this machine has no "
                   "CUDA GPU (torch.cuda.is_available() is False); pass device='auto' to plan for this "
                   "machine, or plan for other hardware offline (dynabatch plan --device)")
        return
    preset, known = gpu_preset(hw.gpu, hw.memory_bytes)
    if known and preset != device:
        _warn_once(("mismatch", device, hw.gpu), f"device={device!r} but this machine's GPU is {hw.gpu!r} "
                   f"(preset {preset!r}); pass device='auto' (or {preset!r}) to plan for it")


def loader_cost_model(cost_model=None, device: str = "auto", num_stages: int = 1, family: str | None = None,
                      *, hardware: Hardware | None = None) -> CostModel:
    """The `DataLoader`'s cost model (see the module docstring): a `CostModel` as given (its own
    device; ``device`` plays no part), else a model preset on the resolved ``device``."""
    from .core.cost.model import CostModel  # numba: imported by what plans, not by the command line's defaults

    if isinstance(cost_model, CostModel):
        return cost_model
    if cost_model is not None and not isinstance(cost_model, str):
        raise TypeError(f"cost_model must be a preset name or a CostModel, got {type(cost_model).__name__}")
    if device == "auto":
        hw = detect_hardware() if hardware is None else hardware
        name = resolve_device("auto", hardware=hw)
        if name == "cpu" and cost_model in MODEL_PRESETS:
            name = OFFLINE_DEFAULT_DEVICE
            _warn_once(("gpu-model-on-cpu", cost_model), f"cost_model={cost_model!r} is a GPU-scale model and this "
                       f"machine has no CUDA GPU: device='auto' plans it for {name!r}. To plan for this CPU "
                       "pass device='cpu' (and cost_model='gpt-tiny' / 't5-tiny', or none); to plan for a GPU "
                       f"without this warning pass cost_model=CostModel.preset({cost_model!r}, 'a100-80gb')")
    else:
        name = resolve_device(device)
        check_device(name, hardware=hardware)
    if cost_model is None:
        cost_model = CPU_DEFAULT_MODEL.get(family or "decoder", "gpt-tiny") if name == "cpu" else "gpt"
    return CostModel.preset(cost_model, name, num_stages=num_stages)


def _warn_once(key, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    frame, level = sys._getframe(0), 1  # point the warning at the first caller outside dynabatch
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeviceMismatchWarning, stacklevel=level)


__all__ = ["CPU_DEFAULT_MODEL", "DeviceMismatchWarning", "Hardware", "check_device", "detect_hardware", "gpu_preset",
           "loader_cost_model", "resolve_device"]
