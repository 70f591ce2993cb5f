"""Conversations rendered with a Jinja chat template (the tokenizer's own or a given one), loss on the
assistant turns only: exact ids and labels on both mask paths ({% generation %} masks and the
rendered-prefix diff), tools and tool turns, images, truncation, the plain fallback's warning, and the
length scan counting what the formatter makes."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest

from tokenization import (IGNORE_INDEX, ByteTokenizer, ChatTemplate, ChatTemplateWarning, FixedResolution,
                          FormatConfig, Formatter, SampleError, count_labels, scan_shapes)

pytest.importorskip("transformers", reason="chat templates need transformers")
pytest.importorskip("tokenizers", reason="the test tokenizer needs tokenizers")

from chat_tokenizers import GEN, IMAGE_ID, NO_GEN, PARTS, TOOLS, UNSTABLE, VOCAB, ids, make_tokenizer  # noqa: E402

M = IGNORE_INDEX
CHAT = [
    {"role": "system", "content": "the"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "how are you"},
    {"role": "assistant", "content": "fine thanks"},
]
# "<s> <|system|> the <|end|> <|user|> hi <|end|> <|assistant|>" masked, "hello <|end|>" trained, ...
CHAT_IDS = ids("<s> <|system|> the <|end|> <|user|> hi <|end|> <|assistant|> hello <|end|> "
               "<|user|> how are you <|end|> <|assistant|> fine thanks <|end|>")
CHAT_LABELS = [M] * 8 + ids("hello <|end|>") + [M] * 6 + ids("fine thanks <|end|>")
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "paris"}}}
TOOL_CHAT = [
    {"role": "user", "content": "what is the weather in paris"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "sunny"},
]


def chat(i=1, messages=CHAT, **extra):
    return {"sample_id": i, "key": f"c{i}", "messages": messages, **extra}


@pytest.fixture(scope="module")
def gen_tok():
    return make_tokenizer(GEN)


@pytest.fixture(scope="module")
def bare_tok():
    return make_tokenizer(None)


def both_paths(gen_tok, bare_tok, **kw):
    """The tokenizer's own {% generation %} template, and the same template without markers given
    as chat_template= to a tokenizer without one (rendered-prefix diff)."""
    own, given = Formatter(gen_tok, **kw), Formatter(bare_tok, chat_template=NO_GEN, **kw)
    assert (own.chat.kind, own.chat.masks, given.chat.kind, given.chat.masks) == ("tokenizer", True, "given", False)
    return own, given


def test_both_mask_paths_give_the_exact_ids_and_assistant_only_labels(gen_tok, bare_tok):
    for f in both_paths(gen_tok, bare_tok):
        e = f.encode(chat())
        assert e.input_ids.tolist() == CHAT_IDS and e.labels.tolist() == CHAT_LABELS
        assert (e.input_tokens, e.target_tokens, e.truncated, e.target_ids) == (14, 5, False, None)
        assert e.input_ids.dtype == np.int32 and e.labels.dtype == np.int32
    # the ids are transformers' own apply_chat_template ids
    assert gen_tok.apply_chat_template(CHAT, tokenize=True, return_dict=False) == CHAT_IDS


def test_mask_paths_agree_on_random_conversations(gen_tok, bare_tok):
    rng = np.random.default_rng(0)
    words = ["a", "b", "c", "d", "e", "hi", "the"]
    samples = []
    for i in range(40):
        turns = [{"role": "system", "content": "the"}] if i % 3 == 0 else []
        for k in range(int(rng.integers(1, 5))):
            for role in ("user", "assistant"):
                turns.append({"role": role, "content": " ".join(rng.choice(words, int(rng.integers(1, 6))))})
        samples.append(chat(i, turns if i % 4 else turns[:-1]))  # some end on a user turn: nothing trained there
    own, given = both_paths(gen_tok, bare_tok)
    for a, b, s in zip(own.encode_batch(samples), given.encode_batch(samples), samples):
        assert a.input_ids.tolist() == b.input_ids.tolist() and a.labels.tolist() == b.labels.tolist()
        # reference: the trained tokens are exactly each assistant turn's content + <|end|>
        want = [t for m in s["messages"] if m["role"] == "assistant" for t in ids(m["content"] + " <|end|>")]
        assert a.labels[a.labels != M].tolist() == want


@pytest.mark.parametrize("where", ["top", "meta"])
def test_tools_and_tool_turns(gen_tok, bare_tok, where):
    extra = {"tools": TOOLS} if where == "top" else {"meta": {"tools": TOOLS}}  # loaders put extra fields in meta
    want_ids = ids("<s> <|system|> tools get_weather <|end|> <|user|> what is the weather in paris <|end|> "
                   "<|assistant|> get_weather city paris <|end|> <|tool|> sunny <|end|> <|assistant|> sunny <|end|>")
    want_labels = [M] * 14 + ids("get_weather city paris <|end|>") + [M] * 4 + ids("sunny <|end|>")
    for f in both_paths(gen_tok, bare_tok):
        e = f.encode(chat(messages=TOOL_CHAT, **extra))
        assert e.input_ids.tolist() == want_ids and e.labels.tolist() == want_labels
        without = f.encode(chat(messages=TOOL_CHAT))  # no tools: no tools block
        assert without.input_ids.tolist() == want_ids[:1] + want_ids[5:]
    # a batch mixing tool sets is rendered group by group, each with its own tools
    out = Formatter(gen_tok).encode_batch([chat(0, TOOL_CHAT, **extra), chat(1), chat(2, TOOL_CHAT)])
    assert [len(e.input_ids) for e in out] == [len(want_ids), len(CHAT_IDS), len(want_ids) - 4]


def test_plain_format_refuses_tools_and_tool_turns():
    plain = Formatter(ByteTokenizer(), chat_template="plain")
    with pytest.raises(SampleError, match="'c1'.*tools.*plain ChatTemplate cannot render"):
        plain.encode(chat(messages=CHAT[:3], tools=TOOLS))
    with pytest.raises(SampleError, match="unknown message role 'tool'.*Jinja chat template"):
        plain.encode(chat(messages=[TOOL_CHAT[0], {"role": "tool", "content": "x"}]))
    with pytest.raises(SampleError, match="message 1 has tool_calls"):
        plain.encode(chat(messages=TOOL_CHAT[:2]))


def test_which_template_is_said_and_the_plain_fallback_warns(gen_tok, bare_tok, caplog):
    caplog.set_level(logging.INFO, logger="tokenization")
    Formatter(gen_tok).encode(chat())
    assert "tokenizer chat template sha256:" in caplog.text and "generation masks" in caplog.text
    with pytest.warns(ChatTemplateWarning, match="has no chat template.*plain format.*chat_template='plain'"):
        e = Formatter(bare_tok).encode(chat(messages=CHAT[1:3]))
    enc = lambda text: bare_tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert e.input_ids.tolist() == enc("User: hi\nAssistant: ") + enc("hello") + [bare_tok.eos_token_id]
    plain = Formatter(bare_tok, chat_template="plain")
    assert plain.encode(chat(messages=CHAT[1:3])).input_ids.tolist() == e.input_ids.tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # chosen explicitly, or no conversation: no warning
        Formatter(bare_tok, chat_template="plain").encode(chat(messages=CHAT[1:3]))
        Formatter(bare_tok, chat_template=ChatTemplate(user_prefix="U ")).encode(chat(messages=CHAT[1:3]))
        Formatter(bare_tok).encode({"sample_id": 0, "inputs": "hi", "targets": "hello"})
    assert Formatter(bare_tok).chat.record() == f"plain {ChatTemplate()!r}"
    assert "given chat template" in Formatter(bare_tok, chat_template=NO_GEN).chat.record()


def test_template_option_errors(gen_tok, bare_tok):
    with pytest.raises(ValueError, match="'tokenizer' but tokenizer .* has no chat template"):
        Formatter(bare_tok, chat_template="tokenizer")
    with pytest.raises(ValueError, match="needs a transformers tokenizer.*'bytes'"):
        Formatter(ByteTokenizer(), chat_template=GEN)
    with pytest.raises(ValueError, match="encoder_decoder"):
        Formatter(gen_tok, family="encoder_decoder", chat_template="tokenizer")
    with pytest.raises(ValueError, match="not a Jinja template"):
        FormatConfig(chat_template="templates/chat.jinja")
    with pytest.raises(TypeError, match="chat_template must be"):
        FormatConfig(chat_template=3)
    # encoder-decoder with the tokenizer's template by default: the plain format, said with a warning
    with pytest.warns(ChatTemplateWarning, match="encoder-decoder"):
        e = Formatter(gen_tok, family="encoder_decoder").encode(chat(messages=CHAT[1:3]))
    assert e.target_ids.tolist()[-1] == gen_tok.eos_token_id


def test_a_template_whose_prefixes_differ_is_a_clear_sample_error(gen_tok):
    f = Formatter(gen_tok, chat_template=UNSTABLE)
    assert not f.chat.masks
    with pytest.raises(SampleError, match="'c1'.*message 2.*not a prefix.*generation"):
        f.encode(chat())
    out = f.encode_batch([chat(), {"sample_id": 2, "inputs": "hi", "targets": "hello"}], on_error="skip")
    assert out[0] is None and out[1] is not None
    # a template that refuses a conversation names the sample; the rest of the batch is rendered
    strict = GEN.replace("{{ bos_token }}", "{% if messages[0].role == 'tool' %}{{ raise_exception('no') }}"
                                            "{% endif %}{{ bos_token }}")
    bad = chat(5, [{"role": "tool", "content": "sunny"}, *CHAT[1:3]])
    out = Formatter(gen_tok, chat_template=strict).encode_batch([bad, chat()], on_error="skip")
    assert out[0] is None and out[1].input_ids.tolist() == CHAT_IDS
    with pytest.raises(SampleError, match="'c5'.*chat template cannot render it"):
        Formatter(gen_tok, chat_template=strict).encode(bad)


@pytest.mark.parametrize("side", ["right", "left"])
def test_truncation_by_position_and_one_bos(gen_tok, bare_tok, side):
    for f in both_paths(gen_tok, bare_tok, max_total_tokens=10, truncation_side=side, add_bos=True):
        e = f.encode(chat())
        if side == "right":
            want_ids, want_labels = CHAT_IDS[:10], CHAT_LABELS[:10]
        else:  # BOS (the template's, kept once by add_bos) then the last 9 tokens
            want_ids, want_labels = CHAT_IDS[:1] + CHAT_IDS[-9:], [M] + CHAT_LABELS[-9:]
        assert e.input_ids.tolist() == want_ids and e.labels.tolist() == want_labels and e.truncated
        assert e.input_tokens + e.target_tokens == 10


def test_image_placeholders_in_a_conversation(gen_tok):
    vision = FixedResolution(tokens_per_image=3)
    img = {"images": [{"path": "unused.png"}], "image_sizes": [(64, 48)]}
    msgs = [{"role": "user", "content": "<image> what is the weather"}, {"role": "assistant", "content": "sunny"}]
    f = Formatter(gen_tok, vision=vision, image_token_id=IMAGE_ID)
    e = f.encode(chat(messages=msgs, **img))
    head = ids("<s> <|user|>")
    rest = ids("what is the weather <|end|> <|assistant|> sunny <|end|>")
    assert e.input_ids.tolist() == head + [IMAGE_ID] * 3 + rest
    assert e.labels.tolist() == [M] * 11 + ids("sunny <|end|>")
    assert (e.input_tokens, e.target_tokens, e.vision_tokens) == (8, 2, 3)
    # no marker: the run goes first (after BOS); without placeholders "<image>" is the tokenizer's own token
    e = f.encode(chat(messages=[{"role": "user", "content": "hi"}, msgs[1]], **img))
    assert e.input_ids.tolist()[:5] == ids("<s>") + [IMAGE_ID] * 3 + ids("<|user|>")
    e = Formatter(gen_tok, vision=vision).encode(chat(messages=msgs, **img))
    assert e.input_ids.tolist()[:3] == head + [IMAGE_ID] and e.vision_tokens == 3
    with pytest.raises(SampleError, match="marker in a response/assistant turn"):
        f.encode(chat(messages=[msgs[0], {"role": "assistant", "content": "<image> a"}], **img))
    # contents as parts ({"type": "image"}) for a vision-language template
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is the"}]},
             {"role": "assistant", "content": "a b"}]
    e = Formatter(gen_tok, vision=vision, image_token_id=IMAGE_ID, chat_template=PARTS).encode(
        chat(messages=parts, **img))
    assert e.input_ids.tolist() == head + [IMAGE_ID] * 3 + ids("what is the <|end|> <|assistant|> a b <|end|>")
    # a tokenizer whose rendering of "<image>" is not image_token_id cannot place the runs
    with pytest.raises(SampleError, match="render to 0 image_token_id"):
        Formatter(gen_tok, vision=vision, image_token_id=len(VOCAB)).encode(chat(messages=msgs, **img))


def test_scan_lengths_equal_the_encoded_lengths(gen_tok, bare_tok):
    vision = FixedResolution(tokens_per_image=3)
    rng = np.random.default_rng(1)
    samples = []
    for i in range(30):
        if i % 5 == 0:
            samples.append({"sample_id": i, "inputs": "what is the weather", "targets": "sunny"})
            continue
        msgs = [dict(m) for m in (TOOL_CHAT if i % 3 == 0 else CHAT)[: int(rng.integers(2, 6))]]
        extra = {"tools": TOOLS} if i % 3 == 0 else {}
        if i % 7 == 0:
            msgs[0] = {"role": msgs[0]["role"], "content": "<image> " + msgs[0]["content"]}
            extra |= {"images": [{"path": "x.png"}], "image_sizes": [(10, 10)]}
        samples.append(chat(i, msgs, **extra))
    for tok, template in ((gen_tok, None), (bare_tok, NO_GEN)):
        for limit in (None, 12):
            kw = dict(max_total_tokens=limit, add_bos=True, chat_template=template, image_token_id=IMAGE_ID)
            cfg = FormatConfig(**kw)
            encs = Formatter(tok, cfg, vision=vision).encode_batch(samples)
            table = scan_shapes(samples, tok, vision=vision, batch_size=7, label_config=cfg, keep_ids=True, **kw)
            got = table.to_pydict()
            assert got["input_tokens"] == [e.input_tokens for e in encs]
            assert got["target_tokens"] == [e.target_tokens for e in encs]
            assert got["vision_tokens"] == [e.vision_tokens for e in encs]
            lengths = [a + b + c for a, b, c in zip(got["input_tokens"], got["target_tokens"], got["vision_tokens"])]
            assert lengths == [len(e.input_ids) for e in encs]
            assert got["cached_input_ids"] == [e.input_ids.tolist() for e in encs]
            assert got["cached_second_ids"] == [e.labels.tolist() for e in encs]
            labels = np.concatenate([e.labels for e in encs])
            assert got["label_tokens"] == count_labels(labels, [len(e.labels) for e in encs], "decoder").tolist()
    with pytest.raises(ValueError, match="render conversations alike"):
        scan_shapes(samples, gen_tok, label_config=FormatConfig(chat_template="plain"))
