"""The names ``dynabatch bench trainer`` offers (models, methods) and which pairs it runs, in a module
that imports nothing (the command's parser reads them without torch: `dynabatch.commands`)."""

from __future__ import annotations

MODELS = ("llama", "t5")
METHODS = ("dp", "group_by_length", "batch_rebalance", "flattening", "trl_bfd")


def family(model: str) -> str:
    """The dynabatch family of a bench model: ``encoder_decoder`` (t5) or ``decoder``."""
    return "encoder_decoder" if model == "t5" else "decoder"


def unsupported(model: str, method: str, trl_installed: bool) -> str | None:
    """Why ``method`` is not run on ``model`` (None: it is)."""
    if method == "flattening" and model == "t5":
        return ("DataCollatorWithFlattening packs decoder-only rows; Hugging Face's T5 would attend across the "
                "samples of a packed row")
    if method == "trl_bfd":
        if not trl_installed:
            return "trl is not installed (pip install trl to compare its BFD packing)"
        if model == "t5":
            return ("TRL's BFD packing makes padding-free decoder-only rows; Hugging Face's T5 would attend across "
                    "the samples of a packed row")
    return None


__all__ = ["METHODS", "MODELS", "family", "unsupported"]
