"""Per-stage activation recomputation: what it costs, what it frees, and the planner's choice.

A stage's recompute policy is a count ``k[s]``: the first ``k[s]`` of the stage's recomputable layers
(the stage's layers less the embedding and the output head) run under
``torch.utils.checkpoint`` (non-reentrant): each keeps only its input for backward and runs its
forward again inside the backward. The policies the planner offers (`RECOMPUTE`):

* ``none``: ``k = 0`` on every stage (today's default);
* ``full``: every recomputable layer of every stage;
* ``adaptive``: per stage the fewest layers that keep the stage's simulated peak of held activation
  bytes within ``device_memory_limit``, chosen together with the micro-batch cuts and the schedule
  (`plan_microbatches`). Under 1F1B stage ``s`` holds up to ``S - s`` micro-batches, so the first
  stages need the most recomputation and the last the least.

Pricing (`recompute_costs`, per micro-batch ``j`` with features ``phi[j]``, stage ``s`` holding ``n[s]``
recomputable layers, ``rho = min(k / n, 1)``, forward share ``f``):

* time: ``t[s, j] + rho * f * v[s, j]`` seconds, ``v`` the stage time without its fixed
  per-micro-batch terms (features ``one``/``has_vis``): the recomputed share of the layers'
  forward runs once more, in the backward;
* held bytes: ``fixed[s, j] + (1 - rho) * layers[s, j] + min(k, n) * input[s, j]``: what autograd
  keeps for backward between a micro-batch's forward and its backward, the quantity the device limit
  bounds and the runner meters. While a stage recomputes a layer inside a backward it also needs
  that layer's activations for a moment (``layers / n`` of one micro-batch); like every other
  transient of the backward pass (gradients, workspace) that is left to the headroom between the
  device limit and the device's memory (`recompute_costs` returns it as the working bytes).

Layers of one stage are priced as equal shares of the stage (exact for a stage of one layer kind;
for a stage mixing ViT and LLM layers the first ``k`` layers are the vision ones, priced at the
stage's mean). `StageMemory` says how the bytes split: `StageMemory.analytic` from the cost model's
layout (every byte in the layers, each recomputed layer keeping its ``dtype x hidden`` input per
token); `dynabatch.pipeline.measure.memory.measured_stage_memory` fits them from the bytes autograd saves
in a real model's stages. Times are seconds, memory bytes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ..cost.features import microbatch_features
from ..cost.stage_memory import StageMemory, stage_memory_of
from ..options import RECOMPUTE
from ..schedule.build import rank_span_and_peaks
from ..schedule.orders import record_orders, stage_limit

__all__ = ["RECOMPUTE", "StageMemory", "apply_recompute", "recompute_costs"]


def recompute_costs(cost, phi, k, memory: StageMemory | None = None):
    """Per-stage seconds ``[S, M]``, held bytes ``[S, M]`` and the recompute working bytes ``[S]`` of
    micro-batches with features ``phi`` ``[M, F]`` when stage ``s`` recomputes its first ``k[s]``
    layers (see the module docstring)."""
    k = np.asarray(k, np.float64)
    return _Priced(cost, phi, stage_memory_of(cost, len(k)) if memory is None else memory).at(k)


class _Priced:
    """The per-stage terms of `recompute_costs` that do not depend on the counts, priced once."""

    def __init__(self, cost, phi, memory: StageMemory):
        phi = np.atleast_2d(np.asarray(phi, np.float64))
        S = memory.num_stages
        self.n = np.asarray(memory.layers)
        self.f = cost.forward_fraction
        self.t = cost.stage_times(phi, S)
        var = phi.copy()
        var[:, 7:] = 0.0  # the fixed per-micro-batch terms are not recomputed
        self.v = cost.stage_times(var, S)
        self.fixed = (phi @ memory.fixed_coef.T).T
        self.layers = (phi @ memory.layer_coef.T).T if memory.layer_coef is not None \
            else np.maximum(cost.stage_memory(phi, S) - self.fixed, 0.0)
        self.input = (phi @ memory.input_coef.T).T

    def at(self, k):
        """(seconds, held bytes, working bytes) with ``k[s]`` layers recomputed on stage ``s``."""
        n = self.n
        kk = np.minimum(np.asarray(k, np.float64), n)
        rho = np.where(n > 0, kk / np.where(n > 0, n, 1.0), 0.0)
        st = self.t + (rho * self.f)[:, None] * self.v
        held = self.fixed + (1.0 - rho)[:, None] * self.layers + kk[:, None] * self.input
        per_layer = np.where(n > 0, 1.0 / np.where(n > 0, n, 1.0), 0.0)
        work = np.where(kk > 0, self.layers.max(axis=1, initial=0.0) * per_layer, 0.0)
        return st, held, work


def _rank_slices(plan) -> list[np.ndarray]:
    """Each rank's micro-batch positions in execution order."""
    out = []
    for r in range(plan.num_ranks):
        out.append(plan.rank_indices(r))
    return out


