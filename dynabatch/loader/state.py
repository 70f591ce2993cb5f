"""`DataLoader` state dicts: their nested layout, how they are checked and how ranks' states merge.

A DataLoader state is a JSON-serializable dict ``{"format": "dynabatch.loader_state", "version":
3, "mode": <mode>, <mode>: <the mode's state>, "integrity": {"fields": {...}}}``; the mode object
(`dynabatch.loader.modes`) makes and loads the inner state alone (``mode.state_dict()`` /
``mode.load_state_dict()``), the way torchdata nodes nest their children's states. Every mode state
holds an ``identity`` (dataset fingerprint, the data files and tokenizer hash, `origin_identity`,
and the options that decide the batches; a state is refused by a loader whose identity differs), the ``layout`` (``rank``, ``world_size``, ``num_workers``) and the position: ``epoch``,
``step``, ``step_in_epoch``, ``microbatch`` (micro-batches of that step this rank has yielded) and
``consumed`` (their sample ids); ``fresh`` marks the start of an epoch. They are cheap: positions
and ids, never sample contents (except for sources without random access).

* Indexed / replay: ``exclude`` (ids of that step consumed before an earlier resume on another
  world size). At a step boundary the state is the same on every rank and loads on any world size.
* Streaming: ``feed`` (the chunk feed's state: per-slot ``loaders`` source states, the round-robin
  slot position and exhausted slots) and ``buffer`` (the buffered sample ids as of the start of the
  current step, plus their tokens for sources without random access); ``shard_ranges`` of a mixture.

`merge_states` combines the states of *all* ranks of a run into one state that loads on any
world size (and, streaming, any number of workers): it lists what nobody has consumed yet.

``integrity`` (`dynabatch.integrity.field_digests`: a digest of every field, e.g.
``indexed.step_in_epoch``, ``indexed.identity.seed``) is written by `wrap` and checked whenever a
state is loaded or merged: a state edited or damaged after it was saved (an ``epoch``,
``step_in_epoch``, ``exclude`` or ``consumed`` changed by hand) is refused naming the fields.
`save_loader_state` writes a state atomically (temporary file, fsync, rename); `load_loader_state`
reads one, naming the file in every error (empty, truncated, not JSON, edited).
"""

from __future__ import annotations

import copy
import json
import os

import numpy as np

from .. import integrity

STATE_FORMAT = "dynabatch.loader_state"
STATE_VERSION = 3
INTEGRITY = "integrity"
#: what to do when a state is refused as edited or damaged
_FIX = ("resume from the state file exactly as it was saved, or start the epoch anew (set_epoch(epoch) without "
        "load_state_dict)")


class LoaderStateError(ValueError):
    """A state dict cannot be loaded into this DataLoader (other data, options or layout)."""


def wrap(mode: str, mode_state: dict) -> dict:
    """The DataLoader state holding ``mode_state`` under the key ``mode``, with its integrity record."""
    state = {"format": STATE_FORMAT, "version": STATE_VERSION, "mode": mode, mode: mode_state}
    state[INTEGRITY] = {"fields": integrity.field_digests(json.loads(json.dumps(state)))}
    return state


