"""Pipeline-parallel execution of dynabatch plans (``torch.distributed``: NCCL on GPUs, gloo on CPU).

Three subpackages, each importing only the ones listed before it:

* `models`: what runs. `LayeredModel` (an ordered list of layers, its boundary `TensorSpec` s per
  `MicroBatchShape`, parameters shared between layers), the tiny models ``gpt-tiny``, ``t5-tiny`` and
  ``vlm-tiny`` (`make_model`), and the stage split (`balanced_partition`, `split_model` ->
  `PipelineStage`); `models.hf`: users' Hugging Face models as layered models (`from_hf`: Llama-family
  decoders, T5/BART, LLaVA; each rank loads only its stage; `save_stage`/`merge_stages` checkpoints,
  `load_stage` one rank's stage of a folder;
  docs/pipeline_hf.md).
* `measure`: what is measured. `StepTiming`/`StepResult`, activation bytes (`SavedBytes`,
  `measured_stage_memory`), per-layer costs (`profile_layers`, `search_partition`: one split agreed
  across ranks), profiled cost models (`dynabatch profile`), the mix a split is profiled on.
* `runtime`: how it runs. Per-stage op orders and NCCL-safe communication programs (`build_programs`),
  one interpreter of a stage's program with hooks (`run_program`, `Hooks`), and on it:
  `PipelineRunner.step(plan, batches)` (flushed steps), `run_steps` with ``RunnerConfig(flush=False)``
  (flush-free streams; `WeightPredictor`), `MultiModelRunner` (K models on one data pass, shards
  spilled under a device budget: `ShardStore`). Parameters shared between stages (`Ties`) are summed
  over their stages before every update; `Bypass` skips a micro-batch's idle stages; `init_pipeline`
  sets up the process groups, `PipelineAborted` ends every rank when one fails, `launch_local` runs N
  local ranks (`run_ranks`: alone or under torchrun).

This package's top level holds the entry points (`__all__`); every other name lives in, and is
documented by, its subpackage: `dynabatch.pipeline.models`, `dynabatch.pipeline.measure`,
`dynabatch.pipeline.runtime` (the communication programs and their parts: `Post`, `Compute`, `Message`,
`build_programs`, ...), `dynabatch.pipeline.models.hf`. See docs/pipeline.md.
"""

from .._lazy import moved_names
from .measure import batch_shapes, measured_stage_memory, profile_layers, search_partition, stage_cost_model
from .models import LayeredModel, balanced_partition, make_model, split_model
from .runtime import (MultiModelRunner, PipelineAborted, PipelineRunner, RunnerConfig, init_pipeline, launch_local,
                      loader_runtime, run_ranks, sequential_step)
from .models.hf import UnsupportedModel, from_hf, load_stage, merge_stages, save_stage

__all__ = [
    # run: process groups, local ranks, the runners and their loader
    "init_pipeline", "launch_local", "run_ranks", "PipelineAborted", "PipelineRunner", "RunnerConfig",
    "MultiModelRunner", "loader_runtime", "sequential_step",
    # models: layered models, Hugging Face models, the stage split and stage checkpoints
    "LayeredModel", "make_model", "from_hf", "UnsupportedModel", "load_stage", "save_stage", "merge_stages",
    "balanced_partition", "split_model",
    # measure: cost models of a stage, per-layer profiles, activation memory
    "stage_cost_model", "profile_layers", "search_partition", "batch_shapes", "measured_stage_memory",
]

#: Former top-level names -> the subpackage that holds (and documents) each now; ``dynabatch.pipeline.X``
#: still finds them for one release, with a DeprecationWarning.
MOVED = {
    **dict.fromkeys(("MODELS", "LayerCosts", "MicroBatchShape", "PipelineStage", "PlanMismatch", "StagePartition",
                     "TensorSpec", "VisionLanguageModel", "check_batch", "count_parameters", "gpt_tiny", "t5_tiny",
                     "vlm_tiny", "merged_length", "partition_makespan", "placeholder_mask", "plan_shapes",
                     "segment_ids", "uniform_partition", "vision_calls", "vlm_batch_shapes", "with_placeholders"),
                    "dynabatch.pipeline.models"),
    **dict.fromkeys(("SavedBytes", "StepResult", "StepTiming", "representative"), "dynabatch.pipeline.measure"),
    **dict.fromkeys(("SCHEDULES", "Bypass", "CommEvent", "CommRecorder", "Compute", "DistContext", "Hooks", "Message",
                     "MultiStepResult", "NonFiniteStep", "P2P", "Post", "ProcResult", "ProgramError", "ShapeMismatch",
                     "ShardStore", "Ties", "WeightPredictor", "build_programs", "check_peer_sequences",
                     "check_programs", "free_port", "run_program", "stage_orders", "tie_stages"),
                    "dynabatch.pipeline.runtime"),
    **dict.fromkeys(("HFLayeredModel", "HFStage", "hf_reference_step"), "dynabatch.pipeline.models.hf"),
}

__getattr__ = moved_names(__name__, MOVED)
