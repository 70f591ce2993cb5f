"""`DataLoader` state dicts: their nested layout, how they are checked and how ranks' states merge.

A DataLoader state is a JSON-serializable dict ``{"format": "dynabatch.loader_state", "version":
2, "mode": <mode>, <mode>: <the mode's state>}``; the mode object (`dynabatch.loader.modes`)
makes and loads the inner state alone (``mode.state_dict()`` / ``mode.load_state_dict()``), the way
torchdata nodes nest their children's states. Every mode state holds an ``identity`` (dataset
fingerprint and the options that decide the batches; a state is refused by a loader whose identity
differs), the ``layout`` (``rank``, ``world_size``, ``num_workers``) and the position: ``epoch``,
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
"""

from __future__ import annotations

import copy

import numpy as np

STATE_FORMAT = "dynabatch.loader_state"
STATE_VERSION = 2


class LoaderStateError(ValueError):
    """A state dict cannot be loaded into this DataLoader (other data, options or layout)."""


def wrap(mode: str, mode_state: dict) -> dict:
    """The DataLoader state holding ``mode_state`` under the key ``mode``."""
    return {"format": STATE_FORMAT, "version": STATE_VERSION, "mode": mode, mode: mode_state}


def _check_outer(state) -> None:
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise LoaderStateError(f"not a dynabatch DataLoader state: {str(state)[:80]}")
    if state.get("version") != STATE_VERSION:
        raise LoaderStateError(f"DataLoader state version {state.get('version')} is not supported "
                               f"(this dynabatch reads {STATE_VERSION})")


def unwrap(state, mode: str) -> dict:
    """The mode state inside a DataLoader state of ``mode`` (LoaderStateError otherwise)."""
    _check_outer(state)
    if state.get("mode") != mode:
        raise LoaderStateError(f"the state is from a DataLoader in {state.get('mode')!r} mode, this one is in "
                               f"{mode!r} mode")
    return state[mode]


def check_identity(state: dict, identity: dict) -> None:
    """Raise `LoaderStateError` unless a mode state was saved with ``identity``."""
    if not isinstance(state, dict) or "identity" not in state:
        raise LoaderStateError(f"not a DataLoader mode state: {str(state)[:80]}")
    saved = state["identity"]
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
