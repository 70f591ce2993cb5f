"""The tiny models by name: `MODELS` and `make_model` (the one place that knows every tiny family, so
`tiny` and `vlm` need not import each other)."""

from __future__ import annotations

from .layered import LayeredModel
from .tiny import gpt_tiny, t5_tiny
from .vlm import vlm_tiny

MODELS = ("gpt-tiny", "t5-tiny", "vlm-tiny")


def make_model(name: str, **overrides) -> LayeredModel:
    """A tiny model by name (``gpt-tiny``, ``t5-tiny`` or ``vlm-tiny``); keyword arguments override its sizes."""
    if name == "gpt-tiny":
        return gpt_tiny(**overrides)
    if name == "t5-tiny":
        return t5_tiny(**overrides)
    if name == "vlm-tiny":
        return vlm_tiny(**overrides)
    raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")




__all__ = ["MODELS", "make_model"]
