"""``dynabatch bench train --flush-free``: synchronous 1F1B against the flush-free stream (PipeOptim).

Four variants of ``dp`` train the same model from the same initialization on the same global
batches, interleaved as every ``bench train`` run (`FLUSH_VARIANTS`):

* ``dp/sync``: today's runner, a pipeline flush and one optimizer step per global batch;
* ``dp/stale``, ``dp/stash``, ``dp/predict``: `PipelineRunner.run_steps` with
  ``RunnerConfig(flush=False)``, windows of ``flush_window`` steps run as one asynchronous 1F1B
  stream (a flush only between windows), and the weight handling of
  `dynabatch.pipeline.runtime.weight_prediction.WeightPredictor`: plain stale weights, the forward's version
  stashed for the backward, or the weights predicted from AdamW's own rule.

No variant refits its cost model (every one plans with the same one). Reported: each variant's loss
at the end and averaged over the run (the convergence the weight handling costs), tokens/s from this
rank's measured step times (the stream: the time between a stage's updates), the loss gap to
``dp/sync`` and the most bytes the weight handling held. Tokens, seconds, bytes.
"""

from __future__ import annotations

import numpy as np

FLUSH_VARIANTS = ("dp/sync", "dp/stale", "dp/stash", "dp/predict")
#: variant -> `RunnerConfig.weight_prediction` of the stream (``sync`` runs flushed)
WEIGHTS = {"stale": None, "stash": "stash", "predict": "predict"}


def split_flush(method: str) -> tuple[str, str | None]:
    """``"dp/predict"`` -> ``("dp", "predict")``; a method without ``/`` -> ``(method, None)``."""
    base, _, kind = method.partition("/")
    if not kind:
        return method, None
    if kind != "sync" and kind not in WEIGHTS:
        raise ValueError(f"unknown method {method!r}: flush variants are dp/sync, dp/stale, dp/stash, dp/predict")
    return base, kind


def runner_options(kind: str | None) -> dict:
    """`RunnerConfig` fields of a variant."""
    if kind in (None, "sync"):
        return {}
    return {"flush": False, "weight_prediction": WEIGHTS[kind], "gather_timing": False}


def stream_step(run):
    """A flush-free variant's next step (``run``: its `dynabatch.bench.train.MethodRun`): a window of
    ``cfg.flush_window`` loader steps runs as one stream when none is pending. Returns (step, its
    StepResult, data seconds) or None at the end of the data."""
    from ..pipeline import batch_shapes

    if not run._window_left:
        window = []
        while len(window) < run.cfg.flush_window:
            mbs, t_data = run._next()
            if mbs is None:
                break
            window.append((mbs, t_data))
        if not window:
            return None
        res = run.runner.run_steps([(batch_shapes(m, run.loader.collation), m) for m, _ in window],
                                    optimizer=run.optimizer, num_tokens=[m.target_tokens for m, _ in window])
        run._window_left = [(m, r, t) for (m, t), r in zip(window, res)]
        run.weight_bytes = max(run.weight_bytes, *(r.weight_extra_bytes or 0.0 for r in res))
    return run._window_left.pop(0)


def summarize(methods: dict) -> dict:
    """Per variant: final loss (mean of the last 10% of steps), mean loss over the run, both relative to
    ``dp/sync``."""
    out = {}
    sync = methods.get("dp/sync")
    ref = None
    for name, m in methods.items():
        losses = np.array([r["loss"] for r in m["per_step"]])
        tail = max(1, len(losses) // 10)
        out[name] = {"final_loss": float(losses[-tail:].mean()), "mean_loss": float(losses.mean())}
        if name == "dp/sync":
            ref = out[name]
    if sync is not None and ref is not None:
        for v in out.values():
            v["final_vs_sync"] = v["final_loss"] / ref["final_loss"]
            v["mean_vs_sync"] = v["mean_loss"] / ref["mean_loss"]
    return out


def format_flush_table(result: dict) -> str:
    """The text table of a ``--flush-free`` run."""
    conv = summarize(result["methods"])
    head = (f"{'variant':<11} {'tokens/s':>9} {'final loss':>10} {'vs sync':>8} {'mean loss':>10} {'vs sync':>8} "
            f"{'weight bytes':>12}")
    lines = [head, "-" * len(head)]
    for name, m in result["methods"].items():
        c = conv[name]
        lines.append(f"{name:<11} {m['tokens_per_s']:9.0f} {c['final_loss']:10.4f} {c.get('final_vs_sync', 1.0):8.4f} "
                     f"{c['mean_loss']:10.4f} {c.get('mean_vs_sync', 1.0):8.4f} {m.get('weight_extra_bytes', 0):12.0f}")
    return "\n".join(lines)
