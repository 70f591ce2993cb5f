"""Pipeline op orders: which op each stage (rank) of a pipeline runs next, in one representation.

* `registry`: every schedule registered once (`ScheduleInfo`: name, code, chunks, split backward);
  an unknown name raises.
* `ops`: the typed representation of a step's ops (`Op`, `StepOps`: per rank, its forwards,
  backwards, input/weight backward parts and updates, each naming micro-batch, chunk and model).
* `build`: `step_ops`, the one derivation of a rank's op order for any schedule (and `adaptive_order`).
* `search`: the planner's ordering search (`order_step`) and ``auto``'s pick (`pick_auto`).
* `orders`: the order recorded with a plan (`record_orders`) and read back (`plan_orders`) by the
  runner, inspect and recompute.

Times are seconds, memory bytes. The submodules load on first use (``dynabatch.core.options`` reads the
registry without the numba kernels).
"""

from __future__ import annotations

import importlib

_HOME = {
    "REGISTRY": "registry", "SCHEDULE_NAMES": "registry", "SCHEDULE_CODES": "registry", "AUTO_PREFERENCE": "registry",
    "ScheduleInfo": "registry", "schedule_info": "registry", "concrete": "registry",
    "Op": "ops", "StepOps": "ops",
    "step_ops": "build", "adaptive_order": "build",
    "order_step": "search", "pick_auto": "search", "ops_by_count": "search",
    "DEFAULT_FORWARD_FRACTION": "orders", "ops_of": "orders", "plan_orders": "orders", "plan_p2p_s": "orders",
    "plan_stage_times": "orders", "rank_ops": "orders", "record_orders": "orders", "slots_of": "orders",
    "split_times": "orders", "stage_limit": "orders",
}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
