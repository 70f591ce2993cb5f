"""Per-layer costs of a model measured on real micro-batches: `profile_layers` times each layer's
forward and backward alone (seconds) and meters the activation bytes it saves; `search_partition`
turns them into the `balanced_partition` every rank agrees on. Seconds and bytes."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch
from torch import nn

from ..models.partition import LayerCosts, StagePartition, balanced_partition
from .memory import SavedBytes, cut_graph


def _float_tensors(state) -> list[torch.Tensor]:
    items = state if isinstance(state, (tuple, list)) else (state,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_layers(layers: Sequence[nn.Module], batches: Sequence[dict], *, repeats: int = 3, warmup: int = 1,
                   device=None) -> LayerCosts:
    """Time every layer's forward and backward (seconds, fastest of ``repeats``:
    timing noise on a shared machine only adds) on each micro-batch
    of ``batches``, plus the activation bytes it saves for backward and the boundary state's bytes.

    Layers run one at a time with the graph cut between them, so a layer's backward is timed alone.
    On CUDA the device is synchronized around each timed region.
    """
    layers = list(layers)
    if len(layers) < 2:
        raise ValueError("profile_layers needs an embedding and a head (at least 2 layers)")
    device = torch.device(device) if device is not None else next(layers[0].parameters()).device
    n, m = len(layers), len(batches)
    fwd = np.zeros((n, m))
    bwd = np.zeros((n, m))
    mem = np.zeros((n, m))
    boundary = np.zeros(m)
    param_ptrs = {p.untyped_storage().data_ptr() for layer in layers for p in layer.parameters()}
    for j, raw in enumerate(batches):
        batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in raw.items()}
        tf = [[] for _ in range(n)]
        tb = [[] for _ in range(n)]
        for rep in range(warmup + repeats):
            ins, outs, saved = [], [], []
            x = batch
            for i, layer in enumerate(layers):
                if i > 0:
                    x = cut_graph(x)
                counter = SavedBytes(param_ptrs)
                _sync(device)
                t0 = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                    y = layer(x) if i == 0 else (layer(x, batch) if i == n - 1 else layer(x))
                _sync(device)
                if rep >= warmup:
                    tf[i].append(time.perf_counter() - t0)
                ins.append(x)
                outs.append(y)
                saved.append(counter.bytes)
                x = y
            grads = None
            for i in range(n - 1, -1, -1):
                _sync(device)
                t0 = time.perf_counter()
                if i == n - 1:
                    outs[i][0].backward()
                else:
                    pairs = [(o, g) for o, g in zip(_float_tensors(outs[i]), grads) if o.requires_grad and g is not None]
                    if pairs:
                        torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
                _sync(device)
                if rep >= warmup:
                    tb[i].append(time.perf_counter() - t0)
                grads = [t.grad for t in _float_tensors(ins[i])] if i > 0 else None
            for layer in layers:
                layer.zero_grad(set_to_none=True)
            mem[:, j] = saved
            boundary[j] = sum(t.numel() * t.element_size() for t in (outs[0] if isinstance(outs[0], tuple) else (outs[0],))
                              if isinstance(t, torch.Tensor))
        fwd[:, j] = [min(t) for t in tf]
        bwd[:, j] = [min(t) for t in tb]
    return LayerCosts(fwd, bwd, mem, boundary)


def search_partition(layers: Sequence[nn.Module], batches: Sequence[dict], num_stages: int, *,
                     schedule: str = "1f1b", repeats: int = 1, warmup: int = 1, device=None,
                     group=None, p2p_s=0.0, memory_limit: float | None = None) -> StagePartition:
    """The `balanced_partition` of ``layers`` for the micro-batch mix ``batches``, identical on every rank.

    Each rank profiles the layers on its own ``batches`` (`profile_layers`, seconds); when
    ``torch.distributed`` is initialized the per-layer costs are averaged over ``group`` (default:
    the whole world) before the search, so that timing noise, which differs from rank to rank,
    cannot make two ranks pick different splits (they would then deadlock). Every rank must pass
    the same number of micro-batches. ``schedule`` ``adaptive`` is searched as ``1f1b``.
    ``memory_limit``: bytes of kept activations a device may hold (see `balanced_partition`).
    """
    import torch.distributed as dist

    if not batches:
        raise ValueError("search_partition needs at least one representative micro-batch")
    costs = profile_layers(layers, batches, repeats=repeats, warmup=warmup, device=device)
    if dist.is_available() and dist.is_initialized():
        dev = torch.device(device) if device is not None else next(layers[0].parameters()).device
        m = torch.tensor([len(batches), -len(batches)], dtype=torch.float64, device=dev)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        if m[0].item() != -m[1].item():
            raise ValueError(f"search_partition: ranks passed different numbers of micro-batches "
                             f"({int(-m[1].item())} to {int(m[0].item())}); every rank must profile the same count")
        arrays = [costs.forward_s, costs.backward_s, costs.memory_bytes, np.broadcast_to(costs.boundary_bytes, costs.forward_s.shape)]
        t = torch.tensor(np.stack(arrays), dtype=torch.float64, device=dev)
        dist.all_reduce(t, group=group)
        mean = (t / dist.get_world_size(group)).cpu().numpy()
        costs = LayerCosts(mean[0], mean[1], mean[2], mean[3][0])
    return balanced_partition(costs, num_stages, schedule="1f1b" if schedule == "adaptive" else schedule, p2p_s=p2p_s,
                              memory_limit=memory_limit)
