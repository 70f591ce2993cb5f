"""Gradient synchronization of a dynabatch step under DDP and FSDP, and what is refused.

A dynabatch step runs the same number of micro-batches on every rank (the loader pads with
placeholders), so every rank enters the same collectives; `no_sync` keeps the gradient
reduction off all micro-batches but the last:

* DDP and FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``): their ``no_sync()``;
* FSDP2 (a module ``torch.distributed.fsdp.fully_shard`` was applied to, torch >= 2.4):
  ``set_requires_gradient_sync(False)`` for the micro-batch, back to True after it. Parameters are
  still all-gathered for every micro-batch's forward and backward (FSDP shards them); only the
  reduce-scatter of the gradients waits for the last micro-batch;
* with an ``accelerate.Accelerator``: ``accelerator.no_sync(model)``, which does the above.

FSDP reduces gradients by their mean over ranks, as DDP does, so `step_backward`'s world-size factor
and ``step.target_tokens`` normalization give the same gradient under both.

Refused, with the reason: ``transformers.Trainer``'s FSDP (``TrainingArguments(fsdp=...)``, accelerate's
FSDP plugin) on the CPU: accelerate 1.x applies the plugin only on accelerators (a CPU run's
distributed type is MULTI_CPU, which ignores it) and the Trainer would train the model with DDP
instead, silently (`check_trainer_fsdp`); a model already sharded by the user under a Trainer whose
accelerator is not FSDP (accelerate would wrap the sharded model again in DDP). DeepSpeed is refused
by `dynabatch.integrations.hf.DynabatchTrainer` (its engine accumulates by itself).
"""

from __future__ import annotations

import contextlib

import torch


def is_fsdp2(model) -> bool:
    """Whether ``model`` is an FSDP2 module (``fully_shard`` was applied to it)."""
    return callable(getattr(model, "set_requires_gradient_sync", None))


def is_sharded(model) -> bool:
    """Whether ``model`` or a submodule is FSDP-sharded (FSDP1 wrapper or FSDP2 module)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) or is_fsdp2(m) for m in model.modules())


@contextlib.contextmanager
def _fsdp2_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def no_sync(model, accelerator=None):
    """The context that keeps ``model``'s gradients from being reduced across ranks during one
    micro-batch (see the module docstring); a null context for a model without data parallelism."""
    if accelerator is not None:
        return accelerator.no_sync(model)
    if is_fsdp2(model):
        return _fsdp2_no_sync(model)
    if hasattr(model, "no_sync"):  # DDP, FSDP1
        return model.no_sync()
    return contextlib.nullcontext()


def check_trainer_fsdp(args, accelerator, model) -> None:
    """Refuse what `dynabatch.integrations.hf.DynabatchTrainer` cannot run as asked (see the module
    docstring): ``args.fsdp`` on a run whose accelerator is not FSDP, and a model sharded beforehand
    under such an accelerator."""
    fsdp_state = getattr(accelerator.state, "fsdp_plugin", None) is not None
    asked = bool(getattr(args, "fsdp", None)) or getattr(args, "fsdp_plugin_args", None) is not None
    if asked and not fsdp_state:
        raise NotImplementedError(
            "TrainingArguments(fsdp=...) was set, but the accelerator is not running FSDP (distributed type "
            f"{accelerator.distributed_type}): accelerate applies its FSDP plugin only on accelerators (GPU, NPU, XPU...), "
            "so on the CPU the Trainer would train with DDP instead. On a CPU, shard the model yourself with "
            "torch.distributed.fsdp.fully_shard and train it with dynabatch.integrations.step_backward, or drop fsdp=")
    if not fsdp_state and model is not None and is_sharded(model):
        raise NotImplementedError(
            "the model is already FSDP-sharded but the Trainer's accelerator does not run FSDP: accelerate would wrap "
            "it again in DDP. Let the Trainer shard it (TrainingArguments(fsdp=..., fsdp_config={'version': 2}) on "
            "accelerators), or train the sharded model with dynabatch.integrations.step_backward")


def local_shard(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient as a plain tensor: an FSDP2 gradient is a sharded ``DTensor``
    (``to_local()``: no communication), any other gradient is itself. Whether every rank's part is
    finite is what the non-finite check reduces over the ranks."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


__all__ = ["check_trainer_fsdp", "is_fsdp2", "is_sharded", "local_shard", "no_sync"]
