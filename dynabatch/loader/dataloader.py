"""`DataLoader`: a drop-in replacement for ``torch.utils.data.DataLoader`` that yields
cost-balanced steps of micro-batches.

Iterating yields one `Step` per optimizer step, as many as ``len(loader)`` says: the list of this
rank's micro-batches of the step (gradient accumulation runs over them), with the step's plan and
its real target-token count over all ranks (``step.target_tokens``, for loss normalization).
Each micro-batch is a dict of tensors shaped like the Hugging Face collators' output (see
`dynabatch.loader.collate`) plus metadata (``step``, ``microbatch``, ``num_microbatches``,
``real_tokens``, ``step_real_tokens``, ``step_target_tokens``, ``step_samples``,
``predicted_time_s``, ``predicted_memory_bytes``, ``plan_time_s``, ``is_padding``, ``sample_ids``,
``epoch``); `DataLoader.microbatches` yields them one by one. Every rank yields the same number of
steps and the same number of micro-batches per step. The constructor takes
``torch.utils.data.DataLoader``'s arguments (`dynabatch.loader.torch_args`), ``options`` (one
`PlanOptions`) and the settings records of `dynabatch.loader.settings`.

The loader is a thin facade: it normalizes its arguments once (`dynabatch.loader.options`: one
`PlanOptions` for every mode), opens the data and tokenizer, and delegates to one mode object
(`dynabatch.loader.modes`: indexed, replay or streaming), a stateful iterator whose state nests in
the loader's (``state_dict()[mode]``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator

import torch

from . import state as lstate
from .modes.indexed.steps import scan_source, write_index_table
from .modes import Context, IndexedMode, ReplayMode, StreamingMode, build_indexed, build_replay
from ..core.options import PlanOptions
from .options import make_formatter, open_data, resolve
from .step import Step
from .tasks import tag_tasks
from .model_facts import check_vocabulary, model_facts, with_model_facts
from .records import CollateConfig
from .settings import Costing, DataSource, LoaderSettings, Runtime, Tokenization, Workers, refusing_old_keywords
from .torch_args import refuse_torch_arguments, torch_planning


def build_index(data, *, tokenizer="bytes", family: str = "decoder", max_len: int | None = None,
                max_target_len: int | None = None, vision=None, add_bos: bool = False, truncation_side: str = "right",
                format_config=None, path=None, on_error: str = "raise", source_options: dict | None = None,
                split: str | None = None, cache_tokens: bool = False, progress: bool | None = None,
                pretokenized: bool | None = None, image_token_id: int | None = None, chat_template=None):
    """Scan a dataset once into the length index the indexed mode plans with (a `pyarrow.Table`
    with the Shapes columns and ``label_tokens``, sorted by ``sample_id``; written to ``path`` as
    Parquet when given). Pass it as ``DataLoader(..., index=path)`` with the same tokenization
    arguments. ``cache_tokens=True`` (text only) also keeps every sample's token ids in two
    ``large_list<int32>`` columns, from which a loader takes its token cache (about 8 bytes/token).
    ``progress``: a tqdm bar of scanned samples (None: only when stderr is a terminal).
    ``image_token_id``, ``chat_template``: image placeholders in the ids and the rendering of
    conversations, as the DataLoader's."""
    source = open_data(data, source_options, split)
    fmt = make_formatter(tokenizer, family, max_len=max_len, max_target_len=max_target_len, add_bos=add_bos,
                         truncation_side=truncation_side, format_config=format_config, vision=vision,
                         pretokenized=pretokenized, image_token_id=image_token_id, chat_template=chat_template)
    table = scan_source(source, fmt, vision=vision, on_error=on_error, keep_tokens=cache_tokens, progress=progress)
    if path is not None:
        write_index_table(table, path)
    return table


