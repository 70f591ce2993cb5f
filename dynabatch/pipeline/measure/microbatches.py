"""What a training loop needs between the `DataLoader` and the `PipelineRunner`.

* `batch_shapes(step)`: the `MicroBatchShape`s of a step's micro-batch dicts, read off the tensors,
  with the plan's predicted seconds and activation bytes (what the runner plans its op order and
  the ``adaptive`` schedule's memory bound from). Placeholder micro-batches included.
* `representative(step, k)`: up to ``k`` micro-batches spread over predicted time, the mix a stage
  split is profiled on (`search_partition`).
* `stage_cost_model(model, num_stages, device)`: the analytic `CostModel` of one stage of a model
  split into ``num_stages`` (what the loader plans with and `FeedbackLoop` refits).

Times are seconds, memory bytes, lengths tokens.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from ...core.cost.model import CostModel, DeviceProfile, device_preset
from ..models.spec import MicroBatchShape


def _collation_of(batch: dict) -> str:
    return "packed" if "cu_seqlens" in batch else "padded"


def batch_shapes(microbatches: Sequence[dict], collation: str | None = None) -> list[MicroBatchShape]:
    """`MicroBatchShape`s of the `DataLoader`'s micro-batch dicts (a step, in order): the runner's plan
    input, with each micro-batch's ``predicted_time_s`` and ``predicted_memory_bytes``.

    ``collation``: ``padded``, ``packed_rows`` (both travel as rows x length) or ``packed`` (varlen:
    ``cu_seqlens``); default: ``packed`` when a dict has ``cu_seqlens``, else ``padded``."""
    out = []
    for b in microbatches:
        c = collation or _collation_of(b)
        rows, L = b["input_ids"].shape
        t, m = float(b.get("predicted_time_s", 0.0)), float(b.get("predicted_memory_bytes", 0.0))
        if c == "packed":  # an encoder-decoder's targets: a second row (its length crosses stage boundaries)
            dec = b.get("decoder_input_ids")
            T, Nt = (0, 0) if dec is None else (int(b["decoder_max_seqlen"]), int(dec.shape[1]))
            out.append(MicroBatchShape("packed", int(b["cu_seqlens"].numel() - 1), int(b["max_seqlen"]), T, int(L),
                                       t, m, target_tokens=Nt))
        else:
            T = b["decoder_input_ids"].shape[1] if "decoder_input_ids" in b else 0
            out.append(MicroBatchShape(c, int(rows), int(L), int(T), 0, t, m))
    return out


def representative(microbatches: Sequence[dict], k: int = 8) -> list[dict]:
    """Up to ``k`` of a step's micro-batch dicts, spread over their predicted times (shortest to
    longest): the mix a stage split is profiled on. The choice depends on the plan alone, so every
    rank of a replica picks the same micro-batches."""
    mbs = list(microbatches)
    if not mbs:
        return []
    order = np.argsort([float(b["predicted_time_s"]) for b in mbs], kind="stable")
    pick = np.unique(np.linspace(0, len(mbs) - 1, min(int(k), len(mbs))).round().astype(int))
    return [mbs[i] for i in order[pick]]


def stage_cost_model(model, num_stages: int, device: str | DeviceProfile = "cpu", *,
                     packed_attention: str | None = None, pad_multiple: int = 8, forgetting: float = 0.98,
                     prior_strength: float = 1e-3) -> CostModel:
    """The analytic `CostModel` of one pipeline stage of ``model`` (a `LayeredModel`, or a
    `ModelConfig`): the whole model's layers (and decoder or vision layers) divided by ``num_stages``, on a
    device preset name or `DeviceProfile`; the keywords as in `CostModel`. A micro-batch without image
    tiles has no vision cost (the ``n_vis``/``q_vis``/``has_vis`` features are 0). A packed row is priced
    as the model attends it (its ``packed_attention()``) unless ``packed_attention`` says otherwise."""
    if packed_attention is None:
        packed_attention = model.packed_attention() if hasattr(model, "packed_attention") else "varlen"
    kw = dict(packed_attention=packed_attention, pad_multiple=pad_multiple, forgetting=forgetting,
              prior_strength=prior_strength)
    cfg = getattr(model, "config", model)
    extra = {"encoder_decoder": {"decoder_layers": cfg.decoder_layers / num_stages},
             "vision_language": {"vision_layers": cfg.vision_layers / num_stages}}.get(cfg.kind, {})
    one = replace(cfg, layers=cfg.layers / num_stages, **extra)
    return CostModel(one, device_preset(device) if isinstance(device, str) else device, **kw)
