"""How a packed micro-batch is attended (`CostModel.packed_attention`): a varlen kernel is quadratic per
sample; SDPA or eager given the packed row and a mask computes all of it, so the row costs what one padded
row of its length with a mask costs. The features, the DP's segment prices, a plan's predictions and the
profile's choice between the two all follow one definition (`CostModel.packed_features`)."""

from __future__ import annotations

import numpy as np
import pytest

from dynabatch import CostModel, Shapes, plan_microbatches
from dynabatch.core.cost.model import ProfiledTable
from dynabatch.core.cost.model import PACKED_ATTENTION
from dynabatch.core.kernels.cost import FEATURES

Q_MAIN, Q_PAD = FEATURES.index("q_main"), FEATURES.index("q_pad")


def _cost(model="gpt", attention="dense", device="a100-80gb"):
    cost = CostModel.preset(model, device, pad_multiple=1)
    cost.packed_attention = attention
    return cost


def test_a_dense_packed_row_is_priced_as_one_padded_row_with_a_mask():
    lens = np.array([100, 50, 30, 7])
    dense, varlen = _cost(), _cost(attention="varlen")
    got = dense.packed_features(lens, 0 * lens, 0 * lens, np.array([0, 0, 0, 1]))
    assert np.array_equal(got[0], dense.padded_features(1, 180, 0, 0, padding=True)[0])
    assert np.array_equal(got[1], dense.padded_features(1, 7, 0, 0, padding=False)[0])  # one sample: no mask
    per_sample = varlen.packed_features(lens, 0 * lens, 0 * lens, np.array([0, 0, 0, 1]))
    assert per_sample[0, Q_MAIN] == 100**2 + 50**2 + 30**2 and per_sample[0, Q_PAD] == 0
    # an encoder-decoder's two rows: decoder self-attention and cross-attention over the whole rows too
    t5 = _cost("t5")
    dec = np.array([9, 4, 2, 3])
    got = t5.packed_features(lens, dec, 0 * lens, np.array([0, 0, 0, 1]))
    assert np.array_equal(got[0], t5.padded_features(1, 180, 15, 0, padding=True)[0])
    assert dense.packed(lens, 0 * lens, 0 * lens, np.zeros(4, np.int64))[0][0] > \
        varlen.packed(lens, 0 * lens, 0 * lens, np.zeros(4, np.int64))[0][0]


def test_packed_attention_is_saved_checked_and_defaults_to_varlen(tmp_path):
    cost = _cost()
    cost.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json").packed_attention == "dense"
    doc = cost.to_dict()
    del doc["packed_attention"]  # a file written before the option: per sample, as then
    assert CostModel.from_dict(doc).packed_attention == "varlen"
    assert CostModel.preset("gpt").packed_attention == "varlen" and PACKED_ATTENTION == ("varlen", "dense")
    with pytest.raises(ValueError, match="packed_attention='flash'"):
        CostModel(cost.model, cost.device, packed_attention="flash")


def test_dp_varlen_plans_at_the_dense_price_and_packs_less():
    """The DP's segments are priced as `packed_features` prices them: every planned micro-batch's time is
    `CostModel.packed` of its samples; a dense row costs its length squared, so the DP packs fewer samples
    per micro-batch than it does for a varlen kernel."""
    rng = np.random.default_rng(0)
    shapes = Shapes.from_lengths(input_tokens=rng.integers(50, 900, 256), target_tokens=rng.integers(1, 40, 256))
    per_mb = {}
    for attention in PACKED_ATTENTION:
        cost = _cost(attention=attention)
        plan = plan_microbatches(shapes, cost, num_stages=4, num_ranks=2, method="dp_varlen", max_len=1024)
        main, dec, tiles = cost.sample_dims(shapes, 1024)
        where = {int(s): k for k, s in enumerate(shapes.sample_id)}
        sizes = []
        for rank in range(2):
            for mb in plan.microbatches(rank=rank):
                k = np.array([where[int(s)] for s in mb.sample_ids])
                want = cost.packed(main[k], dec[k], tiles[k], np.zeros(len(k), np.int64))[0][0]
                assert mb.time_s == pytest.approx(want, rel=1e-9)
                sizes.append(len(k))
        per_mb[attention] = np.mean(sizes)
    assert per_mb["dense"] < per_mb["varlen"], per_mb


