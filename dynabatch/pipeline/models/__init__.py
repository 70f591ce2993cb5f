"""The models a pipeline runs and how they are cut into stages.

* `layered`: `LayeredModel`, the interface (an ordered list of layers, boundary shapes, shared
  parameters); `spec`: the records crossing a stage boundary (`TensorSpec`, `MicroBatchShape`).
* `contract`: what every model stands on (the ignore index, the decoder and encoder-decoder state
  layouts, random micro-batches of a shape), the tiny models and the Hugging Face adapters alike.
* `blocks`: the tiny models' transformer blocks and masks; `tiny`: ``gpt-tiny`` and ``t5-tiny``;
  `vlm`: ``vlm-tiny`` (ViT -> projector -> GPT); `mtmm`: ``mtmm-tiny`` (the multi-task multi-modal
  member's components, `mtmm_tiny`); `zoo`: the tiny models by name (`make_model`).
* `partition`: stage splits by simulated makespan and the stage module (`PipelineStage`).

Model adapters of other libraries live in subpackages here (e.g. ``hf``).
"""

from .layered import LayeredModel
from .partition import (LayerCosts, PipelineStage, StagePartition, balanced_partition, partition_makespan, split_model,
                        uniform_partition)
from .spec import MicroBatchShape, PlanMismatch, TensorSpec, check_batch, plan_shapes
from .blocks import segment_ids
from .tiny import count_parameters, gpt_tiny, t5_tiny
from .vlm import (VisionLanguageModel, merged_length, placeholder_mask, vision_calls, vlm_batch_shapes, vlm_tiny,
                  with_placeholders)
from .mtmm import mtmm_tiny
from .zoo import MODELS, make_model

__all__ = [
    "LayeredModel", "LayerCosts", "PipelineStage", "StagePartition", "balanced_partition", "partition_makespan",
    "split_model", "uniform_partition", "MicroBatchShape", "PlanMismatch", "TensorSpec", "check_batch",
    "plan_shapes", "MODELS", "count_parameters", "gpt_tiny", "make_model", "mtmm_tiny", "segment_ids", "t5_tiny",
    "VisionLanguageModel", "merged_length", "placeholder_mask", "vision_calls", "vlm_batch_shapes", "vlm_tiny",
    "with_placeholders",
]
