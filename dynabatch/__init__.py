"""dynabatch: cost-balanced dynamic micro-batching for variable-length training data.

Measure what each sample costs (`CostModel`), cut each global batch into micro-batches of about
equal cost and spread them evenly over data-parallel ranks and pipeline stages
(`plan_microbatches` -> `BatchPlan`), and check the result with the pipeline simulator
(`simulate_pipeline`) against the usual baselines (`dynabatch bench plan`).
"""

from ._lazy import lazy_names
from .core.batchplan import BatchPlan, MicroBatch
from .core.plan.bounds import iteration_lower_bound, objective_lower_bound
from .core.cost.model import (
    DEVICE_PRESETS,
    FEATURES,
    MODEL_PRESETS,
    CostModel,
    DeviceProfile,
    ModelConfig,
    ProfiledTable,
    device_preset,
    model_preset,
)
from .core.plan.feedback import FeedbackLoop, FeedbackRow, StepError
from .core.options import COLLATIONS, METHODS, RECOMPUTE, SCHEDULES, PlanOptions
from .core.plan.planner import PlanningError, plan_microbatches, split_global_batches
from .shape_sources import ShapeSourceError, read_shapes, synthetic_shapes
from .core.cost.stage_memory import StageMemory
from .core.plan.recompute import apply_recompute, recompute_costs
from .core.shapes import SHAPES_SCHEMA, Shapes
from .core.simulate.pipeline import PipelineDeadlock, SimResult, pipeline_schedule, simulate_pipeline
from .core.plan.steps import global_batches, plan_step
from .planfile import PLAN_SCHEMA_VERSION, PlanMismatchError, RunPlan, load_run_plan, plans_to_arrow

__all__ = sorted([
    "BatchPlan", "COLLATIONS", "CostModel", "DEVICE_PRESETS", "DeviceProfile", "FEATURES", "FeedbackLoop",
    "FeedbackRow", "METHODS", "MODEL_PRESETS", "MicroBatch", "ModelConfig", "PLAN_SCHEMA_VERSION",
    "PipelineDeadlock", "PlanMismatchError", "PlanOptions", "PlanningError", "ProfiledTable", "RECOMPUTE",
    "RunPlan", "SCHEDULES", "StageMemory", "apply_recompute", "recompute_costs", "SHAPES_SCHEMA", "ShapeSourceError", "Shapes", "SimResult", "StepError", "device_preset",
    "global_batches", "iteration_lower_bound", "load_run_plan", "model_preset", "objective_lower_bound",
    "pipeline_schedule",
    "plan_microbatches", "plan_step", "plans_to_arrow", "read_shapes", "simulate_pipeline",
    "split_global_batches", "synthetic_shapes",
])
__version__ = "0.1.0"

# The DataLoader and collation need torch: imported on first use so `import dynabatch` stays light.
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


__getattr__ = lazy_names(__name__, _LAZY)
