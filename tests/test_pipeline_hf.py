"""Hugging Face adapters in one process: the layered model's loss and every gradient equal the Hugging
Face model's own forward/backward (float64) for padded and packed micro-batches; packed rows keep
their samples apart; T5's boundary carries no quadratic tensor; ties are one Parameter; refusals
name the class and what is missing; a stage loads only its weights from safetensors."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_tiny import bart_config, build, decoder_config, grad_gap, t5_config  # noqa: E402

from dynabatch.pipeline.models import MicroBatchShape  # noqa: E402
from dynabatch.pipeline import sequential_step  # noqa: E402
from dynabatch.pipeline.models.hf import UnsupportedModel, from_hf, hf_reference_step, parameter_bytes  # noqa: E402

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"]
PADDED = [MicroBatchShape("padded", 3, 10), MicroBatchShape("padded", 2, 13)]
PACKED = [MicroBatchShape("packed", 3, 9, tokens=17), MicroBatchShape("packed", 2, 8, tokens=11)]


def _batches(model, shapes, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [model.random_batch(s, gen) for s in shapes]


def _check_equal(model, ref, batches):
    loss, n = sequential_step(model.layers, batches)
    ref_loss, ref_n = hf_reference_step(ref, batches)
    assert n == ref_n > 0
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    diff, scale = grad_gap(model, ref)
    assert scale > 0 and diff <= 1e-8 * scale, (diff, scale)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shapes", [PADDED, PACKED], ids=["padded", "packed"])
def test_decoder_equals_hugging_face_forward_backward(family, shapes):
    """Every decoder family (sliding windows, soft-capping, scaled embeddings, tied or not): loss and every
    gradient of the layered model equal the Hugging Face model's own, float64."""
    hf = build(decoder_config(family))
    ref = copy.deepcopy(hf)
    model = from_hf(hf)
    assert len(model.layers) == hf.config.num_hidden_layers + 2
    _check_equal(model, ref, _batches(model, shapes))


def _unpack(batch):
    """The padded twin of a packed micro-batch: one row per sample (labels keep their -100s)."""
    cu = batch["cu_seqlens"].tolist()
    L = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    rows = len(cu) - 1
    ids = torch.zeros(rows, L, dtype=torch.long)
    lab = torch.full((rows, L), -100, dtype=torch.long)
    mask = torch.zeros(rows, L, dtype=torch.long)
    for r, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        ids[r, :b - a] = batch["input_ids"][0, a:b]
        lab[r, :b - a] = batch["labels"][0, a:b]
        mask[r, :b - a] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_packed_rows_do_not_attend_across_samples(family):
    """A packed micro-batch gives the same loss as its samples padded one per row (a token attending to
    another sample would change it); the state carries no [N, N] tensor."""
    model = from_hf(build(decoder_config(family)))
    packed = _batches(model, PACKED)
    loss_p, n_p = sequential_step(model.layers, packed)
    loss_u, n_u = sequential_step(model.layers, [_unpack(b) for b in packed])
    assert n_p == n_u and loss_p == pytest.approx(loss_u, rel=1e-10)
    state = model.layers[0](packed[0])
    assert [list(t.shape) for t in state] == [[1, 17, 16], [1, 17], [4]]


def test_t5_equals_hugging_face_and_sends_no_bias():
    """T5 (eager and SDPA): loss and gradients equal the model's own; a stack's first block on a stage
    computes the relative bias from the stage's table and the stage's later blocks reuse it from the state,
    but what a stage ending at any layer sends (`stage_output`) is the hidden states and [R, L]/[R, T]
    masks, as measured."""
    for impl in ("eager", "sdpa"):
        cfg = t5_config()
        cfg._attn_implementation = impl
        hf = build(cfg)
        ref = copy.deepcopy(hf)
        model = from_hf(hf)
        shapes = [MicroBatchShape("padded", 3, 10, 6), MicroBatchShape("padded", 2, 7, 9)]
        batches = _batches(model, shapes)
        batches[0]["decoder_attention_mask"] = (batches[0]["labels"] != -100).long()
        _check_equal(model, ref, batches)
    shape = MicroBatchShape("padded", 3, 40, 24)
    batch = model.random_batch(shape, torch.Generator().manual_seed(0))
    state = model.layers[0](batch)
    for i, layer in enumerate(model.layers[1:-1], start=1):
        state = layer(state)
        block = "Block" in type(layer).__name__  # a block leaves its stack's bias in the state, for this stage
        n = 24 if i > 3 else 40  # decoder blocks follow the encoder end (layer 3)
        assert [list(t.shape) for t in state[4:]] == ([[1, 4, n, n]] if block else [])
        out = layer.stage_output(state)
        specs = model.boundary(shape, i)
        assert all(s.matches(t) for s, t in zip(specs, out)) and len(specs) == len(out)
        sent = sum(t.numel() * t.element_size() for t in out)
        assert sent == sum(s.nbytes for s in specs) == 3 * (40 + 24) * (16 * 8 + 8)


