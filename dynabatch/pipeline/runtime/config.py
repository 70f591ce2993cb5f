"""`RunnerConfig`: how a `PipelineRunner` executes its steps (schedule, checks, recomputation,
memory metering, flush-free streams and their weight handling, bypass of idle stages, non-finite steps)."""

from __future__ import annotations

from dataclasses import dataclass

from .nonfinite import MODES as NONFINITE
from .schedule import SCHEDULES


@dataclass(frozen=True)
class RunnerConfig:
    """How the runner executes a step.

    ``schedule``: ``auto`` (default: the order each plan records, 1F1B for bare shapes), or ``gpipe``,
    ``1f1b``, ``adaptive`` to override the plan (`schedule.runner_orders`). ``memory_limit_bytes``:
    in-flight activation bytes per stage for ``adaptive`` (default the plan's recorded budget, else
    ``num_stages`` x the step's largest micro-batch). ``debug_shapes``: send a header before every
    message and check it against the receiver's plan. ``gather_timing``: all-gather every rank's `StepTiming` into each step's result
    (what `dynabatch.core.plan.feedback.FeedbackLoop` needs on every rank). ``check_inputs``: check the
    micro-batch dictionaries against the plan before running. ``check_plan``: before the step's first
    transfer, both ends of every link compare a small fingerprint of the messages and shapes they
    expect (one tiny message per link and direction); ranks holding different plans then stop with a
    `ShapeMismatch` naming the micro-batch and both shapes instead of crashing in the transport.
    ``recompute``: ``auto`` (default: the per-stage counts the plan records in
    ``options["recompute_layers"]``, none without), ``none``, ``full`` (every recomputable layer), or
    one count per stage (the first k recomputable layers run under ``torch.utils.checkpoint``; see
    `dynabatch.core.plan.recompute`). ``measure_memory``: meter the activation bytes each micro-batch keeps
    for backward (`dynabatch.pipeline.measure.memory.SavedBytes`) and report the step's peak.
    ``flush``: False makes `run_steps` run its steps as one asynchronous 1F1B stream (PipeOptim): stage
    ``s`` starts the next step's forwards while later stages finish this one, and applies its update
    as soon as its part of a step is done. ``weight_prediction`` then says what a forward whose
    backward comes after an update computes with: None (the current, stale weights), ``"stash"``
    (the backward gets the forward's version back) or ``"predict"`` (the weights predicted from the
    optimizer's own rule, `dynabatch.pipeline.runtime.weight_prediction.WeightPredictor`, with future
    gradients from ``prediction_gradient``). ``bypass_idle_stages``: a micro-batch skips the stages
    holding only layers idle for it (`dynabatch.pipeline.runtime.bypass`: no op, no message there; its entry
    stage starts it from its dictionary, so a middle entry stage needs the step's dictionaries too);
    flushed steps of `from_model` runners only. ``nonfinite``: a NaN or infinite loss or gradient in a step
    is a `NonFiniteStep` naming the step, the stage and the micro-batch on every rank, before any update
    (``"raise"``), or the step is skipped on every rank and counted in ``runner.skipped_steps`` (``"skip"``,
    flushed steps only), or nothing is checked (``"off"``); see `dynabatch.pipeline.runtime.nonfinite`.
    """

    schedule: str = "auto"
    memory_limit_bytes: float | None = None
    debug_shapes: bool = False
    gather_timing: bool = False
    check_inputs: bool = True
    check_plan: bool = True
    recompute: str | tuple[int, ...] = "auto"
    measure_memory: bool = True
    flush: bool = True
    weight_prediction: str | None = None
    prediction_gradient: str = "last"
    bypass_idle_stages: bool = False
    nonfinite: str = "raise"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.weight_prediction not in (None, "none", "stash", "predict"):
            raise ValueError(f"weight_prediction must be None, 'stash' or 'predict', got {self.weight_prediction!r}")
        if self.bypass_idle_stages and not self.flush:
            raise ValueError("bypass_idle_stages runs flushed steps only (flush=True)")
        if self.nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {NONFINITE}, got {self.nonfinite!r}")
        if self.nonfinite == "skip" and not self.flush:
            raise ValueError("nonfinite='skip' needs flushed steps: in a flush-free stream a stage updates before "
                             "the others finish the step, so they cannot agree to skip it; use 'raise'")
        if not self.flush and self.schedule not in ("auto", "1f1b"):
            raise ValueError(f"flush=False runs asynchronous 1F1B; schedule={self.schedule!r} is not 1f1b")
        r = self.recompute
        if isinstance(r, str):
            if r not in ("auto", "none", "full"):
                raise ValueError(f"recompute must be 'auto', 'none', 'full' or per-stage counts, got {r!r}")
        else:
            counts = tuple(int(x) for x in r)
            if any(c < 0 for c in counts) or any(c != x for c, x in zip(counts, r)):
                raise ValueError(f"recompute counts must be integers >= 0, got {r!r}")
            object.__setattr__(self, "recompute", counts)
