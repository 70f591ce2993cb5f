"""dynabatch: cost-balanced dynamic micro-batching for variable-length training data.

Measure what each sample costs (`CostModel`), cut each global batch into micro-batches of about
equal cost and spread them evenly over data-parallel ranks and pipeline stages
(`plan_microbatches` -> `BatchPlan`), and check the result with the pipeline simulator
(`simulate_pipeline`) against the usual baselines (`dynabatch bench plan`).
"""

from ._lazy import lazy_names

# Every public name loads on first use (name -> submodule): `import dynabatch`, and so the `dynabatch`
# command printing its --help, imports neither numba (these torch-free names) nor torch (_LAZY below).
_CORE = {
    "BatchPlan": "core.batchplan", "MicroBatch": "core.batchplan",
    "iteration_lower_bound": "core.plan.bounds", "objective_lower_bound": "core.plan.bounds",
    "DEVICE_PRESETS": "core.cost.model", "FEATURES": "core.cost.model", "MODEL_PRESETS": "core.cost.model",
    "CostModel": "core.cost.model", "DeviceProfile": "core.cost.model", "ModelConfig": "core.cost.model",
    "ProfiledTable": "core.cost.model", "device_preset": "core.cost.model", "model_preset": "core.cost.model",
    "FeedbackLoop": "core.plan.feedback", "FeedbackRow": "core.plan.feedback", "StepError": "core.plan.feedback",
    "COLLATIONS": "core.options", "METHODS": "core.options", "RECOMPUTE": "core.options",
    "SCHEDULES": "core.options", "PlanOptions": "core.options",
    "PlanningError": "core.plan.planner", "plan_microbatches": "core.plan.planner",
    "split_global_batches": "core.plan.planner",
    "ShapeSourceError": "shape_sources", "read_shapes": "shape_sources", "synthetic_shapes": "shape_sources",
    "StageMemory": "core.cost.stage_memory",
    "apply_recompute": "core.plan.recompute", "recompute_costs": "core.plan.recompute",
    "SHAPES_SCHEMA": "core.shapes", "Shapes": "core.shapes",
    "PipelineDeadlock": "core.simulate.pipeline", "SimResult": "core.simulate.pipeline",
    "pipeline_schedule": "core.simulate.pipeline", "simulate_pipeline": "core.simulate.pipeline",
    "global_batches": "core.plan.steps", "plan_step": "core.plan.steps",
    "PLAN_SCHEMA_VERSION": "planfile", "PlanMismatchError": "planfile", "RunPlan": "planfile",
    "load_run_plan": "planfile", "plans_to_arrow": "planfile",
}

__all__ = sorted(_CORE)
__version__ = "0.1.0"

# The DataLoader and collation need torch.
_LAZY = {
    "DataLoader": "loader.dataloader", "build_index": "loader.dataloader", "Tokenization": "loader.settings",
    "DataSource": "loader.settings", "Costing": "loader.settings", "Runtime": "loader.settings",
    "collate_padded": "loader.collate",
    "collate_packed": "loader.collate", "model_inputs": "loader.collate", "Collective": "loader.collective",
    "LocalCollective": "loader.collective", "ThreadCollective": "loader.collective",
    "TorchCollective": "loader.collective", "LoaderStateError": "loader.state", "Step": "loader.step",
    # the length index pulls in `tokenization` (its scan): loaded on first use too
    "LengthIndex": "index", "read_index": "index", "write_index": "index",
    # training integrations: `DynabatchTrainer` needs transformers, `step_backward` torch only
    "DynabatchTrainer": "integrations.hf", "step_backward": "integrations.accumulation",
}
__all__ += sorted(_LAZY)


__getattr__ = lazy_names(__name__, {**_CORE, **_LAZY})
