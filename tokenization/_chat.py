"""Conversations (``messages``): which chat template renders them, and the loss mask it gives.

Three renderings, chosen by `FormatConfig.chat_template` with the tokenizer (`resolve_chat`):

* the tokenizer's own Jinja chat template (a transformers tokenizer's ``chat_template``),
* a Jinja template given by the user (the template text),
* the library's plain `ChatTemplate` (``"User: ...\\nAssistant: "`` markers, any tokenizer).

A Jinja template is applied with the tokenizer's ``apply_chat_template`` (so the ids are exactly
the ones transformers gives), and the loss falls on the assistant turns only: on the tokens of its
``{% generation %}`` blocks when the template has them (``return_assistant_tokens_mask``), else on
the tokens that rendering the conversation up to each assistant turn adds to the rendering up to
the turn before it (with the generation prompt): the rendered-prefix diff. Without a chat template
anywhere (no option given and a tokenizer without one) the plain format is used with a
`ChatTemplateWarning`: never silently. The choice is logged once (INFO, logger ``tokenization``)
and recorded by `ChatRenderer.record`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import warnings
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np

from ._protocol import SampleError, Tokenizer

LOG = logging.getLogger("tokenization")
#: `FormatConfig.chat_template` keywords: the tokenizer's own template (an error without one) / the plain format.
TOKENIZER_TEMPLATE, PLAIN_TEMPLATE = "tokenizer", "plain"
# {% generation %} / {%- generation -%}: the assistant-mask markers transformers reads.
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateWarning(UserWarning):
    """Conversations are rendered with the plain `ChatTemplate` because no chat template was given
    and the tokenizer has none (pass ``chat_template=`` to choose one, or ``"plain"`` to keep this)."""


@dataclass(frozen=True)
class ChatTemplate:
    """Plain-text template that joins conversation turns (``messages``) into one sequence.

    Decoder-only: a user turn is ``user_prefix + content + turn_suffix`` (masked), an
    assistant turn is ``assistant_prefix`` (masked) then ``content`` + EOS (trained);
    ``system`` turns use ``system_prefix`` and are masked like user turns. Encoder-decoder:
    every turn but a final assistant turn is rendered as ``prefix + content + turn_suffix``
    into the input; the final assistant turn is the target. The markers are ordinary text,
    so the template works with any tokenizer. Tool turns, ``tool_calls`` and ``tools`` need a
    Jinja chat template (`FormatConfig.chat_template`).
    """

    user_prefix: str = "User: "
    assistant_prefix: str = "Assistant: "
    system_prefix: str = "System: "
    turn_suffix: str = "\n"

    def prefix(self, role: str) -> str:
        """Marker text that opens a turn of ``role`` (user, assistant or system)."""
        prefixes = {"user": self.user_prefix, "assistant": self.assistant_prefix, "system": self.system_prefix}
        if role not in prefixes:
            hint = " (tool turns need a Jinja chat template: chat_template=)" if role == "tool" else ""
            raise ValueError(f"unknown message role {role!r} (expected 'user', 'assistant' or 'system'){hint}")
        return prefixes[role]


ChatOption = Any  # None | "tokenizer" | "plain" | ChatTemplate | Jinja template text (see FormatConfig)


def check_chat_option(value: ChatOption) -> None:
    """Refuse a `FormatConfig.chat_template` value that is none of the accepted kinds."""
    if value is None or isinstance(value, ChatTemplate) or value in (TOKENIZER_TEMPLATE, PLAIN_TEMPLATE):
        return
    if not isinstance(value, str):
        raise TypeError(f"chat_template must be None, 'tokenizer', 'plain', a ChatTemplate or the text of a Jinja "
                        f"template, got {type(value).__name__} (read a template file with Path(...).read_text())")
    if "{{" not in value and "{%" not in value:
        raise ValueError(f"chat_template {value[:60]!r} is not a Jinja template (it has no '{{{{' or '{{%'): give the "
                         "template's text (read a file with Path(...).read_text()), 'tokenizer' or 'plain'")


def _digest(template: Any) -> str:
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclass
class ChatRenderer:
    """The resolved rendering of conversations for one tokenizer (see the module docstring).

    ``kind``: ``"tokenizer"`` (its own template), ``"given"`` (``template`` text) or ``"plain"``
    (``plain``); ``fallback``: plain because there was no template (warns once); ``masks``: the
    assistant tokens come from ``{% generation %}`` masks (else from rendered prefixes).
    """

    kind: Literal["tokenizer", "given", "plain"]
    plain: ChatTemplate | None = None
    template: str | None = None  # the Jinja text ("given"), None for the tokenizer's own
    digest: str = ""
    masks: bool = False
    fallback: str = ""  # why the plain format was chosen without being asked for
    announced: bool = False

    @property
    def jinja(self) -> bool:
        return self.kind != "plain"

    def record(self) -> str:
        """One line naming the rendering, recorded with the format settings (index metadata)."""
        if not self.jinja:
            return f"plain {self.plain!r}"
        how = "generation masks" if self.masks else "rendered prefixes"
        return f"{self.kind} chat template sha256:{self.digest} (assistant tokens from {how})"

    def announce(self) -> None:
        """Say once which template renders the conversations (a warning for the plain fallback)."""
        if self.announced:
            return
        self.announced = True
        if self.fallback:
            warnings.warn(f"{self.fallback}: conversations (messages) are rendered with dynabatch's plain format "
                          "('User: ...\\nAssistant: ...', tokenization.ChatTemplate); pass chat_template= a Jinja "
                          "template, or chat_template='plain' to choose this format", ChatTemplateWarning,
                          stacklevel=4)
        LOG.info("tokenization: conversations rendered with the %s", self.record())

    def render(self, samples: Sequence[dict], tok: Tokenizer) -> list[tuple[np.ndarray, np.ndarray] | SampleError]:
        """(ids, trained mask) of each conversation sample under the Jinja template, or the
        `SampleError` that names what is wrong with it."""
        out: list[Any] = [None] * len(samples)
        groups: dict[str, list[int]] = {}
        convs, tools = [], []
        for k, s in enumerate(samples):
            try:
                convs.append(jinja_messages(s))
                tools.append(_tools(s))
            except SampleError as exc:
                out[k] = exc
                convs.append(None)
                tools.append(None)
                continue
            groups.setdefault(json.dumps(tools[k], sort_keys=True, default=repr), []).append(k)
        for ks in groups.values():  # apply_chat_template takes one tools list per call
            try:
                results = self._render_group([convs[k] for k in ks], tools[ks[0]], tok)
            except Exception:  # the template refused one of them: find which, one by one
                results = [self._render_one(convs[k], tools[k], tok) for k in ks]
            for k, r in zip(ks, results):
                out[k] = r if not isinstance(r, str) else SampleError(_key(samples[k]), r)
        return out

    def _render_one(self, conv: list[dict], tools: Any, tok: Tokenizer) -> Any:
        try:
            return self._render_group([conv], tools, tok)[0]
        except Exception as exc:  # jinja2's TemplateError, raise_exception() in a template, a bad message
            return f"the chat template cannot render it: {type(exc).__name__}: {exc}"

    def _apply(self, tok: Tokenizer, convs: list, tools: Any, prompt: bool, masks: bool = False):
        return tok.apply_chat_template(convs, tools=tools, template=self.template, add_generation_prompt=prompt,
                                       assistant_masks=masks)

    def _render_group(self, convs: list[list[dict]], tools: Any, tok: Tokenizer) -> list:
        """Results (ids, trained) or an error text per conversation (one tools list for all)."""
        if self.masks:
            ids, masks = self._apply(tok, convs, tools, False, masks=True)
            return [(a, m.astype(bool)) for a, m in zip(ids, masks)]
        full, _ = self._apply(tok, convs, tools, False)
        heads, ends, owner = [], [], []
        out: list[Any] = [(a, np.zeros(len(a), bool)) for a in full]
        for c, msgs in enumerate(convs):
            for k, m in enumerate(msgs):
                if m.get("role") != "assistant":
                    continue
                if k == 0:
                    out[c] = ("its first message is an assistant turn: the rendered-prefix diff needs a turn before "
                              "it; use a chat template with {% generation %} markers")
                    break
                heads.append(msgs[:k])
                ends.append(msgs[:k + 1])
                owner.append((c, k))
        if not owner:
            return out
        head_ids, _ = self._apply(tok, heads, tools, True)
        end_ids, _ = self._apply(tok, ends, tools, False)
        for (c, k), h, e in zip(owner, head_ids, end_ids):
            if isinstance(out[c], str):
                continue
            ids, trained = out[c]
            if not (len(h) <= len(e) <= len(ids) and np.array_equal(ids[:len(e)], e)
                    and np.array_equal(ids[:len(h)], h)):
                out[c] = (f"message {k}: the chat template renders the conversation up to this assistant turn as "
                          "something that is not a prefix of the whole conversation, so its tokens cannot be "
                          "found by rendered prefixes; use a chat template with {% generation %} markers")
                continue
            trained[len(h):len(e)] = True
        return out


def _key(sample: dict) -> object:
    return sample.get("key", sample.get("sample_id"))


def _tools(sample: dict) -> Any:
    """The sample's ``tools`` (top level, else in ``meta`` where loaders put extra record fields)."""
    meta = sample.get("meta")
    value = sample.get("tools", meta.get("tools") if isinstance(meta, dict) else None)
    if value is not None and not isinstance(value, (list, tuple)):
        raise SampleError(_key(sample), f"'tools' must be a list of tool schemas, got {type(value).__name__}")
    return list(value) if value else None


