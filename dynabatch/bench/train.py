"""``dynabatch bench train``: real training throughput of a pipelined tiny model, dp vs baselines.

Every method trains the same model (same seed, same initialization) on the same global batches
(`dynabatch.DataLoader` in the indexed mode: the global batches are cut by tokens with the same
seed whatever the method) for the same number of steps, over ``num_stages`` local processes
(gloo on CPU; ``--backend nccl`` with one GPU per rank). Only the grouping of each global batch
into micro-batches differs: ``dp`` (dynabatch's planner, its cost model refit online by
`dynabatch.core.plan.feedback.FeedbackLoop` from the measured micro-batch times) against ``pack``, ``pad``
and ``token_budget`` (the planner's default knobs, reported in the result). The methods run
interleaved, one step each in a rotating order, so that the background load of a shared machine
hits every method alike (each keeps its own model, optimizer, loader and runner).

What is measured (seconds, tokens):

* ``tokens_per_s``: real (unpadded) tokens of the timed steps / the summed wall time of those
  steps' ``PipelineRunner.step`` (slowest rank: forward, backward, transfers, gradient reduction,
  optimizer). The first ``warmup`` steps are excluded. ``tokens_per_s_e2e`` also counts the time
  the loop waited for the DataLoader (tokenization, collation and planning run in the training
  process here, ``plan_ahead=0``, so that feedback refits apply to the very next plan on every rank).
* MAPE, on a per micro-batch basis: the prediction the step was planned with (``predicted_time_s``
  of each micro-batch, forward+backward on one stage) against the measured forward+backward
  seconds of that micro-batch on the slowest stage (``stage_reduce="max"``). ``mape_start`` pools
  the steps before the first refit (the analytic ``cpu`` preset); ``mape_end`` pools the last
  ``max(3, steps // 4)`` steps, predictions made *before* each step ran (out of sample);
  ``mape_start_step``/``mape_end_step`` score each step's summed prediction the same way. Baselines
  are not refit: their MAPE is the prior's, for reference. ``mape_noise`` estimates the timing
  noise floor: the median relative spread of repeated identical shapes within the run.

``--model vlm-tiny`` (image+text and text-only records over a vision | language split; stage-aware
``dp`` with per-stage feedback vs stage-blind ``dp-blind``, ``pack``, ``token_budget``; per-stage MAPE):
see `dynabatch.bench.train_vlm`. ``--model hf-llama`` (a tiny transformers Llama through ``from_hf``, costed
by a profile of the model, ``dp`` refit per stage): see `dynabatch.bench.train_hf`. Stopping, timeouts and
partial results, the command line: see
`dynabatch.bench.train_report`.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from ..core.options import PlanOptions
from .payload import config_from_payload, config_payload
from .progress import rank_note, rank_tick, watch_ticks
from .train_report import (StopSignal, TrainBenchStopped, assemble_result, format_table, read_json,  # noqa: F401
                           result_config, stop_on_signals, timer_noise, write_json)
from .train_flushfree import FLUSH_VARIANTS, runner_options, split_flush, stream_step
from .train_recompute import RECOMPUTE_VARIANTS, measured_memory, observe, split_variant, summarize, variant_options
from .train_data import SHARED_FLAN, build_data, default_data  # noqa: F401
from .train_hf import HF_MODEL, HF_SIZES
from .train_vlm import VLM_METHODS, VLM_MODEL, VLM_SIZES  # noqa: F401

TRAIN_METHODS = ("dp", "pack", "pad", "token_budget")  # text models; vlm-tiny: VLM_METHODS
PARTIAL_EVERY_S = 1.0  # rank 0 rewrites the partial result after a round at most this often
MODEL_SIZES = {"gpt-tiny": dict(vocab=512, hidden=256, layers=4, heads=4),
               "t5-tiny": dict(vocab=512, hidden=256, encoder_layers=2, decoder_layers=2, heads=4), VLM_MODEL: VLM_SIZES}


def default_train_options() -> "PlanOptions":
    """The planning options ``bench train`` runs with unless told otherwise: 32768-token global
    batches, 2048/512-token caps (byte tokens: FLAN inputs run to ~1.9k at the 95th percentile),
    2 stages, the last partial step dropped so every timed step is full."""
    return PlanOptions(global_batch_tokens=32768, max_len=2048, max_target_len=512, num_stages=2, drop_last=True)


@dataclass
class TrainBenchConfig:
    """Settings of one ``bench train`` run (tokens, seconds): the `PlanOptions` every method plans
    with (``method`` is set per run; ``num_stages`` is the number of local processes) plus what
    only the benchmark knows."""

    model: str = "t5-tiny"
    data: tuple = ()
    options: PlanOptions = field(default_factory=default_train_options)
    steps: int = 20
    warmup: int = 3
    methods: tuple = TRAIN_METHODS
    device_preset: str = "cpu"
    backend: str | None = None
    lr: float = 1e-3
    refit_every: int = 2
    forgetting: float = 0.8
    partition: str = "searched"  # or "uniform" (equal block counts)
    save_cost_model: str | None = None  # JSON path for dp's refit cost model (written by rank 0)
    threads_per_proc: int = 1
    timeout_s: float = 900.0  # liveness: kill the ranks after this long without progress from any of them
    max_wall_s: float | None = None  # optional whole-run cap (a last resort)
    model_sizes: dict = field(default_factory=dict)
    index: str | None = None  # length index Parquet (built by run_train_bench)
    text_fraction: float = 0.5  # vlm-tiny's generated mix: share of FLAN text-only records
    flush_window: int = 10  # flush-free variants: steps run as one stream between flushes
    bypass_idle_stages: bool = False  # RunnerConfig(bypass_idle_stages=...) for every method (flushed runs)
    cost_model: str | None = None  # hf-llama: the profile every method starts from (JSON; profiled when None)

    def resolved_sizes(self) -> dict:
        return {**(HF_SIZES if self.model == HF_MODEL else MODEL_SIZES[self.model]), **self.model_sizes}

    def build_model(self):
        """The run's model (same seed, same weights on every rank and for every method)."""
        from ..pipeline import make_model
        from .train_hf import hf_llama

        return (hf_llama if self.model == HF_MODEL else partial(make_model, self.model))(
            **self.resolved_sizes(), seed=self.options.seed)

    def to_payload(self) -> dict:
        """A JSON-able dict (to send to worker processes); `from_payload` reads it back."""
        return config_payload(self)

    @classmethod
    def from_payload(cls, d: dict) -> "TrainBenchConfig":
        return config_from_payload(cls, d)


