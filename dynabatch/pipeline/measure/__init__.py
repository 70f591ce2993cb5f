"""What the pipeline measures: step times (`timing`: `StepTiming`, `StepResult`), activation bytes
(`memory`: `SavedBytes`, `measured_stage_memory`), per-layer costs (`layers`: `profile_layers`,
`search_partition`), cost models profiled from a model (`profile`: `profile_model` measures padded,
packed and image-tile micro-batches, `fitted_cost_model` turns them into a `CostModel`,
`save_profile`/`load_layer_costs` keep the per-layer costs for the partition search beside it) and
the micro-batch mix a split is profiled on (`microbatches`)."""

from .layers import profile_layers, search_partition
from .memory import SavedBytes, measured_stage_memory
from .microbatches import batch_shapes, representative, stage_cost_model
from .profile import Profile, fitted_cost_model, load_layer_costs, profile_cost_model, profile_model, save_profile
from .timing import StepResult, StepTiming

__all__ = ["profile_layers", "search_partition", "SavedBytes", "measured_stage_memory", "batch_shapes",
           "representative", "stage_cost_model", "StepResult", "StepTiming", "Profile", "profile_model",
           "fitted_cost_model", "profile_cost_model", "save_profile", "load_layer_costs"]
