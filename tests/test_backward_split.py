"""`BackwardSplit` (the measured weight share of a split backward) and the scoring of
``dynabatch bench schedules --measure`` on synthetic rank results whose seconds follow a known law."""

import numpy as np
import pytest

from dynabatch.bench.schedules_measure import MeasureConfig, analyse
from dynabatch.core.cost.backward_split import BackwardSplit
from dynabatch.core.kernels import op_codes as oc
from dynabatch.core.schedule.build import step_ops


def test_split_pools_seconds_per_stage_and_forgets_by_decay():
    sp = BackwardSplit.unmeasured(2)
    assert sp.weight_shares.tolist() == [0.5, 0.5] and sp.weight_share == 0.5
    sp = sp.observe([[3.0, 1.0], [1.0, np.nan]], [[1.0, 1.0], [3.0, 5.0]])
    assert sp.weight_shares.tolist() == [pytest.approx(2 / 6), pytest.approx(3 / 4)]  # NaN pairs left out
    assert sp.weight_share == pytest.approx(5 / 10)
    sp2 = sp.observe([[1.0], [1.0]], [[1.0], [1.0]], decay=0.0, whole_s=[[1.6], [np.nan]])
    assert sp2.weight_shares.tolist() == [0.5, 0.5]
    assert sp.split_factor == 1.0 and sp2.split_factor == pytest.approx(2.0 / 1.6)  # only the paired stage counts
    with pytest.raises(ValueError, match=r"\[2, k\]"):
        sp.observe([[1.0]], [[1.0]])


def _fake_results(cfg, share, rng):
    """Rank results whose op seconds are exactly a linear law of the shape (what the fit can recover)."""
    S, M = 2, cfg.microbatches
    out = [{"rank": s, "rounds": []} for s in range(S)]
    for _ in range(cfg.rounds):
        dims = [(int(rng.integers(2, 7)), int(rng.integers(48, 161))) for _ in range(M)]
        tok = np.array([r * L for r, L in dims], float)
        for s in range(S):
            f = 1e-3 + 2e-6 * tok * (s + 1)
            b = 2 * f
            runs = {}
            for name in cfg.schedules:
                ops = step_ops(name, S, M)
                row = []
                for op in ops.rank(s):
                    t = {oc.FORWARD: f, oc.BACKWARD: b, oc.BACKWARD_INPUT: b * (1 - share),
                         oc.BACKWARD_WEIGHT: b * share}[op.kind][op.microbatch]
                    row.append([op.kind, op.microbatch, float(t)])
                runs[name] = {"ops": row, "step_s": float(f.sum() + b.sum()) * 1.5}
            out[s]["rounds"].append({"dims": dims, "runs": runs})
    return out


def test_measure_scores_a_law_the_fit_can_recover_as_exact():
    cfg = MeasureConfig(rounds=4, microbatches=6)
    rep = analyse(_fake_results(cfg, 0.4, np.random.default_rng(0)), cfg)
    assert rep["weight_share"] == pytest.approx(0.4) and rep["split_factor"] == pytest.approx(1.0)
    assert rep["noise"] == pytest.approx(0.0, abs=1e-12)  # a forward costs the same under both schedules
    same = rep["schedules"]["zb-h1"]["same_round"]["ops"]
    assert all(same[k]["median"] == pytest.approx(1.0, rel=1e-9) for k in ("F", "Bi", "W"))
    fitted = rep["schedules"]["zb-h1"]["fitted"]["ops"]
    for k in ("F", "Bi", "W"):
        assert fitted[k]["median"] == pytest.approx(1.0, rel=1e-6) and fitted[k]["within_10pct"] == 1.0
    halves = rep["schedules"]["zb-h1"]["halves"]["ops"]
    assert halves["W"]["median"] == pytest.approx(0.5 / 0.4, rel=1e-6)  # halves misprice the weight part
    assert rep["schedules"]["1f1b"]["fitted"]["ops"]["B"]["sum_ratio"] == pytest.approx(1.0, rel=1e-6)
    assert 0 < rep["schedules"]["1f1b"]["fitted"]["makespan_ratio"] < 1  # the executed step adds its extras
