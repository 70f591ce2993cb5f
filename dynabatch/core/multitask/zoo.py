"""Component graphs by name: the tiny multi-task multi-modal member (``mtmm-tiny``: the CPU-sized model that
`dynabatch.pipeline.models.mtmm` builds in torch to the same shapes), its full-size counterpart (``mtmm``:
InternViT-6B + a Whisper-large-sized audio encoder + InternLM2-20B, for the benchmark), and two builders: a
graph from per-component `ModelConfig`s (`graph_from_configs`) and the two-component split of a
``vision_language`` `ModelConfig` (`vision_language_graph`: ViT -> backbone, as a LLaVA-style model is).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..cost.presets import ModelConfig
from .graph import Component, ComponentGraph, Task

GRAPHS = ("mtmm-tiny", "mtmm")

#: ``mtmm-tiny``'s shapes (the torch model of `dynabatch.pipeline.models.mtmm` uses the same): a ViT on
#: 56-px tiles of 16 patches (14 px) shuffled 2 x 2 into 4 backbone tokens, an audio encoder whose frames
#: are pooled 2:1, a shared projector, a GPT backbone and two heads (LM head over a 512-token vocabulary,
#: a 16-way classifier over the mean of the backbone's output).
MTMM_TINY = {
    "vocab": 512, "hidden": 128, "heads": 4, "ffn": 512, "layers": 2,
    "vision_hidden": 64, "vision_heads": 2, "vision_ffn": 256, "vision_layers": 2, "tile_patches": 16, "tile_tokens": 4,
    "audio_hidden": 64, "audio_heads": 2, "audio_ffn": 256, "audio_layers": 2, "audio_pool": 2, "classes": 16,
}


def _stack(name: str, hidden: int, attn: int, kv: int, ffn: int, layers: int, *, gated: bool = False,
           recompute: bool = False, flash: bool = True, dtype_bytes: int = 2) -> ModelConfig:
    return ModelConfig(name, "decoder", hidden=hidden, attn_dim=attn, kv_dim=kv, ffn=ffn, layers=layers,
                       gated_ffn=gated, recompute=recompute, flash_attention=flash, dtype_bytes=dtype_bytes)


def _dense(name: str, d_in: int, d_out: int, *, dtype_bytes: int, flash: bool = True) -> ModelConfig:
    """A matmul ``d_in -> d_out`` priced as one attention-free layer: with an ungated ffn of ``f`` the
    analytic model counts ``2 * 2 * h * f`` FLOPs and ``2 * h * f`` parameters per token, so
    ``h = d_in, f = d_out / 2`` is exactly one ``d_in x d_out`` matmul."""
    return ModelConfig(name, "decoder", hidden=d_in, attn_dim=0, kv_dim=0, ffn=max(1, d_out // 2), layers=1,
                       flash_attention=flash, dtype_bytes=dtype_bytes)


def _tasks() -> tuple[Task, ...]:
    return (Task("text", ("backbone", "head_caption")),
            Task("image_text", ("vit", "projector", "backbone", "head_caption")),
            Task("audio_text", ("audio", "projector", "backbone", "head_cls")))


def mtmm_tiny_graph(*, dtype_bytes: int = 4) -> ComponentGraph:
    """``mtmm-tiny``: ``vit`` (2 ViT blocks, 64 wide, per 16-patch tile; 4 backbone tokens per tile) and ``audio``
    (2 blocks, 64 wide; 2 frames per backbone token) feed one ``projector`` (64 -> 128 -> 128 MLP), then the
    ``backbone`` (2 GPT blocks, 128 wide, 4 heads, ffn 512) and two heads: ``head_caption`` (LM head, vocabulary
    512) and ``head_cls`` (16 classes). Tasks: ``text`` (backbone, LM head), ``image_text`` (vit, projector,
    backbone, LM head), ``audio_text`` (audio, projector, backbone, classifier). fp32 (``dtype_bytes=4``) as the
    CPU model trains; eager attention (scores stored)."""
    c = MTMM_TINY
    dt = int(dtype_bytes)
    vit = _stack("mtmm-tiny-vit", c["vision_hidden"], c["vision_hidden"], c["vision_hidden"], c["vision_ffn"],
                 c["vision_layers"], flash=False, dtype_bytes=dt)
    audio = _stack("mtmm-tiny-audio", c["audio_hidden"], c["audio_hidden"], c["audio_hidden"], c["audio_ffn"],
                   c["audio_layers"], flash=False, dtype_bytes=dt)
    # projector: d_v -> h -> h (two matmuls, 2 * (d_v h + h h) FLOPs per token) priced as one h-wide layer
    h = c["hidden"]
    proj_f = (c["vision_hidden"] * h + h * h) // (2 * h)
    proj = ModelConfig("mtmm-tiny-projector", "decoder", hidden=h, attn_dim=0, kv_dim=0, ffn=proj_f, layers=1,
                       flash_attention=False, dtype_bytes=dt)
    backbone = _stack("mtmm-tiny-backbone", h, h, h, c["ffn"], c["layers"], flash=False, dtype_bytes=dt)
    comps = (
        Component("vit", "encoder", c["vision_layers"], vit, tokens="vision", seq_len=c["tile_patches"],
                  token_ratio=c["tile_tokens"] / c["tile_patches"]),
        Component("audio", "encoder", c["audio_layers"], audio, tokens="audio", token_ratio=1.0 / c["audio_pool"]),
        Component("projector", "projector", 1, proj, inputs=("vit", "audio"), tokens="encoded"),
        Component("backbone", "backbone", c["layers"], backbone, inputs=("projector",), tokens="merged"),
        Component("head_caption", "head", 1, _dense("mtmm-tiny-lm-head", h, c["vocab"], dtype_bytes=dt, flash=False),
                  inputs=("backbone",), tokens="merged"),
        Component("head_cls", "head", 1, _dense("mtmm-tiny-cls-head", h, c["classes"], dtype_bytes=dt, flash=False),
                  inputs=("backbone",), tokens="merged"),
    )
    return ComponentGraph(comps, _tasks())


def mtmm_graph() -> ComponentGraph:
    """``mtmm``: the full-size multi-task graph of the benchmark, bf16, full recomputation as InternVL trains.
    ``vit``: InternViT-6B (45 layers x 3200, ffn 12800, 1025-patch tiles -> 256 backbone tokens); ``audio``: a
    Whisper-large-sized encoder (32 layers x 1280, ffn 5120, 1500 frames per 30 s, pooled 2:1); ``projector``:
    3200 -> 6144 -> 6144 MLP; ``backbone``: InternLM2-20B (48 layers x 6144, GQA with 8 KV heads, SwiGLU ffn
    16384); heads: LM head (vocabulary 92544) and a 1000-class classifier. Same tasks as `mtmm_tiny_graph`."""
    vit = _stack("internvit-6b", 3200, 3200, 3200, 12800, 45, recompute=True)
    audio = _stack("whisper-large-encoder", 1280, 1280, 1280, 5120, 32, recompute=True)
    h = 6144
    proj = ModelConfig("mtmm-projector", "decoder", hidden=h, attn_dim=0, kv_dim=0, ffn=(3200 * h + h * h) // (2 * h),
                       layers=1)
    backbone = _stack("internlm2-20b", h, h, 8 * 128, 16384, 48, gated=True, recompute=True)
    comps = (
        Component("vit", "encoder", 45, vit, tokens="vision", seq_len=1025, token_ratio=256 / 1025),
        Component("audio", "encoder", 32, audio, tokens="audio", token_ratio=0.5),
        Component("projector", "projector", 1, proj, inputs=("vit", "audio"), tokens="encoded"),
        Component("backbone", "backbone", 48, backbone, inputs=("projector",), tokens="merged"),
        Component("head_caption", "head", 1, _dense("mtmm-lm-head", h, 92544, dtype_bytes=2), inputs=("backbone",),
                  tokens="merged"),
        Component("head_cls", "head", 1, _dense("mtmm-cls-head", h, 1000, dtype_bytes=2), inputs=("backbone",),
                  tokens="merged"),
    )
    return ComponentGraph(comps, _tasks())


def graph_by_name(name: str) -> ComponentGraph:
    """A graph of `GRAPHS` by name."""
    if name == "mtmm-tiny":
        return mtmm_tiny_graph()
    if name == "mtmm":
        return mtmm_graph()
    raise ValueError(f"unknown component graph {name!r}; choose one of {GRAPHS}")


def graph_from_configs(configs: Mapping[str, ModelConfig], kinds: Mapping[str, str],
                       inputs: Mapping[str, Sequence[str]], tasks: Mapping[str, Sequence[str]], *,
                       tokens: Mapping[str, str] | None = None, seq_len: Mapping[str, int] | None = None,
                       token_ratio: Mapping[str, float] | None = None) -> ComponentGraph:
    """A `ComponentGraph` from per-component ``decoder``-kind `ModelConfig`s (name -> config, in the order
    the components are declared; each config's ``layers`` is the component's layer count, an integer),
    their kinds, their inputs (name -> input names; missing: none), and the tasks (name -> path).
    ``tokens`` / ``seq_len`` / ``token_ratio``: per-component overrides of `Component`'s defaults."""
    tokens, seq_len, token_ratio = tokens or {}, seq_len or {}, token_ratio or {}
    for what, m in (("kinds", kinds), ("inputs", inputs), ("tokens", tokens), ("seq_len", seq_len),
                    ("token_ratio", token_ratio)):
        extra = sorted(set(m) - set(configs))
        if extra:
            raise ValueError(f"graph_from_configs: {what} names {extra}, which have no ModelConfig "
                             f"(components: {list(configs)})")
    comps = []
    for name, cfg in configs.items():
        if name not in kinds:
            raise ValueError(f"graph_from_configs: component {name!r} has no kind (one of encoder, projector, "
                             f"backbone, head)")
        if float(cfg.layers) != int(cfg.layers):
            raise ValueError(f"graph_from_configs: {name!r}'s ModelConfig has {cfg.layers} layers; a component "
                             f"needs a whole number (describe the whole component, not one pipeline stage)")
        comps.append(Component(name, kinds[name], int(cfg.layers), cfg, inputs=tuple(inputs.get(name, ())),
                               tokens=tokens.get(name, "text"), seq_len=int(seq_len.get(name, 0)),
                               token_ratio=float(token_ratio.get(name, 1.0))))
    return ComponentGraph(tuple(comps), tuple(Task(n, tuple(p)) for n, p in tasks.items()))


