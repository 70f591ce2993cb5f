"""Flush-free (asynchronous) 1F1B in the runner (`PipelineRunner.run_steps` with
``RunnerConfig(flush=False)``): equal to the synchronous run where it must be, PipeDream's weight-version
semantics with ``stash``, every weight mode trains, 500 steps without a hang, failures still stop every
rank. Rank-side workers live in this file (`launch_local` runs them by path on gloo).

The selected tests' launches start in the background, two at a time, when the module's first test
begins (``tests/prelaunch.py``: the ranks leave the 2 cores partly idle while they wait on each
other), and the configurations of one topology (stages, bounds, ranks) run in one launch, one process
group, whichever tests ask for them; each test checks its own configurations' results exactly as
when it runs alone."""

import functools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the workers run this file by path
from prelaunch import Prelaunch, job, part  # noqa: E402
from test_pipeline_dist import ok  # noqa: E402
from test_pipeline_workers import replica_batches, synthetic_plan  # noqa: E402

from dynabatch.pipeline import launch_local  # noqa: E402
from dynabatch.loader.settings import records_from_keywords

GPT = dict(vocab=64, hidden=16, layers=4, heads=2, max_positions=128)
LAUNCHES = Prelaunch(parallel=2)
# the 500-step soaks: 1-2 micro-batches per step (a stream's cost is per micro-batch; the steps stay 500)
SOAK_MBS = (1, 2)


@pytest.fixture(scope="module", autouse=True)
def _launches(request):
    yield from LAUNCHES.started(request)


def _stream(model, num_stages, num_ranks, steps, seed, mbs=(2, 4)):
    """``steps`` synthetic steps: (plan, every replica's micro-batch dicts, global real target tokens)."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(steps):
        plan = synthetic_plan(rng, collation="padded", num_ranks=num_ranks, num_stages=num_stages, mbs=mbs, step=k,
                              equal=True)
        every = [replica_batches(model, plan, d, seed=1000 * seed + k) for d in range(num_ranks)]
        tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for bs in every for b in bs)
        out.append((plan, every, tokens))
    return out


def _optimizer(params, name):
    # eps 1e-4: a key bias's gradient is 0 up to rounding (softmax ignores it), and Adam with a tiny eps
    # would turn that rounding noise into lr-sized steps that differ between two exact computations
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-4)


def run_worker(rank, world, port, num_stages, bounds, configs):
    """For each ``(steps, window, mode, opt, lr_zero, seed[, mbs])`` of ``configs``, in one process group:
    train ``steps`` steps of ``mbs`` (default 2-4) micro-batches, synchronously (``mode`` "sync") or
    flush-free in windows of ``window`` steps with weight handling ``mode``; return the per-step losses
    and this stage's final weights of each."""
    from dynabatch.pipeline import PipelineRunner, RunnerConfig, init_pipeline, make_model

    ctx = init_pipeline(num_stages, rank=rank, world_size=world, master_port=port, timeout_s=60, abort_after_s=10)
    out = []
    with ctx:
        for steps, window, mode, opt, lr_zero, seed, *mbs in configs:
            model = make_model("gpt-tiny", **GPT, seed=1)
            cfg = RunnerConfig(schedule="1f1b", flush=mode == "sync",
                               weight_prediction=None if mode in ("sync", "none") else mode)
            runner = PipelineRunner.from_model(model, ctx, bounds, cfg)
            optim = _optimizer(runner.parameters(), opt)
            if lr_zero:
                for g in optim.param_groups:
                    g["lr"] = 0.0
            data = _stream(model, num_stages, ctx.num_replicas, steps, seed, *map(tuple, mbs))
            losses, extra = [], 0.0
            for a in range(0, steps, window):
                chunk = data[a:a + window]
                pairs = [(p, every[ctx.replica] if ctx.stage in (0, num_stages - 1) else None) for p, every, _ in chunk]
                res = runner.run_steps(pairs, optimizer=optim, num_tokens=[n for _, _, n in chunk])
                losses += [r.loss for r in res]
                extra = max(extra, res[-1].weight_extra_bytes or 0.0)
                assert [r.num_tokens for r in res] == [n for _, _, n in chunk]
            weights = [p.detach().double().flatten().tolist() for p in runner.stage.parameters()]
            out.append({"losses": losses, "weights": weights, "extra": extra, "stage": ctx.stage})
    return out


