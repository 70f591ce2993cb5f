"""Schema mapping: FLAN field names and alternates, LLaVA conversations, user mappings."""

from __future__ import annotations

import os

import pytest
from conftest_loaders import image_bytes, write_jsonl, write_tar

import loaders

SAMPLE_KEYS = {"sample_id", "key", "inputs", "targets", "task", "images", "source", "meta"}


def _one(tmp_path, rec, **kw):
    path = write_jsonl(tmp_path / "d.jsonl", [rec])
    (sample,) = list(loaders.JsonlSource(path, **kw))
    return sample


def test_flan_fields_and_meta(tmp_path):
    rec = {"inputs": "Translate: hi", "targets": "salut", "task_name": "wmt", "template_type": "zs_opt", "id": 7}
    s = _one(tmp_path, rec, name="flan")
    assert set(s) == SAMPLE_KEYS
    assert (s["inputs"], s["targets"], s["task"], s["source"]) == ("Translate: hi", "salut", "wmt", "flan")
    assert s["meta"] == {"template_type": "zs_opt", "id": 7} and s["images"] == []
    assert s["key"] == "d.jsonl:1" and s["sample_id"] == 0


@pytest.mark.parametrize(
    "rec, inputs, targets",
    [
        ({"input": "a", "output": "b"}, "a", "b"),
        ({"instruction": "Do X", "response": "done"}, "Do X", "done"),
        ({"instruction": "Do X", "input": "on Y", "response": "done"}, "Do X\n\non Y", "done"),
        ({"instruction": "Do X", "input": "", "output": "done"}, "Do X", "done"),  # Alpaca
        ({"source": "a", "target": "b"}, "a", "b"),
        ({"prompt": "a", "completion": "b"}, "a", "b"),
        ({"inputs": "a", "targets": "b", "source": "niv2"}, "a", "b"),  # "source" as dataset name
        ({"text": "plain text"}, "plain text", ""),
    ],
)
def test_alternate_field_names(tmp_path, rec, inputs, targets):
    s = _one(tmp_path, {**rec, "task": "t1"})
    assert (s["inputs"], s["targets"], s["task"]) == (inputs, targets, "t1")
    assert "input" not in s["meta"] or rec.get("input") == ""


