"""`tokenizer_fingerprint`: what a tokenizer *is*, by content, not by the path it was loaded from.

Recorded with every length index, plan and loader state that token counts or token ids depend
on, so that a tokenizer replaced at the same path (same vocabulary size, other merges) or another
tokenizer given to a loader is refused instead of silently planning with the wrong counts.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ._adapters import load_tokenizer
from ._protocol import ByteTokenizer

#: The fingerprint of the built-in byte tokenizer (no content to hash: it never changes).
BYTES_FINGERPRINT = "bytes-v1"


def _content(tok: Any) -> list:
    """The parts of a tokenizer (an adapter of this package, or a supported library's object)
    that decide its token ids, as bytes or strings."""
    inner = getattr(tok, "_tok", None) or getattr(tok, "_enc", None) or getattr(tok, "_sp", None) or tok
    to_str = getattr(inner, "to_str", None)  # tokenizers.Tokenizer
    backend = getattr(inner, "backend_tokenizer", None)  # transformers fast tokenizers
    if backend is not None:
        parts = [backend.to_str(), json.dumps(getattr(inner, "added_tokens_encoder", {}), sort_keys=True)]
    elif to_str is not None:
        parts = [to_str()]
    elif hasattr(inner, "serialized_model_proto"):  # sentencepiece
        parts = [inner.serialized_model_proto()]
    elif hasattr(inner, "_mergeable_ranks"):  # tiktoken: its ranks and special tokens
        ranks = sorted(inner._mergeable_ranks.items(), key=lambda kv: kv[1])
        parts = [b"".join(len(k).to_bytes(2, "little") + k for k, _ in ranks),
                 json.dumps(sorted(inner._special_tokens.items()))]
    elif hasattr(inner, "get_vocab"):  # a slow transformers tokenizer, or another vocabulary holder
        parts = [json.dumps(sorted(inner.get_vocab().items()))]
    else:  # a custom tokenizer without readable content: its name and size are all there is
        parts = [type(tok).__name__, str(getattr(tok, "name", "")), str(getattr(tok, "vocab_size", ""))]
    if hasattr(inner, "chat_template"):  # transformers: the template renders chat samples
        parts.append(str(inner.chat_template))
    # special ids decide padding, EOS and BOS insertion
    parts.append(repr(tuple(getattr(tok, a, None) for a in ("eos_id", "pad_id", "bos_id"))))
    return parts


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short content hash of a tokenizer (a `Tokenizer` adapter from `load_tokenizer`, or a
    tokenizer object of a supported library): ``sha256:<16 hex digits>`` of its serialized
    vocabulary and merges (``tokenizer.json``, sentencepiece model, tiktoken ranks, transformers
    vocabulary and chat template) and its special ids; ``bytes-v1`` for the built-in byte
    tokenizer. The same for the same tokenizer wherever it was loaded from; different when the
    file at a path was replaced. ``tokenizer`` may also be any `load_tokenizer` spec or object: the
    fingerprint is that of the adapter it loads as. A pure function (no caching)."""
    tokenizer = load_tokenizer(tokenizer)
    if isinstance(tokenizer, ByteTokenizer):
        return BYTES_FINGERPRINT
    h = hashlib.sha256()
    for part in _content(tokenizer):
        h.update(part if isinstance(part, bytes) else str(part).encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return "sha256:" + h.hexdigest()[:16]
