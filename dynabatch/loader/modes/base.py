"""`Mode`: the explicit stateful iterator every planning mode is (indexed, replay, streaming).

A mode yields collated steps (`ReadyStep`) of the current epoch and knows exactly how much of them
was consumed: ``state_dict()`` / ``load_state_dict()`` save and restore that position, nested in
the DataLoader's state under the mode's name (see `dynabatch.loader.state`). Iterating a mode
alone (``for ready in mode``) yields whole steps, each consumed once yielded; the DataLoader uses
`Mode.run` and `Mode.advance` to count micro-batch by micro-batch.
"""

from __future__ import annotations

import copy
import logging
import time
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import state as lstate
from ..records import CollateConfig, ReadyStep

logger = logging.getLogger("dynabatch")


@dataclass
class Context:
    """What every mode gets from the DataLoader: the one `PlanOptions` (``num_ranks`` = world
    size), the cost model, the tokenization, the source and the loading settings."""

    options: Any
    cost: Any
    family: str
    rank: int
    world_size: int
    settings: Any  # dynabatch.loader.settings.LoaderSettings
    formatter: Any
    source: Any
    collate: CollateConfig
    vision: Any = None

    @property
    def num_workers(self) -> int:
        return int(self.settings.num_workers)

    @property
    def layout(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "num_workers": self.num_workers}


