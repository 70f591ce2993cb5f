"""K models on one data pass (`dynabatch.pipeline.MultiModelRunner`, `dynabatch.core.simulate.multimodel`).

Torch-free parts: the shard orders and the residency kernel against their plain-Python references,
deadlock-freedom of the K-model communication programs under NCCL FIFO semantics, the simulator's
K-model vs sequential makespans. In-process: `ShardStore` spills and loads bit for bit and measures
the bytes it holds. Multi-process (gloo, workers in this file, run by `launch_local`): K = 3 gpt-tiny
models with different learning rates trained together are bit-identical to each trained alone by
`PipelineRunner`, with and without a budget that forces spilling, the measured resident bytes never
pass the budget, a budget below one shard is a clear error, a failing shard stops every rank, and
300 steps finish (liveness timeouts only).
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the workers run this file by path
from test_pipeline_dist import ok  # noqa: E402
from test_pipeline_workers import replica_batches, synthetic_plan  # noqa: E402

from dynabatch.core.simulate.multimodel import (  # noqa: E402
    active_peak,
    active_peak_reference,
    lrtf_order,
    multimodel_orders,
    simulate_multimodel,
)
from dynabatch.core.kernels.op_tables import multimodel_table, multimodel_table_reference  # noqa: E402
from dynabatch.core.simulate.pipeline import simulate_pipeline  # noqa: E402
from dynabatch.pipeline import launch_local  # noqa: E402
from dynabatch.pipeline.runtime.schedule import build_programs, check_programs  # noqa: E402

GPT = dict(vocab=64, hidden=16, layers=4, heads=2, max_positions=128)
BOUNDS = [0, 3, 6]
LRS = (1e-2, 3e-3, 3e-2)


# --------------------------------------------------------------------------- torch-free


def _grid():
    for S in (1, 2, 3, 4):
        for K in (1, 2, 3, 4):
            for M in (1, 2, 3, 5):
                for inter in (True, False):
                    yield S, K, M, inter


def test_orders_match_reference_and_keep_each_models_order():
    """Kernel == reference; every stage lists every op once; each model's forwards and backwards run
    in ascending micro-batch order on every stage (what makes the gradients bit-identical)."""
    for S, K, M, inter in _grid():
        ops = multimodel_orders(S, K, M, interleave=inter)
        table = multimodel_table(S, K, M, inter)
        assert [[tuple(r) for r in row] for row in table.tolist()] == multimodel_table_reference(S, K, M, inter)
        assert all(table[s, i, 3] == (table[s, i, 1] // M) for s in range(S) for i in range(2 * K * M))  # the model
        for s in range(S):
            row = ops[s].tolist()
            assert sorted(row) == sorted(list(range(1, K * M + 1)) + [-v for v in range(1, K * M + 1)])
            for p in range(K):
                f = [op - 1 - p * M for op in row if op > 0 and (op - 1) // M == p]
                b = [-op - 1 - p * M for op in row if op < 0 and (-op - 1) // M == p]
                assert f == list(range(M)) and b == list(range(M)), (S, K, M, inter, s, p)


def test_programs_of_k_models_cannot_deadlock():
    """The communication programs of the K-model orders run to completion under strict one-queue
    NCCL semantics, whatever the witness times."""
    rng = np.random.default_rng(0)
    for S, K, M, inter in _grid():
        units = rng.integers(1, 17, K * M)
        check_programs(build_programs(multimodel_orders(S, K, M, interleave=inter), units))


def test_active_peak_matches_reference():
    rng = np.random.default_rng(1)
    for S, K, M, inter in _grid():
        ops = multimodel_orders(S, K, M, interleave=inter)
        for s in range(S):
            for late in (False, True):
                sb = rng.choice([1.0, 2.0, 5.0], K)
                assert active_peak(ops[s], M, sb, updates_at_end=late) == \
                    active_peak_reference(ops[s].tolist(), M, sb.tolist(), late)
    for _ in range(200):  # arbitrary permutations too
        K, M = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        row = rng.permutation(np.concatenate([np.arange(1, K * M + 1), -np.arange(1, K * M + 1)])).astype(np.int32)
        sb = rng.integers(1, 100, K).astype(float)  # whole bytes: both sum exactly
        assert active_peak(row, M, sb) == active_peak_reference(row.tolist(), M, sb.tolist(), False)


def test_active_peak_known_values():
    """2 stages, 3 models of 10 bytes: interleaved stage 0 holds 2 at a model change, the last stage 1;
    model after model holds 1 everywhere."""
    sb = np.full(3, 10.0)
    inter = multimodel_orders(2, 3, 4, interleave=True)
    seq = multimodel_orders(2, 3, 4, interleave=False)
    assert active_peak(inter[0], 4, sb) == (20.0, 2)
    assert active_peak(inter[1], 4, sb) == (10.0, 1)
    assert active_peak(seq[0], 4, sb) == (10.0, 1)


def test_lrtf_order():
    assert lrtf_order([1.0, 3.0, 3.0, 2.0]).tolist() == [1, 2, 3, 0]
    with pytest.raises(ValueError):
        lrtf_order([])


def test_simulator_k_models_vs_sequential():
    """Uniform times (forward 1 s, backward 2 s): one 1F1B model takes (M + S - 1) x 3 s; K models
    together (KM + S - 1) x 3 s; model after model is exactly the K sequential runs."""
    S, M, K = 4, 6, 3
    f, b = np.ones((K, M)), 2 * np.ones((K, M))
    sim = simulate_multimodel(f, b, num_stages=S)
    assert sim.model_makespan_s.tolist() == [(M + S - 1) * 3.0] * K
    assert sim.sequential_s == K * (M + S - 1) * 3.0
    assert sim.makespan_s == (K * M + S - 1) * 3.0
    assert sim.speedup > 1.0
    seq = simulate_multimodel(f, b, num_stages=S, interleave=False)
    assert seq.makespan_s == seq.sequential_s
    one = simulate_multimodel(f[:1], b[:1], num_stages=S)
    assert one.makespan_s == simulate_pipeline(f[0], b[0], num_stages=S).makespan_s


def test_simulator_lrtf_puts_the_longest_model_first_and_beats_the_reverse():
    """Models of different sizes with heterogeneous micro-batches and per-stage times: LRTF orders them
    longest first, the makespan lies between the lower bound and the sequential sum, and it is no
    worse than the opposite order on this example."""
    rng = np.random.default_rng(3)
    S, M = 3, 5
    base = rng.uniform(0.5, 2.0, (S, M))
    scale = np.array([1.0, 3.0, 2.0])
    f = scale[:, None, None] * base[None]
    sim = simulate_multimodel(f, 2 * f)
    assert sim.order.tolist() == [1, 2, 0]
    assert sim.lower_bound_s - 1e-9 <= sim.makespan_s < sim.sequential_s
    rev = simulate_multimodel(f, 2 * f, order=[0, 2, 1])
    assert sim.makespan_s <= rev.makespan_s + 1e-9


# --------------------------------------------------------------------------- ShardStore, in process


def _linear_shards(n=3, opt="adamw"):
    torch.manual_seed(0)
    mods = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)) for _ in range(n)]
    if opt == "adamw":
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in mods]
    else:
        opts = [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in mods]
    return mods, opts


def _train_once(mods, opts):
    for m, o in zip(mods, opts):
        m(torch.ones(2, 8)).square().sum().backward()
        o.step()


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_shard_bytes_predicted_before_the_state_exists_equal_measured(opt):
    from dynabatch.pipeline.runtime.multimodel import shard_bytes

    mods, opts = _linear_shards(1, opt)
    before = shard_bytes(mods[0], opts[0], "cpu")
    _train_once(mods, opts)
    after = shard_bytes(mods[0], opts[0], "cpu")
    assert before == after
    pb = sum(p.numel() * 4 for p in mods[0].parameters())
    n = len(list(mods[0].parameters()))
    assert before == ((pb, pb, 2 * pb + 4 * n) if opt == "adamw" else (pb, pb, pb))


def test_shard_store_spills_and_loads_bit_for_bit_and_measures_bytes():
    from dynabatch.pipeline.runtime.multimodel import ShardStore

    mods, opts = _linear_shards(3)
    _train_once(mods, opts)
    for m in mods:
        for p in m.parameters():
            p.grad = None
    before = [[p.detach().clone() for p in m.parameters()] for m in mods]
    state = [{id(p): {n: t.clone() for n, t in o.state[p].items()} for p in m.parameters()} for m, o in zip(mods, opts)]
    store = ShardStore(mods, opts, "cpu")
    one = sum(p.numel() * 4 * 3 + 4 for p in mods[0].parameters())  # params + exp_avg + exp_avg_sq + step
    assert store.resident_bytes() == 3 * one
    store.spill(1)
    assert store.resident_bytes() == 2 * one and not store.resident[1]
    assert all(p.numel() == 0 for p in mods[1].parameters())
    store.load(1)
    assert store.resident_bytes() == 3 * one
    for m, o, b, st in zip(mods, opts, before, state):
        for p, q in zip(m.parameters(), b):
            assert torch.equal(p, q)
            for n, t in o.state[p].items():
                assert torch.equal(t, st[id(p)][n])
    # the spilled-and-loaded shard trains on exactly as the others would
    _train_once(mods, opts)


def test_shard_store_budget():
    from dynabatch.pipeline.runtime.multimodel import ShardStore, shard_bytes

    mods, opts = _linear_shards(3)
    full = sum(shard_bytes(mods[0], opts[0], "cpu"))
    with pytest.raises(ValueError, match=rf"shard 0 needs {full} bytes on cpu \(parameters .* but the device "
                                         rf"memory budget is {full - 1} bytes"):
        ShardStore(mods, opts, "cpu", budget_bytes=full - 1)
    store = ShardStore(mods, opts, "cpu", budget_bytes=2 * full)
    assert store.resident == [True, True, False] and store.spills == 1  # started within the budget
    assert store.make_room(full, keep={0, 1}, next_use={}) is False
    assert store.make_room(full, keep={0}, next_use={0: 0, 1: 5}) and store.resident == [True, False, False]
    store.load(2)
    assert store.resident_bytes() <= store.budget


# --------------------------------------------------------------------------- multi-process workers


def _data(model, steps, seed, mbs=(2, 4), max_len=24):
    """``steps`` synthetic one-replica steps: (plan, micro-batch dicts, real target tokens)."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(steps):
        plan = synthetic_plan(rng, collation="padded", num_ranks=1, num_stages=2, mbs=mbs, max_len=max_len, step=k)
        bs = replica_batches(model, plan, 0, seed=1000 * seed + k)
        out.append((plan, bs, sum(int((b["labels"][:, 1:] != -100).sum()) for b in bs)))
    return out