def content_text(content: Any) -> str:
    """A message content as text: a str as is; a list of parts (``{"type": "text", "text": ...}``,
    ``{"type": "image"}``) joined with ``<image>`` for image parts (what the image checks read)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join("<image>" if p.get("type") == "image" else str(p.get("text", "")) for p in content)


def jinja_messages(sample: dict) -> list[dict]:
    """The sample's messages for a Jinja template, checked: dicts with a str ``role`` and a
    ``content`` that is a str, a list of parts, or absent on an assistant turn with ``tool_calls``."""
    msgs = sample.get("messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise SampleError(_key(sample), f"message {i} is malformed: it needs a str 'role' (got {m!r:.80})")
        content = m.get("content")
        ok = isinstance(content, str) or (isinstance(content, list) and all(isinstance(p, dict) for p in content))
        if not ok and not (content is None and m.get("tool_calls")):
            raise SampleError(_key(sample), f"message {i} content must be a str or a list of parts "
                                            f"(got {type(content).__name__})")
        out.append(dict(m))
    return out


def plain_messages(sample: dict, template: ChatTemplate) -> list[tuple[str, str]] | None:
    """(role, content) of the sample's messages for the plain format (None without messages)."""
    msgs = sample.get("messages")
    if not msgs:
        return None
    if _tools(sample):
        raise SampleError(_key(sample), "has 'tools', which the plain ChatTemplate cannot render: pass a Jinja "
                                        "chat_template (or a tokenizer with one)")
    out = []
    for i, m in enumerate(msgs):
        try:
            role, content = m["role"], m["content"]
            template.prefix(role)
        except (KeyError, TypeError, ValueError) as exc:
            raise SampleError(_key(sample), f"message {i} is malformed: {exc}") from exc
        if m.get("tool_calls"):
            raise SampleError(_key(sample), f"message {i} has tool_calls, which the plain ChatTemplate cannot "
                                            "render: pass a Jinja chat_template (or a tokenizer with one)")
        if not isinstance(content, str):
            raise SampleError(_key(sample), f"message {i} content must be a str")
        out.append((role, content))
    return out


