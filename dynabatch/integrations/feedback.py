"""Feedback on the data-parallel route: measured micro-batch times refit the loader's cost model
under ``transformers.Trainer``, ``accelerate`` and plain DDP/FSDP loops, as the pipeline runner's
do (`dynabatch.core.plan.feedback`).

`StepFeedback` wraps the `dynabatch.DataLoader` the steps come from. Given to
`dynabatch.integrations.step_backward` (``feedback=``; `DynabatchTrainer` does it by itself), each
step it

1. times each micro-batch's forward and backward on this rank (`dynabatch.integrations.timing`:
   CUDA events on a GPU, ``perf_counter`` on a CPU);
2. gathers every rank's times with one all-gather of a small float64 row per rank (the step's
   micro-batch count x 3 + 7 numbers; x 13 in the streaming mode, whose ranks plan their own shares
   and so send their micro-batches' features too);
3. records them in the loader's `FeedbackLoop` (`FeedbackLoop.record_step` with the step's global
   plan; every rank records the same gathered times) and refits every ``refit_every`` steps. At a
   refit rank 0's new coefficients are broadcast (one more small collective) and a rank whose own fit
   differs in a last bit (another machine's BLAS) takes them, so the ranks never plan apart;
4. makes the step's `StepMetrics` (``last``; `take` hands over those not yet taken).

The micro-batch whose backward synchronizes gradients (the step's last, with more than one rank)
holds the gradient reduction and the wait for the slowest rank in its backward: its time is taken
as its own forward times the backward/forward ratio the step's other micro-batches measured (over
all ranks; the last ratio measured when every rank ran one micro-batch, the cost model's
``(1 - f) / f`` before any), so that a step of one micro-batch per rank is observed too. Under DDP the step's first forward also broadcasts the model's buffers (DDP's
``broadcast_buffers``), so its time includes how much later the last rank started the step. Under
FSDP on several ranks nothing is fed back (a warning says so): every micro-batch all-gathers the
parameters layer by layer, so the ranks run in lockstep and no time is one micro-batch's own.

Determinism: the next step is planned only after this step's refit, so every rank plans it with
the same coefficients and a resumed run plans as the uninterrupted one did. That needs planning on
demand: a loader with a `FeedbackLoop` must have ``Runtime(plan_ahead=0)``, no ``num_workers`` and
no ``plan_processes`` (a planning thread or process would plan ahead with whichever coefficients it
happened to read: plans would differ between ranks). `state_dict` / `load_state_dict` (and
`save_feedback_state` / `read_feedback_state` for a file) keep the refit state in a checkpoint.

Without a `FeedbackLoop` on the loader nothing is refit, and any loader works: the metrics are
still made (``cost_mape`` scores the plan's predictions).

Seconds, tokens, fractions.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from dataclasses import dataclass, replace

import numpy as np
import torch

from .metrics import HEAD, StepMetrics, step_metrics

logger = logging.getLogger("dynabatch")

#: ``format`` of `StepFeedback.state_dict`.
FEEDBACK_FORMAT = "dynabatch.step_feedback"
#: File name of the feedback state inside a `DynabatchTrainer` checkpoint (one file: it is the same on every rank).
FEEDBACK_STATE_NAME = "dynabatch_feedback.json"


@dataclass(frozen=True)
class RankTiming:
    """One rank's measured seconds of one step as `FeedbackLoop.record_step` reads them (what the
    pipeline runner's ``StepTiming`` holds; one stage): ``forward_s``/``backward_s`` [M] in the plan's
    order of the rank's micro-batches, placeholders after them."""

    replica: int
    forward_s: np.ndarray
    backward_s: np.ndarray
    stage: int = 0

    @property
    def compute_s(self) -> np.ndarray:
        """Forward + backward seconds per micro-batch."""
        return self.forward_s + self.backward_s


def _distributed() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _check_planning_on_demand(loader) -> None:
    """Refuse a loader with a FeedbackLoop whose steps are planned ahead (see the module docstring)."""
    mode = loader.mode_object
    processes = int(getattr(getattr(mode, "steps", None), "plan_processes", 0) or 0)
    ahead = [f"plan_ahead={loader.plan_ahead}" if loader.plan_ahead else "",
             f"num_workers={loader.num_workers}" if loader.num_workers else "",
             f"plan_processes={processes}" if processes else ""]
    ahead = [a for a in ahead if a]
    if ahead:
        raise ValueError(
            f"feedback on the data-parallel route needs steps planned on demand, and this loader plans ahead "
            f"({', '.join(ahead)}): a planning thread, worker or process plans with whatever coefficients it reads "
            "when it gets there, so a refit would reach each rank's plans at another step and the ranks would train "
            "different plans. Build the DataLoader with runtime=Runtime(plan_ahead=0) and no num_workers / "
            "plan_processes, or without feedback=")
    if loader.num_stages != 1:
        raise ValueError(f"feedback on the data-parallel route needs PlanOptions(num_stages=1) (each rank runs the "
                         f"whole model); this loader plans {loader.num_stages} stages, whose costs are one stage's share")