def _multi(ctx, K, factor, interleave, recorder=None, lrs=LRS, gpt=GPT, bounds=BOUNDS):
    """K fresh gpt-tiny models (``gpt``, seeds 1..K, cut at ``bounds``) with AdamW at ``lrs``; budget
    ``factor`` x the largest shard of this stage (None: unlimited)."""
    from dynabatch.pipeline import PipelineRunner, RunnerConfig, make_model
    from dynabatch.pipeline.runtime.multimodel import MultiModelRunner, shard_bytes

    models = [make_model("gpt-tiny", **gpt, seed=1 + k) for k in range(K)]
    runners = [PipelineRunner.from_model(m, ctx, bounds, RunnerConfig(schedule="1f1b")) for m in models]
    opts = [torch.optim.AdamW(r.parameters(), lr=lrs[k], eps=1e-4) for k, r in enumerate(runners)]
    budget = None if factor is None else \
        int(factor * max(sum(shard_bytes(r.stage, o, ctx.device)) for r, o in zip(runners, opts)))
    return models, MultiModelRunner(runners, opts, memory_budget_bytes=budget, interleave=interleave,
                                    recorder=recorder)


def identity_worker(rank, world, port, K, steps, configs):
    """Train K models alone with `PipelineRunner` (1F1B), then together under each ``configs`` entry
    ``[budget factor or None, interleave, pass num_tokens]``; report whether every model's stage
    parameters and losses are bit-identical, and the measured residency."""
    from dynabatch.pipeline.runtime import CommRecorder
    from dynabatch.pipeline import PipelineRunner, RunnerConfig, init_pipeline, make_model

    ctx = init_pipeline(2, rank=rank, world_size=world, master_port=port, timeout_s=60, abort_after_s=10)
    out = {"configs": []}
    with ctx:
        data = _data(make_model("gpt-tiny", **GPT, seed=1), steps, seed=5)
        alone_w, alone_l = [], []
        for k in range(K):
            m = make_model("gpt-tiny", **GPT, seed=1 + k)
            r = PipelineRunner.from_model(m, ctx, BOUNDS, RunnerConfig(schedule="1f1b"))
            o = torch.optim.AdamW(r.parameters(), lr=LRS[k], eps=1e-4)
            alone_l.append([r.step(p, bs, optimizer=o).loss for p, bs, _ in data])
            alone_w.append([t.detach().clone() for t in r.stage.parameters()])
        for factor, interleave, early in configs:
            rec = CommRecorder()
            _, multi = _multi(ctx, K, factor, interleave, rec)
            peaks, spills, loads, pre, losses = [], 0, 0, 0, [[] for _ in range(K)]
            for p, bs, n in data:
                res = multi.step(p, bs, num_tokens=n if early else None)
                peaks.append(res.peak_resident_bytes)
                spills, loads, pre = spills + res.spills, loads + res.loads, pre + res.prefetches
                for k in range(K):
                    losses[k].append(res.results[k].loss)
                    assert res.results[k].num_tokens == n
            for k in range(K):  # everything back on the device to compare
                multi.store.make_room(multi.store.full_bytes(k), {k}, {})
                multi.store.load(k)
                got = list(multi.runners[k].stage.parameters())
                same = all(torch.equal(a, b) for a, b in zip(got, alone_w[k]))
                diff = max(float((a - b).abs().max()) for a, b in zip(got, alone_w[k]))
                out["configs"].append({"k": k, "cfg": [factor, interleave, early], "same": same, "diff": diff,
                                       "loss_same": losses[k] == alone_l[k]})
            out.setdefault("res", []).append({"cfg": [factor, interleave, early], "peak": max(peaks),
                                              "budget": multi.store.budget, "spills": spills, "loads": loads,
                                              "prefetches": pre,
                                              "comm": {str(p): v for p, v in rec.per_peer().items()}})
    return out


