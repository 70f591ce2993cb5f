"""Stage partition search: simulated makespan, exhaustive vs local search, profiled layer costs."""

import itertools

import numpy as np
import pytest
import torch

from dynabatch.pipeline.models import LayerCosts, MicroBatchShape, gpt_tiny, partition_makespan, uniform_partition
from dynabatch.pipeline import balanced_partition, profile_layers, sequential_step, split_model


def skewed_costs(light=6, heavy=6, M=6, seed=0):
    """OmniBal's vision-language shape: a cheap embedding, light vision-tower-like blocks, heavy
    LLM-like blocks and a sizeable head; forward cost proportional to each micro-batch's tokens."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(64, 512, M).astype(float)
    per_layer = np.array([0.2] + [0.5] * light + [2.0] * heavy + [1.5])
    fwd = per_layer[:, None] * tokens[None, :] * 1e-5
    return LayerCosts(fwd, 2 * fwd)


def test_balanced_beats_uniform_when_costs_are_skewed():
    costs = skewed_costs()
    for S in (2, 3, 4):
        bal = balanced_partition(costs, S)
        uni = uniform_partition(costs, S)
        assert bal.makespan_s < 0.95 * uni.makespan_s, (S, bal, uni)
        assert bal.makespan_s == pytest.approx(partition_makespan(costs, bal.bounds))
        assert max(bal.stage_busy_s) < max(uni.stage_busy_s)


def test_exhaustive_search_is_optimal():
    costs = skewed_costs(light=3, heavy=3, M=4, seed=1)
    n = costs.num_layers
    best = min(partition_makespan(costs, (0, *c, n)) for c in itertools.combinations(range(1, n), 2))
    assert balanced_partition(costs, 3).makespan_s == pytest.approx(best)


def test_local_search_on_large_models():
    """Too many partitions to enumerate: the min-max start plus boundary moves still beats uniform
    and comes within a few percent of the exhaustive optimum."""
    costs = skewed_costs(light=10, heavy=10, M=5, seed=2)
    S = 6
    local = balanced_partition(costs, S, exhaustive_limit=1)
    exact = balanced_partition(costs, S, exhaustive_limit=10**6)  # all 20,349 partitions
    assert local.makespan_s < uniform_partition(costs, S).makespan_s
    assert local.makespan_s <= 1.05 * exact.makespan_s
    assert len(local.bounds) == S + 1 and all(b > a for a, b in zip(local.bounds[:-1], local.bounds[1:]))


def test_bad_bounds_are_rejected():
    costs = skewed_costs()
    with pytest.raises(ValueError):
        partition_makespan(costs, (0, 3, 3, costs.num_layers))
    with pytest.raises(ValueError):
        balanced_partition(costs, costs.num_layers + 1)


def test_profiled_split_runs_like_the_whole_model():
    """Profile gpt-tiny's layers on sample micro-batches, split at the searched bounds: the stages
    chained equal the whole model, and the layer profile is positive and grows with tokens."""
    model = gpt_tiny(vocab=2048, hidden=32, layers=3, heads=2, seed=0)  # big vocabulary: heavy head
    gen = torch.Generator().manual_seed(0)
    batches = [model.random_batch(MicroBatchShape("padded", r, L), gen) for r, L in ((1, 16), (4, 64), (8, 128))]
    costs = profile_layers(model.layers, batches, repeats=2)
    assert costs.forward_s.shape == (5, 3) and np.all(costs.forward_s > 0) and np.all(costs.backward_s > 0)
    assert np.all(costs.memory_bytes[:, 2] > costs.memory_bytes[:, 0])  # more tokens, more activations
    part = balanced_partition(costs, 2)
    stages = split_model(model.layers, part)
    assert [s.is_first for s in stages] == [True, False] and [s.is_last for s in stages] == [False, True]
    b = batches[1]
    loss_whole, n = sequential_step(model.layers, [b])
    x = stages[0](None, b)
    loss_split, n2 = stages[1](x, b)
    assert int(n2) == n and float(loss_split.detach()) / n == pytest.approx(loss_whole, rel=1e-6)
