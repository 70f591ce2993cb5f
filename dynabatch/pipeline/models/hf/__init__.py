"""Hugging Face models as pipeline `LayeredModel`s: decoder-only causal LMs (Llama, Mistral, Qwen2/3,
Gemma), T5-family and BART-style encoder-decoders and LLaVA-style vision-language models, recognized
by structure.

* `from_hf(source, layers=...)`: a model object, config or ``save_pretrained`` folder as an
  `HFLayeredModel` (only ``layers`` materialized: a rank's stage, read from safetensors);
* `HFLayeredModel.tied_parameters()`: the parameters several layers (so possibly several stages) hold;
* `hf_reference_step`: the model's own forward/backward a pipeline run is checked against;
* `save_stage` / `merge_stages`: each stage saves its part, one call merges them into a
  ``save_pretrained`` folder;
* `load_stage`: one rank's stage of a ``save_pretrained`` folder (`HFStage`, whose ``save`` checkpoints
  and merges).

See docs/pipeline_hf.md.
"""

from .build import adapt, build_model, from_hf
from .checkpoint import merge_stages, save_stage
from .common import HFLayeredModel, UnsupportedModel
from .reference import hf_inputs, hf_reference_step
from .stage import HFStage, load_stage
from .weights import WeightSource, materialize, parameter_bytes

__all__ = ["from_hf", "adapt", "build_model", "HFLayeredModel", "UnsupportedModel", "hf_inputs", "hf_reference_step",
           "WeightSource", "materialize", "parameter_bytes",
           "save_stage", "merge_stages", "HFStage", "load_stage"]
