"""Vision tokens count towards the max lengths (the default path, no image placeholders): the formatter
cuts a vision-language sample's text to ``max_len - vision tokens``, so its merged length (text + vision)
is exactly the planner's main length (`CostModel.sample_dims`) and never passes ``max_len``; a sample
whose images alone pass it is refused (skipped and counted with ``on_error="skip"``). The length scan
(`scan_shapes`, the DataLoader's index, ``dynabatch scan``) agrees with the formatter, and the index
settings and the offline commands know about ``image_token_id``.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from dynabatch import DataLoader, PlanMismatchError, Shapes, build_index
from dynabatch.cli import main
from dynabatch.core.cost.model import CostModel
from dynabatch.index import derived_labels, index_settings
from dynabatch.offline import load_run_plan
from dynabatch.pipeline import stage_cost_model
from dynabatch.pipeline.models import vlm_tiny
from tokenization import (
    IGNORE_INDEX,
    DynamicTiling,
    FormatConfig,
    Formatter,
    SampleError,
    scan_shapes,
    scan_stats,
)
from dynabatch import Costing, DataSource, PlanOptions, Tokenization
from dynabatch.loader.settings import records_from_keywords

POLICY = DynamicTiling(tile_size=56, patch_size=14, max_num=4)  # 4 tokens per tile
SIZES = [(56, 56), (112, 56), (168, 56)]  # 1, 2+1, 3+1 tiles: 4, 12, 16 vision tokens
IMG = 300  # a placeholder id the byte tokenizer (ids < 259) never produces


def _sample(i, rng, family):
    """A random sample: plain prompt/response, language modelling, a conversation or pre-tokenized ids,
    with 0-2 images (their sizes given, never opened)."""
    k = int(rng.integers(0, 3))
    sizes = [SIZES[int(j)] for j in rng.integers(0, len(SIZES), k)]
    s = {"sample_id": i, "key": f"s{i}", "images": [{"path": f"/nowhere/{i}-{j}.png"} for j in range(k)],
         "image_sizes": sizes}
    words = lambda m: " ".join("w" * int(rng.integers(1, 6)) for _ in range(m))  # noqa: E731
    kind = int(rng.integers(0, 4))
    if kind == 0:
        s.update(inputs=words(int(rng.integers(1, 12))), targets=words(int(rng.integers(1, 8))))
    elif kind == 1:
        s.update(inputs=words(int(rng.integers(1, 14))), targets="")
    elif kind == 2:
        s["messages"] = [{"role": "user", "content": words(int(rng.integers(1, 6)))},
                         {"role": "assistant", "content": words(int(rng.integers(1, 6)))},
                         {"role": "user", "content": words(2)}, {"role": "assistant", "content": words(3)}]
    else:
        ids = [int(x) for x in rng.integers(3, 250, int(rng.integers(2, 30)))]
        s["input_ids"] = ids
        if family == "encoder_decoder":
            s["labels"] = [int(x) for x in rng.integers(3, 250, int(rng.integers(1, 6)))]
    return s


def _specials(s, family, add_bos):
    """BOS/EOS the formatter adds to ``s`` (kept whole, like the vision tokens)."""
    if "input_ids" in s:
        return 0
    if family == "encoder_decoder":
        return int(add_bos)
    return int(add_bos) + ("messages" not in s)


def _shapes(encoded):
    return Shapes.from_lengths(input_tokens=[e.input_tokens for e in encoded],
                               target_tokens=[e.target_tokens for e in encoded],
                               vision_tokens=[e.vision_tokens for e in encoded])


def _limit(family, cap):
    return {"max_total_tokens": cap} if family == "decoder" else {"max_input_tokens": cap}


def _main_len(e, family):
    """The merged main length of an encoded sample: its ids (text) plus the vision tokens the model inserts."""
    return len(e.input_ids) + e.vision_tokens


def _label_count(e, family):
    if family == "encoder_decoder":
        return len(e.target_ids)
    trained = e.labels != IGNORE_INDEX
    return int(trained[1:].sum()) if len(trained) else 0


FAMILIES = {"decoder": "vlm", "encoder_decoder": "t5"}  # family -> the cost preset whose sample_dims plans it


@pytest.mark.parametrize("family", list(FAMILIES))
def test_formatter_length_is_the_planned_main_length(family):
    """Random mixed samples and max lengths: text + vision of every formatted sample equals
    `sample_dims`'s main length of its full counts and is at most max_len; a sample is refused exactly
    when its vision and special tokens alone pass max_len, with an error naming it."""
    cm = CostModel.preset(FAMILIES[family], "a100-80gb")
    rng = np.random.default_rng(1)
    samples = [_sample(i, rng, family) for i in range(160)]
    refused = cut = with_vision = 0
    for trial in range(12):
        cap, side, bos = int(rng.integers(6, 48)), ("right", "left")[trial % 2], bool(trial % 3 == 1)
        common = dict(family=family, vision=POLICY, truncation_side=side, add_bos=bos)
        f = Formatter("bytes", **common, **_limit(family, cap))
        got = f.encode_batch(samples, on_error="skip")
        whole = Formatter("bytes", **common).encode_batch(samples)
        main, _, _ = cm.sample_dims(_shapes(whole), max_len=cap)
        for s, e, w, m in zip(samples, got, whole, main.tolist()):
            fits = w.vision_tokens + _specials(s, family, bos) <= cap
            assert (e is not None) == fits, (s, cap)
            if e is None:
                refused += 1
                with pytest.raises(SampleError, match=rf"sample 's{s['sample_id']}'.*vision tokens count towards"):
                    f.encode(s)
                continue
            assert e.vision_tokens == w.vision_tokens
            assert _main_len(e, family) == m <= cap, (s, cap, e)
            assert e.truncated == (_main_len(w, family) > cap)
            cut += e.truncated
            with_vision += e.truncated and e.vision_tokens > 0
    assert refused > 20 and cut > 100 and with_vision > 50


@pytest.mark.parametrize("family", list(FAMILIES))
def test_scan_agrees_with_the_formatter(family):
    """The DataLoader's scan (full counts, the training formatting as label_config) keeps exactly the
    samples the formatter keeps, their full counts plan to the formatter's length, and the label
    counts are the formatter's; scanning under the max lengths (``dynabatch scan --max-len``) gives
    the formatter's counts; counts alone (`derived_labels`) give the labels of prompt/response samples."""
    cm = CostModel.preset(FAMILIES[family], "a100-80gb")
    rng = np.random.default_rng(2)
    samples = [_sample(i, rng, family) for i in range(150)]
    refused = 0
    for trial in range(6):
        cap, side, bos = int(rng.integers(8, 40)), ("right", "left")[trial % 2], bool(trial % 2)
        common = dict(family=family, truncation_side=side, add_bos=bos)
        train = FormatConfig(**common, **_limit(family, cap))
        got = Formatter("bytes", train, vision=POLICY).encode_batch(samples, on_error="skip")
        kept = [(s, e) for s, e in zip(samples, got) if e is not None]
        refused += len(samples) - len(kept)
        table = scan_shapes(samples, "bytes", vision=POLICY, label_config=train, on_error="skip", batch_size=16,
                            **common)
        assert table.column("sample_id").to_pylist() == [e.sample_id for _, e in kept]
        assert scan_stats(table).num_skipped == len(samples) - len(kept)
        assert all("vision tokens count towards" in why for _, why in scan_stats(table).skipped)
        full = Shapes.from_arrow(table)
        main, _, _ = cm.sample_dims(full, max_len=cap)
        assert main.tolist() == [_main_len(e, family) for _, e in kept]
        assert table.column("label_tokens").to_pylist() == [_label_count(e, family) for _, e in kept]
        cut = scan_shapes(samples, "bytes", vision=POLICY, on_error="skip", **common, **_limit(family, cap))
        for col in ("sample_id", "input_tokens", "target_tokens", "vision_tokens"):
            assert cut.column(col).to_pylist() == [getattr(e, col) for _, e in kept], col
        assert scan_stats(cut).num_truncated == sum(e.truncated for _, e in kept)
        labels = derived_labels(full, family, cap if family == "decoder" else None, None, int(bos))
        plain = [k for k, (s, e) in enumerate(kept)
                 if s.get("targets") and e.input_tokens > 0 and "messages" not in s]
        assert len(plain) > 10
        assert [int(labels[k]) for k in plain] == [_label_count(kept[k][1], family) for k in plain]
    assert refused > 10


