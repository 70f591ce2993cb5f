"""Packed batches on a Hugging Face causal LM: ``model(**model_inputs(packed))`` gives the padded
batch's loss and every sample's own logits (no attention or loss across samples)."""

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (Hugging Face models)")

import dynabatch
from dynabatch.loader.collate import IGNORE_INDEX, collate_packed, collate_padded, count_label_tokens, model_inputs
from tokenization import EncodedSample, Formatter
from dynabatch import Costing, PlanOptions, Tokenization

TOL = dict(rtol=1e-5, atol=1e-6)  # float64 model; eager attention takes its softmax in float32


def tiny_llama(attn: str = "sdpa"):
    """Randomly initialised 2-layer Llama (hidden 64, 4 heads, vocab 300), float64, eval mode;
    ``config.use_cache`` keeps its default (True)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                                   attn_implementation=attn)
    return transformers.LlamaForCausalLM(cfg).to(torch.float64).eval()


def byte_samples() -> list[EncodedSample]:
    """Prompt/response samples (prompt masked) and plain-text samples (every label trained)."""
    fmt = Formatter("bytes", family="decoder")
    recs = [("2+2=", "4"), ("the quick brown fox", ""), ("hi", "hello there"), ("", "abc"),
            ("translate: chat", "cat"), ("a much longer plain text sample with several words", "")]
    return fmt.encode_batch([{"sample_id": i, "inputs": p, "targets": t} for i, (p, t) in enumerate(recs)])


def alone(model, ids, labels):
    """(logits [n, V], summed loss, loss terms) of one sample run by itself."""
    ids = torch.as_tensor(np.asarray(ids, np.int64))[None]
    lab = torch.as_tensor(np.asarray(labels, np.int64))[None].clone()
    lab[0, 0] = IGNORE_INDEX  # never predicted (the shift drops it) and masked by the collators
    out = model(ids, labels=lab, use_cache=False)
    terms = int((lab[0, 1:] != IGNORE_INDEX).sum())
    return out.logits[0], out.loss * terms, terms


def reference_mean_loss(model, encs) -> float:
    sums = [alone(model, e.input_ids, e.labels)[1:] for e in encs]
    return sum(s for s, _ in sums) / sum(n for _, n in sums)


def test_packed_keys_match_data_collator_with_flattening():
    encs = byte_samples()
    packed = collate_packed(encs)
    hf = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": e.input_ids.tolist(), "labels": e.labels.tolist()} for e in encs])
    for k in ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        assert type(packed[k]) is type(hf[k]), k
        if isinstance(hf[k], torch.Tensor):
            assert packed[k].dtype == hf[k].dtype and torch.equal(packed[k], hf[k]), k
        else:
            assert packed[k] == hf[k], k
    # HF's labels: -100 separator, then labels[1:] of every sample
    assert torch.equal(packed["labels"], hf["labels"])
    assert torch.equal(packed["cu_seqlens"], packed["cu_seq_lens_q"]) and packed["max_seqlen"] == packed["max_length_q"]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_and_logits_equal_padded_and_alone(attn):
    model = tiny_llama(attn)
    encs = byte_samples()
    packed = collate_packed(encs)
    padded = collate_padded(encs, pad_id=0, pad_to_multiple_of=8)
    inputs = model_inputs({**packed, "step": 0, "sample_ids": torch.arange(len(encs))})
    assert set(inputs) == {"input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                           "max_length_q", "max_length_k", "use_cache"}
    assert inputs["use_cache"] is False
    with torch.no_grad():
        out_p = model(**inputs)
        out_d = model(**model_inputs(padded))
        ref = reference_mean_loss(model, encs)
        # both are means over the loss tokens of the whole micro-batch; the counts agree
        assert count_label_tokens(packed) == count_label_tokens(padded)
        torch.testing.assert_close(out_p.loss, out_d.loss, **TOL)
        torch.testing.assert_close(out_p.loss, ref, **TOL)
        cu = packed["cu_seqlens"].tolist()
        for k, e in enumerate(encs):
            logits = alone(model, e.input_ids, e.labels)[0]
            torch.testing.assert_close(out_p.logits[0, cu[k]:cu[k + 1]], logits, **TOL)
            torch.testing.assert_close(out_d.logits[k, : len(e.input_ids)], logits, **TOL)


def test_packed_without_boundaries_gives_another_loss():
    """What the test above catches: a packed row without restarting positions, or with a KV cache
    (``config.use_cache`` defaults to True), or without the first-label separator, attends or
    predicts across samples."""
    model = tiny_llama("sdpa")
    encs = byte_samples()
    packed = collate_packed(encs)
    with torch.no_grad():
        ref = reference_mean_loss(model, encs)
        good = model(**model_inputs(packed)).loss
        torch.testing.assert_close(good, ref, **TOL)
        bare = model(input_ids=packed["input_ids"], labels=packed["labels"]).loss
        cached = model(**{k: v for k, v in model_inputs(packed).items() if k != "use_cache"}).loss
        leak = model(**model_inputs(collate_packed(encs, mask_first_label=False))).loss
    for bad in (bare, cached, leak):
        assert abs(float(bad) - float(ref)) > 1e-3


def test_dataloader_packed_steps_on_llama(tmp_path):
    """End to end: JSONL -> DataLoader(collate="packed").steps() -> LlamaForCausalLM; the summed
    per-token-normalized loss of each step equals the per-sample reference."""
    rng = np.random.default_rng(0)
    recs = []
    for i in range(24):
        body = "".join(rng.choice(list("abcdefgh "), int(rng.integers(3, 40))))
        recs.append({"inputs": f"q{i} {body}", "targets": "" if i % 4 == 3 else "y" * int(rng.integers(1, 9))})
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    loader = dynabatch.DataLoader(str(path), options=PlanOptions(num_stages=2, global_batch_tokens=600, max_len=128),
                                  tokenization=Tokenization(tokenizer="bytes"),
                                  costing=Costing(collate="packed", cost_model="gpt", device="cpu"))
    fmt = Formatter("bytes", family="decoder")
    model = tiny_llama("sdpa")
    seen, multi_sample, multi_mb = [], 0, 0
    with torch.no_grad():
        for step in loader.steps():
            multi_mb += len(step) > 1
            total, ref_sum, ref_terms = 0.0, 0.0, 0
            for mb in step:
                ids = mb["sample_ids"].tolist()
                multi_sample += len(ids) > 1
                seen += ids
                # HF's loss with num_items_in_batch: summed over the micro-batch, / the step's loss tokens
                total += model(**model_inputs(mb), num_items_in_batch=mb["step_target_tokens"]).loss
                encs = fmt.encode_batch([{"sample_id": s, **recs[s]} for s in ids])
                cu = mb["cu_seqlens"].tolist()
                for k, e in enumerate(encs):
                    assert mb["input_ids"][0, cu[k]:cu[k + 1]].tolist() == e.input_ids.tolist()
                    _, s, n = alone(model, e.input_ids, e.labels)
                    ref_sum, ref_terms = ref_sum + s, ref_terms + n
            assert ref_terms == step[0]["step_target_tokens"] == sum(count_label_tokens(mb) for mb in step)
            torch.testing.assert_close(total, ref_sum / ref_terms, **TOL)
    assert sorted(seen) == list(range(len(recs)))
    assert multi_sample and multi_mb  # several samples share a row; several micro-batches per step
