"""Planning: a global batch's samples cut into micro-batches, spread over ranks and ordered.

`planner` (`plan_microbatches`: the DP of `dynabatch.core.kernels.dp` or a method of `baselines`, rank
balancing, ordering by `dynabatch.core.schedule`), `stage_plan` (its per-stage path), `recompute`
(per-stage activation recomputation), `steps` (global batches of an epoch and the plan of each),
`bounds` (lower bounds on the objective and the iteration time) and `feedback` (the refit loop that
feeds measured times back into the cost model the planner uses).
"""

from .bounds import iteration_lower_bound, objective_lower_bound
from .feedback import FeedbackLoop, FeedbackRow, StepError
from .planner import NoEqualSplitError, PlanningError, plan_microbatches, split_global_batches
from .recompute import apply_recompute, recompute_costs, recompute_layers
from .stage_plan import evaluate_plan, refine_orders
from .steps import global_batches, num_global_batches, plan_step, sample_tokens

__all__ = ["FeedbackLoop", "FeedbackRow", "NoEqualSplitError", "PlanningError", "StepError", "apply_recompute",
           "evaluate_plan", "global_batches", "iteration_lower_bound", "num_global_batches", "objective_lower_bound",
           "plan_microbatches", "plan_step", "recompute_costs", "recompute_layers", "refine_orders", "sample_tokens",
           "split_global_batches"]