def warn_images_without_vision(source, peek: int = 16) -> None:
    """Warn (one line) when the first ``peek`` records of ``source`` carry images while the loader
    has no vision policy: the images would be dropped and the samples trained as text only."""
    import itertools

    try:
        first = list(itertools.islice(iter(source.fresh()), peek))
    except Exception:  # noqa: BLE001 - a peek only: reading errors surface where the data is read
        return
    with_images = [r for r in first if r.get("images")]
    if with_images:
        warnings.warn(f"{len(with_images)} of the first {len(first)} records carry images (e.g. "
                      f"{with_images[0].get('key', with_images[0].get('sample_id'))!r}) but the loader has no vision "
                      "policy: the images are dropped and the samples trained as text only; give a vision policy "
                      "(Tokenization(vision=tokenization.DynamicTiling())) or a vision-language cost model "
                      "(Costing(cost_model='vlm'))",
                      UserWarning, stacklevel=4)


class DataLoader:
    """Cost-balanced micro-batches of variable-length samples (see the module docstring).

    ``DataLoader(data, options=PlanOptions(global_batch_tokens=65536), tokenization=Tokenization(
    tokenizer="tokenizer.json"), runtime=Runtime(rank=r, world_size=w))``; or torch's way,
    ``DataLoader(data, 64, shuffle=True, num_workers=2)``.

    data: a ``loaders`` source or ``Mixture``, a ``datasets.Dataset``/``IterableDataset``, or a
        path/glob/folder that ``loaders.open_source`` opens (`DataSource`'s ``source_options``, ``split``).

    torch's arguments (in torch's order; `dynabatch.loader.torch_args`):
        batch_size: samples per step on this rank (``global_batch_size = batch_size * world_size``);
            instead of ``options``' global batch.
        shuffle, drop_last: `PlanOptions`' ``shuffle`` / ``drop_last`` (None: the options' value;
            give them in ``options`` when you pass it).
        num_workers, pin_memory, timeout (seconds), worker_init_fn, multiprocessing_context
            (``"fork"``, ``"spawn"``, ``"forkserver"`` or a context), prefetch_factor,
            persistent_workers: as for ``torch.utils.data.DataLoader`` (workers die with this process).
        sampler, batch_sampler, collate_fn, generator, pin_memory_device, in_order: refused, with
            what to use instead (dynabatch samples, batches and collates itself).

    options: a `PlanOptions`, how steps are formed and planned (global batch in tokens or samples,
        max_len / max_target_len, method, num_stages, schedule, memory limits, seed, shuffle,
        drop_last...); ``num_ranks`` is the world size (leave it at 1). Defaults: `PlanOptions`'
        (the same as ``dynabatch plan``'s), the method from ``costing.collate`` when not given.
    tokenization: a `Tokenization` (tokenizer, family, format, chat template, vision policy, pixels).
    source: a `DataSource` (source options, split, on_error, mode, length index, plan file to replay).
    costing: a `Costing` (cost model, device, collation, padding multiple).
    runtime: a `Runtime` (rank, world size, collective, plan_ahead, plan_processes, streaming lookahead).
    feedback: a `dynabatch.core.plan.feedback.FeedbackLoop` whose ``cost_model`` is this loader's cost
        model object; see `feedback`.
    Any other keyword raises a TypeError; the loose keywords of earlier releases (``tokenizer=``,
    ``global_batch_tokens=``, ``rank=``...) name the record each now belongs to
    (`dynabatch.loader.settings.record_of`).

    Staleness of planned-ahead steps: a step is planned with the cost model as it is when it is
    planned (`Step.cost_version`). The planning thread runs ``plan_ahead`` steps ahead of the step
    being trained; with ``num_workers`` workers each worker also holds up to ``prefetch_factor``
    (default 2) finished steps, so a refit reaches the plans at most
    ``plan_ahead + num_workers * prefetch_factor + 1`` steps later (``plan_ahead=0`` and no
    workers: the very next step). Workers and plan processes see refits only through a cost model
    with ``share_memory()`` (called here when they are used); otherwise they keep the model as it
    was when they started.
    """

    @refusing_old_keywords
    def __init__(self, data, batch_size: int | None = None, shuffle: bool | None = None, sampler=None,
                 batch_sampler=None, num_workers: int = 0, collate_fn=None, pin_memory: bool = False,
                 drop_last: bool | None = None, timeout: float = 0, worker_init_fn=None, multiprocessing_context=None,
                 generator=None, *, prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True, options: PlanOptions | None = None,
                 tokenization: Tokenization | None = None, source: DataSource | None = None,
                 costing: Costing | None = None, runtime: Runtime | None = None, feedback=None):
        refuse_torch_arguments(sampler=sampler, batch_sampler=batch_sampler, collate_fn=collate_fn,
                               generator=generator, pin_memory_device=pin_memory_device, in_order=in_order)
        workers = Workers(num_workers, pin_memory, prefetch_factor, timeout, multiprocessing_context, worker_init_fn,
                          persistent_workers)
        settings = LoaderSettings.of(workers, tokenization=tokenization, source=source, costing=costing,
                                     runtime=runtime)
        tok = settings.tokenization
        self.model_facts = model_facts(tok.model if tok.model is not None else tok.tokenizer)
        settings = dataclasses.replace(settings, tokenization=with_model_facts(tok, self.model_facts))
        planning = torch_planning(batch_size, shuffle, drop_last, settings.rank, settings.world_size)
        self._build(data, resolve(settings, options, planning), feedback)

    def _build(self, data, r, feedback) -> None:
        """Open the data and tokenizer and pick the mode (see the module docstring)."""
        from tokenization import DynamicTiling

        s = self.settings = r.settings
        self.options, self.cost, self.family = r.options, r.cost, r.family
        self.rank, self.world_size = r.rank, r.world_size
        self.num_workers, self.pin_memory, self.plan_ahead = int(s.num_workers), bool(s.pin_memory), int(s.plan_ahead)
        vision = s.vision if s.vision is not None or self.cost.kind != "vision_language" else DynamicTiling()
        self.vision, self.load_pixels = vision, bool(s.load_pixels)
        if self.load_pixels and vision is None:
            raise ValueError("Tokenization(load_pixels=True) needs a vision policy (Tokenization(vision=DynamicTiling()) "
                             "or FixedResolution())")
        o = self.options
        self.formatter = make_formatter(s.tokenizer, self.family, max_len=o.max_len, max_target_len=o.max_target_len,
                                        add_bos=s.add_bos, truncation_side=s.truncation_side,
                                        format_config=s.format_config, vision=vision, pretokenized=s.pretokenized,
                                        image_token_id=s.image_token_id, chat_template=s.chat_template)
        self.tokenizer = self.formatter.tokenizer
        check_vocabulary(self.tokenizer, self.model_facts)
        self.pad_to_multiple_of = int(self.cost.pad_multiple)
        collate = CollateConfig(
            collation=o.collation, family=self.family, pad_id=int(self.tokenizer.pad_id),
            pad_to_multiple_of=self.pad_to_multiple_of, decoder_start_token_id=s.decoder_start_token_id,
            vision=vision, load_pixels=self.load_pixels, pixel_mean=tuple(s.pixel_mean), pixel_std=tuple(s.pixel_std))
        self.source = self.dataset = open_data(data, s.source_options, s.split)  # .dataset: torch compatibility
        if vision is None:
            warn_images_without_vision(self.source)
        mode = s.mode
        if mode == "auto":
            indexed = r.plan_file is not None or s.index is not None or getattr(self.source, "map_style", False)
            mode = "indexed" if indexed else "streaming"
        if mode == "streaming" and r.explicit.get("shuffle"):
            raise ValueError("shuffle=True needs the indexed mode (a map-style dataset or DataSource(index=)); a streaming "
                             "source is read in its own order: shuffle it at the source (e.g. "
                             "datasets.IterableDataset.shuffle, or the loaders source's shuffle options)")
        if mode == "indexed" and not (getattr(self.source, "supports_random_access", False)
                                      and not hasattr(self.source, "shard_ranges") and self.source.num_rows is not None):
            raise ValueError(f"{type(self.source).__name__} cannot be read by sample id (a mixture, or a source "
                             "without random access or row counts); use DataSource(mode='streaming')")
        ctx = Context(o, self.cost, self.family, self.rank, self.world_size, s, self.formatter, self.source, collate,
                      vision)
        if r.plan_file is not None:
            self._mode = build_replay(ctx, r.plan_file, r.explicit, s.index, s.index_cache)
        elif mode == "indexed":
            self._mode = build_indexed(ctx, s.index, s.index_cache)
        else:
            self._mode = StreamingMode(ctx)
        if feedback is not None and getattr(feedback, "cost_model", None) is not self.cost:
            raise ValueError("feedback= must be a FeedbackLoop over this loader's cost model object (pass the same "
                             "CostModel as costing=Costing(cost_model=...), and no Costing(pad_to_multiple_of=) that "
                             "differs from its pad_multiple)")
        self._feedback, self._last_step = feedback, None
        uses_processes = self.num_workers > 0 or (isinstance(self._mode, IndexedMode) and self._mode.steps.plan_processes)
        if uses_processes and callable(getattr(self.cost, "share_memory", None)):
            self.cost.share_memory()  # forked workers / plan processes then see refits

    # -- what the loader is ----------------------------------------------------------------------
    mode = property(lambda self: self._mode.name, doc="``indexed``, ``replay`` or ``streaming``.")
    mode_object = property(lambda self: self._mode, doc="The mode's stateful iterator (`dynabatch.loader.modes`).")
    feedback_loop = property(lambda self: self._feedback, doc="The `FeedbackLoop` given as ``feedback=``, or None.")
    method = property(lambda self: self.options.method)
    collation = property(lambda self: self.options.collation)
    num_stages = property(lambda self: self.options.num_stages)
    max_len = property(lambda self: self.options.max_len)
    max_target_len = property(lambda self: self.options.max_target_len)
    seed = property(lambda self: self.options.seed)
    global_batch_tokens = property(lambda self: self.options.global_batch_tokens)
    global_batch_size = property(lambda self: self.options.global_batch_size)
    index = property(lambda self: getattr(self._mode, "index", None), doc="The indexed mode's length index.")
    token_cache = property(lambda self: getattr(self._mode, "token_cache", None))
    stats = property(lambda self: self._mode.stats)
    last_epoch_stats = property(lambda self: self._mode.last_epoch_stats)

    @property
    def epoch(self) -> int:
        return self._mode.epoch

    # -- torch.utils.data.DataLoader surface ---------------------------------------------------------
    def __len__(self) -> int:
        """Steps of the current epoch on this rank (the same on every rank): what iterating the
        loader yields, and what an LR scheduler or ``transformers.Trainer`` counts as optimizer
        steps (indexed and replay modes; streaming raises TypeError, as torch does for an
        iterable dataset without a length)."""
        if not isinstance(self._mode, IndexedMode):
            raise TypeError("len() is unknown in the streaming mode (the number of steps depends on the data "
                            "each rank reads); use the indexed mode for a known length")
        return self._mode.num_steps()

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration runs (a pending resume of another epoch is dropped)."""
        self._mode.set_epoch(epoch)

    def __iter__(self) -> Iterator[Step]:
        """One `Step` per optimizer step, ``len(loader)`` of them: the same as `steps`."""
        return self.steps()

    def microbatches(self) -> Iterator[dict]:
        """This rank's micro-batch dicts one by one, step after step (each carries ``step``,
        ``microbatch``, ``num_microbatches`` and ``step_target_tokens``); a micro-batch counts as
        consumed for `state_dict` once it is yielded. Their number is not known before the steps
        are planned: loops that count (LR schedules, ``Trainer``) iterate the loader instead."""
        mode = self._mode
        for ready, skip in mode.run():
            for i in range(skip, len(ready.batches)):
                mode.advance(ready, i + 1)
                yield self._pin(ready.batches[i])

    def steps(self) -> Iterator[Step]:
        """Whole steps, ``len(loader)`` of them: `Step` s (lists of this rank's micro-batches, with
        the step's ``plan``, ``shapes``, ``target_tokens`` and ``cost_version``); iterating the
        loader does the same. A step counts as consumed for `state_dict` once it is yielded."""
        mode = self._mode
        for ready, skip in mode.run():
            mode.advance(ready, len(ready.batches))
            self._last_step = Step.of(ready, [self._pin(b) for b in ready.batches[skip:]], self.rank)
            yield self._last_step

    def train_steps(self, num_steps: int) -> Iterator[Step]:
        """Exactly ``num_steps`` `Step` s, epoch after epoch (each epoch as `steps` gives it, from where the
        loader stands: a resumed state continues), for a loop that trains a number of steps rather than of
        epochs. Raises ValueError, before yielding anything, when an epoch gives no step (empty data, or less
        than one global batch with ``drop_last``): a run that trains nothing must not look like one that did."""
        if num_steps < 0:
            raise ValueError(f"num_steps={num_steps}: a number of steps is >= 0")
        done = 0
        while done < num_steps:
            before, epoch = done, self.epoch
            for step in self.steps():
                yield step
                done += 1
                if done == num_steps:
                    return
            if done == before:
                raise ValueError(f"epoch {epoch} of the data gives no step ({done} of {num_steps} trained): "
                                 "the data holds no samples, or fewer than one global batch with drop_last=True; "
                                 "check the paths, or lower the global batch")

    def feedback(self, result):
        """Feed the measured result of the last step `steps` yielded to the attached
        `FeedbackLoop` (``record_step(step, result)``), then ``maybe_refit()``; returns what
        ``maybe_refit`` returns (a `FeedbackRow` when it refit). Steps already planned ahead keep the
        model they were planned with (see the class docstring for the staleness bound)."""
        if self._feedback is None:
            raise RuntimeError("no FeedbackLoop is attached: pass DataLoader(..., feedback=FeedbackLoop(cost_model))")
        if self._last_step is None:
            raise RuntimeError("feedback() needs a step: call it after DataLoader.steps() yielded one")
        self._feedback.record_step(self._last_step, result)
        return self._feedback.maybe_refit()

    def _pin(self, batch: dict) -> dict:
        batch = tag_tasks(self.source, batch)  # a TaskMixture's samples carry their task (`loader.tasks`)
        # indexed workers pin in the torch DataLoader already
        workers_pin = isinstance(self._mode, IndexedMode) and self.num_workers > 0
        if workers_pin or not (self.pin_memory and torch.cuda.is_available()):
            return batch
        return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def close(self, wait: bool = True) -> None:
        """Stop background planning and DataLoader workers of an unfinished iteration."""
        self._mode.close(wait)

    def __del__(self):
        try:
            self.close(wait=False)
        except Exception:
            pass

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Exact position of this rank: ``{"format", "version", "mode", <mode>: mode.state_dict()}``
        (see `dynabatch.loader.state`); everything yielded so far counts as consumed. Load it with
        `load_state_dict` on the same rank; to resume on another world size, collect every rank's
        state and load the list (or `DataLoader.merge_states` of it)."""
        return lstate.wrap(self.mode, self._mode.state_dict())

    @staticmethod
    def merge_states(states: list[dict]) -> dict:
        """Combine every rank's `state_dict` into one state that loads on any world size."""
        return lstate.merge_states(states)

    def load_state_dict(self, state) -> None:
        """Resume from `state_dict` of this rank (same world size), or from the list of every rank's
        states / their `merge_states` (any world size: nothing is lost or repeated)."""
        if isinstance(state, (list, tuple)):
            self._mode.load_state_dict([lstate.unwrap(s, self.mode) for s in state])
        else:
            self._mode.load_state_dict(lstate.unwrap(state, self.mode))

    def __repr__(self) -> str:
        return (f"DataLoader(mode={self.mode!r}, method={self.method!r}, collation={self.collation!r}, "
                f"rank={self.rank}/{self.world_size}, epoch={self.epoch})")


__all__ = ["DataLoader", "IndexedMode", "ReplayMode", "Step", "StreamingMode", "build_index"]
