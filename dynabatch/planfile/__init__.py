"""The plan file: one format (`dynabatch.planfile.format`: every metadata key, version and column),
one reader (`RunPlan`, `load_run_plan`), one `PlanMismatchError`.

``dynabatch inspect`` (`dynabatch.planfile.inspect`) and ``DataLoader(source=DataSource(plan=...))``
(`dynabatch.loader.modes.replay`) both read plan files through `RunPlan`; `plan_to_arrow`,
`plans_to_arrow` (`arrow`) and `dynabatch.offline.plan_run` write them with the keys of `format`.
The package depends on `dynabatch.core` (the `BatchPlan` record), never the other way round.
"""

from __future__ import annotations

from .arrow import plan_from_arrow, plan_to_arrow, plans_to_arrow
from .format import PLAN_SCHEMA_VERSION, RUN_PLAN_VERSION
from .reader import PlanMismatchError, RunPlan, load_run_plan

# (the `format` submodule is not in __all__: a star import would shadow the builtin)
__all__ = ["PLAN_SCHEMA_VERSION", "PlanMismatchError", "RUN_PLAN_VERSION", "RunPlan", "load_run_plan",
           "plan_from_arrow", "plan_to_arrow", "plans_to_arrow"]
