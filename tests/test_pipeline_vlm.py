"""vlm-tiny: a ViT -> projector -> GPT model as a splittable layer list, fed by the DataLoader's image+text
micro-batches; text-only micro-batches never run the vision layers; 2 gloo stages equal one process.

The rank-side worker (`pipeline_worker`) is in this file; `launch_local` runs it by path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynabatch.pipeline.models import MicroBatchShape, check_batch, merged_length, vision_calls, vlm_tiny
from dynabatch.pipeline import (PipelineRunner, RunnerConfig, init_pipeline, launch_local, sequential_step,
                                stage_cost_model)
from dynabatch.pipeline.models import gpt_tiny
from dynabatch.loader.settings import records_from_keywords

TINY = dict(vocab=300, hidden=32, layers=2, heads=2, vision_hidden=16, vision_layers=2, vision_heads=2)
SHAPES = [MicroBatchShape("padded", 3, 20, tiles=4), MicroBatchShape("padded", 2, 9),
          MicroBatchShape("padded", 1, 12, tiles=2), MicroBatchShape("padded", 4, 7)]


def mixed_batches(model, seed=0, dtype=None):
    gen = torch.Generator().manual_seed(seed)
    out = [model.random_batch(s, gen) for s in SHAPES]
    if dtype is not None:
        for b in out:
            b["pixel_values"] = b["pixel_values"].to(dtype)
    return out


def one_pass(layers, batches):
    """Reference: the layers applied one after another as a plain loop (an nn.Sequential-like pass)."""
    total, n = 0.0, 0
    for p in (q for layer in layers for q in layer.parameters()):
        p.grad = None
    for b in batches:
        x = layers[0](b)
        for layer in layers[1:-1]:
            x = layer(x)
        loss, ntok = layers[-1](x, b)
        loss.backward()
        total, n = total + float(loss.detach()), n + int(ntok)
    for p in (q for layer in layers for q in layer.parameters()):
        if p.grad is not None:
            p.grad.div_(n)
    return total / n, n


def test_boundaries_are_known_from_the_shape():
    """Every state between layers has exactly the shapes `boundary` predicts from (rows, length, tiles);
    a text-only micro-batch carries an empty [0, ...] feature tensor through the vision layers."""
    model = vlm_tiny(**TINY)
    for shape, b in zip(SHAPES, mixed_batches(model)):
        got = model.batch_shapes([b])[0]
        assert (got.rows, got.input_len, got.tiles) == (shape.rows, shape.input_len, shape.tiles)
        check_batch(b, got, "test")
        x = None
        for i, layer in enumerate(model.layers[:-1]):
            x = layer(b) if i == 0 else layer(x)
            want = model.boundary(shape, i)
            assert len(x) == len(want) and all(w.matches(t) for w, t in zip(want, x)), (i, [t.shape for t in x])
        if not shape.tiles:
            assert model.boundary(shape, 0)[0].shape[0] == 0


def test_single_process_equals_plain_pass_and_trains():
    """sequential_step on a mixed set (image+text and text-only) equals a plain layer-by-layer pass, in
    float64 exactly; a few Adam steps lower the loss."""
    a, b = vlm_tiny(**TINY, dtype=torch.float64, seed=3), vlm_tiny(**TINY, dtype=torch.float64, seed=3)
    batches = mixed_batches(a, dtype=torch.float64)
    la, na = sequential_step(a.layers, batches)
    lb, nb = one_pass(b.layers, batches)
    assert na == nb and la == pytest.approx(lb, rel=1e-12)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    assert all(p.grad is not None for p in a.parameters())  # every layer, vision included, got a gradient
    model = vlm_tiny(**TINY, seed=0)
    batches = mixed_batches(model)
    opt = torch.optim.Adam(list(model.parameters()), lr=3e-3)
    losses = []
    for _ in range(8):
        loss, _ = sequential_step(model.layers, batches)
        opt.step()
        losses.append(loss)
    assert losses[-1] < 0.9 * losses[0], losses


def test_text_only_microbatches_never_run_the_vision_layers():
    """The vision layers' call counters move once per layer for each image micro-batch, forward and
    backward of text-only micro-batches leave them alone, and their loss equals gpt-tiny's formula."""
    model = vlm_tiny(**TINY)
    batches = mixed_batches(model)
    n_vis = model.vision_layers
    text = [b for b, s in zip(batches, SHAPES) if not s.tiles]
    images = [b for b, s in zip(batches, SHAPES) if s.tiles]
    sequential_step(model.layers, text)
    assert vision_calls(model) == 0
    sequential_step(model.layers, images)
    assert vision_calls(model) == n_vis * len(images)
    sequential_step(model.layers, text)
    assert vision_calls(model) == n_vis * len(images)
    # vision parameters get no gradient from text-only micro-batches
    sequential_step(model.layers, text)
    assert all(p.grad is None for layer in model.layers[:n_vis] for p in layer.parameters())


