"""Offline planning of a whole run: `scan_dataset` (length index of a dataset, in parallel),
`plan_run` (every step's `BatchPlan`, written as one Parquet file) and `load_run_plan` (the
reader a DataLoader uses to replay and check a plan file).

Command line: ``dynabatch scan``, ``dynabatch plan``, ``dynabatch inspect`` (see
docs/offline_plans.md).
"""

from ..engines import ENGINES, EngineError, map_parts
from .inputs import Index, OfflineError, is_index, read_index, tokenizer_spec
from ..planfile.format import RUN_PLAN_VERSION
from ..planfile.reader import PlanMismatchError, RunPlan, load_run_plan
from ..core.plan.steps import global_batches, plan_step, sample_tokens
from .runplan import RunPlanConfig, plan_run
from .scan import ScanConfig, ScanResult, scan_dataset, write_index

__all__ = [
    "ENGINES",
    "EngineError",
    "Index",
    "OfflineError",
    "PlanMismatchError",
    "RUN_PLAN_VERSION",
    "RunPlan",
    "RunPlanConfig",
    "ScanConfig",
    "ScanResult",
    "global_batches",
    "is_index",
    "load_run_plan",
    "map_parts",
    "plan_run",
    "plan_step",
    "read_index",
    "sample_tokens",
    "scan_dataset",
    "tokenizer_spec",
    "write_index",
]
