"""`dynabatch profile` (issue 41): progress per timed shape while it measures, and a warning when the
timings disagree beyond the noise of their own repeats (a larger shape measured faster than a smaller
one, a shape whose rounds spread far wider than the others') instead of a silently wrong table."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from dynabatch.cli import main
from dynabatch.core.cost.profiled import ProfiledTable
from dynabatch.pipeline.measure.profile import Profile
from dynabatch.pipeline.measure.profile_report import noise_floor, timing_warnings
from dynabatch.pipeline.models.spec import MicroBatchShape

ROWS, LENGTHS = (1, 2), (16, 32)


def _profile(grid_ms, rounds_ms) -> Profile:
    """A profile of the 2x2 padded grid ``grid_ms`` [rows, lengths] (the fastest round, ms) whose timed
    rounds of each shape (table order) were ``rounds_ms`` [rounds, shapes]."""
    t = np.asarray(grid_ms, float)[:, :, None] / 1e3
    table = ProfiledTable(np.array(ROWS), np.array(LENGTHS), np.array([0]), t, np.ones_like(t))
    shapes = tuple(MicroBatchShape("padded", r, L) for r in ROWS for L in LENGTHS)
    n = len(shapes)
    return Profile(table, (0, 2), shapes, (None,) * n, (None,) * n, t.ravel(), np.ones(n), None,
                   round_s=np.asarray(rounds_ms, float) / 1e3)


def test_consistent_timings_raise_no_warning():
    prof = _profile([[10.0, 20.0], [19.0, 39.0]], [[10.0, 20.0, 19.0, 39.0], [10.4, 20.6, 19.5, 40.0]])
    assert noise_floor(prof) == pytest.approx((0.03 + 0.5 / 19) / 2)  # the median of the 4 spreads
    assert timing_warnings(prof) == []


def test_a_larger_shape_measured_faster_is_named():
    """The case of the issue: 1x16 tokens 17.0 ms > 1x32 tokens 12.3 ms, written without a word."""
    prof = _profile([[17.0, 12.3], [19.0, 39.0]], [[17.0, 12.3, 19.0, 39.0], [17.4, 12.5, 19.3, 39.9]])
    warned = timing_warnings(prof)
    assert len(warned) == 1
    assert "1x16 tokens 17.0 ms > 1x32 tokens 12.3 ms" in warned[0] and "measured faster" in warned[0], warned
    # within the repeats' own noise a reversal is no finding
    noisy = _profile([[10.5, 10.0], [19.0, 39.0]], [[10.5, 10.0, 19.0, 39.0], [12.0, 11.5, 22.0, 45.0]])
    assert not [w for w in timing_warnings(noisy) if "measured faster" in w]


def test_a_shape_whose_repeats_spread_far_wider_is_named():
    prof = _profile([[10.0, 20.0], [19.0, 39.0]], [[10.0, 20.0, 19.0, 39.0], [10.2, 31.0, 19.3, 39.6]])
    warned = timing_warnings(prof)
    assert len(warned) == 1 and "repeats spread" in warned[0] and "1x32 tokens 20.0-31.0 ms" in warned[0], warned


def test_profile_shows_progress_per_shape_off_a_terminal(tmp_path, capsys):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["profile", "--model", "gpt-tiny", "--out", str(tmp_path / "c.json"), "--rows", "1", "2",
                     "--lengths", "16", "32", "--hidden", "32", "--layers", "1", "--repeats", "2"]) == 0
    finally:
        torch.set_num_threads(n)
    out = capsys.readouterr()
    assert "\r" not in out.err and "round 1/" not in out.out
    # every shape's timing counted, the warm-up round included: (1 + 2 rounds) x the shapes measured
    m = re.search(r"^profile gpt-tiny on cpu: done, 100% \((\d+)/(\d+) timings\) in ", out.err, re.M)
    shapes = int(re.search(r": (\d+) shapes \(", out.out).group(1))
    assert m and int(m.group(1)) == int(m.group(2)) == 3 * shapes, out.err
