"""The independent reference of the conformance tests: what the plain Hugging Face model computes for a
step, written here from the model's logits and ``torch.nn.functional.cross_entropy``, never through
dynabatch's own loss helpers.

The reference loss of a step is the summed token cross-entropy of every sample of the step (the model's
logits on one padded row per sample; a causal LM predicts token t + 1 at position t; an encoder-decoder's
decoder starts with ``config.decoder_start_token_id`` and is fed the targets shifted right) divided by the
step's target tokens, counted here. No tests are defined here."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def samples_of(mb: dict, seq2seq: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input ids, labels) of every sample of a collated micro-batch, unpadded. Decoder-only: the labels
    line up with the inputs (-100 on the prompt); encoder-decoder: the labels are the target ids. Packed
    micro-batches are split at ``cu_seqlens`` (and ``decoder_cu_seqlens`` for the targets)."""
    if mb.get("is_padding"):
        return []
    if "cu_seqlens" in mb:
        cu = mb["cu_seqlens"].tolist()
        ids = [mb["input_ids"][0, a:b] for a, b in zip(cu[:-1], cu[1:])]
        if not seq2seq:
            return [(i, mb["labels"][0, a:b]) for i, (a, b) in zip(ids, zip(cu[:-1], cu[1:]))]
        ct = mb["decoder_cu_seqlens"].tolist()
        return [(i, mb["labels"][0, a:b]) for i, (a, b) in zip(ids, zip(ct[:-1], ct[1:]))]
    n = mb["attention_mask"].sum(1).tolist()
    if not seq2seq:
        return [(mb["input_ids"][r, :k], mb["labels"][r, :k]) for r, k in enumerate(n)]
    out = []
    for r, k in enumerate(n):
        lab = mb["labels"][r]
        out.append((mb["input_ids"][r, :k], lab[lab != IGNORE]))
    return out


def _padded(rows: list[torch.Tensor], fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(r) for r in rows)
    out = torch.full((len(rows), L), fill, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)], mask[i, :len(r)] = r, 1
    return out, mask


def summed_ce(logits: torch.Tensor, labels: torch.Tensor, shift: bool) -> tuple[torch.Tensor, int]:
    """Sum of token cross-entropies (in the logits' dtype, float32 at least) and the count of terms."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    keep = labels != IGNORE
    return F.cross_entropy(logits[keep], labels[keep], reduction="sum"), int(keep.sum())


def reference_step(model, step: list[dict], extra=None) -> tuple[float, int]:
    """Forward and backward of every sample of ``step`` through the plain ``model`` (one padded batch per
    micro-batch), loss = summed cross-entropy / the step's target tokens. Returns (loss, target tokens);
    the gradients are left in ``model``. ``extra(mb)`` gives more forward inputs of a micro-batch
    (``pixel_values``); with it the micro-batch's own padded rows are used as they are."""
    config = model.config
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    parts, total = [], 0
    for mb in step:
        if mb.get("is_padding"):
            continue
        if extra is not None:
            out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False, **extra(mb))
            parts.append(summed_ce(out.logits, mb["labels"], shift=True))
            continue
        rows = samples_of(mb, seq2seq)
        ids, mask = _padded([r for r, _ in rows], 0)
        if seq2seq:
            start = int(config.decoder_start_token_id)
            targets = [t for _, t in rows]
            dec, dmask = _padded([torch.cat([torch.tensor([start]), t[:-1]]) for t in targets], 0)
            labels, _ = _padded(targets, IGNORE)
            labels = labels.masked_fill(dmask == 0, IGNORE)
            out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dmask,
                        use_cache=False)
            parts.append(summed_ce(out.logits, labels, shift=False))
        else:
            labels, _ = _padded([lab for _, lab in rows], IGNORE)
            labels = labels.masked_fill(mask == 0, IGNORE)
            out = model(input_ids=ids, attention_mask=mask, use_cache=False)
            parts.append(summed_ce(out.logits, labels, shift=True))
    total = sum(n for _, n in parts)
    loss = sum(s for s, _ in parts) / max(total, 1)
    loss.backward()
    return float(loss.detach()), total


def grads_of(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by state-dict name (zeros where it has none)."""
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


def relative_gap(got: dict, want: dict) -> float:
    """max over parameters of ||got - want|| / max(||want||, largest gradient norm * 1e-3)."""
    floor = 1e-3 * max(float(w.norm()) for w in want.values())
    return max(float((got[k] - w).norm()) / max(float(w.norm()), floor) for k, w in want.items())
