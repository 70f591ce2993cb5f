"""What crosses a pipeline boundary: `TensorSpec` (shape, dtype, whether a gradient flows back) and
`MicroBatchShape` (a micro-batch's shape as every rank knows it from the plan).

Receive buffers are allocated from these specs, so no rank ever asks a peer for a shape: the plan
that all ranks hold is the single source of truth (see `docs/pipeline.md`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.batchplan import BatchPlan, MicroBatch

#: Collations the runner understands. ``packed_rows`` (rows of several samples padded to a fixed
#: length) travels exactly like ``padded``.
RUNNER_COLLATIONS = ("padded", "packed", "packed_rows")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a boundary message: ``shape`` (elements per dimension), ``dtype``, and
    ``requires_grad`` (True for hidden states whose gradient is sent back; False for masks and ids)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor."""
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * torch.empty((), dtype=self.dtype).element_size()

    def empty(self, device) -> torch.Tensor:
        """An uninitialized tensor of this spec on ``device`` (a receive buffer)."""
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def matches(self, t: torch.Tensor) -> bool:
        """Whether ``t`` has exactly this shape and dtype."""
        return tuple(t.shape) == tuple(self.shape) and t.dtype == self.dtype

    def describe(self) -> str:
        """``[2, 48, 16] float32`` style text for error messages."""
        return f"{list(self.shape)} {str(self.dtype).replace('torch.', '')}"


@dataclass(frozen=True)
class MicroBatchShape:
    """A micro-batch's shape as the plan states it (tokens, seconds, bytes).

    ``collation`` is ``padded``/``packed_rows`` (``rows`` x ``input_len`` main tokens and ``rows`` x
    ``target_len`` decoder tokens) or ``packed`` (``rows`` sequences concatenated into one row of
    ``tokens`` main-stack tokens, the longest ``input_len``; an encoder-decoder's targets in a second
    row of ``target_tokens`` decoder tokens, the longest ``target_len``). ``time_s`` and
    ``memory_bytes`` are the plan's predicted forward+backward seconds and activation bytes on one
    stage. ``tiles`` is the number of image tiles (vision-language models: the ViT's batch; 0 for a
    text-only micro-batch).
    """

    collation: str
    rows: int
    input_len: int
    target_len: int = 0
    tokens: int = 0
    time_s: float = 0.0
    memory_bytes: float = 0.0
    tiles: int = 0
    target_tokens: int = 0

    def __post_init__(self) -> None:
        if self.collation not in RUNNER_COLLATIONS:
            raise ValueError(f"collation must be one of {RUNNER_COLLATIONS}, got {self.collation!r}")
        if self.rows < 1 or self.input_len < 1 or min(self.target_len, self.tiles, self.target_tokens) < 0:
            raise ValueError(f"a micro-batch needs rows >= 1 and input_len >= 1, got {self}")
        if self.packed and self.tokens < 1:
            raise ValueError("a packed micro-batch needs its total token count (tokens >= 1)")

    @property
    def packed(self) -> bool:
        """True for varlen collation (one row, block-diagonal attention from ``cu_seqlens``)."""
        return self.collation == "packed"

    @classmethod
    def from_microbatch(cls, mb: MicroBatch, collation: str) -> "MicroBatchShape":
        """The shape of one `MicroBatch` of a plan with the given collation (packed: the plan's ``tokens``
        count both rows of an encoder-decoder, ``tokens`` here the main stack's only)."""
        main = int(mb.tokens) - int(mb.target_tokens) if collation == "packed" else int(mb.tokens)
        return cls(collation, int(mb.rows), int(mb.input_len), int(mb.target_len), main,
                   float(mb.time_s), float(mb.memory_bytes), int(mb.vision_tiles), int(mb.target_tokens))