def test_stage_cost_model_has_no_vision_cost_without_tiles():
    """The planner's stage cost model: a micro-batch without tiles costs what the same language model
    without a ViT costs; tiles add time; the ViT layers are split over the stages like the LLM's."""
    model = vlm_tiny(**TINY)
    cm = stage_cost_model(model, 2, "cpu")
    assert cm.kind == "vision_language" and cm.model.vision_layers == model.config.vision_layers / 2
    phi = cm.padded_features([4, 4], [64, 64], [0, 0], [0, 3])
    assert np.all(phi[0, 5:7] == 0) and phi[0, 8] == 0 and phi[1, 8] == 1
    t = cm.time(phi)
    llm = stage_cost_model(gpt_tiny(vocab=300, hidden=32, layers=2, heads=2), 2, "cpu")
    assert t[0] == pytest.approx(float(llm.time(llm.padded_features(4, 64, 0, 0))[0]), rel=1e-9)
    assert t[1] > t[0]
    # and the per-sample dims: a sample without vision tokens has 0 tiles
    from dynabatch import Shapes
    main, _, tiles = cm.sample_dims(Shapes.from_lengths(input_tokens=[10, 10], vision_tokens=[0, 8]))
    assert tiles.tolist() == [0, 2] and main.tolist() == [10, 18]


# -- the DataLoader's micro-batches ---------------------------------------------------------------

def _loader_steps(tmp_path):
    """Real DataLoader steps: generated images (dynabatch.datagen) with short text, plus text-only rows."""
    import datasets
    import tokenization
    from dynabatch import DataLoader, datagen

    policy = tokenization.DynamicTiling(tile_size=56, patch_size=14, max_num=4)
    model = vlm_tiny(**TINY, vision=policy, seed=1)
    imgs = [{"inputs": f"describe image {i}", "targets": "a picture of shapes", "image": {"bytes": data, "path": None}}
            for i, (_, _, data, _) in enumerate(datagen.image_text_samples(4, seed=0))]
    text = [{"inputs": f"say {i} words", "targets": "words " * (i + 1), "image": None} for i in range(4)]
    common = dict(vision=policy, load_pixels=True, cost_model=stage_cost_model(model, 2, "cpu"), num_stages=2, seed=0)
    mixed = DataLoader(datasets.Dataset.from_list(imgs + text),
                       **records_from_keywords(dict(global_batch_tokens=120, **common)))
    text_only = DataLoader(datasets.Dataset.from_list(text),
                           **records_from_keywords(dict(global_batch_tokens=60, **common)))
    return model, policy, [b for s in mixed.steps() for b in s] + [b for s in text_only.steps() for b in s]


def test_dataloader_microbatches_go_straight_in(tmp_path):
    """image+text and text-only micro-batches of a real DataLoader (pixel_values, image_tiles, text ids):
    the model runs them, the merged length counts text + tiles x tile_tokens, text-only ones skip the ViT."""
    model, policy, batches = _loader_steps(tmp_path)
    assert model.tile_tokens == policy.tile_tokens == 4 and model.tile_size == 56
    tiles = [int(b["image_tiles"].sum()) for b in batches]
    assert any(tiles) and 0 in tiles
    for b in batches:
        assert b["pixel_values"].shape == (int(b["image_tiles"].sum()), 3, 56, 56)
        n = b["attention_mask"].sum(1) + b["image_tiles"] * 4
        assert merged_length(b, 4) == max(int(n.max()), b["input_ids"].shape[1])
    loss, ntok = sequential_step(model.layers, [b for b, t in zip(batches, tiles) if t == 0])
    assert vision_calls(model) == 0 and ntok > 0 and np.isfinite(loss)
    loss, ntok = sequential_step(model.layers, batches)
    assert vision_calls(model) == model.vision_layers * sum(t > 0 for t in tiles) and np.isfinite(loss)
    # the text tokens' loss does not depend on where the vision tokens sit: target count is the text's
    assert ntok == sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)


