"""Issue 27 point 1: a DataLoader state carries an integrity record over all its fields; an edited,
emptied or truncated state is refused naming the file and the field; states are written atomically."""

from __future__ import annotations

import json
import os

import pytest

from dynabatch.loader.settings import records_from_keywords
from dynabatch import DataLoader, LoaderStateError
from dynabatch.loader.state import load_loader_state, save_loader_state

from test_dataloader_data import PLAN, ids_of
from test_dataloader_facade import TOKENS, data  # noqa: F401  (the facade's small Parquet/JSONL data fixture)


def _loader(data, fmt):
    kw = dict(global_batch_tokens=TOKENS, **PLAN)
    if fmt == "parquet":
        kw["index_cache"] = data["index"]
    return DataLoader(data[fmt], **records_from_keywords(dict(**kw)))


def _saved(data, fmt, tmp_path, steps=2):
    dl = _loader(data, fmt)
    it = iter(dl)
    head = [ids_of(next(it)) for _ in range(steps)]
    path = tmp_path / f"{fmt}_state.json"
    save_loader_state(dl.state_dict(), path)
    dl.close()
    return path, head


def _edit(path, fn, name):
    state = json.loads(path.read_text())
    fn(state[state["mode"]])
    out = path.with_name(name)
    out.write_text(json.dumps(state))
    return out


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_saved_state_round_trips_and_edits_are_refused_naming_file_and_field(data, fmt, tmp_path):  # noqa: F811
    path, head = _saved(data, fmt, tmp_path)
    want = [ids_of(s) for s in _loader(data, fmt)]
    dl = _loader(data, fmt)
    dl.load_state_dict(load_loader_state(path))  # the file as saved resumes exactly
    assert head + [ids_of(s) for s in dl] == want
    mode = json.loads(path.read_text())["mode"]

    def bump(key, by):
        return lambda s: s.__setitem__(key, s[key] + by)

    edits = {"step_in_epoch": bump("step_in_epoch", 2), "epoch": bump("epoch", 1),
             "consumed": lambda s: s["consumed"].extend([1, 2, 3, 4, 5])}
    if fmt == "parquet":
        edits["exclude"] = lambda s: s["exclude"].extend([7, 8, 9, 10, 11])
        edits["identity.seed"] = lambda s: s["identity"].__setitem__("seed", 9)
    for field, fn in edits.items():
        edited = _edit(path, fn, f"edited_{field.replace('.', '_')}.json")
        with pytest.raises(LoaderStateError) as e:
            load_loader_state(edited)
        msg = str(e.value)
        assert str(edited) in msg and f"field {mode}.{field} does not match the integrity record" in msg, msg
        assert "start the epoch anew" in msg and "\n" not in msg
        # the same state handed over as a dict (e.g. read with json.load) is refused too
        with pytest.raises(LoaderStateError, match=rf"the DataLoader state: field {mode}\.{field} does not match"):
            _loader(data, fmt).load_state_dict(json.loads(edited.read_text()))
    # two fields at once are both named; a state without its record is refused
    both = _edit(path, lambda s: (bump("epoch", 1)(s), bump("step", 3)(s)), "two.json")
    with pytest.raises(LoaderStateError, match=rf"fields {mode}\.epoch, {mode}\.step do not match"):
        load_loader_state(both)
    bare = json.loads(path.read_text())
    del bare["integrity"]
    with pytest.raises(LoaderStateError, match="has no integrity record"):
        _loader(data, fmt).load_state_dict(bare)


def test_empty_truncated_and_non_json_state_files_name_the_file(data, tmp_path):  # noqa: F811
    path, _ = _saved(data, "parquet", tmp_path)
    raw = path.read_bytes()
    cases = {"empty.json": b"", "blank.json": b"  \n", "truncated.json": raw[: len(raw) // 2], "junk.json": b"\x00\xff"}
    for name, content in cases.items():
        p = tmp_path / name
        p.write_bytes(content)
        with pytest.raises(LoaderStateError) as e:
            load_loader_state(p)
        msg = str(e.value)
        assert msg.startswith(f"{p}: the DataLoader state file is ") and ("empty" in msg or "not valid JSON" in msg)
    with pytest.raises(FileNotFoundError):
        load_loader_state(tmp_path / "missing.json")


def test_save_is_atomic_and_leaves_no_temporary_file(data, tmp_path, monkeypatch):  # noqa: F811
    path, _ = _saved(data, "parquet", tmp_path)
    before = path.read_bytes()
    dl = _loader(data, "parquet")
    next(iter(dl))
    state = dl.state_dict()
    dl.close()
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        save_loader_state(state, path)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["parquet_state.json"]
    assert synced  # the temporary file was synced before the rename
    monkeypatch.undo()
    save_loader_state(state, path)
    assert load_loader_state(path) == json.loads(json.dumps(state))
    with pytest.raises(LoaderStateError, match="not a dynabatch DataLoader state"):
        save_loader_state({"x": 1}, path)
