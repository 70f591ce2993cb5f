"""State dict layout, compatibility checks, and merging per-slot states into a global one.

A *slot* state (one rank x worker) lists its work units, a cursor (unit index, next
position), the shuffle buffer as (shard, position) refs plus the buffer's RNG state, and
error counts. A *global* state lists the row ranges nobody has delivered yet; it can be
loaded on any world layout, which re-deals that remaining work exactly once.
"""

from __future__ import annotations

from collections import Counter

from ._errors import StateError
from ._fingerprints import changed_files
from ._sharding import WorkUnit, merge_ranges, split_sample_ids

STATE_VERSION = 1
# Settings that must match for a state to mean the same stream.
SLOT_KEYS = ("fingerprint", "seed", "shuffle", "shuffle_buffer", "units_per_slot", "cap")
GLOBAL_KEYS = ("fingerprint", "seed", "cap")


def check_state(state: dict, expected: dict, kinds: tuple[str, ...], source=None) -> None:
    """Raise ``StateError`` unless ``state`` is of one of ``kinds`` and matches ``expected``; a
    change of ``source``'s files is named by file (`changed_files`)."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise StateError(f"not a loaders state dict (version {STATE_VERSION}): {str(state)[:80]}")
    if state.get("type") not in kinds:
        raise StateError(f"state of type {state.get('type')!r} cannot be loaded here (expected {kinds})")
    keys = SLOT_KEYS if state["type"] == "slot" else GLOBAL_KEYS
    files_changed = state.get("fingerprint") != expected.get("fingerprint") and state.get("files") is not None
    if source is not None and files_changed:
        changes = changed_files(state["files"], source)
        if changes:
            raise StateError(f"state of source {state.get('name')!r} was saved with a different file list or dataset: "
                             f"{'; '.join(changes)}; resume with the data the state was saved with, or start anew")
    for key in keys:
        if state.get(key) != expected.get(key):
            what = {
                "fingerprint": "a different file list or dataset, or files that changed since "
                f"({state.get('num_shards')} shards / {state.get('num_rows')} rows saved, "
                f"{expected.get('num_shards')} shards / {expected.get('num_rows')} rows here)",
            }.get(key, f"{key}={state.get(key)!r}, but this source has {key}={expected.get(key)!r}")
            raise StateError(f"state of source {state.get('name')!r} was saved with {what}")


def check_layout(state: dict, layout_list: list[int]) -> None:
    """Raise ``StateError`` when a slot state is loaded on another rank/worker layout."""
    saved = state["layout"]
    if saved != layout_list:
        raise StateError(
            f"state was saved on rank {saved[0]} of {saved[1]} (worker {saved[2]} of {saved[3]}), "
            f"but is loaded on rank {layout_list[0]} of {layout_list[1]} "
            f"(worker {layout_list[2]} of {layout_list[3]}); to resume on another layout, "
            "combine every slot's state with loaders.merge_states() and load the result")


def slot_remaining(state: dict) -> list[WorkUnit]:
    """Row ranges a slot state has not delivered: rest of the units plus buffered positions."""
    units = [WorkUnit(*u) for u in state["units"]]
    index, pos = state["cursor"]
    rest = []
    if index < len(units):
        u = units[index]
        rest.append(WorkUnit(u.shard, max(pos, u.start), u.stop))
        rest += units[index + 1:]
    rest += [WorkUnit(s, p, p + 1) for s, p in state["buffer"]]
    return rest


def merge_states(states: list[dict]) -> dict:
    """Combine the states of *all* slots of one run into a layout-free global state.

    Load the result with ``load_state_dict`` on any number of ranks/workers: the work
    not yet delivered is split and dealt again, so every sample of the epoch is still
    delivered exactly once overall. Works for ``Source`` and ``Mixture`` states.
    """
    states = list(states)
    if not states:
        raise StateError("merge_states needs at least one state")
    kinds = {s.get("type") for s in states}
    if kinds == {"mixture"}:
        return _merge_mixture(states)
    if kinds != {"slot"}:
        raise StateError(f"merge_states takes per-slot states of one kind, got types {sorted(map(str, kinds))}")
    first = states[0]
    for s in states[1:]:
        check_state(s, first, ("slot",))
        if s["epoch"] != first["epoch"]:
            raise StateError(f"states are from different epochs ({first['epoch']} and {s['epoch']})")
    shapes = {tuple(s["layout"][1::2]) for s in states}
    if len(shapes) != 1:
        raise StateError(f"states come from different layouts (world_size, num_workers): {sorted(shapes)}")
    world_size, num_workers = shapes.pop()
    per_rank = max(1, num_workers)
    seen = Counter(s["layout"][0] * per_rank + s["layout"][2] for s in states)
    missing = sorted(set(range(world_size * per_rank)) - set(seen))
    doubled = sorted(k for k, n in seen.items() if n > 1)
    if missing or doubled:
        raise StateError(f"need exactly one state per slot of world_size={world_size} x "
                         f"num_workers={num_workers}: missing slots {missing}, repeated slots {doubled}")
    errors = Counter()
    for s in states:
        errors.update(s["errors"])
    remaining = merge_ranges([r for s in states for r in slot_remaining(s)])
    out = {k: first[k] for k in (*SLOT_KEYS, "name", "num_shards", "num_rows", "epoch")}
    if "files" in first:
        out["files"] = first["files"]
    out.update(version=STATE_VERSION, type="global", remaining=[r.to_list() for r in remaining],
               errors=dict(errors), from_layout=[world_size, num_workers])
    return out


def _merge_mixture(states: list[dict]) -> dict:
    names = states[0]["names"]
    if any(s["names"] != names for s in states):
        raise StateError("mixture states have different source names")
    return {
        "version": STATE_VERSION,
        "type": "mixture_global",
        "names": names,
        "seed": states[0]["seed"],
        "epoch": states[0]["epoch"],
        "children": {n: merge_states([s["children"][n] for s in states]) for n in names},
    }


def requeue_samples(global_state: dict, sample_ids, shard_ranges: dict | None = None) -> dict:
    """A copy of a global state (``merge_states``) that also delivers the samples ``sample_ids``:
    samples taken out of the stream but not used (e.g. a consumer's buffer at a checkpoint) are put
    back, exactly once. ``shard_ranges`` (`Mixture.shard_ranges`) routes the ids of a mixture's
    global state to its sources."""
    import copy

    g = copy.deepcopy(global_state)
    if not len(sample_ids):
        return g
    shard, pos = split_sample_ids(sample_ids)
    if g.get("type") == "mixture_global":
        if shard_ranges is None:
            raise StateError("requeue_samples of a mixture state needs the mixture's shard_ranges")
        for name, (lo, hi) in shard_ranges.items():
            sel = (shard >= lo) & (shard < hi)
            child = g["children"][name]
            child["remaining"] = sorted(child["remaining"] + [[int(a - lo), int(b), int(b) + 1]
                                                               for a, b in zip(shard[sel], pos[sel])])
        return g
    if g.get("type") != "global":
        raise StateError(f"requeue_samples needs a global state (merge_states), got type {g.get('type')!r}")
    g["remaining"] = sorted(g["remaining"] + [[int(a), int(b), int(b) + 1] for a, b in zip(shard, pos)])
    return g
