"""`Step`: what `DataLoader.steps` yields for one optimizer step.

A `Step` is a ``list`` of this rank's micro-batch dicts (so code that treats a step as a list keeps
working) carrying what the feedback loop and loss normalization need about the step as a whole:

* ``step`` (global step number, from 0 across epochs), ``epoch``, ``rank``;
* ``plan``: the step's `BatchPlan`: the global plan over all ranks (indexed mode), this rank's own
  plan (streaming mode, where each rank plans its share with ``num_ranks=1``), the file's plan of
  the step when replaying a plan file;
* ``shapes``: the `Shapes` of the samples of ``plan`` (per-sample lengths, for packed features);
* ``target_tokens``: the step's real target (loss) tokens over all ranks;
* ``cost_version``: ``getattr(cost_model, "version", 0)`` when the step was planned (a step planned
  ahead used the model as it was then).
"""

from __future__ import annotations


class Step(list):
    """This rank's micro-batch dicts of one step, with the step's plan (see the module docstring)."""

    __slots__ = ("step", "epoch", "rank", "plan", "shapes", "target_tokens", "cost_version")

    def __init__(self, batches, *, step: int, epoch: int, rank: int, plan=None, shapes=None,
                 target_tokens: int = 0, cost_version: int = 0):
        super().__init__(batches)
        self.step, self.epoch, self.rank = int(step), int(epoch), int(rank)
        self.plan, self.shapes = plan, shapes
        self.target_tokens, self.cost_version = int(target_tokens), int(cost_version)

    @classmethod
    def of(cls, ready, batches, rank: int) -> "Step":
        """The `Step` of a collated `ReadyStep` (``batches``: the micro-batches this rank yields)."""
        sp = ready.step
        return cls(batches, step=sp.step, epoch=sp.epoch, rank=rank, plan=sp.plan, shapes=sp.shapes,
                   target_tokens=sp.step_target_tokens, cost_version=sp.cost_version)

    def __repr__(self) -> str:
        return (f"Step(step={self.step}, epoch={self.epoch}, rank={self.rank}, microbatches={len(self)}, "
                f"target_tokens={self.target_tokens}, cost_version={self.cost_version})")
