"""The torch-free planning core: what a step costs and how its samples become micro-batches.

Layers, each importing only those above it in this list:

* records: `shapes` (per-sample token counts), `options` (`PlanOptions`, every planning option once),
  `methods` (the baseline methods by name), `batchplan` (the `BatchPlan` record), and `kernels/`
  (every numba kernel beside its plain-Python reference);
* `cost/`: the cost model (`CostModel` from `presets` and `analytic` coefficients, a profiled table, or
  a refit), per-stage layouts, what recomputation frees, a plan's feature rows;
* `schedule/`: op orders (gpipe, 1f1b, adaptive, auto) and the one derivation of a rank's order that
  the plan records (`schedule.orders`);
* `simulate/`: the pipeline simulator, flush-free streams, many models with spilled shards;
* `plan/`: `plan_microbatches` (the DP or a baseline, rank balancing, ordering), its per-stage path,
  recomputation, steps of an epoch, bounds, and the feedback loop that refits the cost model.

Nothing here imports torch or any other dynabatch package; reading shape files and command-line flags
live outside (`dynabatch.shape_sources`, `dynabatch.option_flags`).
"""
