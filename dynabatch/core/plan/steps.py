"""The one way steps are formed and planned, online (the `DataLoader`) and offline (``dynabatch plan``).

* `sample_tokens`: what one sample weighs when global batches are cut: main + decoder tokens after
  truncation to ``max_len``/``max_target_len`` (or 1 per sample when the batch is given in samples).
* `global_batches`: epoch ``e`` is a seeded permutation of every sample (seed ``options.seed + e``;
  sample-id order when ``options.shuffle`` is False)
  cut each time a batch reaches ``global_batch_tokens`` (or ``global_batch_size`` samples).
* `plan_step`: the `BatchPlan` of one global batch with every rank given the same number of
  micro-batches; a batch that cannot be cut so (typically an epoch's small last one) is planned
  with unequal counts and the loader pads the short ranks with placeholder micro-batches; a batch
  of fewer samples than ranks is planned on as many ranks as it has samples.

Steps are numbered from 0 across epochs. A plan file written by ``dynabatch plan`` holds exactly
the plans these functions make, which is what lets a loader replay it byte for byte.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..batchplan import BatchPlan
from ..cost.model import CostModel
from ..options import PlanOptions
from .planner import NoEqualSplitError, plan_microbatches, split_global_batches
from ..shapes import Shapes


def sample_tokens(shapes: Shapes, cost: CostModel, options: PlanOptions) -> np.ndarray:
    """Weight of each sample in the global-batch cut (int64): tokens after truncation, or ones when
    the global batch is given in samples."""
    if options.global_batch_size is not None:
        return np.ones(len(shapes), np.int64)
    main, dec, _ = cost.sample_dims(shapes, options.max_len, options.max_target_len)
    return (main + dec).astype(np.int64)


def global_batches(shapes: Shapes, cost: CostModel, options: PlanOptions, epoch: int = 0) -> list[np.ndarray]:
    """Positions (into ``shapes``) of each global batch of ``epoch`` (see the module docstring)."""
    options.require_batch()
    size = options.global_batch_tokens if options.global_batch_size is None else options.global_batch_size
    return split_global_batches(shapes, int(size), seed=options.epoch_seed(epoch),
                                tokens=sample_tokens(shapes, cost, options), drop_last=options.drop_last,
                                shuffle=options.shuffle)


def oversized_samples(shapes: Shapes, cost: CostModel, options: PlanOptions) -> str | None:
    """A one-line warning when samples weigh more than the global batch in tokens (each such sample
    then forms a step of its own, over ``global_batch_tokens``), else None."""
    if options.global_batch_tokens is None or not len(shapes):
        return None
    tok = sample_tokens(shapes, cost, options)
    over = int(np.count_nonzero(tok > options.global_batch_tokens))
    if not over:
        return None
    return (f"global_batch_tokens={options.global_batch_tokens} is smaller than {over} of {len(shapes)} samples "
            f"(after truncation; the longest has {int(tok.max())} tokens): each of them is a step of its own, over "
            f"the budget; raise global_batch_tokens above {int(tok.max())} or lower max_len")


def num_global_batches(num_samples: int, options: PlanOptions) -> int | None:
    """Steps of an epoch when it is known without cutting (batches in samples), else None."""
    if options.global_batch_size is None:
        return None
    full, rest = divmod(int(num_samples), int(options.global_batch_size))
    return full + (1 if rest and not options.drop_last else 0)


def plan_step(shapes: Shapes, cost: CostModel, options: PlanOptions, positions, step: int) -> BatchPlan:
    """The `BatchPlan` of the global batch at ``positions`` (into ``shapes``), numbered ``step``.

    ``options.num_ranks`` is the world size; the memory limit defaults to the cost model's for that
    world size. The plan has ``min(num_ranks, samples)`` ranks (see the module docstring)."""
    positions = np.asarray(positions, np.int64)
    batch = shapes.take(positions)
    ranks = min(options.num_ranks, len(positions))
    limit = options.memory_limit
    if limit is None:
        limit = cost.memory_limit(options.num_stages, options.num_ranks)
    opts = dataclasses.replace(options, num_ranks=max(ranks, 1), memory_limit=limit, equal_microbatches=True)
    try:
        return plan_microbatches(batch, cost, opts, step=int(step))
    except NoEqualSplitError:
        return plan_microbatches(batch, cost, dataclasses.replace(opts, equal_microbatches=False), step=int(step))
