"""Baselines (pack, pack_varlen, token_budget, Karmarkar-Karp, ...) and `split_global_batches`."""

from __future__ import annotations

import numpy as np
import pytest

from dynabatch import Shapes
from dynabatch.core.plan import baselines as bl
from dynabatch.core.cost.model import CostModel
from dynabatch.core.plan.planner import plan_microbatches, split_global_batches


def groups_of(g: bl.Grouping):
    return [g.positions[g.offsets[k]:g.offsets[k + 1]] for k in range(len(g.offsets) - 1)]


def rows_of(g: bl.Grouping):
    """{(micro-batch, row): positions}"""
    out = {}
    for k in range(len(g.offsets) - 1):
        for q in range(g.offsets[k], g.offsets[k + 1]):
            out.setdefault((k, int(g.row[q])), []).append(int(g.positions[q]))
    return out


def assert_exactly_once(g: bl.Grouping, n: int, ranks: int):
    np.testing.assert_array_equal(np.sort(g.positions), np.arange(n))
    assert len(g.rank) == len(g.offsets) - 1
    assert np.all((g.rank >= 0) & (g.rank < ranks))
    assert np.all(np.diff(g.offsets) > 0)


def lengths(seed, n, lo=1, hi=2048):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.5, 1.0, n), lo, hi).astype(np.int64)


