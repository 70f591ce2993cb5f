"""`StepMetricsCallback`: dynabatch's per-step figures in ``transformers.Trainer``'s logs.

At every log (``logging_steps``), the `StepMetrics` of the steps trained since the previous log are
summarized into the log's dict under ``dynabatch/<name>`` keys, before the reporters (TensorBoard,
W&B, ...) see it, and into ``state.log_history``:

* means over the steps: ``padding_efficiency``, ``predicted_imbalance``, ``measured_imbalance``,
  ``microbatches`` (per rank), ``real_microbatches`` (all ranks), ``tokens``, ``target_tokens``
  (per step, all ranks), ``compute_s``, ``step_s`` (seconds), ``data_wait_share``, ``cost_mape``
  (fractions); figures undefined for a step (nan) are left out of its mean, a figure undefined for
  every step is left out of the log;
* ``refits``: refits in the window, with the mean ``refit_mape_before`` / ``refit_mape_after`` of them;
* ``cost_version``: the cost model's version after the window's last step.
"""

from __future__ import annotations

import math

from transformers import TrainerCallback

#: StepMetrics fields logged as their mean over the window.
MEAN_FIELDS = ("padding_efficiency", "predicted_imbalance", "measured_imbalance", "microbatches", "real_microbatches",
               "tokens", "target_tokens", "compute_s", "step_s", "data_wait_share", "cost_mape")
PREFIX = "dynabatch/"


def _mean(values) -> float:
    vals = [float(v) for v in values if v == v]  # nan is not equal to itself
    return sum(vals) / len(vals) if vals else math.nan


def summarize(metrics) -> dict[str, float]:
    """The log entries of a window of `StepMetrics` (see the module docstring)."""
    if not metrics:
        return {}
    out = {f"{PREFIX}{f}": _mean(getattr(m, f) for m in metrics) for f in MEAN_FIELDS}
    refits = [m for m in metrics if m.refit]
    out[f"{PREFIX}refits"] = float(len(refits))
    if refits:
        out[f"{PREFIX}refit_mape_before"] = _mean(m.refit_mape_before for m in refits)
        out[f"{PREFIX}refit_mape_after"] = _mean(m.refit_mape_after for m in refits)
    out[f"{PREFIX}cost_version"] = float(metrics[-1].cost_version)
    return {k: v for k, v in out.items() if v == v}


class StepMetricsCallback(TrainerCallback):
    """Adds the window's `summarize` of ``feedback``'s `StepMetrics` (a
    `dynabatch.integrations.feedback.StepFeedback`) to every Trainer log (see the module docstring);
    `DynabatchTrainer` puts it first among the callbacks, so reporters see the entries."""

    def __init__(self, feedback):
        self.feedback = feedback

    def on_log(self, args, state, control, logs=None, **kwargs):
        """``transformers.TrainerCallback.on_log``: add the unread steps' metrics to ``logs``; ``kwargs``
        are what the Trainer passes every callback (model, optimizer, ...), unused here."""
        entries = summarize(self.feedback.take())
        if entries and logs is not None:
            logs.update(entries)
            last = state.log_history[-1] if state.log_history else None
            if last is not None and last.get("step") == state.global_step:  # Trainer's copy of these logs
                last.update(entries)
        return control


__all__ = ["MEAN_FIELDS", "PREFIX", "StepMetricsCallback", "summarize"]