def _peaks_and_times(plan, st, held, p2p, fwd_fraction, limit):
    """(peak held bytes per stage over the ranks, each rank's simulated makespan)."""
    S = st.shape[0]
    peaks = np.zeros(S)
    times = np.zeros(plan.num_ranks)
    for r, idx in enumerate(_rank_slices(plan)):
        if not len(idx):
            continue
        _, buf, times[r] = rank_span_and_peaks(plan.schedule, st[:, idx], p2p[idx], held[:, idx], fwd_fraction, limit)
        peaks = np.maximum(peaks, buf)
    return peaks, times


def apply_recompute(plan, cost, policy: str, device_memory_limit: float | None = None, *, shapes=None):
    """``plan`` with the per-stage recompute of ``policy`` (`RECOMPUTE`) priced in: per-stage times and
    held bytes, bottleneck times, rank times re-simulated, and in ``options`` the counts
    (``recompute_layers``), the policy, the limit and the predicted per-stage peaks
    (``stage_peak_bytes``, bytes the in-flight micro-batches keep for backward at once).

    ``adaptive`` picks, per stage, the fewest layers that keep the stage's peak within
    ``device_memory_limit`` (bytes of activations one device may hold); with a limit, every policy
    raises ValueError when its peak exceeds it (naming the stage, its peak and the limit).
    ``shapes``: the samples, needed for packed plans (`dynabatch.core.cost.features.microbatch_features`).
    """
    if policy not in RECOMPUTE:
        raise ValueError(f"unknown recompute policy {policy!r}; choose one of {RECOMPUTE}")
    if policy == "adaptive" and device_memory_limit is None:
        raise ValueError("recompute='adaptive' needs device_memory_limit= (bytes of activations a device may hold)")
    S = plan.num_stages
    memory = stage_memory_of(cost, S)
    phi = microbatch_features(plan, cost, shapes)
    p2p = cost.p2p_time(phi)
    fwd_fraction = cost.forward_fraction
    sched_limit = stage_limit(plan)
    top = memory.max_layers()
    k = np.zeros(S, np.int64) if policy != "full" else top.copy()
    limit = np.inf if device_memory_limit is None else float(device_memory_limit)
    priced = _Priced(cost, phi, memory)
    for _ in range(int(top.sum()) + 2):  # k only grows: at most sum(top) rounds change it
        st, held, _ = priced.at(k)
        peaks, times = _peaks_and_times(plan, st, held, p2p, fwd_fraction, sched_limit)
        over = np.flatnonzero(peaks > limit)
        if policy != "adaptive" or not len(over):
            break
        stuck = [s for s in over if k[s] >= top[s]]
        if stuck:
            s = int(stuck[0])
            raise ValueError(f"stage {s} holds {peaks[s]:.4g} bytes of activations at its peak even with all "
                             f"{top[s]} of its layers recomputed, over the device limit of {limit:.4g} bytes: "
                             "smaller micro-batches (memory_limit), more stages or a larger limit are needed")
        # the smallest count that fits each over-limit stage under the current order (orders are static
        # for gpipe/1f1b; an adaptive order is rebuilt from the new bytes in the next round)
        for s in over:
            for c in range(int(k[s]) + 1, int(top[s]) + 1):
                k[s] = c
                st2, held2, _ = priced.at(k)
                if _peaks_and_times(plan, st2, held2, p2p, fwd_fraction, sched_limit)[0][s] <= limit:
                    break
    if len(over) and policy != "adaptive":
        s = int(over[0])
        raise ValueError(f"recompute={policy!r}: stage {s} holds {peaks[s]:.4g} bytes of activations at its peak, "
                         f"over the device limit of {limit:.4g} bytes (recompute='adaptive' picks per-stage "
                         "recomputation that fits)")
    options = {**plan.options, "recompute": policy, "recompute_layers": [int(x) for x in k],
               "stage_peak_bytes": [float(x) for x in peaks]}
    if device_memory_limit is not None:
        options["device_memory_limit"] = float(device_memory_limit)
    new = dataclasses.replace(plan, mb_time_s=st.max(axis=0), mb_memory_bytes=held.max(axis=0), rank_time_s=times,
                              stage_time_s=st, stage_memory_bytes=held, options=options)
    return record_orders(new, p2p, fwd_fraction)  # adaptive: the order rebuilt from the recomputed bytes


