"""Tiny random Hugging Face configs (built from the ``transformers`` config classes, nothing downloaded)
shared by the Hugging Face adapter tests and their gloo workers. No tests are defined here."""

from __future__ import annotations

import torch

TEXT = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=4)


def decoder_config(family: str, **over):
    """A tiny causal-LM config of ``family`` (llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3, phi3); sliding
    windows of 4 tokens where the family has them, so the per-layer masks matter (not Gemma2: its eager
    attention gives NaN on the padding rows when a query sees only padding in its window, in the Hugging
    Face model itself)."""
    import transformers as tf

    cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config,
           "gemma": tf.GemmaConfig, "gemma2": tf.Gemma2Config, "gemma3": tf.Gemma3TextConfig,
           "phi3": tf.Phi3Config}[family]
    kw = dict(TEXT)
    if family in ("mistral", "gemma3"):
        kw["sliding_window"] = 4
    if family == "gemma3":
        kw["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    if family == "qwen2":
        kw.update(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    if family == "phi3":
        kw.update(pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=512,
                  original_max_position_embeddings=512)
    kw.update(over)
    cfg = cls(**kw)
    cfg._attn_implementation = "eager" if family == "gemma2" else over.get("attn_implementation", "sdpa")
    return cfg


def t5_config(**over):
    """A tiny T5 config (2 encoder and 3 decoder blocks, 8 relative-position buckets, no dropout)."""
    from transformers import T5Config

    kw = dict(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=3, num_heads=4,
              dropout_rate=0.0, relative_attention_num_buckets=8, relative_attention_max_distance=16,
              decoder_start_token_id=0, pad_token_id=0)
    kw.update(over)
    return T5Config(**kw)


def build(config, seed: int = 0, dtype=torch.float64):
    """The Hugging Face model of ``config``, seeded, in ``dtype``."""
    from dynabatch.pipeline.models.hf import build_model

    torch.manual_seed(seed)
    return build_model(config, empty=False, dtype=dtype)


def grad_gap(model, ref, layers=None) -> tuple[float, float]:
    """(largest |grad - reference grad|, largest |reference grad|) over every parameter of the layered
    ``model``'s ``layers`` (default all) against the Hugging Face model ``ref``, matched by state-dict name."""
    named = dict(ref.named_parameters())
    diff = scale = 0.0
    for i in (range(len(model.layers)) if layers is None else layers):
        layer = model.layers[i]
        for path, key in model.param_keys(i).items():
            p, q = layer.get_parameter(path), named[key]
            if p.is_meta:
                continue
            if p.grad is None or q.grad is None:  # unused (LLaVA's ViT layers past the feature layer): both
                assert p.grad is None and q.grad is None, (i, path)
                continue
            diff = max(diff, float((p.grad - q.grad).abs().max()))
            scale = max(scale, float(q.grad.abs().max()))
    return diff, scale


def llava_config(**over):
    """A tiny LLaVA config: CLIP ViT (3 layers, 28 px tiles of 14 px patches: 4 patches + class token; the
    features from layer 2 of 3), Llama text model, image placeholder id 63 (the last id)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                              image_size=28, patch_size=14, projection_dim=16)
    text = LlamaConfig(**{**TEXT, "num_hidden_layers": 2})
    kw = dict(vision_config=vision, text_config=text, image_token_id=63, vision_feature_layer=-2,
              vision_feature_select_strategy="default", projector_hidden_act="gelu")
    kw.update(over)
    return LlavaConfig(**kw)


def bart_config(**over):
    """A tiny BART config (2 encoder and 2 decoder layers, no dropout or layerdrop)."""
    from transformers import BartConfig

    kw = dict(vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
              dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, decoder_start_token_id=2,
              scale_embedding=True)
    kw.update(over)
    return BartConfig(**kw)


def seq2seq_samples(vocab: int, dims, rng) -> list:
    """`EncodedSample` s of (input tokens, target tokens) ``dims``, ids drawn by ``rng`` from 3..vocab-1 (no
    pad, start or end id of the tiny configs)."""
    import numpy as np

    from tokenization import EncodedSample

    return [EncodedSample(i, rng.integers(3, vocab, n).astype(np.int32), rng.integers(3, vocab, t).astype(np.int32),
                          None, n, t, 0, False) for i, (n, t) in enumerate(dims)]


def seq2seq_microbatches(config, rows, seed: int) -> tuple[list, list]:
    """Micro-batches of an encoder-decoder ``config``, ``rows[k]`` random samples in micro-batch ``k`` (inputs
    of 2-9 tokens, targets of 1-7), collated ``packed`` and ``padded``: (packed, padded) lists of dicts of
    the same samples (the padded ones are what the Hugging Face model's own forward takes)."""
    import numpy as np

    from dynabatch.loader.collate import collate_packed, collate_padded

    rng = np.random.default_rng(seed)
    kw = dict(family="encoder_decoder", pad_id=int(config.pad_token_id),
              decoder_start_token_id=int(config.decoder_start_token_id))
    packed, padded = [], []
    for n in rows:
        dims = [(int(rng.integers(2, 10)), int(rng.integers(1, 8))) for _ in range(n)]
        samples = seq2seq_samples(int(config.vocab_size), dims, rng)
        packed.append(collate_packed(samples, **kw))
        padded.append(collate_padded(samples, **kw))
    return packed, padded
