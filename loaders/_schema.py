"""Map raw records (FLAN-style text-to-text, LLaVA conversations, or user mapping) to samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ._errors import BadFieldError, EmptyTextError, MissingFieldError
from ._images import image_refs, image_size
from ._types import RawRecord

IMAGE_PLACEHOLDER = "<image>"
TASK_FIELDS = ("task_name", "task")
IMAGE_FIELDS = ("image", "images")
ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant", "bot": "assistant",
    "system": "system", "tool": "tool",
}
# Turn fields kept as they are for a chat template: tool calls, tool names, reasoning, ...
_TURN_KEYS = ("from", "role", "value", "content")
# (input field, target field(s)): the first pair whose input or target field is present wins.
TEXT_PAIRS = (
    ("inputs", ("targets",)),
    ("instruction", ("response", "output")),
    ("input", ("output",)),
    ("prompt", ("completion",)),
    ("source", ("target",)),
)
PRESETS = ("auto", "text2text", "conversation")


@dataclass
class Mapped:
    """A record after schema mapping, before ids and source name are attached."""

    inputs: str
    targets: str
    task: str = ""
    images: list[dict] = field(default_factory=list)
    image_sizes: list[tuple[int, int]] | None = None
    messages: list[dict] | None = None
    meta: dict = field(default_factory=dict)


def _text(rec: dict, name: str, where: str, required: bool = True, label: str | None = None) -> str:
    label = label or name
    if name not in rec or rec[name] is None:
        if required:
            raise MissingFieldError(f"missing field {label!r}", where=where, field=label)
        return ""
    value = rec[name]
    if not isinstance(value, str):
        raise BadFieldError(f"field {label!r} must be a string, got {type(value).__name__}",
                            where=where, field=label)
    return value


def _has(rec: dict, name: str) -> bool:
    """Whether ``rec`` has field ``name`` with a value: a None counts as absent (a table built from
    records with different fields holds None where a record had none)."""
    return rec.get(name) is not None


def _mapping_hint(rec: dict) -> str:
    """How to name a record's own fields: the ``mapping`` option of the source."""
    return (f"; the record has fields {sorted(rec)}: name yours with mapping={{'inputs': <field>, 'targets': "
            "<field>} (open_source(..., mapping=...); dynabatch.DataLoader: "
            "source=DataSource(source_options={'mapping': {...}}))")


def _nonempty(value: str, name: str, where: str) -> str:
    if not value.strip():
        raise EmptyTextError(f"field {name!r} is empty", where=where, field=name)
    return value


