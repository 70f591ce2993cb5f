"""`dynabatch profile`: a measured table of micro-batch costs that grows with the shape and survives save/load."""

import json

import numpy as np
import pytest
import torch

from dynabatch import CostModel
from dynabatch.cli import main
from dynabatch.pipeline.models import gpt_tiny, t5_tiny
from dynabatch.pipeline.measure.profile import profile_cost_model, profile_table


def increasing_fraction(a, axis):
    d = np.diff(a, axis=axis)
    return float((d > 0).mean())


@pytest.fixture
def one_thread():
    """Tiny kernels on a small shared CPU: OpenMP threads spin against other processes and turn
    milliseconds into tens of milliseconds; one thread measures the model, not the contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_profiled_table_is_monotone_ish(one_thread):
    model = gpt_tiny(vocab=128, hidden=32, layers=2, heads=2, max_positions=512)
    table, bounds = profile_table(model, rows=(1, 4, 16), lengths=(16, 64, 256), repeats=5)
    t = table.time_s[:, :, 0]
    assert bounds == (0, 4)
    assert np.all(t > 0)
    assert t[-1, -1] > 3 * t[0, 0]  # 256x the tokens
    assert increasing_fraction(t, 0) >= 0.66 and increasing_fraction(t, 1) >= 0.66
    m = table.memory_bytes[:, :, 0]
    assert np.all(np.diff(m, axis=0) > 0) and np.all(np.diff(m, axis=1) > 0)  # saved activations: exact


def test_save_load_gives_identical_predictions(tmp_path, one_thread):
    model = t5_tiny(vocab=128, hidden=32, encoder_layers=1, decoder_layers=1, heads=2, max_positions=256)
    cost = profile_cost_model(model, num_stages=2, rows=(1, 4), lengths=(16, 48), target_lengths=(8, 24), repeats=1)
    assert cost.kind == "encoder_decoder" and cost.table is not None
    assert cost.model.layers == pytest.approx(0.5)  # one stage's share of the layers
    path = tmp_path / "costs.json"
    cost.save(path)
    back = CostModel.load(path)
    rows, L, T = np.array([1, 2, 3, 4]), np.array([16, 20, 33, 48]), np.array([8, 9, 17, 24])
    for a, b in zip(cost.padded(rows, L, T), back.padded(rows, L, T)):
        assert np.array_equal(a, b)
    phi = cost.packed_features(L, T, np.zeros(4), np.array([0, 0, 1, 1]))
    assert np.array_equal(cost.time(phi), back.time(phi))
    assert np.array_equal(cost.table.time_s, back.table.time_s)


def test_cli_profile_writes_a_loadable_cost_model(tmp_path, capsys, one_thread):
    out = tmp_path / "gpt.json"
    argv = ["profile", "--model", "gpt-tiny", "--device", "cpu", "--out", str(out), "--rows", "1", "4",
            "--lengths", "16", "64", "--hidden", "32", "--layers", "1", "--repeats", "1"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "written to" in text and "rows\\len" in text
    doc = json.loads(out.read_text())
    assert doc["format"] == "dynabatch.cost_model" and doc["table"] is not None
    cost = CostModel.load(out)
    assert cost.table.time_s.shape == (2, 2, 1)
    t, m = cost.padded(4, 64)
    assert float(t) == pytest.approx(cost.table.time_s[1, 1, 0])


def test_cli_profile_rejects_a_bad_grid(tmp_path, capsys):
    assert main(["profile", "--out", str(tmp_path / "x.json"), "--lengths", "64", "16"]) == 2
    assert "strictly increasing" in capsys.readouterr().err


def test_a_t5_profile_prices_packed_micro_batches_from_packed_measurements(one_thread):
    """An encoder-decoder is measured on packed micro-batches too (r samples in r x L main tokens and
    r x T target tokens, for r > 1), and the fitted cost model prices packed shapes from them: their
    activation bytes (deterministic) closer than a fit to the padded table alone."""
    from dynabatch.pipeline.measure.profile import fitted_cost_model, profile_model

    model = t5_tiny(vocab=128, hidden=32, encoder_layers=1, decoder_layers=1, heads=2, max_positions=256)
    prof = profile_model(model, rows=(1, 2, 4), lengths=(16, 48), target_lengths=(8, 24), repeats=1)
    packed = prof.extra
    assert [(prof.shapes[k].rows, sum(prof.lengths[k]), sum(prof.decoder_lengths[k])) for k in packed] == \
        [(r, r * L, r * T) for r in (2, 4) for L in (16, 48) for T in (8, 24)]
    assert all(len(prof.lengths[k]) == len(prof.decoder_lengths[k]) == prof.shapes[k].rows for k in packed)
    assert all(prof.decoder_lengths[k] is None for k in range(prof.table.time_s.size))  # the padded grid
    cost = fitted_cost_model(prof, model)
    table_only = CostModel.profiled(prof.table, cost.model, cost.device)

    def packed_bytes_error(cm):
        got = [float(cm.packed(np.array(prof.lengths[k]), np.array(prof.decoder_lengths[k]),
                               np.zeros(prof.shapes[k].rows), np.zeros(prof.shapes[k].rows, np.int64))[1][0])
               for k in packed]
        return float(np.abs(np.array(got) / prof.memory_bytes[packed] - 1).max())

    err = packed_bytes_error(cost)
    assert err < packed_bytes_error(table_only) and err < 0.25, err
