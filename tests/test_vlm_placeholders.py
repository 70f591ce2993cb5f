"""Image placeholder tokens (LLaVA-style, opt-in): the formatter puts one run of ``image_token_id`` per
image into ``input_ids`` (at the image's ``<image>`` marker, else before the text), the length table
still counts each vision token once, truncation never cuts a run, and vlm-tiny scatters its projected
tile features into the runs: the same samples through the placeholder and the prepend path give the
same loss and gradients, in one process and on 2 gloo stages.

Images: the shared COCO photos (``../shared/data/images``) when present, else generated ones.
The rank-side worker (`pipeline_worker`) is in this file; `launch_local` runs it by path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the worker runs this file by path (launch_local)
from test_pipeline_dist import ok  # noqa: E402
from test_pipeline_vlm import TINY, one_pass  # noqa: E402

import tokenization  # noqa: E402
from dynabatch.pipeline import (PipelineRunner, RunnerConfig, init_pipeline, launch_local, sequential_step,
                                stage_cost_model)  # noqa: E402
from dynabatch.pipeline.models import vision_calls, vlm_tiny  # noqa: E402
from dynabatch.pipeline.models.vlm import merged_length, placeholder_mask, with_placeholders  # noqa: E402
from tokenization import (  # noqa: E402
    IGNORE_INDEX,
    DynamicTiling,
    FormatConfig,
    Formatter,
    SampleError,
    scan_shapes,
    scan_stats,
)
from dynabatch import PlanOptions, Tokenization
from dynabatch.loader.settings import records_from_keywords

IMG = 300  # the placeholder id: outside the byte tokenizer's ids (0..258) and outside TINY's vocab (300)
POLICY = DynamicTiling(tile_size=56, patch_size=14, max_num=4)  # 4 tokens per tile
SIZES = {(56, 56): 4, (112, 56): 12, (168, 56): 16}  # (width, height) px -> vision tokens: 1, 2+1, 3+1 tiles
SHARED_IMAGES = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "images"


def enc(text: str) -> list[int]:
    return (np.frombuffer(text.encode(), np.uint8).astype(np.int64) + 3).tolist()


def img_sample(sid, sizes, **fields):
    images = [{"path": f"/nowhere/{sid}-{k}.jpg"} for k in range(len(sizes))]  # never opened: sizes are given
    return {"sample_id": sid, "key": f"s{sid}", "images": images, "image_sizes": list(sizes), **fields}


def runs(ids) -> list[int]:
    """Lengths of the maximal runs of IMG in ``ids``."""
    x = np.concatenate([[0], (np.asarray(ids) == IMG).astype(np.int8), [0]])
    d = np.diff(x)
    return (np.flatnonzero(d == -1) - np.flatnonzero(d == 1)).tolist()


# -- the formatter ---------------------------------------------------------------------------------

def test_runs_replace_markers_in_image_order_and_go_first_without_markers():
    """Each marker becomes its own image's run (images of 4 and 12 tokens: a swapped order shows), labels
    -100 on the runs; no marker: all runs right after BOS; the text counts leave the runs out."""
    from loaders._schema import IMAGE_PLACEHOLDER

    assert tokenization.IMAGE_MARKER == IMAGE_PLACEHOLDER  # the marker the loaders check against the images
    f = Formatter("bytes", vision=POLICY, image_token_id=IMG, add_bos=True)
    s = img_sample(1, [(56, 56), (112, 56)], inputs="first <image> then <image> end", targets="ok")
    e = f.encode(s)
    want = [1, *enc("first "), *[IMG] * 4, *enc(" then "), *[IMG] * 12, *enc(" end"), *enc("ok"), 2]
    assert e.input_ids.tolist() == want
    assert e.labels.tolist() == [IGNORE_INDEX] * (len(want) - 3) + [*enc("ok"), 2]
    assert (e.input_tokens, e.target_tokens, e.vision_tokens) == (1 + len("first  then  end"), 3, 16)
    assert len(e.input_ids) == e.input_tokens + e.target_tokens + e.vision_tokens

    e = f.encode(img_sample(2, [(112, 56), (56, 56)], inputs="what?", targets="x"))  # no marker
    assert e.input_ids.tolist() == [1, *[IMG] * 16, *enc("what?"), *enc("x"), 2] and runs(e.input_ids) == [16]

    # conversations (LLaVA): the run sits inside the user turn; the assistant turn is trained
    conv = img_sample(3, [(168, 56)], messages=[{"role": "user", "content": "<image>\nWhat is it?"},
                                                {"role": "assistant", "content": "A cat."}])
    e = Formatter("bytes", vision=POLICY, image_token_id=IMG).encode(conv)
    want = [*enc("User: "), *[IMG] * 16, *enc("\nWhat is it?\nAssistant: "), *enc("A cat."), 2]
    assert e.input_ids.tolist() == want and e.vision_tokens == 16
    assert e.labels.tolist() == [IGNORE_INDEX] * (len(want) - 7) + [*enc("A cat."), 2]

    # encoder-decoder: the runs are in the encoder input, the targets are text
    e = Formatter("bytes", family="encoder_decoder", vision=POLICY, image_token_id=IMG).encode(s)
    assert e.input_ids.tolist() == [*enc("first "), *[IMG] * 4, *enc(" then "), *[IMG] * 12, *enc(" end")]
    assert e.target_ids.tolist() == [*enc("ok"), 2] and e.input_tokens == len("first  then  end")


def test_off_by_default_and_same_text_as_without_placeholders():
    """Without image_token_id nothing changes (the marker is text); with it, the ids minus the runs are
    the ids of the text without its markers, and the vision count is the same."""
    s = img_sample(1, [(56, 56), (112, 56)], inputs="a <image> b <image>", targets="t")
    plain = Formatter("bytes", vision=POLICY).encode(s)
    assert IMG not in plain.input_ids.tolist() and plain.input_ids.tolist()[:len(enc("a <image>"))] == enc("a <image>")
    ph = Formatter("bytes", vision=POLICY, image_token_id=IMG).encode(s)
    stripped = Formatter("bytes", vision=POLICY).encode({**s, "inputs": "a  b "})
    assert ph.input_ids[ph.input_ids != IMG].tolist() == stripped.input_ids.tolist()
    assert ph.vision_tokens == plain.vision_tokens == 16
    assert (ph.input_tokens, ph.target_tokens) == (stripped.input_tokens, stripped.target_tokens)


def test_pretokenized_rows_expand_one_id_per_image():
    """A pre-tokenized row marks each image with one image_token_id (expanded to the image's run, labels
    -100 there), or none (the runs go first); a wrong count names the sample."""
    f = Formatter("bytes", vision=POLICY, image_token_id=IMG)
    ids, labels = [10, IMG, 11, 12, IMG, 13], [-100, IMG, -100, 12, -100, 13]
    e = f.encode(img_sample(1, [(112, 56), (56, 56)], input_ids=ids, labels=labels))
    assert e.input_ids.tolist() == [10, *[IMG] * 12, 11, 12, *[IMG] * 4, 13]
    assert e.labels.tolist() == [-100, *[-100] * 12, -100, 12, *[-100] * 4, 13]
    assert (e.input_tokens, e.target_tokens, e.vision_tokens) == (2, 2, 16)
    e = f.encode(img_sample(2, [(56, 56)], input_ids=[10, 11]))
    assert e.input_ids.tolist() == [*[IMG] * 4, 10, 11] and e.labels.tolist() == [-100] * 4 + [10, 11]
    with pytest.raises(SampleError, match=r"sample 's3'.*2 image\(s\) but 1"):
        f.encode(img_sample(3, [(56, 56), (56, 56)], input_ids=[10, IMG, 11]))
    with pytest.raises(SampleError, match=r"'input_ids' holds 300"):  # without placeholders the id is refused
        Formatter("bytes", vision=POLICY).encode(img_sample(4, [(56, 56)], input_ids=[10, IMG]))


def test_bad_samples_and_options_name_the_problem():
    f = Formatter("bytes", vision=POLICY, image_token_id=IMG)
    cases = [
        (img_sample(1, [(56, 56)], inputs="<image> and <image>", targets="t"), r"'s1'.*1 image\(s\) but 2 <image>"),
        (img_sample(2, [], inputs="look: <image>", targets="t"), r"'s2'.*1 <image> marker\(s\) but no image"),
        (img_sample(3, [(56, 56)], inputs="q", targets="see <image>"), r"'s3'.*marker in a response"),
        (img_sample(4, [(56, 56)], messages=[{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "<image>"}]), r"'s4'.*response"),
    ]
    for s, msg in cases:
        with pytest.raises(SampleError, match=msg):
            f.encode(s)
    assert f.encode_batch([c[0] for c in cases] + [img_sample(5, [(56, 56)], inputs="q", targets="t")],
                          on_error="skip")[:4] == [None] * 4
    # an id the tokenizer produces for text ('a' is byte 97 -> id 100)
    g = Formatter("bytes", vision=POLICY, image_token_id=100)
    with pytest.raises(SampleError, match=r"'s6'.*encodes to image_token_id 100"):
        g.encode(img_sample(6, [(56, 56)], inputs="banana", targets="t"))
    assert g.encode_batch([img_sample(6, [(56, 56)], inputs="banana", targets="t"),
                           img_sample(7, [(56, 56)], inputs="kiwi", targets="t")], on_error="skip")[0] is None
    with pytest.raises(ValueError, match="needs a vision policy"):
        Formatter("bytes", image_token_id=IMG)
    for bad in (-1, True, 2.0, "300"):
        with pytest.raises(ValueError, match="image_token_id"):
            FormatConfig(image_token_id=bad)
    with pytest.raises(ValueError, match="needs a vision policy"):
        scan_shapes([img_sample(1, [(56, 56)], inputs="q")], "bytes", image_token_id=IMG)


# -- shapes and truncation ------------------------------------------------------------------------

def _mixed_samples(rng, n):
    out = []
    for i in range(n):
        k = int(rng.integers(0, 3))
        sizes = [list(SIZES)[int(j)] for j in rng.integers(0, 3, k)]
        words = lambda m: " ".join("w" * int(rng.integers(1, 6)) for _ in range(m))  # noqa: E731
        kind = int(rng.integers(0, 3))
        if kind == 0:  # text to text, markers or not
            marks = k and rng.random() < 0.5
            prompt = " ".join(f"{words(int(rng.integers(0, 4)))} <image>" for _ in range(k)) + " " + words(3) \
                if marks else words(int(rng.integers(1, 12)))
            out.append(img_sample(i, sizes, inputs=prompt, targets=words(int(rng.integers(0, 8)))))
        elif kind == 1:  # a conversation, the markers in the first user turn
            first = "<image>\n" * k + words(int(rng.integers(1, 6)))
            msgs = [{"role": "user", "content": first},
                    {"role": "assistant", "content": words(int(rng.integers(1, 8)))},
                    {"role": "user", "content": words(2)}, {"role": "assistant", "content": words(3)}]
            out.append(img_sample(i, sizes, messages=msgs))
        else:  # pre-tokenized, one id per image in the middle
            ids = [int(x) for x in rng.integers(3, 250, int(rng.integers(2, 20)))]
            for _ in range(k):
                ids.insert(int(rng.integers(0, len(ids) + 1)), IMG)
            out.append(img_sample(i, sizes, input_ids=ids))
    return out


def test_each_vision_token_counted_once_and_truncation_never_cuts_a_run():
    """On mixed samples (text, conversations, pre-tokenized; 0-2 images with and without markers) and
    random max lengths on both sides: the scan's row equals the formatter's counts, the ids are
    input + target + vision tokens long, which is the planner's main length (`CostModel.sample_dims`,
    max_len included); every image's run is whole, in image order; a sample is refused exactly when
    its runs and specials pass the limit, with an error naming it."""
    cm = stage_cost_model(vlm_tiny(**TINY, vision=POLICY), 2, "cpu")
    rng = np.random.default_rng(0)
    samples = _mixed_samples(rng, 120)
    want_runs = {s["sample_id"]: [SIZES[tuple(wh)] for wh in s["image_sizes"]] for s in samples}
    refused_seen = cut_seen = 0
    for trial in range(12):
        limit = None if trial == 0 else int(rng.integers(8, 48))
        side = ("right", "left")[trial % 2]
        kw = dict(vision=POLICY, image_token_id=IMG, max_total_tokens=limit, truncation_side=side,
                  add_bos=bool(trial % 3))
        f = Formatter("bytes", **kw)
        got = f.encode_batch(samples, on_error="skip")
        table = scan_shapes(samples, "bytes", on_error="skip", **{**kw, "image_token_id": None},
                            label_config=f.config)  # the id comes from label_config
        rows = table.to_pydict()
        kept = [e for e in got if e is not None]
        assert rows["sample_id"] == [e.sample_id for e in kept]
        assert rows["input_tokens"] == [e.input_tokens for e in kept]
        assert rows["target_tokens"] == [e.target_tokens for e in kept]
        assert rows["vision_tokens"] == [e.vision_tokens for e in kept]
        assert scan_stats(table).num_skipped == len(samples) - len(kept)
        shapes = _shapes_of(kept)
        main, _, tiles = cm.sample_dims(shapes)
        assert main.tolist() == [len(e.input_ids) for e in kept]
        assert tiles.tolist() == [e.vision_tokens // 4 for e in kept]
        for s, e in zip(samples, got):
            specials = int(kw["add_bos"]) * ("input_ids" not in s) + ("input_ids" not in s and "messages" not in s)
            fits = limit is None or sum(want_runs[s["sample_id"]]) + specials <= limit
            assert (e is not None) == fits, (s, limit)
            if e is None:
                refused_seen += 1
                with pytest.raises(SampleError, match=rf"sample 's{s['sample_id']}'.*placeholder run is never cut"):
                    f.encode(s)
                continue
            assert _runs_whole(e, want_runs[s["sample_id"]]), (s, e.input_ids)
            assert (e.input_ids == IMG).sum() == e.vision_tokens == sum(want_runs[s["sample_id"]])
            assert np.all(e.labels[e.input_ids == IMG] == IGNORE_INDEX)
            assert len(e.input_ids) == e.input_tokens + e.target_tokens + e.vision_tokens
            if limit is not None:
                assert len(e.input_ids) <= limit
                # the same as the planner's cut of the full counts: text cut to max_len - vision
                full = _full_formatter(kw).encode(s)
                m, _, _ = cm.sample_dims(_shapes_of([full]), max_len=limit)
                assert int(m[0]) == len(e.input_ids)
                cut_seen += e.truncated
    assert refused_seen > 20 and cut_seen > 50


def _runs_whole(e, want):
    """The maximal runs of IMG are the images' runs in order, whole; runs of images with no text between
    them (no markers, or the text between cut away) merge into one run, the sum of theirs."""
    got, k = runs(e.input_ids), 0
    for g in got:
        acc = 0
        while acc < g and k < len(want):
            acc += want[k]
            k += 1
        if acc != g:
            return False
    return k == len(want)


def _full_formatter(kw):
    return Formatter("bytes", **{**kw, "max_total_tokens": None})


def _shapes_of(encoded):
    from dynabatch import Shapes

    return Shapes.from_lengths(input_tokens=[e.input_tokens for e in encoded],
                               target_tokens=[e.target_tokens for e in encoded],
                               vision_tokens=[e.vision_tokens for e in encoded])


def test_refused_samples_raise_or_are_skipped_in_the_dataloader_index_scan():
    """The DataLoader's index scans full counts with the training formatting as label_config: a sample
    whose runs the max length cannot hold is skipped and counted there (no row, so it is never planned),
    or raises naming it; encoder-decoder limits count the runs in the input."""
    ok = img_sample(1, [(56, 56)], inputs="q", targets="a")
    big = img_sample(2, [(168, 56)], inputs="q", targets="a")  # 16 placeholders
    train = FormatConfig(max_total_tokens=12, image_token_id=IMG)
    table = scan_shapes([ok, big], "bytes", vision=POLICY, label_config=train, on_error="skip")
    assert table.column("sample_id").to_pylist() == [1]
    st = scan_stats(table)
    assert st.num_skipped == 1 and st.skipped[0][0] == "s2" and "16 placeholder tokens" in st.skipped[0][1]
    with pytest.raises(SampleError, match=r"sample 's2'"):
        scan_shapes([ok, big], "bytes", vision=POLICY, label_config=train)
    with pytest.raises(ValueError, match="must insert the same placeholders"):
        scan_shapes([ok], "bytes", vision=POLICY, label_config=train, image_token_id=IMG + 1)
    ed = Formatter("bytes", family="encoder_decoder", vision=POLICY, image_token_id=IMG, max_input_tokens=10)
    out = ed.encode_batch([img_sample(3, [(56, 56)], inputs="abcdefghij", targets="t"), big], on_error="skip")
    assert out[1] is None and out[0].input_ids.tolist() == [*[IMG] * 4, *enc("abcdef")] and out[0].truncated


# -- the DataLoader and vlm-tiny -------------------------------------------------------------------

def _image_refs(n):
    """``n`` images: the shared COCO photos (paths) when present, else generated ones (bytes)."""
    if (SHARED_IMAGES / "manifest.jsonl").exists():
        rows = [json.loads(line) for line in (SHARED_IMAGES / "manifest.jsonl").read_text().splitlines() if line]
        return [(str((SHARED_IMAGES / r["file"]).resolve()), r["captions"][0][:40]) for r in rows[:n]]
    from dynabatch import datagen

    return [({"bytes": data, "path": None}, "a picture of shapes")
            for _, _, data, _ in datagen.image_text_samples(n, seed=0)]


def _loaders(markers: bool, n_img: int = 5, tokens: int = 120):
    """The micro-batches of the same records through a DataLoader with placeholders and one without:
    image+text and text-only records mixed, then text-only records alone (text-only micro-batches)."""
    import datasets

    from dynabatch import DataLoader

    rows = []
    for i, (ref, caption) in enumerate(_image_refs(n_img)):
        if markers:  # LLaVA conversations: the marker after the template's "User: "
            rows.append({"conversations": [{"from": "human", "value": f"<image>\nDescribe photo {i}."},
                                           {"from": "gpt", "value": caption}], "image": ref})
        else:
            rows.append({"inputs": f"describe image {i}", "targets": caption, "image": ref})
    text = [{"inputs": f"say {i} words", "targets": "words " * (i + 1), "image": None} for i in range(4)]
    rows += text
    keys = {k: None for r in rows for k in r}  # Dataset.from_list takes its columns from the first row
    rows = [{**keys, **r} for r in rows]
    model = vlm_tiny(**TINY, vision=POLICY, seed=1)
    common = dict(vision=POLICY, load_pixels=True, cost_model=stage_cost_model(model, 2, "cpu"), num_stages=2,
                  seed=0, global_batch_tokens=tokens)
    out = []
    for tid in (IMG, None):
        mixed = DataLoader(datasets.Dataset.from_list(rows), **records_from_keywords(dict(image_token_id=tid, **common)))
        alone = DataLoader(datasets.Dataset.from_list(text),
                           **records_from_keywords(dict(image_token_id=tid, **{**common, "global_batch_tokens": 60})))
        out.append([b for s in mixed.steps() for b in s] + [b for s in alone.steps() for b in s])
    return tuple(out)


KEEP = ("input_ids", "attention_mask", "labels", "image_tiles", "pixel_values", "sample_ids")


def _pad_like(pre: dict, ph: dict) -> dict:
    """The prepend twin ``pre`` with its text ids right-padded to the placeholder batch's merged length
    (its own merged length then, too): the DataLoader pads placeholder ids (vision included) to the
    plan's pad multiple, text ids before the model adds the vision tokens. With equal lengths the
    head's float32 loss sums the same terms in the same order."""
    width = merged_length(ph, 4, IMG)
    assert width >= merged_length(pre, 4)
    out = dict(pre)
    for key, fill in (("input_ids", 0), ("attention_mask", 0), ("labels", IGNORE_INDEX)):
        x = pre[key]
        out[key] = torch.cat([x, x.new_full((x.shape[0], width - x.shape[1]), fill)], 1)
    assert merged_length(out, 4) == width
    return out


