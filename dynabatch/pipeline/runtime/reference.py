"""The one-process reference a pipeline run is tested against: `sequential_step` runs a step's
micro-batches through the whole model with the runner's loss normalization (tokens)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..models.partition import PipelineStage
from ..models.reference import token_mean_step
from ..models.spec import to_device


def sequential_step(layers: Sequence[nn.Module], batches: Sequence[dict], *, device=None) -> tuple[float, int]:
    """Reference: run ``batches`` through the whole model in one process with the runner's loss
    normalization (sum of token losses over all micro-batches / all real target tokens) and leave
    the gradients in the parameters' ``.grad``. Returns (loss, num_tokens)."""
    whole = PipelineStage(list(layers), 0, len(layers))
    if device is not None:
        whole.to(device)
        batches = [to_device(b, torch.device(device)) for b in batches]
    return token_mean_step(whole, batches, lambda b: whole(None, b))