# -- 2 gloo stages ---------------------------------------------------------------------------------

def pipeline_worker(rank, world, port, bounds, schedules, batch_file, bypass=False):
    """Rank side: vlm-tiny (float64) cut at ``bounds`` over ``world`` stages, the mixed synthetic batches
    plus the DataLoader batches in ``batch_file``; loss and gradients vs one process, vision calls
    (``bypass``: RunnerConfig(bypass_idle_stages=True); each micro-batch's entry stage and this stage's
    measured seconds)."""
    torch.set_default_dtype(torch.float64)
    extra = torch.load(batch_file, weights_only=False)
    ctx = init_pipeline(world, rank=rank, world_size=world, master_port=port, timeout_s=30, abort_after_s=10)
    out = []
    with ctx:
        for schedule in schedules:
            model, ref = (vlm_tiny(**TINY, dtype=torch.float64, seed=1) for _ in range(2))
            batches = mixed_batches(model, seed=2, dtype=torch.float64)
            batches += [{**b, "pixel_values": b["pixel_values"].double()} for b in extra]
            shapes = model.batch_shapes(batches)
            runner = PipelineRunner.from_model(model, ctx, bounds, RunnerConfig(schedule=schedule,
                                                                                 bypass_idle_stages=bypass))
            res = runner.step(shapes, batches if ctx.stage in (0, world - 1) or bypass else None)
            ref_loss, ref_n = sequential_step(ref.layers, batches)
            lo = runner.stage.first_layer
            diff = scale = 0.0
            for i, layer in enumerate(runner.stage.layers):
                for p, q in zip(layer.parameters(), ref.layers[lo + i].parameters()):
                    diff = max(diff, float((p.grad - q.grad).abs().max()))
                    scale = max(scale, float(q.grad.abs().max()))
            out.append({"schedule": schedule, "loss": res.loss, "ref_loss": ref_loss, "tokens": res.num_tokens,
                        "ref_tokens": ref_n, "diff": diff, "scale": scale, "calls": vision_calls(runner.stage.layers),
                        "image_mbs": sum(s.tiles > 0 for s in shapes), "first": lo,
                        "vision_here": sum(lo + i < model.vision_layers for i in range(len(runner.stage.layers))),
                        "entry": runner.entries(shapes).tolist(), "stage": ctx.stage,
                        "fwd": res.timing.forward_s.tolist(), "bwd": res.timing.backward_s.tolist()})
    return out


@pytest.mark.parametrize("bounds", [[0, 2, 8], [0, 5, 8]], ids=["cut-inside-vit", "cut-after-merge"])
def test_two_gloo_stages_match_single_process(tmp_path, bounds):
    """2 gloo stages (cut inside the ViT, or after the merge) on synthetic and DataLoader micro-batches,
    image+text and text-only: loss and every gradient equal one process's (float64), for gpipe and
    1f1b; the vision layers computed once per image micro-batch and never on a text-only one."""
    _, _, extra = _loader_steps(tmp_path)
    keep = ("input_ids", "attention_mask", "labels", "image_tiles", "pixel_values")
    path = tmp_path / "batches.pt"
    torch.save([{k: b[k] for k in keep} for b in extra], path)
    res = launch_local(f"{__file__}:pipeline_worker", 2, args=(bounds, ["gpipe", "1f1b"], str(path)),
                       idle_timeout_s=120)
    for r in res:
        assert not r.timed_out, f"rank {r.rank} hung:\n{r.stderr[-3000:]}"
        assert r.returncode == 0, f"rank {r.rank} failed:\n{r.stderr[-3000:]}"
    for r in res:
        assert [c["schedule"] for c in r.result] == ["gpipe", "1f1b"]
        assert all(c["image_mbs"] >= 3 for c in r.result)  # 2 synthetic + the DataLoader's, text-only ones too
        for c in r.result:
            assert c["tokens"] == c["ref_tokens"]
            assert c["loss"] == pytest.approx(c["ref_loss"], rel=1e-12)
            assert c["scale"] > 0 and c["diff"] <= 1e-10 * c["scale"], c
            # forward of every image micro-batch once per vision layer held here; text-only: never
            assert c["calls"] == c["vision_here"] * c["image_mbs"], c


