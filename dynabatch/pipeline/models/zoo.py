"""The tiny models by name: `MODELS` and `make_model` (the one place that knows every tiny family, so
`tiny` and `vlm` need not import each other)."""

from __future__ import annotations

from .layered import LayeredModel
from .tiny import gpt_tiny, t5_tiny
from .vlm import vlm_tiny

MODELS = ("gpt-tiny", "t5-tiny", "vlm-tiny")


def make_model(name: str, *, vocab: int | None = None, hidden: int | None = None, layers: int | None = None,
               heads: int | None = None, ffn: int | None = None, max_positions: int | None = None,
               encoder_layers: int | None = None, decoder_layers: int | None = None,
               vision_hidden: int | None = None, vision_layers: int | None = None, vision_heads: int | None = None,
               vision_ffn: int | None = None, tile_size: int | None = None, patch_size: int | None = None,
               tile_tokens: int | None = None, vision=None, image_token_id: int | None = None, dtype=None,
               seed: int = 0) -> LayeredModel:
    """A tiny model by name (``gpt-tiny``, ``t5-tiny`` or ``vlm-tiny``) built with ``seed``.

    Every other keyword, when not None, overrides the size of that name in the family's builder
    (`gpt_tiny`, `t5_tiny`, `vlm_tiny`, where each is documented); None keeps the builder's default,
    and a size the family does not have (``encoder_layers`` of ``gpt-tiny``) is a TypeError naming it."""
    builders = {"gpt-tiny": gpt_tiny, "t5-tiny": t5_tiny, "vlm-tiny": vlm_tiny}
    if name not in builders:
        raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")
    given = dict(vocab=vocab, hidden=hidden, layers=layers, heads=heads, ffn=ffn, max_positions=max_positions,
                 encoder_layers=encoder_layers, decoder_layers=decoder_layers, vision_hidden=vision_hidden,
                 vision_layers=vision_layers, vision_heads=vision_heads, vision_ffn=vision_ffn, tile_size=tile_size,
                 patch_size=patch_size, tile_tokens=tile_tokens, vision=vision, image_token_id=image_token_id,
                 dtype=dtype)
    return builders[name](seed=seed, **{k: v for k, v in given.items() if v is not None})


__all__ = ["MODELS", "make_model"]
