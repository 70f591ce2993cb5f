"""Pipeline-parallel execution of dynabatch plans (``torch.distributed``: NCCL on GPUs, gloo on CPU).

* `partition`: split an ordered list of layers into stages by simulated makespan (`balanced_partition`;
  `search_partition` profiles the layers and agrees on one split across ranks).
* `schedule`: per-stage op orders (GPipe, 1F1B, memory-aware adaptive) and NCCL-safe communication programs.
* `comm`: process groups (`init_pipeline` -> `DistContext`) and point-to-point transfers (`P2P`).
* `runner`: `PipelineRunner.step(plan, batches)` -> `StepResult` with a `StepTiming`; `run_steps` runs several
  steps, flush-free with ``RunnerConfig(flush=False)`` (`weight_prediction`: `WeightPredictor`).
* `failure`: a failing rank ends every rank with its error (`PipelineAborted`), no hang.
* `bypass`: with ``RunnerConfig(bypass_idle_stages=True)`` a micro-batch skips the stages holding only its
  idle layers (`Bypass`: vlm-tiny's text-only micro-batches never visit the vision stages).
* `multimodel`: `MultiModelRunner` trains K models on the same micro-batches (one data pass), their stage
  shards ordered longest-remaining-time-first and spilled to host memory under a device budget (`shards`).
* `models`: ``gpt-tiny`` and ``t5-tiny`` as layer lists; `vlm`: ``vlm-tiny`` (ViT -> projector -> GPT,
  fed by the DataLoader's image+text micro-batches); `launch`: run N local ranks.
* `hf`: Hugging Face models as layered models (`from_hf`: Llama-family decoders, T5, LLaVA; each rank
  loads only its stage; `TiedGradients`; `save_stage`/`merge_stages` checkpoints; docs/pipeline_hf.md).
* `memory`: the activation bytes a stage keeps for backward (`SavedBytes`, metered per step by the
  runner) and the recompute memory model fitted from them (`measured_stage_memory`).
* `microbatches`: a loader step's shapes for the runner (`batch_shapes`), the mix a split is profiled
  on (`representative`), the one-stage cost model of a split (`stage_cost_model`).

See docs/pipeline.md.
"""

from .bypass import Bypass
from .comm import CommEvent, CommRecorder, DistContext, P2P, ShapeMismatch, check_peer_sequences, init_pipeline
from .failure import PipelineAborted
from .launch import ProcResult, free_port, launch_local
from .memory import SavedBytes, measured_stage_memory
from .microbatches import batch_shapes, representative, stage_cost_model
from .models import MODELS, LayeredModel, count_parameters, gpt_tiny, make_model, segment_ids, t5_tiny
from .partition import (
    LayerCosts,
    PipelineStage,
    StagePartition,
    balanced_partition,
    partition_makespan,
    profile_layers,
    search_partition,
    split_model,
    uniform_partition,
)
from .runner import PipelineRunner, PlanMismatch, RunnerConfig, StepResult, StepTiming, check_batch, sequential_step
from .schedule import (
    SCHEDULES,
    Compute,
    Message,
    Post,
    ProgramError,
    adaptive_orders,
    build_programs,
    check_programs,
    stage_orders,
)
from .spec import MicroBatchShape, TensorSpec, plan_shapes
from .weight_prediction import WeightPredictor
from .multimodel import MultiModelRunner, MultiStepResult, ShardStore
from .hf import HFLayeredModel, TiedGradients, UnsupportedModel, from_hf, hf_reference_step, merge_stages, save_stage
from .vlm import (VisionLanguageModel, merged_length, placeholder_mask, vision_calls, vlm_batch_shapes, vlm_tiny,
                  with_placeholders)

__all__ = [
    "MODELS", "SCHEDULES", "CommEvent", "CommRecorder", "Compute", "DistContext", "LayerCosts", "LayeredModel",
    "Message", "MicroBatchShape", "P2P", "PipelineAborted", "PipelineRunner", "PipelineStage", "PlanMismatch",
    "Post", "ProcResult", "ProgramError", "RunnerConfig", "ShapeMismatch", "StagePartition", "StepResult",
    "StepTiming", "TensorSpec", "adaptive_orders", "balanced_partition", "build_programs", "check_batch",
    "check_peer_sequences", "check_programs", "count_parameters", "free_port", "gpt_tiny", "init_pipeline",
    "launch_local", "make_model", "partition_makespan", "plan_shapes", "profile_layers", "search_partition",
    "segment_ids", "sequential_step", "split_model", "stage_orders", "t5_tiny", "uniform_partition",
    "batch_shapes", "representative", "stage_cost_model", "SavedBytes", "measured_stage_memory", "WeightPredictor",
    "VisionLanguageModel", "merged_length", "placeholder_mask", "vision_calls", "vlm_batch_shapes", "vlm_tiny",
    "with_placeholders",
]
__all__ += ["MultiModelRunner", "MultiStepResult", "ShardStore", "Bypass"]
__all__ += ["HFLayeredModel", "TiedGradients", "UnsupportedModel", "from_hf", "hf_reference_step", "merge_stages",
            "save_stage"]