@pytest.mark.parametrize("bounds", [[0, 4, 8], [0, 2, 5, 8]], ids=["modality-split", "three-stages"])
def test_text_only_microbatches_bypass_the_vision_stages(tmp_path, bounds):
    """RunnerConfig(bypass_idle_stages=True): a text-only micro-batch enters at the stage holding the
    merge embedding (the last stage of the modality split, the middle one of three), runs no op on the
    stages before it (0 s measured there, exactly) and passes no message to them; image micro-batches
    run everywhere. Loss and every gradient still equal one process's (float64) for gpipe, 1f1b and
    adaptive, and the vision layers compute once per image micro-batch."""
    _, _, extra = _loader_steps(tmp_path)
    keep = ("input_ids", "attention_mask", "labels", "image_tiles", "pixel_values")
    path = tmp_path / "batches.pt"
    torch.save([{k: b[k] for k in keep} for b in extra], path)
    stages = len(bounds) - 1
    res = launch_local(f"{__file__}:pipeline_worker", stages,
                       args=(bounds, ["gpipe", "1f1b", "adaptive"], str(path), True), idle_timeout_s=120)
    for r in res:
        assert not r.timed_out, f"rank {r.rank} hung:\n{r.stderr[-3000:]}"
        assert r.returncode == 0, f"rank {r.rank} failed:\n{r.stderr[-3000:]}"
    for r in res:
        for c in r.result:
            assert c["tokens"] == c["ref_tokens"] and c["loss"] == pytest.approx(c["ref_loss"], rel=1e-12)
            assert c["scale"] > 0 and c["diff"] <= 1e-10 * c["scale"], c
            assert c["calls"] == c["vision_here"] * c["image_mbs"], c
            entry = np.array(c["entry"])
            text_only = entry > 0
            assert 0 < text_only.sum() < len(entry)  # both kinds in the step
            assert set(entry[text_only].tolist()) == {1}  # the stage holding the merge embedding
            ran = np.array(c["fwd"]) + np.array(c["bwd"])
            skipped = entry > c["stage"]
            assert (ran[skipped] == 0).all() and (ran[~skipped] > 0).all(), c


def test_bypass_entries_and_refusals():
    """The entry stage of each micro-batch follows the cut and the model's idle layers; a model without
    idle layers enters every micro-batch at stage 0; what cannot bypass says so."""
    from dynabatch.pipeline.runtime import Bypass

    model = vlm_tiny(**TINY)  # layers: patch, 2 ViT, projector | merge, 2 GPT, head
    assert [model.idle_layers(s) for s in SHAPES] == [0, 4, 0, 4]
    assert Bypass.of(model, [0, 4, 8]).entries(SHAPES).tolist() == [0, 1, 0, 1]
    assert Bypass.of(model, [0, 2, 5, 8]).entries(SHAPES).tolist() == [0, 1, 0, 1]
    assert Bypass.of(model, [0, 5, 8]).entries(SHAPES).tolist() == [0, 0, 0, 0]  # the merge shares stage 0
    assert Bypass.of(model, [0, 1, 2, 3, 4, 8]).entries(SHAPES).tolist() == [0, 4, 0, 4]
    gpt = gpt_tiny(vocab=64, hidden=16, layers=2, heads=2)
    assert Bypass.of(gpt, [0, 2, 4]).entries([MicroBatchShape("padded", 2, 8)]).tolist() == [0]
    # enter(): the state at the merge embedding's input, as the idle vision layers leave it
    b = model.random_batch(SHAPES[1], torch.Generator().manual_seed(0))
    state = model.enter(b, 4)
    x = model.layers[0](b)
    for layer in model.layers[1:4]:
        x = layer(x)
    assert len(state) == 4 and state[0].shape[0] == 0 and all(torch.equal(u, v) for u, v in zip(state[1:], x[1:]))
    with pytest.raises(ValueError, match="flushed steps only"):
        RunnerConfig(bypass_idle_stages=True, flush=False)
    with pytest.raises(ValueError, match="rise strictly from 0 to 8"):
        Bypass.of(model, [0, 4, 10])
    with pytest.raises(ValueError, match="idle_layers must be"):
        Bypass((0, 4, 8), lambda sh: 8, model.enter).entries(SHAPES)
