"""Do a user's own micro-batches train the same on each route as the plain Hugging Face model? One step of
``DATA`` through the `DataLoader` (the model folder gives the family, decoder start, vision settings), its
loss and every gradient on each route against a reference computed here from the plain model's logits.

Reference: ``model(...)`` of ``from_pretrained`` on every sample of the step (padded micro-batches as they
are; packed ones one sample per forward; an encoder-decoder's decoder inputs made here from its targets and
``config.decoder_start_token_id``), ``torch.nn.functional.cross_entropy`` summed over the step's target
tokens, divided by their count. Routes:

* ``step_backward``: `dynabatch.integrations.step_backward` (what ``DynabatchTrainer`` and accelerate loops run);
* ``pipeline``: the pipeline adapters' stages (`from_hf`, the split of ``--num-stages``), run one after the other
  in this process as the ranks run them (each stage's output is what it would send).

The whole model is loaded in this process (three copies): for a model larger than memory check a smaller
config of the same family.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: (loss, gradient) relative tolerances by parameter dtype: float32 sums in other orders (padding, stage
#: boundaries) differ in the last bits; float64 keeps Hugging Face's float32 loss upcast (~1e-7)
TOLERANCE = {torch.float64: (1e-5, 1e-5), torch.float32: (1e-4, 2e-3)}


@dataclass(frozen=True)
class RouteResult:
    """One route's agreement with the reference: losses (nats per target token) and the largest relative
    gradient gap over parameters (``||g - g_ref|| / max(||g_ref||, 1e-3 max ||g_ref||)``)."""

    route: str
    loss: float
    ref_loss: float
    grad_gap: float
    rtol: tuple[float, float]

    @property
    def ok(self) -> bool:
        return abs(self.loss - self.ref_loss) <= self.rtol[0] * abs(self.ref_loss) and self.grad_gap <= self.rtol[1]

    def line(self) -> str:
        gap = abs(self.loss - self.ref_loss) / max(abs(self.ref_loss), 1e-30)
        return (f"{self.route:<14} loss {self.loss:.6f} vs {self.ref_loss:.6f} (gap {gap:.1e}, tolerance "
                f"{self.rtol[0]:.0e}), gradients gap {self.grad_gap:.1e} (tolerance {self.rtol[1]:.0e}): "
                + ("agrees" if self.ok else "DISAGREES"))


def _hf_model(folder, dtype):
    from ..pipeline.models.hf.build import model_class
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(folder))
    return model_class(cfg).from_pretrained(str(folder), dtype=dtype).train()


def _ce(logits, labels, shift: bool) -> tuple[torch.Tensor, int]:
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    keep = labels != -100
    return F.cross_entropy(logits[keep].to(torch.promote_types(logits.dtype, torch.float32)), labels[keep],
                           reduction="sum"), int(keep.sum())


def _reference_terms(model, mb: dict) -> list[tuple[torch.Tensor, int]]:
    """(summed loss, tokens) of a micro-batch through the plain model, built here from its samples."""
    cfg = model.config
    if getattr(cfg, "is_encoder_decoder", False):
        if "cu_seqlens" in mb:  # packed: inputs in one row, targets in another
            cu, ct = mb["cu_seqlens"].tolist(), mb["decoder_cu_seqlens"].tolist()
            samples = [(mb["input_ids"][0, a:b], mb["labels"][0, c:d])
                       for a, b, c, d in zip(cu[:-1], cu[1:], ct[:-1], ct[1:])]
        else:
            samples = [(mb["input_ids"][r, :n], mb["labels"][r][mb["labels"][r] != -100])
                       for r, n in enumerate(mb["attention_mask"].sum(1).tolist())]
        out = []
        start = int(cfg.decoder_start_token_id)
        for ids, target in samples:
            dec = torch.cat([target.new_tensor([start]), target[:-1]])[None]
            o = model(input_ids=ids[None], decoder_input_ids=dec, use_cache=False)
            out.append(_ce(o.logits, target[None], shift=False))
        return out
    if "cu_seqlens" in mb:  # packed: every sample alone
        cu = mb["cu_seqlens"].tolist()
        return [_ce(model(input_ids=mb["input_ids"][:, a:b], use_cache=False).logits, mb["labels"][:, a:b], True)
                for a, b in zip(cu[:-1], cu[1:])]
    extra = {}
    if "pixel_values" in mb and "image_tiles" in mb and int(mb["image_tiles"].sum()):
        extra["pixel_values"] = mb["pixel_values"].to(next(model.parameters()).dtype)
    o = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False, **extra)
    return [_ce(o.logits, mb["labels"], shift=True)]


def _grads(named) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in named if p.grad is not None}


def _gap(got: dict, want: dict) -> float:
    if not want:
        return float("inf")
    floor = 1e-3 * max(float(w.norm()) for w in want.values())
    missing = set(want) - set(got)
    if missing:
        return float("inf")
    return max(float((got[k] - w).norm()) / max(float(w.norm()), floor, 1e-30) for k, w in want.items())


def _pipeline_route(folder, step, bounds, dtype) -> tuple[float, dict]:
    from ..pipeline.models.hf import from_hf
    from ..pipeline.models.partition import split_model

    model = from_hf(folder, dtype=dtype)
    stages = split_model(model.layers, bounds)
    total, tokens = 0.0, 0
    for mb in step:
        x = None
        for stage in stages:  # each stage gets what the previous one sends
            x = stage(x, mb)
        loss_sum, n = x
        (loss_sum / step.target_tokens).backward()
        total, tokens = total + float(loss_sum.detach()), tokens + int(n)
    grads = {}
    for i in range(len(model.layers)):
        for path, key in model.param_keys(i).items():
            p = model.layers[i].get_parameter(path)
            if p.grad is not None and key not in grads:
                grads[key] = p.grad.detach().clone()
    return total / max(step.target_tokens, 1), grads


def route_agreement(folder, step, *, bounds, dtype=torch.float32) -> list[RouteResult]:
    """`RouteResult` of each route for one `Step` of the user's data (see the module docstring)."""
    from ..integrations import step_backward

    ref = _hf_model(folder, dtype)
    terms = [t for mb in step if not mb.get("is_padding") for t in _reference_terms(ref, mb)]
    tokens = sum(n for _, n in terms)
    if tokens != step.target_tokens:
        raise ValueError(f"the step counts {step.target_tokens} target tokens but its samples hold {tokens}: the "
                         "loader's labels do not match the model's loss")
    ref_loss = sum(s for s, _ in terms) / max(tokens, 1)
    ref_loss.backward()
    want = _grads(ref.named_parameters())
    rtol = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    out = []
    packed_seq2seq = "cu_seqlens" in step[0] and getattr(ref.config, "is_encoder_decoder", False)
    if not packed_seq2seq:  # (step_backward refuses packed encoder-decoder rows: Hugging Face mixes them)
        mine = _hf_model(folder, dtype)
        loss = float(step_backward(mine, step).detach())
        out.append(RouteResult("step_backward", loss, float(ref_loss.detach()), _gap(_grads(mine.named_parameters()), want),
                               rtol))
    loss, grads = _pipeline_route(folder, step, bounds, dtype)
    out.append(RouteResult(f"pipeline x{len(bounds) - 1}", loss, float(ref_loss.detach()), _gap(grads, want), rtol))
    return out


__all__ = ["RouteResult", "TOLERANCE", "route_agreement"]
