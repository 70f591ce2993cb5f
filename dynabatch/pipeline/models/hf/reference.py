"""The one-process reference a pipeline run of a Hugging Face model is checked against: the model's own
``forward`` on each micro-batch, the summed token loss, ``backward``, then the gradients times 1 / the
step's target tokens (the runner's normalization, the same operations: bit for bit where the sums agree)."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from ..reference import token_mean_step
from .common import summed_cross_entropy

#: Micro-batch keys the Hugging Face model's forward takes (the rest is dynabatch metadata).
FORWARD_KEYS = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask", "pixel_values")


def hf_inputs(batch: dict) -> dict:
    """The keyword arguments of the Hugging Face forward for a dynabatch micro-batch: packed rows pass
    ``position_ids`` and no attention mask (the models then keep the samples apart), no KV cache;
    a micro-batch without image tiles passes no ``pixel_values``."""
    out = {k: batch[k] for k in FORWARD_KEYS if k in batch}
    if "cu_seqlens" in batch:
        out["position_ids"] = batch["position_ids"]
        out.pop("attention_mask", None)
    tiles = batch.get("image_tiles")
    if "pixel_values" in out and (tiles is None or int(tiles.sum()) == 0):
        out.pop("pixel_values")
    return {**out, "use_cache": False}


def hf_reference_step(hf_model: nn.Module, batches: Sequence[dict]) -> tuple[float, int]:
    """Run ``batches`` through ``hf_model``'s own forward (summed cross-entropy over ``labels``, shifted
    for causal LMs, as the model's loss takes them), backward each, and scale the gradients by 1 / all
    real target tokens. Returns (loss per token, target tokens)."""
    seq2seq = bool(getattr(hf_model.config, "is_encoder_decoder", False))

    def loss_of(b: dict):
        return summed_cross_entropy(hf_model(**hf_inputs(b)).logits, b["labels"], shift=not seq2seq)

    return token_mean_step(hf_model, batches, loss_of)