@pytest.mark.parametrize("truth", PACKED_ATTENTION)
def test_the_profile_finds_the_packed_attention_its_measurements_show(truth):
    """Measurements made by known coefficients under one packed attention (padded grid, padded rows,
    packed rows of r samples): `fitted_cost_model` picks that attention, and its one coefficient vector
    prices the padded grid as well as the packed rows (what the per-stage predictions use)."""
    pytest.importorskip("torch")
    from dynabatch.core.cost.fit import mape
    from dynabatch.pipeline import make_model
    from dynabatch.pipeline.measure.profile import Profile, fitted_cost_model
    from dynabatch.pipeline.models.spec import MicroBatchShape

    model = make_model("gpt-tiny", hidden=32, layers=2, heads=2)
    base = CostModel.preset("gpt-tiny", "cpu", num_stages=1)
    true = base.prior_time_coef * np.linspace(0.7, 1.6, len(FEATURES))
    true[Q_PAD] = 0.5 * true[Q_MAIN]  # a mask's attention
    rows, lengths = np.array([1, 4, 16]), np.array([32, 128, 512])
    truth_cost = CostModel(base.model, base.device, time_coef=true, pad_multiple=1, packed_attention=truth)
    grid = np.array([[truth_cost.time(truth_cost.padded_features(r, L, 0, 0))[0] for L in lengths] for r in rows])
    table_shapes = [MicroBatchShape("padded", int(r), int(L)) for r in rows for L in lengths]
    ragged = [MicroBatchShape("padded", int(r), int(L)) for r in rows for L in lengths[1:]]
    packed = [MicroBatchShape("packed", int(r), int(L), 0, int(r * L)) for r in (2, 4) for L in lengths]
    lens = tuple([int(s.input_len)] * s.rows for s in packed)
    t_ragged = [truth_cost.time(truth_cost.padded_features(s.rows, s.input_len, 0, 0, True))[0] for s in ragged]
    t_packed = [truth_cost.packed(np.array(x), 0 * np.array(x), 0 * np.array(x), 0 * np.array(x))[0][0] for x in lens]
    table = ProfiledTable(rows, lengths, np.array([0]), grid[:, :, None], np.full((3, 3, 1), 1e6))
    n = len(table_shapes) + len(ragged) + len(packed)
    prof = Profile(table, (0, len(model.layers)), tuple(table_shapes + ragged + packed),
                   (None,) * (len(table_shapes) + len(ragged)) + lens, (None,) * n,
                   np.r_[grid.ravel(), t_ragged, t_packed], np.full(n, 1e6), None,
                   (False,) * len(table_shapes) + (True,) * len(ragged) + (False,) * len(packed))
    cost = fitted_cost_model(prof, model, device="cpu", pad_multiple=1)
    assert cost.packed_attention == truth
    padded_phi = cost.padded_features(np.repeat(rows, 3), np.tile(lengths, 3), 0, 0)
    assert mape(cost.time(padded_phi), grid.ravel()) < 0.02
    got = [cost.packed(np.array(x), 0 * np.array(x), 0 * np.array(x), 0 * np.array(x))[0][0] for x in lens]
    assert mape(np.array(got), np.array(t_packed)) < 0.02


def test_a_models_analytic_cost_prices_packed_rows_as_it_attends_them():
    """`stage_cost_model` takes the model's ``packed_attention()``: the tiny models and Hugging Face SDPA or
    eager give the row whole with a mask (dense); flash-attention and flex are per sample (varlen)."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hf_tiny import build, decoder_config

    from dynabatch.pipeline import make_model, stage_cost_model
    from dynabatch.pipeline.models.hf import from_hf

    assert stage_cost_model(make_model("gpt-tiny", hidden=32, layers=2, heads=2), 2).packed_attention == "dense"
    llama = from_hf(build(decoder_config("llama")))
    assert llama.hf_config._attn_implementation == "sdpa" and stage_cost_model(llama, 2).packed_attention == "dense"
    for impl, want in (("eager", "dense"), ("flash_attention_2", "varlen"), ("flex_attention", "varlen")):
        llama.hf_config._attn_implementation = impl
        assert stage_cost_model(llama, 2).packed_attention == want, impl
    assert stage_cost_model(llama, 2, packed_attention="dense").packed_attention == "dense"  # said explicitly


def test_another_device_or_model_change_keeps_the_packed_attention():
    cost = _cost()
    assert cost.with_device("h100").packed_attention == "dense"
    assert cost.with_model(recompute=False).packed_attention == "dense"
