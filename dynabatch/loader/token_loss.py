"""The summed token loss of collated labels: the one definition of "loss per target token" that the
pipeline's Hugging Face heads, `step_backward` / `DynabatchTrainer` (for models whose own loss is a
per-micro-batch mean) and ``dynabatch check`` share.

Labels follow the collators' layout (`dynabatch.loader.collate`): -100 (`IGNORE_INDEX`) is no loss
term. A causal LM predicts ``labels[t + 1]`` at position ``t`` (``shift``), as Hugging Face's
``ForCausalLMLoss`` does; an encoder-decoder's logits line up with its labels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .collate import IGNORE_INDEX


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, shift: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token losses in nats, target tokens) of ``logits`` [rows, L, V] against ``labels``
    [rows, L] (-100 ignored), in float32 or wider as Hugging Face's losses are. ``shift``: causal LM
    (position t predicts ``labels[t + 1]``, the label row padded with -100 as ``ForCausalLMLoss`` does)."""
    if shift:
        labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    target = labels.reshape(-1).long().to(logits.device)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (target != IGNORE_INDEX).sum()


__all__ = ["summed_cross_entropy"]