def test_dataloader_puts_one_run_per_image_tile_tokens_long():
    """DataLoader(image_token_id=...): every row holds image_tiles x tile_tokens placeholders, labels -100
    there, the ids are as long as the merged sequence; the option conflicts with a format_config."""
    ph, plain = _loaders(markers=True)
    tiles = [int(b["image_tiles"].sum()) for b in ph]
    assert any(tiles) and 0 in tiles
    for b in ph:
        n = (b["input_ids"] == IMG).sum(1)
        assert n.tolist() == (b["image_tiles"] * 4).tolist()
        assert bool((b["labels"][b["input_ids"] == IMG] == IGNORE_INDEX).all())
        assert merged_length(b, 4, IMG) == b["input_ids"].shape[1] >= int(b["attention_mask"].sum(1).max())
        assert b["pixel_values"].shape == (int(b["image_tiles"].sum()), 3, 56, 56)
    for b in plain:
        assert not bool((b["input_ids"] == IMG).any())
    import datasets

    from dynabatch import DataLoader

    with pytest.raises(TypeError, match="image_token_id= in format_config or as a keyword"):
        DataLoader(datasets.Dataset.from_list([{"inputs": "a", "targets": "b"}]),
                   options=PlanOptions(global_batch_tokens=64),
                   tokenization=Tokenization(vision=POLICY, format_config=FormatConfig(), image_token_id=IMG))