def _stage_shard_bytes(stage_index):
    """(param bytes, tensors) of gpt-tiny stage ``stage_index`` cut at BOUNDS, in this process."""
    from dynabatch.pipeline import make_model, split_model

    st = split_model(make_model("gpt-tiny", **GPT, seed=1).layers, BOUNDS)[stage_index]
    ps = list(st.parameters())
    return sum(p.numel() * p.element_size() for p in ps), len(ps)


def test_three_models_together_are_bit_identical_to_each_alone():
    """K = 3 gpt-tiny (different seeds and learning rates), 2 gloo stages, 4 steps of 2-4 random-shape
    micro-batches: after training together every model's parameters and per-step losses are
    bit-identical to training it alone, with no budget (nothing moves), with a budget of two shards
    (spills and prefetches every step; interleaved; updates right after each model's last backward,
    or at the end of the step), and with one shard model after model. Measured resident bytes never
    pass the budget, and both ends of every link posted the same operations."""
    from dynabatch.pipeline.runtime import check_peer_sequences

    configs = [[None, True, True], [2.0, True, True], [2.0, True, False], [1.0, False, True]]
    res = ok(launch_local(f"{__file__}:identity_worker", 2, args=(3, 4, configs), idle_timeout_s=180))
    for r in res:
        for c in r["configs"]:
            assert c["same"], (c, r)
            assert c["loss_same"], c
        for x in r["res"]:
            factor = x["cfg"][0]
            if factor is None:
                assert x["spills"] == 0 and x["loads"] == 0
            else:
                assert x["peak"] <= x["budget"], x
                assert x["spills"] > 0 and x["loads"] > 0, x
    # the interleaved two-shard runs prefetched ahead of the turn on some stage
    assert any(x["prefetches"] > 0 for r in res for x in r["res"] if x["cfg"] == [2.0, True, True])
    for i in range(len(configs)):
        check_peer_sequences({rank: {int(p): seq for p, seq in res[rank]["res"][i]["comm"].items()}
                              for rank in range(2)})