def _check_outer(state, where: str = "the DataLoader state") -> None:
    """Refuse what is not a DataLoader state of this version, or one whose fields do not match its
    integrity record; messages start with ``where`` (the file it was read from)."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise LoaderStateError(f"{where} is not a dynabatch DataLoader state: {str(state)[:80]}")
    if state.get("version") != STATE_VERSION:
        raise LoaderStateError(f"{where}: DataLoader state version {state.get('version')} is not supported (this "
                               f"dynabatch reads {STATE_VERSION}, whose states carry an integrity record); resume "
                               "with the dynabatch that saved it, or start the epoch anew")
    rec = state.get(INTEGRITY)
    if not isinstance(rec, dict) or not isinstance(rec.get("fields"), dict):
        raise LoaderStateError(f"{where} has no integrity record (its '{INTEGRITY}' field is missing or damaged), so "
                               f"its position cannot be trusted; {_FIX}")
    body = json.loads(json.dumps({k: v for k, v in state.items() if k != INTEGRITY}))  # as a file holds it
    integrity.check(LoaderStateError, where, "field", rec["fields"], integrity.field_digests(body), _FIX)


def save_loader_state(state: dict, path) -> None:
    """Write a DataLoader state (`DataLoader.state_dict`) to ``path`` as JSON, atomically: a
    temporary file in the same folder, flushed and fsynced, then renamed over ``path``; a crash
    leaves the old file or the new one, never a part."""
    _check_outer(state)
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    try:  # the rename itself survives a power loss once the folder is synced
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_loader_state(path) -> dict:
    """Read a DataLoader state written by `save_loader_state` (or any JSON dump of a
    `DataLoader.state_dict`), checked (`LoaderStateError` naming the file when it is empty,
    truncated, not JSON, or edited: see the module docstring). Load it with ``load_state_dict``."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        raw = f.read()
    if not raw.strip():
        raise LoaderStateError(f"{path}: the DataLoader state file is empty (a save that did not finish?); resume "
                               "from an earlier checkpoint, or start the epoch anew")
    try:
        state = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoaderStateError(f"{path}: the DataLoader state file is not valid JSON ({e}; {len(raw)} bytes: truncated "
                               "or damaged); resume from an earlier checkpoint, or start the epoch anew") from None
    _check_outer(state, str(path))
    return state


def unwrap(state, mode: str) -> dict:
    """The mode state inside a DataLoader state of ``mode`` (LoaderStateError otherwise)."""
    _check_outer(state)
    if state.get("mode") != mode:
        raise LoaderStateError(f"the state is from a DataLoader in {state.get('mode')!r} mode, this one is in "
                               f"{mode!r} mode")
    return state[mode]


def origin_identity(source, tokenizer) -> dict:
    """The identity entries every mode state carries: ``data_files`` (`loaders.file_fingerprints`
    of ``source``) and ``tokenizer_hash`` (`tokenization.tokenizer_fingerprint`)."""
    import loaders
    from tokenization import tokenizer_fingerprint

    return {"data_files": loaders.file_fingerprints(source), "tokenizer_hash": tokenizer_fingerprint(tokenizer)}


def check_identity(state: dict, identity: dict, source=None, tokenizer=None) -> None:
    """Raise `LoaderStateError` unless a mode state was saved with ``identity``; a change of the
    data files of ``source`` is named by file, another ``tokenizer`` by its name and both hashes."""
    if not isinstance(state, dict) or "identity" not in state:
        raise LoaderStateError(f"not a DataLoader mode state: {str(state)[:80]}")
    saved = state["identity"]
    fix = "resume with the data and tokenizer the state was saved with, or start the epoch anew"
    if saved.get("data_files") != identity.get("data_files"):
        integrity.check_data_files(LoaderStateError, "the DataLoader state", saved.get("data_files"), source, fix)
    if saved.get("tokenizer_hash") != identity.get("tokenizer_hash") and tokenizer is not None:
        integrity.check_tokenizer(LoaderStateError, "the DataLoader state", saved.get("tokenizer_hash"), None,
                                  tokenizer, fix)
    for key in sorted(set(saved) | set(identity)):
        if saved.get(key) != identity.get(key):
            raise LoaderStateError(f"the state was saved with {key}={saved.get(key)!r}, but this DataLoader has "
                                   f"{key}={identity.get(key)!r}; resume with the same data and options")


def _ids(x) -> list[int]:
    return [int(v) for v in np.asarray(x, np.int64).ravel()]


