"""Imported once by `launch_local`'s fork server (``start_method="forkserver"``) before it forks any rank:
torch, `dynabatch.pipeline`, the op-order numba kernels (`warm_orders`: 0.8 s CPU from their on-disk
cache, measured), the planner's kernels (`warm_planner`: a rank's DataLoader plans its first step 0.1-0.2 s
CPU faster), ``torch._dynamo`` (a rank's first optimizer imports it: ``torch.optim`` wraps its
methods with it, 3 s CPU, measured) and the drop-in `DataLoader`'s module (0.4 s CPU per rank that builds
one, measured on a slow 2-core machine) are loaded here, so every forked rank inherits them instead of paying
for them again."""

from __future__ import annotations

import torch._dynamo  # noqa: F401  (what the first torch.optim optimizer of a rank imports)

import dynabatch.pipeline  # noqa: F401  (torch with it)
import dynabatch.loader.dataloader  # noqa: F401  (what a rank that reads its data through dynabatch builds)
from dynabatch.pipeline.runtime.forked_ranks import forked_rank  # noqa: F401  (what each forked rank runs)
from dynabatch.core.plan.warm import warm_planner
from dynabatch.pipeline.runtime.schedule import warm_orders

warm_orders()
warm_planner()
