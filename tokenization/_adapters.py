"""Adapters from tokenizer libraries to the `Tokenizer` protocol, and `load_tokenizer`.

Every adapter loads from local files only: dynabatch never downloads a tokenizer.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ._protocol import ByteTokenizer, Tokenizer, as_id_arrays

# Candidate special-token strings, tried in order when the caller does not name them.
_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "[SEP]")
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")
_BOS_CANDIDATES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]")


# Optional packages that have a same-named extra in dynabatch's pyproject.toml.
_EXTRAS = ("tokenizers", "tiktoken", "sentencepiece")


def _require(module: str) -> Any:
    """Import an optional dependency or say exactly what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = f" (or pip install 'dynabatch[{module}]')" if module in _EXTRAS else ""
        raise ImportError(f"this tokenizer needs the optional package {module!r}: pip install {module}{extra}") from exc


def _existing_path(path: str | os.PathLike, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"{what} {str(path)!r} does not exist; dynabatch only loads tokenizers from local files"
        )
    return p


def _pick_special(
    lookup, given: str | None, candidates: Sequence[str], role: str, source: str
) -> int | None:
    """Id of the named special token, else of the first candidate the vocabulary has."""
    if given is not None:
        tid = lookup(given)
        if tid is None:
            raise ValueError(f"{role} token {given!r} is not in the vocabulary of {source}")
        return int(tid)
    for tok in candidates:
        tid = lookup(tok)
        if tid is not None:
            return int(tid)
    return None


