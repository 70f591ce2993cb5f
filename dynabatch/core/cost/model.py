"""Cost model: time (seconds) and peak activation memory (bytes) of one micro-batch's
forward+backward on one pipeline stage.

Every micro-batch is reduced to a feature vector ``phi`` (see ``FEATURES``) and its cost is
``time = time_coef @ phi`` and ``memory = mem_coef @ phi``. The features are chosen so that the
analytic model is exactly linear in them:

* ``n_main``/``q_main``: tokens and sum of squared sequence lengths of the main stack (decoder-only
  model, T5 encoder, or the LLM of a vision-language model). Padded collation counts
  ``rows * L`` and ``rows * L**2``; packed (varlen) collation counts ``sum(s)`` and ``sum(s**2)``,
  because a varlen attention kernel is quadratic per sample only; ``packed_attention="dense"`` (SDPA,
  eager: the whole row attended with a mask) prices it as one padded row of ``sum(s)`` tokens with a mask.
* ``n_dec``/``q_dec``/``x_dec``: decoder tokens, decoder self-attention and cross-attention
  (``target * input``) of an encoder-decoder model.
* ``n_vis``/``q_vis``: ViT tokens (tiles * patches per tile) and their attention.
* ``one``: a constant per micro-batch: launch overhead plus reading the stage's weights once per
  pass (forward, input-gradient, weight-gradient). This fixed cost is what penalizes small
  micro-batches: the effective efficiency of a micro-batch of ``n`` tokens is
  ``eff_max * n / (n + n_half)`` with ``n_half = fixed / per-token time``.
* ``has_vis``: the ViT's fixed cost, paid only by micro-batches that hold at least one tile.
* ``q_pad``: ``rows * L**2`` of a padded micro-batch in which some row is shorter than ``L`` (0 for full
  rows and packed micro-batches). Such a micro-batch needs a padding mask, and an attention kernel
  given a mask cannot take its causal fast path: Hugging Face models call SDPA with ``is_causal``
  and no ``[rows, 1, L, L]`` mask only when no row is padded. The analytic models price it at 0;
  a profile measures it (`dynabatch.pipeline.profile_model`) and the feedback loop refits it.

Three sources of truth sit behind this one interface: the analytic model built from a
`ModelConfig` and a `DeviceProfile`; a `ProfiledTable` of measured padded shapes, interpolated
(shapes outside the grid are infeasible unless ``extrapolate=True``); and a robust refit of the
coefficients from measured step times, by `dynabatch.core.plan.feedback.FeedbackLoop` (the one refit path;
the math is in `dynabatch.core.cost.fit`). ``version`` counts the coefficient changes, and
`CostModel.share_memory` lets forked processes holding a copy of the model see every refit.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

# The feature layout and the numba cost kernels live in `kernels.cost` (beside their plain-Python
# references), the model/device descriptions and their presets in `presets`; their names are
# re-exported so ``from dynabatch.core.cost.model import X`` keeps working for every X it offered.
from ..kernels.cost import FEATURES, NUM_FEATURES, Q_PAD
from .profiled import ProfiledTable
from .presets import (DEVICE_PRESETS, GPU_PRESETS, KIND_CODE, KINDS, MODEL_PRESETS, TINY_MODEL_PRESETS,  # noqa: F401
                      DeviceProfile, GiB, ModelConfig, device_preset, model_preset)
from .analytic import analytic_coefficients
from . import fileformat, legacy_refit
from .coefficients import Coefficients
from .features import packed_rows
from .fit import MAX_OBSERVATIONS, fit_relative  # noqa: F401  (the fitting math lives in fit.py)
from ..shapes import Shapes
from .stages import LAYOUTS, StageCosts, StageLayout  # noqa: F401


#: `CostModel.packed_attention`: a varlen kernel (flash-attention, flex with a block mask) is quadratic per
#: sample; SDPA and eager given a packed row and a mask compute the whole row (`packed_features`).
PACKED_ATTENTION = ("varlen", "dense")


class CostModel(StageCosts):
    """Time (seconds) and activation memory (bytes) of one micro-batch on one pipeline stage.

    Build one with `CostModel.preset` (``"gpt"``, ``"t5"``, ``"vlm"`` on a device preset), with
    `CostModel.analytic` from a `ModelConfig` and `DeviceProfile`, or with `CostModel.profiled`
    from a measured `ProfiledTable`. All cost methods are vectorized over micro-batches.

    Keywords: ``time_coef``/``mem_coef`` (seconds / bytes per feature unit, `FEATURES`; default the analytic
    ones), ``table`` (a `ProfiledTable` deciding padded costs), ``pad_multiple`` (tokens padded lengths round
    up to), ``forgetting`` and ``prior_strength`` (the deprecated `observe`/`refit`'s per-call decay and
    ridge), ``packed_attention`` (`PACKED_ATTENTION`: how a packed row is attended).

    Jobs: pricing is here; the coefficients, their version and sharing are its `coefficients` store
    (`dynabatch.core.cost.coefficients`), the file format `dynabatch.core.cost.fileformat`, the deprecated
    refit `dynabatch.core.cost.legacy_refit`.
    """

    stage_memory_model = None  # see __init__ (a class default, for models unpickled from older releases)
    packed_attention = "varlen"  # likewise

    def __init__(self, model: ModelConfig, device: DeviceProfile, *, time_coef=None, mem_coef=None,
                 table: ProfiledTable | None = None, pad_multiple: int = 8, forgetting: float = 0.98,
                 prior_strength: float = 1e-3, packed_attention: str = "varlen"):
        if packed_attention not in PACKED_ATTENTION:
            raise ValueError(f"packed_attention={packed_attention!r}: expected one of {PACKED_ATTENTION}")
        self.packed_attention = packed_attention  # how a packed row is attended (`packed_features`)
        t0, m0 = analytic_coefficients(model, device)
        self.model = model
        self.device = device
        self.prior_time_coef = t0
        tc = t0 if time_coef is None else np.asarray(time_coef, np.float64)
        self.mem_coef = m0.copy() if mem_coef is None else np.asarray(mem_coef, np.float64).copy()
        if tc.shape != (NUM_FEATURES,) or self.mem_coef.shape != (NUM_FEATURES,):
            raise ValueError(f"cost coefficients must have {NUM_FEATURES} entries ({', '.join(FEATURES)})")
        #: The `Coefficients` store: ``time_coef``, its version and per-stage rows (shared after `share_memory`).
        self.coefficients = Coefficients(tc)
        self.table = table
        self.pad_multiple = int(pad_multiple)
        self.forgetting = float(forgetting)
        self.prior_strength = float(prior_strength)
        #: The `FeedbackLoop` behind the deprecated `observe`/`refit` (`legacy_refit`), or None.
        self.legacy_loop = None
        #: Optional `dynabatch.core.cost.stage_memory.StageMemory`: how recomputation changes each stage's held
        #: bytes (measured by `dynabatch.pipeline.measured_stage_memory`); None: derived from the layout.
        self.stage_memory_model = None

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def preset(cls, model: str = "gpt", device: str = "a100-80gb", *, num_stages: int = 4, layout="uniform",
               pad_multiple: int = 8, forgetting: float = 0.98, prior_strength: float = 1e-3,
               packed_attention: str = "varlen") -> "CostModel":
        """Analytic cost model of a named model preset on a named device preset.

        The default device stays ``a100-80gb`` on every machine: the same arguments give the same
        costs (and plans) wherever they run, as offline planning needs. This machine's device is
        ``dynabatch.devices.resolve_device()`` (torch, so outside this core), which the
        DataLoader's default ``device="auto"`` uses. ``layout``: where layers sit (`dynabatch.core.cost.stages`);
        the other keywords as in `CostModel`."""
        cm = cls(model_preset(model, num_stages), device_preset(device), pad_multiple=pad_multiple,
                 forgetting=forgetting, prior_strength=prior_strength, packed_attention=packed_attention)
        cm._num_stages = int(num_stages)
        return cm.set_layout(layout)

    @classmethod
    def analytic(cls, model: ModelConfig, device: DeviceProfile, *, time_coef=None, mem_coef=None,
                 pad_multiple: int = 8, forgetting: float = 0.98, prior_strength: float = 1e-3,
                 packed_attention: str = "varlen") -> "CostModel":
        """Analytic cost model from explicit configs (the keywords as in `CostModel`)."""
        return cls(model, device, time_coef=time_coef, mem_coef=mem_coef, pad_multiple=pad_multiple,
                   forgetting=forgetting, prior_strength=prior_strength, packed_attention=packed_attention)

    @classmethod
    def profiled(cls, table: ProfiledTable, model: ModelConfig, device: DeviceProfile, *, pad_multiple: int = 8,
                 forgetting: float = 0.98, prior_strength: float = 1e-3,
                 packed_attention: str = "varlen") -> "CostModel":
        """Cost model whose padded costs come from ``table``; packed (varlen) costs use linear
        coefficients least-squares fitted to the same table (the keywords as in `CostModel`)."""
        cm = cls(model, device, table=table, pad_multiple=pad_multiple, forgetting=forgetting,
                 prior_strength=prior_strength, packed_attention=packed_attention)
        r, l, d = np.meshgrid(table.rows, table.main_len, table.dec_len, indexing="ij")
        phi = cm.padded_features(r.ravel(), l.ravel(), d.ravel(), np.zeros(r.size))
        cm.time_coef = fit_relative(phi, table.time_s.ravel(), np.ones(r.size), cm.prior_time_coef, 1e-6)
        cm.mem_coef = fit_relative(phi, table.memory_bytes.ravel(), np.ones(r.size), cm.mem_coef, 1e-6)
        return cm

    @property
    def kind(self) -> str:
        """``decoder``, ``encoder_decoder`` or ``vision_language``."""
        return self.model.kind

    @property
    def forward_fraction(self) -> float:
        """Share of a micro-batch's stage time spent in the forward pass."""
        return 0.25 if self.model.recompute else 1.0 / 3.0

    # -- samples -> dimensions ---------------------------------------------------------------
    def sample_dims(self, shapes: Shapes, max_len: int | None = None, max_target_len: int | None = None):
        """Per-sample (main length, decoder length, vision tiles) as int64 arrays.

        decoder: main = input + target (+ vision) tokens; encoder_decoder: main = input (+ vision),
        decoder = target; vision_language: main = LLM tokens = input + target + vision, tiles =
        ceil(vision / tile_tokens). ``max_len`` truncates main (text first, vision tokens are kept),
        ``max_target_len`` the decoder length.
        """
        inp = shapes.input_tokens.astype(np.int64)
        tgt = shapes.target_tokens.astype(np.int64)
        vis = shapes.vision_tokens.astype(np.int64)
        tiles = np.zeros(len(shapes), np.int64)
        if self.kind == "encoder_decoder":
            main, dec = inp + vis, tgt
        else:
            main, dec = inp + tgt + vis, np.zeros(len(shapes), np.int64)
        if self.kind == "vision_language":
            tiles = -(-vis // self.model.tile_tokens)
        if max_len is not None:
            cap = max(int(max_len), 1)
            # Text is truncated, vision tokens are kept (an image is never cut).
            main = np.where(vis > 0, vis + np.minimum(main - vis, np.maximum(cap - vis, 0)), np.minimum(main, cap))
        if max_target_len is not None:
            dec = np.minimum(dec, int(max_target_len))
        return main, dec, tiles

    # -- features ----------------------------------------------------------------------------
    def padded_features(self, rows, main_len, dec_len, tiles, padding=False) -> np.ndarray:
        """Features [n, NUM_FEATURES] of padded micro-batches (lengths are rounded up to ``pad_multiple``);
        ``padding`` (bool, per micro-batch): some row's main-stack sample is shorter than the
        rounded length (``q_pad``; default: full rows)."""
        rows, main_len, dec_len, tiles, padding = (np.asarray(x, np.float64).ravel() for x in
                                                   np.broadcast_arrays(rows, main_len, dec_len, tiles, padding))
        p = self.pad_multiple
        L = np.ceil(main_len / p) * p if p > 1 else main_len
        T = np.ceil(dec_len / p) * p if p > 1 else dec_len
        v = tiles * self.model.tile_patches
        return np.stack([rows * L, rows * L * L, rows * T, rows * T * T, rows * T * L, v,
                         v * self.model.tile_patches, (rows > 0).astype(float), (tiles > 0).astype(float),
                         np.where(padding > 0, rows * L * L, 0.0)], axis=1)

    def packed_features(self, main_len, dec_len, tiles, group) -> np.ndarray:
        """Features of packed micro-batches (each one row) from per-sample lengths and ``group`` ids
        (0..G-1), attended as ``packed_attention`` says (`dynabatch.core.cost.features.packed_rows`)."""
        return packed_rows(main_len, dec_len, tiles, group, self.model.tile_patches, self.packed_attention == "dense")

    # -- costs -------------------------------------------------------------------------------
    def time(self, phi) -> np.ndarray:
        """Seconds of forward+backward on one stage for feature rows ``phi``."""
        return np.atleast_2d(phi) @ self.time_coef

    def memory(self, phi) -> np.ndarray:
        """Peak activation bytes on one stage for feature rows ``phi``."""
        return np.atleast_2d(phi) @ self.mem_coef

    def padded(self, rows, main_len, dec_len=0, tiles=0, padding=False) -> tuple[np.ndarray, np.ndarray]:
        """(seconds, bytes) of padded micro-batches (``padding`` as in `padded_features`); a
        `ProfiledTable`, when present, decides for full rows, and a padded one adds its ``q_pad`` cost."""
        phi = self.padded_features(rows, main_len, dec_len, tiles, padding)
        if self.table is not None:
            p = self.pad_multiple
            L = np.ceil(np.asarray(main_len, np.float64) / p) * p
            T = np.ceil(np.asarray(dec_len, np.float64) / p) * p
            t, m = self.table.lookup(rows, L, T)
            q = self.time_coef[Q_PAD]
            return (t + q * phi[:, Q_PAD].reshape(np.shape(t)) if q > 0 else t), m
        return self.time(phi), self.memory(phi)

    def packed(self, main_len, dec_len, tiles, group) -> tuple[np.ndarray, np.ndarray]:
        """(seconds, bytes) of packed (varlen) micro-batches given per-sample lengths and group ids."""
        phi = self.packed_features(main_len, dec_len, tiles, group)
        return self.time(phi), self.memory(phi)

    def p2p_bytes(self, phi) -> np.ndarray:
        """Bytes a micro-batch sends between adjacent stages (hidden states of all its tokens)."""
        phi = np.atleast_2d(phi)
        return self.transfer_bytes(phi[:, 0] + phi[:, 2])

    def transfer_bytes(self, tokens) -> np.ndarray:
        """Bytes of the hidden states of ``tokens`` (main + decoder tokens a micro-batch computes)."""
        return np.asarray(tokens, np.float64) * self.model.hidden * self.model.dtype_bytes

    def p2p_time(self, phi) -> np.ndarray:
        """Seconds to send a micro-batch's activations (or gradients) to the next stage."""
        phi = np.atleast_2d(phi)
        return self.transfer_time(phi[:, 0] + phi[:, 2])

    def transfer_time(self, tokens) -> np.ndarray:
        """Seconds to send the hidden states of ``tokens`` computed tokens to the next stage (the
        micro-batch's ``mb_tokens``: what `p2p_time` prices from its features)."""
        return self.transfer_bytes(tokens) / self.device.p2p_bandwidth + self.device.p2p_latency_s

    def state_bytes(self, num_ranks: int = 1) -> float:
        """Model state per stage: bf16 weights and grads, fp32 master weights and Adam moments, the
        optimizer part sharded over data-parallel ranks (Megatron's distributed optimizer)."""
        p = self.model.params_per_stage
        return p * (2 * self.model.dtype_bytes + 12.0 / max(num_ranks, 1))

    def memory_limit(self, num_stages: int, num_ranks: int = 1) -> float:
        """Default activation-memory limit (bytes) for one micro-batch: the device memory left after
        model state, divided by the ``num_stages`` micro-batches stage 0 holds in flight under 1F1B."""
        free = self.device.memory_bytes * self.device.usable_memory_fraction - self.state_bytes(num_ranks)
        if free <= 0:
            raise ValueError(
                f"model state ({self.state_bytes(num_ranks) / GiB:.1f} GiB per stage) does not fit in "
                f"{self.device.name}'s memory ({self.device.memory_bytes / GiB:.1f} GiB); use more stages or ranks"
            )
        return free / max(num_stages, 1)

    # -- coefficients: the store (`coefficients.Coefficients`), its version counter, shared memory ------
    @property
    def time_coef(self) -> np.ndarray:
        """Seconds per feature unit (`FEATURES`): a live view, in shared memory after `share_memory`.

        Assigning writes the new values in place and increments `version` (a `FeedbackLoop` refit
        does exactly that); one process writes, any number read."""
        return self.coefficients.coef

    @time_coef.setter
    def time_coef(self, value) -> None:
        value = np.asarray(value, np.float64)
        if value.shape != (NUM_FEATURES,):
            raise ValueError(f"cost coefficients must have {NUM_FEATURES} entries ({', '.join(FEATURES)})")
        self.coefficients.write(value)  # a scalar refit: stages are priced by time_coef (and the layout) again

    @property
    def version(self) -> int:
        """How many times ``time_coef`` changed since the model was built (+1 per refit); read from
        shared memory after `share_memory`, so a forked process sees the parent's refits."""
        return self.coefficients.version

    @property
    def is_shared(self) -> bool:
        """Whether ``time_coef`` and ``version`` live in shared memory (`share_memory`)."""
        return self.coefficients.is_shared

    def share_memory(self) -> "CostModel":
        """Move ``time_coef`` and ``version`` into shared memory (a `multiprocessing.RawArray`, no
        torch needed) and return ``self``.

        Processes forked afterwards (DataLoader workers, planner processes), processes started with
        this model as an argument (spawn, forkserver) and ``copy.copy`` of the model share the
        coefficients: every refit written here is seen there, with its ``version``. `snapshot`,
        ``copy.deepcopy`` and ordinary pickling give independent copies. Idempotent."""
        self.coefficients = self.coefficients.shared()
        return self

    def read_time_coef(self) -> tuple[np.ndarray, int]:
        """(a copy of ``time_coef``, its ``version``), consistent even while another process refits."""
        return self.coefficients.read()[:2]

    def snapshot(self) -> "CostModel":
        """A private copy frozen at the current coefficients and version (plan one step with one model
        even while a refit lands in shared memory)."""
        import copy

        return copy.deepcopy(self)

    def __copy__(self) -> "CostModel":
        import copy

        new = self.__class__.__new__(self.__class__)
        new.__dict__.update(self.__dict__)
        new.legacy_loop = None
        new.coefficients = copy.copy(self.coefficients)  # shared only when shared memory was asked for
        return new

    # -- deprecated: the one refit path is dynabatch.core.plan.feedback.FeedbackLoop (`legacy_refit`) ------
    #: The refit loop class behind the deprecated `observe`/`refit`: `FeedbackLoop`, which sits above the
    #: planner and registers itself here when imported, so the cost model imports nothing above it.
    legacy_loop_class = None

    def observe(self, phi, measured_s, weight: float = 1.0) -> None:
        """Deprecated: ``FeedbackLoop(cost).record(phi, measured_s)`` (the one refit path).

        Records measured stage times (seconds) of micro-batches with features ``phi`` in a
        `FeedbackLoop` of this model (forgetting ``self.forgetting`` per call, prior the analytic
        coefficients, ridge ``self.prior_strength``)."""
        legacy_refit.observe(self, phi, measured_s, weight)

    @property
    def num_observations(self) -> int:
        """How many micro-batch timings the deprecated `observe` holds for `refit`."""
        return 0 if self.legacy_loop is None else self.legacy_loop.num_observations

    def refit(self) -> np.ndarray:
        """Deprecated: ``FeedbackLoop.refit``/``maybe_refit`` (the one refit path; this delegates to it).
        Returns the new coefficients."""
        return legacy_refit.refit(self)

    def mape(self, phi, measured_s) -> float:
        """Mean absolute percentage error of predicted vs measured times (a fraction, 0.1 = 10%)."""
        y = np.asarray(measured_s, np.float64)
        return float(np.mean(np.abs(self.time(phi) - y) / np.maximum(y, 1e-12)))

    # -- persistence: the file format is `dynabatch.core.cost.fileformat` ----------------------------
    def to_dict(self) -> dict:
        """JSON-serializable description (configs, coefficients, optional table; `fileformat`)."""
        return fileformat.cost_model_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """Inverse of `to_dict`."""
        return fileformat.cost_model_from_dict(cls, d)

    def save(self, path) -> None:
        """Write the cost model as JSON to ``path``."""
        fileformat.save_cost_model(self, path)

    @classmethod
    def load(cls, path) -> "CostModel":
        """Read a cost model written by `save`; a file that is not one raises ValueError naming it."""
        return fileformat.load_cost_model(cls, path)

    def with_device(self, device: str | DeviceProfile) -> "CostModel":
        """The same model, layout and packed attention on another device (analytic coefficients recomputed)."""
        dev = device_preset(device) if isinstance(device, str) else device
        return CostModel(self.model, dev, pad_multiple=self.pad_multiple,
                         packed_attention=self.packed_attention).set_layout(self.layout)

    def with_model(self, model: ModelConfig | None = None, *, recompute: bool | None = None) -> "CostModel":
        """The same device and layer layout with another `ModelConfig` (``model``; default this one), its
        ``recompute`` set when given (``recompute=False``: the base a per-stage recompute policy is
        priced from); analytic coefficients recomputed."""
        model = self.model if model is None else model
        model = model if recompute is None else replace(model, recompute=bool(recompute))
        return CostModel(model, self.device, pad_multiple=self.pad_multiple,
                         packed_attention=self.packed_attention).set_layout(self.layout)

    def __repr__(self) -> str:
        src = "profiled" if self.table is not None else ("refit" if self.version else "analytic")
        return f"CostModel({self.model.name}, {self.device.name}, {src})"


def describe(cost: CostModel) -> str:
    """One line per feature with its time coefficient, for logs and `dynabatch inspect`."""
    lines = [repr(cost)]
    for name, t, m in zip(FEATURES, cost.time_coef, cost.mem_coef):
        lines.append(f"  {name:8s} {t:.3e} s/unit  {m:.3e} B/unit")
    n_half = cost.time_coef[7] / cost.time_coef[0] if cost.time_coef[0] else math.inf
    lines.append(f"  half-efficiency micro-batch: {n_half:.0f} main tokens")
    return "\n".join(lines)
