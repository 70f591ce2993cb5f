"""``torch.utils.data.DataLoader``'s arguments on `dynabatch.DataLoader`.

A torch user writes ``DataLoader(dataset, 64, shuffle=True, num_workers=2)``; the DataLoader takes
torch's arguments in torch's order and maps each onto what dynabatch means by it, or refuses it
with a message saying what to use instead:

* ``batch_size``: samples per step *on this rank*, as in torch; the step over all ranks holds
  ``batch_size * world_size`` samples (``PlanOptions.global_batch_size``), which the planner
  spreads over the ranks by cost (so one rank's share of a step varies around ``batch_size``).
* ``shuffle``, ``drop_last``: `PlanOptions.shuffle` / ``drop_last`` (shuffle default True: a
  seeded permutation each epoch; ``PlanOptions(seed=)`` instead of ``generator=``).
* ``num_workers``, ``pin_memory``, ``timeout``, ``worker_init_fn``, ``multiprocessing_context``
  (fork, spawn or forkserver), ``prefetch_factor``, ``persistent_workers``: as in torch
  (`dynabatch.loader.settings.Workers`).
* ``sampler``, ``batch_sampler``, ``collate_fn``, ``generator``, ``pin_memory_device``,
  ``in_order=False``: refused (dynabatch samples, batches and collates itself).
"""

from __future__ import annotations

_REFUSED = {
    "sampler": "dynabatch draws the samples of each step itself (a seeded permutation, cut by tokens or "
               "samples); use shuffle=/PlanOptions(seed=) for the order and Runtime(rank=, world_size=) (default: "
               "torch.distributed) for distribution instead of a DistributedSampler",
    "batch_sampler": "dynabatch forms the batches itself from their measured cost; give the step size with "
                     "batch_size= (samples per rank) or options=PlanOptions(global_batch_size=/global_batch_tokens=)",
    "collate_fn": "dynabatch collates micro-batches itself, shaped like the Hugging Face collators; choose the "
                  "layout with costing=Costing(collate='padded'|'packed'|'packed_rows') and transform batches in "
                  "the training loop",
    "generator": "the order comes from PlanOptions(seed=) (epoch e uses seed + e), the same on every rank",
}


def refuse_torch_arguments(*, sampler, batch_sampler, collate_fn, generator, pin_memory_device, in_order) -> None:
    """TypeError/ValueError for torch arguments dynabatch does itself, naming what to use instead."""
    given = {"sampler": sampler, "batch_sampler": batch_sampler, "collate_fn": collate_fn, "generator": generator}
    for name, value in given.items():
        if value is not None:
            raise TypeError(f"DataLoader does not take {name}=: {_REFUSED[name]}")
    if in_order is not True:
        raise ValueError("DataLoader does not take in_order=False: steps come in order so that every rank runs the "
                         "same step at the same time")
    if pin_memory_device not in ("", None):
        raise ValueError("DataLoader does not take pin_memory_device=: with pin_memory=True batches are pinned for "
                         "the current CUDA device")


def torch_planning(batch_size, shuffle, drop_last, rank, world_size) -> dict:
    """The `PlanOptions` fields torch's ``batch_size`` / ``shuffle`` / ``drop_last`` give (those not None)."""
    out = {}
    if shuffle is not None:
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be True or False, got {shuffle!r}")
        out["shuffle"] = shuffle
    if drop_last is not None:
        if not isinstance(drop_last, bool):
            raise TypeError(f"drop_last must be True or False, got {drop_last!r}")
        out["drop_last"] = drop_last
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive number of samples per rank, got {batch_size!r}")
        from .options import resolve_layout

        out["global_batch_size"] = batch_size * resolve_layout(rank, world_size)[1]
    return out


__all__ = ["refuse_torch_arguments", "torch_planning"]
