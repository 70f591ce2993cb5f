"""One dynabatch `Step` = one optimizer step: forward and backward every micro-batch of the step
with the loss normalized by the step's real target tokens.

`step_backward` is the one place where dynabatch's per-step loss normalization lives; the
`transformers.Trainer` subclass (`dynabatch.integrations.hf.DynabatchTrainer`) and hand-written
``accelerate`` loops both call it. The rule: each micro-batch's loss is the SUM of its per-token
losses divided by ``step.target_tokens`` (the loss labels of the whole step over all ranks and
micro-batches), times the data-parallel world size because DDP/FSDP average gradients over ranks.
Summing the backward passes of the step's micro-batches then gives the gradient of the mean loss
per target token of the whole global batch, however the samples were grouped. A per-micro-batch
mean (what ``model(...).loss`` returns without ``num_items_in_batch``) would weigh the tokens of
small micro-batches more.

Loss functions follow Hugging Face's convention: ``loss_fn(model, inputs, num_items_in_batch)``
returns ``sum of per-token losses / num_items_in_batch``, which is what ``Trainer``'s
``compute_loss_func`` returns and what the default `model_loss` gives for every Hugging Face model
(from the model's own loss where it honours ``num_items_in_batch``, from its logits where it returns a
per-micro-batch mean, as T5 and BART do: `dynabatch.integrations.loss`). A
placeholder micro-batch (``is_padding``: every label -100, run so that every rank does the same
number of forward/backward passes) then has a loss of exactly 0 and adds nothing to the gradient.

Only torch is needed here (``accelerate`` is optional: pass an ``Accelerator`` to use its
``backward`` and ``no_sync``).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence

import torch

from ..loader.collate import model_inputs
from .fsdp import is_sharded, local_shard, no_sync
from .loss import model_loss
from .timing import MicroBatchTimer

#: How a step with a non-finite loss or gradient norm is handled (`step_backward`'s ``nonfinite``).
NONFINITE = ("raise", "skip")


class NonFiniteStep(FloatingPointError):
    """A step whose loss or gradient norm is not finite (NaN or inf): the message names the step and
    the micro-batch; nothing of the step reached the weights if the caller stops there."""


#: skipped steps per model (``nonfinite="skip"``), read by `skipped_steps`
_SKIPPED: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()


def skipped_steps(model) -> int:
    """Steps `step_backward` skipped for ``model`` because of non-finite numbers (``nonfinite="skip"``)."""
    from .loss import unwrap

    return _SKIPPED.get(unwrap(model), 0)


def step_target_tokens(step: Sequence[Mapping]) -> int:
    """Real target (loss) tokens of the whole step over all ranks: ``step.target_tokens`` of a
    `dynabatch.Step`, else the first micro-batch's ``step_target_tokens`` (a plain list of
    micro-batch dicts works too)."""
    n = getattr(step, "target_tokens", None)
    if n is None:
        if not len(step):
            return 0
        n = step[0]["step_target_tokens"]
    return int(n)


def _data_parallel_size(accelerator) -> int:
    if accelerator is not None:
        return int(accelerator.num_processes)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_world_size())
    return 1


def _model_device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _to_device(inputs: Mapping, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def step_backward(model, step: Sequence[Mapping], *, accelerator=None,
                  loss_fn: Callable[..., torch.Tensor] | None = None, world_size: int | None = None,
                  prepare: Callable[[dict], dict] | None = None, nonfinite: str = "raise",
                  feedback=None) -> torch.Tensor:
    """Forward and backward all micro-batches of one dynabatch step; call ``optimizer.step()``
    after it (it neither steps nor zeroes the gradients).

    Each micro-batch ``mb`` runs ``loss_fn(model, prepare(model_inputs(mb)), step.target_tokens)``
    (default `model_loss`: the micro-batch's summed per-token loss / the step's target tokens, from the
    model's own loss where it honours ``num_items_in_batch``, else from its logits), multiplied by
    ``world_size``, and backward. All
    micro-batches but the last run under ``accelerator.no_sync(model)`` (or, for a bare DDP, FSDP1 or
    FSDP2 model, its own: `dynabatch.integrations.fsdp.no_sync`), so gradients are reduced once per
    step. After the call the accumulated gradient is that of the mean loss per target token over the
    whole global batch (all ranks).

    Args:
        model: the model, prepared by ``accelerator.prepare`` / wrapped in DDP or FSDP (``fully_shard``)
            when distributed.
        step: a `dynabatch.Step` (this rank's micro-batch dicts with ``target_tokens``); a plain
            list of micro-batch dicts works too (``step_target_tokens`` is read from them).
        accelerator: an ``accelerate.Accelerator`` (backward, no_sync, device, world size); its
            ``gradient_accumulation_steps`` must be 1 (the accumulation happens here, inside the
            step: do not also wrap the call in ``accelerator.accumulate``). None: plain
            ``loss.backward()`` and the model's own gradient-sync switch when it has one.
        loss_fn: ``(model, inputs, num_items_in_batch) -> loss`` returning the micro-batch's summed
            per-token loss divided by ``num_items_in_batch`` (Hugging Face's convention); it must
            give exactly 0 for a placeholder micro-batch (all labels -100), which a summed loss does.
        world_size: data-parallel ranks whose gradients are averaged (default: the
            accelerator's ``num_processes``, else ``torch.distributed``'s world size, else 1).
        prepare: maps the model inputs of a micro-batch to what ``loss_fn`` gets (default: move the
            tensors to the accelerator's device, else to the model's).
        nonfinite: ``"raise"`` (default): a NaN/inf loss of a micro-batch or a non-finite gradient norm
            after the step raises `NonFiniteStep` naming the step and the micro-batch; ``"skip"``: the
            step's gradients are dropped (``grad = None``, so ``optimizer.step()`` changes nothing), a
            warning says so and `skipped_steps` counts it (mixed-precision runs). The check costs one
            gradient norm and one host sync per step (plus a one-element all-reduce when distributed,
            so that every rank decides the same).
        feedback: a `dynabatch.integrations.feedback.StepFeedback` over the loader the step came from:
            each micro-batch's forward and backward are timed (`dynabatch.integrations.timing`), the
            times of every rank gathered (one small collective per step) and fed to the loader's
            `FeedbackLoop`, and the step's `StepMetrics` kept in ``feedback.last``. None: nothing timed.

    Returns:
        The detached sum of the backpropagated losses: this rank's share of the step's loss per
        target token, times ``world_size`` (averaged over ranks it is the step's mean loss per
        target token, in nats; on one rank it is that mean itself).
    """
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite={nonfinite!r}: use one of {NONFINITE}")
    if accelerator is not None and int(getattr(accelerator, "gradient_accumulation_steps", 1)) != 1:
        raise ValueError(
            f"the accelerator has gradient_accumulation_steps={accelerator.gradient_accumulation_steps}; it would "
            "divide every loss by it, but a dynabatch step already accumulates over its micro-batches: create the "
            "Accelerator with gradient_accumulation_steps=1 (the default)")
    loss_fn = model_loss if loss_fn is None else loss_fn
    if prepare is None:
        device = accelerator.device if accelerator is not None else _model_device(model)
        prepare = lambda inputs: _to_device(inputs, device)  # noqa: E731
    scale = _data_parallel_size(accelerator) if world_size is None else int(world_size)
    # a step without loss tokens (e.g. only prompts) gives 0 / 1 = 0, not 0 / 0
    num_items = max(step_target_tokens(step), 1)
    device = accelerator.device if accelerator is not None else _model_device(model)
    # the last micro-batch's backward reduces the gradients: with several ranks it also waits for them
    timer = None if feedback is None else MicroBatchTimer(len(step), device, len(step) - 1 if scale > 1 else None,
                                                          lockstep=scale > 1 and is_sharded(model))
    total, losses = None, []
    for i, mb in enumerate(step):
        sync = contextlib.nullcontext() if i == len(step) - 1 else no_sync(model, accelerator)
        with sync:
            mark = timer.start() if timer is not None else None
            loss = loss_fn(model, prepare(model_inputs(mb)), num_items) * scale
            if timer is not None:
                timer.forward_done(i, mark)
            if mb.get("is_padding") and loss.detach().abs().item() != 0:
                raise ValueError("loss_fn gave a nonzero loss on a placeholder micro-batch (all labels -100): it must "
                                 "return the summed per-token loss / num_items_in_batch, not a per-micro-batch mean")
            mark = timer.start() if timer is not None else None
            if accelerator is not None:
                accelerator.backward(loss)
            else:
                loss.backward()
            if timer is not None:
                timer.backward_done(i, mark)
        losses.append(loss.detach())
        total = loss.detach() if total is None else total + loss.detach()
    if total is None:
        total = torch.zeros((), device=device)
    else:
        _check_finite(model, step, losses, nonfinite)
    if feedback is not None:
        feedback.record(step, timer, total)
    return total


def _check_finite(model, step, losses: list[torch.Tensor], nonfinite: str) -> None:
    """Raise `NonFiniteStep` (or drop the step's gradients, ``"skip"``) when a micro-batch's loss or the
    step's gradient norm is not finite; every rank takes the same decision (the gradients are the
    all-reduced ones, the loss flags are reduced with MIN)."""
    grads = [local_shard(p.grad) for p in model.parameters() if p.grad is not None]  # FSDP2: this rank's shard
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])) if grads \
        else torch.zeros((), device=losses[0].device)
    finite = torch.isfinite(torch.stack(losses)).to(torch.int32)
    ok = torch.cat([finite, torch.isfinite(norm).reshape(1).to(torch.int32)]).to(norm.device)
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        flag = ok.min().reshape(1)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        everyone = bool(flag.item())
    else:
        everyone = bool(ok.min().item())
    if everyone:
        return
    bad = [i for i, f in enumerate(finite.tolist()) if not f]
    where = getattr(step, "step", None)
    what = (f"step {where}" if where is not None else "this step") + (
        f" (rank {step.rank})" if getattr(step, "rank", None) is not None else "")
    if bad:
        cause = f"micro-batch {bad[0]} of {len(losses)} has loss {float(losses[bad[0]]):g}"
    elif not bool(torch.isfinite(norm)):
        cause = f"the gradient norm is {float(norm):g} (every micro-batch's loss is finite)"  # FSDP2: of the shard
    else:
        cause = "another rank's loss or gradients are not finite"
    if nonfinite == "raise":
        raise NonFiniteStep(f"{what}: {cause}. The weights were not updated by this step; look for damaged "
                            "weights or data, lower the learning rate, or pass nonfinite='skip' to skip such steps")
    from .loss import unwrap

    for p in model.parameters():
        p.grad = None
    inner = unwrap(model)
    _SKIPPED[inner] = _SKIPPED.get(inner, 0) + 1
    warnings.warn(f"{what} skipped: {cause} ({_SKIPPED[inner]} skipped so far)", RuntimeWarning, stacklevel=3)


__all__ = ["NONFINITE", "NonFiniteStep", "model_loss", "skipped_steps", "step_backward", "step_target_tokens"]
