"""What the pipeline measures: step times (`timing`: `StepTiming`, `StepResult`), activation bytes
(`memory`: `SavedBytes`, `measured_stage_memory`), per-layer costs (`layers`: `profile_layers`,
`search_partition`), cost models profiled from a model (`profile`) and the micro-batch mix a split
is profiled on (`microbatches`)."""

from .layers import profile_layers, search_partition
from .memory import SavedBytes, measured_stage_memory
from .microbatches import batch_shapes, representative, stage_cost_model
from .timing import StepResult, StepTiming

__all__ = ["profile_layers", "search_partition", "SavedBytes", "measured_stage_memory", "batch_shapes",
           "representative", "stage_cost_model", "StepResult", "StepTiming"]
