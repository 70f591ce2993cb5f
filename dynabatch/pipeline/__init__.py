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

See docs/pipeline.md.
"""

from .measure import (SavedBytes, StepResult, StepTiming, batch_shapes, measured_stage_memory, profile_layers,
                      representative, search_partition, stage_cost_model)
from .models import (MODELS, LayerCosts, LayeredModel, MicroBatchShape, PipelineStage, PlanMismatch, StagePartition,
                     TensorSpec, VisionLanguageModel, balanced_partition, check_batch, count_parameters, gpt_tiny,
                     make_model, merged_length, partition_makespan, placeholder_mask, plan_shapes, segment_ids,
                     split_model, t5_tiny, uniform_partition, vision_calls, vlm_batch_shapes, vlm_tiny,
                     with_placeholders)
from .runtime import (SCHEDULES, Bypass, CommEvent, CommRecorder, Compute, DistContext, Hooks, Message,
                      MultiModelRunner, MultiStepResult, NonFiniteStep, P2P, PipelineAborted, PipelineRunner, Post,
                      ProcResult,
                      ProgramError, RunnerConfig, ShapeMismatch, ShardStore, Ties, WeightPredictor,
                      build_programs, check_peer_sequences, check_programs, free_port, init_pipeline, launch_local,
                      loader_runtime, run_program, run_ranks, sequential_step, stage_orders, tie_stages)
from .models.hf import (HFLayeredModel, HFStage, UnsupportedModel, from_hf, hf_reference_step, load_stage, merge_stages,
                        save_stage)

__all__ = [
    "MODELS", "SCHEDULES", "CommEvent", "CommRecorder", "Compute", "DistContext", "LayerCosts", "LayeredModel",
    "Message", "MicroBatchShape", "P2P", "PipelineAborted", "PipelineRunner", "PipelineStage", "PlanMismatch",
    "Post", "ProcResult", "ProgramError", "RunnerConfig", "ShapeMismatch", "StagePartition", "StepResult",
    "StepTiming", "TensorSpec", "balanced_partition", "build_programs", "check_batch",
    "check_peer_sequences", "check_programs", "count_parameters", "free_port", "gpt_tiny", "init_pipeline",
    "launch_local", "make_model", "partition_makespan", "plan_shapes", "profile_layers", "search_partition",
    "segment_ids", "sequential_step", "split_model", "stage_orders", "t5_tiny", "uniform_partition",
    "batch_shapes", "representative", "stage_cost_model", "SavedBytes", "measured_stage_memory", "WeightPredictor",
    "VisionLanguageModel", "merged_length", "placeholder_mask", "vision_calls", "vlm_batch_shapes", "vlm_tiny",
    "with_placeholders",
]
__all__ += ["MultiModelRunner", "MultiStepResult", "ShardStore", "Bypass", "Hooks", "Ties", "run_program", "tie_stages"]
__all__ += ["HFLayeredModel", "UnsupportedModel", "from_hf", "hf_reference_step", "merge_stages", "save_stage"]
__all__ += ["HFStage", "load_stage", "run_ranks", "NonFiniteStep", "loader_runtime"]
