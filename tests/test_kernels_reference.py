"""Every numba kernel of the planner equals its plain-Python reference on random inputs."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch.core.kernels.assign import assign_ranks, assign_ranks_reference
from dynabatch.core.baselines import _budget_cuts, _pack_rows, budget_cuts_reference, pack_rows_reference
from dynabatch.core.plan import _greedy_cuts, greedy_cuts_reference

times_st = st.lists(st.floats(0.001, 10.0, allow_nan=False), min_size=1, max_size=24)


@settings(max_examples=80, deadline=None)
@given(times_st, st.integers(1, 5), st.integers(1, 6), st.booleans())
def test_assign_ranks_matches_reference(times, ranks, stages, equal):
    if equal:
        times = times[: len(times) - len(times) % ranks] or times[:1] * ranks
    t = np.array(times)
    got = assign_ranks(t, ranks, stages, equal).tolist()
    assert got == assign_ranks_reference(t, ranks, stages, equal)
    if equal:
        assert set(np.bincount(got, minlength=ranks)) == {len(t) // ranks}


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 60)), min_size=1, max_size=40), st.booleans(),
       st.integers(100, 400), st.integers(0, 80))
def test_pack_rows_matches_reference(samples, best_fit, cap_main, cap_dec):
    main = np.array([s[0] for s in samples], np.int64)
    dec = np.array([s[1] for s in samples], np.int64)
    order = np.argsort(-main, kind="stable")
    row, nrows = _pack_rows(order, main, dec, cap_main, cap_dec, best_fit)
    ref_row, ref_n = pack_rows_reference(order, main, dec, cap_main, cap_dec, best_fit)
    assert (row.tolist(), nrows) == (ref_row, ref_n)
    for r in range(nrows):  # capacity holds (lengths beyond a row are truncated to it)
        assert np.minimum(main[order][row == r], cap_main).sum() <= cap_main


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 2048), min_size=1, max_size=60), st.integers(64, 8192), st.sampled_from([1, 8]))
def test_budget_cuts_matches_reference(lengths, budget, multiple):
    s = np.sort(np.array(lengths, np.int64))
    assert _budget_cuts(s, budget, multiple).tolist() == budget_cuts_reference(s, budget, multiple)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=1, max_size=80), st.integers(1, 2000))
def test_greedy_cuts_matches_reference(tokens, budget):
    t = np.array(tokens, np.int64)
    assert _greedy_cuts(t, budget).tolist() == greedy_cuts_reference(t, budget)
