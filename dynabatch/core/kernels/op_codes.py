"""The integer vocabulary of op tables and schedule codes (plain constants: no numba, no numpy).

An *op table* is int32 ``[S, L, 4]``: row ``table[s, i]`` is the ``i``-th op of stage (rank) ``s``,
its columns `KIND`, `MICROBATCH`, `CHUNK` (the model chunk on that rank: virtual stage
``chunk * S + s``) and `MODEL` (many models: the model's position). A rank's list ends at its first
`NOP` row (lists of one table may differ in length). `dynabatch.core.schedule.ops` gives the typed view
(`Op`, `StepOps`); `dynabatch.core.kernels.op_tables` builds the tables, `dynabatch.core.kernels.simulate`
prices them.
"""

from __future__ import annotations

#: Columns of an op table row.
KIND, MICROBATCH, CHUNK, MODEL = 0, 1, 2, 3
COLUMNS = 4

#: Op kinds. ``BACKWARD`` computes input and weight gradients at once; a split backward is
#: ``BACKWARD_INPUT`` (input gradients, the graph kept) then ``BACKWARD_WEIGHT`` (weight gradients);
#: ``UPDATE``'s micro-batch column names the step (flush-free streams) or the model it updates.
#: ``SEND``/``RECV`` appear only in the runtime's compiled programs, never in a schedule's table.
INVALID, NOP, FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, UPDATE, SEND, RECV = -2, -1, 0, 1, 2, 3, 4, 5, 6
KIND_NAMES = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "Bi", BACKWARD_WEIGHT: "W", UPDATE: "U", SEND: "send",
              RECV: "recv"}

#: Schedule codes (`dynabatch.core.schedule.registry` names them): the static orders fixed by the stage,
#: chunk and micro-batch counts, and the orders built from the micro-batches' times and bytes.
GPIPE, ONE_F_ONE_B, ADAPTIVE, AUTO, INTERLEAVED, ZB_H1, ZB_H2 = 0, 1, 2, 3, 4, 5, 6

#: Share of a backward's seconds its weight-gradient part (``BACKWARD_WEIGHT``) takes when it is split:
#: a layer's input- and weight-gradient products cost about the same (Qi et al., 2024).
WEIGHT_SHARE = 0.5

#: Model chunks per rank of the interleaved schedule (Megatron's virtual pipeline size).
INTERLEAVED_CHUNKS = 2
