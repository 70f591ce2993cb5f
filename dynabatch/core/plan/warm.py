"""Load the planner's numba kernels once, before a process forks its workers.

A rank forked from `launch_local`'s fork server that plans its steps (a `DataLoader` in every rank) would
otherwise load each planner kernel from numba's on-disk cache on its first step (0.13 s CPU per rank on an
idle machine, measured; more under load), paid again by every rank of every launch. `warm_planner` plans one tiny global batch with each
method and collation through `plan_microbatches`, the planner's one entry, so it loads exactly the kernel
signatures a real plan uses (`Shapes` normalizes its columns' dtypes, so the types are the real ones)."""

from __future__ import annotations

import numpy as np

from ..cost.model import CostModel
from ..methods import BASELINES
from ..options import default_method
from ..shapes import Shapes
from ..schedule import step_ops
from ..simulate.pipeline import makespan
from .planner import plan_microbatches, split_global_batches


def warm_planner() -> None:
    """Plan 24 synthetic samples (16-200 input tokens, 4-40 target tokens) with the dp planner of each
    collation (`default_method`) and every baseline, on 2 stages and 2 ranks of the ``gpt`` preset, cut them
    into global batches and price one order as the partition search does: the kernels those calls run stay
    loaded in this process (and in every process it forks). About 0.13 s CPU from a warm cache (measured)."""
    n = 24
    ids = np.arange(n, dtype=np.int64)
    shapes = Shapes(sample_id=ids, input_tokens=16 + (ids * 37) % 185, target_tokens=4 + (ids * 11) % 37,
                    vision_tokens=np.zeros(n, np.int32), task_id=np.full(n, -1, np.int32))
    cost = CostModel.preset("gpt", "a100-80gb", num_stages=2)
    split_global_batches(shapes, 1000)
    makespan(np.ones((2, 2)), np.ones((2, 2)), step_ops("1f1b", 2, 2), np.zeros(2))  # the partition search's
    for method in dict.fromkeys([default_method(c) for c in ("padded", "packed", "packed_rows")] + list(BASELINES)):
        plan_microbatches(shapes, cost, method=method, num_stages=2, num_ranks=2, max_len=256, max_target_len=64)