# ----------------------------------------------------------------------------- pack / pack_varlen


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_pack_rows_never_exceed_capacity(seed, rows):
    n, ranks, max_len, max_t = 150, 3, 2048, 256
    main = lengths(seed, n, hi=max_len)
    dec = np.random.default_rng(seed + 100).integers(0, max_t // 3, n)
    dec[::17] = max_t  # a few full decoder rows
    g = bl.pack(main, dec, ranks, rows=rows, max_len=max_len, max_target_len=max_t)
    assert_exactly_once(g, n, ranks)
    for (k, r), pos in rows_of(g).items():
        assert main[pos].sum() <= max_len, (k, r)
        assert dec[pos].sum() <= max_t, (k, r)
    for k, grp in enumerate(groups_of(g)):
        local = g.row[g.offsets[k]:g.offsets[k + 1]]
        assert local.min() == 0 and local.max() < rows
        # each rank packs its own DistributedSampler share
        assert np.all(grp % ranks == g.rank[k])
    # rows are actually shared: far fewer rows than samples
    assert len(rows_of(g)) < 0.6 * n


def test_pack_first_fit_leaves_at_most_one_row_half_empty_per_rank():
    main = lengths(7, 300, hi=1024)
    g = bl.pack(main, np.zeros_like(main), 2, rows=2, max_len=1024, max_target_len=0)
    half_empty = {}
    for (k, _), pos in rows_of(g).items():
        if main[pos].sum() <= 512:
            half_empty[int(g.rank[k])] = half_empty.get(int(g.rank[k]), 0) + 1
    assert all(v <= 1 for v in half_empty.values()), half_empty


def test_pack_truncates_an_overlong_sample_into_its_own_row():
    main = np.array([100, 5000, 200, 300])
    g = bl.pack(main, np.zeros(4, np.int64), 1, rows=8, max_len=1024, max_target_len=0)
    for pos in rows_of(g).values():
        if 1 in pos:
            assert pos == [1]


@pytest.mark.parametrize("seed", range(3))
def test_pack_varlen_rows_never_exceed_main_plus_decoder_capacity(seed):
    n, ranks, max_len, max_t = 150, 4, 1024, 256
    main = lengths(seed, n, hi=max_len)
    dec = np.random.default_rng(seed).integers(0, max_t + 1, n)
    g = bl.pack_varlen(main, dec, ranks, rows=2, max_len=max_len, max_target_len=max_t)
    assert_exactly_once(g, n, ranks)
    cap = max_len + max_t
    fills = [(main[pos] + dec[pos]).sum() for pos in rows_of(g).values()]
    assert max(fills) <= cap
    assert np.mean(fills) > 0.7 * cap  # best fit packs rows well


@pytest.mark.parametrize("method", ["pack", "pack_varlen"])
@pytest.mark.parametrize("preset", ["gpt", "t5"])
def test_planned_packs_respect_capacity(method, preset):
    cm = CostModel.preset(preset)
    rng = np.random.default_rng(3)
    n = 120
    inp = np.clip(rng.lognormal(6.0, 1.0, n), 1, 3000).astype(int)
    tgt = np.clip(rng.lognormal(4.0, 1.0, n), 1, 600).astype(int) if preset == "t5" else None
    sh = Shapes.from_lengths(inp, tgt, sample_id=np.arange(n) + 500)
    max_len, max_t = 2048, 256
    plan = plan_microbatches(sh, cm, num_stages=2, num_ranks=2, method=method, max_len=max_len,
                             max_target_len=max_t, memory_limit=1e15, method_options={"rows": 2})
    np.testing.assert_array_equal(np.sort(plan.sample_ids), sh.sample_id)
    main, dec, _ = cm.sample_dims(sh, max_len, max_t)
    by_id = {int(s): k for k, s in enumerate(sh.sample_id)}
    cap_main = max_len if method == "pack" else max_len + (max_t if preset == "t5" else 0)
    for k in range(plan.num_microbatches):
        a, b = plan.mb_offsets[k], plan.mb_offsets[k + 1]
        pos = np.array([by_id[int(s)] for s in plan.sample_ids[a:b]])
        rows = plan.sample_row[a:b]
        if method == "pack":
            assert plan.mb_rows[k] == rows.max() + 1 <= 2
        for r in np.unique(rows):
            sel = pos[rows == r]
            if method == "pack":
                assert main[sel].sum() <= max_len and dec[sel].sum() <= max_t
            else:
                assert (main[sel] + dec[sel]).sum() <= cap_main


# ----------------------------------------------------------------------------- token_budget


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("max_tokens", [1024, 4096, 16384])
def test_token_budget_micro_batches_fit_the_budget(seed, max_tokens):
    n, ranks, pad = 200, 3, 8
    tokens = lengths(seed, n, hi=8192)
    g = bl.token_budget(tokens, ranks, max_tokens=max_tokens, pad_multiple=pad)
    assert_exactly_once(g, n, ranks)
    padded = -(-tokens // pad) * pad
    for k, grp in enumerate(groups_of(g)):
        assert np.all(grp % ranks == g.rank[k])
        need = len(grp) * padded[grp].max()
        assert need <= max_tokens or len(grp) == 1, (k, need)
    # greedy: a rank's next micro-batch (in length order) could not have taken one more sample
    for r in range(ranks):
        mine = [grp for k, grp in enumerate(groups_of(g)) if g.rank[k] == r]
        for cur, nxt in zip(mine, mine[1:]):
            assert padded[cur].max() <= padded[nxt].min()
            assert (len(cur) + 1) * padded[nxt[0]] > max_tokens


def test_token_budget_through_the_planner():
    cm = CostModel.preset("gpt")
    tok = lengths(5, 300, hi=6000)
    tok[::50] = 5000  # oversized: alone in their micro-batch
    sh = Shapes.from_lengths(tok)
    plan = plan_microbatches(sh, cm, num_stages=2, num_ranks=4, method="token_budget",
                             method_options={"max_tokens": 4096}, memory_limit=1e15)
    single = plan.mb_rows == 1
    assert np.all((plan.mb_rows * plan.mb_input_len <= 4096) | single)
    assert np.any(single & (plan.mb_input_len > 4096))  # the oversized samples go alone
    np.testing.assert_array_equal(plan.mb_tokens, plan.mb_rows * plan.mb_input_len)


# ----------------------------------------------------------------------------- Karmarkar-Karp


def spread(weights, parts):
    sums = [weights[p].sum() for p in parts]
    return max(sums) - min(sums)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_karmarkar_karp_equal_size_is_balanced(seed, k):
    rng = np.random.default_rng(seed)
    n = k * int(rng.integers(16, 33))  # LDM can lose to luck on a handful of items
    w = rng.lognormal(5.0, 1.0, n).round()
    parts = bl.karmarkar_karp(w, k, equal_size=True)
    assert len(parts) == k
    assert [len(p) for p in parts] == [n // k] * k
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(n))
    round_robin = [np.arange(r, n, k) for r in range(k)]
    assert spread(w, parts) <= spread(w, round_robin)
    assert spread(w, parts) <= w.max()  # differencing never leaves a gap above the largest item


@pytest.mark.parametrize("seed", range(5))
def test_karmarkar_karp_unequal_size(seed):
    rng = np.random.default_rng(seed)
    w = rng.lognormal(5.0, 1.0, 37).round()
    parts = bl.karmarkar_karp(w, 5, equal_size=False)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(37))
    assert spread(w, parts) <= w.max()
    assert spread(w, parts) <= spread(w, [np.arange(r, 37, 5) for r in range(5)])


def test_karmarkar_karp_rejects_bad_arguments():
    with pytest.raises(ValueError, match="divisible"):
        bl.karmarkar_karp(np.ones(7), 2, equal_size=True)
    with pytest.raises(ValueError):
        bl.karmarkar_karp(np.ones(4), 0, equal_size=False)


@pytest.mark.parametrize("n,ranks", [(64, 4), (23, 7), (10, 3)])
def test_kk_baseline_covers_and_balances_ranks(n, ranks):
    tokens = lengths(n, n)
    g = bl.kk(tokens, ranks, max_tokens=2048)
    assert_exactly_once(g, n, ranks)
    per_rank = np.array([tokens[g.positions[g.offsets[k]:g.offsets[k + 1]]].sum() for k in range(len(g.rank))])
    sums = np.bincount(g.rank, weights=per_rank, minlength=ranks)
    assert sums.max() - sums.min() <= tokens.max()
    for r in range(ranks):
        m = int((g.rank == r).sum())
        share = int(sum(len(grp) for k, grp in enumerate(groups_of(g)) if g.rank[k] == r))
        assert 1 <= m <= min(int(np.ceil(sums[r] / 2048)), share)
    # equal shares: n // ranks samples each, the remainder one each on the lightest ranks
    share_sizes = np.bincount(g.rank, weights=np.diff(g.offsets), minlength=ranks)
    assert share_sizes.min() >= n // ranks and share_sizes.max() <= n // ranks + 1


# ----------------------------------------------------------------------------- other groupings


@pytest.mark.parametrize("fn", ["pad", "group_by_length"])
def test_fixed_row_baselines(fn):
    tokens = lengths(1, 103)
    g = getattr(bl, fn)(tokens, 4, rows=8)
    assert_exactly_once(g, 103, 4)
    sizes = np.diff(g.offsets)
    assert sizes.max() == 8 and np.all(sizes <= 8)
    if fn == "pad":
        for k, grp in enumerate(groups_of(g)):
            assert np.all(grp % 4 == g.rank[k])  # DistributedSampler shares
            assert np.all(np.diff(grp) > 0)  # arrival order
    else:
        np.testing.assert_array_equal(g.rank, np.arange(len(g.rank)) % 4)


def test_rebalance_equalizes_cost():
    cm = CostModel.preset("gpt")
    tokens = lengths(2, 400, hi=4096)
    own, _ = cm.padded(1, tokens)
    g = bl.rebalance(tokens, own, 4, microbatches_per_rank=4)
    assert_exactly_once(g, 400, 4)
    assert len(g.rank) == 16
    cost = np.array([own[grp].sum() for grp in groups_of(g)])
    assert cost.max() <= cost.mean() + own.max()


# ----------------------------------------------------------------------------- split_global_batches


def heavy_shapes(seed=0, n=500):
    rng = np.random.default_rng(seed)
    return Shapes.from_lengths(np.clip(rng.lognormal(6.0, 1.2, n), 1, 32768).astype(int),
                               sample_id=np.arange(n) * 2 + 1)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("budget", [1, 3000, 8192, 10**9])
def test_split_global_batches_covers_every_sample_once(seed, budget):
    sh = heavy_shapes(seed)
    parts = split_global_batches(sh, budget, seed=seed)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(sh)))
    assert all(len(p) for p in parts)
    tok = sh.total_tokens
    # the running total reaches a multiple of the budget at the end of every batch but the last
    cum = np.cumsum([tok[p].sum() for p in parts])
    assert np.all(cum[:-1] >= budget * np.arange(1, len(parts)))
    if budget == 10**9:
        assert len(parts) == 1
    if budget == 1:
        assert len(parts) == len(sh)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("budget", [100, 8192, 50_000])