def _run_configs(num_stages, bounds, nprocs, configs):
    """One launch of `run_worker` on ``nprocs`` ranks: every rank's results, one list per config."""
    res = ok(launch_local(f"{__file__}:run_worker", nprocs, args=(num_stages, bounds, list(configs)),
                          idle_timeout_s=240.0))
    return [[r[i] for r in res] for i in range(len(configs))]


def launch(num_stages, bounds, configs, nprocs=2, weight=0.0):
    """``configs`` (as `run_worker` takes them) on ``nprocs`` ranks, as `prelaunch.Part` s of the launch
    of that topology (``weight``: about its seconds)."""
    run = functools.partial(_run_configs, num_stages, bounds, nprocs)
    return [part(("run_worker", num_stages, tuple(bounds), nprocs), c, run, weight / len(configs)) for c in configs]


def _run(parts):
    """Every rank's results of each part's config, one list per config."""
    return [LAUNCHES.result(p) for p in parts]


def _close(a, b, tol):
    return all(np.allclose(x, y, rtol=tol, atol=tol) for x, y in zip(a, b))


MODES = ("sync", "none", "stash", "predict")
ONE_STAGE_CONFIGS = [(6, 3, mode, opt, False, 0) for opt in ("sgd", "adamw") for mode in MODES]
ONE_STAGE = launch(1, [0, 6], ONE_STAGE_CONFIGS, nprocs=1, weight=4)


@LAUNCHES.plan(lambda: ONE_STAGE)
def test_one_stage_flush_free_equals_synchronous():
    """One stage: no micro-batch waits for an update, so the stream is the synchronous run, exactly."""
    modes, configs = MODES, ONE_STAGE_CONFIGS
    res = [r[0] for r in _run(ONE_STAGE)]
    for i in range(0, len(configs), len(modes)):
        sync = res[i]
        for mode, free in zip(modes[1:], res[i + 1:i + len(modes)]):
            assert free["losses"] == sync["losses"], (configs[i][3], mode)
            assert free["weights"] == sync["weights"], (configs[i][3], mode)


FROZEN = launch(2, [0, 3, 6], [(5, 5, "sync", "sgd", True, 1), (5, 5, "predict", "sgd", True, 1)], weight=5)
FROZEN_REPLICAS = launch(2, [0, 3, 6], [(3, 3, "sync", "adamw", True, 2), (3, 3, "stash", "adamw", True, 2)], nprocs=4,
                         weight=7)


@LAUNCHES.plan(lambda: FROZEN + FROZEN_REPLICAS)
def test_two_stages_with_frozen_weights_equal_synchronous():
    """lr = 0: the weight versions cannot differ, so losses and token normalization must equal the
    synchronous run's on 2 stages and on 2 stages x 2 replicas."""
    sync, free = _run(FROZEN)
    for a, b in zip(sync, free):
        assert np.allclose(a["losses"], b["losses"], rtol=1e-6)
    sync4, free4 = _run(FROZEN_REPLICAS)
    for a, b in zip(sync4, free4):
        assert np.allclose(a["losses"], b["losses"], rtol=1e-6)


