"""Formatting for decoder-only and encoder-decoder models: masking, EOS, truncation, chat."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenization import IGNORE_INDEX, ByteTokenizer, ChatTemplate, FormatConfig, Formatter, SampleError

TOK = ByteTokenizer()  # byte b -> id b + 3; PAD 0, BOS 1, EOS 2
EOS, BOS, M = 2, 1, IGNORE_INDEX


def b(text: str) -> list[int]:
    """Byte-tokenizer ids of ``text``."""
    return [c + 3 for c in text.encode()]


def sample(inputs="ab", targets="cd", **kw):
    return {"sample_id": 7, "key": "s7", "inputs": inputs, "targets": targets, **kw}


CHAT = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "q"},
    {"role": "assistant", "content": "a"},
]


def test_decoder_masks_prompt_exactly():
    e = Formatter(TOK).encode(sample())
    # "ab" -> 100, 101 ; "cd" -> 102, 103 ; then EOS
    assert e.input_ids.tolist() == [100, 101, 102, 103, EOS]
    assert e.labels.tolist() == [M, M, 102, 103, EOS]
    assert e.target_ids is None
    assert (e.sample_id, e.input_tokens, e.target_tokens, e.vision_tokens, e.truncated) == (7, 2, 3, 0, False)
    assert e.input_ids.dtype == np.int32 and e.labels.dtype == np.int32


def test_decoder_bos_counts_as_masked_prompt():
    e = Formatter(TOK, add_bos=True).encode(sample())
    assert e.input_ids.tolist() == [BOS, 100, 101, 102, 103, EOS]
    assert e.labels.tolist() == [M, M, M, 102, 103, EOS]
    assert (e.input_tokens, e.target_tokens) == (3, 3)


def test_decoder_without_targets_is_language_modelling():
    e = Formatter(TOK, add_bos=True).encode(sample(targets=""))
    assert e.input_ids.tolist() == [BOS, 100, 101, EOS]
    assert e.labels.tolist() == [M, 100, 101, EOS]
    assert (e.input_tokens, e.target_tokens) == (3, 1)
    assert Formatter(TOK).encode({"sample_id": 1, "inputs": "x"}).labels.tolist() == [b("x")[0], EOS]


def test_encoder_decoder_appends_eos_to_targets_only():
    e = Formatter(TOK, family="encoder_decoder").encode(sample())
    assert e.input_ids.tolist() == [100, 101]
    assert e.target_ids.tolist() == [102, 103, EOS]
    assert e.labels is None
    assert (e.input_tokens, e.target_tokens) == (2, 3)
    e = Formatter(TOK, family="encoder_decoder", add_bos=True).encode(sample(targets=""))
    assert e.input_ids.tolist() == [BOS, 100, 101] and e.target_ids.tolist() == [EOS]


@pytest.mark.parametrize("family", ["decoder", "encoder_decoder"])
def test_input_truncation_right_and_left(family):
    s = sample(inputs="abcdef", targets="wxyz")
    right = Formatter(TOK, family=family, max_input_tokens=3).encode(s)
    left = Formatter(TOK, family=family, max_input_tokens=3, truncation_side="left").encode(s)
    if family == "decoder":
        assert right.input_ids.tolist() == b("abc") + b("wxyz") + [EOS]
        assert left.input_ids.tolist() == b("def") + b("wxyz") + [EOS]
        assert left.labels.tolist() == [M] * 3 + b("wxyz") + [EOS]
    else:
        assert right.input_ids.tolist() == b("abc") and left.input_ids.tolist() == b("def")
    assert right.truncated and left.truncated
    assert (right.input_tokens, right.target_tokens) == (3, 5)
    # with room to spare nothing is cut
    assert not Formatter(TOK, family=family, max_input_tokens=6, max_target_tokens=5).encode(s).truncated


def test_target_truncation_keeps_start_and_eos():
    s = sample(inputs="abcdef", targets="wxyz")
    e = Formatter(TOK, family="encoder_decoder", max_target_tokens=3, truncation_side="left").encode(s)
    assert e.target_ids.tolist() == b("wx") + [EOS]  # targets keep their start whatever the side
    assert e.truncated and e.target_tokens == 3


def test_total_limit_cuts_input_first_then_target():
    s = sample(inputs="abcdef", targets="wxyz")  # 6 input tokens, 4 + EOS target tokens
    # 8 total: the target (5) fits, the input keeps 3
    e = Formatter(TOK, max_total_tokens=8).encode(s)
    assert e.input_ids.tolist() == b("abc") + b("wxyz") + [EOS]
    assert (e.input_tokens, e.target_tokens, e.truncated) == (3, 5, True)
    # 4 total: the input is gone and the target keeps 3 tokens + EOS
    e = Formatter(TOK, max_total_tokens=4, truncation_side="left").encode(s)
    assert e.input_ids.tolist() == b("wxy") + [EOS]
    assert e.labels.tolist() == b("wxy") + [EOS]
    # with BOS: BOS is always kept and counts towards the input
    e = Formatter(TOK, family="encoder_decoder", add_bos=True, max_total_tokens=6).encode(s)
    assert e.input_ids.tolist() == [BOS] and e.target_ids.tolist() == b("wxyz") + [EOS]


def test_conversation_masks_user_turns():
    e = Formatter(TOK).encode({"sample_id": 3, "key": "c", "messages": CHAT})
    # template: "User: hi\nAssistant: " (masked) "yo" EOS (trained) "User: q\nAssistant: " (masked) "a" EOS
    p1, p2 = b("User: hi\nAssistant: "), b("User: q\nAssistant: ")
    assert e.input_ids.tolist() == p1 + b("yo") + [EOS] + p2 + b("a") + [EOS]
    assert e.labels.tolist() == [M] * len(p1) + b("yo") + [EOS] + [M] * len(p2) + b("a") + [EOS]
    assert (e.input_tokens, e.target_tokens) == (len(p1) + len(p2), 5)


def test_conversation_system_turn_trailing_user_and_custom_template():
    msgs = [{"role": "system", "content": "S"}, *CHAT[:2], {"role": "user", "content": "bye"}]
    t = ChatTemplate(user_prefix="<u>", assistant_prefix="<a>", system_prefix="<s>", turn_suffix="|")
    e = Formatter(TOK, chat_template=t, add_bos=True).encode({"sample_id": 1, "messages": msgs})
    p1 = b("<s>S|<u>hi|<a>")
    assert e.input_ids.tolist() == [BOS] + p1 + b("yo") + [EOS] + b("<u>bye|")
    assert e.labels.tolist() == [M] * (1 + len(p1)) + b("yo") + [EOS] + [M] * len(b("<u>bye|"))


def test_conversation_truncation_by_position():
    full = Formatter(TOK, add_bos=True).encode({"sample_id": 1, "messages": CHAT})
    n = len(full.input_ids)
    right = Formatter(TOK, add_bos=True, max_total_tokens=10).encode({"sample_id": 1, "messages": CHAT})
    assert right.input_ids.tolist() == full.input_ids[:10].tolist()
    assert right.labels.tolist() == full.labels[:10].tolist() and right.truncated
    left = Formatter(TOK, add_bos=True, max_total_tokens=10, truncation_side="left").encode(
        {"sample_id": 1, "messages": CHAT}
    )
    assert left.input_ids.tolist() == [BOS] + full.input_ids[n - 9:].tolist()
    assert left.labels.tolist() == [M] + full.labels[n - 9:].tolist()
    assert (left.input_tokens, left.target_tokens) == (1 + 9 - 2, 2)  # "a" EOS trained
    assert left.input_tokens + left.target_tokens == 10


def test_conversation_encoder_decoder_uses_last_assistant_turn_as_target():
    e = Formatter(TOK, family="encoder_decoder").encode({"sample_id": 1, "messages": CHAT})
    assert e.input_ids.tolist() == b("User: hi\nAssistant: yo\nUser: q\n")
    assert e.target_ids.tolist() == b("a") + [EOS]
    e = Formatter(TOK, family="encoder_decoder").encode({"sample_id": 1, "messages": CHAT[:3]})
    assert e.input_ids.tolist() == b("User: hi\nAssistant: yo\nUser: q\n") and e.target_ids.tolist() == [EOS]


def test_batch_equals_one_by_one_and_skips_bad_samples():
    f = Formatter(TOK, max_total_tokens=12, truncation_side="left")
    samples = [
        sample(inputs="x" * i, targets="y" * (i % 4)) | {"sample_id": i, "key": f"k{i}"} for i in range(12)
    ]
    samples[5] = {"sample_id": 5, "key": "bad", "targets": "no inputs"}
    samples[8] = {"sample_id": 8, "messages": CHAT}
    out = f.encode_batch(samples, on_error="skip")
    assert out[5] is None
    for s, e in zip(samples, out):
        if e is not None:
            one = f.encode(s)
            assert e.sample_id == s["sample_id"]
            assert e.input_ids.tolist() == one.input_ids.tolist() and e.labels.tolist() == one.labels.tolist()
    with pytest.raises(SampleError, match="'bad'.*no 'inputs'"):
        f.encode_batch(samples)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"inputs": "x"}, "integer 'sample_id'"),
        ({"sample_id": 1, "inputs": 3}, "'inputs' must be a str"),
        ({"sample_id": 1, "messages": [{"role": "bot", "content": "x"}]}, "unknown message role 'bot'"),
        ({"sample_id": 1, "messages": [{"content": "x"}]}, "message 0 is malformed"),
    ],
)
def test_bad_samples_raise_sample_error(bad, message):
    with pytest.raises(SampleError, match=message):
        Formatter(TOK).encode(bad)


def test_config_validation():
    with pytest.raises(ValueError, match="max_target_tokens must be >= 1"):
        FormatConfig(max_target_tokens=0)
    with pytest.raises(ValueError, match="max_total_tokens must be >= 2"):
        FormatConfig(max_total_tokens=1, add_bos=True)
    with pytest.raises(ValueError, match="family"):
        FormatConfig(family="seq2seq")
    with pytest.raises(ValueError, match="truncation_side"):
        FormatConfig(truncation_side="middle")

    class NoBos(ByteTokenizer):
        bos_id = None

    with pytest.raises(ValueError, match="no BOS"):
        Formatter(NoBos(), add_bos=True)
    with pytest.raises(TypeError, match="not both"):
        Formatter(TOK, FormatConfig(), add_bos=True)


limits = st.one_of(st.none(), st.integers(1, 12))


@settings(max_examples=150, deadline=None)
@given(
    inputs=st.text(max_size=15),
    targets=st.text(max_size=15),
    max_in=limits,
    max_tgt=limits,
    max_total=st.one_of(st.none(), st.integers(2, 20)),
    side=st.sampled_from(["left", "right"]),
    family=st.sampled_from(["decoder", "encoder_decoder"]),
    bos=st.booleans(),
)
def test_limits_hold_and_counts_add_up(inputs, targets, max_in, max_tgt, max_total, side, family, bos):
    f = Formatter(
        TOK,
        family=family,
        max_input_tokens=None if max_in is None else max(max_in, int(bos)),
        max_target_tokens=max_tgt,
        max_total_tokens=max_total,
        truncation_side=side,
        add_bos=bos,
    )
    e = f.encode({"sample_id": 0, "inputs": inputs, "targets": targets})
    n_in, n_tgt = len(inputs.encode()) + bos, len(targets.encode()) + 1
    cfg = f.config
    assert cfg.max_input_tokens is None or e.input_tokens <= cfg.max_input_tokens
    assert max_tgt is None or e.target_tokens <= max_tgt
    assert max_total is None or e.input_tokens + e.target_tokens <= max_total
    assert e.truncated == (e.input_tokens < n_in or e.target_tokens < n_tgt)
    if family == "decoder":
        assert len(e.input_ids) == len(e.labels) == e.input_tokens + e.target_tokens
        assert e.input_ids[-1] == EOS
        if targets:
            assert (e.labels[: e.input_tokens] == M).all()
            assert (e.labels[e.input_tokens:] == e.input_ids[e.input_tokens:]).all()
    else:
        assert (len(e.input_ids), len(e.target_ids)) == (e.input_tokens, e.target_tokens)
        assert e.target_ids[-1] == EOS
    if bos:
        assert e.input_ids[0] == BOS
    # the kept input text is a prefix ("right") or suffix ("left") of the original
    body = e.input_ids[int(bos): e.input_tokens].tolist()
    full = b(inputs)
    assert body == (full[: len(body)] if side == "right" else full[len(full) - len(body):])
