"""The one-process reference a pipeline run is tested against: `sequential_step` runs a step's
micro-batches through the whole model with the runner's loss normalization (tokens)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..models.partition import PipelineStage
from ..models.spec import to_device


def sequential_step(layers: Sequence[nn.Module], batches: Sequence[dict], *, device=None) -> tuple[float, int]:
    """Reference: run ``batches`` through the whole model in one process with the runner's loss
    normalization (sum of token losses over all micro-batches / all real target tokens) and leave
    the gradients in the parameters' ``.grad``. Returns (loss, num_tokens)."""
    whole = PipelineStage(list(layers), 0, len(layers))
    if device is not None:
        whole.to(device)
        batches = [to_device(b, torch.device(device)) for b in batches]
    for p in whole.parameters():
        p.grad = None
    total, n = 0.0, 0
    for b in batches:
        loss, ntok = whole(None, b)
        loss.backward()
        total += float(loss.detach())
        n += int(ntok)
    for p in whole.parameters():
        if p.grad is not None:
            p.grad.div_(max(n, 1))
    return total / max(n, 1), n
