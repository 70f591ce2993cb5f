"""Pre-tokenized samples: rows that carry token ids instead of text.

Hugging Face users often tokenize first (``datasets.map(tokenize)``), giving rows with an
``input_ids`` column and optionally ``labels``. `Formatter` takes such rows as they are: no
tokenizer call and no special token added. Decoder-only: ``labels`` align with ``input_ids``
(``IGNORE_INDEX`` where not trained); without ``labels`` every token is trained.
Encoder-decoder: ``labels`` are the target ids (required). ``attention_mask`` and other columns
are ignored. The ids are looked up in the sample, then in its ``meta`` (where ``loaders`` puts
the columns that are not text).
"""

from __future__ import annotations

import numpy as np

from ._protocol import IGNORE_INDEX, SampleError, Tokenizer

ID_FIELD = "input_ids"
LABEL_FIELD = "labels"
_TEXT_FIELDS = ("inputs", "targets", "messages")


def _key(sample: dict) -> object:
    return sample.get("key", sample.get("sample_id"))


def _empty(value: object) -> bool:
    return value is None or (isinstance(value, (str, list, tuple)) and len(value) == 0)


def ids_holder(sample: dict, mode: bool | None) -> dict | None:
    """The dict holding the sample's ``input_ids`` when the sample is formatted as pre-tokenized.

    ``mode`` is `FormatConfig.pretokenized`: True requires the ids (`SampleError` without
    them), False never uses them, None uses them when the sample has no text (no ``inputs``,
    ``targets`` or ``messages``). Returns None for a text sample.
    """
    if mode is False:
        return None
    meta = sample.get("meta")
    holder = sample if ID_FIELD in sample else meta if isinstance(meta, dict) and ID_FIELD in meta else None
    if mode is True:
        if holder is None:
            raise SampleError(_key(sample), f"has no {ID_FIELD!r} (the formatter expects pre-tokenized rows)")
        return holder
    if holder is None or not all(_empty(sample.get(f)) for f in _TEXT_FIELDS):
        return None
    return holder


def _id_array(value: object, field: str, key: object, tok: Tokenizer, ignore_ok: bool,
              extra: np.ndarray | None = None) -> np.ndarray:
    """``value`` as an int32 array of token ids (`SampleError` naming the sample otherwise); ``extra``
    (a bool mask of positions, e.g. image placeholders) is exempt from the vocabulary check."""
    arr = None
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, (list, tuple)):
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError):  # ragged nesting
            arr = None
    if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        bad = type(value).__name__
        if isinstance(value, (list, tuple)):
            bad = next((f"{type(v).__name__} {v!r:.40}" for v in value
                        if isinstance(v, bool) or not isinstance(v, (int, np.integer))), bad)
        raise SampleError(key, f"field {field!r} must be a flat list of int token ids, got {bad}")
    if not arr.size:
        raise SampleError(key, f"field {field!r} is empty")
    arr = arr.astype(np.int64, copy=False)
    outside = (arr < 0) | (arr >= tok.vocab_size)
    if ignore_ok:
        outside &= arr != IGNORE_INDEX
    if extra is not None and len(extra) == len(arr):
        outside &= ~extra
    if outside.any():
        v = int(arr[np.argmax(outside)])
        if v == IGNORE_INDEX:
            hint = "encoder-decoder labels are the target ids: remove the -100 padding"
        else:
            hint = f"not an id of tokenizer {tok.name!r} (vocab_size {tok.vocab_size}): pass the tokenizer " \
                   "the data was tokenized with"
        raise SampleError(key, f"field {field!r} holds {v}: {hint}")
    return arr.astype(np.int32)


def pretokenized_ids(holder: dict, sample: dict, family: str, tok: Tokenizer,
                     image_token_id: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """(input ids, labels or target ids or None) of a pre-tokenized sample, checked (`SampleError`).
    ``image_token_id`` (image placeholders on) may be outside the tokenizer's vocabulary: it is
    accepted in ``input_ids`` and, for decoder-only rows, in ``labels`` where the ids hold it."""
    key = _key(sample)
    raw_ids = holder[ID_FIELD]
    marks = None
    if image_token_id is not None:
        try:
            marks = np.asarray(raw_ids) == image_token_id
        except (ValueError, TypeError):  # ragged: _id_array names the problem
            marks = None
        if marks is not None and marks.ndim != 1:
            marks = None
    ids = _id_array(raw_ids, ID_FIELD, key, tok, ignore_ok=False, extra=marks)
    raw = holder.get(LABEL_FIELD)
    if raw is None:
        if family == "encoder_decoder":
            raise SampleError(key, f"has {ID_FIELD!r} but no {LABEL_FIELD!r}: encoder-decoder pre-tokenized rows "
                                   "need the target ids as labels")
        return ids, None
    labels = _id_array(raw, LABEL_FIELD, key, tok, ignore_ok=family == "decoder",
                       extra=marks if family == "decoder" else None)
    if family == "decoder" and len(labels) != len(ids):
        raise SampleError(key, f"{LABEL_FIELD!r} has {len(labels)} entries but {ID_FIELD!r} has {len(ids)}; "
                               f"decoder-only labels align with the input ids ({IGNORE_INDEX} where not trained)")
    return ids, labels


def label_runs(labels: np.ndarray) -> list[tuple[int, int, bool]]:
    """``(start, stop, trained)`` of the runs of trained (not ``IGNORE_INDEX``) and masked labels."""
    trained = labels != IGNORE_INDEX
    cuts = (np.flatnonzero(trained[1:] != trained[:-1]) + 1).tolist()
    return [(a, b, bool(trained[a])) for a, b in zip([0, *cuts], [*cuts, len(labels)])]
