"""The cost model's file format: a `CostModel` as a JSON object (``format: dynabatch.cost_model``).

Keys: ``version`` (1), ``model`` and ``device`` (the `ModelConfig` and `DeviceProfile` fields), ``time_coef``
and ``mem_coef`` (one entry per feature of `dynabatch.core.kernels.cost.FEATURES`; files written before
``q_pad`` existed hold one fewer, read with it priced at 0), ``pad_multiple``, ``forgetting``,
``prior_strength``, ``packed_attention`` (absent in older files: ``varlen``), ``table`` (a `ProfiledTable`
or null), and when set: ``layout`` (a `StageLayout`), ``stage_time_coef`` (fitted per-stage rows;
``time_coef`` beside them is their mean), ``stage_memory_model`` (a `StageMemory`). ``dynabatch profile``
files add per-layer costs beside these (`dynabatch.pipeline.measure.profile.save_profile`).
`CostModel.to_dict`/`from_dict`/`save`/`load` are these functions.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..kernels.cost import NUM_FEATURES
from .presets import DeviceProfile, ModelConfig
from .profiled import ProfiledTable
from .stage_memory import StageMemory
from .stages import StageLayout

#: The ``format`` key of a cost model file.
FORMAT = "dynabatch.cost_model"


def coefficients_of(coef) -> list:
    """Coefficients read from a file: files written before ``q_pad`` existed hold one fewer, priced at 0."""
    coef = list(coef)
    return coef + [0.0] if len(coef) == NUM_FEATURES - 1 else coef


def cost_model_dict(cost) -> dict:
    """The JSON-serializable description of ``cost`` (a `CostModel`): configs, coefficients, optional table."""
    d = {
        "format": FORMAT, "version": 1,
        "model": asdict(cost.model), "device": asdict(cost.device),
        "time_coef": cost.time_coef.tolist(), "mem_coef": cost.mem_coef.tolist(),
        "pad_multiple": cost.pad_multiple, "forgetting": cost.forgetting,
        "prior_strength": cost.prior_strength, "packed_attention": cost.packed_attention, "table": None,
        **({"layout": cost.layout.to_dict()} if cost.layout is not None else {}),
        **({"stage_time_coef": cost.stage_time_coef.tolist()} if cost.stage_time_coef is not None else {}),
        **({"stage_memory_model": cost.stage_memory_model.to_dict()} if cost.stage_memory_model is not None
           else {}),
    }
    if cost.table is not None:
        d["table"] = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in asdict(cost.table).items()}
    return d


def cost_model_from_dict(cls, d: dict):
    """The `CostModel` (of class ``cls``) that `cost_model_dict` described as ``d``."""
    if d.get("format") != FORMAT:
        raise ValueError(f"not a dynabatch cost model (missing format: {FORMAT})")
    table = ProfiledTable(**d["table"]) if d.get("table") else None
    cm = cls(ModelConfig(**d["model"]), DeviceProfile(**d["device"]), time_coef=coefficients_of(d["time_coef"]),
             mem_coef=coefficients_of(d["mem_coef"]), table=table, pad_multiple=d["pad_multiple"],
             forgetting=d["forgetting"], prior_strength=d["prior_strength"],
             packed_attention=d.get("packed_attention", "varlen")).set_layout(
                 StageLayout.from_dict(d["layout"]) if d.get("layout") else None)
    if d.get("stage_time_coef"):  # fitted per-stage rows (time_coef, saved beside them, is their mean)
        cm.coefficients.restore(cm.time_coef.copy(), cm.version, [coefficients_of(row) for row in d["stage_time_coef"]])
    if d.get("stage_memory_model"):
        cm.stage_memory_model = StageMemory.from_dict(d["stage_memory_model"])
    return cm


def save_cost_model(cost, path) -> None:
    """Write ``cost`` as JSON to ``path``."""
    Path(path).write_text(json.dumps(cost_model_dict(cost), indent=1))


def load_cost_model(cls, path):
    """Read a cost model file written by `save_cost_model` as a ``cls``; a file that is not one raises
    ValueError naming it."""
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(d, dict):
            raise TypeError(f"expected a JSON object, found {type(d).__name__}")
        return cost_model_from_dict(cls, d)
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSON and Unicode errors are ValueErrors
        raise ValueError(f"{path}: not a valid dynabatch cost model file ({e})") from e
