"""``dynabatch bench gpu``, cost-model section: the device preset's analytic predictions against what
the bench's Llama model measures on this device, and the profiled cost model saved beside the results.

1. `dynabatch.pipeline.measure.profile.profile_cost_model` times forward+backward of a grid of padded shapes
   layer by layer (the ``dynabatch profile`` machinery) and the result is written to
   ``cost_model.json`` (`CostModel.save`; `CostModel.load` reads it, the DataLoader takes it).
2. FLAN-like micro-batches: the first ``cost_microbatches`` micro-batches ``dp`` cuts from the bench
   data with the preset's cost model (``h100``/``h200`` for those GPUs, `dynabatch.devices.gpu_preset`;
   ``cpu`` here). Each is timed layer by layer (`dynabatch.pipeline.profile_layers`, fastest of
   ``profile_repeats`` after one warm-up).
3. Scores: MAPE per micro-batch of the preset's prediction and of the profiled model's, against the
   measured forward+backward seconds; per layer, the measured forward and backward seconds summed
   over the micro-batches (and the bytes each keeps for backward): where the time goes.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import numpy as np


def flan_microbatches(cfg, data, index, cost, count: int) -> list[dict]:
    """The first ``count`` micro-batches ``dp`` plans from the bench data with ``cost``."""
    from .gpu_setup import bench_loader

    loader = bench_loader(cfg, data, index, cost)
    out: list[dict] = []
    try:
        for step in loader.steps():
            out.extend(step)
            if len(out) >= count:
                break
    finally:
        loader.close()
    if not out:
        raise RuntimeError("bench gpu: the data gave no micro-batch (too little data for one global batch?)")
    return out[:count]


def _mape(pred, meas) -> float:
    from ..core.cost.fit import mape

    return float(mape(np.asarray(pred, np.float64), np.asarray(meas, np.float64)))


def cost_section(cfg, factory, data, index, out_dir: str) -> tuple[dict, object]:
    """Run the section (module docstring); returns (its result, the profiled `CostModel`)."""
    from ..pipeline import batch_shapes, profile_layers, stage_cost_model
    # closest_device_profile: the one device -> preset mapping
    from ..pipeline.measure.profile import closest_device_profile, profile_cost_model

    model = factory.fresh()
    preset = closest_device_profile(cfg.device).name
    t0 = time.perf_counter()
    profiled = profile_cost_model(model, device=cfg.device, rows=cfg.profile_rows, lengths=cfg.profile_lengths,
                                  repeats=cfg.profile_repeats, device_profile=preset)
    profile_s = time.perf_counter() - t0
    # rows beyond the grid (pad/token_budget cut many short rows) scale linearly: time and bytes grow with rows
    profiled.table = replace(profiled.table, extrapolate=True)
    path = os.path.join(out_dir, "cost_model.json")
    profiled.save(path)
    analytic = stage_cost_model(model, 1, preset)
    mbs = flan_microbatches(cfg, data, index, analytic, cfg.cost_microbatches)
    costs = profile_layers(model.layers, mbs, repeats=cfg.profile_repeats, warmup=1, device=cfg.device)
    measured = (costs.forward_s + costs.backward_s).sum(axis=0)
    shapes = batch_shapes(mbs, "padded")
    rows = np.array([s.rows for s in shapes])
    lens = np.array([s.input_len for s in shapes])
    pred_preset = np.asarray(analytic.padded(rows, lens)[0], np.float64).ravel()
    pred_profiled = np.asarray(profiled.padded(rows, lens)[0], np.float64).ravel()
    per_mb = [{"rows": int(r), "length": int(L), "real_tokens": int(b["real_tokens"]), "measured_s": float(m),
               "preset_s": float(p), "profiled_s": float(q)}
              for r, L, b, m, p, q in zip(rows, lens, mbs, measured, pred_preset, pred_profiled)]
    layers = [{"layer": i, "kind": "embedding" if i == 0 else ("head" if i == len(model.layers) - 1 else "block"),
               "forward_s": float(costs.forward_s[i].sum()), "backward_s": float(costs.backward_s[i].sum()),
               "saved_bytes": float(costs.memory_bytes[i].max())} for i in range(len(model.layers))]
    result = {
        "preset": preset, "microbatches": len(mbs), "profile_s": profile_s, "cost_model_path": path,
        "profile_grid": {"rows": list(cfg.profile_rows), "lengths": list(cfg.profile_lengths)},
        "mape_preset": _mape(pred_preset, measured), "mape_profiled": _mape(pred_profiled, measured),
        "backward_over_forward": float(costs.backward_s.sum() / max(costs.forward_s.sum(), 1e-12)),
        "per_microbatch": per_mb, "per_layer": layers,
    }
    return result, profiled
