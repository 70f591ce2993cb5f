"""Cost model: time (seconds) and peak activation memory (bytes) of one micro-batch's
forward+backward on one pipeline stage.

Every micro-batch is reduced to a feature vector ``phi`` (see ``FEATURES``) and its cost is
``time = time_coef @ phi`` and ``memory = mem_coef @ phi``. The features are chosen so that the
analytic model is exactly linear in them:

* ``n_main``/``q_main``: tokens and sum of squared sequence lengths of the main stack (decoder-only
  model, T5 encoder, or the LLM of a vision-language model). Padded collation counts
  ``rows * L`` and ``rows * L**2``; packed (varlen) collation counts ``sum(s)`` and ``sum(s**2)``,
  because attention is quadratic per sample only.
* ``n_dec``/``q_dec``/``x_dec``: decoder tokens, decoder self-attention and cross-attention
  (``target * input``) of an encoder-decoder model.
* ``n_vis``/``q_vis``: ViT tokens (tiles * patches per tile) and their attention.
* ``one``: a constant per micro-batch: launch overhead plus reading the stage's weights once per
  pass (forward, input-gradient, weight-gradient). This fixed cost is what penalizes small
  micro-batches: the effective efficiency of a micro-batch of ``n`` tokens is
  ``eff_max * n / (n + n_half)`` with ``n_half = fixed / per-token time``.
* ``has_vis``: the ViT's fixed cost, paid only by micro-batches that hold at least one tile.

Three sources of truth sit behind this one interface: the analytic model built from a
`ModelConfig` and a `DeviceProfile`; a `ProfiledTable` of measured padded shapes, interpolated
(shapes outside the grid are infeasible unless ``extrapolate=True``); and a least-squares refit of
the coefficients from observed step times (`CostModel.observe` / `CostModel.refit`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from numba import njit

from .shapes import Shapes

FEATURES = ("n_main", "q_main", "n_dec", "q_dec", "x_dec", "n_vis", "q_vis", "one", "has_vis")
NUM_FEATURES = len(FEATURES)

KINDS = ("decoder", "encoder_decoder", "vision_language")
KIND_CODE = {k: i for i, k in enumerate(KINDS)}
GiB = float(1 << 30)
MAX_OBSERVATIONS = 100_000  # micro-batch timings CostModel.observe keeps for refit


@dataclass(frozen=True)
class ModelConfig:
    """Transformer shape of one pipeline stage (layer counts are per stage and may be fractional).

    ``kind`` is ``decoder`` (GPT-style), ``encoder_decoder`` (T5-style: ``layers`` encoder layers
    and ``decoder_layers`` decoder layers per stage) or ``vision_language`` (a ViT of
    ``vision_layers`` on image tiles feeding an LLM of ``layers``). ``attn_dim`` is heads*head_dim
    and ``kv_dim`` the key/value width (smaller than ``attn_dim`` with grouped-query attention).
    """

    name: str
    kind: str
    hidden: int
    attn_dim: int
    kv_dim: int
    ffn: int
    layers: float
    decoder_layers: float = 0.0
    gated_ffn: bool = False
    vision_hidden: int = 0
    vision_attn_dim: int = 0
    vision_ffn: int = 0
    vision_layers: float = 0.0
    tile_patches: int = 0  # ViT sequence length per tile (patches + class token)
    tile_tokens: int = 0  # LLM tokens each tile becomes (after pixel shuffle)
    recompute: bool = False  # full activation checkpointing
    flash_attention: bool = True  # attention scores are not stored
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ModelConfig.kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "encoder_decoder" and self.decoder_layers <= 0:
            raise ValueError("an encoder_decoder ModelConfig needs decoder_layers > 0")
        if self.kind == "vision_language" and (self.vision_layers <= 0 or self.tile_tokens <= 0):
            raise ValueError("a vision_language ModelConfig needs vision_layers > 0 and tile_tokens > 0")

    def _ffn_mats(self) -> int:
        return 3 if self.gated_ffn else 2

    @property
    def params_per_stage(self) -> float:
        """Parameters held by one pipeline stage."""
        h, a, kv, f = self.hidden, self.attn_dim, self.kv_dim, self.ffn
        layer = 2 * h * a + 2 * h * kv + self._ffn_mats() * h * f
        cross = 2 * h * a + 2 * h * kv
        vit = 4 * self.vision_hidden * self.vision_attn_dim + 2 * self.vision_hidden * self.vision_ffn
        return self.layers * layer + self.decoder_layers * (layer + cross) + self.vision_layers * vit


@dataclass(frozen=True)
class DeviceProfile:
    """Throughput of one accelerator: ``peak_flops`` (FLOP/s, bf16 dense), ``max_efficiency``
    (fraction of peak reached by large GEMMs), ``memory_bandwidth`` (bytes/s, for reading weights),
    ``overhead_s`` (fixed launch/sync time per micro-batch per stage, fwd+bwd), ``memory_bytes``,
    and the stage-to-stage link (``p2p_bandwidth`` bytes/s, ``p2p_latency_s``)."""

    name: str
    peak_flops: float
    max_efficiency: float
    memory_bandwidth: float
    overhead_s: float
    memory_bytes: float
    p2p_bandwidth: float
    p2p_latency_s: float
    usable_memory_fraction: float = 0.9  # allocator fragmentation and workspace


MODEL_PRESETS = ("gpt", "t5", "vlm")

DEVICE_PRESETS: dict[str, DeviceProfile] = {
    "a100-80gb": DeviceProfile("a100-80gb", 312e12, 0.70, 2.0e12, 4e-4, 80 * GiB, 25e9, 2e-5),
    "h100": DeviceProfile("h100", 989e12, 0.65, 3.35e12, 3e-4, 80 * GiB, 50e9, 2e-5),
    "h200": DeviceProfile("h200", 989e12, 0.65, 4.8e12, 3e-4, 141e9, 50e9, 2e-5),
    # Two desktop cores in fp32 through PyTorch eager; issue #5's profiler/refit replaces this.
    "cpu": DeviceProfile("cpu", 1.0e11, 0.35, 2.0e10, 5e-4, 16 * GiB, 5e9, 5e-5, 0.8),
}


def model_preset(name: str, num_stages: int = 4) -> ModelConfig:
    """The published configurations dynabatch is evaluated against.

    ``gpt``: DynaPipe's GPT (hidden 4096, 32 heads, ffn 16384, 4 layers per stage).
    ``t5``: DynaPipe's T5-11B (d_model 1024, d_ff 65536, 128 heads x d_kv 128, 2 encoder + 2 decoder
    layers per stage). ``vlm``: OmniBal's InternVL setting, InternViT-6B (45 layers x 3200, 448-px
    tiles of 1024 patches + class token -> 256 LLM tokens) + InternLM2-20B (48 layers x 6144, GQA with
    8 KV heads, SwiGLU ffn 16384), both split evenly over ``num_stages`` with full activation
    recomputation as InternVL trains it.
    """
    if name == "gpt":
        return ModelConfig("gpt", "decoder", hidden=4096, attn_dim=4096, kv_dim=4096, ffn=16384, layers=4)
    if name == "t5":
        return ModelConfig(
            "t5", "encoder_decoder", hidden=1024, attn_dim=128 * 128, kv_dim=128 * 128, ffn=65536,
            layers=2, decoder_layers=2,
        )
    if name == "vlm":
        return ModelConfig(
            "vlm", "vision_language", hidden=6144, attn_dim=6144, kv_dim=8 * 128, ffn=16384,
            layers=48 / num_stages, gated_ffn=True, vision_hidden=3200, vision_attn_dim=3200,
            vision_ffn=12800, vision_layers=45 / num_stages, tile_patches=1025, tile_tokens=256,
            recompute=True,
        )
    raise ValueError(f"unknown model preset {name!r}; choose one of {MODEL_PRESETS}")


def device_preset(name: str) -> DeviceProfile:
    """A `DeviceProfile` by name (``a100-80gb``, ``h100``, ``h200``, ``cpu``)."""
    try:
        return DEVICE_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown device preset {name!r}; choose one of {sorted(DEVICE_PRESETS)}") from None


def _layer_flops(h: int, a: int, kv: int, ffn_mats: int, f: int) -> tuple[float, float]:
    """Forward FLOPs of one self-attention layer: (per token, per unit of sum(s**2))."""
    per_token = 2.0 * (2 * h * a + 2 * h * kv) + 2.0 * ffn_mats * h * f
    return per_token, 4.0 * a


def _layer_act_bytes(h: int, a: int, kv: int, f: int, gated: bool, dtype: int) -> float:
    """Activation bytes one layer keeps per token for its backward (Megatron-style accounting).

    Inputs of both norms and of every matmul, Q/K/V, the attention output, the ffn intermediate
    (twice when gated) and two 1-byte dropout masks. For GPT shapes this is ~36*h, close to
    Megatron's 34*h.
    """
    return dtype * (6 * h + 2 * a + 2 * kv + (3 if gated else 2) * f) + 2 * h


def analytic_coefficients(model: ModelConfig, device: DeviceProfile) -> tuple[np.ndarray, np.ndarray]:
    """Time coefficients (seconds per feature unit) and memory coefficients (bytes per feature unit)."""
    passes = 4.0 if model.recompute else 3.0  # fwd + 2x bwd (+ recomputed fwd)
    rate = device.peak_flops * device.max_efficiency
    t = np.zeros(NUM_FEATURES)
    m = np.zeros(NUM_FEATURES)
    h, a, kv, f, dt = model.hidden, model.attn_dim, model.kv_dim, model.ffn, model.dtype_bytes
    tok, sq = _layer_flops(h, a, kv, model._ffn_mats(), f)
    act = _layer_act_bytes(h, a, kv, f, model.gated_ffn, dt)
    score_bytes = 0.0 if model.flash_attention else 5.0 * (a / 128)  # heads * (2+2+1) bytes per score

    # Main stack (decoder-only / encoder / LLM).
    t[0] = model.layers * tok * passes / rate
    t[1] = model.layers * sq * passes / rate
    if model.kind == "encoder_decoder":
        # Cross-attention K/V projections run over encoder tokens in every decoder layer.
        t[0] += model.decoder_layers * 2.0 * (2 * h * kv) * passes / rate
        dec_tok = tok + 2.0 * 2 * h * a  # plus cross-attention Q and output projections
        t[2] = model.decoder_layers * dec_tok * passes / rate
        t[3] = model.decoder_layers * sq * passes / rate
        t[4] = model.decoder_layers * 4.0 * a * passes / rate
    if model.kind == "vision_language":
        vh, va, vf = model.vision_hidden, model.vision_attn_dim, model.vision_ffn
        vtok, vsq = _layer_flops(vh, va, va, 2, vf)
        t[5] = model.vision_layers * vtok * passes / rate
        t[6] = model.vision_layers * vsq * passes / rate
        vit_params = model.vision_layers * (4 * vh * va + 2 * vh * vf)
        t[8] = vit_params * dt * passes / device.memory_bandwidth
    main_params = model.params_per_stage - (model.vision_layers * (4 * model.vision_hidden * model.vision_attn_dim + 2 * model.vision_hidden * model.vision_ffn))
    t[7] = device.overhead_s + main_params * dt * passes / device.memory_bandwidth

    if model.recompute:
        # Only each layer's input is kept; the layer being recomputed holds its full set.
        m[0] = model.layers * dt * h + act
        if model.kind == "encoder_decoder":
            m[2] = model.decoder_layers * dt * h + act
        if model.kind == "vision_language":
            vh, va, vf = model.vision_hidden, model.vision_attn_dim, model.vision_ffn
            m[5] = model.vision_layers * dt * vh + _layer_act_bytes(vh, va, va, vf, False, dt)
    else:
        m[0] = model.layers * act
        m[1] = model.layers * score_bytes
        if model.kind == "encoder_decoder":
            cross_act = dt * (3 * h + 2 * a) + h
            m[0] += model.decoder_layers * dt * 2 * kv  # cross K/V of encoder tokens
            m[2] = model.decoder_layers * (act + cross_act)
            m[3] = model.decoder_layers * score_bytes
            m[4] = model.decoder_layers * score_bytes
        if model.kind == "vision_language":
            vh, va, vf = model.vision_hidden, model.vision_attn_dim, model.vision_ffn
            m[5] = model.vision_layers * _layer_act_bytes(vh, va, va, vf, False, dt)
            m[6] = model.vision_layers * (0.0 if model.flash_attention else 5.0 * va / 128)
    return t, m


# ---------------------------------------------------------------------------------------------
# Feature kernels (shared by the planner's numba DP and by the vectorized Python API)


@njit(cache=True)
def round_up(x: int, multiple: int) -> int:
    """``x`` rounded up to a multiple of ``multiple`` (``multiple`` <= 1 leaves it unchanged)."""
    if multiple <= 1:
        return x
    return ((x + multiple - 1) // multiple) * multiple


@njit(cache=True)
def padded_features(rows, main_len, dec_len, tiles, tile_patches, out):
    """Fill ``out`` (length NUM_FEATURES) with the features of a padded micro-batch of ``rows``
    rows padded to ``main_len``/``dec_len`` tokens, holding ``tiles`` vision tiles in total."""
    r = float(rows)
    L = float(main_len)
    T = float(dec_len)
    v = float(tiles) * tile_patches
    out[0] = r * L
    out[1] = r * L * L
    out[2] = r * T
    out[3] = r * T * T
    out[4] = r * T * L
    out[5] = v
    out[6] = v * tile_patches
    out[7] = 1.0 if rows > 0 else 0.0
    out[8] = 1.0 if tiles > 0 else 0.0


@njit(cache=True)
def dot(coef, phi) -> float:
    """``coef @ phi`` for two short float64 vectors."""
    s = 0.0
    for k in range(coef.shape[0]):
        s += coef[k] * phi[k]
    return s


@njit(cache=True)
def _interp_axis(grid, x):
    """Index ``i`` and weight ``w`` so that x ~ (1-w)*grid[i] + w*grid[i+1]; w outside [0,1] extrapolates."""
    n = grid.shape[0]
    if n == 1:
        return 0, 0.0
    i = 0
    while i < n - 2 and x > grid[i + 1]:
        i += 1
    w = (x - grid[i]) / (grid[i + 1] - grid[i])
    return i, w


@njit(cache=True)
def profiled_lookup(grid_rows, grid_len, grid_dec, values, rows, main_len, dec_len, extrapolate) -> float:
    """Trilinear interpolation of ``values[r, l, t]`` at a padded shape; +inf outside the grid
    unless ``extrapolate`` (then linear extrapolation from the edge cell, clipped at 0)."""
    if not extrapolate:
        if (rows < grid_rows[0] or rows > grid_rows[-1] or main_len < grid_len[0] or main_len > grid_len[-1]
                or dec_len < grid_dec[0] or dec_len > grid_dec[-1]):
            return np.inf
    i, wi = _interp_axis(grid_rows, float(rows))
    j, wj = _interp_axis(grid_len, float(main_len))
    k, wk = _interp_axis(grid_dec, float(dec_len))
    ni = 1 if grid_rows.shape[0] > 1 else 0
    nj = 1 if grid_len.shape[0] > 1 else 0
    nk = 1 if grid_dec.shape[0] > 1 else 0
    acc = 0.0
    for di in range(ni + 1):
        for dj in range(nj + 1):
            for dk in range(nk + 1):
                w = (wi if di else 1.0 - wi) if ni else 1.0
                w *= (wj if dj else 1.0 - wj) if nj else 1.0
                w *= (wk if dk else 1.0 - wk) if nk else 1.0
                acc += w * values[i + di, j + dj, k + dk]
    return max(acc, 0.0)


@dataclass(frozen=True)
class ProfiledTable:
    """Measured costs of padded micro-batches on a grid of (rows, main length, decoder length).

    ``time_s`` and ``memory_bytes`` have shape [len(rows), len(main_len), len(dec_len)]; use a
    single decoder length of 0 for decoder-only models. Shapes beyond the grid are infeasible
    (+inf) unless ``extrapolate`` is set, in which case they are extrapolated linearly.
    """

    rows: np.ndarray
    main_len: np.ndarray
    dec_len: np.ndarray
    time_s: np.ndarray
    memory_bytes: np.ndarray
    extrapolate: bool = False

    def __post_init__(self) -> None:
        for name in ("rows", "main_len", "dec_len"):
            g = np.ascontiguousarray(getattr(self, name), dtype=np.float64)
            if g.ndim != 1 or len(g) == 0 or np.any(np.diff(g) <= 0):
                raise ValueError(f"ProfiledTable.{name} must be a non-empty strictly increasing 1-D grid")
            object.__setattr__(self, name, g)
        shape = (len(self.rows), len(self.main_len), len(self.dec_len))
        for name in ("time_s", "memory_bytes"):
            v = np.ascontiguousarray(getattr(self, name), dtype=np.float64)
            if v.shape != shape:
                raise ValueError(f"ProfiledTable.{name} must have shape {shape}, got {v.shape}")
            object.__setattr__(self, name, v)

    def lookup(self, rows, main_len, dec_len) -> tuple[np.ndarray, np.ndarray]:
        """Interpolated (time seconds, memory bytes) at arrays of padded shapes."""
        rows, main_len, dec_len = np.broadcast_arrays(
            np.asarray(rows, np.int64), np.asarray(main_len, np.int64), np.asarray(dec_len, np.int64)
        )
        t = np.empty(rows.shape)
        m = np.empty(rows.shape)
        for idx in np.ndindex(rows.shape):
            t[idx] = profiled_lookup(self.rows, self.main_len, self.dec_len, self.time_s, rows[idx],
                                     main_len[idx], dec_len[idx], self.extrapolate)
            m[idx] = profiled_lookup(self.rows, self.main_len, self.dec_len, self.memory_bytes, rows[idx],
                                     main_len[idx], dec_len[idx], self.extrapolate)
        return t, m


@dataclass
class _Observations:
    phi: list = field(default_factory=list)
    time_s: list = field(default_factory=list)
    weight: list = field(default_factory=list)


class CostModel:
    """Time (seconds) and activation memory (bytes) of one micro-batch on one pipeline stage.

    Build one with `CostModel.preset` (``"gpt"``, ``"t5"``, ``"vlm"`` on a device preset), with
    `CostModel.analytic` from a `ModelConfig` and `DeviceProfile`, or with `CostModel.profiled`
    from a measured `ProfiledTable`. All cost methods are vectorized over micro-batches.
    """

    def __init__(self, model: ModelConfig, device: DeviceProfile, *, time_coef=None, mem_coef=None,
                 table: ProfiledTable | None = None, pad_multiple: int = 8, forgetting: float = 0.98,
                 prior_strength: float = 1e-3):
        t0, m0 = analytic_coefficients(model, device)
        self.model = model
        self.device = device
        self.prior_time_coef = t0
        self.time_coef = t0.copy() if time_coef is None else np.asarray(time_coef, np.float64).copy()
        self.mem_coef = m0.copy() if mem_coef is None else np.asarray(mem_coef, np.float64).copy()
        if self.time_coef.shape != (NUM_FEATURES,) or self.mem_coef.shape != (NUM_FEATURES,):
            raise ValueError(f"cost coefficients must have {NUM_FEATURES} entries ({', '.join(FEATURES)})")
        self.table = table
        self.pad_multiple = int(pad_multiple)
        self.forgetting = float(forgetting)
        self.prior_strength = float(prior_strength)
        self._obs = _Observations()

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def preset(cls, model: str = "gpt", device: str = "a100-80gb", *, num_stages: int = 4, **kw) -> "CostModel":
        """Analytic cost model of a named model preset on a named device preset."""
        return cls(model_preset(model, num_stages), device_preset(device), **kw)

    @classmethod
    def analytic(cls, model: ModelConfig, device: DeviceProfile, **kw) -> "CostModel":
        """Analytic cost model from explicit configs."""
        return cls(model, device, **kw)

    @classmethod
    def profiled(cls, table: ProfiledTable, model: ModelConfig, device: DeviceProfile, **kw) -> "CostModel":
        """Cost model whose padded costs come from ``table``; packed (varlen) costs use linear
        coefficients least-squares fitted to the same table."""
        cm = cls(model, device, table=table, **kw)
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
    def padded_features(self, rows, main_len, dec_len, tiles) -> np.ndarray:
        """Features [n, NUM_FEATURES] of padded micro-batches (lengths are rounded up to ``pad_multiple``)."""
        rows, main_len, dec_len, tiles = (np.asarray(x, np.float64).ravel() for x in
                                          np.broadcast_arrays(rows, main_len, dec_len, tiles))
        p = self.pad_multiple
        L = np.ceil(main_len / p) * p if p > 1 else main_len
        T = np.ceil(dec_len / p) * p if p > 1 else dec_len
        v = tiles * self.model.tile_patches
        return np.stack([rows * L, rows * L * L, rows * T, rows * T * T, rows * T * L, v,
                         v * self.model.tile_patches, (rows > 0).astype(float), (tiles > 0).astype(float)], axis=1)

    def packed_features(self, main_len, dec_len, tiles, group) -> np.ndarray:
        """Features of packed (varlen) micro-batches: per-sample lengths summed by ``group`` id
        (0..G-1); attention is quadratic per sample only."""
        main_len = np.asarray(main_len, np.float64)
        dec_len = np.asarray(dec_len, np.float64)
        v = np.asarray(tiles, np.float64) * self.model.tile_patches
        group = np.asarray(group, np.int64)
        g = int(group.max()) + 1 if len(group) else 0
        cols = [main_len, main_len**2, dec_len, dec_len**2, dec_len * main_len, v, v * self.model.tile_patches]
        phi = np.zeros((g, NUM_FEATURES))
        for k, c in enumerate(cols):
            phi[:, k] = np.bincount(group, weights=c, minlength=g)
        phi[:, 7] = np.bincount(group, minlength=g) > 0
        phi[:, 8] = phi[:, 5] > 0
        return phi

    # -- costs -------------------------------------------------------------------------------
    def time(self, phi) -> np.ndarray:
        """Seconds of forward+backward on one stage for feature rows ``phi``."""
        return np.atleast_2d(phi) @ self.time_coef

    def memory(self, phi) -> np.ndarray:
        """Peak activation bytes on one stage for feature rows ``phi``."""
        return np.atleast_2d(phi) @ self.mem_coef

    def padded(self, rows, main_len, dec_len=0, tiles=0) -> tuple[np.ndarray, np.ndarray]:
        """(seconds, bytes) of padded micro-batches; a `ProfiledTable`, when present, decides."""
        if self.table is not None:
            p = self.pad_multiple
            L = np.ceil(np.asarray(main_len, np.float64) / p) * p
            T = np.ceil(np.asarray(dec_len, np.float64) / p) * p
            return self.table.lookup(rows, L, T)
        phi = self.padded_features(rows, main_len, dec_len, tiles)
        return self.time(phi), self.memory(phi)

    def packed(self, main_len, dec_len, tiles, group) -> tuple[np.ndarray, np.ndarray]:
        """(seconds, bytes) of packed (varlen) micro-batches given per-sample lengths and group ids."""
        phi = self.packed_features(main_len, dec_len, tiles, group)
        return self.time(phi), self.memory(phi)

    def p2p_bytes(self, phi) -> np.ndarray:
        """Bytes a micro-batch sends between adjacent stages (hidden states of all its tokens)."""
        phi = np.atleast_2d(phi)
        return (phi[:, 0] + phi[:, 2]) * self.model.hidden * self.model.dtype_bytes

    def p2p_time(self, phi) -> np.ndarray:
        """Seconds to send a micro-batch's activations (or gradients) to the next stage."""
        return self.p2p_bytes(phi) / self.device.p2p_bandwidth + self.device.p2p_latency_s

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

    # -- feedback ----------------------------------------------------------------------------
    def observe(self, phi, measured_s, weight: float = 1.0) -> None:
        """Record measured stage times (seconds) of micro-batches with features ``phi``.

        Older observations are down-weighted by ``forgetting`` per call so the fit follows drift.
        """
        phi = np.atleast_2d(np.asarray(phi, np.float64))
        y = np.atleast_1d(np.asarray(measured_s, np.float64))
        if phi.shape != (len(y), NUM_FEATURES):
            raise ValueError(f"observe needs phi of shape [n, {NUM_FEATURES}] matching {len(y)} times")
        if np.any(~np.isfinite(y)) or np.any(y < 0):
            raise ValueError("observed times must be finite and non-negative seconds")
        self._obs.weight = [w * self.forgetting for w in self._obs.weight]
        self._obs.phi.extend(phi)
        self._obs.time_s.extend(y)
        self._obs.weight.extend([weight] * len(y))
        # Forgotten observations no longer move the fit: drop them so memory stays bounded.
        keep = next((k for k, w in enumerate(self._obs.weight) if w >= 1e-6 * weight), len(self._obs.weight))
        keep = max(keep, len(self._obs.weight) - MAX_OBSERVATIONS)
        if keep:
            del self._obs.phi[:keep], self._obs.time_s[:keep], self._obs.weight[:keep]

    @property
    def num_observations(self) -> int:
        """How many micro-batch timings `observe` has recorded."""
        return len(self._obs.time_s)

    def refit(self) -> np.ndarray:
        """Least-squares refit of the time coefficients on the observed features, shrunk towards the
        analytic prior (so few observations cannot produce a wild model). Returns the new coefficients."""
        if not self._obs.time_s:
            raise ValueError("refit() needs observations: call observe(phi, measured_seconds) first")
        self.time_coef = fit_relative(np.array(self._obs.phi), np.array(self._obs.time_s),
                                         np.array(self._obs.weight), self.prior_time_coef, self.prior_strength)
        return self.time_coef.copy()

    def mape(self, phi, measured_s) -> float:
        """Mean absolute percentage error of predicted vs measured times (a fraction, 0.1 = 10%)."""
        y = np.asarray(measured_s, np.float64)
        return float(np.mean(np.abs(self.time(phi) - y) / np.maximum(y, 1e-12)))

    # -- persistence ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-serializable description (configs, coefficients, optional table)."""
        d = {
            "format": "dynabatch.cost_model", "version": 1,
            "model": asdict(self.model), "device": asdict(self.device),
            "time_coef": self.time_coef.tolist(), "mem_coef": self.mem_coef.tolist(),
            "pad_multiple": self.pad_multiple, "forgetting": self.forgetting,
            "prior_strength": self.prior_strength, "table": None,
        }
        if self.table is not None:
            d["table"] = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in asdict(self.table).items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """Inverse of `to_dict`."""
        if d.get("format") != "dynabatch.cost_model":
            raise ValueError("not a dynabatch cost model (missing format: dynabatch.cost_model)")
        table = ProfiledTable(**d["table"]) if d.get("table") else None
        return cls(ModelConfig(**d["model"]), DeviceProfile(**d["device"]), time_coef=d["time_coef"],
                   mem_coef=d["mem_coef"], table=table, pad_multiple=d["pad_multiple"],
                   forgetting=d["forgetting"], prior_strength=d["prior_strength"])

    def save(self, path) -> None:
        """Write the cost model as JSON to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path) -> "CostModel":
        """Read a cost model written by `save`; a file that is not one raises ValueError naming it."""
        try:
            d = json.loads(Path(path).read_text(encoding="utf-8"))
            if not isinstance(d, dict):
                raise TypeError(f"expected a JSON object, found {type(d).__name__}")
            return cls.from_dict(d)
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSON and Unicode errors are ValueErrors
            raise ValueError(f"{path}: not a valid dynabatch cost model file ({e})") from e

    def with_device(self, device: str | DeviceProfile) -> "CostModel":
        """The same model on another device (analytic coefficients recomputed)."""
        dev = device_preset(device) if isinstance(device, str) else device
        return CostModel(self.model, dev, pad_multiple=self.pad_multiple)

    def with_model(self, **changes) -> "CostModel":
        """The same device with some `ModelConfig` fields changed (e.g. ``recompute=True``)."""
        return CostModel(replace(self.model, **changes), self.device, pad_multiple=self.pad_multiple)

    def __repr__(self) -> str:
        src = "profiled" if self.table is not None else ("refit" if self._obs.time_s else "analytic")
        return f"CostModel({self.model.name}, {self.device.name}, {src})"


def fit_relative(phi, y, w, prior, strength) -> np.ndarray:
    """Weighted least squares on *relative* residuals with a Gaussian prior on the relative
    deviation from ``prior``.

    Solving for c = prior * (1 + delta) keeps features of wildly different scale comparable;
    dividing each row by its measured time makes the fit minimize percentage error (what MAPE
    reports) instead of letting the longest micro-batches dominate; ``strength`` is the prior's
    weight on every ``delta`` (the noise-to-prior variance ratio), so coefficients the data
    cannot pin down stay near the analytic model instead of absorbing the others' residuals.
    Coefficients whose prior is 0 stay 0 (the feature does not apply to this model); negative
    coefficients are clipped to 0 (a cost cannot shrink with more work).
    """
    active = prior > 0
    X = phi[:, active] * prior[active]  # columns in units of the prior's prediction
    scale = np.sqrt(w) / np.maximum(y, 1e-30)
    A = X * scale[:, None]
    b = (y - X.sum(axis=1)) * scale
    delta = np.linalg.solve(A.T @ A + strength * np.eye(A.shape[1]), A.T @ b)
    c = prior.copy()
    c[active] = np.maximum(prior[active] * (1.0 + delta), 0.0)
    return c


def describe(cost: CostModel) -> str:
    """One line per feature with its time coefficient, for logs and `dynabatch inspect`."""
    lines = [repr(cost)]
    for name, t, m in zip(FEATURES, cost.time_coef, cost.mem_coef):
        lines.append(f"  {name:8s} {t:.3e} s/unit  {m:.3e} B/unit")
    n_half = cost.time_coef[7] / cost.time_coef[0] if cost.time_coef[0] else math.inf
    lines.append(f"  half-efficiency micro-batch: {n_half:.0f} main tokens")
    return "\n".join(lines)