def _llava_jsonl(path, n, rng, *, long_text=False):
    """A LLaVA conversations file with PNG images next to it (some rows text-only)."""
    rows = []
    for i in range(n):
        words = " ".join("word" for _ in range(int(rng.integers(1, 40 if long_text else 8))))
        answer = " ".join("ok" for _ in range(int(rng.integers(1, 20 if long_text else 6))))
        if i % 4 == 3:
            rows.append({"conversations": [{"from": "human", "value": words}, {"from": "gpt", "value": answer}]})
            continue
        w, h = SIZES[i % len(SIZES)] if long_text else (64 * (1 + i % 3), 64)
        name = f"img{i}.png"
        Image.new("RGB", (w, h), (i % 255, 80, 160)).save(path.parent / name)
        prompt = "<image>\n" + words
        rows.append({"image": name, "conversations": [{"from": "human", "value": prompt},
                                                      {"from": "gpt", "value": answer}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("mode", ["indexed", "streaming"])
def test_dataloader_rows_never_pass_max_len(tmp_path, mode):
    """vlm-tiny's DataLoader without placeholders: every row's text + vision tokens equal the planned
    main length of the sample (the index's full counts through `sample_dims`) and are at most max_len;
    samples whose images alone pass max_len are skipped (in the index scan too), never batched."""
    rng = np.random.default_rng(3)
    data = _llava_jsonl(tmp_path / "llava.jsonl", 48, rng, long_text=True)
    cap = 28  # the 16-token images fit with a few text tokens, their text is cut
    model = vlm_tiny(vocab=300, hidden=32, heads=2, vision_hidden=16, vision_heads=2, vision=POLICY)
    cost = stage_cost_model(model, 2, "cpu")
    index = build_index(data, vision=POLICY, max_len=cap, on_error="skip")
    full = Shapes.from_arrow(index)
    planned = dict(zip(full.sample_id.tolist(), cost.sample_dims(full, max_len=cap)[0].tolist()))
    whole = build_index(data, vision=POLICY, on_error="skip")
    assert index.num_rows == whole.num_rows  # no image here passes max_len alone
    loader = DataLoader(data, options=PlanOptions(num_stages=2, max_len=cap, global_batch_tokens=200, seed=0),
                        tokenization=Tokenization(vision=POLICY), source=DataSource(on_error="skip", mode=mode),
                        costing=Costing(cost_model=cost))
    seen, vision_cut = [], 0
    for step in loader.steps():
        for mb in step:
            if mb["is_padding"]:
                continue
            text = mb["attention_mask"].sum(1)
            vis = mb["image_tiles"] * model.tile_tokens
            for sid, t, v in zip(mb["sample_ids"].tolist(), text.tolist(), vis.tolist()):
                assert t + v == planned[sid] <= cap, (sid, t, v)
                vision_cut += v > 0 and t + v == cap
                seen.append(sid)
    loader.close()
    assert sorted(seen) == sorted(planned) and vision_cut > 5

    # a smaller max_len leaves no room for the 16-token images: skipped and counted, or raised
    small = build_index(data, vision=POLICY, max_len=14, on_error="skip")
    stats = scan_stats(small)
    assert stats.num_skipped == sum(v + 1 > 14 for v in whole.column("vision_tokens").to_pylist()) > 0
    assert all("vision tokens count towards" in why for _, why in stats.skipped)
    with pytest.raises(SampleError, match="vision tokens count towards the max lengths"):
        build_index(data, vision=POLICY, max_len=14)


def test_index_settings_record_image_token_id_and_vision(tmp_path):
    """`index_settings` records image_token_id when set and that vision tokens count towards the max
    lengths; an index cache made before they did (without that key) is rebuilt."""
    text = Formatter("bytes", max_total_tokens=64)
    vis = Formatter("bytes", max_total_tokens=64, vision=POLICY)
    ph = Formatter("bytes", max_total_tokens=64, vision=POLICY, image_token_id=IMG)
    assert not {"image_token_id", "vision_in_max_len"} & set(index_settings(text, None))
    assert index_settings(vis, POLICY)["vision_in_max_len"] is True and "image_token_id" not in index_settings(
        vis, POLICY)
    assert index_settings(ph, POLICY)["image_token_id"] == IMG

    data = _llava_jsonl(tmp_path / "llava.jsonl", 8, np.random.default_rng(4), long_text=True)
    cache = tmp_path / "index.parquet"
    common = dict(vision=POLICY, cost_model=stage_cost_model(vlm_tiny(vision=POLICY), 2, "cpu"), num_stages=2,
                  global_batch_tokens=200, max_len=40, index_cache=str(cache), mode="indexed")

    def run():
        loader = DataLoader(data, **records_from_keywords(dict(**common)))
        next(iter(loader.steps()))  # the index is built (or read) when the loader starts
        loader.close()

    run()
    t = pq.read_table(cache)
    settings = json.loads(t.schema.metadata[b"dynabatch.index_settings"])
    assert settings["vision_in_max_len"] is True
    old = {k: v for k, v in settings.items() if k != "vision_in_max_len"}  # as written before this rule
    meta = {**t.schema.metadata, b"dynabatch.index_settings": json.dumps(old, sort_keys=True).encode()}
    pq.write_table(t.replace_schema_metadata(meta), cache)
    run()
    assert json.loads(pq.read_table(cache).schema.metadata[b"dynabatch.index_settings"]) == settings


@pytest.mark.filterwarnings("ignore::UserWarning")  # device="h200" on a machine without it: planned offline
def test_offline_scan_and_plan_take_image_token_id(tmp_path, capsys):
    """``dynabatch scan/plan --image-token-id`` count the data as a DataLoader with the same
    image_token_id does (the <image> markers become placeholder runs): same dataset fingerprint, and
    a plan of it replays in that loader; without the flag the marker text is counted and the
    fingerprint differs. The flag needs --vision, and an index scanned with another id is refused."""
    data = _llava_jsonl(tmp_path / "llava.jsonl", 12, np.random.default_rng(5))
    ph, plain = tmp_path / "ph.parquet", tmp_path / "plain.parquet"
    base = ["scan", data, "--vision", "tiling", "--tokenizer", "bytes", "--workers", "1", "--no-progress"]
    assert main([*base, "--image-token-id", str(IMG), "--out", str(ph)]) == 0
    assert main([*base, "--out", str(plain)]) == 0
    loader_index = build_index(data, vision=DynamicTiling(), image_token_id=IMG)
    want = Shapes.from_arrow(loader_index).fingerprint()
    t_ph, t_plain = pq.read_table(ph), pq.read_table(plain)
    assert Shapes.from_arrow(t_ph).fingerprint() == want
    assert Shapes.from_arrow(t_plain).fingerprint() != want
    assert json.loads(t_ph.schema.metadata[b"dynabatch.scan"])["image_token_id"] == IMG
    assert "image_token_id" not in json.loads(t_plain.schema.metadata[b"dynabatch.scan"])
    with_img = [v > 0 for v in t_ph.column("vision_tokens").to_pylist()]
    diff = [b - a for a, b in zip(t_ph.column("input_tokens").to_pylist(), t_plain.column("input_tokens").to_pylist())]
    assert diff == [len("<image>") * w for w in with_img] and any(with_img)

    plan = tmp_path / "plan.parquet"
    opts = ["--out", str(plan), "--model", "vlm", "--device", "h200", "--ranks", "1", "--stages", "4",
            "--global-batch-tokens", "2000", "--seed", "0", "--tokenizer", "bytes", "--workers", "1", "--no-progress"]
    assert main(["plan", data, "--image-token-id", str(IMG), *opts]) == 0
    assert load_run_plan(plan).dataset_fingerprint == want
    kw = dict(vision=DynamicTiling(), cost_model="vlm", device="h200", num_stages=4, seed=0, plan=str(plan))
    loader = DataLoader(data, **records_from_keywords(dict(image_token_id=IMG, **kw)))
    ids = sorted(i for step in loader.steps() for mb in step if not mb["is_padding"]
                 for i in mb["sample_ids"].tolist())
    loader.close()
    assert ids == sorted(loader_index.column("sample_id").to_pylist())
    with pytest.raises(PlanMismatchError, match="dataset fingerprint"):
        DataLoader(data, **records_from_keywords(dict(**kw)))  # without placeholders the marker text is counted: other data

    assert main(["plan", str(ph), "--image-token-id", str(IMG), *opts]) == 0  # the index's own id: fine
    capsys.readouterr()
    assert main(["plan", str(ph), "--image-token-id", str(IMG + 1), *opts]) == 1
    assert f"scanned with image_token_id {IMG}, not {IMG + 1}" in capsys.readouterr().err
    assert main(["scan", data, "--image-token-id", str(IMG), "--out", str(tmp_path / "x.parquet"), "--no-progress",
                 "--workers", "1"]) == 1
    assert "needs a vision policy" in capsys.readouterr().err
