"""``dynabatch bench gpu``: single-GPU training of the bench's Llama model through the library's
adapters (`dynabatch.pipeline.models.hf`, one pipeline stage), and adaptive recomputation under a device
memory limit.

Training section: every method of `GPU_METHODS` trains its own copy of the same initialization on
the same global batches (the DataLoader's indexed mode cuts global batches by tokens with the same
seed whatever the method), one step each in a rotating order so that drift hits every method alike.
``dp``/``dp_varlen`` plan with the profiled cost model of the cost section; ``dp_varlen`` and
``pack`` (`PLANNER_METHOD`) send packed rows (``cu_seqlens``) through the model's own attention. Per
method: real (unpadded) tokens/s over the timed steps' wall seconds (``PipelineRunner.step`` with the
optimizer, device synchronized), the ratio to ``pack``, the share of wall time spent waiting for the DataLoader, and
on CUDA the activation bytes measured (``torch.cuda.max_memory_allocated`` minus the bytes held
before the step: weights, gradients, optimizer state) against the plan's prediction.

Recompute section: ``dp`` with ``recompute="adaptive"`` under an activation limit (a fraction of
the largest activation peak ``dp`` planned in the training section; the cost model's memory
measured on the model, `dynabatch.pipeline.measured_stage_memory`) against ``recompute=
"full"`` on the same batches: the device limit is the state bytes plus that activation limit, and
``torch.cuda.max_memory_allocated`` must stay within it; step time adaptive / full.
"""

from __future__ import annotations

import time

import numpy as np

from .gpu_setup import SKIP_NO_CUDA, bench_loader, real_tokens, sync

GPU_METHODS = ("dp", "dp_varlen", "pack", "token_budget", "pad")
#: the planner's method of each arm where it differs from its name: a Hugging Face model must not attend
#: across samples (the adapter refuses rows of several samples), so ``pack`` runs the packing baseline's
#: varlen form (its bins as packed rows with ``cu_seqlens``), which is how such models train packed data
PLANNER_METHOD = {"pack": "pack_varlen"}


class Arm:
    """One method's training state: its model copy, DataLoader, runner and optimizer."""

    def __init__(self, ctx, cfg, factory, data, index, method: str, cost, *, options=None, recompute="auto"):
        import torch

        from ..pipeline import PipelineRunner, RunnerConfig

        self.cfg, self.method = cfg, method
        model = factory.fresh()
        options = options or cfg.options(PLANNER_METHOD.get(method, method))
        self.loader = bench_loader(cfg, data, index, cost, options=options, num_workers=cfg.loader_workers)
        self._it = iter(self.loader.steps())
        self.runner = PipelineRunner.from_model(model, ctx, [0, len(model.layers)],
                                                config=RunnerConfig(schedule="1f1b", recompute=recompute))
        self.optimizer = torch.optim.AdamW(self.runner.parameters(), lr=cfg.lr)
        self.rows: list[dict] = []

    def step(self) -> dict | None:
        """Train the next global batch; its row (None at the end of the data)."""
        import torch

        from ..pipeline import batch_shapes

        t0 = time.perf_counter()
        mbs = next(self._it, None)
        data_s = time.perf_counter() - t0
        if mbs is None:
            return None
        cuda = self.cfg.cuda
        if cuda:
            sync(self.cfg.device)
            torch.cuda.reset_peak_memory_stats(self.cfg.device)
        before = torch.cuda.memory_allocated(self.cfg.device) if cuda else 0
        t0 = time.perf_counter()
        res = self.runner.step(batch_shapes(mbs, self.loader.collation), mbs, optimizer=self.optimizer)
        sync(self.cfg.device)
        wall = time.perf_counter() - t0
        plan_opts = (mbs.plan.options if getattr(mbs, "plan", None) is not None else None) or {}
        planned = plan_opts.get("stage_peak_bytes")
        planned = float(max(planned)) if planned else float(max(b["predicted_memory_bytes"] for b in mbs))
        row = {"loss": float(res.loss), "real_tokens": real_tokens(mbs), "microbatches": len(mbs), "step_s": wall,
               "data_s": data_s, "planned_activation_bytes": planned,
               "recompute_layers": int(res.timing.recompute_layers),
               "peak_saved_bytes": float(res.timing.peak_saved_bytes)}
        if cuda:
            peak = torch.cuda.max_memory_allocated(self.cfg.device)
            row.update(state_bytes=int(before), peak_bytes=int(peak), activation_bytes=int(peak - before))
        self.rows.append(row)
        return row

    def summary(self) -> dict:
        """Tokens/s, data-wait share and memory over the timed steps (closes the loader)."""
        self.loader.close()
        rows = self.rows
        if not rows:
            raise RuntimeError(f"bench gpu: {self.method} got no step from the data (too little data?)")
        timed = rows[min(self.cfg.warmup, len(rows) - 1):]
        toks = sum(r["real_tokens"] for r in timed)
        secs = sum(r["step_s"] for r in timed)
        data = sum(r["data_s"] for r in timed)
        out = {"steps": len(rows), "timed_steps": len(timed), "tokens_per_s": toks / secs if secs > 0 else 0.0,
               "data_wait_share": data / (data + secs) if data + secs > 0 else 0.0,
               "microbatches_per_step": float(np.mean([r["microbatches"] for r in rows])),
               "loss_start": rows[0]["loss"], "loss_end": rows[-1]["loss"],
               "planned_activation_bytes": max(r["planned_activation_bytes"] for r in rows),
               "mean_recompute_layers": float(np.mean([r["recompute_layers"] for r in rows])),
               "collation": self.loader.collation, "per_step": rows}
        if self.cfg.cuda:
            act = max(r["activation_bytes"] for r in rows)
            out.update(peak_bytes=max(r["peak_bytes"] for r in rows), state_bytes=max(r["state_bytes"] for r in rows),
                       activation_bytes=act, activation_over_planned=act / out["planned_activation_bytes"])
        else:
            out.update(peak_bytes=SKIP_NO_CUDA, activation_bytes=SKIP_NO_CUDA)
        return out