class Schema:
    """Turns a ``RawRecord`` into a ``Mapped`` sample.

    ``mapping`` is ``"auto"`` (detect per record), ``"text2text"``, ``"conversation"``,
    a dict renaming fields (``{"inputs": "question", "targets": "answer"}``), or a
    function ``record -> dict`` returning at least ``inputs`` and ``targets`` (optionally
    ``task``, ``images``, ``image_sizes``, ``messages``, ``meta``). Relative image paths
    resolve against ``image_root`` (default: the data file's folder). With
    ``check_images`` each image's header is opened to catch missing/unreadable images
    and to fill ``image_sizes``.
    """

    def __init__(self, mapping: str | dict | Callable = "auto", image_root: str | None = None,
                 check_images: bool = True):
        if isinstance(mapping, str) and mapping not in PRESETS:
            raise ValueError(f"mapping must be one of {PRESETS}, a dict or a function, got {mapping!r}")
        self.mapping = mapping
        self.image_root = image_root
        self.check_images = check_images
        self.storage = None  # opens remote image URLs (set by the Source to its reader's storage)

    def __call__(self, raw: RawRecord) -> Mapped:
        rec, where = raw.record, raw.where or raw.key
        root = self.image_root if self.image_root is not None else raw.base_dir
        if callable(self.mapping):
            out = self._user(rec, raw, root)
        else:
            if isinstance(self.mapping, dict):
                rec = {**rec, **{new: rec[old] for new, old in self.mapping.items() if old in rec}}
            # Images carried next to the record (webdataset members) win; the record's own
            # image fields (often the original file name) then stay in meta.
            images = list(raw.images)
            image_fields = () if images else IMAGE_FIELDS
            for f in image_fields:
                if rec.get(f) is not None:
                    images += image_refs(rec[f], root, where, f)
            conversational = _has(rec, "conversations") or _has(rec, "messages")
            if self.mapping == "conversation" or (self.mapping == "auto" and conversational):
                out, used = self._conversation(rec, where, images)
            else:
                out, used = self._text2text(rec, where, images)
            out.images = images
            out.task, task_field = self._task(rec, where)
            used |= {task_field, *image_fields, "image_sizes"}
            if isinstance(self.mapping, dict):
                used |= set(self.mapping) | set(self.mapping.values())
            out.meta = {k: v for k, v in rec.items() if k not in used}
            out.image_sizes = _record_sizes(rec, len(images))
        out.meta.update(raw.extra)
        if self.check_images and out.images:
            out.image_sizes = [image_size(ref, where, self.storage) for ref in out.images]
        return out

    @staticmethod
    def _task(rec: dict, where: str) -> tuple[str, str | None]:
        for f in TASK_FIELDS:
            if _has(rec, f):
                return _text(rec, f, where, required=False), f
        return "", None

    @staticmethod
    def _text2text(rec: dict, where: str, images: list) -> tuple[Mapped, set]:
        for src, targets in TEXT_PAIRS:
            if _has(rec, src) or _has(rec, targets[0]):
                if src == "source" and not _has(rec, "target"):
                    continue  # "source" alone is the dataset name in FLAN-style records
                tgt = next((t for t in targets if _has(rec, t)), targets[0])
                for name in (src, tgt):
                    if not _has(rec, name):
                        raise MissingFieldError(f"missing field {name!r} (a {src}/{tgt} record){_mapping_hint(rec)}",
                                                where=where, field=name)
                inputs = _text(rec, src, where)
                used = {src, tgt}
                if src == "instruction" and _text(rec, "input", where, required=False).strip():
                    inputs = f"{inputs}\n\n{rec['input']}"
                    used.add("input")
                if not images:
                    _nonempty(inputs, src, where)
                # Empty targets are legitimate (NIv2 has answers that are the empty list).
                return Mapped(inputs, _text(rec, tgt, where)), used
        if _has(rec, "caption"):
            return Mapped("", _nonempty(_text(rec, "caption", where), "caption", where)), {"caption"}
        if _has(rec, "text"):
            return Mapped(_nonempty(_text(rec, "text", where), "text", where), ""), {"text"}
        if _has(rec, "input_ids"):  # pre-tokenized (datasets.map(tokenize)): the ids stay in meta for the formatter
            return Mapped("", ""), set()
        raise MissingFieldError(
            "no text fields: expected inputs/targets, instruction/response, input/output, "
            f"prompt/completion, source/target, conversations, caption, text or input_ids{_mapping_hint(rec)}",
            where=where, field="inputs")

    @staticmethod
    def _conversation(rec: dict, where: str, images: list) -> tuple[Mapped, set]:
        name = "conversations" if _has(rec, "conversations") else "messages"
        turns = rec.get(name)
        if not isinstance(turns, list):
            if turns is None:
                raise MissingFieldError(f"missing field {name!r}", where=where, field=name)
            raise BadFieldError(f"field {name!r} must be a list, got {type(turns).__name__}",
                                where=where, field=name)
        messages = []
        for i, turn in enumerate(turns):
            fname = f"{name}[{i}]"
            if not isinstance(turn, dict):
                raise BadFieldError(f"{fname} must be an object", where=where, field=fname)
            role_key = "from" if "from" in turn else "role"
            role = _text(turn, role_key, where, label=f"{fname}.{role_key}")
            if role not in ROLES:
                raise BadFieldError(f"{fname}.{role_key} has unknown role {role!r}", where=where, field=fname)
            text_key = "value" if "value" in turn else "content"
            # an assistant turn that only calls tools may have no content
            content = _text(turn, text_key, where, label=f"{fname}.{text_key}", required=not turn.get("tool_calls"))
            extra = {k: v for k, v in turn.items() if k not in _TURN_KEYS}
            messages.append({"role": ROLES[role], "content": content, **extra})
        if not any(m["content"].strip() or m.get("tool_calls") for m in messages) and not images:
            raise EmptyTextError(f"conversation {name!r} has no text", where=where, field=name)
        placeholders = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
        if placeholders and not images:
            raise MissingFieldError(f"{placeholders} {IMAGE_PLACEHOLDER} placeholder(s) but no image",
                                    where=where, field="image")
        if images and placeholders != len(images):
            raise BadFieldError(f"{len(images)} image(s) but {placeholders} {IMAGE_PLACEHOLDER} placeholder(s)",
                                where=where, field=name)
        answered = bool(messages) and messages[-1]["role"] == "assistant"
        prompt = messages[:-1] if answered else messages
        targets = messages[-1]["content"] if answered else ""
        return Mapped("\n".join(m["content"] for m in prompt), targets, messages=messages), {name}

    def _user(self, rec: dict, raw: RawRecord, root: str) -> Mapped:
        where = raw.where or raw.key
        out = self.mapping(dict(rec))
        if not isinstance(out, dict):
            raise BadFieldError(f"mapping function returned {type(out).__name__}, expected a dict",
                                where=where, field="mapping")
        images = list(raw.images)
        if out.get("images"):
            images += image_refs(out["images"], root, where, "images")
        messages = out.get("messages")
        if messages is not None:
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and m.get("role") in ("user", "assistant", "system", "tool")
                and (isinstance(m.get("content"), str) or (m.get("content") is None and m.get("tool_calls")))
                for m in messages
            ):
                raise BadFieldError("messages must be a list of {role: user|assistant|system|tool, content: str} "
                                    "(content may be None on a turn with tool_calls)", where=where, field="messages")
        inputs, targets = _text(out, "inputs", where), _text(out, "targets", where)
        texts = [inputs, targets, *(m["content"] or "" for m in messages or [])]
        if not any(t.strip() for t in texts) and not images:
            raise EmptyTextError("mapping function returned no text", where=where, field="inputs")
        meta = out.get("meta") or {}
        if not isinstance(meta, dict):
            raise BadFieldError("meta must be a dict", where=where, field="meta")
        return Mapped(inputs, targets, _text(out, "task", where, required=False), images,
                      out.get("image_sizes"), messages, dict(meta))


def _record_sizes(rec: dict, n_images: int) -> list[tuple[int, int]] | None:
    sizes = rec.get("image_sizes")
    if isinstance(sizes, list) and len(sizes) == n_images:
        return [tuple(int(v) for v in s) for s in sizes]
    if n_images == 1 and isinstance(rec.get("width"), int) and isinstance(rec.get("height"), int):
        return [(rec["width"], rec["height"])]
    return None
