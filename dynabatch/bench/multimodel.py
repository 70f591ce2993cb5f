"""``dynabatch bench multimodel``: K models trained together on one data pass vs K single-model runs.

Hydra's claim, measured on the project's own pipeline: training K configurations of a model at once
(`dynabatch.pipeline.MultiModelRunner`) beats training them one after another on the same stages,
because the pipeline fills and drains once per step instead of once per model, and because the
data are scanned, tokenized, collated and planned once instead of K times.

One run, on ``num_stages`` local processes (gloo on CPU):

* **The data pass** (timed once, reported apart): the length index is built once (``scan_s``, in
  the launching process) and the `dynabatch.DataLoader` (indexed mode, ``dp`` plans, one pipeline
  replica) yields the run's ``steps`` global batches (``loader_s``: planning, tokenization,
  collation; rank 0's clock). K separate runs would do both K times: ``data_saved_s = (K - 1) x
  (scan_s + loader_s)``.
* **Training** (per K of ``ks``): K models of the same architecture and initialization with
  learning rates ``lr x LR_FACTORS[k]`` (a learning-rate sweep). The *together* arm is a
  `MultiModelRunner` (LRTF order, interleaved 1F1B, optional spilling budget); the *sequential*
  arm is K `PipelineRunner` (1F1B) runs, the same models and optimizers. Both train on the same
  materialized loader steps, one step of each arm after the other (together, then model 0 .. K-1
  alone), so any background load hits both alike; what K sequential runs take is the sum of the
  single-model steps. Times are rank 0's wall seconds of each ``step`` call (every step ends with
  an all-reduce over the ranks); the first ``warmup`` steps are excluded. At the end the together
  arm's parameters are compared with the sequential arm's (``identical``: bit for bit).
* **Simulated** beside the measurement, `dynabatch.core.simulate.multimodel.simulate_multimodel` of each
  timed step: ``sim_plan`` from the plan's per-micro-batch seconds (forward share from the cost
  model) x each model's ``time_scale``; ``sim_measured`` from the forward and backward seconds the
  sequential arm measured on every stage (the schedule's own prediction, without the cost model's
  error). Both are together/sequential makespan ratios. With a budget both include the shard
  copies: every stage's shard bytes and budget, and the copy bandwidth the run measured (bytes
  the spills and loads moved / seconds spent in them, `MultiStepResult.moved_bytes`/``copy_s``).
* **Timer noise**: the K sequential models run identical shapes (only the learning rate differs),
  so the median relative spread of their step times is the run's timing noise.

Seconds, tokens and bytes throughout.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

import numpy as np

from ..core.options import PlanOptions
from .payload import config_from_payload, config_payload
from ..progress import show_progress
from .progress import rank_tick, watch_ticks

#: learning-rate multipliers of the K models (a sweep around ``lr``); K <= len(LR_FACTORS)
LR_FACTORS = (1.0, 0.3, 3.0, 0.1, 0.5, 2.0, 0.2, 5.0)


def default_multimodel_options() -> PlanOptions:
    """The planning options ``bench multimodel`` runs with unless told otherwise: 8192-token global
    batches of inputs up to 512 tokens (targets 128), 2 stages, dp plans, full steps only."""
    return PlanOptions(global_batch_tokens=8192, max_len=512, max_target_len=128, num_stages=2, drop_last=True,
                       method="dp")


@dataclass
class MultiBenchConfig:
    """Settings of one ``bench multimodel`` run (tokens, seconds, bytes)."""

    model: str = "gpt-tiny"
    ks: tuple = (2, 4)
    data: tuple = ()
    options: PlanOptions = field(default_factory=default_multimodel_options)
    steps: int = 12
    warmup: int = 2
    lr: float = 1e-3
    budget_shards: float | None = None  # per-device shard budget, in units of the stage's largest shard
    interleave: bool = True
    device_preset: str = "cpu"
    threads_per_proc: int = 1
    timeout_s: float = 600.0  # liveness: no rank made progress for this long
    model_sizes: dict = field(default_factory=dict)
    index: str | None = None
    scan_s: float = 0.0

    def to_payload(self) -> dict:
        """A JSON-able dict for the worker processes (`from_payload` reads it back)."""
        return config_payload(self)

    @classmethod
    def from_payload(cls, d: dict) -> "MultiBenchConfig":
        return config_from_payload(cls, d)


def _sizes(cfg: MultiBenchConfig) -> dict:
    from .train import MODEL_SIZES

    return {**MODEL_SIZES[cfg.model], **cfg.model_sizes}


def _stage_times(step, cost):
    """``(fwd, bwd)`` [S, M] seconds the plan predicts for this replica's micro-batches of ``step``."""
    from ..core.schedule.orders import plan_stage_times, split_times

    return split_times(plan_stage_times(step.plan)[:, step.plan.rank_indices(0)], cost.forward_fraction)


