"""The one representation of a step's ops: per rank, an ordered list of typed ops.

`StepOps` holds the op table of one pipeline's step (int32 ``[S, L, 4]``, the layout of
`dynabatch.core.kernels.op_codes`: per rank its ops in order, each a kind, a micro-batch, a model chunk
and a model; ranks' lists end at their first ``NOP``). `Op` is one row, typed. Kinds: ``F`` forward,
``B`` backward, ``Bi`` its input part and ``W`` its weight part (a split backward), ``U`` an optimizer
update (flush-free streams: of a step; many models: of a model). The simulator prices a `StepOps`, the
runtime compiles its communication programs from one (adding the sends and receives), the plan records
the order it was priced with. Plain op codes (``j + 1`` forward, ``-(j + 1)`` backward of micro-batch
``j``, one chunk) convert both ways (`StepOps.codes`, `StepOps.from_codes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels import op_codes as oc
from ..kernels.op_tables import codes_table, table_codes


@dataclass(frozen=True)
class Op:
    """One op of a rank: ``kind`` (an `oc` kind), the micro-batch (for an update: the step or model it
    updates), the model chunk on this rank (virtual stage ``chunk * S + stage``) and the model."""

    kind: int
    microbatch: int
    chunk: int = 0
    model: int = 0

    @property
    def name(self) -> str:
        """``F3``, ``Bi3``, ``W3``, ``B3`` (``.c1`` for chunk 1), ``U0``."""
        return f"{oc.KIND_NAMES[self.kind]}{self.microbatch}" + (f".c{self.chunk}" if self.chunk else "")

    @property
    def forward(self) -> bool:
        return self.kind == oc.FORWARD

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, eq=False)
class StepOps:
    """The ops of one pipeline's step (module docstring): ``schedule`` names the order (empty for an
    order given as codes), ``num_chunks`` the model chunks per rank, ``table`` int32 ``[S, L, 4]``."""

    schedule: str
    num_stages: int
    num_microbatches: int
    num_chunks: int
    table: np.ndarray

    def __post_init__(self) -> None:
        t = np.array(self.table, np.int32, order="C")  # a copy: the order does not change under its owner
        if t.ndim != 3 or t.shape[0] != self.num_stages or t.shape[2] != oc.COLUMNS:
            raise ValueError(f"an op table is int [S, L, {oc.COLUMNS}] with S = {self.num_stages}, got {t.shape}")
        view = t.view()
        view.setflags(write=False)
        object.__setattr__(self, "table", view)
        object.__setattr__(self, "_writable", t)

    @property
    def kernel_table(self) -> np.ndarray:
        """`table` as the kernels take it: the same memory, typed writable (numba compiles a kernel, and
        everything it calls, once more for a read-only array); the kernels only read it."""
        return self._writable

    def __reduce__(self):
        # rebuilt through __init__: one copy of the table pickled, and `table` read-only again over it
        return StepOps, (self.schedule, self.num_stages, self.num_microbatches, self.num_chunks, self._writable)

    @classmethod
    def from_codes(cls, codes, schedule: str = "") -> "StepOps":
        """The ops of plain op codes ``codes`` (int ``[S, 2M]``)."""
        c = np.asarray(codes)
        M = c.shape[1] // 2
        # int32 as the kernels write codes (one compile of `codes_table`); a code outside ±1..±M is invalid
        # either way, so clipping to ±(M + 1) first keeps it invalid instead of wrapping into range
        c = np.ascontiguousarray(np.clip(c, -(M + 1), M + 1), np.int32)
        return cls(schedule, c.shape[0], M, 1, codes_table(c, M))

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.num_chunks

    @property
    def split(self) -> bool:
        """Whether some backward is split into its input and weight parts."""
        return bool((self.table[:, :, oc.KIND] == oc.BACKWARD_WEIGHT).any())

    def length(self, stage: int) -> int:
        """Ops of ``stage`` (up to its first ``NOP``)."""
        kinds = self.table[stage, :, oc.KIND]
        end = np.flatnonzero(kinds == oc.NOP)
        return int(end[0]) if len(end) else len(kinds)

    def rank(self, stage: int) -> tuple[Op, ...]:
        """``stage``'s ops in order."""
        return tuple(Op(*(int(x) for x in row)) for row in self.table[stage, :self.length(stage)])

    def codes(self) -> np.ndarray:
        """Plain op codes int32 ``[S, L]``; ValueError when some op is not a forward or backward of chunk 0."""
        out, ok = table_codes(self.kernel_table)
        if not ok:
            raise ValueError(f"the {self.schedule or 'given'} order has ops beyond plain forwards and backwards "
                             f"(chunks or split backwards): it has no plain op codes")
        return out

    def tobytes(self) -> bytes:
        """A key of the order (the table's bytes and its shape)."""
        return np.asarray(self.table.shape, np.int64).tobytes() + self.table.tobytes()

    def __eq__(self, other) -> bool:
        return isinstance(other, StepOps) and self.table.shape == other.table.shape and bool(
            np.array_equal(self.table, other.table)) and self.num_chunks == other.num_chunks

    __hash__ = None

    def check(self) -> None:
        """ValueError unless every rank lists, for each micro-batch and chunk, once each: a forward and either a
        backward or its input and weight parts (updates anywhere; an order they cannot run in is the
        simulator's to find)."""
        for s in range(self.num_stages):
            seen: dict[tuple[int, int], list[int]] = {}
            for op in self.rank(s):
                if op.kind == oc.UPDATE:
                    continue
                if not (0 <= op.microbatch < self.num_microbatches and 0 <= op.chunk < self.num_chunks) or \
                        op.kind not in (oc.FORWARD, oc.BACKWARD, oc.BACKWARD_INPUT, oc.BACKWARD_WEIGHT):
                    raise ValueError(f"stage {s} lists {op!r}, not an op of {self.num_microbatches} micro-batches "
                                     f"x {self.num_chunks} chunks")
                seen.setdefault((op.microbatch, op.chunk), []).append(op.kind)
            want = {(j, c) for j in range(self.num_microbatches) for c in range(self.num_chunks)}
            good = ([oc.FORWARD, oc.BACKWARD], [oc.FORWARD, oc.BACKWARD_INPUT, oc.BACKWARD_WEIGHT])
            bad = sorted(k for k in want if sorted(seen.get(k, [])) not in good) + sorted(set(seen) - want)
            if bad:
                j, c = bad[0]
                raise ValueError(f"stage {s} must list F and B (or Bi and W), once each, for micro-batch {j} "
                                 f"chunk {c}; it lists {[oc.KIND_NAMES.get(k, k) for k in seen.get((j, c), [])]}")
