"""Offline planning of a whole run: `scan_dataset` (length index of a dataset, in parallel),
`plan_run` (every step's `BatchPlan`, written as one Parquet file) and `load_run_plan` (the
reader a DataLoader uses to replay and check a plan file).

Command line: ``dynabatch scan``, ``dynabatch plan``, ``dynabatch inspect`` (see
docs/offline_plans.md).
"""

from .._lazy import lazy_names

# Names load on first use (name -> module; a leading dot: a sibling of this package): the `dynabatch`
# command's parser imports `offline.commands`, which must not pull in numba and the scan with it.
_NAMES = {
    "ENGINES": ".engines", "EngineError": ".engines", "map_parts": ".engines",
    "Index": "inputs", "OfflineError": "inputs", "is_index": "inputs", "read_index": "inputs",
    "tokenizer_spec": "inputs", "RUN_PLAN_VERSION": ".planfile.format", "PlanMismatchError": ".planfile.reader",
    "RunPlan": ".planfile.reader", "load_run_plan": ".planfile.reader", "global_batches": ".core.plan.steps",
    "plan_step": ".core.plan.steps", "sample_tokens": ".core.plan.steps", "RunPlanConfig": "runplan",
    "plan_run": "runplan", "ScanConfig": "scan", "ScanResult": "scan", "scan_dataset": "scan",
    "write_index": "scan",
}
__all__ = sorted(_NAMES)

__getattr__ = lazy_names(__name__, _NAMES)