def budget_worker(rank, world, port, factors, interleave):
    """Build the K = 3 runner with budget ``factors[rank]`` x the largest shard of its stage and train
    two steps (the errors under test happen before the first transfer)."""
    from dynabatch.pipeline import init_pipeline

    ctx = init_pipeline(2, rank=rank, world_size=world, master_port=port, timeout_s=20, abort_after_s=3)
    with ctx:
        models, multi = _multi(ctx, 3, factors[rank], interleave)
        for p, bs, n in _data(models[0], 2, seed=2):
            multi.step(p, bs, num_tokens=n)
    return {"finished": True}


def test_budget_smaller_than_one_shard_is_a_clear_error():
    """Rank 0's budget is half its shard: it raises a ValueError naming the shard and its bytes; the
    other rank stops with PipelineAborted naming rank 0's error."""
    pb, n = _stage_shard_bytes(0)
    full = pb + pb + 2 * pb + 4 * n  # parameters + gradients + AdamW's two moments + step scalars
    res = launch_local(f"{__file__}:budget_worker", 2, args=([0.5, None], True), idle_timeout_s=60)
    for r in res:
        assert not r.timed_out and r.returncode != 0, r.stderr[-2000:]
    assert (f"ValueError: model 0 stage 0 (rank 0) needs {full} bytes on cpu (parameters {pb} + gradients {pb} + "
            f"optimizer state {full - 2 * pb}) but the device memory budget is {full // 2} bytes") in res[0].stderr, \
        res[0].stderr[-2000:]
    assert "PipelineAborted: rank 0 (stage 0, replica 0) failed: ValueError: model 0 stage 0" in res[1].stderr, \
        res[1].stderr[-2000:]