def merge_states(states: list[dict]) -> dict:
    """One DataLoader state from every rank's state of one run (any order), loadable on any world size."""
    states = list(states)
    if not states:
        raise LoaderStateError("merge_states needs the states of every rank")
    for s in states:
        _check_outer(s)
        if s.get("mode") != states[0].get("mode"):
            raise LoaderStateError(f"states differ in mode: {s.get('mode')!r} vs {states[0].get('mode')!r}")
    mode = states[0]["mode"]
    return wrap(mode, merge_mode_states(mode, [s[mode] for s in states]))


def merge_mode_states(mode: str, states: list[dict]) -> dict:
    """`merge_states` of the mode states (``mode``: ``indexed``, ``replay`` or ``streaming``)."""
    first = states[0]
    for s in states:
        if s.get("merged"):
            raise LoaderStateError("merge_states takes the per-rank states, not an already merged one")
        for key in ("identity",):
            if s.get(key) != first.get(key):
                raise LoaderStateError(f"states differ in {key}: {s.get(key)!r} vs {first.get(key)!r}")
        if s["layout"]["world_size"] != first["layout"]["world_size"]:
            raise LoaderStateError("states differ in world_size")
    W = first["layout"]["world_size"]
    ranks = sorted(s["layout"]["rank"] for s in states)
    if ranks != list(range(W)):
        raise LoaderStateError(f"need exactly one state per rank of world_size={W}, got ranks {ranks}")
    pos = {(s["epoch"], s["step_in_epoch"]) for s in states}
    if len(pos) != 1:
        raise LoaderStateError(f"the ranks' states are at different steps {sorted(pos)}; take them at the same "
                               "point of the training loop")
    states = sorted(states, key=lambda s: s["layout"]["rank"])
    mb = [int(s.get("microbatch", 0)) for s in states]
    out = {k: copy.deepcopy(first[k]) for k in ("identity", "epoch", "step", "step_in_epoch")}
    out.update(merged=True, from_world_size=W, microbatch=mb)
    if all(s.get("fresh") for s in states):  # every rank finished the epoch: nothing half done
        out.update(fresh=True)
        return out
    if mode in ("indexed", "replay"):
        before = sorted({i for s in states for i in s.get("exclude", [])})
        consumed = sorted({i for s in states for i in s.get("consumed", [])})
        out.update(exclude_before=before, exclude=sorted(set(before) | set(consumed)))
        return out
    if mode != "streaming":
        raise LoaderStateError(f"unknown DataLoader mode {mode!r}")
    import loaders

    merged = loaders.merge_states([st for s in states for st in s["feed"]["slots"].values()])
    leftover = []
    for s in states:
        done = set(s.get("consumed", []))
        leftover += [i for i in s["buffer"]["ids"] if i not in done]
    ranges = first.get("shard_ranges")
    out["global"] = loaders.requeue_samples(merged, leftover, {k: tuple(v) for k, v in ranges.items()} if ranges
                                            else None)
    return out


def encoded_to_json(toks) -> list[dict]:
    """Tokenized samples as JSON (for sources whose samples cannot be re-read by position)."""
    out = []
    for t in toks:
        e = t.enc
        out.append({"sample_id": int(t.sample_id), "tiles": int(t.tiles), "images": t.images,
                    "input_ids": e.input_ids.tolist(),
                    "target_ids": None if e.target_ids is None else e.target_ids.tolist(),
                    "labels": None if e.labels is None else e.labels.tolist(),
                    "input_tokens": int(e.input_tokens), "target_tokens": int(e.target_tokens),
                    "vision_tokens": int(e.vision_tokens), "truncated": bool(e.truncated)})
    return out


def encoded_from_json(items: list[dict]):
    from tokenization import EncodedSample

    from .records import TokSample

    def arr(v):
        return None if v is None else np.asarray(v, np.int32)

    return [TokSample(d["sample_id"], EncodedSample(d["sample_id"], arr(d["input_ids"]), arr(d["target_ids"]),
                                                     arr(d["labels"]), d["input_tokens"], d["target_tokens"],
                                                     d["vision_tokens"], d["truncated"]), d["tiles"], d["images"])
            for d in items]
