"""Shard spill and load times in the K-model simulator (`simulate_multimodel(..., budget_bytes=...)`).

No budget gives the old results exactly; free copies or a budget that holds every shard give the
no-spill makespan; a hand-computed step (K = 2, S = 1, M = 2); a prefetch hides a load behind a
longer window and stalls by exactly the difference behind a shorter one; the timing kernel equals
its plain-Python reference on random instances (exactly: same float operations in the same
order); clear errors for bad shapes and budgets; and the simulator's moves per step are the
runner's (`MultiModelRunner` on one in-process stage, steady state).
"""

import socket
import sys
from pathlib import Path

import numpy as np
import pytest

from dynabatch.core.kernels.spill import (
    DEMAND_LOAD,
    DEMAND_SPILL,
    PREFETCH_LOAD,
    PREFETCH_SPILL,
    pack_copies,
    spill_timing_kernel,
    spill_timing_reference,
)
from dynabatch.core.simulate.multimodel import active_peak, multimodel_orders, simulate_multimodel, virtual_times
from dynabatch.core.simulate.spill import copy_plan
from dynabatch.core.simulate.pipeline import simulate_pipeline

TIMES = np.array([0.25, 0.5, 1.0, 1.0, 2.0, 3.5])  # seconds, with ties


def _instance(rng, K, S, M):
    f = rng.choice(TIMES, (K, S, M)) * rng.choice([1.0, 0.3], (K, 1, 1))
    return f, f * rng.choice([1.0, 2.0], f.shape)


def _peak_budget(ops, M, sizes, order, early):
    """The smallest budget per stage that the order runs under (bytes)."""
    return np.array([active_peak(ops[s], M, sizes[order, s], updates_at_end=not early)[0] for s in range(len(ops))])


def test_no_budget_gives_the_old_results_exactly():
    rng = np.random.default_rng(0)
    for K, S, M, inter in [(1, 1, 1, True), (3, 2, 4, True), (4, 3, 2, False), (2, 4, 5, True)]:
        f, b = _instance(rng, K, S, M)
        sim = simulate_multimodel(f, b, p2p_s=0.125, interleave=inter)
        ops = multimodel_orders(S, K, M, interleave=inter)
        old = simulate_pipeline(virtual_times(f, sim.order), virtual_times(b, sim.order), schedule=ops,
                                p2p_s=np.full(K * M, 0.125))
        alone = [simulate_pipeline(f[k], b[k], schedule="1f1b", p2p_s=0.125).makespan_s for k in range(K)]
        assert sim.makespan_s == old.makespan_s and sim.lower_bound_s == old.lower_bound_s
        assert sim.sequential_s == sum(alone) and sim.model_makespan_s.tolist() == alone
        assert np.array_equal(sim.ops, ops)
        for field in (sim.load_s, sim.stall_s, sim.loads, sim.spills, sim.prefetches):
            assert field.shape == (S,) and not field.any()
        # shard sizes and a bandwidth without a budget change nothing either
        same = simulate_multimodel(f, b, p2p_s=0.125, interleave=inter, shard_bytes=np.ones(K), load_bytes_per_s=1.0)
        assert same.makespan_s == sim.makespan_s and not same.loads.any()


@pytest.mark.parametrize("early", [True, False])
def test_free_copies_and_a_budget_of_every_shard_give_the_no_spill_makespan(early):
    rng = np.random.default_rng(1)
    for K, S, M, inter in [(2, 1, 2, True), (3, 2, 3, True), (4, 3, 2, False), (4, 2, 4, True), (3, 4, 1, False)]:
        f, b = _instance(rng, K, S, M)
        sizes = rng.integers(1, 5, (K, S)) * 1e6
        base = simulate_multimodel(f, b, p2p_s=0.05, interleave=inter)
        ops = multimodel_orders(S, K, M, interleave=inter)
        tight = _peak_budget(ops, M, sizes, base.order, early)
        free = simulate_multimodel(f, b, p2p_s=0.05, interleave=inter, shard_bytes=sizes, budget_bytes=tight,
                                   load_bytes_per_s=np.inf, updates_at_end=not early)
        assert free.makespan_s == base.makespan_s and not free.stall_s.any() and not free.load_s.any()
        if K > 1 and sizes.sum(axis=0).max() > tight.max():
            assert free.loads.sum() > 0  # the budget did force moves; they just cost nothing
        every = simulate_multimodel(f, b, p2p_s=0.05, interleave=inter, shard_bytes=sizes,
                                    budget_bytes=sizes.sum(axis=0), load_bytes_per_s=1e6, updates_at_end=not early)
        assert every.makespan_s == base.makespan_s
        assert not (every.loads.any() or every.spills.any() or every.load_s.any() or every.stall_s.any())
        slow = simulate_multimodel(f, b, p2p_s=0.05, interleave=inter, shard_bytes=sizes, budget_bytes=tight,
                                   load_bytes_per_s=1e7, updates_at_end=not early)
        assert slow.makespan_s >= base.makespan_s and slow.sequential_s == base.sequential_s
        assert np.all(slow.loads >= slow.prefetches) and np.all(slow.stall_s <= slow.load_s + 1e-9)


