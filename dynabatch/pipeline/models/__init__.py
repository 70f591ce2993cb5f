"""The models a pipeline runs and how they are cut into stages.

* `layered`: `LayeredModel`, the interface (an ordered list of layers, boundary shapes, shared
  parameters); `spec`: the records crossing a stage boundary (`TensorSpec`, `MicroBatchShape`).
* `tiny`: ``gpt-tiny`` and ``t5-tiny``; `vlm`: ``vlm-tiny`` (ViT -> projector -> GPT).
* `partition`: stage splits by simulated makespan and the stage module (`PipelineStage`).

Model adapters of other libraries live in subpackages here (e.g. ``hf``).
"""

from .layered import LayeredModel
from .partition import (LayerCosts, PipelineStage, StagePartition, balanced_partition, partition_makespan, split_model,
                        uniform_partition)
from .spec import MicroBatchShape, PlanMismatch, TensorSpec, check_batch, plan_shapes
from .tiny import MODELS, count_parameters, gpt_tiny, make_model, segment_ids, t5_tiny
from .vlm import (VisionLanguageModel, merged_length, placeholder_mask, vision_calls, vlm_batch_shapes, vlm_tiny,
                  with_placeholders)

__all__ = [
    "LayeredModel", "LayerCosts", "PipelineStage", "StagePartition", "balanced_partition", "partition_makespan",
    "split_model", "uniform_partition", "MicroBatchShape", "PlanMismatch", "TensorSpec", "check_batch",
    "plan_shapes", "MODELS", "count_parameters", "gpt_tiny", "make_model", "segment_ids", "t5_tiny",
    "VisionLanguageModel", "merged_length", "placeholder_mask", "vision_calls", "vlm_batch_shapes", "vlm_tiny",
    "with_placeholders",
]