def resolve_chat(option: ChatOption, tok: Tokenizer, family: str) -> ChatRenderer:
    """The `ChatRenderer` for `FormatConfig.chat_template` ``option`` with tokenizer ``tok``."""
    check_chat_option(option)
    if isinstance(option, ChatTemplate):
        return ChatRenderer("plain", plain=option)
    if option == PLAIN_TEMPLATE:
        return ChatRenderer("plain", plain=ChatTemplate())
    own = getattr(tok, "chat_template", None)
    jinja_ok = callable(getattr(tok, "apply_chat_template", None))
    if option is None:
        if own is None or family != "decoder":
            why = (f"tokenizer {tok.name!r} has no chat template" if own is None and jinja_ok else
                   f"tokenizer {tok.name!r} has no chat template (only a transformers tokenizer, from a folder or "
                   "an object, carries one)" if own is None else "encoder-decoder models take the plain format")
            return ChatRenderer("plain", plain=ChatTemplate(), fallback=why)
        option = TOKENIZER_TEMPLATE
    if family != "decoder":
        raise ValueError("a Jinja chat template renders one decoder-only sequence; for family='encoder_decoder' use "
                         "chat_template='plain' or a ChatTemplate(...)")
    if not jinja_ok:
        raise ValueError(f"chat_template={option[:40]!r} needs a transformers tokenizer (its apply_chat_template); "
                         f"tokenizer {tok.name!r} is not one: load a tokenizer folder or pass a transformers "
                         "tokenizer object, or use chat_template='plain'")
    if option == TOKENIZER_TEMPLATE:
        if own is None:
            raise ValueError(f"chat_template='tokenizer' but tokenizer {tok.name!r} has no chat template: pass the "
                             "template's text as chat_template=, or chat_template='plain'")
        texts = own.values() if isinstance(own, dict) else [own]
        return ChatRenderer("tokenizer", digest=_digest(own), masks=_has_masks(texts, tok))
    return ChatRenderer("given", template=option, digest=_digest(option), masks=_has_masks([option], tok))


def _has_masks(texts, tok: Tokenizer) -> bool:
    """Whether the assistant tokens come from {% generation %} masks: every template has the markers
    and the tokenizer maps tokens to characters (a fast tokenizer); else rendered prefixes."""
    return bool(getattr(tok, "assistant_masks", False)) and all(_GENERATION.search(t) for t in texts)
