"""Model and device descriptions the analytic cost model is built from, and their named presets.

`ModelConfig` is the transformer shape of one pipeline stage, `DeviceProfile` the throughput of
one accelerator; `model_preset` / `device_preset` return the published configurations dynabatch
is evaluated against. `dynabatch.core.cost` turns a pair of them into cost coefficients and
re-exports every name defined here.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("decoder", "encoder_decoder", "vision_language")
KIND_CODE = {k: i for i, k in enumerate(KINDS)}
GiB = float(1 << 30)


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
