"""`dynabatch demo`: plan generated data end to end and print what the planner decided."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from .bounds import iteration_lower_bound
from .cost import CostModel
from .plan import plan_microbatches, split_global_batches
from .shape_sources import synthetic_shapes

_SETUPS = (
    # (model preset, synthetic kind, max_len)
    ("gpt", "text", 2048),
    ("t5", "text", 2048),
    ("vlm", "vision", 8192),
)


def _microbatch_table(plan, rank: int) -> str:
    head = f"{'mb':>3} {'rows':>5} {'in len':>7} {'tgt len':>7} {'tiles':>5} {'real tok':>9} {'pad eff':>7} {'pred ms':>8}"
    lines = [head, "-" * len(head)]
    for mb in plan.microbatches(rank):
        eff = mb.real_tokens / mb.tokens if mb.tokens else 1.0
        lines.append(f"{mb.index:>3} {mb.rows:>5} {mb.input_len:>7} {mb.target_len:>7} {mb.vision_tiles:>5} "
                     f"{mb.real_tokens:>9} {eff:>7.2f} {mb.time_s * 1e3:>8.1f}")
    return "\n".join(lines)


def run_demo(out_dir: str | None = None, seed: int = 0, ranks: int = 8, stages: int = 4,
             global_batch_tokens: int = 65536) -> int:
    """Plan one global batch of generated data for each model preset and print the plans."""
    out = Path(out_dir) if out_dir else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    for model, kind, max_len in _SETUPS:
        shapes, tasks = synthetic_shapes(kind, 8000, seed=seed)
        cost = CostModel.preset(model, num_stages=stages)
        first = split_global_batches(shapes, global_batch_tokens, seed=seed)[0]
        batch = shapes.take(first)
        kw = dict(num_stages=stages, num_ranks=ranks, max_len=max_len, max_target_len=512)
        dp = plan_microbatches(batch, cost, method="dp", **kw)
        pack = plan_microbatches(batch, cost, method="pack", **kw)
        lb = iteration_lower_bound(batch, cost, num_stages=stages, num_ranks=ranks, max_len=max_len,
                                   max_target_len=512)
        print(f"\n=== {model} ({cost.model.kind}) on {cost.device.name}: one global batch of {len(batch)} "
              f"{kind} samples, {int(batch.total_tokens.sum())} tokens, {ranks} ranks x {stages} stages")
        print(f"tasks in the batch: " + ", ".join(
            f"{tasks[t]} {c}" for t, c in zip(*np.unique(batch.task_id, return_counts=True))))
        print(f"dynabatch dp: {dp.num_microbatches} micro-batches ({dp.microbatches_per_rank()[0]} per rank), "
              f"iteration {dp.iteration_time_s * 1e3:.0f} ms, padding efficiency {dp.padding_efficiency:.2f}, "
              f"rank max/mean {dp.rank_imbalance:.3f}")
        print(f"packing:      {pack.num_microbatches} micro-batches, iteration {pack.iteration_time_s * 1e3:.0f} ms, "
              f"padding efficiency {pack.padding_efficiency:.2f}  ->  dp is {pack.iteration_time_s / dp.iteration_time_s:.2f}x faster")
        print(f"objective lower bound {lb * 1e3:.0f} ms; dp objective {dp.objective_s * 1e3:.0f} ms")
        print(f"rank 0's micro-batches in execution order:\n{_microbatch_table(dp, 0)}")
        if out:
            pq.write_table(shapes.to_arrow(), out / f"{kind}_shapes.parquet")
            pq.write_table(dp.to_arrow(), out / f"{model}_dp_plan.parquet")
    if out:
        print(f"\nshapes and plans written to {out}/")
    return 0
