"""Seconds per op of a simulation, from per-stage seconds: the forward/backward split every simulation
of a plan uses, and the chunks of a stage (virtual stages). Numba kernels beside their plain references
(`split_kernel` / `split_reference`, `chunk_times` / `chunk_times_reference`)."""

from __future__ import annotations

import numpy as np
from .compile_once import njit


@njit(cache=True)
def split_kernel(st, fwd_fraction):
    """(fwd, bwd) float64 ``[S, k]``: each stage runs a micro-batch's forward for ``fwd_fraction`` of its
    stage time ``st`` (seconds) and its backward for the rest. The one split every simulation of a
    plan uses (planner, recompute, inspect, flush-free); `split_reference` is its plain form."""
    S, k = st.shape
    fwd = np.empty((S, k))
    bwd = np.empty((S, k))
    for s in range(S):
        for j in range(k):
            fwd[s, j] = st[s, j] * fwd_fraction
            bwd[s, j] = st[s, j] - fwd[s, j]
    return fwd, bwd


def split_reference(st, fwd_fraction):
    """Plain `split_kernel` (numpy arrays, the same two operations per element)."""
    st = np.asarray(st, np.float64)
    fwd = st * fwd_fraction
    return fwd, st - fwd


@njit(cache=True)
def chunk_times(t, v):
    """float64 ``[v S, k]``: per-stage seconds ``t`` ``[S, k]`` as ``v`` chunks per stage, each a ``1 / v``
    share of its stage's layers and seconds (virtual stage ``c S + s`` is chunk ``c`` of stage ``s``)."""
    S, k = t.shape
    out = np.empty((v * S, k))
    for c in range(v):
        for s in range(S):
            for j in range(k):
                out[c * S + s, j] = t[s, j] / v
    return out


def chunk_times_reference(t, v):
    """Plain `chunk_times`."""
    return np.concatenate([np.asarray(t, np.float64) / v] * v, axis=0)
