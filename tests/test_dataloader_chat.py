"""Conversation records through the whole stack with a chat template: loaders keep tool turns, the
DataLoader's ``chat_template=`` (indexed and streaming) delivers the formatter's ids and assistant-only
labels, ``build_index`` records the rendering, and ``dynabatch scan``/``plan --chat-template FILE``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenization import IGNORE_INDEX, ChatTemplateWarning, FormatConfig, Formatter

pytest.importorskip("transformers", reason="chat templates need transformers")
pytest.importorskip("tokenizers", reason="the test tokenizer needs tokenizers")

from chat_tokenizers import GEN, NO_GEN, TOOLS, make_tokenizer  # noqa: E402
from test_tokenization_pretokenized import unpack  # noqa: E402  (rows of a collated micro-batch)
from dynabatch.loader.settings import records_from_keywords

PLAN = dict(cost_model="gpt", device="cpu", num_stages=2)
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "rome"}}}
WORDS = ["a", "b", "c", "d", "e", "hi", "the", "sunny"]


def records(n=36, seed=0):
    """Conversation records as a JSONL file holds them: some with tools, a tool call and a tool turn."""
    rng = np.random.default_rng(seed)
    say = lambda: " ".join(rng.choice(WORDS, int(rng.integers(1, 9))))  # noqa: E731
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": say()}] if i % 4 == 0 else []
        for _ in range(int(rng.integers(1, 4))):
            turns += [{"role": "user", "content": say()}, {"role": "assistant", "content": say()}]
        rec = {"messages": turns, "id": f"chat{i}"}
        if i % 3 == 0:
            turns[-1:] = [{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "sunny"},
                          {"role": "assistant", "content": say()}]
            rec["tools"] = TOOLS
        out.append(rec)
    return out


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def loaded_samples(path):
    """The samples loaders makes of the file, in file order."""
    import loaders

    src = loaders.open_source(path)
    src.set_epoch(0)
    return sorted(src, key=lambda s: s["sample_id"])


def test_loaders_keep_tool_turns_calls_and_tools(tmp_path):
    rows = records(6)
    samples = loaded_samples(write_jsonl(tmp_path / "chat.jsonl", rows))
    s = samples[0]
    assert s["messages"][-3] == {"role": "assistant", "content": "", "tool_calls": [CALL]}
    assert s["messages"][-2] == {"role": "tool", "content": "sunny"} and s["meta"]["tools"] == TOOLS
    # rendered with the template, the tool call is trained, the tool result is not
    e = Formatter(make_tokenizer(GEN)).encode(s)
    trained = make_tokenizer(GEN).convert_ids_to_tokens(e.labels[e.labels != IGNORE_INDEX].tolist())
    assert trained[:4] == ["get_weather", "city", "rome", "<|end|>"] and "<|tool|>" not in trained


def expected_batches(samples, fmt, max_len):
    """sample_id -> (input ids, labels) the loader must deliver (the collators mask each first label)."""
    out = {}
    for s, e in zip(samples, fmt.encode_batch(samples)):
        out[s["sample_id"]] = (e.input_ids.tolist(), [IGNORE_INDEX] + e.labels.tolist()[1:])
        assert max_len is None or len(e.input_ids) <= max_len
    return out


def delivered(loader):
    """sample_id -> (input ids, labels) of every padded row the loader delivers."""
    got = {}
    for step in loader.steps():
        # the planned loss tokens are the delivered assistant labels
        assert step.target_tokens == sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in step)
        got.update(kv for b in step if not b["is_padding"]
                   for kv in zip(b["sample_ids"].tolist(), unpack(b, "padded", "decoder")))
    return got


@pytest.mark.parametrize("mode", ["indexed", "streaming"])
def test_dataloader_chat_template_delivers_assistant_only_labels(tmp_path, mode):
    import dynabatch

    path = write_jsonl(tmp_path / "chat.jsonl", records())
    samples = loaded_samples(path)
    own = make_tokenizer(GEN)
    want = expected_batches(samples, Formatter(own, FormatConfig(max_total_tokens=40)), 40)
    dl = dynabatch.DataLoader(path, **records_from_keywords(dict(tokenizer=own, global_batch_tokens=200, max_len=40, collate="padded", mode=mode, **PLAN)))
    assert delivered(dl) == want
    # the same template given as text to a tokenizer without one (rendered-prefix diff): the same batches
    given = dynabatch.DataLoader(path, **records_from_keywords(dict(tokenizer=make_tokenizer(None), chat_template=NO_GEN, global_batch_tokens=200, max_len=40, collate="padded", mode=mode, **PLAN)))
    assert delivered(given) == want


def test_dataloader_plain_fallback_warns_and_options_conflict(tmp_path):
    import dynabatch

    path = write_jsonl(tmp_path / "chat.jsonl", [r for r in records(8) if "tools" not in r])
    with pytest.warns(ChatTemplateWarning, match="has no chat template"):
        dl = dynabatch.DataLoader(path, **records_from_keywords(dict(tokenizer=make_tokenizer(None), global_batch_tokens=300, mode="indexed", **PLAN)))
        next(iter(dl.steps()))
    with pytest.raises(TypeError, match="chat_template= in format_config or as a keyword, not both"):
        dynabatch.DataLoader(path, **records_from_keywords(dict(global_batch_tokens=300, chat_template="plain", format_config=FormatConfig(), **PLAN)))


def test_build_index_records_the_rendering_and_counts_what_is_encoded(tmp_path):
    import dynabatch
    from dynabatch.index import SETTINGS_KEY

    path = write_jsonl(tmp_path / "chat.jsonl", records(20))
    samples = loaded_samples(path)
    table = dynabatch.build_index(path, tokenizer=make_tokenizer(None), chat_template=NO_GEN)
    settings = json.loads(table.schema.metadata[SETTINGS_KEY])
    assert settings["chat_template"].startswith("given chat template sha256:")
    encs = Formatter(make_tokenizer(None), chat_template=NO_GEN).encode_batch(samples)
    cols = table.to_pydict()
    assert [a + b for a, b in zip(cols["input_tokens"], cols["target_tokens"])] == [len(e.input_ids) for e in encs]
    other = dynabatch.build_index(path, tokenizer=make_tokenizer(GEN))
    assert json.loads(other.schema.metadata[SETTINGS_KEY])["chat_template"].startswith("tokenizer chat template")


def test_cli_scan_and_plan_take_a_chat_template_file(tmp_path, capsys):
    from dynabatch.cli import main

    path = write_jsonl(tmp_path / "chat.jsonl", records(24))
    folder = tmp_path / "tok"
    make_tokenizer(None).save_pretrained(folder)
    template = tmp_path / "chat.jinja"
    template.write_text(NO_GEN)
    index = tmp_path / "index.parquet"
    assert main(["scan", path, "--tokenizer", str(folder), "--chat-template", str(template), "--out", str(index),
                 "--workers", "1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["chat_template"].startswith("given chat template sha256:")
    encs = Formatter(make_tokenizer(None), chat_template=NO_GEN).encode_batch(loaded_samples(path))
    assert summary["input_tokens"] + summary["target_tokens"] == sum(len(e.input_ids) for e in encs)
    # planning that index with another rendering is refused; with the same one it plans
    assert main(["plan", str(index), "--chat-template", "plain", "--global-batch-tokens", "400", "--out",
                 str(tmp_path / "p.parquet"), "--no-progress"]) == 1
    assert "scanned with messages rendered by given chat template" in capsys.readouterr().err
    assert main(["plan", str(index), "--chat-template", str(template), "--global-batch-tokens", "400", "--out",
                 str(tmp_path / "p.parquet"), "--no-progress"]) == 0
    import pyarrow.parquet as pq
    from dynabatch.planfile.format import INDEX_KEY

    recorded = json.loads(pq.read_schema(tmp_path / "p.parquet").metadata[INDEX_KEY.encode()])["scan"]
    assert recorded["chat_template"] == summary["chat_template"]  # the plan file says which rendering
    assert main(["scan", path, "--chat-template", str(tmp_path / "missing.jinja"), "--out", str(index)]) == 1
    assert "no such file" in capsys.readouterr().err
