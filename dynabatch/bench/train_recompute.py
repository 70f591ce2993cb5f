"""``dynabatch bench train --device-memory-limit L ...``: recomputation policies under device memory limits.

At each limit (bytes of activations one device may hold, or a fraction of the predicted peak of
``dp`` without recomputation, written ``0.6x``), three variants of ``dp`` train the same model on the
same global batches, interleaved step by step as every ``bench train`` run (`RECOMPUTE_VARIANTS`):

* ``dp+none``: no recomputation, planned without the limit (it may not fit: the result says whether
  its planned and measured peaks do);
* ``dp+full``: every recomputable layer of every stage under ``torch.utils.checkpoint``;
* ``dp+adaptive``: the planner's per-stage choice (`dynabatch.core.plan.recompute`) under the limit.

The runs use equal block counts per stage (``--partition uniform``) so that every variant has the
same stages, and the cost model's `StageMemory` is measured on those stages
(`dynabatch.pipeline.measure.memory.measured_stage_memory`, on the run's device). The recompute variants
are not refit online, so that every variant plans with the same cost model (a `FeedbackLoop` would
refit the time without recomputation, see `dynabatch.core.plan.feedback`).
Reported per limit and variant: tokens/s, step time against ``dp+full``, each stage's largest
measured bytes kept for backward (saved-tensor hooks) against the limit and against the plan's
prediction, and the mean recomputed layers per stage. Bytes, seconds, tokens.
"""

from __future__ import annotations

import numpy as np

RECOMPUTE_VARIANTS = ("dp+none", "dp+full", "dp+adaptive")
#: Steps whose plans give the predicted peak a relative level (``0.6x``) scales.
PEAK_STEPS = 4


def split_variant(method: str) -> tuple[str, str | None]:
    """``"dp+adaptive"`` -> ``("dp", "adaptive")``; a plain method -> ``(method, None)``."""
    from ..core.options import RECOMPUTE

    base, _, policy = method.partition("+")
    if not policy:
        return method, None
    if policy not in RECOMPUTE or base not in ("dp", "dp_varlen"):
        raise ValueError(f"unknown method {method!r}: recompute variants are dp+{{{','.join(RECOMPUTE)}}}")
    return base, policy


def parse_level(text: str) -> tuple[float, bool]:
    """``"0.6x"`` -> ``(0.6, True)`` (relative to the predicted peak without recomputation);
    ``"12MB"``/``"3e7"`` -> ``(bytes, False)``."""
    from ..option_flags import parse_bytes

    t = str(text).strip()
    if t.lower().endswith("x"):
        v = float(t[:-1])
        if not v > 0:
            raise ValueError(f"a relative memory level must be > 0, got {text!r}")
        return v, True
    return parse_bytes(t), False


def measured_memory(model, bounds, cost, device) -> None:
    """Give ``cost`` the `StageMemory` measured on ``model``'s stages at ``bounds``."""
    from ..pipeline.measure.memory import measured_stage_memory

    cost.stage_memory_model = measured_stage_memory(model, bounds, cost, device=device)


def variant_options(options, policy: str):
    """The `PlanOptions` of a recompute variant: ``none`` plans unchecked (whether it fits is
    reported), the others under ``options.device_memory_limit``."""
    if policy == "none":
        return options.replace(recompute="none", device_memory_limit=1e300)  # peaks recorded, never refused
    return options.replace(recompute=policy)


def observe(step, res) -> dict:
    """Per-stage planned and measured peaks (bytes) and recomputed layers of one trained step."""
    plan = getattr(step, "plan", None)
    opts = (plan.options if plan is not None else {}) or {}
    timings = res.all_timings or (res.timing,)
    S = max(t.stage for t in timings) + 1
    measured = [max(t.peak_saved_bytes for t in timings if t.stage == s) for s in range(S)]
    return {"planned_peak_bytes": [float(x) for x in opts.get("stage_peak_bytes", [np.nan] * S)],
            "measured_peak_bytes": [float(x) for x in measured],
            "recompute_layers": [int(x) for x in opts.get("recompute_layers", [0] * S)]}


def summarize(rows: list[dict], limit: float | None) -> dict:
    """A variant's memory result over its steps (per stage: the largest planned and measured peaks)."""
    planned = np.array([r["planned_peak_bytes"] for r in rows], np.float64)
    measured = np.array([r["measured_peak_bytes"] for r in rows], np.float64)
    ks = np.array([r["recompute_layers"] for r in rows], np.float64)
    out = {"planned_peak_bytes": planned.max(axis=0).tolist(), "measured_peak_bytes": measured.max(axis=0).tolist(),
           "mean_recompute_layers": ks.mean(axis=0).tolist(),
           "measured_over_planned": float(np.nanmax(measured / np.where(planned > 0, planned, np.nan)))}
    if limit is not None:
        out.update(device_memory_limit=float(limit), fits_planned=bool(np.nanmax(planned) <= limit),
                   fits_measured=bool(measured.max() <= limit))
    return out
