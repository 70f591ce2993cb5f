"""dynabatch: cost-balanced dynamic micro-batching for variable-length training data.

Measure what each sample costs (`CostModel`), cut each global batch into micro-batches of about
equal cost and spread them evenly over data-parallel ranks and pipeline stages
(`plan_microbatches` -> `BatchPlan`), and check the result with the pipeline simulator
(`simulate_pipeline`) against the usual baselines (`dynabatch bench plan`).
"""

from .core.batchplan import BatchPlan, MicroBatch
from .core.bounds import iteration_lower_bound
from .core.cost import (
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
from .core.options import COLLATIONS, METHODS, SCHEDULES, PlanOptions
from .core.plan import PlanningError, plan_microbatches, split_global_batches
from .core.steps import global_batches, plan_step
from .planfile import PLAN_SCHEMA_VERSION, PlanMismatchError, plans_to_arrow
from .core.shape_sources import ShapeSourceError, read_shapes, synthetic_shapes
from .core.shapes import SHAPES_SCHEMA, Shapes
from .core.simulate import PipelineDeadlock, SimResult, pipeline_schedule, simulate_pipeline

__all__ = [
    "BatchPlan",
    "COLLATIONS",
    "PlanOptions",
    "SCHEDULES",
    "global_batches",
    "plan_step",
    "CostModel",
    "DEVICE_PRESETS",
    "DeviceProfile",
    "FEATURES",
    "METHODS",
    "MODEL_PRESETS",
    "MicroBatch",
    "ModelConfig",
    "PLAN_SCHEMA_VERSION",
    "PipelineDeadlock",
    "PlanningError",
    "ProfiledTable",
    "SHAPES_SCHEMA",
    "ShapeSourceError",
    "Shapes",
    "SimResult",
    "device_preset",
    "iteration_lower_bound",
    "model_preset",
    "pipeline_schedule",
    "plan_microbatches",
    "plans_to_arrow",
    "read_shapes",
    "simulate_pipeline",
    "split_global_batches",
    "synthetic_shapes",
]
__version__ = "0.1.0"

# The DataLoader and collation need torch: imported on first use so `import dynabatch` stays light.
_LAZY = {
    "DataLoader": "loader.dataloader", "build_index": "loader.dataloader", "collate_padded": "loader.collate",
    "collate_packed": "loader.collate", "model_inputs": "loader.collate", "Collective": "loader.collective",
    "LocalCollective": "loader.collective", "ThreadCollective": "loader.collective",
    "TorchCollective": "loader.collective", "LoaderStateError": "loader.state",
}
__all__ += sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