def vision_language_graph(config: ModelConfig, *, num_stages: int = 1) -> ComponentGraph:
    """The two components of a ``vision_language`` `ModelConfig` (a LLaVA / InternVL-style model): ``vit``
    (its vision tower, attended per tile of ``tile_patches``, ``tile_tokens`` backbone tokens per tile) and
    ``backbone`` (its language model over the merged sequence). ``num_stages``: how many pipeline stages the
    config's per-stage layer counts describe (`dynabatch.core.cost.model_preset` splits a preset over them).
    Tasks: ``text`` (backbone) and ``image_text`` (vit, backbone)."""
    if config.kind != "vision_language":
        raise ValueError(f"vision_language_graph needs a vision_language ModelConfig, got {config.name!r} of kind "
                         f"{config.kind!r}")
    S = int(num_stages)
    vl, ll = config.vision_layers * S, config.layers * S
    if vl != int(round(vl)) or ll != int(round(ll)):
        raise ValueError(f"vision_language_graph: {config.name!r} x {S} stages gives {vl} vision and {ll} language "
                         f"layers; pass the num_stages the config was split over")
    vl, ll = int(round(vl)), int(round(ll))
    vit = _stack(f"{config.name}-vit", config.vision_hidden, config.vision_attn_dim, config.vision_attn_dim,
                 config.vision_ffn, vl, recompute=config.recompute, flash=config.flash_attention,
                 dtype_bytes=config.dtype_bytes)
    lm = _stack(f"{config.name}-lm", config.hidden, config.attn_dim, config.kv_dim, config.ffn, ll,
                gated=config.gated_ffn, recompute=config.recompute, flash=config.flash_attention,
                dtype_bytes=config.dtype_bytes)
    comps = (Component("vit", "encoder", vl, vit, tokens="vision", seq_len=config.tile_patches,
                       token_ratio=config.tile_tokens / config.tile_patches),
             Component("backbone", "backbone", ll, lm, inputs=("vit",), tokens="merged"))
    return ComponentGraph(comps, (Task("text", ("backbone",)), Task("image_text", ("vit", "backbone"))))
