"""``dynabatch bench schedules --measure``: the simulator's op seconds against the ones 2 gloo stages execute.

gpt-tiny runs on 2 local processes (gloo, CPU, one thread each). Each *round* draws a fresh set of
variable-shape padded micro-batches and runs one step of it under every schedule of ``schedules``
(``1f1b`` and ``zb-h1`` by default; interleaved, one after the other in the same round, so background load
hits them alike), keeping every op each rank executed and its seconds (`PipelineRunner.last_run`). The
first ``warmup`` rounds are dropped; the rest are split in two, and nothing of the second half is seen
before it is predicted:

* *calibration* rounds fit, per stage, the forward and the whole backward seconds of a micro-batch on
  ``[1, tokens, rows x len^2]`` (least squares on 1F1B's ops; the cost model's job, done here so the
  check does not depend on a preset) and the `dynabatch.core.cost.backward_split.BackwardSplit` of the
  split backwards (the measured share of the weight part, per stage and pooled, and the split's seconds over
  the same micro-batches' whole backward under 1F1B, ``split_factor``);
* *evaluation* rounds: each executed op's predicted seconds are the simulator's (`op_ready`'s rule):
  ``F`` the fitted forward, ``B`` the fitted backward, ``Bi`` / ``W`` its input / weight share, with the
  pooled share the simulator prices (``fitted``) and with halves (``halves``, `WEIGHT_SHARE`).

Per op kind: the median and 10th-90th percentile of predicted / executed seconds, the share of ops within
10% and the ratio of the sums; per schedule the simulated makespan (`simulate_table_kernel` of the predicted
op seconds, no transfer time) over the executed step (the slower rank's program, transfers included).
Seconds throughout; the machine's load is printed with the table (`os.getloadavg`).
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from ..core.cost.backward_split import BackwardSplit
from ..core.kernels import op_codes as oc

#: The op kinds the report scores, by name (`Op.name` prefix).
KINDS = ("F", "B", "Bi", "W")


@dataclasses.dataclass(frozen=True)
class MeasureConfig:
    """What ``--measure`` runs: gpt-tiny of ``hidden``/``layers``, ``microbatches`` padded micro-batches per
    step of ``rows`` x ``lens`` (inclusive ranges) per round, ``rounds`` rounds after ``warmup``. ``clock``:
    ``"thread"`` times each op in CPU seconds of the rank's thread (``time.thread_time``; one torch thread, so
    the op's own work, without the preemption other processes on a shared machine add), ``"wall"`` in
    ``perf_counter`` seconds (the runner's clock)."""

    schedules: tuple[str, ...] = ("1f1b", "zb-h1")
    hidden: int = 128
    layers: int = 4
    microbatches: int = 8
    rows: tuple[int, int] = (2, 6)
    lens: tuple[int, int] = (48, 160)
    rounds: int = 12
    warmup: int = 2
    seed: int = 0
    clock: str = "thread"


def measure_rank(rank: int, world: int, port: int, payload: dict) -> dict:
    """One stage process: every round's steps; per round and schedule, the ops this rank ran and their seconds."""
    import torch

    from ..pipeline.models.spec import MicroBatchShape
    from ..pipeline.models.zoo import make_model
    from ..pipeline.runtime.comm import init_pipeline
    from ..pipeline.runtime.config import RunnerConfig
    from ..pipeline.runtime.launch import heartbeat
    from ..pipeline.runtime.runner import PipelineRunner

    from ..pipeline.measure.timing import Clock

    cfg = MeasureConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in payload.items()})
    torch.set_num_threads(1)

    class ThreadClock(Clock):
        """CPU seconds of the calling thread (the rank's ops run on it)."""

        def start(self):
            return time.thread_time()

        def stop(self, t0, out, j):
            out[j] = time.thread_time() - t0

    class Runner(PipelineRunner):
        def start_program(self, program, hooks, recompute):
            clock = super().start_program(program, hooks, recompute)
            return ThreadClock(self.ctx.device) if cfg.clock == "thread" else clock
    rounds = []
    with init_pipeline(world, rank=rank, world_size=world, master_port=port, timeout_s=300) as ctx:
        model = make_model("gpt-tiny", hidden=cfg.hidden, layers=cfg.layers, seed=cfg.seed)
        n = len(model.layers)
        runner = Runner.from_model(model, ctx, [0, n // 2, n], RunnerConfig(schedule=cfg.schedules[0],
                                                                                      measure_memory=False))
        rng = np.random.default_rng(cfg.seed)
        for k in range(cfg.warmup + cfg.rounds):
            dims = [(int(rng.integers(cfg.rows[0], cfg.rows[1] + 1)), int(rng.integers(cfg.lens[0], cfg.lens[1] + 1)))
                    for _ in range(cfg.microbatches)]
            shapes = [MicroBatchShape("padded", r, L, time_s=1e-6 * r * L, memory_bytes=float(r * L)) for r, L in dims]
            gen = torch.Generator().manual_seed(cfg.seed + k)
            batches = [model.random_batch(sh, gen) for sh in shapes]
            per = {}
            for name in cfg.schedules:
                runner.config = dataclasses.replace(runner.config, schedule=name)
                res = runner.step(shapes, batches if ctx.stage in (0, world - 1) else None)
                run = runner.last_run
                per[name] = {"ops": [[int(op.kind), int(op.microbatch), float(t)] for op, t in run.op_times()],
                             "step_s": float(res.timing.step_s)}
                heartbeat()
            rounds.append({"dims": dims, "runs": per})
    return {"rank": rank, "rounds": rounds[cfg.warmup:]}