def _reference_stash(bounds, steps, opt, seed):
    """One process, PipeDream semantics: micro-batch i runs forward and backward on stage s with the
    stage's weight version after the updates done before its forward there (`update_lag`), its
    step's gradient (every micro-batch, summed, / the step's tokens) updates the current weights."""
    from dynabatch.core.simulate.flushfree import update_lag
    from dynabatch.pipeline import make_model

    model = make_model("gpt-tiny", **GPT, seed=1)
    scratch = make_model("gpt-tiny", **GPT, seed=1)
    S = len(bounds) - 1
    stage_layers = [list(range(bounds[s], bounds[s + 1])) for s in range(S)]
    opts = [_optimizer([p for i in ls for p in model.layers[i].parameters()], opt) for ls in stage_layers]
    data = _stream(model, S, 1, steps, seed)
    mbs = [b for _, every, _ in data for b in every[0]]
    ends = np.cumsum([len(every[0]) for _, every, _ in data])
    lag = update_lag(ends, S)
    versions = [[[p.detach().clone() for i in ls for p in model.layers[i].parameters()]] for ls in stage_layers]
    k = 0
    for i, batch in enumerate(mbs):
        step = int(np.searchsorted(ends, i, side="right"))
        for s, ls in enumerate(stage_layers):
            before_b = step  # updates done before the backward of i on any stage
            v = before_b - int(lag[s, i])
            for p, w in zip((p for j in ls for p in scratch.layers[j].parameters()), versions[s][v]):
                p.data.copy_(w)
                p.grad = None
        x = batch
        for j, layer in enumerate(scratch.layers):
            x = layer(x) if j == 0 else (layer(x, batch) if j == len(scratch.layers) - 1 else layer(x))
        x[0].backward()
        for s, ls in enumerate(stage_layers):
            for p, q in zip((p for j in ls for p in model.layers[j].parameters()),
                            (q for j in ls for q in scratch.layers[j].parameters())):
                if q.grad is not None:
                    p.grad = q.grad.clone() if p.grad is None else p.grad + q.grad
        if i + 1 == ends[k]:
            for s, ls in enumerate(stage_layers):
                for p in (p for j in ls for p in model.layers[j].parameters()):
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad.div_(data[k][2])
                opts[s].step()
                for p in (p for j in ls for p in model.layers[j].parameters()):
                    p.grad = None
                versions[s].append([p.detach().clone() for j in ls for p in model.layers[j].parameters()])
            k += 1
    return [[p.detach().double().flatten().tolist() for j in ls for p in model.layers[j].parameters()]
            for ls in stage_layers]


STASH_OPTS = ("sgd", "adamw")
STASH = launch(2, [0, 3, 6], [(6, 6, mode, opt, False, 3) for opt in STASH_OPTS for mode in ("stash", "sync")],
               weight=6)


@LAUNCHES.plan(lambda: STASH)
def test_stash_follows_pipedream_weight_versions():
    """2 stages, stash: every micro-batch's forward and backward on a stage use the version its forward
    saw; the final weights equal a one-process replay of exactly those versions (SGD with momentum and
    AdamW), and differ from the synchronous run's (the stream really is asynchronous)."""
    opts = STASH_OPTS
    res = _run(STASH)
    for i, opt in enumerate(opts):
        free, sync = res[2 * i], res[2 * i + 1]
        ref = _reference_stash([0, 3, 6], 6, opt, 3)
        for r in free:
            assert _close(r["weights"], ref[r["stage"]], 2e-5), (opt, r["stage"])
        assert not all(_close(a["weights"], b["weights"], 1e-6) for a, b in zip(free, sync))


EVERY_MODE_RUNS = (("predict", 500, SOAK_MBS), ("none", 50, (2, 4)), ("stash", 50, (2, 4)))
EVERY_MODE = launch(4, [0, 2, 3, 4, 6], [(n, 50, mode, "adamw", False, 4, mbs) for mode, n, mbs in EVERY_MODE_RUNS],
                    nprocs=4, weight=20)


@LAUNCHES.plan(lambda: EVERY_MODE)
def test_every_mode_trains_on_four_stages_for_500_steps():
    """4 stages, 500 flush-free steps with prediction in windows of 50, and 50 steps with stale and
    stashed weights (no hang: the launcher's liveness timeout); the loss falls, and the memory each mode
    held is reported (none holds nothing, stash and predict hold copies). The 500 steps are the soak: ten
    streams of 50 steps one after the other on the same runner, optimizer and weight predictor (the whole
    launch ~32 CPU-s over its 4 ranks, measured alone)."""
    modes = [(mode, n) for mode, n, _ in EVERY_MODE_RUNS]
    res = _run(EVERY_MODE)
    held = {}
    for (mode, n), per_rank in zip(modes, res):
        losses = per_rank[0]["losses"]
        # random tokens: the loss can only fall towards their entropy, ln 64 = 4.16
        assert len(losses) == n and np.all(np.isfinite(losses)), mode
        assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.05, mode
        held[mode] = max(r["extra"] for r in per_rank)
    assert held["none"] == 0 and held["stash"] > 0 and held["predict"] > 0


