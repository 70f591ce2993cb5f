"""Training-framework integrations: one dynabatch `Step` = one optimizer step.

* `step_backward` (torch only; ``accelerate`` optional): forward/backward a step's micro-batches
  with the loss normalized by the step's real target tokens, for hand-written and ``accelerate``
  loops; `model_loss` is its default loss function.
* `DynabatchTrainer` (``transformers``): a ``transformers.Trainer`` that trains from a
  `dynabatch.DataLoader`, with exact resume from its checkpoints.
* `StepFeedback` (torch only): times each step's micro-batches on every rank, gathers the times,
  refits the loader's `FeedbackLoop` and makes the step's `StepMetrics`; `step_backward(feedback=)`
  and `DynabatchTrainer` use it (its metrics in the Trainer's logs: `StepMetricsCallback`).

Nothing here is imported by ``import dynabatch``; names load on first use, so `step_backward`
does not import ``transformers``.
"""

from .._lazy import lazy_names

_LAZY = {
    "step_backward": "accumulation", "model_loss": "loss", "step_target_tokens": "accumulation",
    "NonFiniteStep": "accumulation", "skipped_steps": "accumulation", "loss_route": "loss",
    "DynabatchTrainer": "hf", "LOADER_STATE_NAME": "hf", "steps_in_epoch": "hf", "training_schedule": "hf",
    "StepFeedback": "feedback", "FEEDBACK_STATE_NAME": "feedback", "save_feedback_state": "feedback",
    "read_feedback_state": "feedback", "StepMetrics": "metrics", "MicroBatchTimer": "timing",
    "StepMetricsCallback": "hf_metrics",
}
__all__ = sorted(_LAZY)


__getattr__ = lazy_names(__name__, _LAZY)
