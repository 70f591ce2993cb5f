"""Loud starts (issue 36 item 5): what would train wrong or fail late is said before the first step.

* A model folder given to the DataLoader (`Tokenization(model=...)`, or a tokenizer folder holding its
  ``config.json``) sets an encoder-decoder's decoder start from ``config.decoder_start_token_id`` (BART-style:
  2, not the pad id); a stated id that disagrees is a warning; a tokenizer with more ids than the model's
  ``vocab_size`` is refused before any step.
* ``dynabatch plan`` refuses an index scanned for the other family than its ``--model``'s.
* The streaming mode warns about samples heavier than the global batch, as the indexed mode does.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_tiny import bart_config, build, t5_config  # noqa: E402

from dynabatch import DataLoader, PlanOptions, Tokenization  # noqa: E402
from dynabatch.cli import main  # noqa: E402
from dynabatch.loader.model_facts import ModelMismatchWarning  # noqa: E402

ROWS = [{"inputs": f"question {i} " + "ab " * (i % 5), "targets": "yes " * (1 + i % 3)} for i in range(12)]
OPTIONS = PlanOptions(global_batch_tokens=400, max_len=64)


def _saved(tmp_path, config):
    build(config, seed=0).save_pretrained(tmp_path)
    return str(tmp_path)


def test_encoder_decoder_starts_as_its_config_says(tmp_path):
    bart = _saved(tmp_path / "bart", bart_config(vocab_size=260))
    loader = DataLoader(ROWS, options=OPTIONS, tokenization=Tokenization(model=bart))
    mb = next(iter(loader))[0]
    assert loader.family == "encoder_decoder"
    assert mb["decoder_input_ids"][:, 0].tolist() == [2] * len(mb["decoder_input_ids"])
    with pytest.warns(ModelMismatchWarning, match=r"decoder_start_token_id=0\) differs from the model's config .*: 2"):
        loader = DataLoader(ROWS, options=OPTIONS, tokenization=Tokenization(model=bart, decoder_start_token_id=0))
    assert next(iter(loader))[0]["decoder_input_ids"][0, 0] == 0  # the stated value is used, and said
    t5 = _saved(tmp_path / "t5", t5_config(vocab_size=260, decoder_start_token_id=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelMismatchWarning)
        assert next(iter(DataLoader(ROWS, options=OPTIONS, tokenization=Tokenization(model=t5))))[0][
            "decoder_input_ids"][0, 0] == 0


def test_a_tokenizer_past_the_vocabulary_is_refused(tmp_path):
    small = _saved(tmp_path, bart_config(vocab_size=64))
    with pytest.raises(ValueError, match=r"the tokenizer has 259 ids but the model \(.*\) embeds only 64"):
        DataLoader(ROWS, options=OPTIONS, tokenization=Tokenization(model=small))


def test_plan_refuses_an_index_of_the_other_family(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS * 4))
    index = tmp_path / "index.parquet"
    assert main(["scan", str(data), "--tokenizer", "bytes", "--out", str(index), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["plan", str(index), "--model", "t5", "--max-len", "64", "--max-target-len", "16", "--out",
                 str(tmp_path / "p.parquet"), "--no-progress"]) == 1
    assert "the index says family 'decoder' but --model t5 is 'encoder_decoder'" in capsys.readouterr().err
    assert main(["scan", str(data), "--tokenizer", "bytes", "--family", "encoder_decoder", "--out", str(index),
                 "--no-progress"]) == 0
    assert main(["plan", str(index), "--model", "t5", "--max-len", "64", "--max-target-len", "16", "--out",
                 str(tmp_path / "p.parquet"), "--no-progress"]) == 0


def test_streaming_warns_of_samples_over_the_global_batch(tmp_path):
    data = tmp_path / "long.jsonl"
    data.write_text("\n".join(json.dumps({"inputs": "x" * 300, "targets": "y"}) for _ in range(3)))
    loader = DataLoader(str(data), options=PlanOptions(global_batch_tokens=48, max_len=1024))
    assert loader.mode == "streaming"
    with pytest.warns(UserWarning, match=r"global_batch_tokens=48 is smaller than 3 samples read so far .* "
                                         r"the longest has 302 tokens"):
        assert sum(1 for _ in loader) == 3


def test_train_steps_spans_epochs_and_refuses_data_without_a_step(tmp_path):
    """`DataLoader.train_steps(n)`: exactly n steps, epoch after epoch (5 steps of data for 2 steps per
    epoch: epochs 0, 0, 1, 1, 2); an empty file is an error, not a run of 0 steps."""
    loader = DataLoader(ROWS, options=PlanOptions(global_batch_tokens=200, max_len=64))
    per_epoch = len(loader)
    steps = [(s.epoch, s.step) for s in loader.train_steps(2 * per_epoch + 1)]
    assert steps == [(e, k) for k, e in enumerate(sorted([0] * per_epoch + [1] * per_epoch + [2]))]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    loader = DataLoader(str(empty), options=OPTIONS)
    with pytest.raises(ValueError, match=r"epoch 0 of the data gives no step \(0 of 3 trained\)"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the streaming mode's own "gave no step"
            list(loader.train_steps(3))