def packed_pair_seqlens(name: str, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(encoder ``cu_seqlens``, decoder ``decoder_cu_seqlens``) of a packed encoder-decoder micro-batch
    (``collate='packed'``, ``family='encoder_decoder'``), checked: both rows present, as many samples on
    both sides, one row each (``name``: the model, for the error)."""
    if "decoder_cu_seqlens" not in batch or "decoder_input_ids" not in batch:
        raise ValueError(f"{name}: a packed encoder-decoder micro-batch needs decoder_input_ids and decoder_cu_seqlens "
                         "(collate='packed' with family='encoder_decoder')")
    cu, dcu = batch["cu_seqlens"], batch["decoder_cu_seqlens"]
    if len(cu) != len(dcu) or batch["input_ids"].shape[0] != 1:
        raise ValueError(f"{name}: the packed micro-batch holds {len(cu) - 1} encoder and {len(dcu) - 1} decoder "
                         f"samples in {batch['input_ids'].shape[0]} rows; each sample needs both sides, in one row")
    return cu, dcu


def plan_shapes(plan: BatchPlan, replica: int) -> list[MicroBatchShape]:
    """The micro-batch shapes data-parallel replica ``replica`` runs, in the plan's execution order."""
    if not 0 <= replica < plan.num_ranks:
        raise ValueError(f"replica {replica} is not in a plan for {plan.num_ranks} ranks")
    return [MicroBatchShape.from_microbatch(mb, plan.collation) for mb in plan.microbatches(rank=replica)]


class PlanMismatch(ValueError):
    """A micro-batch's tensors do not have the shape its plan states."""


def check_batch(batch: dict, shape: MicroBatchShape, where: str) -> None:
    """Raise `PlanMismatch` if a Hugging Face-style micro-batch dictionary does not have the plan's
    shape: padded ``input_ids`` [rows, input_len] (``decoder_input_ids``/``labels`` [rows,
    target_len] when target_len > 0); packed ``input_ids`` [1, tokens], ``cu_seqlens`` [rows + 1] (an
    encoder-decoder's ``decoder_input_ids``/``labels`` [1, target_tokens], ``decoder_cu_seqlens`` [rows + 1])."""
    def need(key, want):
        if key in batch and isinstance(batch[key], torch.Tensor) and tuple(batch[key].shape) != tuple(want):
            raise PlanMismatch(f"{where}: {key} has shape {list(batch[key].shape)} but the plan says {list(want)} "
                               f"({shape.collation}, rows {shape.rows}, input_len {shape.input_len}, "
                               f"target_len {shape.target_len}, tokens {shape.tokens}, "
                               f"target_tokens {shape.target_tokens})")
    if shape.packed:
        need("input_ids", (1, shape.tokens))
        need("position_ids", (1, shape.tokens))
        need("cu_seqlens", (shape.rows + 1,))
        if "decoder_input_ids" in batch:
            for key in ("decoder_input_ids", "decoder_position_ids", "labels"):
                need(key, (1, shape.target_tokens))
            need("decoder_cu_seqlens", (shape.rows + 1,))
        else:
            need("labels", (1, shape.tokens))
    elif shape.tiles:  # a vision-language model inserts the tiles' tokens itself: text is [rows, <= input_len]
        if int(batch.get("image_tiles", torch.zeros(0)).sum()) != shape.tiles or len(batch["input_ids"]) != shape.rows:
            raise PlanMismatch(f"{where}: image_tiles and input_ids are not the plan's {shape.tiles} tiles in "
                               f"{shape.rows} rows")
    else:
        need("input_ids", (shape.rows, shape.input_len))
        need("attention_mask", (shape.rows, shape.input_len))
        tgt = (shape.rows, shape.target_len) if shape.target_len else (shape.rows, shape.input_len)
        need("position_ids", (shape.rows, shape.input_len))
        need("decoder_input_ids", tgt)
        need("decoder_position_ids", tgt)
        need("labels", tgt)


def as_tuple(x) -> tuple:
    """A stage's state as a tuple (a one-tensor state may travel bare)."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def to_device(batch: dict, device: torch.device) -> dict:
    """A micro-batch dictionary with its tensors on ``device`` (copies are non-blocking)."""
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