def test_t5_blocks_recomputed_carry_the_stage_bias_through_their_checkpoints():
    """A T5 stage whose blocks run under activation recomputation (`PipelineStage(recompute=k)`: the state,
    the stage's bias in it, is what each checkpoint keeps and replays) gives the loss and every gradient of
    the stage without recomputation, bit for bit."""
    from dynabatch.pipeline.models import PipelineStage  # noqa: E402

    hf = build(t5_config())
    model = from_hf(hf)
    batch = model.random_batch(MicroBatchShape("padded", 3, 10, 6), torch.Generator().manual_seed(0))
    runs = []
    for recompute in (0, 2, 6):  # none, the encoder's blocks, every block and the encoder end
        hf.zero_grad(set_to_none=True)
        loss, _ = PipelineStage(model.layers, 0, len(model.layers), recompute=recompute)(None, batch)
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in hf.parameters()]))
    for loss, grads in runs[1:]:
        assert torch.equal(loss, runs[0][0]) and all(torch.equal(a, b) for a, b in zip(grads, runs[0][1]))


def test_bart_equals_hugging_face():
    """BART (scaled embeddings, learned positions, a non-zero final_logits_bias buffer): loss and gradients
    equal the model's own; the shared embedding is one tie over the embedding layer and the head."""
    hf = build(bart_config())
    with torch.no_grad():
        hf.final_logits_bias.normal_()
    ref = copy.deepcopy(hf)
    model = from_hf(hf)
    assert len(model.layers) == 6 and model.buffer_keys[-1] == {"final_logits_bias": "final_logits_bias"}
    assert [i for i, _ in model.tied_parameters()["model.shared.weight"]] == [0, 5]
    batches = _batches(model, [MicroBatchShape("padded", 3, 10, 6), MicroBatchShape("padded", 2, 7, 9)])
    batches[0]["decoder_attention_mask"] = (batches[0]["labels"] != -100).long()
    _check_equal(model, ref, batches)


def test_ties_are_one_parameter_and_listed():
    """Tied Llama: the embedding and the head hold one Parameter, listed under its state-dict name; untied:
    no tie. T5: the shared embedding and both relative bias tables, with every block as a holder."""
    tied = from_hf(build(decoder_config("llama", tie_word_embeddings=True)))
    ties = tied.tied_parameters()
    assert ties == {"model.embed_tokens.weight": [(0, "embed.weight"), (4, "lm_head.weight")]}
    assert tied.layers[0].embed.weight is tied.layers[4].lm_head.weight
    assert from_hf(build(decoder_config("llama", tie_word_embeddings=False))).tied_parameters() == {}
    t5 = from_hf(build(t5_config()))
    ties = t5.tied_parameters()
    enc = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    dec = "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert set(ties) == {"shared.weight", enc, dec}
    assert [i for i, _ in ties["shared.weight"]] == [0, 7]
    assert [i for i, _ in ties[enc]] == [1, 2] and [i for i, _ in ties[dec]] == [4, 5, 6]
    for name, holders in ties.items():
        params = {id(t5.layers[i].get_parameter(path)) for i, path in holders}
        assert len(params) == 1, name


