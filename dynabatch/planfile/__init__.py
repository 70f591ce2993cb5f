"""The plan file: one format (`dynabatch.planfile.format`: every metadata key, version and column),
one reader (`RunPlan`, `load_run_plan`), one `PlanMismatchError`.

``dynabatch inspect`` (`dynabatch.planfile.inspect`; `step_timeline` and `stage_busy` re-simulate a step) and
``DataLoader(source=DataSource(plan=...))`` (`dynabatch.loader.modes.replay`) both read plan files through
`RunPlan`; `plan_to_arrow`, `plans_to_arrow` (`arrow`) and `dynabatch.offline.plan_run` write them with the keys
of `format`.
The package depends on `dynabatch.core` (the `BatchPlan` record), never the other way round.
"""

from __future__ import annotations

from .._lazy import lazy_names
from .arrow import plan_from_arrow, plan_to_arrow, plans_to_arrow
from .format import PLAN_SCHEMA_VERSION, RUN_PLAN_VERSION
from .reader import PlanMismatchError, RunPlan, load_run_plan

# `inspect`'s re-simulation loads on first use (name -> submodule): it imports the schedule and simulator kernels,
# which reading or writing a plan file does not need.
_LAZY = {"stage_busy": "inspect", "step_timeline": "inspect"}

# (the `format` submodule is not in __all__: a star import would shadow the builtin)
__all__ = ["PLAN_SCHEMA_VERSION", "PlanMismatchError", "RUN_PLAN_VERSION", "RunPlan", "load_run_plan",
           "plan_from_arrow", "plan_to_arrow", "plans_to_arrow", "stage_busy", "step_timeline"]

__getattr__ = lazy_names(__name__, _LAZY)