def _fingerprint(*parts: str) -> str:
    """Short content hash naming a tokenizer object (so that two different objects never share a name)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()[:12]


def _config_specials(directory: Path) -> dict[str, str]:
    """Special-token strings declared next to a tokenizer.json (HF hub layout), if any."""
    found: dict[str, str] = {}
    for fname in ("tokenizer_config.json", "special_tokens_map.json"):
        f = directory / fname
        if not f.is_file():
            continue
        try:
            cfg = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for role in ("eos_token", "pad_token", "bos_token"):
            val = cfg.get(role)
            if isinstance(val, dict):
                val = val.get("content")
            if isinstance(val, str):
                found.setdefault(role, val)
    return found


class _Adapter:
    """Shared plumbing: protocol attributes and a readable repr."""

    name: str
    vocab_size: int
    eos_id: int
    pad_id: int
    bos_id: int | None

    def _set_specials(self, eos: int | None, pad: int | None, bos: int | None, *, why: str) -> None:
        if eos is None or eos < 0:
            raise ValueError(f"{self.name} has no EOS token ({why}); pass eos_token='...'")
        self.eos_id = int(eos)
        # Without a PAD token, padding with EOS is the common convention; padded positions
        # are masked anyway, so the choice never changes token counts.
        self.pad_id = self.eos_id if pad is None or pad < 0 else int(pad)
        self.bos_id = None if bos is None or bos < 0 else int(bos)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size})"


class HFTokenizer(_Adapter):
    """Hugging Face `tokenizers` adapter for a local ``tokenizer.json`` (needs ``pip install tokenizers``).

    ``tokenizer`` is a path to ``tokenizer.json`` or a ``tokenizers.Tokenizer`` object.
    Special tokens are found by the names given, else in a ``tokenizer_config.json`` /
    ``special_tokens_map.json`` next to the file, else among common names (``</s>``,
    ``<|endoftext|>``, ...). Batch encoding runs in parallel in Rust (set
    ``TOKENIZERS_PARALLELISM=false`` or ``RAYON_NUM_THREADS`` inside process pools).
    """

    def __init__(self, tokenizer: Any, *, eos_token: str | None = None, pad_token: str | None = None,
                 bos_token: str | None = None) -> None:
        tk = _require("tokenizers")
        if isinstance(tokenizer, (str, os.PathLike)):
            path = _existing_path(tokenizer, "tokenizer.json")
            self.name = f"tokenizers:{path}"
            declared = _config_specials(path.parent)
            tokenizer = tk.Tokenizer.from_file(str(path))
        else:
            if not isinstance(tokenizer, tk.Tokenizer):
                raise TypeError(f"HFTokenizer needs a tokenizer.json path or a tokenizers.Tokenizer, "
                                f"got {type(tokenizer).__name__}")
            raw = tokenizer.to_str()
            self.name = f"tokenizers:<object {_fingerprint(raw)}>"
            declared = {}
            # Work on a copy: the truncation/padding switched off below must not leak to the caller.
            tokenizer = tk.Tokenizer.from_str(raw)
        # A tokenizer.json may carry truncation/padding settings; they would silently cap or
        # pad the counts, and dynabatch applies its own explicit max lengths instead.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tok = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        look = tokenizer.token_to_id
        self._set_specials(
            _pick_special(look, eos_token or declared.get("eos_token"), _EOS_CANDIDATES, "EOS", self.name),
            _pick_special(look, pad_token or declared.get("pad_token"), _PAD_CANDIDATES, "PAD", self.name),
            _pick_special(look, bos_token or declared.get("bos_token"), _BOS_CANDIDATES, "BOS", self.name),
            why=f"looked for {list(_EOS_CANDIDATES)}",
        )
        # encode_batch_fast (tokenizers >= 0.20) skips computing character offsets.
        self._encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    @classmethod
    def from_object(cls, tokenizer: Any, *, eos_token: str | None = None, pad_token: str | None = None,
                    bos_token: str | None = None) -> "HFTokenizer":
        """Adapter of an in-memory ``tokenizers.Tokenizer`` (a copy: the caller's object is not changed).

        Special tokens are found by the names given (``eos_token=``, ``pad_token=``,
        ``bos_token=``), else among the common names; ``name`` carries a hash of the tokenizer.
        """
        return cls(tokenizer, eos_token=eos_token, pad_token=pad_token, bos_token=bos_token)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids (int32) of each text, no special tokens added."""
        return as_id_arrays([e.ids for e in self._encode(list(texts), add_special_tokens=False)])

    def count_batch(self, texts: Sequence[str]) -> np.ndarray:
        """Token counts of each text (the lengths of `encode_batch`'s arrays), without id arrays."""
        encs = self._encode(list(texts), add_special_tokens=False)
        return np.fromiter((len(e) for e in encs), dtype=np.int64, count=len(encs))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``, special tokens dropped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


class TransformersTokenizer(_Adapter):
    """`transformers` tokenizer adapter (needs ``pip install transformers``).

    Built from a local directory (``AutoTokenizer`` with ``local_files_only=True``; a path that
    is not an existing directory is refused before transformers is asked, so nothing is ever
    fetched from the hub) or, with `from_object`, from a tokenizer object already in memory.
    ``kwargs`` are passed to ``transformers.AutoTokenizer.from_pretrained`` (e.g. ``eos_token=``), with
    ``local_files_only=True``.
    """

    def __init__(self, directory: str | os.PathLike, *, trust_remote_code: bool = False, **kwargs: Any) -> None:
        path = _existing_path(directory, "transformers tokenizer directory")
        if not path.is_dir():
            raise ValueError(f"{str(directory)!r} is not a directory (a transformers tokenizer is a folder)")
        tf = _require("transformers")
        kwargs["local_files_only"] = True
        tok = tf.AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code, **kwargs)
        self._setup(tok, f"transformers:{path}")

    @classmethod
    def from_object(cls, tokenizer: Any, *, eos_token: str | None = None, pad_token: str | None = None,
                    bos_token: str | None = None) -> "TransformersTokenizer":
        """Adapter of an in-memory transformers tokenizer (any ``PreTrainedTokenizerBase``).

        Works on a copy when the object can be copied. Special ids are the object's
        ``eos_token_id``, ``pad_token_id`` and ``bos_token_id`` unless a token is named here;
        ``name`` carries the object's ``name_or_path`` and a hash of its vocabulary.
        """
        self = cls.__new__(cls)
        try:
            tok = copy.deepcopy(tokenizer)
        except Exception:  # an exotic tokenizer that cannot be copied is used as is
            tok = tokenizer
        where = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        self._setup(tok, f"transformers:<object {where} {_transformers_fingerprint(tok)}>",
                    eos_token=eos_token, pad_token=pad_token, bos_token=bos_token)
        return self

    def _setup(self, tok: Any, name: str, **named: str | None) -> None:
        self._tok = tok
        self.name = name
        self.vocab_size = int(len(tok))
        ids = {role: getattr(tok, f"{role}_token_id", None) for role in ("eos", "pad", "bos")}
        vocab = tok.get_vocab() if any(named.values()) else {}
        for key, token in named.items():
            if token is not None:
                if token not in vocab:
                    raise ValueError(f"{key} {token!r} is not in the vocabulary of {name}")
                ids[key[:3]] = vocab[token]
        self._set_specials(ids["eos"], ids["pad"], ids["bos"], why="its eos_token is not set")

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids (int32) of each text, no special tokens added."""
        enc = self._tok(
            list(texts),
            add_special_tokens=False,
            return_attention_mask=False,
            return_token_type_ids=False,
            verbose=False,  # long texts are expected here: counting them is the point
        )
        return as_id_arrays(enc["input_ids"])

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``, special tokens dropped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def chat_template(self) -> str | dict | None:
        """The tokenizer's own Jinja chat template (a dict of named ones for some), None without one."""
        return getattr(self._tok, "chat_template", None) or None

    @property
    def assistant_masks(self) -> bool:
        """Whether ``apply_chat_template`` can return ``{% generation %}`` masks (a fast tokenizer's offsets)."""
        return bool(getattr(self._tok, "is_fast", False))

    def apply_chat_template(self, conversations: list[list[dict]], *, tools: list | None = None,
                            template: str | None = None, add_generation_prompt: bool = False,
                            assistant_masks: bool = False) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        """Token ids (int32) of each conversation rendered with ``template`` (None: the tokenizer's own)
        by transformers' ``apply_chat_template``, and with ``assistant_masks`` its assistant-token mask
        (``{% generation %}`` blocks; int8), else None."""
        out = self._tok.apply_chat_template(
            conversations, tools=tools, chat_template=template, add_generation_prompt=add_generation_prompt,
            tokenize=True, return_dict=True, return_assistant_tokens_mask=assistant_masks,
            tokenizer_kwargs={"verbose": False},  # long conversations are expected: counting them is the point
        )
        ids = as_id_arrays(out["input_ids"])
        masks = [np.asarray(m, dtype=np.int8) for m in out["assistant_masks"]] if assistant_masks else None
        return ids, masks


