"""Activation bytes a stage keeps for backward: the runner's meter and the recompute model fitted from it.

`SavedBytes` counts the bytes of the tensors autograd saves for backward during one forward
(``torch.autograd.graph.saved_tensors_hooks``; each storage once, parameters excluded) plus the
inputs a checkpointed layer keeps, which those hooks do not see (non-reentrant
``torch.utils.checkpoint`` keeps them in its recompute closure). `PipelineRunner` meters every
micro-batch this way and reports, per step, the peak of the bytes its in-flight micro-batches hold
(`StepTiming.peak_saved_bytes`) next to the plan's prediction (``plan.options["stage_peak_bytes"]``).

`measured_stage_memory` fits the `dynabatch.core.cost.stage_memory.StageMemory` of a model cut into stages:
it runs each layer alone on a grid of padded micro-batch shapes, meters the bytes the layer saves
and the bytes of its input (what it keeps when recomputed), and fits, per stage, bytes per feature
unit of the cost model's features for the recomputable layers, the layers recompute never frees
(embedding, head) and one recomputed layer's input. Saved bytes are a deterministic function of
the shape, so the fit is close to exact; it is then scaled up to bound every measured grid point,
so the planner's predictions err on the safe side. Bytes throughout.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


class SavedBytes:
    """Bytes of activation tensors kept for backward during a forward (each storage counted once;
    ``param_ptrs``: storage addresses of parameters, never counted). Use `pack`/`unpack` as
    ``saved_tensors_hooks`` and `keep` for a checkpointed layer's inputs."""

    def __init__(self, param_ptrs: set[int] | None = None):
        self.param_ptrs = param_ptrs or set()
        self.seen: set[int] = set()
        self.bytes = 0

    def _count(self, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.param_ptrs and ptr not in self.seen:
                self.seen.add(ptr)
                self.bytes += storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. sparse)
            pass

    def pack(self, t: torch.Tensor):
        self._count(t)
        return t

    @staticmethod
    def unpack(t):
        return t

    def keep(self, state) -> None:
        """Count the tensors of ``state`` (a tensor or a tuple of them) as kept."""
        for t in (state if isinstance(state, (tuple, list)) else (state,)):
            self._count(t)

    def hooks(self):
        """The context manager metering what autograd saves."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def param_pointers(modules) -> set[int]:
    """Storage addresses of the parameters of ``modules`` (what `SavedBytes` leaves out)."""
    return {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}


def default_grid(model) -> list:
    """Padded `MicroBatchShape` s spanning rows 1-8 and lengths 16-128 (targets 8-32 for
    encoder-decoder models): the grid `measured_stage_memory` fits on."""
    from ..models.spec import MicroBatchShape

    targets = (8, 16, 32) if model.kind == "encoder_decoder" else (0,)
    return [MicroBatchShape("padded", r, L, T) for r in (1, 2, 4, 8) for L in (16, 32, 64, 128) for T in targets]


def layer_memory(model, shapes: Sequence, *, device="cpu", seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per layer and shape: bytes the layer saves for backward and bytes of its input state,
    both float64 ``[n_layers, len(shapes)]`` (the embedding's input, a dictionary, counts 0)."""
    layers = list(model.layers)
    params = param_pointers(layers)
    gen = torch.Generator().manual_seed(seed)
    saved = np.zeros((len(layers), len(shapes)))
    inputs = np.zeros_like(saved)
    for g, shape in enumerate(shapes):
        batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                 for k, v in model.random_batch(shape, gen).items()}
        x = batch
        for i, layer in enumerate(layers):
            if i > 0:
                x = cut_graph(x)
                m_in = SavedBytes(params)
                m_in.keep(x)
                inputs[i, g] = m_in.bytes
            meter = SavedBytes(params)
            with meter.hooks():
                x = layer(x) if i == 0 else (layer(x, batch) if i == len(layers) - 1 else layer(x))
            saved[i, g] = meter.bytes
    return saved, inputs


def cut_graph(state):
    """Cut the autograd graph at a layer boundary, so each layer is metered (and timed) alone."""
    def one(t):
        if isinstance(t, torch.Tensor):
            d = t.detach()
            return d.requires_grad_(True) if d.is_floating_point() else d
        return t
    return tuple(one(t) for t in state) if isinstance(state, (tuple, list)) else one(state)


def _bounding_fit(phi: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least-squares-like coefficients (features never seen are 0), scaled up so that
    ``phi @ coef >= y`` on every row."""
    from ...core.kernels.cost import NUM_FEATURES

    coef = np.zeros(NUM_FEATURES)
    if not np.any(y > 0):
        return coef
    cols = np.flatnonzero(np.any(phi != 0, axis=0))
    x = phi[:, cols]
    scale = np.maximum(np.abs(x).max(axis=0), 1e-300)
    sol, *_ = np.linalg.lstsq(x / scale, y, rcond=None)
    sol = np.maximum(sol / scale, 0.0)
    coef[cols] = sol
    pred = phi @ coef
    ratio = np.max(np.where(y > 0, y / np.maximum(pred, 1e-300), 0.0))
    return coef * max(float(ratio), 1.0)


def measured_stage_memory(model, bounds: Sequence[int], cost, *, shapes: Sequence | None = None, device="cpu",
                          seed: int = 0):
    """The `dynabatch.core.cost.stage_memory.StageMemory` of ``model`` (a `LayeredModel`) cut at ``bounds``,
    fitted in ``cost``'s features from the bytes its layers save on ``shapes`` (padded
    `MicroBatchShape` s, default `default_grid`); see the module docstring. Set it as
    ``cost.stage_memory_model`` for the planner to price recomputation of this model's stages."""
    from ...core.cost.stage_memory import StageMemory

    shapes = default_grid(model) if shapes is None else list(shapes)
    b = [int(x) for x in bounds]
    n = len(model.layers)
    if b[0] != 0 or b[-1] != n or any(y <= x for x, y in zip(b[:-1], b[1:])):
        raise ValueError(f"bounds must rise strictly from 0 to {n}, got {b}")
    saved, inputs = layer_memory(model, shapes, device=device, seed=seed)
    phi = cost.padded_features(np.array([s.rows for s in shapes]), np.array([s.input_len for s in shapes]),
                               np.array([s.target_len for s in shapes]), np.array([s.tiles for s in shapes]))
    S = len(b) - 1
    layers, fixed, layer, inp = [], [], [], []
    for s in range(S):
        idx = np.arange(b[s], b[s + 1])
        edge = (idx == 0) | (idx == n - 1)
        rec = idx[~edge]
        layers.append(len(rec))
        fixed.append(_bounding_fit(phi, saved[idx[edge]].sum(axis=0)))
        layer.append(_bounding_fit(phi, saved[rec].sum(axis=0)))
        inp.append(_bounding_fit(phi, inputs[rec].max(axis=0)) if len(rec) else np.zeros(phi.shape[1]))
    return StageMemory(tuple(layers), np.array(inp), np.array(fixed), np.array(layer), "measured")