class StepFeedback:
    """Times, gathers and feeds back each step of ``loader`` (see the module docstring).

    Args:
        loader: the `dynabatch.DataLoader` the steps come from, built with this process's rank and
            world size. With a `FeedbackLoop` (``DataLoader(feedback=...)``) its cost model is refit;
            then the loader must plan on demand (``Runtime(plan_ahead=0)``, no workers or plan
            processes) and for one stage.
    """

    def __init__(self, loader):
        self.loader = loader
        self.loop = loader.feedback_loop
        if self.loop is not None:
            _check_planning_on_demand(loader)
        self.last: StepMetrics | None = None
        self._unread: list[StepMetrics] = []
        self._stats = None  # the loader's wait/interval counters after the previous step
        self._device = None  # where the collectives' tensors live (the backend's device)
        self._ratio: float | None = None  # backward / forward seconds, for the synchronizing micro-batch

    # -- what step_backward calls ------------------------------------------------------------------
    def record(self, step, timer, loss: torch.Tensor) -> StepMetrics:
        """Gather the step's times from every rank, feed the loop (refit when due) and make the
        step's `StepMetrics`; ``timer`` is the step's `MicroBatchTimer`, ``loss`` this rank's
        `step_backward` return value. Every rank must call it for the same step."""
        plan = getattr(step, "plan", None)
        if plan is None:
            raise TypeError("StepFeedback needs the loader's Step (with its plan): pass the steps the DataLoader yields")
        rank, world = _distributed()
        if (rank, world) != (self.loader.rank, self.loader.world_size):
            raise ValueError(f"this process is rank {rank} of {world} but the loader was built for rank "
                             f"{self.loader.rank} of {self.loader.world_size}")
        fwd, bwd = timer.resolve()
        M = len(fwd)
        mine = self._own_microbatches(plan, rank)  # plan indices, execution order
        pred = np.zeros(M)
        pred[:len(mine)] = plan.mb_time_s[mine]
        wait, interval = self._wait_and_interval(getattr(step, "epoch", 0))
        head = [M, len(mine), float(loss), wait, interval, int(plan.mb_real_tokens[mine].sum()),
                int(plan.mb_tokens[mine].sum())]
        streaming = self.loop is not None and self.loader.mode == "streaming"
        phi = np.zeros((M, self.loop.cost_model.time_coef.size)) if streaming else np.zeros((M, 0))
        if streaming and len(mine):
            phi[:len(mine)] = self.loop.features(plan, step.shapes)[mine]
        row = np.concatenate([np.asarray(head, np.float64), fwd, bwd, pred, phi.ravel()])
        rows = self._all_gather(row, world)
        n = len(HEAD)
        F, B, P = (rows[:, n + k * M:n + (k + 1) * M] for k in range(3))
        real = np.arange(M)[None, :] < rows[:, 1][:, None]
        cost = self.loop.cost_model if self.loop is not None else getattr(self.loader, "cost", None)
        B = self._estimate_synced_backward(F, B, real, timer.synced, cost)
        valid = real & np.isfinite(F + B) & (F + B > 0)
        refit = None
        if self.loop is not None and timer.lockstep:
            self._warn_lockstep()
        elif self.loop is not None:
            if streaming:
                Phi = rows[:, n + 3 * M:].reshape(world, M, -1)
                self._record_observations(Phi[valid], (F + B)[valid], P[valid])
            else:
                self._record_plan(step, plan, F, B, valid, world)
            refit = self.loop.maybe_refit()
            if refit is not None and world > 1:
                self._agree_on_coefficients()
        m = step_metrics(step, rows[:, :n], F, B, P, valid)
        if refit is not None:
            m = replace(m, refit=True, refit_mape_before=refit.mape_before_refit, refit_mape_after=refit.mape_after_refit)
        m = replace(m, cost_version=int(getattr(cost, "version", 0)))
        if timer.lockstep:  # every rank waited for the slowest one in each micro-batch: no rank's own time
            m = replace(m, measured_imbalance=math.nan)
        self.last = m
        self._unread.append(m)
        return m

    def take(self) -> list[StepMetrics]:
        """The `StepMetrics` made since the last `take` (oldest first); they are handed over once."""
        out, self._unread = self._unread, []
        return out

    # -- the accelerate helper ---------------------------------------------------------------------
    def backward(self, model, step, *, accelerator=None, loss_fn=None, world_size: int | None = None,
                 prepare=None, nonfinite: str = "raise") -> StepMetrics:
        """`step_backward` of ``step`` with this feedback (same arguments); returns its `StepMetrics`
        (``loss`` the step's mean loss per target token over all ranks). Call ``optimizer.step()`` after."""
        from .accumulation import step_backward

        step_backward(model, step, accelerator=accelerator, loss_fn=loss_fn, world_size=world_size, prepare=prepare,
                      nonfinite=nonfinite, feedback=self)
        return self.last

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The loop's refit state (`FeedbackLoop.state_dict`; None without a loop) and the last
        backward/forward ratio (the synchronizing micro-batch's estimate), JSON-able."""
        return {"format": FEEDBACK_FORMAT, "loop": None if self.loop is None else self.loop.state_dict(),
                "backward_ratio": self._ratio}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict` into the loop and its cost model (the loader's), in place."""
        if not isinstance(state, dict) or state.get("format") != FEEDBACK_FORMAT:
            raise ValueError(f"not a StepFeedback state (its format is not {FEEDBACK_FORMAT!r})")
        if (state["loop"] is None) != (self.loop is None):
            raise ValueError("the feedback state was saved " + ("without" if state["loop"] is None else "with") +
                             " a FeedbackLoop and this loader has " + ("one" if self.loop is not None else "none") +
                             ": the plans would not continue as they were")
        if self.loop is not None:
            self.loop.load_state_dict(state["loop"])
        self._stats, self._ratio = None, state.get("backward_ratio")

    # -- inside ------------------------------------------------------------------------------------
    def _estimate_synced_backward(self, F, B, real, synced: int | None, cost) -> np.ndarray:
        """``B`` with the synchronizing micro-batch's backward (which also waited for the slowest rank
        and reduced the gradients) replaced by its forward times the backward/forward ratio of the
        step's other real micro-batches over all ranks (the last such ratio seen when the step has
        none; the cost model's ``(1 - f) / f`` before any)."""
        if synced is None or F.shape[1] == 0:
            return B
        others = real.copy()
        others[:, synced] = False
        f, b = F[others].sum(), B[others].sum()
        if f > 0 and b > 0:
            self._ratio = float(b / f)
        elif self._ratio is None:
            frac = float(getattr(cost, "forward_fraction", 1.0 / 3.0))
            self._ratio = (1.0 - frac) / frac
        B = B.copy()
        B[:, synced] = F[:, synced] * self._ratio
        return B

    def _warn_lockstep(self) -> None:
        if not getattr(self, "_warned_lockstep", False):
            self._warned_lockstep = True
            warnings.warn("the model is FSDP-sharded: every micro-batch all-gathers its parameters, so each rank waits "
                          "for the others in every forward and backward and no measured time is a micro-batch's own; "
                          "they are not fed to the FeedbackLoop (the metrics are still made; refit with DDP, or "
                          "profile the model: dynabatch profile)", RuntimeWarning, stacklevel=4)

    def _own_microbatches(self, plan, rank: int) -> np.ndarray:
        """Indices into ``plan`` of this rank's micro-batches in execution order (the order of the
        step's micro-batch dicts): the streaming mode's plan is the rank's own."""
        if self.loader.mode == "streaming":
            return plan.rank_indices(0)
        return plan.rank_indices(rank) if rank < plan.num_ranks else np.zeros(0, np.int64)

    def _wait_and_interval(self, epoch: int) -> tuple[float, float]:
        """(seconds the loop waited for the loader's last step, seconds since the step before), from
        the loader's counters; nan for an epoch's first step (its wait includes start-up, and a loop
        that stops iterating an epoch without exhausting it, as the Trainer does, leaves the counters
        running into the next)."""
        st = getattr(self.loader, "stats", None) or {}
        now = (int(epoch), int(st.get("steps", 0)), float(st.get("wait_time_s", 0.0)), float(st.get("step_time_s", 0.0)))
        before, self._stats = self._stats, now
        if before is None or now[:2] != (before[0], before[1] + 1) or now[1] < 2:
            return math.nan, math.nan
        return now[2] - before[2], now[3] - before[3]

    def _collective_device(self) -> torch.device:
        if self._device is None:
            backend = str(torch.distributed.get_backend())
            self._device = (torch.device("cpu") if "gloo" in backend or "cuda" not in backend and "nccl" not in backend
                            else torch.device("cuda", torch.cuda.current_device()))
        return self._device

    def _all_gather(self, row: np.ndarray, world: int) -> np.ndarray:
        if world == 1:
            return row[None, :]
        t = torch.from_numpy(row).to(self._collective_device())
        out = [torch.empty_like(t) for _ in range(world)]
        torch.distributed.all_gather(out, t)
        return torch.stack(out).cpu().numpy()

    def _record_plan(self, step, plan, F, B, valid, world: int) -> None:
        """`FeedbackLoop.record_step` with each rank's times in the plan's order (not-observed ones nan)."""
        y_f, y_b = np.where(valid, F, np.nan), np.where(valid, B, np.nan)
        timings = [RankTiming(r, to_plan_order(plan, r, y_f[r]), to_plan_order(plan, r, y_b[r])) for r in range(world)]
        self.loop.record_step(step, timings)

    def _record_observations(self, phi, y, pred) -> None:
        """`FeedbackLoop.record` of every rank's gathered features (the streaming mode)."""
        if self.loop.per_stage:
            self.loop.record(phi, y[None, :], predicted_s=pred[None, :])
        else:
            self.loop.record(phi, y, predicted_s=pred)

    def _agree_on_coefficients(self) -> None:
        """Broadcast rank 0's refit coefficients; a rank whose own differ takes them."""
        cost = self.loop.cost_model
        rows = cost.stage_time_coef
        mine = np.asarray(cost.time_coef if rows is None else rows, np.float64)
        t = torch.from_numpy(mine.ravel().copy()).to(self._collective_device())
        torch.distributed.broadcast(t, src=0)
        theirs = t.cpu().numpy().reshape(mine.shape)
        if not np.array_equal(theirs, mine):
            logger.info("rank %d: its refit differs from rank 0's in the last bits; it takes rank 0's coefficients",
                        torch.distributed.get_rank())
            if rows is None:
                cost.time_coef = theirs
            else:
                cost.set_stage_time_coef(theirs)


def to_plan_order(plan, rank: int, values: np.ndarray) -> np.ndarray:
    """``values`` of rank ``rank``'s micro-batches in execution order (the order of its micro-batch
    dicts, placeholders last) rearranged into the plan's order of that rank's micro-batches (what
    `FeedbackLoop.record_step` reads), placeholders still last."""
    values = np.asarray(values, np.float64)
    if rank >= plan.num_ranks:  # a global batch planned on fewer ranks: this one has only placeholders
        return values.copy()
    in_plan = np.flatnonzero(plan.mb_rank == rank)
    pos = np.searchsorted(in_plan, plan.rank_indices(rank))  # where each executed micro-batch sits in plan order
    out = values.copy()
    out[pos] = values[:len(pos)]
    return out


def save_feedback_state(state: dict, path) -> None:
    """Write `StepFeedback.state_dict` to ``path`` as JSON with an integrity record (`read_feedback_state`
    checks it). Not atomic by itself: `DynabatchTrainer` writes it into the checkpoint's staging
    folder, published whole; in an accelerate loop, ``accelerator.register_for_checkpointing(feedback)``
    puts it into ``accelerator.save_state`` instead."""
    from .. import integrity

    doc = {"state": state, "integrity": {"fields": integrity.field_digests(json.loads(json.dumps(state)))}}
    with open(os.fspath(path), "w", encoding="utf-8") as f:
        json.dump(doc, f)


def read_feedback_state(path) -> dict:
    """Read `save_feedback_state`'s file, checked: ValueError naming the file and the fields when it is
    not JSON or was edited or damaged after it was written."""
    from .. import integrity

    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        state, record = doc["state"], doc["integrity"]["fields"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a dynabatch feedback state file ({e}); resume from an earlier checkpoint") from None
    integrity.check(ValueError, path, "field", record, integrity.field_digests(state),
                    "resume from an earlier checkpoint")
    return state


__all__ = ["FEEDBACK_FORMAT", "FEEDBACK_STATE_NAME", "RankTiming", "StepFeedback", "read_feedback_state",
           "save_feedback_state", "to_plan_order"]
