"""``dynabatch bench plan --device-memory-limit B``: the dp methods with no, full and adaptive recomputation.

The same global batches as the method table, each planned with ``recompute`` ``none``, ``full`` and
``adaptive`` under the device limit (`dynabatch.core.plan.recompute`); reported per policy: the mean
simulated iteration time, its ratio to full recomputation, the largest predicted per-stage peak of
kept activation bytes against the limit (``none`` is cut with micro-batches of up to the device
limit each, planned without the check, and marked when its peak does not fit), and the mean
recomputed layers per stage. Seconds, bytes.
"""

from __future__ import annotations

import numpy as np

from ..core.options import RECOMPUTE
from ..core.plan.steps import plan_step


def recompute_rows(shapes, batches_idx, cost, options, methods=("dp", "dp_varlen")) -> dict:
    """``{method: {policy: row}}`` for the dp methods of ``methods`` (see the module docstring)."""
    limit = options.device_memory_limit
    out = {}
    for m in [m for m in methods if m in ("dp", "dp_varlen")]:
        rows = {}
        for policy in RECOMPUTE:
            # none: micro-batches up to the device limit each, planned unchecked; its peak shows whether it fits
            o = options.replace(method=m, method_options={}, recompute=policy,
                                device_memory_limit=1e300 if policy == "none" else limit,
                                memory_limit=limit if policy == "none" and options.memory_limit is None
                                else options.memory_limit)
            try:
                plans = [plan_step(shapes, cost, o, idx, i) for i, idx in enumerate(batches_idx)]
            except ValueError as e:  # full recomputation does not fit either
                rows[policy] = {"error": str(e)}
                continue
            peaks = np.array([p.options["stage_peak_bytes"] for p in plans])
            rows[policy] = {
                "iteration_time_s": float(np.mean([p.iteration_time_s for p in plans])),
                "peak_bytes": peaks.max(axis=0).tolist(),
                "fits": bool(peaks.max() <= limit),
                "mean_recompute_layers": np.mean([p.options["recompute_layers"] for p in plans], axis=0).tolist(),
            }
        full = rows.get("full", {}).get("iteration_time_s")
        for r in rows.values():
            if full and "iteration_time_s" in r:
                r["vs_full"] = r["iteration_time_s"] / full
        out[m] = rows
    return out


def format_recompute(rows: dict, limit: float) -> str:
    """The text table of `recompute_rows`."""
    lines = [f"recomputation under a device limit of {limit / 2**30:.2f} GiB of kept activations per stage:",
             f"{'method':<10} {'recompute':<9} {'iter ms':>9} {'vs full':>8} {'fits':>5}  "
             f"{'peak GiB per stage':<28} recomputed layers per stage (mean)"]
    for m, by in rows.items():
        for policy, r in by.items():
            if "error" in r:
                lines.append(f"{m:<10} {policy:<9} {'-':>9} {'-':>8} {'no':>5}  {r['error'][:90]}")
                continue
            peaks = " ".join(f"{x / 2**30:.1f}" for x in r["peak_bytes"])
            ks = " ".join(f"{x:.1f}" for x in r["mean_recompute_layers"])
            lines.append(f"{m:<10} {policy:<9} {r['iteration_time_s'] * 1e3:9.1f} {r.get('vs_full', float('nan')):8.3f} "
                         f"{'yes' if r['fits'] else 'no':>5}  {peaks:<28} {ks}")
    return "\n".join(lines)