def test_interleaving_needs_two_shards_on_all_but_the_last_stage():
    """One shard of budget: the interleaved order is refused on stage 0 (it holds two models at a
    model change) before any transfer; model after model trains with the same budget."""
    res = launch_local(f"{__file__}:budget_worker", 2, args=([1.0, 1.0], True), idle_timeout_s=60)
    for r in res:
        assert not r.timed_out and r.returncode != 0, r.stderr[-2000:]
    assert "stage 0 (rank 0) must hold 2 shards at once under the interleaved order" in res[0].stderr
    assert "or use interleave=False" in res[0].stderr
    assert "PipelineAborted: rank 0 (stage 0, replica 0) failed: ValueError" in res[1].stderr
    ok(launch_local(f"{__file__}:budget_worker", 2, args=([1.0, 1.0], False), idle_timeout_s=60))


def failing_worker(rank, world, port, fail_rank, fail_model, fail_step):
    """K = 3 with a two-shard budget; ``fail_rank`` raises in the forward of model ``fail_model``'s
    stage at step ``fail_step``."""
    from dynabatch.pipeline import init_pipeline

    ctx = init_pipeline(2, rank=rank, world_size=world, master_port=port, timeout_s=20, abort_after_s=3)
    with ctx:
        models, multi = _multi(ctx, 3, 2.0, True)
        state = {"step": 0}

        def boom(module, args):
            if rank == fail_rank and state["step"] == fail_step:
                raise ValueError(f"boom in model {fail_model} on rank {rank} at step {fail_step}")

        multi.runners[fail_model].stage.layers[-1].register_forward_pre_hook(boom)
        for k, (p, bs, n) in enumerate(_data(models[0], fail_step + 3, seed=4)):
            state["step"] = k
            multi.step(p, bs, num_tokens=n)
    return {"finished": True}


