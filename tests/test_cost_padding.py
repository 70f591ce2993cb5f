"""``q_pad``: what a padding mask costs a padded micro-batch (`dynabatch.core.cost.model`'s feature list).

A Hugging Face decoder attends without a mask (SDPA's causal path) only when no row is padded; the cost
model tells the two apart from the plan alone, the profile measures the difference, and files written
before the feature still load."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dynabatch import CostModel, Shapes, plan_microbatches
from dynabatch.core.cost.features import main_padding, microbatch_features
from dynabatch.core.cost.model import FEATURES, ProfiledTable

Q = FEATURES.index("q_pad")


def test_hugging_face_builds_a_mask_only_for_padded_rows():
    """The premise: with SDPA, a full batch gets no mask (the causal fast path), one padded row a
    ``[rows, 1, L, L]`` mask; what the cost model's ``q_pad`` prices."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    config._attn_implementation = "sdpa"
    h = torch.zeros(2, 8, 16)
    full = torch.ones(2, 8, dtype=torch.long)
    padded = full.clone()
    padded[1, 5:] = 0
    pos = torch.arange(8)[None].expand(2, -1)
    assert create_causal_mask(config=config, inputs_embeds=h, attention_mask=full, cache=None, position_ids=pos) is None
    mask = create_causal_mask(config=config, inputs_embeds=h, attention_mask=padded, cache=None, position_ids=pos)
    assert tuple(mask.shape) == (2, 1, 8, 8)


def test_padding_is_read_from_the_plan_and_priced():
    """Micro-batches of 2 rows padded to 64 tokens: q_pad is 0 where both samples are 64 tokens long and
    2 x 64**2 where one is shorter (read from the plan's columns alone); the planner's seconds include
    q_pad's coefficient, so the padded one costs more."""
    cost = CostModel.preset("gpt", device="a100-80gb", num_stages=1)
    coef = cost.time_coef.copy()
    coef[Q] = 3 * coef[FEATURES.index("q_main")]
    cost.time_coef = coef
    lengths = np.array([64, 64, 40, 64])
    shapes = Shapes.from_lengths(input_tokens=lengths, target_tokens=np.zeros(4, np.int64))
    plan = plan_microbatches(shapes, cost, num_stages=1, num_ranks=1, method="token_budget", max_len=64,
                             method_options={"max_tokens": 128})
    phi = microbatch_features(plan, cost)
    short = [bool(lengths[plan.sample_ids[a:b]].min() < 64) for a, b in zip(plan.mb_offsets[:-1], plan.mb_offsets[1:])]
    assert sorted(short) == [False, True] and plan.mb_rows.tolist() == [2, 2]
    assert phi[:, Q].tolist() == [2 * 64**2 if s else 0.0 for s in short]
    np.testing.assert_allclose(plan.mb_time_s, phi @ cost.time_coef, rtol=1e-12)
    assert plan.mb_time_s[short.index(True)] > plan.mb_time_s[short.index(False)]
    assert main_padding([128, 104], [2, 2], [64, 64]).tolist() == [False, True]


def test_a_profiled_table_adds_the_mask_cost_to_padded_shapes_only():
    table = ProfiledTable(np.array([1, 4]), np.array([64, 256]), np.array([0]), np.full((2, 2, 1), 1e-3),
                          np.full((2, 2, 1), 1e6))
    cost = CostModel.profiled(table, CostModel.preset("gpt").model, CostModel.preset("gpt").device)
    coef = cost.time_coef.copy()
    coef[Q] = 1e-9
    cost.time_coef = coef
    full, _ = cost.padded([4, 4], [256, 256], 0, 0, [False, True])
    assert full[0] == pytest.approx(1e-3) and full[1] == pytest.approx(1e-3 + 1e-9 * 4 * 256**2)


