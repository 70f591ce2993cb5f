"""`DynabatchTrainer`: ``transformers.Trainer`` trained from a `dynabatch.DataLoader`, one dynabatch
`Step` per optimizer step.

The Trainer iterates the loader itself (``get_train_dataloader`` returns it as is: no
``accelerator.prepare``, no sampler, no sharding, since dynabatch already gives each rank its own
micro-batches) and takes each `Step` as one "batch" with ``gradient_accumulation_steps=1``.
`DynabatchTrainer.training_step` accumulates over the step's micro-batches with
`dynabatch.integrations.accumulation.step_backward`: each micro-batch's ``compute_loss`` gets
``num_items_in_batch = step.target_tokens`` (the step's loss tokens over all ranks), the loss is
multiplied by the world size under DDP, and all but the last micro-batch run under
``accelerator.no_sync``. So ``global_step`` counts optimizer steps = dynabatch steps, ``len(loader)``
of them per epoch (epochs may differ in length: token-budget batches are cut anew each epoch, and
``max_steps`` is their sum), ``state.epoch`` reaches ``num_train_epochs``, ``set_epoch`` is called on
the loader each epoch, and the logged ``loss`` is the mean loss per target token of the steps. A
streaming-mode loader has no length: ``max_steps`` is required and ``state.epoch`` follows Trainer's
convention for iterable data (``max_steps`` steps per "epoch").

Checkpoints hold the loader's ``state_dict()`` (``dynabatch_loader_rank{r}.json`` per rank) and are
complete or absent: written into ``tmp-checkpoint-N/`` and renamed ``checkpoint-N`` when whole;
``train(resume_from_checkpoint=...)`` loads it and continues exactly after the last trained step
instead of Trainer's ``skip_first_batches`` (``ignore_data_skip`` is forced on). A checkpoint
without that file is refused.

Feedback and metrics (``feedback=True``, the default): every step is timed, gathered over the ranks
and fed to the loader's `FeedbackLoop` when it has one (`dynabatch.integrations.feedback.StepFeedback`,
``step_feedback``; its refit state is saved in each checkpoint, ``FEEDBACK_STATE_NAME``, and loaded
on resume), and the steps' `StepMetrics` are logged as ``dynabatch/*`` entries
(`dynabatch.integrations.hf_metrics.StepMetricsCallback`).

Not supported (refused at construction): ``gradient_accumulation_steps != 1``, DeepSpeed, and
``nn.DataParallel`` (several GPUs in one process; use DDP through ``torchrun``/``accelerate launch``);
``TrainingArguments(fsdp=...)`` where accelerate does not run FSDP (the CPU) and a model sharded
beforehand under such an accelerator (`dynabatch.integrations.fsdp.check_trainer_fsdp`).
The loss of every Hugging Face model is the summed token loss / ``step.target_tokens``
(`dynabatch.integrations.loss.model_loss`: T5 and BART, whose own loss is a per-micro-batch mean, get it
from their logits); a ``compute_loss_func`` or label smoother is used as Trainer uses it.
"""

from __future__ import annotations

import copy
import glob
import inspect
import math
import os
import shutil

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from ..loader.collate import model_inputs
from ..loader.state import load_loader_state, save_loader_state
from ..loader.step import Step
from .accumulation import step_backward
from .feedback import FEEDBACK_STATE_NAME, StepFeedback, read_feedback_state, save_feedback_state
from .fsdp import check_trainer_fsdp
from .hf_metrics import StepMetricsCallback
from .loss import model_loss

#: Trainer internals this subclass overrides (present in transformers 5.x); checked at construction so
#: that another version fails with a clear message instead of silently skipping an override.
_TRAINER_HOOKS = ("_run_epoch", "_init_training_state", "_save_checkpoint", "_get_output_dir",
                  "_track_num_input_tokens", "set_initial_training_values", "get_batch_samples", "training_step")

#: File name of a rank's loader state inside a checkpoint folder.
LOADER_STATE_NAME = "dynabatch_loader_rank{rank}.json"
#: Prefix of the folder a checkpoint is written into before it is renamed ``checkpoint-N``.
STAGING_PREFIX = "tmp-"


