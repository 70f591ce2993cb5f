"""Per-stage costs: where the layers sit, and what each micro-batch costs on every pipeline stage.

A `CostModel` prices one micro-batch on "one stage", which is exact only when every stage holds
the same share of every layer kind (the ``uniform`` layout the presets describe: 48/S LLM and 45/S
ViT layers on each stage of the ``vlm`` preset). A `StageLayout` says how many main-stack (LLM /
encoder / decoder-only), decoder and vision layers each stage holds; ``contiguous`` is the layout
pipelines run (vision first, then the main stack, then the decoder), split so that the stages are
balanced for a representative micro-batch (the analytic, torch-free counterpart of
`dynabatch.pipeline.models.partition.balanced_partition`).

`stage_scale` turns a layout into multipliers ``scale[s, j]`` of the cost coefficients, so that
micro-batch ``j`` with features ``phi[j]`` costs ``phi[j] @ (time_coef * scale[s])`` seconds and
``phi[j] @ (mem_coef * mem_scale[s])`` bytes on stage ``s``. The analytic coefficients are affine in
the layer counts, so the multipliers are exact for the analytic model: vision features are priced
only on stages holding vision layers, main features only where main layers are, the fixed
per-micro-batch overhead on every stage. Summed over the stages the time multipliers give ``S``:
the same total work as the uniform layout, redistributed. A refit or profiled coefficient is
scaled by the same analytic ratios. The uniform layout's multipliers are exactly 1.

Per-stage coefficients: a `FeedbackLoop(stage_reduce="per_stage")` refit fits every stage's own row of
time coefficients, ``stage_time_coef`` ``[S, NUM_FEATURES]`` (seconds per feature unit on stage ``s``);
once set, `stage_times` uses them instead of ``time_coef * scale[s]`` and ``time_coef`` is their mean
over the stages (the average stage: with the layout multipliers, which sum to ``S``, exactly the
``time_coef`` they would scale). They live in the same buffer as ``time_coef`` (one version counter,
shared memory after `CostModel.share_memory`, at most `MAX_STAGE_ROWS` stages: the store is
`dynabatch.core.cost.coefficients`). A uniform-layout
model whose fitted rows differ becomes stage-aware (its `layout` reads as the uniform `StageLayout`),
so the planner takes its per-stage path; a model never refit per stage plans exactly as before.
Assigning ``time_coef`` (a scalar refit) or changing the layout drops the rows.

The planner's per-stage path (`plan_microbatches` when ``cost.layout`` is not uniform) uses the
helpers here: `assign_ranks_stages` balances each rank's per-stage load vector and
`order_step_stages` orders each rank by simulating ``[S, k]`` stage times; `evaluate_plan`
re-prices any plan under another cost model (say, a plan made stage-blind, under the real layout).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import numpy as np

from ..kernels.cost import Q_PAD
from .analytic import analytic_coefficients
from .coefficients import MAX_STAGE_ROWS
from .presets import ModelConfig

#: The layouts `CostModel.preset` / ``dynabatch bench plan --layout`` name.
LAYOUTS = ("uniform", "contiguous")
# feature columns (see `dynabatch.core.kernels.cost.FEATURES`) of each layer kind
_MAIN, _DEC, _VIS = (0, 1, Q_PAD), (2, 3, 4), (5, 6, 8)


@dataclass(frozen=True)
class StageLayout:
    """Layers held by each pipeline stage (counts may be fractional, as `ModelConfig`'s are).

    ``main_layers``: main-stack layers (decoder-only model, T5 encoder, the LLM of a VLM);
    ``decoder_layers``: T5 decoder layers; ``vision_layers``: ViT layers. ``embedding`` /
    ``lm_head`` mark the stages holding the token embedding and the output head (the cost model
    has no vocabulary term, so they carry no cost today; recorded for the runner)."""

    main_layers: tuple[float, ...]
    decoder_layers: tuple[float, ...]
    vision_layers: tuple[float, ...]
    embedding: tuple[bool, ...] = ()
    lm_head: tuple[bool, ...] = ()
    name: str = "custom"

    def __post_init__(self) -> None:
        S = len(self.main_layers)
        for f in ("main_layers", "decoder_layers", "vision_layers"):
            v = tuple(float(x) for x in getattr(self, f))
            if len(v) != S or min(v, default=0.0) < 0:
                raise ValueError(f"StageLayout.{f} needs {S} non-negative layer counts, got {v}")
            object.__setattr__(self, f, v)
        for f, default in (("embedding", 0), ("lm_head", S - 1)):
            v = tuple(bool(x) for x in getattr(self, f)) or tuple(s == default for s in range(S))
            if len(v) != S:
                raise ValueError(f"StageLayout.{f} needs {S} entries")
            object.__setattr__(self, f, v)
        if S < 1:
            raise ValueError("a StageLayout needs at least one stage")

    @property
    def num_stages(self) -> int:
        return len(self.main_layers)

    def is_uniform_for(self, config: ModelConfig) -> bool:
        """Whether every stage holds exactly ``config``'s per-stage layer counts."""
        return (all(x == config.layers for x in self.main_layers)
                and all(x == config.decoder_layers for x in self.decoder_layers)
                and all(x == config.vision_layers for x in self.vision_layers))

    @classmethod
    def uniform(cls, config: ModelConfig, num_stages: int) -> "StageLayout":
        """Today's even spread: every stage holds ``config``'s per-stage counts."""
        S = int(num_stages)
        return cls((config.layers,) * S, (config.decoder_layers,) * S, (config.vision_layers,) * S, name="uniform")

    @classmethod
    def contiguous(cls, config: ModelConfig, num_stages: int, phi=None, *, device=None) -> "StageLayout":
        """Whole layers in model order (vision, main stack, decoder) cut into ``num_stages`` contiguous
        stages minimizing the slowest stage's time on the representative micro-batch ``phi``
        (features; default `representative_features`). ``device`` (a `DeviceProfile`, default
        ``a100-80gb``) prices the layers; only the ratios between layer kinds matter."""
        from .presets import device_preset

        S = int(num_stages)
        dev = device_preset("a100-80gb") if device is None else device
        c0, per_kind = _affine_coefficients(config, dev)[0]
        phi = representative_features(config) if phi is None else np.asarray(phi, np.float64).ravel()
        kinds = [(k, int(round(n * S))) for k, n in ((2, config.vision_layers), (0, config.layers),
                                                      (1, config.decoder_layers))]
        seq = np.concatenate([np.full(n, float(phi @ per_kind[k])) for k, n in kinds])
        kind_of = np.concatenate([np.full(n, k) for k, n in kinds]).astype(np.int64)
        if len(seq) < S:
            raise ValueError(f"cannot split {len(seq)} layers into {S} stages")
        bounds = _min_max_split(seq, S)
        counts = np.zeros((3, S))
        for s in range(S):
            counts[:, s] = np.bincount(kind_of[bounds[s]:bounds[s + 1]], minlength=3)
        return cls(tuple(counts[0]), tuple(counts[1]), tuple(counts[2]), name="contiguous")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StageLayout":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def representative_features(config: ModelConfig) -> np.ndarray:
    """Features of the micro-batch a contiguous layout is balanced for: 8 samples of 6 image tiles
    and 256 text tokens each (vision-language; OmniBal's InternVL samples average about 6 tiles),
    or 8 samples of 1024 tokens (+ 256 decoder tokens for encoder-decoder models), packed."""
    from ..kernels.cost import NUM_FEATURES

    phi = np.zeros(NUM_FEATURES)
    tiles = 6 if config.kind == "vision_language" else 0
    main = 1024 if tiles == 0 else tiles * config.tile_tokens + 256
    dec = 256 if config.kind == "encoder_decoder" else 0
    v = tiles * config.tile_patches
    phi[:] = [8 * main, 8 * main**2, 8 * dec, 8 * dec**2, 8 * dec * main, 8 * v, 8 * v * config.tile_patches, 1,
              float(tiles > 0), 0.0]  # packed: no padding
    return phi


def _min_max_split(w: np.ndarray, S: int) -> list[int]:
    """Boundaries of the contiguous split of weights ``w`` into ``S`` non-empty parts with the smallest
    largest part (linear-partition DP; ties: the earliest boundaries)."""
    n = len(w)
    pre = np.concatenate(([0.0], np.cumsum(w)))
    best = np.full((S + 1, n + 1), np.inf)
    arg = np.zeros((S + 1, n + 1), np.int64)
    best[0, 0] = 0.0
    for k in range(1, S + 1):
        for i in range(k, n - (S - k) + 1):
            j = np.arange(k - 1, i)
            v = np.maximum(best[k - 1, j], pre[i] - pre[j])
            q = int(np.argmin(v))
            best[k, i], arg[k, i] = v[q], j[q]
    bounds = [n]
    for k in range(S, 0, -1):
        bounds.append(int(arg[k, bounds[-1]]))
    return bounds[::-1]


def _affine_coefficients(config: ModelConfig, device):
    """The analytic (time, memory) coefficients as ``c0 + main * c_main + dec * c_dec + vis * c_vis``
    in the per-stage layer counts: for each of time and memory ``(c0, [c_main, c_dec, c_vis])``.
    Exact (the analytic model is affine in the layer counts); found by doubling each count."""
    base = analytic_coefficients(config, device)
    counts = (config.layers, config.decoder_layers, config.vision_layers)
    fields = ("layers", "decoder_layers", "vision_layers")
    out = []
    for w in range(2):  # 0 time, 1 memory
        slopes = []
        for f, n in zip(fields, counts):
            if n > 0:
                hi = analytic_coefficients(dataclasses.replace(config, **{f: 2 * n}), device)[w]
                slopes.append((hi - base[w]) / n)
            else:
                slopes.append(np.zeros_like(base[w]))
        c0 = base[w] - sum(n * sl for n, sl in zip(counts, slopes))
        out.append((c0, np.array(slopes)))
    return out


def stage_scale(config: ModelConfig, layout: StageLayout, device=None) -> tuple[np.ndarray, np.ndarray]:
    """(time, memory) multipliers, float64 ``[S, NUM_FEATURES]`` each, of the cost coefficients on
    every stage of ``layout`` (see the module docstring); all ones for the uniform layout."""
    from .presets import device_preset

    S = layout.num_stages
    if layout.is_uniform_for(config):
        ones = np.ones((S, len(analytic_coefficients(config, device_preset("a100-80gb"))[0])))
        return ones, ones.copy()
    dev = device_preset("a100-80gb") if device is None else device
    base = analytic_coefficients(config, dev)
    counts = np.array([layout.main_layers, layout.decoder_layers, layout.vision_layers])  # [3, S]
    scales = []
    for w, (c0, slopes) in enumerate(_affine_coefficients(config, dev)):
        c = c0[None, :] + counts.T @ slopes  # [S, F]
        for k, cols in enumerate((_MAIN, _DEC, _VIS)):  # no layer of a kind: none of its cost
            c[np.ix_(counts[k] == 0, cols)] = 0.0
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.where(base[w] != 0, c / np.where(base[w] != 0, base[w], 1.0), 1.0)
        scales.append(np.maximum(sc, 0.0))
    return scales[0], scales[1]


# -- the CostModel side (a base class of `CostModel`) --------------------------------------------------
class StageCosts:
    """Per-stage costs of a `CostModel`: its `layout` (default uniform), its optional per-stage time
    coefficients (`stage_time_coef`, rows of its `coefficients.Coefficients` store) and the ``[S, M]`` matrices."""

    _layout = None

    def _stage_rows(self) -> np.ndarray | None:
        """The per-stage rows ``[S, F]`` (a live view) or None."""
        return self.coefficients.rows()

    @property
    def stage_time_coef(self) -> np.ndarray | None:
        """Per-stage time coefficients ``[S, NUM_FEATURES]`` fitted by a per-stage `FeedbackLoop` refit
        (a live view, shared after `share_memory`), or None when the model has none (then stage ``s``
        costs ``time_coef * stage_scale_rows()[s]``)."""
        return self._stage_rows()

    def stage_time_rows(self, num_stages: int | None = None) -> np.ndarray:
        """The time coefficients each stage is priced with, ``[S, NUM_FEATURES]`` (a copy): the fitted
        `stage_time_coef` when set, else ``time_coef`` times the layout's multipliers."""
        rows = self._stage_rows()
        S = self._stages(num_stages)
        if rows is not None:
            return rows.copy()
        coef = self.coefficients.coef
        scale = np.ones((S, len(coef))) if self._layout is None else self._stage_scale[0]
        return coef[None, :] * scale

    def set_stage_time_coef(self, rows) -> None:
        """Write per-stage time coefficients ``[S, NUM_FEATURES]`` (non-negative) in place, and their mean
        over the stages as ``time_coef``; `version` + 1 (one write: readers see both or neither)."""
        rows = np.asarray(rows, np.float64)
        S = self._stages(len(rows)) if self._layout is not None else len(rows)
        F = len(self.coefficients.coef)
        if rows.shape != (S, F) or not 1 <= S <= MAX_STAGE_ROWS:
            raise ValueError(f"per-stage coefficients must have shape [S <= {MAX_STAGE_ROWS}, {F}]")
        if not np.all(np.isfinite(rows)) or rows.min() < 0:
            raise ValueError("per-stage coefficients must be finite and non-negative")
        self.coefficients.write_rows(rows)

    @property
    def layout(self) -> StageLayout | None:
        """The `StageLayout` costs are split by; None: uniform (every stage costs `time`). A uniform
        model with differing fitted `stage_time_coef` reads as the uniform layout of its stages."""
        if self._layout is None and self._rows_differ():
            return StageLayout.uniform(self.model, len(self._stage_rows()))
        return self._layout

    def _rows_differ(self) -> bool:
        rows = self._stage_rows()
        return rows is not None and bool(np.any(rows != rows[:1]))

    @property
    def stage_aware(self) -> bool:
        """Whether the planner takes its per-stage path: the layout is not uniform, or fitted per-stage
        coefficients differ between the stages."""
        return self._layout is not None or self._rows_differ()

    def set_layout(self, layout) -> "StageCosts":
        """Use ``layout`` (a `StageLayout`, ``"uniform"``, ``"contiguous"`` or None) in place; returns self.
        ``num_stages`` of a named layout is read from the model preset's per-stage counts."""
        if isinstance(layout, str):
            if layout not in LAYOUTS:
                raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
            if layout == "uniform":
                layout = None
            else:
                S = getattr(self, "_num_stages", None)
                if S is None:
                    raise ValueError("a named layout needs the stage count: build with CostModel.preset(..., layout=)")
                layout = StageLayout.contiguous(self.model, S, device=self.device)
        if layout is not None and layout.is_uniform_for(self.model):
            layout = None
        if self._stage_rows() is not None and layout != self._layout:
            # fitted rows belong to the layout they were fitted under; never drop them from a shared
            # store another holder (a copy, a forked process) still plans with
            if self.coefficients.is_shared:
                self.coefficients = self.coefficients.private()
            self.coefficients.drop_rows()
        self._layout = layout
        self._stage_scale = None if layout is None else stage_scale(self.model, layout, self.device)
        return self

    def with_layout(self, layout) -> "StageCosts":
        """A copy of this model with another layout (coefficients shared as `copy.copy` shares them)."""
        return copy.copy(self).set_layout(layout)

    def _stages(self, num_stages) -> int:
        rows = self._stage_rows()
        if rows is not None and self._layout is None:
            if num_stages is not None and int(num_stages) != len(rows):
                raise ValueError(f"the cost model's per-stage coefficients have {len(rows)} stages, not {num_stages}")
            return len(rows)
        if self._layout is not None:
            if num_stages is not None and int(num_stages) != self._layout.num_stages:
                raise ValueError(f"the cost model's layout has {self._layout.num_stages} stages, not {num_stages}")
            return self._layout.num_stages
        S = num_stages if num_stages is not None else getattr(self, "_num_stages", None)
        if S is None:
            raise ValueError("stage_times/stage_memory of a uniform cost model need num_stages=")
        return int(S)

    def stage_times(self, phi, num_stages: int | None = None) -> np.ndarray:
        """Seconds of forward+backward of each micro-batch on each stage, float64 ``[S, M]`` (uniform
        layout: `time` on every stage; ``num_stages`` defaults to the layout's or the preset's)."""
        phi = np.atleast_2d(phi)
        S = self._stages(num_stages)
        rows = self._stage_rows()
        if rows is not None:
            return (phi @ rows.T).T
        if self._layout is None:
            return np.repeat(self.time(phi)[None, :], S, axis=0)
        return (phi @ (self.time_coef[None, :] * self._stage_scale[0]).T).T

    def stage_memory(self, phi, num_stages: int | None = None) -> np.ndarray:
        """Peak activation bytes of each micro-batch on each stage, float64 ``[S, M]``."""
        phi = np.atleast_2d(phi)
        S = self._stages(num_stages)
        if self._layout is None:
            return np.repeat(self.memory(phi)[None, :], S, axis=0)
        return (phi @ (self.mem_coef[None, :] * self._stage_scale[1]).T).T

    def stage_scale_rows(self) -> np.ndarray:
        """The time multipliers ``[S, NUM_FEATURES]`` of the layout (`stage_scale`; uniform: ones); with
        fitted `stage_time_coef`, their ratio to ``time_coef`` (1 where ``time_coef`` is 0: every row is
        0 there), so ``time_coef * stage_scale_rows()`` is each stage's row either way."""
        rows = self._stage_rows()
        if rows is not None:
            c = self.coefficients.coef[None, :]
            return np.where(c > 0, rows / np.where(c > 0, c, 1.0), 1.0)
        if self._layout is None:
            return np.ones((self._stages(None), len(self.time_coef)))
        return self._stage_scale[0]

    def planning_mem_coef(self) -> np.ndarray:
        """Memory coefficients bounding every stage's memory (the largest per feature): what the DP's
        memory check uses on the per-stage path (``phi >= 0``, so ``phi @ max >= max_s phi @ c_s``)."""
        if self._layout is None:
            return self.mem_coef
        return (self.mem_coef[None, :] * self._stage_scale[1]).max(axis=0)
