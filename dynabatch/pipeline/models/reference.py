"""The loss normalization of the one-process references a pipeline run is checked against
(`dynabatch.pipeline.sequential_step`, `dynabatch.pipeline.models.hf.hf_reference_step`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn


def token_mean_step(module: nn.Module, batches: Sequence[dict], loss_of: Callable) -> tuple[float, int]:
    """Clear ``module``'s gradients, then per micro-batch of ``batches`` take ``loss_of(batch) ->
    (summed token loss, target tokens)`` and backward it, then scale the gradients by 1 / all real
    target tokens: the runner's normalization, in its order of operations. Returns (loss per token,
    target tokens)."""
    for p in module.parameters():
        p.grad = None
    total, n = 0.0, 0
    for b in batches:
        loss, ntok = loss_of(b)
        loss.backward()
        total += float(loss.detach())
        n += int(ntok)
    scale = 1.0 / max(float(n), 1.0)  # times the reciprocal, as the runner scales: x / n may differ in the last bit
    for p in module.parameters():
        if p.grad is not None:
            p.grad.mul_(scale)
    return total / max(n, 1), n
