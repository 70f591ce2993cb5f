"""``dynabatch bench train``: the result document, its table, and how a run stops.

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


def _ratios(methods: dict) -> dict:
    ref = methods.get("pack", {}).get("tokens_per_s")
    best_other = max((v["tokens_per_s"] for k, v in methods.items() if k != "dp"), default=None)
    ratios = {}
    if "dp" in methods and ref:
        ratios["dp_vs_pack"] = methods["dp"]["tokens_per_s"] / ref
    if "dp" in methods and best_other:
        ratios["dp_vs_best_baseline"] = methods["dp"]["tokens_per_s"] / best_other
    return ratios


def assemble_result(config: dict, methods: dict, *, status: str = "complete", stopped_by: str | None = None) -> dict:
    """The JSON document of a run: ``status`` is ``complete``, ``running`` (written mid-run) or
    ``stopped``; anything but complete has ``"partial": true`` and per-method results of the steps
    done so far (``steps_done``; a method with no finished step is left out of ``methods``)."""
    done = {m: 0 for m in config.get("methods", ())}
    done.update({m: int(v["steps"]) for m, v in methods.items()})
    return {"config": config, "methods": methods, "ratios": _ratios(methods), "partial": status != "complete",
            "status": status, "stopped_by": stopped_by, "steps_done": done}


def _write_json(path: str, doc: dict) -> None:
    """Write ``doc`` atomically (a reader, or a kill mid-write, never sees half a file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, default=float)
    os.replace(tmp, path)


def _read_json(path: str | None) -> dict | None:
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


class _Stop(BaseException):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals():
    """SIGINT/SIGTERM raise `_Stop` (once; a second signal while stopping is ignored). Only in the
    main thread, and not for a signal this process ignores (a background job's SIGINT)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = []

    def handler(signum, frame):
        if not fired:
            fired.append(signum)
            raise _Stop(signum)

    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            old[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _result_config(cfg: TrainBenchConfig, index_s: float, parameters: int) -> dict:
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
    return config


def _pct(x: float) -> str:
    """``x`` as a percentage, ``-`` when undefined (no shape repeated often enough to measure noise)."""
    return "-" if x != x else f"{x:.1%}"


def format_table(result: dict) -> str:
    """The human-readable table of a `run_train_bench` result."""
    cfg = result["config"]
    o = cfg["options"]
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
             f"{'MAPE start':>12}{'MAPE end':>10}{'noise':>8}{'step MAPE':>17}  stage bounds"]
    pack = result["methods"].get("pack", {}).get("tokens_per_s")
    for name, m in result["methods"].items():
        vs = f"{m['tokens_per_s'] / pack:.2f}x" if pack else "-"
        lines.append(f"{name:<13}{m['tokens_per_s']:>9.0f}{m['tokens_per_s_e2e']:>11.0f}{vs:>9}"
                     f"{m['microbatches_per_step']:>10.1f}{m['loss_start']:>9.3f}->{m['loss_end']:<7.3f}"
                     f"{m['mape_start']:>12.1%}{m['mape_end']:>10.1%}{_pct(m['mape_noise']):>8}"
                     f"{m.get('mape_start_step', float('nan')):>9.1%}->{m.get('mape_end_step', float('nan')):<6.1%}"
                     f"  {m.get('bounds', '-')}")
    r = result.get("ratios", {})
    if r:
        lines.append("")
        lines.append("dp vs pack: " + (f"{r['dp_vs_pack']:.2f}x" if "dp_vs_pack" in r else "-")
                     + "; dp vs best other baseline: "
                     + (f"{r['dp_vs_best_baseline']:.2f}x" if "dp_vs_best_baseline" in r else "-"))
    lines.append("dp: feedback refits its cost model every %d steps; baselines: planner default knobs, no refit "
                 "(their MAPE is the analytic prior's)" % cfg["refit_every"])
    return "\n".join(lines)


BENCH_TRAIN_EPILOG = """\
columns:
  tok/s        real (unpadded) tokens / wall seconds of the pipelined training steps (slowest rank),
               warm-up steps excluded
  e2e tok/s    the same, counting the time the loop waited for the DataLoader
  vs pack      tok/s over pack's
  MAPE         per micro-batch: planned vs measured forward+backward seconds on the slowest stage;
               start = before the first refit, end = the last max(3, steps/4) steps (predictions made
               before each step ran: out of sample); noise = median relative spread of identical
               shapes in the run (about the floor a per-micro-batch MAPE can reach on this machine)
  step MAPE    the same on each step's sum over its micro-batches (start -> end): what the step
               time the planner balances sees, with the per-micro-batch timer noise averaged out

examples:
  dynabatch bench train --model t5-tiny --stages 2 --steps 20
  dynabatch bench train --model gpt-tiny --steps 20 --data ../shared/data/text/niv2_sample.jsonl.gz --json
"""
