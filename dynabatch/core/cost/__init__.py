"""The cost model: what a micro-batch of given shapes costs, in seconds and activation bytes.

`model` (`CostModel`, the façade users build: pricing, linear coefficients over the features of
`dynabatch.core.kernels.cost`, or a profiled table) built from `presets` (model and device configs) with the
math of `analytic`; it composes `coefficients` (`Coefficients`: the time coefficients, their version and
per-stage rows, shareable between processes), `fileformat` (the JSON file format: `to_dict`/`save`/`load`)
and `legacy_refit` (the deprecated ``observe``/``refit``, delegating to `FeedbackLoop`); `stages`
spreads it over pipeline stages (`StageLayout`), `profiled` holds measured tables (`ProfiledTable`),
`fit` the refit math, `stage_memory` what recomputation frees (`StageMemory`), and `features` turns a
plan's micro-batches into feature rows. Nothing here plans, orders or simulates.
"""

from ..lazy import lazy_names

# Names load on first use (name -> submodule): `presets` alone, which the command line's choices read,
# then costs no numba import (`model`, `features` and the kernels do).
_NAMES = {
    "microbatch_features": "features", "plan_features": "features", "CostModel": "model", "describe": "model",
    "DEVICE_PRESETS": "presets", "GPU_PRESETS": "presets", "MODEL_PRESETS": "presets",
    "TINY_MODEL_PRESETS": "presets", "DeviceProfile": "presets", "ModelConfig": "presets",
    "device_preset": "presets", "model_preset": "presets", "ProfiledTable": "profiled",
    "StageMemory": "stage_memory", "stage_memory_of": "stage_memory", "LAYOUTS": "stages",
    "StageLayout": "stages", "Coefficients": "coefficients", "FEATURES": ".kernels.cost", "NUM_FEATURES": ".kernels.cost",
}
__all__ = sorted(_NAMES)

__getattr__ = lazy_names(__name__, _NAMES)
