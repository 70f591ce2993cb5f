"""Flush vs flush-free: the simulated step time of consecutive dp plans when every step ends with a
pipeline flush (today) and under flush-free asynchronous 1F1B (`dynabatch.core.simulate.flushfree`).

`run_flushfree_bench` plans epoch 0's first global batches of some shapes (the DataLoader's cut,
`dynabatch.core.plan.steps`), one plan per pipeline depth, and reports per depth the mean flushed and
flush-free step time (seconds), the share of the flushed time removed, the steady-state lower
bound and the largest update lag; `format_flushfree` prints it as a table. The data defaults to
the shared ``text_mix_small.jsonl`` when it is present, else the project's synthetic FLAN-like
shapes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..core.cost.model import CostModel
from ..core.simulate.flushfree import flushfree_report
from ..core.options import PlanOptions
from ..shape_sources import read_shapes, synthetic_shapes
from ..core.plan.steps import global_batches, plan_step

#: The shared text mixture `run_flushfree_bench` reads by default when it is there (relative to the
#: working directory, as the CLI examples name shared data).
SHARED_TEXT = Path("../shared/data/text/text_mix_small.jsonl")


def bench_shapes(data=None, *, synthetic_samples: int = 20000, seed: int = 0):
    """``(shapes, label)``: ``data`` (paths for `read_shapes`) if given, else `SHARED_TEXT` when it
    exists, else ``synthetic_samples`` synthetic FLAN-like text shapes."""
    if data is not None:
        shapes, _ = read_shapes(data)
        paths = [data] if isinstance(data, (str, Path)) else list(data)
        return shapes, ", ".join(Path(p).name for p in paths)
    if SHARED_TEXT.exists():
        shapes, _ = read_shapes(SHARED_TEXT)
        return shapes, SHARED_TEXT.name
    shapes, _ = synthetic_shapes("text", synthetic_samples, seed=seed)
    return shapes, f"synthetic text ({synthetic_samples} samples, seed {seed})"


def run_flushfree_bench(shapes=None, *, data=None, label: str | None = None, model: str = "gpt",
                        device: str = "a100-80gb", stages=(4, 8), num_ranks: int = 8,
                        global_batch_tokens: int = 65536, max_len: int = 2048, max_target_len: int = 512,
                        num_batches: int | None = 16, method: str = "dp", warm_steps: int = 1,
                        update_s: float = 0.0) -> dict:
    """Flushed vs flush-free simulated step time of ``method`` plans at each pipeline depth of ``stages``.

    ``shapes`` (a `Shapes`) or ``data`` (see `bench_shapes`); the first ``num_batches`` global batches
    of epoch 0 (all when None) are planned with the ``model``/``device`` cost preset for each depth and
    reported by `flushfree_report` (``warm_steps``, ``update_s`` as there). Returns a JSON-able dict:
    ``config`` and, per depth, the per-step lists and their means (seconds) and totals.
    """
    if shapes is None:
        shapes, default_label = bench_shapes(data)
        label = label or default_label
    out = {"config": {"data": label or "shapes", "samples": len(shapes), "model": model, "device": device,
                      "num_ranks": num_ranks, "global_batch_tokens": global_batch_tokens, "max_len": max_len,
                      "max_target_len": max_target_len, "method": method, "warm_steps": warm_steps,
                      "update_s": update_s},
           "stages": {}}
    for S in stages:
        cost = CostModel.preset(model, device, num_stages=int(S))
        opts = PlanOptions(global_batch_tokens=global_batch_tokens, max_len=max_len, max_target_len=max_target_len,
                           num_stages=int(S), num_ranks=num_ranks, method=method)
        batches = global_batches(shapes, cost, opts, 0)
        if num_batches is not None:
            batches = batches[:num_batches]
        if not batches:
            raise ValueError(f"the data ({len(shapes)} samples) holds no global batch of {global_batch_tokens} tokens")
        plans = [plan_step(shapes, cost, opts, pos, k) for k, pos in enumerate(batches)]
        rep = flushfree_report(plans, cost, warm_steps=warm_steps, update_s=update_s)
        out["stages"][int(S)] = {
            **rep.to_dict(),
            "steps": len(plans),
            "microbatches_per_rank": float(np.mean([p.num_microbatches / p.num_ranks for p in plans])),
            "schedule": plans[0].schedule,
            "mean_flushed_s": float(rep.flushed_s.mean()),
            "mean_flushfree_s": float(rep.flushfree_s.mean()),
            "mean_bound_s": float(rep.bound_s.mean()),
        }
    return out


def format_flushfree(result: dict) -> str:
    """The text table of a `run_flushfree_bench` result (milliseconds per step)."""
    c = result["config"]
    lines = [f"flush vs flush-free 1F1B: {c['method']} plans of {c['data']} ({c['model']} on {c['device']}, "
             f"{c['num_ranks']} ranks, {c['global_batch_tokens']} tokens/step, warm steps {c['warm_steps']})",
             f"{'stages':>6} {'steps':>5} {'mb/rank':>7} {'flushed ms':>10} {'flush-free ms':>13} {'removed':>8} "
             f"{'step min..max':>15} {'bound ms':>9} {'ff/bound':>8} {'max lag':>7}"]
    for S, r in result["stages"].items():
        share = np.asarray(r["removed_share"])
        lines.append(f"{S:>6} {r['steps']:>5} {r['microbatches_per_rank']:>7.1f} {r['mean_flushed_s'] * 1e3:>10.1f} "
                     f"{r['mean_flushfree_s'] * 1e3:>13.1f} {r['total_removed_share'] * 100:>7.1f}% "
                     f"{share.min() * 100:>6.1f}..{share.max() * 100:>5.1f}% {r['mean_bound_s'] * 1e3:>9.1f} "
                     f"{r['mean_flushfree_s'] / r['mean_bound_s']:>8.3f} {max(r['max_lag']):>7d}")
    return "\n".join(lines)