def _transformers_fingerprint(tok: Any) -> str:
    """Hash of a transformers tokenizer's vocabulary and special tokens ("unknown" if unreadable)."""
    try:
        backend = getattr(tok, "backend_tokenizer", None)
        content = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
        return _fingerprint(content, repr((tok.eos_token_id, tok.pad_token_id, tok.bos_token_id, len(tok))))
    except Exception:
        return "unknown"


_TIKTOKEN_LOCK = threading.Lock()


def _offline_tiktoken(tiktoken: Any, encoding: str) -> Any:
    """``tiktoken.get_encoding`` that refuses to download the encoding file."""
    load = importlib.import_module("tiktoken.load")
    real_read = load.read_file

    def refuse_remote(blobpath: str) -> bytes:
        if "://" in blobpath:
            cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") or "<tmp>/data-gym-cache"
            raise OSError(
                f"tiktoken encoding {encoding!r} is not cached locally (it would be downloaded from "
                f"{blobpath}); dynabatch never downloads. Put the file in the tiktoken cache ({cache}) "
                "or use a local tokenizer.json / sentencepiece model instead"
            )
        return real_read(blobpath)

    # tiktoken reads its cache first and only falls back to read_file for a miss, so
    # swapping read_file for the duration of the load keeps the load strictly offline.
    with _TIKTOKEN_LOCK:
        load.read_file = refuse_remote
        try:
            return tiktoken.get_encoding(encoding)
        finally:
            load.read_file = real_read