def test_failing_shard_stops_every_rank_with_its_error():
    res = launch_local(f"{__file__}:failing_worker", 2, args=(1, 1, 2), idle_timeout_s=60)
    for r in res:
        assert not r.timed_out, f"rank {r.rank} hung:\n{r.stderr[-2000:]}"
        assert r.returncode != 0
        assert "boom in model 1 on rank 1 at step 2" in r.stderr, r.stderr[-2000:]
    assert "ValueError" in res[1].stderr
    assert "rank 1 (stage 1, replica 0) failed: ValueError: boom in model 1" in res[0].stderr


# the soak's models: one block per stage instead of two (the runner's shard bookkeeping walks every
# tensor of every shard at each operation: most of a soak step's CPU); what the soak is for, shards
# moving in and out of the budget and the ranks' step orders varying, does not depend on the depth
SOAK_GPT, SOAK_BOUNDS = dict(GPT, layers=2), [0, 2, 4]


def soak_worker(rank, world, port, steps):
    """K = 3 (`SOAK_GPT`), two-shard budget, ``steps`` small steps (1-2 micro-batches), alternating the
    update placement; returns the losses of model 0 and the moves."""
    from dynabatch.pipeline import init_pipeline
    from dynabatch.pipeline.runtime.launch import heartbeat

    ctx = init_pipeline(2, rank=rank, world_size=world, master_port=port, timeout_s=30, abort_after_s=5)
    losses, spills, peak_ok = [], 0, True
    with ctx:
        models, multi = _multi(ctx, 3, 2.0, True, gpt=SOAK_GPT, bounds=SOAK_BOUNDS)
        for k, (p, bs, n) in enumerate(_data(models[0], steps, seed=9, mbs=(1, 2), max_len=8)):
            res = multi.step(p, bs, num_tokens=n if k % 2 else None)
            losses.append(res.results[0].loss)
            spills += res.spills
            peak_ok &= res.peak_resident_bytes <= res.budget_bytes
            heartbeat()
    return {"losses": losses, "spills": spills, "peak_ok": bool(peak_ok)}


def test_three_hundred_steps_do_not_hang():
    """300 small steps of three models over two shards, the update placement alternating: its length is
    the point. A spill that leaves a model's shard or a stale buffer behind shows only after many moves
    of shards in and out of the budget, and a hang between the two ranks only once their step orders
    have varied enough; both ranks' losses stay finite and equal, shards did spill, and the resident
    bytes never passed the budget. The models have one block per stage (`SOAK_GPT`: 30% less CPU than two,
    measured, with the same 899 and 1049 spills on the two ranks)."""
    res = ok(launch_local(f"{__file__}:soak_worker", 2, args=(300,), idle_timeout_s=90))
    for r in res:
        assert len(r["losses"]) == 300 and np.all(np.isfinite(r["losses"]))
        assert r["spills"] > 0 and r["peak_ok"]
    assert res[0]["losses"] == res[1]["losses"]


