"""``dynabatch bench train``: the result document, its table, and how a run stops (the command:
`dynabatch.bench.train_command`).

Stopping: ``timeout_s`` (``--timeout``) is a liveness timeout, not a wall clock: the ranks are
killed only when none of them made progress (a step, a print) for that long
(`dynabatch.pipeline.launch_local`); ``max_wall_s`` (``--max-wall``) is an optional whole-run cap.
After a round of steps (at most once a second) rank 0 writes the result so far (``"partial": true,
"status": "running"``) to a JSON file (``--out``, else a temporary one); when the run is stopped
(SIGINT, SIGTERM, a timeout, a failed rank) the command prints and writes that partial result with
``"status": "stopped"`` and ``"stopped_by"``, and
`run_train_bench` raises `TrainBenchStopped` carrying it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal

import numpy as np



def timer_noise(phi: np.ndarray, y: np.ndarray) -> float:
    """Median relative deviation from the median among micro-batches of identical shape (>= 3 repeats)."""
    keys: dict = {}
    for row, v in zip(map(bytes, np.round(phi, 6).view(np.uint8).reshape(len(phi), -1)), y):
        keys.setdefault(row, []).append(v)
    devs = []
    for vals in keys.values():
        if len(vals) >= 3:
            m = float(np.median(vals))
            devs += [abs(v - m) / m for v in vals]
    return float(np.median(devs)) if devs else float("nan")


def _ratios(methods: dict) -> dict:
    """dp's tokens/s over every other method's (``dp_vs_<method>``) and over the best of them; with the
    spread of the paired per-step ratios (``paired``: the methods train the same global batches
    interleaved, so each timed step's time ratio is one paired sample of the timer and load noise)."""
    if "dp" not in methods:
        return {}
    dp = methods["dp"]
    others = {k: v for k, v in methods.items() if k != "dp"}
    ratios = {f"dp_vs_{k.replace('-', '_')}": dp["tokens_per_s"] / v["tokens_per_s"]
              for k, v in others.items() if v.get("tokens_per_s")}
    best_other = max((v["tokens_per_s"] for v in others.values()), default=None)
    if best_other:
        ratios["dp_vs_best_baseline"] = dp["tokens_per_s"] / best_other
    paired = {}
    for k, v in others.items():
        a, b = dp.get("per_step", []), v.get("per_step", [])
        n, w = min(len(a), len(b)), dp.get("warmup_steps", 0)
        r = [b[i]["step_s"] / a[i]["step_s"] for i in range(w, n) if a[i]["step_s"] > 0]
        if r:
            q = [float(x) for x in np.quantile(r, [0.25, 0.5, 0.75])]
            paired[k] = {"p25": q[0], "median": q[1], "p75": q[2], "steps": len(r)}
    if paired:
        ratios["paired"] = paired
    return ratios


def assemble_result(config: dict, methods: dict, *, status: str = "complete", stopped_by: str | None = None) -> dict:
    """The JSON document of a run: ``status`` is ``complete``, ``running`` (written mid-run) or
    ``stopped``; anything but complete has ``"partial": true`` and per-method results of the steps
    done so far (``steps_done``; a method with no finished step is left out of ``methods``)."""
    done = {m: 0 for m in config.get("methods", ())}
    done.update({m: int(v["steps"]) for m, v in methods.items()})
    return {"config": config, "methods": methods, "ratios": _ratios(methods), "partial": status != "complete",
            "status": status, "stopped_by": stopped_by, "steps_done": done}


def write_json(path: str, doc: dict) -> None:
    """Write ``doc`` atomically (a reader, or a kill mid-write, never sees half a file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, default=float)
    os.replace(tmp, path)


def read_json(path: str | None) -> dict | None:
    """The JSON document at ``path``; None when there is no path, no file, or not (yet) a whole JSON file."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError, TypeError):
        return None


class TrainBenchStopped(RuntimeError):
    """``bench train`` ended before its last step: a signal (SIGINT, SIGTERM), its liveness timeout
    (no rank made progress for ``timeout_s``), ``max_wall_s``, or a failed rank. ``result`` is the
    partial result (``"partial": true``, per-method results of the steps done; None when the data
    was not even prepared) and ``exit_code`` the exit status the command returns (128 + signal
    number for a signal, else 1)."""

    def __init__(self, message: str, result: dict | None = None, exit_code: int = 1):
        super().__init__(message)
        self.result, self.exit_code = result, exit_code


class StopSignal(BaseException):
    """SIGINT or SIGTERM arrived (`stop_on_signals`); ``signum`` is the signal's number. A BaseException, so
    that no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals():
    """SIGINT/SIGTERM raise `StopSignal` (once; a second signal while stopping is ignored). Only in the
    main thread, and not for a signal this process ignores (a background job's SIGINT)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = []

    def handler(signum, frame):
        if not fired:
            fired.append(signum)
            raise StopSignal(signum)

    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            old[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def result_config(cfg: TrainBenchConfig, index_s: float, parameters: int) -> dict:
    """The result's ``config`` section: the run's settings, the model's ``parameters`` (a count), the index
    build seconds ``index_s`` and how each reported figure is measured."""
    config = {k: v for k, v in cfg.to_payload().items() if k not in ("index", "model_sizes", "timeout_s", "max_wall_s")}
    config.update(data=list(cfg.data), methods=list(cfg.methods), model_sizes=cfg.resolved_sizes(),
                  parameters=parameters,
                  backend=cfg.backend or "auto (gloo on CPU, nccl on GPU)", index_build_s=index_s,
                  timing="tokens_per_s = real tokens of the timed steps / sum over those steps of the slowest "
                         "rank's PipelineRunner.step wall time (warm-up steps excluded); tokens_per_s_e2e adds "
                         "the time waiting for the DataLoader",
                  mape_basis="per micro-batch: planned forward+backward seconds on one stage vs measured on the "
                             "slowest stage; mape_start = steps before the first refit, mape_end = last "
                             "max(3, steps//4) steps, predictions made before the step ran")
    if cfg.model == "vlm-tiny":
        from .train_vlm import data_description

        config.update(records=data_description(cfg.data),
                      stage_mape_basis="per micro-batch and stage: cost.stage_times (planned before the step's refit) "
                                       "vs that stage's measured forward+backward seconds; start/end windows as MAPE; "
                                       "stage_mape_* pools every micro-batch, stage_compute_mape_* the micro-batches "
                                       "the stage runs layers on, stage_passthrough_mape_* those it passes through "
                                       "(the vision stage on text-only micro-batches: sub-millisecond dispatch of "
                                       "skipped layers and index bookkeeping, slower after a vision micro-batch left "
                                       "the CPU caches cold; their shares of the stage's micro-batches and seconds in "
                                       "stage_passthrough_share/_time_share); *_floor: MAPE of predicting each "
                                       "repeated identical micro-batch by its median measured time (timing noise); "
                                       "stage_step_mape_*: each step's planned vs measured sum over its micro-batches "
                                       "per stage (the stage's busy seconds the pipeline simulation adds up); a "
                                       "stage's measured 0 s is a micro-batch it bypassed (--bypass-idle-stages: "
                                       "no op there), left out of every figure and counted in stage_bypassed_share")
    return config


def _pct(x: float) -> str:
    """``x`` as a percentage, ``-`` when undefined (no shape repeated often enough to measure noise)."""
    return "-" if x != x else f"{x:.1%}"


def _stages(v) -> str:
    return "/".join(_pct(x) for x in v) if v else "-"


def _stage_lines(name: str, m: dict) -> list[str]:
    """The per-stage MAPE of one vlm method, split: the micro-batches each stage computes on and
    those it passes through (with their shares of the stage's micro-batches and seconds), start ->
    end and the noise floor of each."""
    if "stage_compute_mape_end" not in m:
        return []
    parts = []
    for s in range(len(m["stage_compute_mape_end"])):
        text = (f"s{s} computing {_pct(m['stage_compute_mape_start'][s])} -> {_pct(m['stage_compute_mape_end'][s])}"
                f" (floor {_pct(m['stage_compute_mape_floor'][s])})")
        skipped = (m.get("stage_bypassed_share") or [0.0] * (s + 1))[s]
        if skipped > 0:
            text += f", bypassed ({skipped:.0%} of its micro-batches: no op)"
        share = m["stage_passthrough_share"][s]
        if share > 0:
            text += (f", pass-through ({share:.0%} of its micro-batches, {_pct(m['stage_passthrough_time_share'][s])}"
                     f" of its seconds) {_pct(m['stage_passthrough_mape_start'][s])} -> "
                     f"{_pct(m['stage_passthrough_mape_end'][s])} (floor {_pct(m['stage_passthrough_mape_floor'][s])})")
        parts.append(text)
    if m.get("stage_step_mape_end"):
        parts.append(f"per-step sums {_stages(m['stage_step_mape_start'])} -> {_stages(m['stage_step_mape_end'])}")
    return [f"  {name:<13}" + "; ".join(parts)]


def format_table(result: dict) -> str:
    """The human-readable table of a `run_train_bench` result."""
    cfg = result["config"]
    o = cfg["options"]
    staged = any("stage_mape_start" in m for m in result["methods"].values())
    lines = [] if not result.get("partial") else [
        f"PARTIAL RESULT ({result.get('stopped_by') or result.get('status')}): steps done "
        + ", ".join(f"{m} {n}" for m, n in result.get("steps_done", {}).items()) + f" of {cfg['steps']}", ""]
    lines += [f"bench train: {cfg['model']} ({cfg['parameters'] / 1e6:.2f}M parameters), {o['num_stages']} stages "
             f"({cfg['partition']} split), {cfg['steps']} steps ({cfg['warmup']} warm-up excluded), global batch "
             f"{o['global_batch_tokens']} tokens, max_len {o['max_len']}"
             + (f"/{o['max_target_len']}" if cfg["model"] == "t5-tiny" else "") + f", {o['schedule']}",
             f"data: {' '.join(os.path.basename(d) for d in cfg['data'])}",
             "",
             f"{'method':<13}{'tok/s':>9}{'e2e tok/s':>11}{'vs pack':>9}{'mbs/step':>10}{'loss start->end':>18}"
             f"{'MAPE start':>12}{'MAPE end':>10}{'noise':>8}{'step MAPE':>17}  stage bounds"
             + ("  per-stage MAPE start -> end  refit" if staged else "")]
    pack = result["methods"].get("pack", {}).get("tokens_per_s")
    for name, m in result["methods"].items():
        vs = f"{m['tokens_per_s'] / pack:.2f}x" if pack else "-"
        lines.append(f"{name:<13}{m['tokens_per_s']:>9.0f}{m['tokens_per_s_e2e']:>11.0f}{vs:>9}"
                     f"{m['microbatches_per_step']:>10.1f}{m['loss_start']:>9.3f}->{m['loss_end']:<7.3f}"
                     f"{m['mape_start']:>12.1%}{m['mape_end']:>10.1%}{_pct(m['mape_noise']):>8}"
                     f"{m.get('mape_start_step', float('nan')):>9.1%}->{m.get('mape_end_step', float('nan')):<6.1%}"
                     f"  {m.get('bounds', '-')}"
                     + (f"  {_stages(m.get('stage_mape_start'))} -> {_stages(m.get('stage_mape_end'))}"
                        f"  {m.get('feedback_mode') or '-'}" if staged else ""))
    split = [x for name, m in result["methods"].items() for x in _stage_lines(name, m)]
    if split:
        lines += ["", "per-stage MAPE start -> end, split: micro-batches the stage runs layers on | those it passes "
                      "through (vision stage, text-only micro-batch); floor = timing noise of identical micro-batches; "
                      "per-step sums = each stage's busy seconds per step"]
        lines += split
    r = result.get("ratios", {})
    if r:
        lines.append("")
        lines.append("dp vs " + "; ".join(f"{m}: {r['dp_vs_' + m.replace('-', '_')]:.2f}x"
                                          + (f" (per-step {p['median']:.2f}x, IQR {p['p25']:.2f}-{p['p75']:.2f})"
                                             if (p := r.get("paired", {}).get(m)) else "")
                                          for m in result["methods"] if m != "dp" and f"dp_vs_{m.replace('-', '_')}" in r)
                     + "; best other: " + (f"{r['dp_vs_best_baseline']:.2f}x" if "dp_vs_best_baseline" in r else "-"))
    if any(m in ("dp", "dp-blind") for m in result["methods"]):
        lines.append("dp: feedback refits its cost model every %d steps; baselines: planner default knobs, no refit "
                     "(their MAPE is the analytic prior's)" % cfg["refit_every"])
    else:  # recompute / flush-free variants of dp all plan with the same cost model
        lines.append("no method refits its cost model (their MAPE is the analytic prior's)")
    return "\n".join(lines)
