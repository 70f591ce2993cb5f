"""The cost model: what a micro-batch of given shapes costs, in seconds and activation bytes.

`model` (`CostModel`: linear coefficients over the features of `dynabatch.core.kernels.cost`, or a
profiled table) built from `presets` (model and device configs) with the math of `analytic`; `stages`
spreads it over pipeline stages (`StageLayout`), `profiled` holds measured tables (`ProfiledTable`),
`fit` the refit math, `stage_memory` what recomputation frees (`StageMemory`), and `features` turns a
plan's micro-batches into feature rows. Nothing here plans, orders or simulates.
"""

from .features import microbatch_features, plan_features
from .model import CostModel
from .presets import (DEVICE_PRESETS, GPU_PRESETS, MODEL_PRESETS, TINY_MODEL_PRESETS, DeviceProfile, ModelConfig,
                      device_preset, model_preset)
from .profiled import ProfiledTable
from .stage_memory import StageMemory, stage_memory_of
from .stages import LAYOUTS, StageLayout
from ..kernels.cost import FEATURES, NUM_FEATURES

__all__ = ["DEVICE_PRESETS", "FEATURES", "GPU_PRESETS", "LAYOUTS", "MODEL_PRESETS", "NUM_FEATURES", "TINY_MODEL_PRESETS",
           "CostModel", "DeviceProfile", "ModelConfig", "ProfiledTable", "StageLayout", "StageMemory", "device_preset",
           "microbatch_features", "model_preset", "plan_features", "stage_memory_of"]