def test_hand_computed_step():
    """K = 2, S = 1, M = 2, one shard fits. Model 0 (F 1 s, B 2 s) before model 1 (F 0.5 s, B 1 s);
    100-byte shards, loads at 50 B/s (2 s), spills at 100 B/s (1 s). Steady state: model 1 is
    resident at the start, so the step spills it (0-1 s) and loads model 0 (1-3 s): F0 3-4, B0 4-6,
    F1 6-7, B1 7-9; model 1's turn at 9 spills model 0 (9-10), loads model 1 (10-12): F 12-12.5,
    B -13.5, F -14, B -15. Nothing can be prefetched (one shard at a time)."""
    f = np.array([[1.0, 1.0], [0.5, 0.5]])
    sim = simulate_multimodel(f, 2 * f, num_stages=1, shard_bytes=[100, 100], budget_bytes=100,
                              load_bytes_per_s=50, spill_bytes_per_s=100)
    assert sim.order.tolist() == [0, 1]
    assert simulate_multimodel(f, 2 * f, num_stages=1).makespan_s == 9.0
    assert sim.makespan_s == 15.0
    assert sim.stall_s.tolist() == [6.0] and sim.load_s.tolist() == [6.0]
    assert sim.loads.tolist() == [2] and sim.spills.tolist() == [2] and sim.prefetches.tolist() == [0]
    same_rate = simulate_multimodel(f, 2 * f, num_stages=1, shard_bytes=[100, 100], budget_bytes=100,
                                    load_bytes_per_s=50)
    assert same_rate.makespan_s == 17.0 and same_rate.stall_s.tolist() == [8.0]  # spills cost 2 s too


@pytest.mark.parametrize("load_s", [0.5, 1.0, 2.0, 2.5, 3.0, 4.0, 7.25])
def test_prefetch_hides_a_load_behind_a_longer_window_and_stalls_by_the_difference(load_s):
    """S = 1, K = 3 in order a, b, c, M = 1, two shards fit, free spills. Each step a is loaded at its
    turn (a full stall: c was kept, b was prefetched during a); c is prefetched when b starts, so it
    waits only for what b's window (F 1 s + B 2 s = 3 s) does not cover."""
    f = np.array([[1.0], [1.0], [1.0]])
    sim = simulate_multimodel(f, 2 * f, num_stages=1, order=[0, 1, 2], shard_bytes=[8.0, 8.0, 8.0],
                              budget_bytes=16.0, load_bytes_per_s=8.0 / load_s, spill_bytes_per_s=np.inf)
    window = 3.0
    stall = load_s + max(0.0, load_s - window)
    assert sim.loads.tolist() == [2] and sim.prefetches.tolist() == [1] and sim.spills.tolist() == [2]
    assert sim.stall_s[0] == pytest.approx(stall, abs=1e-12)
    assert sim.makespan_s == pytest.approx(9.0 + stall, abs=1e-12)
    assert sim.load_s[0] == pytest.approx(2 * load_s, abs=1e-12)


def _random_copies(rng, S, N, K, L):
    """Random copy lists in issue order (any uses, kinds, shards, durations with ties and zeros)."""
    out = []
    for _ in range(S):
        cs = []
        for use in sorted(rng.choice(2 * N + L, size=rng.integers(0, 2 * N + L + 1), replace=False)):
            for phase in sorted(rng.choice(2, size=rng.integers(1, 3), replace=False)):
                for _ in range(rng.integers(1, 3)):
                    cs.append((int(use), int(2 * phase + rng.integers(0, 2)), int(rng.integers(0, K)),
                               float(rng.choice([0.0, 0.25, 1.0, 1.5, rng.uniform(0, 3)]))))
        out.append(cs)
    return out


