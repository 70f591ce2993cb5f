"""The default loss of a dynabatch step's micro-batch: the summed token loss / the step's target tokens,
whatever the model's own ``forward(labels=...)`` computes.

Hugging Face models differ: a causal LM (Llama, Mistral, Qwen2, Gemma, LLaVA, ...) routes
``num_items_in_batch`` into its loss and returns ``sum / num_items_in_batch``; T5, BART and other
seq2seq models of transformers 5.x take the same ``**kwargs`` but return the **mean over the
micro-batch**, whatever ``num_items_in_batch`` says. Summing those means over a step's micro-batches
gives a loss several times too large that depends on how the step was split. The signature cannot
tell the two apart (both have ``**kwargs: Unpack[TransformersKwargs]``), so `loss_route` decides, once
per model, as follows (never by family name):

1. the model's ``accepts_loss_kwargs`` attribute, when it has one (what ``transformers.Trainer`` reads);
2. a forward without ``num_items_in_batch`` and without ``**kwargs`` does not take it;
3. otherwise the model's behaviour on the first micro-batch whose loss tokens differ from
   ``num_items_in_batch``: its loss is compared with the summed cross-entropy of its own logits / n
   (``"model"``: it honours it) and with that sum / the micro-batch's tokens (``"logits"``: a mean).
   A loss that is neither (an auxiliary loss, label smoothing) is an error asking for ``loss_fn``.

On the ``"logits"`` route the loss is computed from the model's logits (`summed_cross_entropy`) and
the model is called without ``labels`` (so it does not compute a loss that is thrown away).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping

import torch

from ..loader.token_loss import summed_cross_entropy

#: Relative gap within which the model's loss is taken to equal a candidate (float32 sums of
#: thousands of tokens agree to ~1e-6; the candidates differ by ``n / tokens``, checked >= 2%).
_AGREE_RTOL = 1e-3
_DISTINCT = 0.02

_ROUTES: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()


def unwrap(model) -> torch.nn.Module:
    """The user's model inside DDP / FSDP / accelerate / torch.compile wrappers (``.module``,
    ``._orig_mod``), whose config and forward signature say what it computes."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            break
        model = inner
    return model


def _is_seq2seq(model) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def _declared_route(model) -> str | None:
    """``"model"`` / ``"logits"`` when the model says so (attribute or signature), else None."""
    said = getattr(model, "accepts_loss_kwargs", None)
    if isinstance(said, bool):
        return "model" if said else "logits"
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    if "num_items_in_batch" in params:
        return "model"
    if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return "logits"
    return None


def loss_route(model) -> str | None:
    """How `model_loss` computes ``model``'s loss: ``"model"`` (its own loss, given
    ``num_items_in_batch``), ``"logits"`` (summed cross-entropy of its logits), or None (not decided
    yet: decided on the next micro-batch that can tell them apart)."""
    inner = unwrap(model)
    return _ROUTES.get(inner) or _declared_route(inner)


def _without_labels(inputs: Mapping, seq2seq: bool) -> dict:
    # an encoder-decoder without decoder inputs makes them from the labels: keep those then
    if seq2seq and "decoder_input_ids" not in inputs:
        return dict(inputs)
    return {k: v for k, v in inputs.items() if k != "labels"}


def _refuse_packed_seq2seq(model, inputs: Mapping) -> None:
    if _is_seq2seq(model) and "attention_mask" not in inputs and "position_ids" in inputs:
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder and this micro-batch is packed (one row, no attention "
            "mask): Hugging Face's T5/BART attend across the samples of a packed row, so the loss would mix them. "
            "Build the DataLoader with collate='padded' for this model (dynabatch's pipeline adapters run packed "
            "seq2seq rows themselves)")


def model_loss(model, inputs: Mapping, num_items_in_batch: int) -> torch.Tensor:
    """The default ``loss_fn`` of `step_backward`: the micro-batch's summed token cross-entropy (nats)
    divided by ``num_items_in_batch`` (the step's target tokens), a float scalar tensor.

    The model's own loss is used where it honours ``num_items_in_batch``; where it returns a
    per-micro-batch mean (T5, BART in transformers 5.x) the loss is computed from its logits instead
    (see the module docstring for how that is decided)."""
    inner = unwrap(model)
    _refuse_packed_seq2seq(inner, inputs)
    route = loss_route(inner)
    seq2seq = _is_seq2seq(inner)
    if route == "model":
        return model(**inputs, num_items_in_batch=num_items_in_batch).loss
    if route == "logits":
        logits = model(**_without_labels(inputs, seq2seq)).logits
        return summed_cross_entropy(logits, inputs["labels"], shift=not seq2seq)[0] / num_items_in_batch
    out = model(**inputs, num_items_in_batch=num_items_in_batch)
    total, tokens = summed_cross_entropy(out.logits, inputs["labels"], shift=not seq2seq)
    own = total / num_items_in_batch
    tokens = int(tokens)
    if tokens == 0 or abs(num_items_in_batch / tokens - 1) < _DISTINCT:
        return own  # the two readings agree here: decide on a later micro-batch
    theirs, mean = float(out.loss.detach()), float(total.detach()) / tokens
    if abs(theirs - float(own.detach())) <= _AGREE_RTOL * abs(float(own.detach())):
        _ROUTES[inner] = "model"
        return out.loss
    if abs(theirs - mean) <= _AGREE_RTOL * abs(mean):
        _ROUTES[inner] = "logits"
        return own
    raise ValueError(
        f"{type(inner).__name__}'s loss ({theirs:.6g}) is neither its summed token cross-entropy / num_items_in_batch "
        f"({float(own.detach()):.6g}) nor its mean over the micro-batch ({mean:.6g}): it adds something of its own "
        "(an auxiliary loss, label smoothing). Pass step_backward(loss_fn=...) / DynabatchTrainer("
        "compute_loss_func=...) returning the summed per-token loss / num_items_in_batch")


__all__ = ["loss_route", "model_loss", "unwrap"]
