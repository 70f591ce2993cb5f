"""`DataLoader` state dicts: what they hold, how they are checked and how ranks' states merge.

All states are JSON-serializable dicts with ``format`` = ``"dynabatch.loader_state"``, a
``version``, the ``mode`` and an ``identity`` (dataset fingerprint and the options that decide the
batches; a state is refused by a loader whose identity differs). They are cheap: positions and
ids, never sample contents (except for sources without random access).

* Indexed / replay: ``epoch``, ``step_in_epoch``, ``microbatch`` (micro-batches of that step this
  rank has yielded), ``consumed`` (their sample ids) and ``exclude`` (ids of that step consumed
  before an earlier resume on another world size). At a step boundary the state is the same on
  every rank and loads on any world size.
* Streaming: additionally the per-slot source states, the round-robin slot position, exhausted
  slots and the buffered sample ids as of the start of the current step (see `_streaming`).

`merge_states` combines the states of *all* ranks of a run into one state that loads on any
world size (and, streaming, any number of workers): it lists what nobody has consumed yet.
"""

from __future__ import annotations

import copy

import numpy as np

STATE_FORMAT = "dynabatch.loader_state"
STATE_VERSION = 1


class LoaderStateError(ValueError):
    """A state dict cannot be loaded into this DataLoader (other data, options or layout)."""


def base_state(mode: str, identity: dict, **fields) -> dict:
    out = {"format": STATE_FORMAT, "version": STATE_VERSION, "mode": mode, "identity": identity}
    out.update(fields)
    return out


def check_state(state, mode: str, identity: dict) -> None:
    """Raise `LoaderStateError` unless ``state`` is a loader state of ``mode`` with ``identity``."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise LoaderStateError(f"not a dynabatch DataLoader state: {str(state)[:80]}")
    if state.get("version") != STATE_VERSION:
        raise LoaderStateError(f"DataLoader state version {state.get('version')} is not supported "
                               f"(this dynabatch reads {STATE_VERSION})")
    if state.get("mode") != mode:
        raise LoaderStateError(f"the state is from a DataLoader in {state.get('mode')!r} mode, this one is in "
                               f"{mode!r} mode")
    saved = state.get("identity", {})
    for key in sorted(set(saved) | set(identity)):
        if saved.get(key) != identity.get(key):
            raise LoaderStateError(f"the state was saved with {key}={saved.get(key)!r}, but this DataLoader has "
                                   f"{key}={identity.get(key)!r}; resume with the same data and options")


def _ids(x) -> list[int]:
    return [int(v) for v in np.asarray(x, np.int64).ravel()]


def merge_states(states: list[dict]) -> dict:
    """One state from every rank's state of one run (any order), loadable on any world size."""
    states = list(states)
    if not states:
        raise LoaderStateError("merge_states needs the states of every rank")
    first = states[0]
    for s in states:
        if not isinstance(s, dict) or s.get("format") != STATE_FORMAT:
            raise LoaderStateError(f"not a dynabatch DataLoader state: {str(s)[:80]}")
        if s.get("merged"):
            raise LoaderStateError("merge_states takes the per-rank states, not an already merged one")
        for key in ("mode", "identity", "world_size"):
            if s.get(key) != first.get(key):
                raise LoaderStateError(f"states differ in {key}: {s.get(key)!r} vs {first.get(key)!r}")
    W = first["world_size"]
    ranks = sorted(s["rank"] for s in states)
    if ranks != list(range(W)):
        raise LoaderStateError(f"need exactly one state per rank of world_size={W}, got ranks {ranks}")
    pos = {(s["epoch"], s["step_in_epoch"]) for s in states}
    if len(pos) != 1:
        raise LoaderStateError(f"the ranks' states are at different steps {sorted(pos)}; take them at the same "
                               "point of the training loop")
    states = sorted(states, key=lambda s: s["rank"])
    mb = [int(s.get("microbatch", 0)) for s in states]
    out = {k: copy.deepcopy(first[k]) for k in ("format", "version", "mode", "identity", "epoch", "step",
                                                  "step_in_epoch")}
    out.update(merged=True, from_world_size=W, microbatch=mb)
    if all(s.get("fresh") for s in states):  # every rank finished the epoch: nothing half done
        out.update(fresh=True)
        return out
    if first["mode"] in ("indexed", "replay"):
        before = sorted({i for s in states for i in s.get("exclude", [])})
        consumed = sorted({i for s in states for i in s.get("consumed", [])})
        out.update(exclude_before=before, exclude=sorted(set(before) | set(consumed)))
        return out
    if first["mode"] != "streaming":
        raise LoaderStateError(f"unknown DataLoader mode {first['mode']!r}")
    import loaders

    slot_states = [st for s in states for st in s["slots"].values()]
    merged = loaders.merge_states(slot_states)
    leftover = []
    for s in states:
        done = set(s.get("consumed", []))
        leftover += [i for i in s["buffer_ids"] if i not in done]
    out["global"] = add_ids_to_global(merged, leftover, first.get("mixture_offsets"))
    return out


def add_ids_to_global(global_state: dict, ids: list[int], mixture_offsets: dict | None = None) -> dict:
    """A loaders global state that also delivers the samples ``ids`` (buffered, not consumed).

    ``mixture_offsets`` (name -> [first shard, end shard]) routes ids to a mixture's sources.
    """
    from .access import split_ids

    g = copy.deepcopy(global_state)
    if not ids:
        return g
    shard, pos = split_ids(ids)
    if g.get("type") == "mixture_global":
        for name, (lo, hi) in (mixture_offsets or {}).items():
            sel = (shard >= lo) & (shard < hi)
            child = g["children"][name]
            child["remaining"] = sorted(child["remaining"] + [[int(a - lo), int(b), int(b) + 1]
                                                               for a, b in zip(shard[sel], pos[sel])])
        return g
    g["remaining"] = sorted(g["remaining"] + [[int(a), int(b), int(b) + 1] for a, b in zip(shard, pos)])
    return g


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

    from .steps import TokSample

    def arr(v):
        return None if v is None else np.asarray(v, np.int32)

    return [TokSample(d["sample_id"], EncodedSample(d["sample_id"], arr(d["input_ids"]), arr(d["target_ids"]),
                                                     arr(d["labels"]), d["input_tokens"], d["target_tokens"],
                                                     d["vision_tokens"], d["truncated"]), d["tiles"], d["images"])
            for d in items]