def test_llava_conversation_with_image_root(tmp_path):
    img_dir = tmp_path / "imgs" / "coco"
    img_dir.mkdir(parents=True)
    (img_dir / "1.png").write_bytes(image_bytes(size=(12, 5)))
    rec = {"id": "42", "image": "coco/1.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat color?"}, {"from": "gpt", "value": "Red."},
        {"from": "human", "value": "Sure?"}, {"from": "gpt", "value": "Yes."}]}
    s = _one(tmp_path, rec, image_root=str(tmp_path / "imgs"))
    assert s["messages"] == [
        {"role": "user", "content": "<image>\nWhat color?"}, {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes."}]
    assert s["targets"] == "Yes." and s["inputs"] == "<image>\nWhat color?\nRed.\nSure?"
    assert s["images"] == [{"path": str(img_dir / "1.png")}] and os.path.isabs(s["images"][0]["path"])
    assert s["image_sizes"] == [(12, 5)] and s["meta"] == {"id": "42"}


def test_conversation_without_answer_and_text_only(tmp_path):
    rec = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    s = _one(tmp_path, rec)
    assert s["targets"] == "" and s["inputs"] == "Be brief.\nHi" and s["images"] == []
    assert [m["role"] for m in s["messages"]] == ["system", "user"]


def test_llava_placeholder_mismatch(tmp_path):
    (tmp_path / "a.png").write_bytes(image_bytes())
    rec = {"image": ["a.png", "a.png"], "conversations": [{"from": "human", "value": "<image> hi"},
                                                        {"from": "gpt", "value": "x"}]}
    with pytest.raises(loaders.BadFieldError, match="2 image.*1 <image>"):
        _one(tmp_path, rec)
    rec = {"conversations": [{"from": "human", "value": "<image> hi"}, {"from": "gpt", "value": "x"}]}
    with pytest.raises(loaders.MissingFieldError, match="no image"):
        _one(tmp_path, rec)
    rec = {"conversations": [{"from": "robot", "value": "hi"}]}
    with pytest.raises(loaders.BadFieldError, match="unknown role"):
        _one(tmp_path, rec)


def test_embedded_image_bytes_in_hf_dataset():
    import datasets

    png = image_bytes(size=(3, 4))
    ds = datasets.Dataset.from_list([{"image": {"bytes": png, "path": None},
                                      "conversations": [{"from": "human", "value": "<image>Describe."},
                                                        {"from": "gpt", "value": "Red."}]}])
    ds = ds.cast_column("image", datasets.Image())
    (s,) = list(loaders.HFSource(ds, name="llava"))
    assert s["images"] == [{"bytes": png}] and s["image_sizes"] == [(3, 4)] and s["key"] == "llava:0"


def test_webdataset_image_caption_and_json(tmp_path):
    png, jpg = image_bytes("PNG"), image_bytes("JPEG", (10, 20))
    path = write_tar(tmp_path / "mm-000.tar", [
        ("c1", {"jpg": jpg, "txt": b"a red square", "cls": b"3"}),
        ("c2", {"png": png, "json": b'{"conversations": [{"from": "human", "value": "<image>?"},'
                                    b' {"from": "gpt", "value": "red"}], "width": 8, "height": 6, "image": "orig/1.png"}'}),
        ("t3", {"txt": b"just text"}),
    ])
    a, b, c = list(loaders.WebDatasetSource(path))
    assert (a["key"], a["inputs"], a["targets"], a["images"]) == ("c1", "", "a red square", [{"bytes": jpg}])
    assert a["image_sizes"] == [(10, 20)] and a["meta"] == {"cls": "3"}
    assert b["messages"][1] == {"role": "assistant", "content": "red"} and b["images"] == [{"bytes": png}]
    assert b["meta"]["image"] == "orig/1.png"  # the embedded member wins over the record's path
    assert (c["inputs"], c["targets"], c["images"]) == ("just text", "", [])
    # Sizes carried by the record are used when images are not checked.
    (b2,) = [x for x in loaders.WebDatasetSource(path, check_images=False) if x["key"] == "c2"]
    assert b2["image_sizes"] == [(8, 6)]


def test_user_mapping_function(tmp_path):
    def mapping(rec):
        return {"inputs": f"Q: {rec['q']}", "targets": rec["a"], "task": "qa",
                "meta": {"orig": rec["q"]}}

    s = _one(tmp_path, {"q": "why?", "a": "because"}, mapping=mapping, name="custom")
    assert (s["inputs"], s["targets"], s["task"], s["meta"], s["source"]) == (
        "Q: why?", "because", "qa", {"orig": "why?"}, "custom")
    with pytest.raises(loaders.MissingFieldError, match="'targets'"):
        _one(tmp_path, {"q": "x"}, mapping=lambda r: {"inputs": r["q"]})
    with pytest.raises(loaders.BadFieldError, match="expected a dict"):
        _one(tmp_path, {"q": "x"}, mapping=lambda r: None)


def test_dict_mapping_renames_fields(tmp_path):
    s = _one(tmp_path, {"question": "q?", "answer": "a", "category": "c", "x": 1},
             mapping={"inputs": "question", "targets": "answer", "task": "category"})
    assert (s["inputs"], s["targets"], s["task"], s["meta"]) == ("q?", "a", "c", {"x": 1})


def test_preset_mappings(tmp_path):
    rec = {"inputs": "a", "targets": "b", "messages": [{"role": "user", "content": "hey"}]}
    assert _one(tmp_path, rec, mapping="text2text")["inputs"] == "a"
    assert _one(tmp_path, rec, mapping="conversation")["inputs"] == "hey"
    with pytest.raises(ValueError, match="mapping must be"):
        _one(tmp_path, rec, mapping="flan-v3")