def test_other_models_are_refused_with_what_is_missing():
    """A GPT-2 (no model.embed_tokens) and an nn.Sequential are refused naming the class and the missing part."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32))
    with pytest.raises(UnsupportedModel, match=r"GPT2LMHeadModel\.transformer is not a decoder-only.*no `embed_tokens`"):
        from_hf(gpt2)
    with pytest.raises(UnsupportedModel, match="Sequential is not a transformers model"):
        from_hf(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_packed_rows_layout_is_refused():
    """Rows holding several samples (collate='packed_rows') would attend across samples: a clear error."""
    model = from_hf(build(decoder_config("llama")))
    batch = _batches(model, PADDED)[0]
    batch["position_ids"] = torch.arange(10).expand(3, 10)
    with pytest.raises(ValueError, match="packed_rows"):
        model.layers[0](batch)


def test_a_stage_loads_only_its_weights(tmp_path):
    """A sharded save_pretrained folder: each stage materializes its layers only; its parameter bytes are its
    share plus the tied embedding; the stages' loss equals the whole model's; bad folders are named."""
    hf = build(decoder_config("llama", tie_word_embeddings=True, num_hidden_layers=4), dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    whole = from_hf(tmp_path)
    total = parameter_bytes(whole.layers)
    assert total == sum(p.numel() * 4 for p in hf.parameters())
    bounds = [0, 3, 6]
    ties = whole.tied_parameters()["model.embed_tokens.weight"]
    assert [i for i, _ in ties] == [0, 5]
    embed = hf.model.embed_tokens.weight.numel() * 4
    batch = whole.random_batch(MicroBatchShape("padded", 2, 9), torch.Generator().manual_seed(0))
    state = batch
    for s in range(2):
        layers = range(bounds[s], bounds[s + 1])
        stage = from_hf(tmp_path, layers=layers)
        got = parameter_bytes(stage.layers)
        keys = {k for i in layers for k in whole.param_keys(i).values()}
        want = sum(hf.get_parameter(k).numel() * 4 for k in keys)  # the stage's share, + the head's tied copy
        assert got == want and abs(got - want) <= 0.1 * want and got < 0.75 * total
        assert ("model.embed_tokens.weight" in keys) and (embed <= got)
        for i in layers:
            state = stage.layers[i](state) if i < 5 else stage.layers[i](state, batch)
    loss, _ = sequential_step(whole.layers, [batch])
    assert float(state[0].detach()) / int(state[1]) == pytest.approx(loss, rel=1e-6)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    (tmp_path / sorted(set(index["weight_map"].values()))[0]).unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        from_hf(tmp_path, layers=range(0, 3))


def test_weights_that_do_not_match_the_config_are_refused(tmp_path):
    """A folder whose tensors have other shapes than its config gives, or lack a layer, is a clear error."""
    hf = build(decoder_config("llama", num_hidden_layers=2), dtype=torch.float32)
    hf.save_pretrained(tmp_path)
    wider = decoder_config("llama", num_hidden_layers=2, intermediate_size=48)
    with pytest.raises(ValueError, match=r"mlp\..*shape .* the config gives"):
        from_hf(wider, weights=tmp_path)
    deeper = decoder_config("llama", num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"parameter\(s\) no stored tensor fills, e\.g\. \['model\.layers\.2\."):
        from_hf(deeper, weights=tmp_path)
    shallower = decoder_config("llama", num_hidden_layers=1)  # the weights have a layer the config lacks
    with pytest.raises(ValueError, match=r"num_hidden_layers=1\): 9 stored tensor\(s\) no layer of the config takes, "
                                         r"e\.g\. \['model\.layers\.1\."):
        from_hf(shallower, weights=tmp_path)
    state = {k: v for k, v in hf.state_dict().items()}
    model = from_hf(hf.config, weights=state, dtype=torch.float32)
    assert torch.equal(model.layers[1].block.mlp.up_proj.weight, hf.model.layers[0].mlp.up_proj.weight)


@pytest.mark.parametrize("family", ["llama", "t5", "bart"])
def test_stage_checkpoints_merge_into_a_loadable_folder(tmp_path, family):
    """Each stage (loaded alone from a folder) saves its part; merge_stages writes a save_pretrained folder
    whose from_pretrained model gives the same logits; a missing part or disagreeing tied copies are named."""
    from dynabatch.pipeline.models.hf import hf_inputs, merge_stages, save_stage

    cfg = {"t5": t5_config, "bart": bart_config}.get(family, lambda: decoder_config("llama", tie_word_embeddings=True))()
    hf = build(cfg, dtype=torch.float32)
    if family == "bart":  # a persistent buffer travels through the stage parts too
        with torch.no_grad():
            hf.final_logits_bias.normal_()
    hf.save_pretrained(tmp_path / "src")
    n = len(from_hf(hf).layers)
    bounds = [0, 2, n]
    for s in range(2):
        layers = range(bounds[s], bounds[s + 1])
        save_stage(from_hf(tmp_path / "src", layers=layers), layers, tmp_path / "ckpt", s, 2)
    out = merge_stages(tmp_path / "ckpt", tmp_path / "merged")
    back = type(hf).from_pretrained(out)
    batch = from_hf(hf).random_batch(MicroBatchShape("padded", 2, 7, 0 if family == "llama" else 5),
                                     torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(hf(**hf_inputs(batch)).logits, back(**hf_inputs(batch)).logits)
    # a tied copy that was updated on one stage only
    save_stage(from_hf(tmp_path / "src", layers=range(0, 2)), range(0, 2), tmp_path / "bad", 0, 2)
    other = from_hf(tmp_path / "src", layers=range(2, n))
    tie = next(iter(other.tied_parameters().values()))
    with torch.no_grad():
        other.layers[tie[-1][0]].get_parameter(tie[-1][1]).add_(1.0)
    save_stage(other, range(2, n), tmp_path / "bad", 1, 2)
    with pytest.raises(ValueError, match="differs between stage 0 and stage 1"):
        merge_stages(tmp_path / "bad", tmp_path / "m2")
    (tmp_path / "ckpt" / "stage-00001-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"lacks stage part\(s\) \['stage-00001-of-00002.safetensors'\]"):
        merge_stages(tmp_path / "ckpt", tmp_path / "m3")


def test_llava_equals_hugging_face_with_text_only_microbatches():
    """LLaVA (CLIP features from layer 2 of 3, class token dropped): image+text and text-only micro-batches
    with the image placeholders give the Hugging Face model's loss and gradients; the ViT layer past the
    feature layer is held (saved) but frozen: no gradient there either; text-only ones compute no vision."""
    from hf_tiny import llava_config

    hf = build(llava_config())
    ref = copy.deepcopy(hf)
    model = from_hf(hf)
    assert (len(model.layers), model.vision_layers, model.tile_tokens, model.image_token_id) == (8, 4, 4, 63)
    shapes = [MicroBatchShape("padded", 3, 20, tiles=4), MicroBatchShape("padded", 2, 9),
              MicroBatchShape("padded", 1, 12, tiles=2)]
    batches = _batches(model, shapes)
    assert model.batch_shapes(batches) == shapes
    assert [model.idle_layers(s) for s in shapes] == [0, 4, 0]
    _check_equal(model, ref, batches)
    assert "model.vision_tower.encoder.layers.2.mlp.fc1.weight" in model.param_keys(3).values()
    assert not any(p.requires_grad for p in model.layers[3].unused2.parameters())
    state = model.layers[0](batches[1])
    assert list(state[0].shape) == [0, 5, 16]
    for i in range(1, 4):
        state = model.layers[i](state)
        assert all(s.matches(t) for s, t in zip(model.boundary(shapes[1], i), state))
    bad = dict(batches[0], image_tiles=batches[0]["image_tiles"] * 0)
    with pytest.raises(ValueError, match="image_token_id"):
        model.layers[0](bad)


def test_cli_profile_of_a_hugging_face_folder(tmp_path, capsys):
    """`dynabatch profile --model hf:FOLDER` measures the real model's layers into a loadable cost model
    (its ModelConfig from the Hugging Face config); hf:config.json works too; a bad spec is refused."""
    from dynabatch.cli import main
    from dynabatch.core.cost import CostModel

    torch.set_num_threads(1)
    hf = build(decoder_config("qwen3"), dtype=torch.float32)
    hf.save_pretrained(tmp_path / "m")
    out = tmp_path / "c.json"
    argv = ["profile", "--model", f"hf:{tmp_path / 'm'}", "--out", str(out), "--rows", "1", "2", "--lengths", "8",
            "16", "--repeats", "1"]
    assert main(argv) == 0
    assert "written to" in capsys.readouterr().out
    cost = CostModel.load(out)
    assert cost.table.time_s.shape == (2, 2, 1) and (cost.table.time_s > 0).all()
    assert (cost.model.hidden, cost.model.kv_dim, cost.model.layers) == (16, 8, 3)
    assert main(argv[:2] + [f"hf:{tmp_path / 'm' / 'config.json'}"] + argv[3:]) == 0
    with pytest.raises(SystemExit):
        main(["profile", "--model", "llama", "--out", str(out)])
    assert main(["profile", "--model", f"hf:{tmp_path / 'nothing'}", "--out", str(out)]) == 2
    assert "no config.json" in capsys.readouterr().err