class Mode(ABC):
    """Base of the planning modes (see the module docstring). Subclasses set ``name`` and
    ``identity`` and implement `_generate` (``(ReadyStep, skip, position)`` items of the epoch),
    `_position_state` and `_resume_from`."""

    name = "?"

    def __init__(self, ctx: Context, identity: dict):
        self.ctx = ctx
        # every mode's state also depends on the data files' content and the tokenizer (checked by name)
        self.identity = {**identity, **lstate.origin_identity(ctx.source, ctx.formatter.tokenizer)}
        self.epoch = 0
        self._resume: dict | None = None  # where the next iteration starts (internal form)
        self._loaded: dict | None = None  # the state last loaded, until iteration starts
        self._pos: dict | None = None  # live position while iterating
        self._closers: list = []
        self._it = None
        self._epoch_start_step = 0
        self.stats = {"steps": 0, "plan_time_s": 0.0, "load_time_s": 0.0, "wait_time_s": 0.0, "step_time_s": 0.0}
        self.last_epoch_stats: dict | None = None

    # -- stateful iterator ---------------------------------------------------------------------
    def __iter__(self):
        self._it = None
        return self

    def __next__(self) -> ReadyStep:
        """The next whole step (its not-yet-consumed micro-batches); it counts as consumed."""
        if self._it is None:
            self._it = self.run()
        try:
            ready, skip = next(self._it)
        except StopIteration:
            self._it = None
            raise
        self.advance(ready, len(ready.batches))
        return ReadyStep(ready.step, ready.batches[skip:], ready.snapshot, ready.load_time_s, ready.extra)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration runs (a pending resume of another epoch is dropped)."""
        epoch = int(epoch)
        if self._resume is not None and self._resume.get("epoch") != epoch:
            logger.info("set_epoch(%d) drops the loaded state of epoch %d", epoch, self._resume.get("epoch"))
            self._resume = None
        self.epoch = epoch

    def run(self):
        """(ReadyStep, micro-batches already consumed) of the current epoch, with bookkeeping."""
        self.close()
        self._loaded = None
        self._epoch_start_step = self._first_step()
        resumed = self._resume is not None and not self._resume.get("fresh") and self._resume.get("epoch") == self.epoch
        gen = self._generate()
        last = time.perf_counter()
        finished = False
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    ready, skip, pos = next(gen)
                except StopIteration:
                    finished = True
                    break
                now = time.perf_counter()
                self._pos = pos
                if skip and skip >= len(ready.batches):  # resumed after the step's last micro-batch
                    self.advance(ready, skip)
                    continue
                self._record(ready, now - t0, now - last)
                last = now
                yield ready, skip
        finally:
            gen.close()
            if finished:
                self._epoch_done(resumed)
            else:
                self.close()

    def advance(self, ready: ReadyStep, upto: int) -> None:
        """Count the step's micro-batches up to ``upto`` (exclusive) as consumed."""
        p = self._pos
        for mb in ready.step.microbatches[p["microbatch"]:upto]:
            p["consumed"].append(mb.sample_ids)
        p["microbatch"] = upto
        if upto == len(ready.batches):
            p["done"] = True
            p["next_step"] = ready.step.step + 1

    def next_step(self) -> int:
        """Global number of the first step not yet wholly consumed: every step before it was yielded
        whole (a step yielded part-way, or one a resume starts part-way, is not counted)."""
        if self._pos is not None:
            return int(self._pos["next_step"])
        r = self._resume
        if r is None:
            return int(self._epoch_start_step)
        return int(r.get("step", 0)) + (1 if r.get("done") else 0)

    def close(self, wait: bool = True) -> None:
        """Stop background planning and workers of an unfinished iteration."""
        for fn in self._closers:
            try:
                fn(wait)
            except Exception:  # closing is best effort
                pass
        self._closers = []

    # -- bookkeeping ------------------------------------------------------------------------------
    @abstractmethod
    def _first_step(self) -> int:
        """Global step number of the current epoch's first step."""

    @abstractmethod
    def _generate(self):
        """(ReadyStep, micro-batches to skip, position) of the current epoch, from the resume point."""

    def _record(self, ready: ReadyStep, wait: float, interval: float) -> None:
        st = self.stats
        st["steps"] += 1
        st["plan_time_s"] += ready.step.plan_time_s
        st["load_time_s"] += ready.load_time_s
        if st["steps"] > 1:  # the first step also pays for start-up (workers, index, JIT)
            st["wait_time_s"] += wait
            st["step_time_s"] += interval
        logger.debug("rank %d step %d: %d micro-batches, plan %.1f ms, load %.1f ms, waited %.1f ms of %.1f ms",
                     self.ctx.rank, ready.step.step, ready.step.num_microbatches, ready.step.plan_time_s * 1e3,
                     ready.load_time_s * 1e3, wait * 1e3, interval * 1e3)

    def _epoch_done(self, resumed: bool = False) -> None:
        st, rank = self.stats, self.ctx.rank
        n = st["steps"]
        if not n and not resumed:  # a resume after the epoch's last step rightly gives none
            warnings.warn(f"rank {rank}: epoch {self.epoch} of the {self.name} mode gave no step: the data holds no "
                          "samples (or fewer than one global batch with drop_last=True); check the paths/split",
                          UserWarning, stacklevel=4)
        if n:
            later = max(n - 1, 1)
            logger.info("rank %d epoch %d done: %d steps, planning %.1f ms/step, loading %.1f ms/step, the training "
                        "loop waited %.1f ms of %.1f ms per step", rank, self.epoch, n,
                        1e3 * st["plan_time_s"] / n, 1e3 * st["load_time_s"] / n,
                        1e3 * st["wait_time_s"] / later, 1e3 * st["step_time_s"] / later)
            busy = (st["step_time_s"] - st["wait_time_s"]) / later  # seconds the loop itself spent per step
            if n >= 5 and busy >= 5e-3 and st["wait_time_s"] > 0.2 * st["step_time_s"]:
                logger.warning("rank %d: the training loop waited for data %.0f%% of the time; raise num_workers or "
                               "plan_ahead", rank, 100 * st["wait_time_s"] / st["step_time_s"])
        next_step = (self._pos or {}).get("next_step", self._epoch_start_step)
        self.epoch += 1
        self._pos = None
        self._resume = {"epoch": self.epoch, "step": next_step, "fresh": True}
        self.last_epoch_stats = dict(st)
        for k in st:
            st[k] = 0 if k == "steps" else 0.0

    # -- state ------------------------------------------------------------------------------------
    def _state(self, **fields) -> dict:
        out = {"identity": copy.deepcopy(self.identity), "layout": self.ctx.layout}
        out.update(fields)
        return out

    def _fresh_state(self, epoch: int, step: int) -> dict:
        return self._state(epoch=epoch, step=step, step_in_epoch=0, microbatch=0, consumed=[], fresh=True)

    def state_dict(self) -> dict:
        """This mode's exact position: everything yielded so far counts as consumed (JSON-able)."""
        if self._pos is None:
            if self._loaded is not None:
                return copy.deepcopy(self._loaded)
            r = self._resume or {"epoch": self.epoch, "step": 0}
            return self._fresh_state(r["epoch"], r.get("step", 0))
        p = self._pos
        consumed = lstate._ids(np.concatenate(p["consumed"])) if p["consumed"] else []
        return copy.deepcopy(self._position_state(p, consumed))

    def load_state_dict(self, state) -> None:
        """Resume from this mode's `state_dict` (same layout), or from the list of every rank's mode
        states / their merge (any world size: nothing is lost or repeated)."""
        if isinstance(state, (list, tuple)):
            state = (lstate.merge_mode_states(self.name, list(state)) if len(state) > 1 or self.ctx.world_size != 1
                     else state[0])
        lstate.check_identity(state, self.identity, self.ctx.source, self.ctx.formatter.tokenizer)
        state = copy.deepcopy(state)
        self.close()
        self._pos = None
        self._loaded = copy.deepcopy(state)
        self.epoch = int(state["epoch"])
        if state.get("fresh"):
            self._resume = {"epoch": self.epoch, "step": int(state.get("step", 0)), "fresh": True}
        else:
            self._resume = self._resume_from(state)

    def _check_same_layout(self, s: dict, what: str) -> None:
        if s["layout"] != self.ctx.layout:
            L = s["layout"]
            raise lstate.LoaderStateError(
                f"this state was taken {what} on rank {L['rank']} of {L['world_size']} (num_workers="
                f"{L['num_workers']}); to resume it on rank {self.ctx.rank} of {self.ctx.world_size} (num_workers="
                f"{self.ctx.num_workers}), load the list of every rank's states")

    @abstractmethod
    def _position_state(self, p: dict, consumed: list) -> dict:
        """The mode's state at position ``p`` (``consumed``: sample ids already yielded)."""

    @abstractmethod
    def _resume_from(self, s: dict) -> dict:
        """The internal resume point of a loaded (checked) mode state ``s``."""