def recompute_layers(plan, stage: int) -> int:
    """How many recomputable layers ``stage`` of ``plan`` recomputes (0 when the plan records none)."""
    ks = (getattr(plan, "options", None) or {}).get("recompute_layers")
    if not ks:
        return 0
    if not 0 <= stage < len(ks):
        raise ValueError(f"the plan records recompute for {len(ks)} stages, not stage {stage}")
    return int(ks[stage])


def recomputed_cost(cost, num_stages: int):
    """A shallow copy of ``cost`` whose activation memory is the least any policy reaches: every
    stage with all its recomputable layers recomputed, the largest over the stages (same on every
    stage, bytes per feature unit); times unchanged. The planner sizes micro-batches with it when
    recomputation may free memory (a measured `ProfiledTable` keeps its own memory)."""
    import copy

    memory = stage_memory_of(cost, num_stages)
    n = np.asarray(memory.layers)
    rows = memory.fixed_coef + n[:, None] * memory.input_coef
    c = copy.copy(cost)
    c.mem_coef = rows.max(axis=0)
    if getattr(c, "_stage_scale", None) is not None:  # the rows are already per stage: no layout scaling
        c._stage_scale = (c._stage_scale[0], np.ones_like(c._stage_scale[1]))
    return c


def dp_candidates(cost, limit: float, policy: str, device_memory_limit: float | None, num_stages: int):
    """(cost model, per-micro-batch cap in bytes) pairs the DP cuts a step with under ``policy``.

    ``full``: the `recomputed_cost` memory, capped by the device limit (one micro-batch fully
    recomputed must fit it) or ``limit``. ``adaptive``: that, and the cost model's own memory at
    ``limit`` and at the device limit shared by the ``S`` and ``ceil(S / 2)`` micro-batches stage 0
    holds under 1F1B (smaller micro-batches need less recomputation but run less efficiently;
    the simulated makespan decides)."""
    d = float(device_memory_limit) if device_memory_limit is not None else None
    cands = [(recomputed_cost(cost, num_stages), d if d is not None else float(limit))]
    if policy == "adaptive":
        caps = [float(limit)] + [d / share for share in (num_stages, math.ceil(num_stages / 2))]
        for c in caps:
            if c <= float(limit) and all(abs(c - x) > 1e-9 * x for _, x in cands[1:]):
                cands.append((cost, c))
    return cands