def _features(dims) -> np.ndarray:
    d = np.asarray(dims, np.float64)
    return np.stack([np.ones(len(d)), d[:, 0] * d[:, 1], d[:, 0] * d[:, 1] ** 2], axis=1)


def _op_seconds(ops, kind: int, M: int) -> np.ndarray:
    out = np.full(M, np.nan)
    for k, j, t in ops:
        if k == kind:
            out[j] = t
    return out


def analyse(results: list[dict], cfg: MeasureConfig) -> dict:
    """The report (module doc) of every rank's ``measure_rank`` results."""
    from ..core.kernels.simulate import simulate_table_kernel
    from ..core.schedule.build import step_ops

    S = len(results)
    rounds = len(results[0]["rounds"])
    half = max(1, rounds // 2)
    M = cfg.microbatches
    # calibration: per stage, forward and whole-backward seconds on the features (1F1B's ops), and the split
    coef = {}
    split = BackwardSplit.unmeasured(S)
    for s, res in enumerate(results):
        X = np.concatenate([_features(r["dims"]) for r in res["rounds"][:half]])
        for kind in (oc.FORWARD, oc.BACKWARD):
            y = np.concatenate([_op_seconds(r["runs"]["1f1b"]["ops"], kind, M) for r in res["rounds"][:half]])
            coef[(s, kind)] = np.linalg.lstsq(X, y, rcond=None)[0]
    if "zb-h1" in cfg.schedules:
        bi = np.array([np.concatenate([_op_seconds(r["runs"]["zb-h1"]["ops"], oc.BACKWARD_INPUT, M)
                                       for r in res["rounds"][:half]]) for res in results])
        w = np.array([np.concatenate([_op_seconds(r["runs"]["zb-h1"]["ops"], oc.BACKWARD_WEIGHT, M)
                                      for r in res["rounds"][:half]]) for res in results])
        whole = np.array([np.concatenate([_op_seconds(r["runs"]["1f1b"]["ops"], oc.BACKWARD, M)
                                          for r in res["rounds"][:half]]) for res in results])
        split = split.observe(bi, w, decay=0.0, whole_s=whole)
    noise = []  # the timer's floor: one micro-batch's forward under two schedules of the same round
    for res in results:
        for r in res["rounds"][half:]:
            runs = [_op_seconds(r["runs"][n]["ops"], oc.FORWARD, M) for n in cfg.schedules]
            noise += [abs(b / a - 1) for a, b in zip(runs[0], runs[-1]) if a > 0] if len(runs) > 1 else []
    out = {"noise": float(np.median(noise)) if noise else float("nan"), "config": dataclasses.asdict(cfg), "load": list(os.getloadavg()), "stage_weight_shares":
           split.weight_shares.tolist(), "weight_share": split.weight_share, "split_factor": split.split_factor,
           "schedules": {}}
    for name in cfg.schedules:
        labels = [("fitted", split.weight_share, split.split_factor), ("halves", oc.WEIGHT_SHARE, 1.0)]
        if name != "1f1b" and "1f1b" in cfg.schedules:
            labels.append(("same_round", split.weight_share, split.split_factor))
        for label, share, factor in labels:
            ratios = {k: [] for k in KINDS}
            sums = {k: [0.0, 0.0] for k in KINDS}
            spans = []
            for i in range(half, rounds):
                dims = results[0]["rounds"][i]["dims"]
                X = _features(dims)
                fwd = np.array([X @ coef[(s, oc.FORWARD)] for s in range(S)])
                bwd = np.array([X @ coef[(s, oc.BACKWARD)] for s in range(S)])
                if label == "same_round":  # this round's 1F1B ops of the same micro-batches, run just before
                    fwd = np.array([_op_seconds(res["rounds"][i]["runs"]["1f1b"]["ops"], oc.FORWARD, M)
                                    for res in results])
                    bwd = np.array([_op_seconds(res["rounds"][i]["runs"]["1f1b"]["ops"], oc.BACKWARD, M)
                                    for res in results])
                fwd, bwd = np.maximum(fwd, 1e-7), np.maximum(bwd, 1e-7)
                split_bwd = bwd * factor  # what a split backward costs in all
                pred = {oc.FORWARD: fwd, oc.BACKWARD: bwd, oc.BACKWARD_INPUT: split_bwd * (1 - share),
                        oc.BACKWARD_WEIGHT: split_bwd * share}
                for s, res in enumerate(results):
                    for kind, j, t in res["rounds"][i]["runs"][name]["ops"]:
                        key = oc.KIND_NAMES[kind]
                        if key in ratios and t > 0:
                            ratios[key].append(pred[kind][s, j] / t)
                            sums[key][0] += pred[kind][s, j]
                            sums[key][1] += t
                ops = step_ops(name, S, M)
                start, end = np.empty((S, M, 2)), np.empty((S, M, 2))
                ws, we = np.empty((S, M)), np.empty((S, M))
                simulate_table_kernel(fwd, split_bwd if ops.split else bwd, share, np.zeros(M), ops.kernel_table, start, end,
                                      ws, we)
                span = max(float(end.max()), float(we.max()) if ops.split else 0.0)
                spans.append(span / max(res["rounds"][i]["runs"][name]["step_s"] for res in results))
            rows = {}
            for k in KINDS:
                r = np.array(ratios[k])
                if len(r):
                    rows[k] = {"n": int(len(r)), "median": float(np.median(r)), "p10": float(np.quantile(r, 0.1)),
                               "p90": float(np.quantile(r, 0.9)), "within_10pct": float(np.mean(np.abs(r - 1) <= 0.1)),
                               "sum_ratio": sums[k][0] / sums[k][1]}
            out["schedules"].setdefault(name, {})[label] = {"ops": rows, "makespan_ratio": float(np.median(spans))}
    return out


def run_measure(cfg: MeasureConfig = MeasureConfig(), *, idle_timeout_s: float = 300) -> dict:
    """Launch the 2 stage processes and analyse their rounds (module doc)."""
    from ..pipeline.runtime.launch import launch_local

    res = launch_local(f"{__name__}:measure_rank", 2, args=(dataclasses.asdict(cfg),), idle_timeout_s=idle_timeout_s)
    for r in res:
        if r.returncode != 0 or r.timed_out:
            raise RuntimeError(f"bench schedules --measure: rank {r.rank} failed:\n{r.stderr[-3000:]}")
    return analyse(sorted((r.result for r in res), key=lambda d: d["rank"]), cfg)


def format_measure(rep: dict) -> str:
    """The report as a table: per schedule and share, per op kind the predicted / executed seconds."""
    c = rep["config"]
    lines = [f"gpt-tiny hidden {c['hidden']}, {c['layers']} blocks on 2 gloo stages, {c['microbatches']} padded "
             f"micro-batches of {c['rows'][0]}-{c['rows'][1]} rows x {c['lens'][0]}-{c['lens'][1]} tokens per step, "
             f"{c['rounds']} rounds (first half calibrates, second half scored); {c.get('clock', 'wall')} clock; load "
             f"{rep['load'][0]:.2f}",
             "measured weight share of a split backward: per stage "
             + ", ".join(f"{x:.3f}" for x in rep["stage_weight_shares"]) + f"; pooled {rep['weight_share']:.3f}; "
             f"input + weight part over a whole backward {rep['split_factor']:.3f}",
             f"timer noise: one micro-batch's forward under two schedules of one round differs by {100 * rep['noise']:.0f}% "
             "(median)",
             "", "schedule  share       op    n  pred/exec median  p10-p90      within 10%  sum ratio  makespan ratio"]
    for name, by in rep["schedules"].items():
        for label, r in by.items():
            first = True
            for k, row in r["ops"].items():
                lines.append(f"{name if first else '':<8}  {label if first else '':<10}  {k:<3} {row['n']:>4}  "
                             f"{row['median']:>16.3f}  {row['p10']:.3f}-{row['p90']:.3f}  {100 * row['within_10pct']:>9.0f}%"
                             f"  {row['sum_ratio']:>9.3f}  " + (f"{r['makespan_ratio']:>14.3f}" if first else ""))
                first = False
    return "\n".join(lines)
