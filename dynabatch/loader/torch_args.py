"""``torch.utils.data.DataLoader``'s signature on `dynabatch.DataLoader`.

A torch user writes ``DataLoader(dataset, 64, shuffle=True, num_workers=2)``; `torch_keywords`
names those positional arguments and maps each torch argument onto what dynabatch means by it, or
refuses it with a message saying what to use instead:

* ``batch_size``: samples per step *on this rank*, as in torch; the step over all ranks holds
  ``batch_size * world_size`` samples (``global_batch_size``), which the planner spreads over the
  ranks by cost (so one rank's share of a step varies around ``batch_size``).
* ``shuffle``: `PlanOptions.shuffle` (default True: a seeded permutation each epoch; ``seed=``
  instead of ``generator=``).
* ``drop_last``, ``num_workers``, ``pin_memory``, ``timeout``, ``worker_init_fn``,
  ``multiprocessing_context``, ``prefetch_factor``, ``persistent_workers``: as in torch.
* ``sampler``, ``batch_sampler``, ``collate_fn``, ``generator``, ``pin_memory_device``,
  ``in_order=False``: refused (dynabatch samples, batches and collates itself).
"""

from __future__ import annotations

#: torch.utils.data.DataLoader's positional parameters after ``dataset``, in order.
TORCH_POSITIONAL: tuple[str, ...] = (
    "batch_size", "shuffle", "sampler", "batch_sampler", "num_workers", "collate_fn", "pin_memory", "drop_last",
    "timeout", "worker_init_fn", "multiprocessing_context", "generator",
)

_REFUSED = {
    "sampler": "dynabatch draws the samples of each step itself (a seeded permutation, cut by tokens or "
               "samples); use shuffle=/seed= for the order and rank=/world_size= (default: torch.distributed) "
               "for distribution instead of a DistributedSampler",
    "batch_sampler": "dynabatch forms the batches itself from their measured cost; give the step size with "
                     "batch_size= (samples per rank), global_batch_size= or global_batch_tokens=",
    "collate_fn": "dynabatch collates micro-batches itself, shaped like the Hugging Face collators; choose the "
                  "layout with collate='padded', 'packed' (varlen, HF flash-attention keys) or 'packed_rows', and "
                  "transform batches in the training loop",
    "generator": "the order comes from seed= (epoch e uses seed + e), the same on every rank",
}


def torch_keywords(args: tuple, kwargs: dict, options=None) -> dict:
    """``kwargs`` with torch's positional arguments (``args``, after the dataset) named and torch's
    arguments mapped to dynabatch's (see the module docstring). Raises TypeError or ValueError
    naming the argument and what to use instead."""
    out = dict(kwargs)
    if len(args) > len(TORCH_POSITIONAL):
        raise TypeError(f"DataLoader takes at most {len(TORCH_POSITIONAL) + 1} positional arguments (dataset, "
                        f"{', '.join(TORCH_POSITIONAL)}), got {len(args) + 1}")
    for name, value in zip(TORCH_POSITIONAL, args):
        if name in out:
            raise TypeError(f"DataLoader got multiple values for argument {name!r}")
        out[name] = value
    for name, why in _REFUSED.items():
        if out.pop(name, None) is not None:
            raise TypeError(f"DataLoader does not take {name}=: {why}")
    if out.pop("in_order", True) is not True:
        raise ValueError("DataLoader does not take in_order=False: steps come in order so that every rank runs the "
                         "same step at the same time")
    if out.pop("pin_memory_device", "") not in ("", None):
        raise ValueError("DataLoader does not take pin_memory_device=: with pin_memory=True batches are pinned for "
                         "the current CUDA device")
    if out.get("shuffle") is None:
        out.pop("shuffle", None)
    elif not isinstance(out["shuffle"], bool):
        raise TypeError(f"shuffle must be True or False, got {out['shuffle']!r}")
    batch_size = out.pop("batch_size", None)
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive number of samples per rank, got {batch_size!r}")
        given = [k for k in ("global_batch_size", "global_batch_tokens", "batch_tokens") if out.get(k) is not None]
        if given or options is not None:
            raise TypeError(f"batch_size= (samples per step on each rank) and {given or ['options']} both give the "
                            "step size; give one")
        from .options import resolve_layout

        _, world_size = resolve_layout(out.get("rank"), out.get("world_size"))
        out["global_batch_size"] = batch_size * world_size
    return out


__all__ = ["TORCH_POSITIONAL", "torch_keywords"]
