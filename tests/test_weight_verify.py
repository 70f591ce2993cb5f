"""Weights are verified where they are read (`dynabatch.pipeline.models.hf.verify`, through `WeightSource`):
a truncated or garbled safetensors file is an error naming the file and what is wrong (not safetensors'
"incomplete metadata" naming none), a non-finite tensor names the tensor and its file, and a folder the
library saved (``save_stage`` / ``merge_stages``) carries a checksum manifest that catches bytes changed in
place at the same size. ``save_stage`` refuses a non-finite stage. One process, tiny random tied Llama."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_tiny import build, decoder_config  # noqa: E402

from dynabatch.pipeline.models.hf import from_hf, merge_stages, save_stage  # noqa: E402
from dynabatch.pipeline.models.hf.verify import MANIFEST, DamagedWeights, FolderCheck  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(a plain save_pretrained folder, a sharded one, a merged pipeline checkpoint with its manifest)."""
    root = tmp_path_factory.mktemp("weights")
    model = build(decoder_config("llama", tie_word_embeddings=True, num_hidden_layers=2), dtype=torch.float32)
    model.save_pretrained(root / "plain")
    model.save_pretrained(root / "sharded", max_shard_size="6KB")
    for s, layers in enumerate([range(0, 2), range(2, 4)]):
        save_stage(from_hf(root / "plain", layers=layers), layers, root / "parts", s, 2)
    merge_stages(root / "parts", root / "merged")
    return root


def _copy(saved, name: str, tmp_path) -> Path:
    out = tmp_path / name
    shutil.copytree(saved / name, out, copy_function=shutil.copy2)  # mtimes kept: not a "copy" to the manifest
    return out


def _edit(path: Path, fn) -> None:
    raw = bytearray(path.read_bytes())
    fn(raw)
    path.write_bytes(bytes(raw))


def test_truncated_and_garbled_files_name_the_file(saved, tmp_path):
    plain = _copy(saved, "plain", tmp_path)
    f = plain / "model.safetensors"
    good = f.read_bytes()
    f.write_bytes(good[:-1000])
    with pytest.raises(DamagedWeights, match=r"model\.safetensors: tensor .* ends at data byte \d+ but the file "
                                             r"holds \d+ data bytes \(truncated\)"):
        from_hf(plain)
    f.write_bytes(b"\xff" * 8 + good[8:])
    with pytest.raises(DamagedWeights, match=r"model\.safetensors: its first 8 bytes give a header of \d+ bytes"):
        from_hf(plain)
    f.write_bytes(good[:20] + b"\xfe" * 20 + good[40:])
    with pytest.raises(DamagedWeights, match=r"model\.safetensors: its \d+-byte header is not valid JSON"):
        from_hf(plain)
    f.write_bytes(good + b"\0" * 64)  # bytes appended
    with pytest.raises(DamagedWeights, match=r"fill \d+ of its \d+ data bytes"):
        from_hf(plain)


def test_a_damaged_shard_is_named_and_only_its_reader_fails(saved, tmp_path):
    sharded = _copy(saved, "sharded", tmp_path)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    shard = sharded / index["model.layers.1.mlp.down_proj.weight"]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(DamagedWeights, match=rf"{shard.name}: .*truncated"):
        from_hf(sharded)
    from_hf(sharded, layers=range(0, 2))  # stage 0 never opens that shard
    (sharded / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(DamagedWeights, match=r"model\.safetensors\.index\.json: it is not a shard index"):
        from_hf(sharded, layers=range(0, 2))


def test_non_finite_tensor_names_tensor_and_file(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    plain = _copy(saved, "plain", tmp_path)
    f = plain / "model.safetensors"
    state = load_file(str(f))
    state["model.layers.1.mlp.up_proj.weight"][3, 2] = float("inf")
    save_file(state, str(f), metadata={"format": "pt"})
    with pytest.raises(DamagedWeights, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight in .*model\.safetensors "
                                             r"holds 1 non-finite value"):
        from_hf(plain)
    from_hf(plain, layers=range(0, 2))  # the layers that do not read it load


def test_library_saves_carry_a_manifest_that_catches_bytes_changed_in_place(saved, tmp_path, monkeypatch):
    merged = _copy(saved, "merged", tmp_path)
    manifest = json.loads((merged / MANIFEST).read_text())["files"]
    assert "model.safetensors" in manifest and len(manifest["model.safetensors"]["sha256"]) == 64
    parts = sorted(p.name for p in (saved / "parts").glob("dynabatch-checksums.stage-*.json"))
    assert parts == ["dynabatch-checksums.stage-00000-of-00002.json", "dynabatch-checksums.stage-00001-of-00002.json"]
    f = merged / "model.safetensors"
    check = FolderCheck(merged)
    check.opened(f)
    assert check.hashed == []  # unchanged (same size and mtime): the header is parsed, nothing hashed
    st = f.stat()

    def flip(raw):  # 1 KB of the data flipped, the size unchanged: the header still parses
        mid = len(raw) // 2
        raw[mid:mid + 1024] = bytes(b ^ 0x5A for b in raw[mid:mid + 1024])

    _edit(f, flip)
    assert f.stat().st_size == st.st_size
    with pytest.raises(DamagedWeights, match=r"model\.safetensors: its sha256 does not match dynabatch-checksums\.json"):
        from_hf(merged)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # bit rot keeps the mtime: only a full hash sees it
    from_hf(merged)
    monkeypatch.setenv("DYNABATCH_VERIFY_WEIGHTS", "hash")
    with pytest.raises(DamagedWeights, match="its sha256 does not match"):
        from_hf(merged)
    monkeypatch.setenv("DYNABATCH_VERIFY_WEIGHTS", "sometimes")
    with pytest.raises(ValueError, match=r"\$DYNABATCH_VERIFY_WEIGHTS must be one of"):
        from_hf(merged)


def test_a_copied_folder_is_hashed_and_loads(saved, tmp_path):
    merged = tmp_path / "copied"
    shutil.copytree(saved / "merged", merged, copy_function=shutil.copyfile)  # new mtimes, same bytes
    check = FolderCheck(merged)
    check.opened(merged / "model.safetensors")
    assert check.hashed == ["model.safetensors"]
    model = from_hf(merged)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_merge_refuses_a_damaged_part_and_save_refuses_non_finite_weights(saved, tmp_path):
    parts = _copy(saved, "parts", tmp_path)
    part = parts / "stage-00001-of-00002.safetensors"
    st = part.stat()
    _edit(part, lambda raw: raw.__setitem__(slice(len(raw) - 300, len(raw) - 200), b"\x11" * 100))
    assert part.stat().st_size == st.st_size
    with pytest.raises(DamagedWeights, match=rf"{part.name}: its sha256 does not match"):
        merge_stages(parts, tmp_path / "out")
    model = from_hf(saved / "plain", layers=range(2, 4))
    with torch.no_grad():
        model.layers[2].get_parameter(next(iter(model.keys[2]))).mul_(float("nan"))
    with pytest.raises(ValueError, match=r"stage 1 of 2 holds NaN or infinite values in 1 tensor\(s\).*nothing was "
                                         r"saved"):
        save_stage(model, range(2, 4), tmp_path / "diverged", 1, 2)
    assert not list((tmp_path / "diverged").glob("*.safetensors"))