def _kernel(vf, vb, vp, ops, M, upd, copies):
    S, N = vf.shape
    ncopy, cuse, ckind, cshard, cdur = pack_copies(copies)
    start, end = np.empty((S, N, 2)), np.empty((S, N, 2))
    upd_t, cstart, cend, stall = np.empty(upd.shape), np.empty(cdur.shape), np.empty(cdur.shape), np.empty(S)
    code = spill_timing_kernel(vf, vb, vp, ops, M, upd, ncopy, cuse, ckind, cshard, cdur, start, end, upd_t, cstart,
                               cend, stall)
    times = [list(zip(cstart[s, :ncopy[s]].tolist(), cend[s, :ncopy[s]].tolist())) for s in range(S)]
    return code, start, end, upd_t, times, stall.tolist()


def test_timing_kernel_matches_reference_on_random_instances():
    rng = np.random.default_rng(7)
    planned = stalled = 0
    for trial in range(300):
        K, S, M = (int(x) for x in rng.integers(1, 5, 3))
        inter, late = bool(rng.integers(2)), bool(rng.integers(2))
        order = rng.permutation(K)
        ops = multimodel_orders(S, K, M, interleave=inter)
        f, b = _instance(rng, K, S, M)
        vf, vb = virtual_times(f, order), virtual_times(b, order)
        vp = np.tile(rng.choice([0.0, 0.1, 0.5], M), K)
        if trial % 2:  # the simulator's own plan: the runner's moves under a random budget and bandwidths
            sizes = rng.choice([1.0, 2.0, 3.0], (K, S)) * 1e6
            peak = _peak_budget(ops, M, sizes, order, not late)
            budget = np.maximum(peak, sizes.max(axis=0)) * rng.choice([1.0, 1.0, 1.5, 2.0])
            copies, upd = copy_plan(ops, order, M, sizes, budget, rng.choice([1e5, 1e6, 4e6, np.inf]),
                                    rng.choice([1e5, 1e6, np.inf]), late)
            planned += sum(map(len, copies))
        else:
            L = K if late else 0
            copies = _random_copies(rng, S, K * M, K, L)
            upd = rng.integers(0, K, (S, L)).astype(np.int64)
        code, start, end, upd_t, times, stall = _kernel(vf, vb, vp, ops, M, upd, copies)
        ref = spill_timing_reference(vf, vb, vp, ops, M, upd, copies)
        assert code == 0 and ref is not None
        r_start, r_end, r_upd, r_times, r_stall = ref
        assert np.array_equal(start, r_start) and np.array_equal(end, r_end), trial
        assert np.array_equal(upd_t, r_upd) and times == r_times and stall == r_stall, trial
        stalled += max(stall) > 0
        if not any(copies):
            plain = simulate_pipeline(vf, vb, schedule=ops, p2p_s=vp)
            assert np.array_equal(end, plain.end_s)
    assert planned > 100 and stalled > 100  # the plans did move shards, and ops did wait for them


def test_timing_kernel_rejects_malformed_input():
    rng = np.random.default_rng(3)
    K, S, M = 2, 2, 2
    ops = multimodel_orders(S, K, M, interleave=True)
    f, b = _instance(rng, K, S, M)
    vf, vb, vp = virtual_times(f, [0, 1]), virtual_times(b, [0, 1]), np.zeros(K * M)
    none = np.zeros((S, 0), np.int64)
    assert _kernel(vf, vb, vp, ops, M, none, [[], []])[0] == 0
    assert _kernel(vf, vb, vp, ops, 3, none, [[], []])[0] == 2                       # N not a multiple of M
    assert _kernel(vf, vb, vp, ops, M, none, [[(0, DEMAND_LOAD, 2, 1.0)], []])[0] == 2  # no shard 2
    assert _kernel(vf, vb, vp, ops, M, np.full((S, 1), 5, np.int64), [[], []])[0] == 2
    out_of_order = [[(3, PREFETCH_LOAD, 0, 1.0), (1, DEMAND_SPILL, 1, 1.0)], []]
    assert _kernel(vf, vb, vp, ops, M, none, out_of_order)[0] == 2                   # a copy never runs
    assert _kernel(vf, vb, vp, ops, M, none, [[(0, PREFETCH_SPILL, 1, 1.0)], []])[0] == 0
    bad = ops.copy()
    bad[0, 0] = 99
    assert _kernel(vf, vb, vp, bad, M, none, [[], []])[0] == 2


