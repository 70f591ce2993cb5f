"""Multi-task multi-modal training on ``torch.distributed`` (Spindle, issue 39): a `ComponentModel`'s
components on the device groups of an `dynabatch.core.multitask.Allocation`, run in wavefronts.

* `init_spindle` (`setup`): the world (`dynabatch.pipeline.init_pipeline`'s store and failure monitor) and
  one process group per component group (`attach_allocation`: another allocation on the same world);
  `check_allocation` refuses, by component name, an allocation the
  executor cannot run (a component without ranks, ranks outside the world, a pipeline inside a component).
* `SpindleExecutor` (`executor`): one step: each rank runs the components it holds on the micro-batches
  `dynabatch.core.multitask.routing.route` gives it, activations and gradients crossing between groups with
  shapes known from the micro-batches, the gradient all-reduce inside each group, one optimizer step.
  `SpindleStep` holds the loss and each component's measured seconds on the rank.

See docs/multitask.md.
"""

from .executor import SpindleEvent, SpindleExecutor, SpindleStep, task_of
from .setup import AllocationError, SpindleContext, attach_allocation, check_allocation, init_spindle

__all__ = ["AllocationError", "SpindleContext", "SpindleEvent", "SpindleExecutor", "SpindleStep", "attach_allocation",
           "check_allocation", "init_spindle", "task_of"]
