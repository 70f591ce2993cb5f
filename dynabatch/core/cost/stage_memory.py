"""`StageMemory`: how per-stage activation recomputation changes each stage's held bytes, a part of
the cost model (`CostModel.stage_memory_model`) that `dynabatch.core.plan.recompute` prices policies
with. Bytes per feature unit of `dynabatch.core.kernels.cost.FEATURES`, one row per stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels.cost import NUM_FEATURES
from .stages import StageLayout


@dataclass(frozen=True)
class StageMemory:
    """How recomputation changes each stage's held activation bytes (bytes per feature unit of
    `dynabatch.core.kernels.cost.FEATURES`, rows per stage).

    ``layers`` ``[S]``: recomputable layers per stage; ``input_coef`` ``[S, F]``: bytes one recomputed
    layer keeps (its input); ``fixed_coef`` ``[S, F]``: bytes recomputation never frees (embedding,
    head, the activation received from the previous stage); ``layer_coef`` ``[S, F]``: bytes the
    recomputable layers keep without recomputation, or None for "the cost model's stage memory less
    ``fixed_coef``"."""

    layers: tuple[float, ...]
    input_coef: np.ndarray
    fixed_coef: np.ndarray
    layer_coef: np.ndarray | None = None
    source: str = "analytic"

    def __post_init__(self) -> None:
        S = len(self.layers)
        object.__setattr__(self, "layers", tuple(float(x) for x in self.layers))
        if S < 1 or min(self.layers) < 0:
            raise ValueError(f"StageMemory.layers needs >= 1 non-negative counts, got {self.layers}")
        for name in ("input_coef", "fixed_coef", "layer_coef"):
            v = getattr(self, name)
            if v is None:
                continue
            v = np.asarray(v, np.float64)
            if v.shape != (S, NUM_FEATURES) or not np.all(np.isfinite(v)):
                raise ValueError(f"StageMemory.{name} must be finite [{S}, {NUM_FEATURES}], got {v.shape}")
            object.__setattr__(self, name, v)

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    def max_layers(self) -> np.ndarray:
        """The largest useful count per stage (int ``[S]``): every recomputable layer."""
        return np.ceil(np.asarray(self.layers) - 1e-9).astype(np.int64)

    @classmethod
    def analytic(cls, cost, num_stages: int) -> "StageMemory":
        """From the cost model's layout (uniform: the config's per-stage counts): every activation byte
        belongs to a layer; a recomputed main/decoder layer keeps ``dtype_bytes * hidden`` bytes per
        token, a vision layer ``dtype_bytes * vision_hidden`` per vision token."""
        m = cost.model
        if m.recompute:
            raise ValueError(f"the cost model of {m.name!r} already prices full recomputation "
                             "(ModelConfig.recompute=True); per-stage recompute starts from a model without it: "
                             "plan with cost.with_model(recompute=False)")
        S = int(num_stages)
        layout = cost.layout if cost.layout is not None else StageLayout.uniform(m, S)
        if layout.num_stages != S:
            raise ValueError(f"the cost model's layout has {layout.num_stages} stages, not {S}")
        main, dec, vis = (np.asarray(x, np.float64) for x in (layout.main_layers, layout.decoder_layers,
                                                              layout.vision_layers))
        n = main + dec + vis
        inp = np.zeros((S, NUM_FEATURES))
        share = np.where(n > 0, 1.0 / np.where(n > 0, n, 1.0), 0.0)
        inp[:, 0] = main * share * m.dtype_bytes * m.hidden
        inp[:, 2] = dec * share * m.dtype_bytes * m.hidden
        inp[:, 5] = vis * share * m.dtype_bytes * m.vision_hidden
        return cls(tuple(n), inp, np.zeros((S, NUM_FEATURES)), None, "analytic")

    def to_dict(self) -> dict:
        d = {"layers": list(self.layers), "input_coef": self.input_coef.tolist(),
             "fixed_coef": self.fixed_coef.tolist(), "source": self.source}
        if self.layer_coef is not None:
            d["layer_coef"] = self.layer_coef.tolist()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "StageMemory":
        return cls(tuple(d["layers"]), np.asarray(d["input_coef"]), np.asarray(d["fixed_coef"]),
                   None if d.get("layer_coef") is None else np.asarray(d["layer_coef"]), d.get("source", "custom"))


def stage_memory_of(cost, num_stages: int) -> StageMemory:
    """The cost model's `StageMemory` (``cost.stage_memory_model`` when set, else `StageMemory.analytic`)."""
    sm = getattr(cost, "stage_memory_model", None)
    if sm is not None:
        if sm.num_stages != int(num_stages):
            raise ValueError(f"the cost model's stage memory is for {sm.num_stages} stages, not {num_stages}")
        return sm
    return StageMemory.analytic(cost, num_stages)
