"""dynabatch: cost-balanced dynamic micro-batching for variable-length training data.

Measure what each sample costs (`CostModel`), cut each global batch into micro-batches of about
equal cost and spread them evenly over data-parallel ranks and pipeline stages
(`plan_microbatches` -> `BatchPlan`), and check the result with the pipeline simulator
(`simulate_pipeline`) against the usual baselines (`dynabatch bench plan`).
"""

from ._lazy import lazy_names, moved_names

# The entry points: every public name loads on first use (name -> submodule): `import dynabatch`, and so the
# `dynabatch` command printing its --help, imports neither numba (these torch-free names) nor torch (_LAZY below).
_CORE = {
    "BatchPlan": "core.batchplan", "CostModel": "core.cost.model", "FeedbackLoop": "core.plan.feedback",
    "PlanOptions": "core.options", "PlanningError": "core.plan.planner", "plan_microbatches": "core.plan.planner",
    "split_global_batches": "core.plan.planner", "Shapes": "core.shapes", "read_shapes": "shape_sources",
    "simulate_pipeline": "core.simulate.pipeline", "PlanMismatchError": "planfile", "load_run_plan": "planfile",
}

__all__ = sorted(_CORE)
__version__ = "0.1.0"

# The DataLoader (and the records it takes), collation and the training integrations need torch.
_LAZY = {
    "DataLoader": "loader.dataloader", "build_index": "loader.dataloader", "Tokenization": "loader.settings",
    "DataSource": "loader.settings", "Costing": "loader.settings", "Runtime": "loader.settings",
    "Step": "loader.step", "LoaderStateError": "loader.state", "model_inputs": "loader.collate",
    # training integrations: `DynabatchTrainer` needs transformers, `step_backward` torch only
    "DynabatchTrainer": "integrations.hf", "step_backward": "integrations.accumulation",
}
__all__ += sorted(_LAZY)

#: Former top-level names -> the module that holds (and documents) each now; ``dynabatch.X`` still finds
#: them for one release, with a DeprecationWarning.
MOVED = {
    **dict.fromkeys(("COLLATIONS", "METHODS", "RECOMPUTE", "SCHEDULES"), "dynabatch.core.options"),
    **dict.fromkeys(("DEVICE_PRESETS", "FEATURES", "MODEL_PRESETS", "DeviceProfile", "ModelConfig", "ProfiledTable",
                     "device_preset", "model_preset"), "dynabatch.core.cost.model"),
    "MicroBatch": "dynabatch.core.batchplan", "FeedbackRow": "dynabatch.core.plan.feedback",
    "StepError": "dynabatch.core.plan.feedback",
    "iteration_lower_bound": "dynabatch.core.plan.bounds", "objective_lower_bound": "dynabatch.core.plan.bounds",
    **dict.fromkeys(("PLAN_SCHEMA_VERSION", "RunPlan", "plans_to_arrow"), "dynabatch.planfile"),
    **dict.fromkeys(("PipelineDeadlock", "SimResult", "pipeline_schedule"), "dynabatch.core.simulate.pipeline"),
    "ShapeSourceError": "dynabatch.shape_sources", "synthetic_shapes": "dynabatch.shape_sources",
    "StageMemory": "dynabatch.core.cost.stage_memory",
    "apply_recompute": "dynabatch.core.plan.recompute", "recompute_costs": "dynabatch.core.plan.recompute",
    "SHAPES_SCHEMA": "dynabatch.core.shapes",
    "global_batches": "dynabatch.core.plan.steps", "plan_step": "dynabatch.core.plan.steps",
    "collate_padded": "dynabatch.loader.collate", "collate_packed": "dynabatch.loader.collate",
    **dict.fromkeys(("Collective", "LocalCollective", "ThreadCollective", "TorchCollective"),
                    "dynabatch.loader.collective"),
    **dict.fromkeys(("LengthIndex", "read_index", "write_index"), "dynabatch.index"),
}

__getattr__ = moved_names(__name__, MOVED, lazy_names(__name__, {**_CORE, **_LAZY}))
