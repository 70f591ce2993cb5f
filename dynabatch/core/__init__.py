"""The torch-free planning core: what a step costs and how its samples become micro-batches.

Data flows through it in this order: `shapes` (per-sample token counts) -> `options` (`PlanOptions`,
every planning option once) -> `steps` (global batches of an epoch and the plan of each, the one path
online and offline share) -> `plan` (`plan_microbatches`: the dp search of `kernels.dp` or a method of
`baselines`, rank balancing and ordering of `kernels.assign`) -> `batchplan` (the `BatchPlan`
record). Costs come from `cost` (`CostModel`: `analytic` coefficients from `presets`, a profiled
table, or a refit by `feedback` with the math of `fit`); `simulate` plays pipeline schedules and
`bounds` bounds the objective; `recompute` prices per-stage activation recomputation and picks it
under a device memory limit. Every numba kernel sits in `kernels/` beside its plain-Python
reference. Nothing here imports torch or any other dynabatch package.
"""