def _arm_models(cfg: MultiBenchConfig, ctx, K: int, bounds):
    """K fresh models (one seed) and their runners and AdamW optimizers (lr sweep)."""
    import torch

    from ..pipeline import PipelineRunner, RunnerConfig, make_model

    runners = [PipelineRunner.from_model(make_model(cfg.model, **_sizes(cfg), seed=cfg.options.seed), ctx, bounds,
                                         RunnerConfig(schedule="1f1b", gather_timing=True)) for _ in range(K)]
    opts = [torch.optim.AdamW(r.parameters(), lr=cfg.lr * LR_FACTORS[k]) for k, r in enumerate(runners)]
    return runners, opts


def run_k(ctx, cfg: MultiBenchConfig, K: int, steps, collation: str, cost, bounds) -> dict:
    """Train K models together and alone on ``steps`` (the materialized loader steps), one step of
    each arm after the other; rank 0's figures (see the module doc)."""
    import torch

    from ..core.simulate.multimodel import simulate_multimodel
    from ..pipeline import MultiModelRunner, batch_shapes
    from ..pipeline.runtime.launch import heartbeat
    from ..pipeline.runtime.shards import shard_bytes

    S = ctx.num_stages
    alone, alone_opt = _arm_models(cfg, ctx, K, bounds)
    together, together_opt = _arm_models(cfg, ctx, K, bounds)
    budget = None
    if cfg.budget_shards is not None:
        budget = float(cfg.budget_shards) * max(sum(shard_bytes(r.stage, o, ctx.device))
                                                 for r, o in zip(together, together_opt))
    multi = MultiModelRunner(together, together_opt, memory_budget_bytes=budget, interleave=cfg.interleave,
                             names=[f"lr x{LR_FACTORS[k]:g}" for k in range(K)])
    rows, times = [], []
    for i, step in enumerate(steps):
        shapes = batch_shapes(step, collation)
        t0 = time.perf_counter()
        res = multi.step(shapes, step, num_tokens=step.target_tokens)
        t_together = time.perf_counter() - t0
        singles, meas_f, meas_b = [], np.zeros((K, S, len(shapes))), np.zeros((K, S, len(shapes)))
        for k in range(K):
            t0 = time.perf_counter()
            r = alone[k].step(shapes, step, optimizer=alone_opt[k])
            singles.append(time.perf_counter() - t0)
            for t in r.all_timings:
                meas_f[k, t.stage], meas_b[k, t.stage] = t.forward_s, t.backward_s
        times.append((*_stage_times(step, cost), meas_f, meas_b, np.asarray(res.time_scale, np.float64)))
        rows.append({"step": i, "together_s": t_together, "single_s": singles, "microbatches": len(shapes),
                     "tokens": int(np.sum(step.plan.mb_real_tokens)),
                     "peak_resident_bytes": res.peak_resident_bytes, "spills": res.spills, "loads": res.loads,
                     "prefetches": res.prefetches, "moved_bytes": res.moved_bytes, "copy_s": res.copy_s})
        heartbeat()  # a step is progress for the launcher (each rank: the others may wait on it)
        if ctx.rank == 0:
            rank_tick()
    identical = True
    for k in range(K):  # each shard back on the device (spilling the others), compared with the model alone
        multi.store.make_room(multi.store.full_bytes(k), {k}, {})
        multi.store.load(k)
        identical &= all(torch.equal(a, b) for a, b in zip(together[k].stage.parameters(), alone[k].stage.parameters()))
    # every stage's figures: [identical, its K shard sizes, bytes moved, copy seconds, budget] (one all-gather)
    mine = torch.tensor([float(identical), *(float(multi.store.full_bytes(k)) for k in range(K)),
                         float(sum(r["moved_bytes"] for r in rows)), float(sum(r["copy_s"] for r in rows)),
                         float(budget or 0.0)], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    torch.distributed.all_gather(every, mine)
    every = torch.stack(every).numpy()  # [S, K + 3]
    spill = {}
    if budget is not None:
        moved, copy_s = every[:, K + 1].sum(), every[:, K + 2].sum()
        bw = moved / copy_s if copy_s > 0 else float("inf")  # measured: what this device's copies ran at
        spill = dict(shard_bytes=every[:, 1:K + 1].T, budget_bytes=every[:, K + 3], load_bytes_per_s=bw,
                     updates_at_end=False)
    for row, (pf, pb, mf, mb, scale) in zip(rows, times):
        sim_plan = simulate_multimodel(scale[:, None, None] * pf[None], scale[:, None, None] * pb[None],
                                       interleave=cfg.interleave, **spill)
        sim_meas = simulate_multimodel(mf, mb, interleave=cfg.interleave, **spill)
        row.update(sim_plan_together_s=sim_plan.makespan_s, sim_plan_sequential_s=sim_plan.sequential_s,
                   sim_measured_together_s=sim_meas.makespan_s, sim_measured_sequential_s=sim_meas.sequential_s,
                   sim_stall_s=float(sim_meas.stall_s.sum()))
    out = summarize_k(rows, cfg.warmup, K, bool(every[:, 0].min() == 1.0), budget)
    if budget is not None:
        out.update(copy_bytes_per_s=float(spill["load_bytes_per_s"]), budget_bytes_per_stage=every[:, K + 3].tolist(),
                   copy_s=float(every[:, K + 2].sum()),
                   sim_stall_s=float(sum(r["sim_stall_s"] for r in rows[cfg.warmup:])))
    return out


def summarize_k(rows: list, warmup: int, K: int, identical: bool, budget: float | None) -> dict:
    """Totals over the timed steps (``rows[warmup:]``) of one K."""
    timed = rows[warmup:] or rows
    together = float(sum(r["together_s"] for r in timed))
    sequential = float(sum(sum(r["single_s"]) for r in timed))
    singles = np.array([r["single_s"] for r in timed])  # [steps, K]: identical shapes across k
    spread = (singles.max(axis=1) - singles.min(axis=1)) / np.median(singles, axis=1)
    sp = lambda a, b: float(sum(r[b] for r in timed) / sum(r[a] for r in timed))  # noqa: E731
    return {"K": K, "steps_timed": len(timed), "together_s": together, "sequential_s": sequential,
            "speedup": sequential / together if together > 0 else float("nan"),
            "sim_plan_speedup": sp("sim_plan_together_s", "sim_plan_sequential_s"),
            "sim_measured_speedup": sp("sim_measured_together_s", "sim_measured_sequential_s"),
            "timer_noise": float(np.median(spread)) if K > 1 else float("nan"),
            "identical": identical, "budget_bytes": budget,
            "peak_resident_bytes": int(max(r["peak_resident_bytes"] for r in rows)),
            "spills": int(sum(r["spills"] for r in rows)), "loads": int(sum(r["loads"] for r in rows)),
            "prefetches": int(sum(r["prefetches"] for r in rows)), "per_step": rows}


def worker(rank: int, world_size: int, port: int, payload: dict):
    """One stage process of ``bench multimodel``: the data pass, then every K of ``cfg.ks``."""
    import torch

    import dynabatch
    from ..pipeline import init_pipeline, make_model, stage_cost_model
    from ..pipeline.runtime.launch import heartbeat
    from .train import uniform_bounds

    cfg = MultiBenchConfig.from_payload(payload)
    torch.set_num_threads(cfg.threads_per_proc)
    S = cfg.options.num_stages
    with init_pipeline(num_stages=S, rank=rank, world_size=world_size, master_port=port,
                       timeout_s=cfg.timeout_s) as ctx:
        model = make_model(cfg.model, **_sizes(cfg), seed=cfg.options.seed)
        cost = stage_cost_model(model, S, cfg.device_preset)
        enc_dec = model.kind == "encoder_decoder"
        opts = cfg.options.replace(num_ranks=1, max_target_len=cfg.options.max_target_len if enc_dec else None)
        t0 = time.perf_counter()
        from ..loader.settings import Costing, DataSource, Runtime

        loader = dynabatch.DataLoader(list(cfg.data), options=opts,
                                      source=DataSource(index=cfg.index, mode="indexed"),
                                      costing=Costing(cost_model=cost),
                                      runtime=Runtime(world_size=1, rank=0, plan_ahead=0))
        steps = []
        for step in loader.steps():
            heartbeat()
            steps.append(step)
            if len(steps) == cfg.steps:
                break
        loader_s = time.perf_counter() - t0
        loader.close()
        if len(steps) < cfg.steps:
            raise ValueError(f"the data hold {len(steps)} global batches of {opts.global_batch_tokens} tokens; "
                             f"--steps asks for {cfg.steps}")
        bounds = uniform_bounds(model, S)
        out = {"loader_s": loader_s, "bounds": [int(b) for b in bounds],
               "microbatches_per_step": float(np.mean([len(s) for s in steps])),
               "ks": [run_k(ctx, cfg, int(K), steps, loader.collation, cost, bounds) for K in cfg.ks]}
    return out if rank == 0 else None


def run_multimodel_bench(cfg: MultiBenchConfig, *, generated_samples: int = 2000, progress: bool = False) -> dict:
    """Run the benchmark on ``cfg.options.num_stages`` local processes; returns the JSON-able result.
    ``progress``: a bar of the steps trained (each K's) on stderr."""
    from ..pipeline import launch_local, make_model
    from ..pipeline.models import count_parameters
    from .train import TrainBenchConfig, build_data

    bad = [K for K in cfg.ks if not 1 <= int(K) <= len(LR_FACTORS)]
    if bad:
        raise ValueError(f"K must be 1..{len(LR_FACTORS)} models, got {bad}")
    if cfg.warmup >= cfg.steps:
        raise ValueError(f"--warmup {cfg.warmup} leaves none of the {cfg.steps} steps to time")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        built = build_data(TrainBenchConfig(model=cfg.model, data=cfg.data, options=cfg.options), tmp,
                           generated_samples)
        cfg = replace(cfg, data=built.data, index=built.index, scan_s=time.perf_counter() - t0)
        with watch_ticks(os.path.join(tmp, "progress"), cfg.steps * len(cfg.ks), f"bench multimodel (K={cfg.ks})",
                         "step", progress) as env:
            procs = launch_local(f"{__name__}:worker", cfg.options.num_stages, args=(cfg.to_payload(),),
                                 idle_timeout_s=cfg.timeout_s, threads_per_proc=cfg.threads_per_proc, env=env)
    failed = [p for p in procs if p.returncode != 0 or p.timed_out]
    if failed:
        raise RuntimeError("bench multimodel failed: " + "; ".join(
            f"rank {p.rank}: rc={p.returncode} timed_out={p.timed_out}\n{p.stderr[-3000:]}" for p in failed))
    res = procs[0].result
    data_s = cfg.scan_s + res["loader_s"]
    for r in res["ks"]:
        r["data_saved_s"] = (r["K"] - 1) * data_s
    config = {k: v for k, v in cfg.to_payload().items() if k not in ("index", "timeout_s")}
    config.update(parameters=count_parameters(make_model(cfg.model, **_sizes(cfg), seed=0)), model_sizes=_sizes(cfg),
                  bounds=res["bounds"], microbatches_per_step=res["microbatches_per_step"],
                  lrs=[cfg.lr * f for f in LR_FACTORS[:max(cfg.ks)]])
    return {"config": config, "scan_s": cfg.scan_s, "loader_s": res["loader_s"], "data_pass_s": data_s,
            "ks": res["ks"]}


def format_multimodel(result: dict) -> str:
    """The text table of a `run_multimodel_bench` result (seconds)."""
    c = result["config"]
    o = c["options"]
    data = ", ".join(os.path.basename(p) for p in c["data"])
    lines = [f"K models on one data pass vs K single-model runs: {c['model']} ({c['parameters']:,} parameters), "
             f"{o['num_stages']} gloo stages {c['bounds']}, {c['steps']} steps of {o['global_batch_tokens']} tokens "
             f"({c['warmup']} warm-up, {c['microbatches_per_step']:.1f} micro-batches per step), "
             f"{'interleaved' if c['interleave'] else 'model after model'}; data {data}",
             f"{'K':>2} {'together s':>10} {'sequential s':>12} {'speedup':>8} {'sim plan':>9} {'sim meas':>9} "
             f"{'noise':>6} {'identical':>9} {'data saved s':>12}  spilling"]
    for r in result["ks"]:
        spill = ("-" if r["budget_bytes"] is None else
                 f"budget {r['budget_bytes'] / 2**20:.1f} MiB, peak {r['peak_resident_bytes'] / 2**20:.1f} MiB, "
                 f"{r['spills']} spills, {r['loads']} loads ({r['prefetches']} prefetched), copies "
                 f"{r['copy_s']:.2f} s at {r['copy_bytes_per_s'] / 1e9:.1f} GB/s (simulated stalls "
                 f"{r['sim_stall_s']:.2f} s)")
        noise = "-" if r["timer_noise"] != r["timer_noise"] else f"{r['timer_noise']:.1%}"
        lines.append(f"{r['K']:>2} {r['together_s']:>10.2f} {r['sequential_s']:>12.2f} {r['speedup']:>7.3f}x "
                     f"{r['sim_plan_speedup']:>8.3f}x {r['sim_measured_speedup']:>8.3f}x {noise:>6} "
                     f"{'yes' if r['identical'] else 'NO':>9} {r['data_saved_s']:>12.2f}  {spill}")
    lines.append(f"data pass (done once together, K times sequentially): scan {result['scan_s']:.2f} s + loader "
                 f"(plan, tokenize, collate {c['steps']} steps) {result['loader_s']:.2f} s = {result['data_pass_s']:.2f} s;"
                 f" data saved = (K - 1) x that, not in the training columns")
    lines.append("speedup = sequential / together over the timed steps (rank 0's step wall times); sim plan: the "
                 "simulator on the plan's seconds; sim meas: on the sequential arm's measured stage times; noise: "
                 "median spread of the K identical single-model steps")
    return "\n".join(lines)


def bench_multimodel_command(args) -> int:
    """Run ``dynabatch bench multimodel`` with its parsed arguments (parser: `dynabatch.commands.bench_train`)."""
    import json

    from .train_command import sizes_from_args

    try:  # bad sizes, options or settings: one line naming the command, exit 2
        options = default_multimodel_options().replace(
            num_stages=args.stages, global_batch_tokens=args.global_batch_tokens, max_len=args.max_len,
            max_target_len=args.max_target_len, seed=args.seed)
        cfg = MultiBenchConfig(model=args.model, ks=tuple(args.k), data=tuple(args.data or ()), options=options,
                               steps=args.steps, warmup=args.warmup, lr=args.lr, budget_shards=args.budget_shards,
                               interleave=not args.no_interleave, timeout_s=args.timeout,
                               model_sizes=sizes_from_args(args))
        result = run_multimodel_bench(cfg, progress=show_progress(args))
    except ValueError as e:
        print(f"dynabatch bench multimodel: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, default=float) if args.json else format_multimodel(result))
    return 0


__all__ = ["LR_FACTORS", "MultiBenchConfig", "bench_multimodel_command", "default_multimodel_options",
           "format_multimodel", "run_k", "run_multimodel_bench", "summarize_k", "worker"]