TWO_STAGE_SOAK = launch(2, [0, 3, 6], [(500, 100, "predict", "adamw", False, 6, SOAK_MBS)], weight=8)


@LAUNCHES.plan(lambda: TWO_STAGE_SOAK)
def test_two_stages_stream_500_steps():
    """2 stages, 500 flush-free steps with prediction in windows of 100: no hang, finite falling losses,
    the same on both ranks (replicas are covered by the frozen-weights test). The length is the soak: five
    streams of 100 steps one after the other on the same runner, optimizer and weight predictor."""
    (res,) = _run(TWO_STAGE_SOAK)
    losses = res[0]["losses"]
    assert len(losses) == 500 and all(r["losses"] == losses for r in res)
    assert np.all(np.isfinite(losses)) and np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.05


def failing_worker(rank, world, port, fail_rank, fail_mb):
    """2 stages x 2 replicas, one flush-free stream of 4 steps; ``fail_rank`` raises in the forward of
    its ``fail_mb``-th micro-batch (in the middle of the stream, after an update)."""
    from dynabatch.pipeline import PipelineRunner, RunnerConfig, init_pipeline, make_model

    ctx = init_pipeline(2, rank=rank, world_size=world, master_port=port, timeout_s=20, abort_after_s=3)
    with ctx:
        model = make_model("gpt-tiny", **GPT, seed=1)
        runner = PipelineRunner.from_model(model, ctx, [0, 3, 6], RunnerConfig(flush=False, weight_prediction="predict"))
        calls = {"n": 0}

        def boom(module, args):
            calls["n"] += 1
            if rank == fail_rank and calls["n"] == fail_mb:
                raise ValueError(f"boom from rank {rank} in micro-batch {fail_mb}")

        runner.stage.layers[-1].register_forward_pre_hook(boom)
        data = _stream(model, 2, ctx.num_replicas, 4, 5)
        pairs = [(p, every[ctx.replica]) for p, every, _ in data]
        runner.run_steps(pairs, optimizer=torch.optim.AdamW(runner.parameters()), num_tokens=[n for *_, n in data])
    return {"finished": True}


FAILING = job("failing", launch_local, f"{__file__}:failing_worker", 4, args=(1, 6), idle_timeout_s=60, weight=8)


@LAUNCHES.plan(lambda: [FAILING])
def test_a_failing_rank_stops_every_rank_of_a_stream():
    res = LAUNCHES.result(FAILING)
    for r in res:
        assert not r.timed_out, f"rank {r.rank} hung:\n{r.stderr[-2000:]}"
        assert r.returncode != 0, f"rank {r.rank} exited 0"
        assert "boom from rank 1 in micro-batch 6" in r.stderr, f"rank {r.rank}:\n{r.stderr[-2000:]}"
    for r in (res[0], res[2], res[3]):
        assert "rank 1 (stage 1, replica 0) failed: ValueError" in r.stderr


def test_loader_resume_is_exact_when_steps_are_taken_by_windows():
    """A flush-free loop takes its loader's steps a window at a time (`run_steps`); the loader's state
    saved after a window resumes at the next window's first step exactly."""
    from dynabatch import DataLoader, datagen

    records = datagen.text_records(200, seed=7)
    kw = dict(tokenizer="bytes", global_batch_tokens=3000, max_len=256, num_stages=2, rank=0, world_size=1,
              seed=3, cost_model="gpt-tiny", progress=False)
    loader = DataLoader(records, **records_from_keywords(dict(**kw)))
    it = iter(loader)
    windows = [[next(it) for _ in range(3)] for _ in range(2)]
    state = loader.state_dict()
    rest = [next(it) for _ in range(3)]
    again = DataLoader(records, **records_from_keywords(dict(**kw)))
    again.load_state_dict(state)
    resumed = [s for _, s in zip(range(3), again)]
    ids = lambda steps: [[b["sample_ids"].tolist() for b in s] for s in steps]  # noqa: E731
    assert ids(resumed) == ids(rest)
    assert [s.target_tokens for s in resumed] == [s.target_tokens for s in rest]
    assert all(len(w) == 3 for w in windows)
