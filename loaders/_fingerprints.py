"""What a source's data files are, recorded where something depends on their content (a length
index, a plan, a loader state), and how a change is named: `file_fingerprints` and `changed_files`.

A file's record is ``[name, size in bytes, version]`` in ``sample_id`` shard order (the shard index
is part of every ``sample_id``): ``name`` relative to the files' common folder (so a copy of the
data elsewhere matches), ``version`` the `ShardInfo.version` (a local file's content digest, an
object's ETag or version tag). A `Mixture` lists its sources' files in shard order, each name
prefixed with its source's name.
"""

from __future__ import annotations

_SHOW = 3  # changes named in a message


def _shards(source) -> list[tuple[str, object]]:
    """(recorded name, ShardInfo) of every shard of a Source or Mixture, in shard order."""
    children = getattr(source, "sources", None)
    if children is not None and hasattr(source, "shard_ranges"):  # a Mixture: its sources in shard order
        order = sorted(source.shard_ranges.items(), key=lambda kv: kv[1][0])
        return [(f"{name}/{info.name}", info) for name, _ in order for _, info in _shards(children[name])]
    return [(info.name, info) for info in source.shards]


def file_fingerprints(source) -> list[list]:
    """``[[name, size, version], ...]`` of the data files of a `Source` or `Mixture` (see the module
    docstring): JSON-able, equal for the same data wherever it is stored."""
    return [[name, int(info.size_bytes), str(info.version)] for name, info in _shards(source)]


def _where(info) -> str:
    return info.path or info.name


def changed_files(recorded, source) -> list[str]:
    """What differs between recorded `file_fingerprints` and ``source``'s files now, each change
    naming the file or object (its full path or URL): replaced content, another size, a file
    renamed, added or missing. Empty when they match."""
    now = _shards(source)
    out = []
    for i, (old, (name, info)) in enumerate(zip(recorded, now)):
        old_name, old_size, old_version = old
        if old_name != name:
            out.append(f"file {i} is {_where(info)} but was {old_name} (files renamed, added or removed)")
        elif int(old_size) != int(info.size_bytes) or str(old_version) != str(info.version):
            out.append(f"{_where(info)} changed (size {int(old_size)} -> {int(info.size_bytes)} bytes, version "
                       f"{old_version or '-'} -> {info.version or '-'})")
    if len(recorded) != len(now):
        extra = ", ".join(_where(info) for _, info in now[len(recorded):][:_SHOW])
        out.append(f"{len(now)} files now but {len(recorded)} recorded" + (f" (new: {extra})" if extra else ""))
    return out[:_SHOW] + ([f"{len(out) - _SHOW} more"] if len(out) > _SHOW else [])
