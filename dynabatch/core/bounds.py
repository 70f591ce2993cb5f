"""A lower bound on the balanced pipeline objective of any plan of one global batch.

The planner minimizes DynaPipe's cost of a data-parallel step: ``sum(t) / R + (S-1) * max(t)``
over all micro-batches of the global batch (the work shared by ``R`` ranks plus the pipeline
fill/drain of the largest micro-batch on ``S`` stages); rank balance is measured separately.
Relax everything a plan could possibly improve:

* every sample costs at least its varlen time (no padding, attention over itself only), so the
  variable work of all micro-batches sums to at least ``W``, the varlen work of the whole batch;
* every micro-batch pays at least the fixed per-micro-batch time ``F`` (launch overhead and the
  weight reads that make small micro-batches inefficient);
* with ``M`` micro-batches per rank the largest costs at least their mean ``W / (R*M) + F`` and at
  least the costliest single sample ``c_max``;
* activation memory forces at least ``M_min`` micro-batches per rank.

so ``LB = min over M >= M_min of  W/R + M*F + (S-1) * max(W/(R*M) + F, c_max)``.

This bounds the planning objective, not the simulated makespan: a simulated 1F1B rank whose
short micro-batches open and close the schedule fills and drains faster than ``(S-1) * max(t)``.
"""

from __future__ import annotations

import numpy as np

from .cost import CostModel
from .shapes import Shapes


def iteration_lower_bound(shapes: Shapes, cost: CostModel, *, num_stages: int, num_ranks: int,
                          max_len: int | None = None, max_target_len: int | None = None,
                          memory_limit: float | None = None) -> float:
    """Lower bound (seconds) on ``sum(t)/R + (S-1)*max(t)`` of any plan of ``shapes`` (module doc)."""
    n = len(shapes)
    if n == 0:
        return 0.0
    main, dec, tiles = cost.sample_dims(shapes, max_len, max_target_len)
    phi = cost.packed_features(main, dec, tiles, np.arange(n))
    variable = phi.copy()
    variable[:, 7:] = 0.0
    work = float(cost.time(variable).sum())
    fixed = float(cost.time_coef[7] + (cost.time_coef[8] if np.all(tiles > 0) else 0.0))
    c_max = float(cost.time(phi).max())
    limit = cost.memory_limit(num_stages, num_ranks) if memory_limit is None else float(memory_limit)
    m_min = max(int(np.ceil(float(cost.memory(variable).sum()) / num_ranks / limit)), 1)
    per_rank = work / num_ranks
    m = np.arange(m_min, max(-(-n // num_ranks), m_min) + 1, dtype=np.float64)
    bound = per_rank + m * fixed + (num_stages - 1) * np.maximum(per_rank / m + fixed, c_max)
    return float(bound.min())