def test_clear_errors_for_bad_shapes_and_budgets():
    f = np.ones((3, 4))
    kw = dict(num_stages=2, shard_bytes=np.full((3, 2), 10.0), budget_bytes=30.0, load_bytes_per_s=1e3)
    simulate_multimodel(f, f, **kw)
    cases = [
        (dict(shard_bytes=np.ones((2, 2))), "shard_bytes must be"),
        (dict(shard_bytes=np.ones((3, 3))), "shard_bytes must be"),
        (dict(shard_bytes=[1.0, -1.0, 1.0]), "shard_bytes must be"),
        (dict(shard_bytes=[1.0, np.nan, 1.0]), "shard_bytes must be"),
        (dict(budget_bytes=[30.0, 30.0, 30.0]), "budget_bytes must be"),
        (dict(budget_bytes=0.0), "budget_bytes must be"),
        (dict(budget_bytes=np.nan), "budget_bytes must be"),
        (dict(shard_bytes=None), "needs shard_bytes"),
        (dict(load_bytes_per_s=None), "load_bytes_per_s"),
        (dict(load_bytes_per_s=0.0), "load_bytes_per_s must be"),
        (dict(load_bytes_per_s=[1e3, 1e3]), "load_bytes_per_s must be"),
        (dict(spill_bytes_per_s=-1.0), "spill_bytes_per_s must be"),
        (dict(spill_bytes_per_s=np.nan), "spill_bytes_per_s must be"),
        (dict(budget_bytes=[30.0, 5.0]), "model 0's stage 1 shard needs 10 bytes but stage 1's budget is 5"),
        (dict(budget_bytes=10.0), "stage 0 must hold 2 shards at once under the interleaved order"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            simulate_multimodel(f, f, **{**kw, **change})
    with pytest.raises(ValueError, match="use interleave=False"):
        simulate_multimodel(f, f, **{**kw, "budget_bytes": 10.0})
    one = simulate_multimodel(f, f, **{**kw, "budget_bytes": 10.0}, interleave=False)  # one shard at a time fits
    assert one.loads.tolist() == [3, 3]
    with pytest.raises(ValueError, match="shard_bytes must be"):  # checked without a budget too
        simulate_multimodel(f, f, num_stages=2, shard_bytes=np.ones(5))


# --------------------------------------------------------------------------- against the runner


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_moves_per_step_are_the_runners():
    """`MultiModelRunner` on one in-process gloo stage with K = 4 gpt-tiny models and a budget: from
    its second step on (the simulator times the steady state) its spills, loads and prefetches per
    step are the simulator's for the same order, shard bytes and budget."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_pipeline_workers import replica_batches, synthetic_plan

    from dynabatch.pipeline import PipelineRunner, RunnerConfig, init_pipeline, make_model
    from dynabatch.pipeline.runtime.multimodel import MultiModelRunner, shard_bytes

    gpt = dict(vocab=64, hidden=16, layers=4, heads=2, max_positions=128)
    K = 4
    with init_pipeline(1, rank=0, world_size=1, master_port=_port(), timeout_s=60) as ctx:
        for factor, inter, early in [(2.0, True, True), (2.5, False, False)]:
            models = [make_model("gpt-tiny", **gpt, seed=1 + k) for k in range(K)]
            runners = [PipelineRunner.from_model(m, ctx, [0, 6], RunnerConfig(schedule="1f1b")) for m in models]
            opts = [torch.optim.AdamW(r.parameters(), lr=1e-3) for r in runners]
            budget = int(factor * max(sum(shard_bytes(r.stage, o, ctx.device)) for r, o in zip(runners, opts)))
            multi = MultiModelRunner(runners, opts, memory_budget_bytes=budget, interleave=inter,
                                     time_scale=[1.0, 0.5, 0.8, 0.3])
            rng = np.random.default_rng(0)
            for step in range(3):
                plan = synthetic_plan(rng, collation="padded", num_ranks=1, num_stages=1, mbs=(2, 4), max_len=16,
                                      step=step)
                bs = replica_batches(models[0], plan, 0, seed=step)
                n = sum(int((x["labels"][:, 1:] != -100).sum()) for x in bs)
                res = multi.step(plan, bs, num_tokens=n if early else None)
                sim = simulate_multimodel(np.ones((K, len(bs))), np.ones((K, len(bs))), num_stages=1,
                                          order=list(res.order), interleave=inter,
                                          shard_bytes=[multi.store.full_bytes(k) for k in range(K)],
                                          budget_bytes=budget, load_bytes_per_s=1e9, updates_at_end=not early)
                if step:
                    assert (res.spills, res.loads, res.prefetches) == \
                        (int(sim.spills[0]), int(sim.loads[0]), int(sim.prefetches[0])), (factor, inter, early, step)
                assert res.loads > 0
