"""examples/pipeline_hf.py trains a Hugging Face decoder folder for real: a tiny random tied Llama saved with a
tiny BPE tokenizer (trained here on the data, nothing downloaded), FLAN-like data from `dynabatch datagen`,
2 local gloo stages, 3 steps. One loss line per step (finite), adaptive recomputation under the memory
limit, and a merged ``--out`` folder that ``from_pretrained`` loads with the tokenizer, holding the stage
parts' weights (the same logits as a model built from the parts alone) and not the initial ones."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_ranks runs this file by path
from liveness import run_live  # noqa: E402

LIMIT = 200_000  # activation bytes a stage may hold
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pipeline_hf.py"


def _model_folder(folder: Path, texts: list[str]):
    import tokenizers
    import transformers

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>",
                                                                                                  "<unk>"]))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>",
                                               unk_token="<unk>")
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model


@pytest.mark.slow
def test_example_trains_a_hugging_face_folder_on_two_stages(tmp_path):
    import transformers
    from safetensors.torch import load_file

    from dynabatch.datagen import text_records, write_text_shards

    data = tmp_path / "data"
    write_text_shards(data, 240, num_shards=2, seed=0)
    initial = _model_folder(tmp_path / "model", [r["inputs"] + r["targets"] for r in text_records(240, seed=0)])
    out = tmp_path / "out"
    res = run_live([sys.executable, str(EXAMPLE), str(tmp_path / "model"), str(data), "--steps", "3", "--out", str(out),
                    "--batch-tokens", "1024", "--max-len", "128", "--memory-limit", str(LIMIT)], idle_s=180)
    assert res.returncode == 0, res.stderr[-4000:]
    lines = re.findall(r"^step (\d+) loss (\S+) tokens (\d+) recomputed layers (\d+) peak activations (\d+) B",
                       res.stdout, re.M)
    assert [int(k) for k, *_ in lines] == [0, 1, 2], res.stdout
    assert all(math.isfinite(float(loss)) and float(loss) > 0 and int(n) > 0 for _, loss, n, *_ in lines), res.stdout
    # the limit binds (without recomputation a micro-batch alone would hold more) and the measured peak keeps it
    assert all(int(r) > 0 and 0 < int(peak) <= LIMIT for *_, r, peak in lines), res.stdout
    assert f"merged into {out}" in res.stdout

    merged = transformers.LlamaForCausalLM.from_pretrained(out)
    assert merged.lm_head.weight is merged.model.embed_tokens.weight
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tok) == merged.config.vocab_size
    state = {}
    for part in sorted((out / "stages").glob("stage-*.safetensors")):
        state.update(load_file(str(part)))
    from_parts = transformers.LlamaForCausalLM(merged.config)
    from_parts.load_state_dict(state, strict=False)
    from_parts.tie_weights()
    ids = torch.tensor([tok("the quick answer is")["input_ids"]])
    with torch.no_grad():
        logits = merged(ids).logits
        assert torch.equal(logits, from_parts(ids).logits)
        assert not torch.equal(logits, initial(ids).logits)  # trained: not the saved initial weights


def ranks_target(rank, world, port, tag):
    """A `run_ranks` target (by path): its rank and world back, or a failure on rank 0 for tag 'fail'."""
    if tag == "fail":
        raise RuntimeError("rank 0 failed on purpose")
    return [rank, world, port, tag]


def test_run_ranks_joins_torchrun_or_names_a_failed_rank(monkeypatch):
    """Under torchrun (RANK, WORLD_SIZE, MASTER_PORT set) the target runs in this process with them; alone,
    a failing rank is a RuntimeError naming it with its error."""
    from dynabatch.pipeline import run_ranks

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29617")
    assert run_ranks(f"{__file__}:ranks_target", 2, args=("x",)) == [1, 2, 29617, "x"]
    monkeypatch.delenv("RANK")
    with pytest.raises(RuntimeError, match=r"rank 0 of 1 exited with 1:(.|\n)*failed on purpose"):
        run_ranks(f"{__file__}:ranks_target", 1, args=("fail",))


def test_load_stage_reads_only_its_layers(tmp_path):
    """Stage 1 of 2 of a folder: equal layer counts, only its layers (and the tied embedding its head
    uses) materialized, equal to the saved weights; bounds that do not fit the pipeline are refused."""
    from types import SimpleNamespace

    import transformers

    from dynabatch.pipeline import load_stage

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config)
    hf.save_pretrained(tmp_path)
    ctx = SimpleNamespace(stage=1, num_stages=2, device=torch.device("cpu"))
    part = load_stage(tmp_path, ctx)
    assert part.bounds == (0, 2, 4) and part.layers == range(2, 4)
    assert all(p.is_meta for p in part.model.layers[1].parameters())
    named = dict(hf.named_parameters())
    for i in part.layers:
        for path, key in part.model.param_keys(i).items():
            assert torch.equal(part.model.layers[i].get_parameter(path), named[key]), key
    with pytest.raises(ValueError, match="give 3 stages, the pipeline has 2"):
        load_stage(tmp_path, ctx, bounds=[0, 1, 2, 4])
