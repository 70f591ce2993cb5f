"""A `FeedbackLoop`'s refit state as a JSON-able dict, and back: what a checkpoint keeps so that a
resumed run plans exactly as the uninterrupted one would have.

The state holds everything the next refits and plans depend on: the cost model's coefficients
(``time_coef``, the per-stage rows when fitted, ``version``, whether a profiled table was already
dropped), the loop's observation buffers (features, measured and predicted seconds, base weights,
the recorded step of each, their stage), its counters (steps recorded, steps since the last refit,
where the current window starts), its prior and its refit history. Floats are written as Python
floats, whose JSON form (``repr``) reads back bit for bit, so a loaded loop refits to the same
coefficients from the same later observations. ``step_errors`` (one entry per recorded step, for
reporting) are not kept: they restart empty after a load.

Seconds for times, feature units for coefficients (`dynabatch.core.cost.model.FEATURES`).
"""

from __future__ import annotations

import numpy as np

from ..cost.model import NUM_FEATURES

#: ``format`` of a feedback state dict; `load_feedback_state` refuses anything else.
STATE_FORMAT = "dynabatch.feedback_state"
STATE_VERSION = 1

#: The loop's buffers: name in the state -> (attribute, dtype).
_BUFFERS = {"phi": ("_phi", np.float64), "measured_s": ("_y", np.float64), "weight": ("_w", np.float64),
            "recorded_step": ("_step", np.int64), "predicted_s": ("_pred", np.float64),
            "stage": ("_sid", np.int64)}
#: Settings that change what the buffers mean: a state is refused by a loop that differs in one.
_SETTINGS = ("per_stage", "stage_reduce")


def _floats(a) -> list:
    return np.asarray(a, np.float64).tolist()


def feedback_state_dict(loop) -> dict:
    """The refit state of ``loop`` (a `FeedbackLoop`) and of its cost model, JSON-able (see the module
    docstring)."""
    from dataclasses import asdict

    cost = loop.cost_model
    rows = cost.stage_time_coef
    return {
        "format": STATE_FORMAT, "version": STATE_VERSION,
        "settings": {k: getattr(loop, k) for k in _SETTINGS},
        "cost": {"time_coef": _floats(cost.time_coef), "stage_time_coef": None if rows is None else _floats(rows),
                 "version": int(cost.version), "table_dropped": bool(loop.history) and cost.table is None},
        "prior": None if loop.prior is None else _floats(loop.prior),
        "buffers": {name: np.asarray(getattr(loop, attr)).tolist() for name, (attr, _) in _BUFFERS.items()},
        "counters": {"steps_recorded": int(loop._steps_recorded), "since_refit": int(loop._since_refit),
                     "window_start": int(loop._window_start)},
        "history": [asdict(row) for row in loop.history],
    }


def load_feedback_state(loop, state: dict, row_type) -> None:
    """Restore ``loop`` (and its cost model, in place) from `feedback_state_dict`, its history as
    ``row_type`` (`FeedbackRow`) objects; ValueError naming what does not fit (another format, a loop
    with other stage settings, damaged buffers)."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ValueError(f"not a feedback state (its format is not {STATE_FORMAT!r})")
    if int(state.get("version", -1)) != STATE_VERSION:
        raise ValueError(f"feedback state version {state.get('version')!r}; this dynabatch reads {STATE_VERSION}")
    mine = {k: getattr(loop, k) for k in _SETTINGS}
    if state["settings"] != mine:
        raise ValueError(f"the feedback state was made by a FeedbackLoop with {state['settings']}, this one has {mine}: "
                         "its observations would be read as another stage's")
    buffers = {name: np.asarray(state["buffers"][name], dtype) for name, (_, dtype) in _BUFFERS.items()}
    n = len(buffers["measured_s"])
    if buffers["phi"].size == 0:
        buffers["phi"] = buffers["phi"].reshape(0, NUM_FEATURES)
    if buffers["phi"].shape != (n, NUM_FEATURES) or any(len(v) != n for v in buffers.values()):
        raise ValueError(f"the feedback state's buffers disagree in length (features {buffers['phi'].shape}, {n} "
                         "measured times): the state is damaged")
    c = state["cost"]
    cost = loop.cost_model
    if c["stage_time_coef"] is not None:
        cost.set_stage_time_coef(np.asarray(c["stage_time_coef"], np.float64))
    else:
        cost.time_coef = np.asarray(c["time_coef"], np.float64)
    if c["table_dropped"]:
        cost.table = None  # the first refit dropped it in the saved run too
    # the version as it was saved (the writes above counted one more); shared memory, when there, kept
    cost.coefficients.restore(np.asarray(c["time_coef"], np.float64), int(c["version"]),
                              None if c["stage_time_coef"] is None else np.asarray(c["stage_time_coef"], np.float64))
    loop.prior = None if state["prior"] is None else np.asarray(state["prior"], np.float64)
    for name, (attr, _) in _BUFFERS.items():
        setattr(loop, attr, buffers[name])
    k = state["counters"]
    loop._steps_recorded, loop._since_refit, loop._window_start = (int(k["steps_recorded"]), int(k["since_refit"]),
                                                                   int(k["window_start"]))
    loop.history = [row_type(**{f: (_tuples(v) if isinstance(v, list) else v) for f, v in row.items()})
                    for row in state["history"]]
    loop.step_errors = []
    loop.last = None


def _tuples(v):
    """Lists (JSON) back into the tuples `FeedbackRow` holds (nested for per-stage rows)."""
    return tuple(_tuples(x) if isinstance(x, list) else x for x in v)


__all__ = ["STATE_FORMAT", "STATE_VERSION", "feedback_state_dict", "load_feedback_state"]