def refit_worker(rank, world, port, steps_before, steps_after):
    """Two architectures (gpt-tiny hidden 16 with 4 blocks, hidden 128 with 6), each with its own cut, with equal
    ``time_scale``: train, refit the scale from measured times, train on; report the orders and
    whether both models equal training each alone. (`from_models` without a scale takes the
    parameter-count ratio: checked first.)"""
    from dynabatch.pipeline import PipelineRunner, RunnerConfig, init_pipeline, make_model
    from dynabatch.pipeline.runtime.multimodel import MultiModelRunner

    cfgs = [dict(GPT), dict(GPT, hidden=128, heads=4, layers=6)]
    ctx = init_pipeline(2, rank=rank, world_size=world, master_port=port, timeout_s=60, abort_after_s=10)
    with ctx:
        data = _data(make_model("gpt-tiny", **GPT, seed=1), steps_before + steps_after, seed=6, mbs=(3, 4),
                     max_len=24)
        cuts = [BOUNDS, [0, 3, 8]]  # each model its own cut (and depth)
        alone = []
        for k, c in enumerate(cfgs):
            r = PipelineRunner.from_model(make_model("gpt-tiny", **c, seed=1 + k), ctx, cuts[k],
                                          RunnerConfig(schedule="1f1b"))
            o = torch.optim.AdamW(r.parameters(), lr=LRS[k], eps=1e-4)
            for p, bs, _ in data:
                r.step(p, bs, optimizer=o)
            alone.append([t.detach().clone() for t in r.stage.parameters()])
        models = [make_model("gpt-tiny", **c, seed=1 + k) for k, c in enumerate(cfgs)]
        sizes = [sum(p.numel() for layer in m.layers for p in layer.parameters()) for m in models]
        default = MultiModelRunner.from_models(models, ctx, cuts, lambda ps, k: torch.optim.SGD(ps, lr=0.1))
        default_scale = default.time_scale.tolist()
        assert default_scale == [sizes[0] / sizes[1], 1.0] and default.order(np.ones(3)).tolist() == [1, 0]
        models = [make_model("gpt-tiny", **c, seed=1 + k) for k, c in enumerate(cfgs)]
        multi = MultiModelRunner.from_models(models, ctx, cuts,
                                             lambda ps, k: torch.optim.AdamW(ps, lr=LRS[k], eps=1e-4),
                                             time_scale=[1.0, 1.0])
        orders, done = [], []
        for i, (p, bs, n) in enumerate(data):
            if i == steps_before:
                scale = multi.refit_time_scale(done).tolist()
            res = multi.step(p, bs, num_tokens=n)
            done.append(res)
            orders.append(list(res.order))
        same = [all(torch.equal(a, b) for a, b in zip(multi.runners[k].stage.parameters(), alone[k]))
                for k in range(2)]
    return {"orders": orders, "scale": scale, "same": same}


def test_refit_from_measured_times_reorders_mixed_architectures():
    """gpt-tiny with hidden 16 (4 blocks) and hidden 128 (6 blocks, another cut) trained together:
    with equal scales the LRTF order is by index; after the refit from measured shard times (the
    same figures on every rank) the larger model has the larger scale and goes first, the ranks
    agree, and both models stay bit-identical to training alone."""
    res = ok(launch_local(f"{__file__}:refit_worker", 2, args=(3, 3), idle_timeout_s=180))
    for r in res:
        assert r["orders"][:3] == [[0, 1]] * 3 and r["orders"][3:] == [[1, 0]] * 3, r["orders"]
        assert r["scale"][1] == 1.0 and r["scale"][0] < 1.0
        assert r["same"] == [True, True]
    assert res[0]["scale"] == res[1]["scale"]