def _publish(staged: str, final: str) -> None:
    """Rename the complete folder ``staged`` to ``final`` (an older ``final`` of the same step is
    moved aside first and removed after: a kill in between leaves that step absent, never half)."""
    old = None
    if os.path.exists(final):
        old = os.path.join(os.path.dirname(staged), "old")  # inside the staging folder: removed with it
        os.replace(final, old)
    os.replace(staged, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def steps_in_epoch(loader, epoch: int) -> int | None:
    """Optimizer steps (dynabatch steps) of ``epoch``, or None when unknown (streaming mode)."""
    mode = loader.mode_object
    if not hasattr(mode, "num_steps"):
        return None
    return int(mode.num_steps(epoch))


def training_schedule(loader, num_train_epochs: float, max_steps: int = -1) -> tuple[int, int]:
    """(epochs to iterate, total optimizer steps) of a run over ``loader`` (indexed mode).

    ``max_steps > 0`` wins (epochs: as many as hold that many steps); otherwise
    ``num_train_epochs`` whole epochs plus ``ceil(fraction * steps of the next epoch)`` steps."""
    if max_steps > 0:
        epochs, total = 0, 0
        while total < max_steps:
            n = steps_in_epoch(loader, epochs)
            if n <= 0:
                raise ValueError(f"epoch {epochs} of the loader has no steps")
            total, epochs = total + n, epochs + 1
        return epochs, int(max_steps)
    full = int(num_train_epochs)
    total = sum(steps_in_epoch(loader, e) for e in range(full))
    frac = num_train_epochs - full
    if frac > 0:
        total += math.ceil(frac * steps_in_epoch(loader, full))
    return math.ceil(num_train_epochs), int(total)


def _dynabatch_args(args: TrainingArguments | None) -> TrainingArguments:
    """A copy of ``args`` with what a dynabatch step needs (the caller's object is left alone)."""
    if args is None:
        args = TrainingArguments(output_dir="tmp_trainer")
    if args.gradient_accumulation_steps != 1:
        raise ValueError(
            f"gradient_accumulation_steps={args.gradient_accumulation_steps}: with DynabatchTrainer one dynabatch step "
            "is one optimizer step and the accumulation runs over its micro-batches; size the step with the loader's "
            "global_batch_tokens / global_batch_size and leave gradient_accumulation_steps=1")
    args = copy.copy(args)
    # the loader resumes exactly from its own state: Trainer must not skip batches on resume
    args.ignore_data_skip = True
    # step.target_tokens already counts every rank's tokens; step_backward multiplies by the world size
    args.average_tokens_across_devices = False
    return args


class _ResumedEpochCallback(TrainerCallback):
    """Trainer sets ``state.epoch = epoch + (k + 1) / steps_in_epoch`` counting the steps it ran in
    this epoch; a resumed epoch already had ``done`` steps: add ``done / steps_in_epoch``."""

    def __init__(self, trainer: "DynabatchTrainer"):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        state.epoch += self.trainer._epoch_shift
        return control


class DynabatchTrainer(Trainer):
    """``transformers.Trainer`` whose training data is a `dynabatch.DataLoader`: one dynabatch
    `Step` (this rank's micro-batches) per optimizer step, loss normalized by the step's real
    target tokens over all ranks (see the module docstring).

    Args:
        train_loader: the `dynabatch.DataLoader` (keyword only) built with this process's
            ``rank``/``world_size`` (the defaults, from ``torch.distributed``, do that). Indexed mode:
            ``len(loader)`` steps per epoch, ``num_train_epochs`` or ``max_steps``; streaming mode:
            ``max_steps`` is required.
        nonfinite: ``"raise"`` (default) stops training on a step whose loss or gradient norm is NaN/inf,
            naming the step and micro-batch; ``"skip"`` drops that step's gradients and counts it
            (`dynabatch.integrations.skipped_steps`), see `step_backward`.
        feedback: True (default): time every step's micro-batches, gather them over the ranks (one
            small collective per step), refit the loader's `FeedbackLoop` when it has one
            (`dynabatch.integrations.feedback.StepFeedback`, kept in ``step_feedback``; its refit state
            is saved in every checkpoint, ``FEEDBACK_STATE_NAME``, and loaded on resume) and log the
            steps' `StepMetrics` (``dynabatch/*`` entries, `StepMetricsCallback`). False: none of it.
        *args, **kwargs: ``transformers.Trainer``'s (``model``, ``args``, ``eval_dataset``,
            ``compute_loss_func``, ``callbacks``, ...), without ``train_dataset``/``data_collator``
            for training. ``args.gradient_accumulation_steps`` must be 1; the Trainer works on a copy
            of ``args`` with ``ignore_data_skip=True`` and ``average_tokens_across_devices=False``.
    """

    def __init__(self, *args, train_loader, nonfinite: str = "raise", feedback: bool = True, **kwargs):
        missing = [h for h in _TRAINER_HOOKS if not hasattr(Trainer, h)]
        if missing:
            import transformers

            raise ImportError(f"DynabatchTrainer overrides Trainer.{', '.join(missing)}, which transformers "
                              f"{transformers.__version__} does not have: install transformers>=5.0 "
                              "(pip install 'dynabatch[hf]'), or use dynabatch.step_backward in your own loop")
        params = list(inspect.signature(Trainer.__init__).parameters)[1:]
        bound = dict(zip(params, args))
        bound.update(kwargs)
        if bound.get("train_dataset") is not None:
            raise ValueError("pass the training data as train_loader=dynabatch.DataLoader(...), not train_dataset=")
        bound["args"] = _dynabatch_args(bound.get("args"))
        super().__init__(**bound)
        self.train_loader = train_loader
        self.nonfinite = nonfinite
        self._epoch_shift = 0.0
        self._resume_point: tuple[int, int] | None = None
        self._staging_dir: str | None = None  # set while _save_checkpoint writes
        self.callback_handler.callbacks.insert(0, _ResumedEpochCallback(self))
        self._check_setup()
        self.step_feedback = StepFeedback(train_loader) if feedback else None
        if self.step_feedback is not None:  # first: the reporters after it see its entries
            self.callback_handler.callbacks.insert(0, StepMetricsCallback(self.step_feedback))

    def _check_setup(self) -> None:
        a, loader = self.args, self.train_loader
        if a.gradient_accumulation_steps != 1 or int(self.accelerator.gradient_accumulation_steps) != 1:
            raise ValueError("DynabatchTrainer needs gradient_accumulation_steps=1 (also in accelerator_config)")
        if self.is_deepspeed_enabled:
            raise NotImplementedError(
                "DynabatchTrainer does not support DeepSpeed: its engine owns the accumulation (its config's "
                "gradient_accumulation_steps, engine.backward scaling each loss and reducing at its own boundary) and "
                "its ZeRO stages partition gradients by its own buckets, so a dynabatch step's micro-batches, "
                "normalized by step.target_tokens and reduced once after the last, would be scaled and reduced again. "
                "Train with DDP, or with FSDP through dynabatch.integrations.step_backward")
        check_trainer_fsdp(a, self.accelerator, self.model)
        if a.n_gpu > 1:
            raise NotImplementedError("DynabatchTrainer does not support nn.DataParallel (several GPUs in one process): "
                                      "launch one process per GPU (torchrun / accelerate launch)")
        if int(loader.world_size) != int(a.world_size):
            raise ValueError(f"the loader was built for world_size={loader.world_size} but the Trainer runs "
                             f"{a.world_size} processes: build it in each process with rank=/world_size= of the job")
        if steps_in_epoch(loader, 0) is None and a.max_steps <= 0:
            raise ValueError("a streaming-mode loader has no length: set TrainingArguments(max_steps=...)")

    # -- data ----------------------------------------------------------------------------------
    def get_train_dataloader(self):
        """The dynabatch loader itself: already sharded by rank, not prepared by accelerate."""
        return self.train_loader

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The next ``num_batches`` (1) `Step` s; no ``num_items_in_batch``: each step carries its own."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        for b in batches:
            if not isinstance(b, Step):
                raise TypeError(f"DynabatchTrainer trains on dynabatch Steps (iterate the loader), got {type(b).__name__}")
        return batches, None

    def num_examples(self, dataloader) -> int:
        """Samples of the data (the loader's length index), for Trainer's logs."""
        if dataloader is self.train_loader and self.train_loader.index is not None:
            return len(self.train_loader.index)
        return super().num_examples(dataloader)

    # -- schedule ------------------------------------------------------------------------------
    def set_initial_training_values(self, args, dataloader):
        """Trainer's values with ``max_steps``/epochs from every epoch's own step count."""
        values = list(super().set_initial_training_values(args, dataloader))
        if dataloader is self.train_loader and steps_in_epoch(self.train_loader, 0) is not None:
            values[0], values[6] = training_schedule(self.train_loader, args.num_train_epochs, args.max_steps)
        return tuple(values)

    def _run_epoch(self, *args, **kwargs):
        """Trainer's epoch with this epoch's step count (and the steps left of a resumed epoch)."""
        a = inspect.signature(Trainer._run_epoch).bind(self, *args, **kwargs).arguments
        a.pop("self")
        n = steps_in_epoch(self.train_loader, a["epoch"])
        self._epoch_shift = 0.0
        resumed = self._resume_point is not None and self._resume_point[0] == a["epoch"]
        if n is not None:
            done = self._resume_point[1] if resumed else 0
            self._epoch_shift = done / n
            a["steps_in_epoch"], a["num_update_steps_per_epoch"] = n, n - done
        self._resume_point = None
        before = self.state.global_step
        try:
            out = super()._run_epoch(**a)
        finally:
            self._epoch_shift = 0.0
        if resumed and n is None and self.state.global_step == before:
            # a streaming state saved after the last step of its epoch resumes into an epoch with no
            # step left (its length is unknown until then); Trainer takes that for the end of the data
            self.control.should_training_stop = False
        return out

    # -- one step --------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Forward/backward of every micro-batch of the `Step` ``inputs`` (`step_backward` with this
        Trainer's ``compute_loss``, ``_prepare_inputs`` and accelerator); returns the detached step
        loss per target token (this rank's share times the world size)."""
        if not isinstance(inputs, Step):
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()

        def loss_fn(model, mb_inputs, n):
            with self.compute_loss_context_manager():
                return self.compute_loss(model, mb_inputs, num_items_in_batch=n)

        return step_backward(model, inputs, accelerator=self.accelerator, loss_fn=loss_fn,
                             world_size=self.args.world_size, prepare=self._prepare_inputs,
                             nonfinite=self.nonfinite, feedback=self.step_feedback)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """A training micro-batch's summed token loss / ``num_items_in_batch`` by `model_loss` (the
        model's own loss where it honours ``num_items_in_batch``, its logits' where it returns a mean,
        as T5 and BART do); Trainer's own ``compute_loss`` with ``compute_loss_func``, a label smoother,
        ``return_outputs`` (evaluation) or without ``num_items_in_batch``."""
        if (return_outputs or num_items_in_batch is None or self.compute_loss_func is not None
                or self.label_smoother is not None):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        return model_loss(model, inputs, int(num_items_in_batch))

    def floating_point_ops(self, inputs) -> int:
        if isinstance(inputs, Step):
            return sum(super(DynabatchTrainer, self).floating_point_ops(model_inputs(mb)) for mb in inputs)
        return super().floating_point_ops(inputs)

    def _track_num_input_tokens(self, inputs):
        how = self.args.include_num_input_tokens_seen
        if not isinstance(inputs, Step) or how == "no":
            return super()._track_num_input_tokens(inputs)
        n = sum(int(mb["attention_mask"].sum()) if how == "non_padding" and "attention_mask" in mb
                else mb["input_ids"].numel() for mb in inputs if not mb.get("is_padding"))
        n = torch.as_tensor(n, device=self.args.device, dtype=torch.int64)
        self.state.num_input_tokens_seen += self.accelerator.gather(n).sum().item()

    # -- checkpoints -------------------------------------------------------------------------------
    def _get_output_dir(self, trial):
        """Trainer's run folder, or the staging folder while `_save_checkpoint` writes into it."""
        return self._staging_dir if self._staging_dir is not None else super()._get_output_dir(trial=trial)

    def _save_checkpoint(self, model, trial):
        """Trainer's checkpoint plus every rank's loader state (``LOADER_STATE_NAME``), complete or
        absent: all of it is written under ``tmp-checkpoint-N/`` (which ``get_last_checkpoint`` does
        not match) and renamed to ``checkpoint-N`` once every rank has written its part; a save
        killed midway leaves only the staging folder (removed by the next save)."""
        run_dir = super()._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        stage, final = os.path.join(run_dir, f"{STAGING_PREFIX}{name}"), os.path.join(run_dir, name)
        staged = os.path.join(stage, name)
        if self.args.should_save:  # what saves killed midway left behind
            for left in glob.glob(os.path.join(run_dir, f"{STAGING_PREFIX}{PREFIX_CHECKPOINT_DIR}-*")):
                shutil.rmtree(left, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self._staging_dir = stage
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_dir = None
        os.makedirs(staged, exist_ok=True)
        # atomic, with its integrity record
        save_loader_state(self.train_loader.state_dict(), os.path.join(staged, LOADER_STATE_NAME.format(
            rank=self.train_loader.rank)))
        fb = self.step_feedback
        if fb is not None and fb.loop is not None and self.args.should_save:  # the same on every rank
            save_feedback_state(fb.state_dict(), os.path.join(staged, FEEDBACK_STATE_NAME))
        if self.state.best_model_checkpoint == staged:  # Trainer recorded the folder it wrote
            self.state.best_model_checkpoint = final
            if self.args.should_save:
                self.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            _publish(staged, final)
            os.rmdir(stage)
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()

    def _load_loader_state(self, checkpoint: str) -> None:
        loader = self.train_loader
        own = os.path.join(checkpoint, LOADER_STATE_NAME.format(rank=loader.rank))
        paths = sorted(glob.glob(os.path.join(checkpoint, LOADER_STATE_NAME.format(rank="*"))))
        if not paths:
            raise FileNotFoundError(
                f"{checkpoint} holds no dynabatch loader state ({LOADER_STATE_NAME.format(rank=loader.rank)}): it was "
                "not saved by DynabatchTrainer, and skipping batches would not resume a dynabatch loader exactly. "
                "Start a new run, or load the loader's state_dict() yourself and train without resume_from_checkpoint")
        states = [load_loader_state(p) for p in paths]  # checked: names the file of an edited or damaged state
        mine = [s for p, s in zip(paths, states) if p == own]
        same_world = mine and mine[0][mine[0]["mode"]]["layout"]["world_size"] == loader.world_size
        loader.load_state_dict(mine[0] if same_world else states)
        self._load_feedback_state(checkpoint)

    def _load_feedback_state(self, checkpoint: str) -> None:
        """The refit state the checkpoint holds into the loader's FeedbackLoop (warned when one of the
        two is missing: the plans then continue from another cost model than the saved run's)."""
        import warnings

        path = os.path.join(checkpoint, FEEDBACK_STATE_NAME)
        fb = self.step_feedback
        has_loop = fb is not None and fb.loop is not None
        if os.path.exists(path) and has_loop:
            fb.load_state_dict(read_feedback_state(path))
        elif os.path.exists(path):
            warnings.warn(f"{path} holds the refit cost model of the saved run, but this Trainer has no FeedbackLoop "
                          "(DataLoader(feedback=...)) to load it into: the steps are planned with the loader's own cost "
                          "model, not the refit one", UserWarning, stacklevel=3)
        elif has_loop:
            warnings.warn(f"{checkpoint} holds no feedback state ({FEEDBACK_STATE_NAME}): the FeedbackLoop starts from its "
                          "prior, so the steps may be planned otherwise than in the saved run", UserWarning, stacklevel=3)

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint,
                             trial):
        """Trainer's state; on resume, the loader's state from the checkpoint gives the epoch and the
        steps already trained in it (no batch skipping)."""
        epochs, _ = super()._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs,
                                                 resume_from_checkpoint, trial)
        self._resume_point = None
        if resume_from_checkpoint is None:
            return epochs, 0
        self._load_loader_state(resume_from_checkpoint)
        s = self.train_loader.state_dict()
        pos = s[s["mode"]]
        done = self.train_loader.mode_object.next_step()  # a streaming state stays at its last step's start
        if done != int(self.state.global_step):
            raise ValueError(f"the loader state in {resume_from_checkpoint} has trained {done} steps but the "
                             f"Trainer state {self.state.global_step} (global step): not the same run")
        epoch = int(pos["epoch"])
        self._resume_point = (epoch, 0 if pos.get("fresh") else int(pos["step_in_epoch"]))
        return epoch, 0


__all__ = ["DynabatchTrainer", "LOADER_STATE_NAME", "steps_in_epoch", "training_schedule"]