def uniform_bounds(model, stages: int) -> list[int]:
    """Stage bounds with about equal transformer blocks per stage (embedding on the first, head on
    the last); the same for every method."""
    n = len(model.layers)
    return [0, *[1 + round((n - 2) * k / stages) for k in range(1, stages)], n]


from ..core.cost.fit import mape as _mape  # noqa: E402

# `batch_shapes`, `representative` and `stage_cost_model` are public in `dynabatch.pipeline` (imported
# where used: this module is loaded by the CLI, which must not import torch up front)


class MethodRun:
    """One method's training state on this rank's stage: its own model (same seed as every other
    method), cost model, DataLoader, runner and optimizer; `step` trains one global batch."""

    def __init__(self, ctx, cfg: TrainBenchConfig, method: str):
        import torch

        import dynabatch
        from ..core.plan.feedback import FeedbackLoop
        from ..pipeline import PipelineRunner, RunnerConfig, search_partition, stage_cost_model
        from ..pipeline.measure import representative
        from . import train_hf
        from ..pipeline.runtime.launch import heartbeat  # each set-up phase is progress (a minute each, loaded)

        self.cfg, self.method, self.rank = cfg, method, ctx.rank
        base_method, self.flush_kind = split_flush(method)  # "dp/predict": dp, flush-free with prediction
        base_method, self.recompute = split_variant(base_method)  # "dp+adaptive": dp with that recompute policy
        model = cfg.build_model()
        hf = cfg.model == HF_MODEL  # its costs: a profile of the model on this machine (bench.train_hf)
        self.cost = train_hf.load_costs(cfg.cost_model) if hf else stage_cost_model(model, ctx.num_stages,
                                                                                     cfg.device_preset)
        if self.recompute is not None:  # fixed stages, their measured memory (see bench.train_recompute)
            model.to(ctx.device)
            measured_memory(model, uniform_bounds(model, ctx.num_stages), self.cost, ctx.device)
        self.vlm = None  # vlm-tiny: train_vlm.setup (stage layout, bounds, vision loader, feedback mode)
        if cfg.model == VLM_MODEL:
            from . import train_vlm

            self.vlm = train_vlm.setup(model, self.cost, ctx.num_stages, cfg, method)
        # hf-llama: train_hf.setup (planning method, feedback mode); both: per-stage planned vs measured seconds
        self.spec = vlm = self.vlm or (train_hf.setup(base_method) if hf else {})
        self.staged = bool(vlm)
        self.model, self.stage_preds, self.stage_meas, self.stage_comp = model, [], [], []
        self.prior = self.cost.time_coef.copy()
        # dp (and dp-blind): the loader's feedback loop refits its cost model; baselines: a loop that only scores
        self.feedback = (FeedbackLoop(self.cost, refit_every=cfg.refit_every, forgetting=cfg.forgetting,
                                      **vlm.get("feedback", {})) if method in ("dp", "dp-blind") else None)
        self.scorer = self.feedback or FeedbackLoop(self.cost)
        enc_dec = model.kind == "encoder_decoder"
        # plan_ahead=0: step k+1 is planned after step k's refit, identically on every rank
        opts = cfg.options.replace(method=vlm.get("plan_method", "dp" if method == "dp-blind" else base_method),
                                   num_stages=ctx.num_stages, num_ranks=ctx.num_replicas,
                                   max_target_len=cfg.options.max_target_len if enc_dec else None)
        opts = variant_options(opts, self.recompute) if self.recompute else opts
        from ..loader.settings import Costing, DataSource, Runtime, Tokenization

        self.loader = dynabatch.DataLoader(
            list(cfg.data), options=opts, feedback=self.feedback, source=DataSource(index=cfg.index, mode="indexed"),
            costing=Costing(cost_model=self.cost), runtime=Runtime(world_size=ctx.num_replicas, rank=ctx.replica,
                                                                   plan_ahead=0),
            tokenization=Tokenization(**vlm.get("tokenization", {})))
        self._it = iter(self.loader.steps())
        heartbeat()
        t0 = time.perf_counter()
        self._first = next(self._it, None)  # trained as step 0; its micro-batches are the expected mix
        self._first_data_s = time.perf_counter() - t0
        if self.vlm is not None:
            self.partition, bounds = None, self.vlm["bounds"]
        elif cfg.partition == "searched" and self._first and self.recompute is None:
            model.to(ctx.device)
            self.partition = search_partition(model.layers, representative(self._first), ctx.num_stages,
                                              schedule=cfg.options.schedule, device=ctx.device)
            bounds = self.partition.bounds
        else:
            self.partition = None
            bounds = uniform_bounds(model, ctx.num_stages)
        self.bounds = [int(b) for b in bounds]
        heartbeat()
        self.runner = PipelineRunner.from_model(model, ctx, bounds, config=RunnerConfig(
            **{"schedule": cfg.options.schedule, "gather_timing": True, "bypass_idle_stages": cfg.bypass_idle_stages,
               **runner_options(self.flush_kind)}))
        self._window_left: list = []  # flush-free variants: the window's (step, result) pairs not reported yet
        self.weight_bytes = 0.0  # flush-free variants: the most bytes the weight handling held
        self.optimizer = torch.optim.AdamW(self.runner.parameters(), lr=cfg.lr)
        self.rows: list[dict] = []
        self.memory_rows: list[dict] = []  # recompute variants: per-stage planned and measured peaks
        self.phis, self.ys, self.preds = [], [], []
        self.done = False

    def _next(self):
        """The loader's next step and the seconds waited for it (None at the end of the data)."""
        t0 = time.perf_counter()
        if self._first is not None:
            mbs, self._first = self._first, None
            return mbs, self._first_data_s
        return next(self._it, None), time.perf_counter() - t0

    def step(self, k: int) -> dict | None:
        """Train one step; None when the data is exhausted."""
        from ..pipeline import batch_shapes

        if self.flush_kind not in (None, "sync"):
            got = stream_step(self)
            if got is None:
                self.done = True
                return None
            mbs, res, t_data = got
            return self._row(k, mbs, res, t_data, float(res.timing.step_s))
        mbs, t_data = self._next()
        if mbs is None:
            self.done = True
            return None

        if self.vlm is not None:
            from .train_vlm import rows_as_sequences

            run = rows_as_sequences(mbs)
            res = self.runner.step(self.model.batch_shapes(run), run, optimizer=self.optimizer)
        else:
            counts = mbs.plan.options.get("recompute_layers") if self.recompute and mbs.plan is not None else None
            res = self.runner.step(batch_shapes(mbs, self.loader.collation), mbs, optimizer=self.optimizer,
                                   recompute=counts)
            if self.recompute:
                self.memory_rows.append(observe(mbs, res))
        obs = self._observe_stages(mbs, res) if self.staged else None  # before the refit in loader.feedback
        return self._row(k, mbs, res, t_data, max(t.step_s for t in res.all_timings), obs)

    def _observe_stages(self, mbs, res) -> tuple:
        """Keep each stage's planned and measured seconds of this step's micro-batches (per-stage MAPE)."""
        from .train_vlm import stage_computes, stage_observation

        obs = stage_observation(self.cost, mbs, res)
        self.stage_preds.append(obs[1])
        self.stage_meas.append(obs[2])
        self.stage_comp.append(stage_computes(self.model, self.bounds, obs[0]))
        return obs

    def _row(self, k, mbs, res, t_data, wall, vlm_obs=None) -> dict:
        """Score one trained step (MAPE; feedback refit for dp) and keep its row."""
        if self.feedback is not None:
            self.loader.feedback(res)  # record_step against the plan (slowest stage), refit every refit_every
        else:
            self.scorer.record_step(mbs, res)  # the same scoring, no refit
        err = self.scorer.step_errors[-1].mape
        seen = self.scorer.last  # features, measured (slowest stage) and planned seconds per micro-batch
        phi, measured, pred = seen.phi, seen.measured_s, seen.predicted_s
        if vlm_obs is not None:  # every method alike: planned vs measured seconds of the slowest stage
            phi, pred, measured = vlm_obs[0], vlm_obs[1].max(axis=0), vlm_obs[2].max(axis=0)
            err = _mape(pred, measured)
        self.phis.append(phi)
        self.ys.append(measured)
        self.preds.append(pred)
        row = {"step": k, "loss": float(res.loss), "real_tokens": int(sum(int(b["real_tokens"]) for b in mbs)),
               "target_tokens": int(res.num_tokens), "microbatches": len(mbs), "step_s": float(wall),
               "data_s": float(t_data), "predicted_s": float(pred.sum()), "measured_s": float(measured.sum()),
               "mape": float(err),
               "sample_ids": sorted(int(i) for b in mbs for i in b.get("sample_ids", ()))}  # this rank's samples
        if vlm_obs is not None:  # micro-batches without vision tiles: the ones a vision stage can bypass
            from ..core.kernels.cost import FEATURES

            row["text_only_microbatches"] = int((vlm_obs[0][:, FEATURES.index("has_vis")] <= 0).sum())
        self.rows.append(row)
        return row

    def summary(self) -> dict:
        """The method's result at the end of the run (closes its loader, saves dp's cost model)."""
        self.loader.close()
        out = self.stats()
        if self.feedback is not None and self.cfg.save_cost_model:
            if self.rank == 0:  # every rank holds the same coefficients
                self.cost.save(self.cfg.save_cost_model)
            out["cost_model_path"] = self.cfg.save_cost_model
        return out

    def stats(self) -> dict:
        """The result of the steps trained so far, without side effects (also a partial result mid-run)."""
        cfg, rows, feedback = self.cfg, self.rows, self.feedback
        n = len(rows)
        if not n:
            raise RuntimeError(f"{self.method}: the data gave no step (too little data for the global batch?)")
        w = min(cfg.warmup, n - 1)
        timed = rows[w:]
        toks = sum(r["real_tokens"] for r in timed)
        secs = sum(r["step_s"] for r in timed)
        secs_e2e = secs + sum(r["data_s"] for r in timed)
        first = max(1, min(cfg.refit_every, n)) if feedback is not None else n
        last = max(3, n // 4)
        all_phi, all_y = np.vstack(self.phis), np.concatenate(self.ys)
        out = {
            "tokens_per_s": toks / secs if secs > 0 else 0.0,
            "tokens_per_s_e2e": toks / secs_e2e if secs_e2e > 0 else 0.0,
            "steps": n, "warmup_steps": w, "timed_steps": len(timed),
            "real_tokens": sum(r["real_tokens"] for r in rows), "timed_real_tokens": toks, "timed_s": secs,
            "microbatches_per_step": float(np.mean([r["microbatches"] for r in rows])),
            "loss_start": rows[0]["loss"], "loss_end": rows[-1]["loss"],
            "mape_start": _mape(np.concatenate(self.preds[:first]), np.concatenate(self.ys[:first])),
            "mape_end": _mape(np.concatenate(self.preds[-last:]), np.concatenate(self.ys[-last:])),
            "mape_start_step": _mape([r["predicted_s"] for r in rows[:first]], [r["measured_s"] for r in rows[:first]]),
            "mape_end_step": _mape([r["predicted_s"] for r in rows[-last:]], [r["measured_s"] for r in rows[-last:]]),
            "mape_prior_all": _mape(all_phi @ self.prior, all_y),
            "mape_noise": timer_noise(all_phi, all_y),
            "refits": len(feedback.history) if feedback is not None else 0,
            "bounds": self.bounds,
            "partition_makespan_s": self.partition.makespan_s if self.partition is not None else None,
            "knobs": {"method": self.method, "collation": self.loader.collation, "method_options": "planner defaults"},
            "weight_extra_bytes": self.weight_bytes,
            "per_step": rows,
        }
        if feedback is not None and feedback.history:
            out["mape_last_refit_in_sample"] = feedback.history[-1].mape_after_refit
        if self.recompute is not None:
            limit = cfg.options.device_memory_limit
            out["memory"] = {**summarize(self.memory_rows[w:] or self.memory_rows, limit),
                             "recompute": self.recompute}
        if self.stage_preds:  # per-stage MAPE: each stage's planned vs measured seconds
            from .train_vlm import vlm_stats

            out.update(vlm_stats(self.stage_preds, self.stage_meas, self.stage_comp, self.phis, first, last, w),
                       feedback_mode=self.spec["feedback_mode"], stage_aware=bool(self.cost.stage_aware),
                       plan_method=self.spec["plan_method"])
        return out


def train_methods(ctx, cfg: TrainBenchConfig, *, log=None, on_round=None) -> dict:
    """Train every method for ``cfg.steps`` steps, interleaved step by step (the order rotates each
    step) so that a change in the machine's background load hits every method alike.
    ``on_round(k, runs)`` is called after round ``k`` (every method did step ``k``); each step
    reports progress to the launcher (`dynabatch.pipeline.runtime.launch.heartbeat`)."""
    from ..pipeline.runtime.launch import heartbeat

    runs = {}
    note = rank_note if ctx.rank == 0 else (lambda text: None)  # beside the launcher's bar (bench.progress)
    for i, m in enumerate(cfg.methods):
        heartbeat()
        note(f"set up {m} ({i + 1}/{len(cfg.methods)})")
        runs[m] = MethodRun(ctx, cfg, m)
    names = list(runs)
    for k in range(cfg.steps):
        order = names[k % len(names):] + names[:k % len(names)]
        for m in order:
            if not runs[m].done:
                note(f"step {k + 1}: {m}")
                row = runs[m].step(k)
                heartbeat()
                if row is not None and log is not None:
                    log(m, row)
        if on_round is not None:
            on_round(k, runs)
        if all(r.done for r in runs.values()):
            break
    return {m: runs[m].summary() for m in names}


def train_method(ctx, cfg: TrainBenchConfig, method: str, *, log=None) -> dict:
    """Train ``cfg.steps`` steps with one method alone; the same dict on every rank."""
    return train_methods(ctx, replace(cfg, methods=(method,)), log=log)[method]


def worker(rank: int, world_size: int, port: int, cfg_dict: dict):
    """One rank of ``bench train`` (run by `dynabatch.pipeline.launch_local`): every method in turn."""
    import torch

    from ..pipeline import init_pipeline

    cfg = TrainBenchConfig.from_payload(cfg_dict)
    torch.set_num_threads(cfg.threads_per_proc)
    verbose = bool(cfg_dict.get("_verbose")) and rank == 0

    def log(method, row):
        print(f"[{method}] step {row['step']:3d} loss {row['loss']:.3f} real tokens {row['real_tokens']} "
              f"mbs {row['microbatches']} predicted {row['predicted_s'] * 1e3:.0f} ms measured "
              f"{row['measured_s'] * 1e3:.0f} ms step {row['step_s'] * 1e3:.0f} ms MAPE {row['mape']:.1%}",
              file=sys.stderr, flush=True)

    partial_path, config = cfg_dict.get("_partial"), cfg_dict.get("_config") or {}
    last_write = [-1e9]

    def on_round(k, runs):  # rank 0: a bar unit (bench.progress); the result so far on disk, what a stop reports
        if rank == 0:
            rank_tick()
        # at most once a second: the other ranks wait for rank 0 meanwhile, inside their timed step
        if rank != 0 or not partial_path or time.monotonic() - last_write[0] < PARTIAL_EVERY_S:
            return
        last_write[0] = time.monotonic()
        try:
            methods = {m: r.stats() for m, r in runs.items() if r.rows}
            write_json(partial_path, assemble_result(config, methods, status="running"))
        except Exception as e:  # never let the report of a partial result break the run itself
            print(f"bench train: could not write the partial result: {e!r}", file=sys.stderr, flush=True)

    os.environ.setdefault("LOCAL_RANK", str(rank))  # one GPU per local rank with NCCL
    out = {}
    with init_pipeline(num_stages=cfg.options.num_stages, rank=rank, world_size=world_size, master_port=port,
                       backend=cfg.backend, timeout_s=cfg.timeout_s) as ctx:
        out = train_methods(ctx, cfg, log=log if verbose else None, on_round=on_round)
    return out if rank == 0 else None


def run_train_bench(cfg: TrainBenchConfig, *, verbose: bool = False, generated_samples: int = 2000,
                    out: str | None = None, progress: bool = False) -> dict:
    """Run the benchmark on ``cfg.options.num_stages`` local processes; returns the JSON-able result
    (``"partial": false``). ``progress``: a bar of the steps trained (each: every method's) on stderr. ``out``: a JSON file kept up to date after every round of steps (partial,
    ``"status": "running"``) and holding the final or stopped result at the end. A run that does
    not finish (SIGINT/SIGTERM, liveness timeout, ``max_wall_s``, a failed rank) raises
    `TrainBenchStopped` with the partial result of the steps done so far."""
    from ..pipeline import launch_local
    from ..pipeline.models import count_parameters

    unknown = (set(cfg.methods) - set(TRAIN_METHODS) - set(RECOMPUTE_VARIANTS) - set(FLUSH_VARIANTS)
               - {"dp-blind", "group_by_length", "kk", "rebalance"})
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}")
    if cfg.cost_model is not None and cfg.model != HF_MODEL:
        raise ValueError(f"--cost-model starts hf-llama from a profile; {cfg.model} uses the analytic --device-preset")
    if cfg.model == HF_MODEL:
        from .train_hf import check_cost_model

        check_cost_model(cfg.cost_model)
    if cfg.model == VLM_MODEL:  # a fixed split: vision | language ("searched", the text models' default, maps here)
        cfg = replace(cfg, partition="modality" if cfg.partition == "searched" else cfg.partition)
        if cfg.partition not in ("modality", "uniform"):
            raise ValueError("vlm-tiny runs a fixed split: --partition modality (vision | language) or uniform")
    out = os.path.abspath(out) if out else None
    if out and os.path.exists(out):
        os.remove(out)  # a stale file must not pass for this run's partial result
    procs, stop, config = None, None, None
    with tempfile.TemporaryDirectory() as tmp, stop_on_signals():
        partial_path = out or os.path.join(tmp, "partial.json")
        try:
            t0 = time.perf_counter()
            cfg = build_data(cfg, tmp, generated_samples)
            index_s = time.perf_counter() - t0
            model = cfg.build_model()
            costs = {}  # hf-llama: the profile every method starts from (bench.train_hf)
            if cfg.model == HF_MODEL:
                from .train_hf import prepare_costs

                cfg, costs = prepare_costs(cfg, model, tmp, progress)
            config = {**result_config(cfg, index_s, count_parameters(model)), **costs}
            payload = {**cfg.to_payload(), "_verbose": verbose, "_partial": partial_path, "_config": config}
            with watch_ticks(os.path.join(tmp, "progress"), cfg.steps,
                             f"bench train ({cfg.model}, {len(cfg.methods)} methods)", "step", progress) as env:
                procs = launch_local(f"{__name__}:worker", cfg.options.num_stages, args=(payload,),
                                     idle_timeout_s=cfg.timeout_s, max_wall_s=cfg.max_wall_s,
                                     threads_per_proc=cfg.threads_per_proc, env=env)
        except StopSignal as e:
            stop = e
        partial = read_json(partial_path)
    bad = [p for p in procs if p.returncode != 0 or p.timed_out] if procs else []
    if stop is None and not bad and procs[0].result is not None:
        if verbose:
            sys.stderr.write(procs[0].stderr)
        result = assemble_result(config, procs[0].result)
        if out:
            write_json(out, result)
        return result
    # stopped early: report what was done
    if stop is not None:
        why, code = f"stopped by {stop.args[0]}", 128 + stop.signum
    elif any(p.timed_out and p.timeout_reason == "max_wall" for p in procs):
        why, code = f"max wall time: stopped after {cfg.max_wall_s:g} s", 1
    elif any(p.timed_out for p in procs):
        why, code = f"liveness timeout: no rank made progress for {cfg.timeout_s:g} s", 1
    else:
        why, code = "failed: " + ", ".join(f"rank {p.rank} exited with {p.returncode}" for p in bad or procs), 1
    detail = "; ".join(f"rank {p.rank}: rc={p.returncode} timed_out={p.timed_out}\n{p.stderr[-3000:]}"
                       for p in (bad or procs or ()))
    result = None
    if config is not None:
        methods = (partial or {}).get("methods") or {}
        result = assemble_result(config, methods, status="stopped", stopped_by=why)
        if out:
            write_json(out, result)
    done = ", ".join(f"{m} {n}" for m, n in result["steps_done"].items()) if result else "none"
    raise TrainBenchStopped(f"bench train {why}; steps done: {done} of {cfg.steps}"
                            + (f"\n{detail}" if detail else ""), result, code)