def _as_float64(b):
    return {**b, "pixel_values": b["pixel_values"].double()} if "pixel_values" in b else b


def _synthetic_twins(model, seed=0):
    """(prepend batches, their placeholder twins) of the synthetic shapes of test_pipeline_vlm; the twins
    are what ``model.random_batch`` makes for a model with ``image_token_id``."""
    from test_pipeline_vlm import SHAPES

    from dynabatch.pipeline.models.vlm import vlm_random_batch

    make = vlm_random_batch(TINY["vocab"], model.tile_tokens, model.tile_size)
    gen = torch.Generator().manual_seed(seed)
    pre = [make(s, gen) for s in SHAPES]
    twins = [with_placeholders(b, model.tile_tokens, IMG) if int(b["image_tiles"].sum()) else b for b in pre]
    gen = torch.Generator().manual_seed(seed)
    for s, t in zip(SHAPES, twins):
        own = model.random_batch(s, gen)
        assert all(torch.equal(own[k], t[k]) for k in t), s
    return pre, twins


def test_placeholder_and_prepend_paths_give_the_same_loss_and_gradients():
    """The same samples (the DataLoader's, without markers so the run is first, and synthetic twins) as
    placeholder batches and as prepend batches: same merged length and boundary shapes, and in float64
    the same loss and every gradient; the plan's micro-batches are the same in both loaders."""
    ph, plain = _loaders(markers=False)
    assert [b["sample_ids"].tolist() for b in ph] == [b["sample_ids"].tolist() for b in plain]
    pad = stage_cost_model(vlm_tiny(**TINY), 2, "cpu").pad_multiple
    for x in ph:  # the placeholder ids are the plan's padded main length
        real = int(x["attention_mask"].sum(1).max())
        assert x["input_ids"].shape[1] == -(-real // pad) * pad or not int(x["image_tiles"].sum())
    plain = [_pad_like(p, x) for p, x in zip(plain, ph)]
    a = vlm_tiny(**TINY, dtype=torch.float64, seed=3, image_token_id=IMG)
    b = vlm_tiny(**TINY, dtype=torch.float64, seed=3)
    pre, twins = _synthetic_twins(a)
    ph_batches = [_as_float64(x) for x in ph] + [_as_float64(x) for x in twins]
    pre_batches = [_as_float64(x) for x in plain] + [_as_float64(x) for x in pre]
    assert any(bool((x["input_ids"] == IMG).any()) for x in ph_batches)
    shapes = a.batch_shapes(ph_batches)
    assert [(s.rows, s.input_len, s.tiles) for s in shapes] == \
        [(s.rows, s.input_len, s.tiles) for s in b.batch_shapes(pre_batches)]
    for shape, batch in zip(shapes, ph_batches):  # every boundary follows from the plan's shape
        x = None
        for i, layer in enumerate(a.layers[:-1]):
            x = layer(batch) if i == 0 else layer(x)
            assert all(w.matches(t) for w, t in zip(a.boundary(shape, i), x)), (i, [t.shape for t in x])
    calls = vision_calls(a)
    la, na = sequential_step(a.layers, ph_batches)
    lb, nb = one_pass(b.layers, pre_batches)
    assert na == nb > 0 and la == pytest.approx(lb, rel=1e-12)
    for p, q in zip(a.parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-13)
    assert vision_calls(a) - calls == a.vision_layers * sum(int(x["image_tiles"].sum()) > 0 for x in ph_batches)


def test_placeholders_mid_sequence_take_the_tiles_in_order():
    """LLaVA conversations (the run after "User: "): the merged embedding at the k-th placeholder of the
    micro-batch is the k-th projected vision token (plus its position); text positions keep their
    token embeddings; the loss is finite and ignores the placeholders."""
    ph, _ = _loaders(markers=True)
    model = vlm_tiny(**TINY, dtype=torch.float64, seed=2, image_token_id=IMG)
    n_vis = model.vision_layers
    merge = model.layers[n_vis]
    checked = 0
    for b in (_as_float64(x) for x in ph):
        if not int(b["image_tiles"].sum()):
            continue
        x = b
        for layer in model.layers[:n_vis]:
            x = layer(x)
        vis, ids, seg, slots = x
        h, _ = merge(x)
        at = b["input_ids"] == IMG
        assert bool(at[:, 0].logical_not().all())  # not at the start: the template comes first
        pos = merge.pos((seg.cumsum(-1) - 1).clamp(min=0))
        assert torch.allclose((h - pos)[at], vis.reshape(-1, vis.shape[-1]), atol=1e-12)
        text = b["attention_mask"].bool() & ~at
        assert torch.allclose((h - pos)[text], merge.tok(b["input_ids"][text]), atol=1e-12)
        checked += 1
    assert checked >= 2
    loss, ntok = sequential_step(model.layers, [_as_float64(x) for x in ph])
    assert np.isfinite(loss) and ntok == sum(int((x["labels"][:, 1:] != IGNORE_INDEX).sum()) for x in ph)


def test_placeholder_count_must_match_the_tiles():
    """A row whose placeholders are not image_tiles x tile_tokens (one dropped, or a tile too many, or
    placeholders in a text-only micro-batch) is refused, naming the row and its sample id."""
    ph, _ = _loaders(markers=True)
    model = vlm_tiny(**TINY, seed=2, image_token_id=IMG)
    b = next(x for x in ph if int(x["image_tiles"].sum()))
    r = int(torch.nonzero(b["image_tiles"]).flatten()[0])
    ids = b["input_ids"].clone()
    ids[r, int(torch.nonzero(ids[r] == IMG).flatten()[0])] = 5
    sid = int(b["sample_ids"][r])
    for bad in ({**b, "input_ids": ids}, {**b, "image_tiles": b["image_tiles"] + (torch.arange(len(ids)) == r)}):
        with pytest.raises(ValueError, match=rf"row {r} \(sample_id {sid}\) holds \d+ image placeholder tokens"):
            model.layers[0](bad)
        with pytest.raises(ValueError, match="placeholder"):
            model.batch_shapes([bad])
    text = next(x for x in ph if not int(x["image_tiles"].sum()))
    bad = {**text, "input_ids": text["input_ids"].masked_fill(text["attention_mask"].bool() & (
        torch.arange(text["input_ids"].shape[1]) == 0), IMG)}
    with pytest.raises(ValueError, match=r"holds 1 image placeholder tokens .* 0 tile\(s\)"):
        sequential_step(model.layers, [bad])
    assert placeholder_mask(text, 4, IMG) is None and placeholder_mask(b, 4, None) is None


# -- 2 gloo stages ---------------------------------------------------------------------------------

def pipeline_worker(rank, world, port, bounds, schedules, batch_file):
    """Rank side: vlm-tiny with image_token_id (float64) cut at ``bounds``; the placeholder batches
    (DataLoader's and synthetic) vs one process on them and vs the prepend twins."""
    torch.set_default_dtype(torch.float64)
    ph, pre = torch.load(batch_file, weights_only=False)
    ctx = init_pipeline(world, rank=rank, world_size=world, master_port=port, timeout_s=30, abort_after_s=10)
    out = []
    with ctx:
        for schedule in schedules:
            model, ref, old = (vlm_tiny(**TINY, dtype=torch.float64, seed=1, image_token_id=IMG) for _ in range(3))
            synth_pre, synth_ph = _synthetic_twins(model, seed=2)
            batches = [_as_float64(b) for b in ph] + [_as_float64(b) for b in synth_ph]
            prepend = [_as_float64(b) for b in pre] + [_as_float64(b) for b in synth_pre]
            shapes = model.batch_shapes(batches)
            runner = PipelineRunner.from_model(model, ctx, bounds, RunnerConfig(schedule=schedule))
            res = runner.step(shapes, batches if ctx.stage in (0, world - 1) else None)
            ref_loss, ref_n = sequential_step(ref.layers, batches)
            pre_loss, pre_n = sequential_step(old.layers, prepend)
            lo = runner.stage.first_layer
            diff = scale = pre_diff = 0.0
            for i, layer in enumerate(runner.stage.layers):
                for p, q, o in zip(layer.parameters(), ref.layers[lo + i].parameters(),
                                   old.layers[lo + i].parameters()):
                    diff = max(diff, float((p.grad - q.grad).abs().max()))
                    pre_diff = max(pre_diff, float((p.grad - o.grad).abs().max()))
                    scale = max(scale, float(q.grad.abs().max()))
            out.append({"schedule": schedule, "loss": res.loss, "ref_loss": ref_loss, "pre_loss": pre_loss,
                        "tokens": res.num_tokens, "ref_tokens": ref_n, "pre_tokens": pre_n, "diff": diff,
                        "pre_diff": pre_diff, "scale": scale, "calls": vision_calls(runner.stage.layers),
                        "image_mbs": sum(s.tiles > 0 for s in shapes),
                        "placeholder_mbs": sum(bool((b["input_ids"] == IMG).any()) for b in batches),
                        "vision_here": sum(lo + i < model.vision_layers for i in range(len(runner.stage.layers)))})
    return out


@pytest.mark.parametrize("bounds", [[0, 2, 8], [0, 5, 8]], ids=["cut-inside-vit", "cut-after-merge"])
def test_two_gloo_stages_match_single_process(tmp_path, bounds):
    """2 gloo stages on placeholder micro-batches (the DataLoader's real image+text and text-only ones,
    plus synthetic): loss and every gradient equal one process's and the prepend twins' (float64),
    for gpipe and 1f1b; the vision layers run once per image micro-batch."""
    ph, pre = _loaders(markers=False)
    pre = [_pad_like(p, x) for p, x in zip(pre, ph)]
    path = tmp_path / "batches.pt"
    torch.save(([{k: b[k] for k in KEEP} for b in ph], [{k: b[k] for k in KEEP} for b in pre]), path)
    res = launch_local(f"{__file__}:pipeline_worker", 2, args=(bounds, ["gpipe", "1f1b"], str(path)),
                       idle_timeout_s=120)
    for result in ok(res):
        assert [c["schedule"] for c in result] == ["gpipe", "1f1b"]
        for c in result:
            assert c["placeholder_mbs"] >= 3 and c["image_mbs"] == c["placeholder_mbs"]
            assert c["tokens"] == c["ref_tokens"] == c["pre_tokens"]
            assert c["loss"] == pytest.approx(c["ref_loss"], rel=1e-12)
            assert c["loss"] == pytest.approx(c["pre_loss"], rel=1e-12)
            assert c["scale"] > 0 and c["diff"] <= 1e-10 * c["scale"] and c["pre_diff"] <= 1e-10 * c["scale"], c
            assert c["calls"] == c["vision_here"] * c["image_mbs"], c


def test_index_cache_is_tied_to_image_token_id(tmp_path):
    """The indexed mode's length index records image_token_id: a cache made with placeholders (markers
    removed from the text) is rebuilt for a loader without them, whose text counts hold the markers."""
    import datasets
    import pyarrow.parquet as pq

    from dynabatch import DataLoader

    rows = [{"conversations": [{"from": "human", "value": f"<image>\nDescribe photo {i}."},
                               {"from": "gpt", "value": caption}], "image": ref}
            for i, (ref, caption) in enumerate(_image_refs(3))]
    path = tmp_path / "index.parquet"
    common = dict(vision=POLICY, cost_model=stage_cost_model(vlm_tiny(**TINY, vision=POLICY), 2, "cpu"),
                  num_stages=2, global_batch_tokens=200, index_cache=str(path))

    def index():
        t = pq.read_table(path)
        return json.loads(t.schema.metadata[b"dynabatch.index_settings"]), t.column("input_tokens").to_pylist()

    DataLoader(datasets.Dataset.from_list(rows), **records_from_keywords(dict(image_token_id=IMG, **common)))
    settings, with_ph = index()
    assert settings["image_token_id"] == IMG
    stamp = path.stat().st_mtime_ns
    DataLoader(datasets.Dataset.from_list(rows), **records_from_keywords(dict(image_token_id=IMG, **common)))  # reused as it is
    assert index() == (settings, with_ph) and path.stat().st_mtime_ns == stamp
    DataLoader(datasets.Dataset.from_list(rows), **records_from_keywords(dict(**common)))
    settings, without = index()
    assert "image_token_id" not in settings
    assert [b - a for a, b in zip(with_ph, without)] == [len("<image>")] * 3
