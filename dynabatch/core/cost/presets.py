"""Model and device descriptions the analytic cost model is built from, and their named presets.

`ModelConfig` is the transformer shape of one pipeline stage, `DeviceProfile` the throughput of
one accelerator; `model_preset` / `device_preset` return the published configurations dynabatch
is evaluated against. `dynabatch.core.cost.model` turns a pair of them into cost coefficients and
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
    """Throughput of one accelerator: ``peak_flops`` (FLOP/s, bf16 dense; fp32 for ``cpu``), ``max_efficiency``
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
#: CPU-sized models: the ``gpt-tiny`` / ``t5-tiny`` that `dynabatch.pipeline` trains and
#: ``dynabatch profile`` measures (same `ModelConfig`), and the DataLoader's default on the ``cpu``.
TINY_MODEL_PRESETS = ("gpt-tiny", "t5-tiny")

DEVICE_PRESETS: dict[str, DeviceProfile] = {
    "a100-40gb": DeviceProfile("a100-40gb", 312e12, 0.70, 1.555e12, 4e-4, 40 * GiB, 25e9, 2e-5),
    "a100-80gb": DeviceProfile("a100-80gb", 312e12, 0.70, 2.0e12, 4e-4, 80 * GiB, 25e9, 2e-5),
    "h100": DeviceProfile("h100", 989e12, 0.65, 3.35e12, 3e-4, 80 * GiB, 50e9, 2e-5),
    "h200": DeviceProfile("h200", 989e12, 0.65, 4.8e12, 3e-4, 141e9, 50e9, 2e-5),
    # PyTorch eager fp32 on 2 cores (Xeon, AVX-512; torch 2.13 CPU, 2 threads), measured:
    # * peak_flops: the fastest fp32 GEMMs, cache-resident [128..512 x 256] @ [256 x 1024]
    #   (torch.mm, fastest of 7): 3.7-3.8e11 FLOP/s; large ones (2048^3, 4096^3) reach 1.8e11.
    # * max_efficiency 0.60, overhead_s 4 ms: ``dynabatch profile --model gpt-tiny --device cpu
    #   --rows 1 2 4 8 16 32 --lengths 16 32 64 128 256 512 --repeats 5`` fits 79.8 us/token and
    #   7.1 ms per micro-batch (fwd+bwd; whole-model forward+backward timed directly: 83 us/token,
    #   8.0 ms); 0.60 x 3.8e11 gives gpt-tiny 82.8 us/token, and 4 ms + reading its weights at
    #   memory_bandwidth gives 7.8 ms per micro-batch. The analytic model then predicts that table
    #   within 4% (mean abs error) and t5-tiny's (same command, --model t5-tiny --lengths 16 32 64
    #   128 256 --target-lengths 8 32) within 9%.
    # * memory_bandwidth: torch sum / copy of 256 MiB fp32: 0.9-1.1e10 B/s.
    # * memory_bytes: a 16 GiB laptop, 80% usable (not this machine's RAM). p2p: loopback gloo,
    #   not measured. Measure your own machine with ``dynabatch profile`` (see docs/cost_model.md).
    "cpu": DeviceProfile("cpu", 3.8e11, 0.60, 1.0e10, 4e-3, 16 * GiB, 5e9, 5e-5, 0.8),
}
#: The device presets of GPUs (``dynabatch.devices`` maps a CUDA device name to one of them).
GPU_PRESETS = ("a100-40gb", "a100-80gb", "h100", "h200")


def model_preset(name: str, num_stages: int = 4) -> ModelConfig:
    """The published configurations dynabatch is evaluated against.

    ``gpt``: DynaPipe's GPT (hidden 4096, 32 heads, ffn 16384, 4 layers per stage).
    ``t5``: DynaPipe's T5-11B (d_model 1024, d_ff 65536, 128 heads x d_kv 128, 2 encoder + 2 decoder
    layers per stage). ``vlm``: OmniBal's InternVL setting, InternViT-6B (45 layers x 3200, 448-px
    tiles of 1024 patches + class token -> 256 LLM tokens) + InternLM2-20B (48 layers x 6144, GQA with
    8 KV heads, SwiGLU ffn 16384), both split evenly over ``num_stages`` with full activation
    recomputation as InternVL trains it.

    ``gpt-tiny`` / ``t5-tiny`` (`TINY_MODEL_PRESETS`): the CPU-sized models of `dynabatch.pipeline`
    (hidden 256, 4 heads, ffn 1024, fp32; 4 decoder layers, or 2 encoder + 2 decoder layers), the
    whole model split evenly over ``num_stages``.
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
    if name in TINY_MODEL_PRESETS:  # dynabatch.pipeline.models.gpt_tiny / t5_tiny, fp32, split over the stages
        enc_dec = name == "t5-tiny"
        return ModelConfig(name, "encoder_decoder" if enc_dec else "decoder", hidden=256, attn_dim=256, kv_dim=256,
                           ffn=1024, layers=(2 if enc_dec else 4) / num_stages,
                           decoder_layers=2 / num_stages if enc_dec else 0.0, flash_attention=False, dtype_bytes=4)
    raise ValueError(f"unknown model preset {name!r}; choose one of {MODEL_PRESETS + TINY_MODEL_PRESETS}")


def device_preset(name: str) -> DeviceProfile:
    """A `DeviceProfile` by name (``a100-40gb``, ``a100-80gb``, ``h100``, ``h200``, ``cpu``).

    ``"auto"`` (this machine's device) is resolved outside this torch-free core, by
    `dynabatch.devices.resolve_device`, which the DataLoader calls."""
    try:
        return DEVICE_PRESETS[name]
    except KeyError:
        hint = " ('auto' is resolved by dynabatch.devices.resolve_device())" if name == "auto" else ""
        raise ValueError(f"unknown device preset {name!r}; choose one of {sorted(DEVICE_PRESETS)}{hint}") from None