def _interleave(arms: dict, steps: int, tick=None) -> None:
    names = list(arms)
    done: set = set()
    for k in range(steps):
        for m in names[k % len(names):] + names[:k % len(names)]:
            if m not in done and arms[m].step() is None:
                done.add(m)
            if tick is not None:
                tick()


def train_section(ctx, cfg, factory, data, index, cost, *, tick=None) -> dict:
    """Every method of `GPU_METHODS` on the same global batches, interleaved (module docstring)."""
    arms = {m: Arm(ctx, cfg, factory, data, index, m, cost) for m in GPU_METHODS}
    _interleave(arms, cfg.steps, tick)
    methods = {m: a.summary() for m, a in arms.items()}
    del arms
    pack = methods["pack"]["tokens_per_s"]
    for m in methods.values():
        m["ratio_to_pack"] = m["tokens_per_s"] / pack if pack > 0 else float("nan")
    return {"methods": methods, "data_wait_target": 0.02,
            "data_wait_ok": all(m["data_wait_share"] <= 0.02 for m in methods.values())}


def recompute_section(ctx, cfg, factory, data, index, cost, planned_peak: float, *, tick=None) -> dict:
    """``dp`` adaptive under an activation limit vs full recomputation (module docstring)."""
    from ..core.cost import CostModel
    from ..pipeline import measured_stage_memory
    from ..pipeline.models import MicroBatchShape

    limit = cfg.recompute_fraction * planned_peak
    cost = CostModel.from_dict(cost.to_dict())  # its own memory model; the training section's stays as it was
    model = factory.fresh()
    shapes = [MicroBatchShape("padded", r, L, 0) for r in cfg.profile_rows for L in cfg.profile_lengths
              if r * L <= cfg.global_batch_tokens]  # the profile's grid (a micro-batch is at most a global batch)
    cost.stage_memory_model = measured_stage_memory(model, [0, len(model.layers)], cost, shapes=shapes,
                                                    device=cfg.device)
    del model
    arms = {}
    for policy in ("adaptive", "full"):
        opts = cfg.options("dp").replace(recompute=policy, device_memory_limit=limit)
        arms[policy] = Arm(ctx, cfg, factory, data, index, "dp", cost, options=opts,
                           recompute="auto" if policy == "adaptive" else "full")
    _interleave(arms, cfg.recompute_steps, tick)
    out = {p: a.summary() for p, a in arms.items()}
    del arms
    ada, full = out["adaptive"], out["full"]
    saved = max(r["peak_saved_bytes"] for r in ada["per_step"])  # metered by the runner on any device
    res = {"activation_limit_bytes": limit, "fraction_of_dp_peak": cfg.recompute_fraction, "variants": out,
           "planned_activation_bytes": ada["planned_activation_bytes"], "measured_saved_bytes": saved,
           "saved_within_limit": bool(saved <= limit),
           "step_time_vs_full": (full["tokens_per_s"] / ada["tokens_per_s"]) if ada["tokens_per_s"] > 0 else None}
    if cfg.cuda:
        device_limit = ada["state_bytes"] + limit
        res.update(device_limit_bytes=device_limit, max_memory_allocated=ada["peak_bytes"],
                   fits=bool(ada["peak_bytes"] <= device_limit))
    else:
        res.update(device_limit_bytes=SKIP_NO_CUDA, max_memory_allocated=SKIP_NO_CUDA, fits=SKIP_NO_CUDA)
    return res