class TiktokenTokenizer(_Adapter):
    """`tiktoken` adapter (needs ``pip install tiktoken``); loads only if the encoding is cached.

    ``encoding`` is an encoding name (``"cl100k_base"``) or a ``tiktoken.Encoding``. Text is
    encoded with ``encode_ordinary_batch``: special-token strings inside data count as plain
    text instead of raising. tiktoken has no BOS/PAD tokens, so ``bos_id`` is None and
    ``pad_id`` equals ``eos_id`` (``<|endoftext|>``).
    """

    def __init__(self, encoding: Any, *, eos_token: str = "<|endoftext|>", num_threads: int = 8) -> None:
        tiktoken = _require("tiktoken")
        if isinstance(encoding, str):
            encoding = _offline_tiktoken(tiktoken, encoding)
        self._enc = encoding
        self._threads = num_threads
        self.name = f"tiktoken:{encoding.name}"
        self.vocab_size = int(encoding.n_vocab)
        eos = encoding.encode_single_token(eos_token) if eos_token in encoding.special_tokens_set else None
        self._set_specials(eos, None, None, why=f"{eos_token!r} is not one of its special tokens")

    @classmethod
    def from_object(cls, encoding: Any, *, eos_token: str = "<|endoftext|>", num_threads: int = 8) -> "TiktokenTokenizer":
        """Adapter of an in-memory ``tiktoken.Encoding`` (``eos_token=``, ``num_threads=`` as above)."""
        if not hasattr(encoding, "encode_ordinary_batch"):
            raise TypeError(f"TiktokenTokenizer needs a tiktoken.Encoding, got {type(encoding).__name__}")
        return cls(encoding, eos_token=eos_token, num_threads=num_threads)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids (int32) of each text; special-token strings are encoded as text."""
        return as_id_arrays(self._enc.encode_ordinary_batch(list(texts), num_threads=self._threads))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids`` (the EOS id is dropped)."""
        return self._enc.decode([int(i) for i in ids if int(i) != self.eos_id])


class SentencePieceTokenizer(_Adapter):
    """`sentencepiece` adapter for a local ``.model`` file (needs ``pip install sentencepiece``).

    Special ids are those the model was trained with (``eos_id()``, ``pad_id()``,
    ``bos_id()``); a model trained without EOS needs ``eos_token=``.
    """

    def __init__(
        self, model_file: str | os.PathLike, *, eos_token: str | None = None, num_threads: int | None = None
    ) -> None:
        spm = _require("sentencepiece")
        path = _existing_path(model_file, "sentencepiece model")
        self._sp = spm.SentencePieceProcessor(model_file=str(path))
        self._threads = num_threads
        self.name = f"sentencepiece:{path}"
        self.vocab_size = int(self._sp.vocab_size())
        eos = self._sp.eos_id()
        if eos_token is not None:
            eos = self._sp.piece_to_id(eos_token)
            if eos == self._sp.unk_id() and eos_token != self._sp.id_to_piece(eos):
                raise ValueError(f"EOS token {eos_token!r} is not in the vocabulary of {self.name}")
        self._set_specials(eos, self._sp.pad_id(), self._sp.bos_id(), why="the model was trained with eos_id=-1")

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids (int32) of each text, no BOS/EOS added."""
        kw = {} if self._threads is None else {"num_threads": self._threads}
        return as_id_arrays(self._sp.encode(list(texts), out_type=int, add_bos=False, add_eos=False, **kw))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids`` (control tokens dropped)."""
        return self._sp.decode([int(i) for i in ids])