def test_split_global_batches_every_batch_but_last_reaches_budget(seed, budget):
    """Regression: cuts used to sit at global multiples of the budget, so a batch after an
    overshooting one could be far short (about half the batches for this data and 8192)."""
    sh = heavy_shapes(seed)
    parts = split_global_batches(sh, budget, seed=seed)
    tok = sh.total_tokens
    sums = np.array([tok[p].sum() for p in parts])
    assert np.all(sums[:-1] >= budget), sums
    # greedy: each batch closes with the sample that reaches the budget, not later
    assert all(tok[p[:-1]].sum() < budget for p in parts[:-1])
    assert sums[-1] > 0


def test_split_global_batches_small_repro():
    """Tokens 90,20,90,20,90 with a budget of 100 gave batches [180, 20, 110] (seed 0)."""
    tok = np.array([90, 20, 90, 20, 90])
    sh = Shapes.from_lengths(tok)
    parts = split_global_batches(sh, 100, seed=0)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(5))
    sums = [int(tok[p].sum()) for p in parts]
    assert sum(sums) == 310
    assert min(sums[:-1]) >= 100, sums


def test_split_global_batches_is_seeded():
    sh = heavy_shapes(1)
    a = split_global_batches(sh, 8192, seed=11)
    b = split_global_batches(sh, 8192, seed=11)
    c = split_global_batches(sh, 8192, seed=12)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    assert len(a) != len(c) or not all(np.array_equal(x, y) for x, y in zip(a, c))
    # a batch is a random sample, not a contiguous run of the input
    assert any(np.any(np.diff(np.sort(p)) > 1) for p in a)


def test_split_global_batches_options():
    sh = heavy_shapes(2, 200)
    tok = np.ones(200, np.int64)
    parts = split_global_batches(sh, 32, seed=0, tokens=tok)  # count samples instead of tokens
    assert [len(p) for p in parts] == [32] * 6 + [8]
    parts = split_global_batches(sh, 32, seed=0, tokens=tok, drop_last=True)
    assert [len(p) for p in parts] == [32] * 6
    parts = split_global_batches(sh, 40, seed=0, tokens=tok, drop_last=True)
    assert [len(p) for p in parts] == [40] * 5  # an exact last batch is kept
    assert split_global_batches(sh.take(np.zeros(0, np.int64)), 10) == []
    with pytest.raises(ValueError):
        split_global_batches(sh, 0)
    with pytest.raises(ValueError):
        split_global_batches(sh, 10, tokens=np.ones(5))