def test_the_profile_fits_the_mask_cost_from_rows_measured_again_with_padding():
    """`fitted_cost_model` on measurements whose padded-row repeats cost the table's time plus
    c x rows x L**2 recovers c; without the surplus it stays 0."""
    pytest.importorskip("torch")
    from dynabatch.pipeline import make_model
    from dynabatch.pipeline.measure.profile import Profile, fitted_cost_model
    from dynabatch.pipeline.models.spec import MicroBatchShape

    model = make_model("gpt-tiny", hidden=32, layers=2, heads=2)
    rows, lengths = np.array([1, 4]), np.array([64, 256])
    grid = np.array([[2e-3, 6e-3], [5e-3, 2e-2]])[:, :, None]
    table = ProfiledTable(rows, lengths, np.array([0]), grid, np.full(grid.shape, 1e6))
    ragged = [MicroBatchShape("padded", int(r), 256) for r in rows]
    for c in (4e-8, 0.0):
        extra = np.array([grid[i, 1, 0] + c * r * 256**2 for i, r in enumerate(rows)])
        shapes = tuple(MicroBatchShape("padded", int(r), int(L)) for r in rows for L in lengths) + tuple(ragged)
        prof = Profile(table, (0, len(model.layers)), shapes, (None,) * 6, (None,) * 6,
                       np.r_[grid.ravel(), extra], np.full(6, 1e6), None, (False,) * 4 + (True,) * 2)
        cost = fitted_cost_model(prof, model)
        assert cost.time_coef[Q] == pytest.approx(c, rel=1e-9, abs=1e-20)


def test_cost_files_written_before_q_pad_load_with_it_at_zero(tmp_path):
    cost = CostModel.preset("gpt")
    doc = cost.to_dict()
    doc["time_coef"], doc["mem_coef"] = doc["time_coef"][:-1], doc["mem_coef"][:-1]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    old = CostModel.load(path)
    assert old.time_coef[Q] == 0.0 and np.array_equal(old.time_coef[:Q], cost.time_coef[:Q])


def test_the_dps_table_path_prices_every_segment_as_the_cost_model_does():
    """`enumerate_segments` on a profiled table with a q_pad coefficient: every candidate segment's seconds
    equal `CostModel.padded` of its rows, rounded longest length and padding (its shortest sample shorter)."""
    from dynabatch.core.kernels.dp import enumerate_segments, segment_cost

    table = ProfiledTable(np.array([1, 2, 4]), np.array([8, 32, 64]), np.array([0]),
                          np.array([[1.0, 2.0, 4.0], [1.5, 3.5, 8.0], [2.5, 7.0, 15.0]])[:, :, None] * 1e-3,
                          np.full((3, 3, 1), 1e6))
    preset = CostModel.preset("gpt")
    cost = CostModel.profiled(table, preset.model, preset.device)
    coef = cost.time_coef.copy()
    coef[Q] = 2e-7
    cost.time_coef = coef
    main = np.array([8, 16, 16, 20, 24, 24, 40, 64], np.int64)  # sorted, as the planner passes them
    zeros = np.zeros(len(main), np.int64)
    seg = segment_cost(False, cost.pad_multiple, cost.model.tile_patches, cost.time_coef, cost.mem_coef, np.inf, table)
    offset, count, seg_time, bad = enumerate_segments(main, zeros, zeros, seg)
    assert bad == -1
    padded_seen = full_seen = 0
    for i in range(1, len(main) + 1):
        for k in range(count[i]):
            j = i - 1 - k
            rows, top = i - j, -(-int(main[j:i].max()) // 8) * 8
            padding = bool(main[j:i].min() < top)
            if rows > 4:
                continue  # beyond the grid: extrapolated, checked elsewhere
            want = float(np.ravel(cost.padded(rows, top, 0, 0, padding)[0])[0])
            assert seg_time[offset[i] + k] == pytest.approx(want, rel=1e-12), (j, i)
            padded_seen += padding
            full_seen += not padding
    assert padded_seen and full_seen