def feedback_worker(rank, world, port, steps):
    """gpt-tiny hidden 16 and 128 together with ``refit_every=2`` and ``gather_timing``: every step's
    result goes to a per-stage `FeedbackLoop`; report the orders, scales and what the loop observed."""
    from types import SimpleNamespace

    from dynabatch import CostModel
    from dynabatch.core.plan.feedback import FeedbackLoop
    from dynabatch.pipeline import init_pipeline, make_model
    from dynabatch.pipeline.runtime.multimodel import MultiModelRunner

    cfgs = [dict(GPT), {**GPT, "hidden": 128, "heads": 4}]
    ctx = init_pipeline(2, rank=rank, world_size=world, master_port=port, timeout_s=60, abort_after_s=10)
    with ctx:
        data = _data(make_model("gpt-tiny", **GPT, seed=1), steps, seed=11, mbs=(3, 3))
        models = [make_model("gpt-tiny", **c, seed=1 + k) for k, c in enumerate(cfgs)]
        multi = MultiModelRunner.from_models(models, ctx, [BOUNDS, BOUNDS],
                                             lambda ps, k: torch.optim.SGD(ps, lr=0.01), time_scale=[1.0, 1.0],
                                             gather_timing=True, refit_every=2)
        loop = FeedbackLoop(CostModel.preset("gpt", "cpu", num_stages=2), stage_reduce="per_stage", refit_every=100)
        rows = []
        for i, (p, bs, n) in enumerate(data):
            res = multi.step(p, bs, num_tokens=n)
            loop.record_step(SimpleNamespace(plan=p, step=i), res)
            obs = loop.last
            meas = {(t.stage, k): np.asarray(t.compute_s) for k, r in enumerate(res.results) for t in r.all_timings}
            want = np.concatenate([meas[(st, k)] / res.time_scale[k] for k in range(2) for st in (0, 1)])
            rows.append({"order": list(res.order), "scale": list(res.time_scale), "n_obs": len(obs.measured_s),
                         "m": p.num_microbatches, "y_ok": bool(np.allclose(np.sort(obs.measured_s), np.sort(want))),
                         "after": multi.time_scale.tolist(),
                         "model_s": [float(np.sum(r.timing.forward_s) + np.sum(r.timing.backward_s))
                                     for r in res.results]})
    return rows


def test_refit_every_and_feedback_take_every_models_measured_times():
    """``refit_every=2``: the scales used by steps 0-1 are the given [1, 1]; from step 2 on they are the
    measured ones (each model's forward+backward seconds of steps 0-1 summed over the ranks, over the
    largest, 3 digits), the same on every rank, and the slower model goes first; a `FeedbackLoop`
    records a multi-model result as K observations per micro-batch and stage, each model's measured
    seconds divided by the scale its step used. (Which model measures slower is the machine's: the
    larger one, unless load says otherwise, so the scale is checked against the measured seconds.)"""
    res = ok(launch_local(f"{__file__}:feedback_worker", 2, args=(4,), idle_timeout_s=180))
    total = np.sum([r["model_s"] for rows in res for r in rows[:2]], axis=0)
    want = [max(float(f"{x:.3g}"), 1e-3) for x in total / total.max()]
    slow_first = sorted(range(2), key=lambda k: -want[k])
    for rows in res:
        assert [r["scale"] for r in rows[:2]] == [[1.0, 1.0]] * 2
        assert rows[0]["order"] == [0, 1] and rows[2]["scale"] == want, rows
        assert all(r["order"] == slow_first for r in rows[2:]), rows
        assert min(want) < 1.0 == max(want)
        assert rows[1]["after"] == rows[2]["scale"]  # the refit ran after step 1, before step 2's order
        assert rows[2]["after"] == rows[2]["scale"]  # no refit after step 2 (a window of one step)
        for r in rows:
            assert r["n_obs"] == 2 * 2 * r["m"] and r["y_ok"], r
    assert [r["scale"] for r in res[0]] == [r["scale"] for r in res[1]]


def test_a_schedule_other_than_1f1b_is_refused_naming_what_runs():
    """MultiModelRunner's order is 1F1B over the models' virtual micro-batches (`multimodel_ops`): a runner
    configured for another schedule is an error that names the supported one, not a silent 1F1B."""
    from types import SimpleNamespace

    from dynabatch.pipeline.runtime.config import RunnerConfig
    from dynabatch.pipeline.runtime.multimodel import MultiModelRunner

    ctx = SimpleNamespace(num_replicas=1, stage=0, rank=0)
    runners = [SimpleNamespace(ctx=ctx, bypass=None, config=RunnerConfig(schedule=s)) for s in ("1f1b", "zb-h1")]
    with pytest.raises(ValueError, match=r"schedule='zb-h1'.*use '1f1b'"):
        MultiModelRunner(runners, [None, None])
