"""Compare dynabatch's planner with the usual batching methods on your own sample lengths.

    python examples/compare_methods.py                      # generated FLAN-like lengths
    python examples/compare_methods.py lengths.parquet t5   # a Shapes/length file, a model preset

The same comparison as `dynabatch bench plan`, written with the Python API so it is easy to adapt:
swap in a `CostModel.load("costs.json")` measured on your hardware, or your own world layout.
"""

import sys

import numpy as np

from dynabatch.core.options import METHODS
from dynabatch import CostModel, PlanOptions, plan_microbatches, read_shapes, split_global_batches
from dynabatch.core.plan import objective_lower_bound
from dynabatch.shape_sources import synthetic_shapes


def main(path: str | None = None, model: str = "gpt", ranks: int = 8, stages: int = 4, batches: int = 8) -> dict:
    shapes, _ = read_shapes(path) if path else synthetic_shapes("vision" if model == "vlm" else "text", 20000)
    cost = CostModel.preset(model, num_stages=stages)
    max_len = 8192 if model == "vlm" else 2048
    steps = [shapes.take(i) for i in split_global_batches(shapes, 65536, seed=0, drop_last=True)[:batches]]
    bound = np.mean([objective_lower_bound(s, cost, num_stages=stages, num_ranks=ranks, max_len=max_len,
                                           max_target_len=512) for s in steps])
    options = PlanOptions(num_stages=stages, num_ranks=ranks, max_len=max_len, max_target_len=512)  # one record
    results = {}
    for method in METHODS:
        plans = [plan_microbatches(s, cost, options.replace(method=method), step=k) for k, s in enumerate(steps)]
        results[method] = (np.mean([p.iteration_time_s for p in plans]), np.mean([p.objective_s for p in plans]),
                           np.mean([p.padding_efficiency for p in plans]))
    print(f"{model}: {len(steps)} global batches of 65536 tokens, {ranks} ranks x {stages} stages")
    print(f"{'method':16s} {'ms/step':>8s} {'obj/LB':>7s} {'pad eff':>8s}")
    for method, (it, obj, eff) in results.items():
        print(f"{method:16s} {it * 1e3:8.1f} {obj / bound:7.3f} {eff:8.3f}")
    return results


if __name__ == "__main__":
    main(*(sys.argv[1:2] or [None]), *(sys.argv[2:3] or []))
