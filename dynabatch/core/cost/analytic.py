"""Analytic cost coefficients: time (seconds) and activation bytes per feature unit of one
micro-batch's forward+backward on one stage, from a `ModelConfig` and a `DeviceProfile` (FLOPs
over achievable throughput, bytes of the activations each layer keeps for backward)."""

from __future__ import annotations

import numpy as np

from ..kernels.cost import NUM_FEATURES
from .presets import DeviceProfile, ModelConfig


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