def _object_adapter(obj: Any) -> Any:
    """The adapter class for a tokenizer object of a supported library, else None.

    Checked against the libraries already imported (an object of a library means the library is
    loaded), so this never imports transformers, tokenizers or tiktoken itself.
    """
    tf = sys.modules.get("transformers")
    base = getattr(tf, "PreTrainedTokenizerBase", None) if tf is not None else None
    if isinstance(base, type) and isinstance(obj, base):
        return TransformersTokenizer
    for module, attr, adapter in (("tokenizers", "Tokenizer", HFTokenizer),
                                  ("tiktoken", "Encoding", TiktokenTokenizer)):
        cls = getattr(sys.modules.get(module), attr, None)
        if isinstance(cls, type) and isinstance(obj, cls):
            return adapter
    return None


def load_tokenizer(spec: Any, *, eos_token: str | None = None, pad_token: str | None = None,
                   bos_token: str | None = None, num_threads: int | None = None,
                   trust_remote_code: bool | None = None) -> Tokenizer:
    """Build a tokenizer from a spec, from local files only.

    ``spec`` is one of: ``"bytes"`` (`ByteTokenizer`); a path to a ``tokenizer.json``
    (`HFTokenizer`); a path to a sentencepiece ``.model`` (`SentencePieceTokenizer`); a local
    transformers tokenizer directory (`TransformersTokenizer`); ``"tiktoken:<encoding>"``
    (`TiktokenTokenizer`, only if cached); a tokenizer object: a ``tokenizers.Tokenizer``
    (`HFTokenizer.from_object`), any transformers tokenizer, e.g. ``AutoTokenizer``'s
    (`TransformersTokenizer.from_object`: special ids from its ``eos_token_id``,
    ``pad_token_id``, ``bos_token_id``) or a ``tiktoken.Encoding``
    (`TiktokenTokenizer.from_object`); or an object that already is a `Tokenizer` (returned
    unchanged). The keywords given (not None) go to the adapter, which documents them: the special
    tokens' names (``eos_token=``, ``pad_token=``, ``bos_token=``), ``num_threads=`` (tiktoken,
    sentencepiece), ``trust_remote_code=`` (a transformers directory); one the adapter does not take
    is a TypeError. Adapters pickle, so worker processes may get the adapter or the spec string.
    """
    kwargs = {k: v for k, v in (("eos_token", eos_token), ("pad_token", pad_token), ("bos_token", bos_token),
                                ("num_threads", num_threads), ("trust_remote_code", trust_remote_code))
              if v is not None}
    if not isinstance(spec, (str, os.PathLike)):
        if isinstance(spec, Tokenizer):
            return spec
        adapter = _object_adapter(spec)
        if adapter is None:
            raise TypeError(
                "tokenizer spec must be a string, a path, a tokenizers.Tokenizer, a transformers tokenizer, "
                f"a tiktoken.Encoding or a Tokenizer, got {type(spec).__name__}"
            )
        return adapter.from_object(spec, **kwargs)
    text = os.fspath(spec)
    if text == "bytes":
        return ByteTokenizer()
    if text.startswith("tiktoken:"):
        return TiktokenTokenizer(text[len("tiktoken:"):], **kwargs)
    path = Path(text).expanduser()
    if text and path.is_dir():
        return TransformersTokenizer(path, **kwargs)
    if text and path.is_file():
        if path.suffix == ".json":
            return HFTokenizer(path, **kwargs)
        if path.suffix == ".model":
            return SentencePieceTokenizer(path, **kwargs)
        raise ValueError(
            f"tokenizer spec {text!r} is a file but neither a tokenizer.json (.json) nor a sentencepiece model (.model)"
        )
    raise ValueError(
        f"tokenizer spec {text!r} is not understood: expected 'bytes', 'tiktoken:<encoding>', or an existing "
        "local tokenizer.json, sentencepiece .model file or transformers directory (nothing is downloaded)"
    )
