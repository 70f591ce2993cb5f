"""``dynabatch bench gpu``, many-models section: two copies of the bench's Llama model (learning rates
``lr`` and ``0.3 x lr``) trained together on one GPU by `dynabatch.pipeline.MultiModelRunner` under
a shard budget of 1.5 shards, so that one model's shard (weights, gradients, AdamW state) is spilled
to pinned host memory and loaded back on a side stream every step.

Arms, on the same ``dp`` loader steps (materialized once), one step each in turn:

* ``spilling``: the runner with the budget;
* ``resident``: the same runner without a budget (both shards stay on the device);
* ``alone``: each model trained by its own `PipelineRunner`.

Reported: the spilling arm's moved bytes, copy seconds and whether its host copies are pinned; on
CUDA the share of the copy time hidden behind compute, ``1 - (spilling - resident step time) /
copy time alone`` where the copy time alone is the moved bytes over the pinned host-to-device
bandwidth measured here; and whether both runners' models end bit-identical to training each
alone (deterministic algorithms on, so that a difference is the runner's, not the kernels').
"""

from __future__ import annotations

import time

import numpy as np

from .gpu_setup import SKIP_NO_CUDA, bench_loader, sync

LR_FACTORS = (1.0, 0.3)


def _bandwidth(device: str, nbytes: int = 256 << 20) -> float:
    """Pinned host-to-device copy bandwidth (bytes/s) on a side stream, best of three."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    best = float("inf")
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            dev.copy_(host, non_blocking=True)
        stream.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def _shard_bytes(model) -> int:
    """Bytes of one shard once trained with AdamW: weights, gradients and two moments."""
    return 4 * sum(p.numel() * p.element_size() for layer in model.layers for p in layer.parameters())


def _identical(a, b) -> bool:
    """Every tensor of ``a`` equals its partner in ``b`` bit for bit (and the counts match)."""
    import torch

    return len(a) == len(b) and all(torch.equal(x.detach().cpu(), y.detach().cpu()) for x, y in zip(a, b))


def multimodel_section(ctx, cfg, factory, data, index, cost, *, tick=None) -> dict:
    """Run the section (module docstring)."""
    import torch

    from ..pipeline import MultiModelRunner, PipelineRunner, RunnerConfig, batch_shapes

    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        loader = bench_loader(cfg, data, index, cost)
        try:
            steps = [s for s, _ in zip(loader.steps(), range(cfg.multimodel_steps))]
            collation = loader.collation
        finally:
            loader.close()

        def optimizer(params, k):
            return torch.optim.AdamW(params, lr=cfg.lr * LR_FACTORS[k])

        config = RunnerConfig(schedule="1f1b")
        models = {arm: [factory.fresh() for _ in LR_FACTORS] for arm in ("spilling", "resident", "alone")}
        n = len(models["alone"][0].layers)
        budget = 1.5 * _shard_bytes(models["alone"][0])
        multi = {"spilling": MultiModelRunner.from_models(models["spilling"], ctx, [0, n], optimizer, config=config,
                                                          memory_budget_bytes=budget),
                 "resident": MultiModelRunner.from_models(models["resident"], ctx, [0, n], optimizer, config=config)}
        alone = [PipelineRunner.from_model(m, ctx, [0, n], config=config) for m in models["alone"]]
        alone_opt = [optimizer(r.parameters(), k) for k, r in enumerate(alone)]
        secs = {"spilling": [], "resident": [], "alone": []}
        results, pinned = [], []
        for mbs in steps:
            shapes = batch_shapes(mbs, collation)
            for arm, runner in multi.items():
                sync(cfg.device)
                t0 = time.perf_counter()
                res = runner.step(shapes, mbs)
                sync(cfg.device)
                secs[arm].append(time.perf_counter() - t0)
                if arm == "spilling":  # the spilled shard's host copies, while it is spilled
                    results.append(res)
                    pinned += [t.is_pinned() for h in runner.store.host if h is not None for t in h["params"]]
            sync(cfg.device)
            t0 = time.perf_counter()
            for r, o in zip(alone, alone_opt):
                r.step(shapes, mbs, optimizer=o)
            sync(cfg.device)
            secs["alone"].append(time.perf_counter() - t0)
            if tick is not None:
                tick()
        for runner in multi.values():  # every shard back on the device before comparing
            for k in range(len(LR_FACTORS)):
                runner.store.load(k)
                runner.store.ready(k)
        sync(cfg.device)
        ref = [list(r.parameters()) for r in alone]
        identical = {arm: all(_identical(list(r.parameters()), ref[k]) for k, r in enumerate(runner.runners))
                     for arm, runner in multi.items()}
    finally:
        torch.use_deterministic_algorithms(deterministic)
    moved = int(sum(r.moved_bytes for r in results))
    copy_s = float(sum(r.copy_s for r in results))
    w = 1 if len(steps) > 1 else 0  # the first step warms up (allocations, kernels)
    step_s = {arm: float(np.mean(v[w:])) for arm, v in secs.items()}
    out = {"models": len(LR_FACTORS), "steps": len(steps), "budget_bytes": budget,
           "shard_bytes": _shard_bytes(models["alone"][0]), "spills": int(sum(r.spills for r in results)),
           "loads": int(sum(r.loads for r in results)), "prefetches": int(sum(r.prefetches for r in results)),
           "moved_bytes": moved, "copy_issue_s": copy_s, "step_s": step_s,
           "bit_identical_to_alone": identical}
    if cfg.cuda:
        bw = _bandwidth(cfg.device)
        copy_alone = moved / max(len(steps), 1) / bw
        exposed = max(0.0, step_s["spilling"] - step_s["resident"])
        out.update(pinned_host_copies=bool(pinned) and all(pinned), h2d_bandwidth_bytes_per_s=bw,
                   copy_s_per_step=copy_alone,
                   hidden_copy_share=float(np.clip(1.0 - exposed / copy_alone, 0.0, 1.0)) if copy_alone > 0 else None)
    else:
        out.update(pinned_host_copies=SKIP_NO_CUDA, h2d_bandwidth_bytes_per_s=SKIP_NO_CUDA,
                   copy_s_per_step=SKIP_NO_CUDA, hidden_copy_share=SKIP_NO_CUDA)
    return out
