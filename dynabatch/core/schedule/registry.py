"""The schedules, each registered once: its name, code and what its order is made of.

A schedule is one function that writes a rank's op table (`dynabatch.core.kernels.op_tables` for the
orders fixed by the stage and micro-batch counts, `dynabatch.core.kernels.schedules.adaptive_kernel` for
the one built from the micro-batches' times and bytes) and one `ScheduleInfo` here. Everything else (the
simulator, the planner's ordering search and ``auto``, the plan file, inspect, the runtime's programs)
reads the order from `dynabatch.core.schedule.build.step_ops` and the facts from here; a name that is not
registered raises. This module imports nothing heavy: `dynabatch.core.options` takes its vocabulary
from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from ..kernels import op_codes as oc


@dataclass(frozen=True)
class ScheduleInfo:
    """One registered schedule. ``code``: its `dynabatch.core.kernels.op_codes` code; ``chunks``: model chunks
    per rank (virtual stages ``chunks * S``); ``split``: its backwards are split into an input part and a
    weight part (`oc.WEIGHT_SHARE` of the backward); ``static``: the order is fixed by the stage and
    micro-batch counts (else built from the predicted seconds, transfer seconds and activation bytes);
    ``balance``: the plain order (gpipe or 1f1b) whose simulated makespan judges the planner's rank
    swaps (`dynabatch.core.kernels.assign.balance_simulated` prices plain op codes; the final order and
    rank times always use the schedule itself); ``summary``: one line for docs and ``inspect``."""

    name: str
    code: int
    chunks: int
    split: bool
    static: bool
    balance: str
    summary: str

    @property
    def concrete(self) -> bool:
        """An order of its own (``auto`` only picks one of the others)."""
        return self.code != oc.AUTO


_ENTRIES = (
    ScheduleInfo("gpipe", oc.GPIPE, 1, False, True, "gpipe",
                 "all forwards, then all backwards in the same order"),
    ScheduleInfo("1f1b", oc.ONE_F_ONE_B, 1, False, True, "1f1b",
                 "Megatron's order: S-s-1 warm-up forwards, then one forward / one backward"),
    ScheduleInfo("adaptive", oc.ADAPTIVE, 1, False, False, "1f1b",
                 "memory-aware list order from the predicted times and bytes (DynaPipe-style)"),
    ScheduleInfo("auto", oc.AUTO, 1, False, False, "1f1b",
                 "per step, the fastest simulated order whose in-flight bytes fit the memory limit"),
    ScheduleInfo("interleaved", oc.INTERLEAVED, oc.INTERLEAVED_CHUNKS, False, True, "1f1b",
                 f"Megatron's interleaved 1F1B: {oc.INTERLEAVED_CHUNKS} model chunks per stage, assigned round-robin"),
    ScheduleInfo("zb-h1", oc.ZB_H1, 1, True, True, "1f1b",
                 "zero bubble ZB-H1: 1F1B with each backward split into input and weight parts, the weight parts "
                 "of stage s s backwards late (1F1B's stage-0 memory)"),
    ScheduleInfo("zb-h2", oc.ZB_H2, 1, True, True, "1f1b",
                 "zero bubble ZB-H2: 2(S-s)-1 warm-up forwards on stage s fill the warm-up bubble, each backward "
                 "split, its input part first, the weight parts s backwards late (about twice 1F1B's memory)"),
)

#: name -> its `ScheduleInfo`, in registration order.
REGISTRY: Mapping[str, ScheduleInfo] = MappingProxyType({e.name: e for e in _ENTRIES})
#: The schedule names, as `dynabatch.core.options.PlanOptions` and the command-line flags take them.
SCHEDULE_NAMES: tuple[str, ...] = tuple(REGISTRY)
#: name -> code.
SCHEDULE_CODES: Mapping[str, int] = MappingProxyType({e.name: e.code for e in _ENTRIES})
#: The concrete orders ``auto`` chooses from, in the order it prefers them on equal makespans: every
#: registered order of one chunk per stage (a runner holds one model cut for all its steps, so the per-step
#: pick is among the orders that cut runs; ``interleaved`` needs its own cut and is chosen by name).
AUTO_PREFERENCE: tuple[str, ...] = tuple(sorted((e.name for e in _ENTRIES if e.code != oc.AUTO and e.chunks == 1),
                                                key=("1f1b", "zb-h1", "zb-h2", "adaptive", "gpipe").index))


def schedule_info(name: str) -> ScheduleInfo:
    """The registered schedule ``name``; ValueError naming the registered ones otherwise."""
    info = REGISTRY.get(name) if isinstance(name, str) else None
    if info is None:
        raise ValueError(f"unknown schedule {name!r}; valid kinds: {SCHEDULE_NAMES}")
    return info


def concrete(name: str) -> ScheduleInfo:
    """`schedule_info` of a schedule with an order of its own (not ``auto``)."""
    info = schedule_info(name)
    if not info.concrete:
        raise ValueError(f"{name!r} picks one of {AUTO_PREFERENCE} per step; a rank's op order needs a concrete "
                         f"schedule ({', '.join(n for n in SCHEDULE_NAMES if REGISTRY[n].concrete)})")
    return info
