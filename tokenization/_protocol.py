"""The `Tokenizer` protocol, the byte-level reference tokenizer and shared errors."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

#: Label value for positions that do not contribute to the loss (the PyTorch/HF convention).
IGNORE_INDEX = -100


class SampleError(ValueError):
    """A sample cannot be tokenized or shaped (bad fields, unreadable image).

    ``key`` names the sample. ``scan_shapes(..., on_error="skip")`` and the formatters skip
    exactly these errors; anything else is a bug and always propagates.
    """

    def __init__(self, key: object, message: str) -> None:
        super().__init__(f"sample {key!r}: {message}")
        self.key = key


@runtime_checkable
class Tokenizer(Protocol):
    """What dynabatch needs from a tokenizer.

    ``encode_batch`` turns texts into token ids **without** adding special tokens (the
    formatters add BOS/EOS themselves, so counts do not depend on a tokenizer's
    post-processor). Ids are 1-D numpy int32 arrays, one per text. ``eos_id`` and
    ``pad_id`` are token ids; ``bos_id`` is ``None`` when the tokenizer has no BOS token;
    ``vocab_size`` counts tokens including added/special ones; ``name`` says where the
    tokenizer came from (for logs and error messages).
    """

    name: str
    vocab_size: int
    eos_id: int
    pad_id: int
    bos_id: int | None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids (int32 arrays) of each text, no special tokens added."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``, special tokens dropped."""
        ...

    # Optional: ``count_batch(texts) -> np.ndarray`` (int64 token counts, equal to the lengths
    # of ``encode_batch``'s arrays). Length scans use it when present to skip building ids.


def as_id_arrays(batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Lists of ids (as tokenizer libraries return them) -> int32 arrays."""
    return [np.asarray(ids, dtype=np.int32) for ids in batch]


class ByteTokenizer:
    """Dependency-free tokenizer: one token per UTF-8 byte, plus special ids.

    Ids 0, 1, 2 are PAD, BOS and EOS; byte ``b`` is id ``b + 3``, so ``vocab_size`` is 259.
    Meant for tests, demos and quick upper bounds: byte counts **over-estimate** subword
    token counts (roughly 4x for English text, less for code, more for CJK scripts whose
    characters take 3 bytes), so plans built on them are conservative.
    """

    name = "bytes"
    pad_id = 0
    bos_id: int | None = 1
    eos_id = 2
    offset = 3
    vocab_size = 256 + offset

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """UTF-8 bytes of each text shifted past the special ids (int32 arrays)."""
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) + self.offset for t in texts]

    def count_batch(self, texts: Sequence[str]) -> np.ndarray:
        """Token counts of each text (UTF-8 byte lengths), without building id arrays."""
        return np.fromiter((len(t.encode("utf-8")) for t in texts), dtype=np.int64, count=len(texts))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``; special ids are dropped and broken UTF-8 becomes U+FFFD."""
        arr = np.asarray(ids, dtype=np.int64)
        arr = arr[(arr >= self.offset) & (arr < self.vocab_size)] - self.offset
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"
