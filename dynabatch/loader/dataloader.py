"""`DataLoader`: a drop-in replacement for ``torch.utils.data.DataLoader`` that yields
cost-balanced micro-batches.

Iterating yields this rank's micro-batches, step after step: dicts of tensors shaped like the
Hugging Face collators' output (see `dynabatch.loader.collate`) plus metadata (``step``,
``microbatch``, ``num_microbatches``, ``real_tokens``, ``step_real_tokens``,
``step_target_tokens``, ``step_samples``, ``predicted_time_s`` and ``predicted_memory_bytes``
(the plan's forward+backward seconds and activation bytes of the micro-batch on one stage),
``plan_time_s``, ``is_padding``, ``sample_ids``, ``epoch``). `DataLoader.steps` yields whole steps
(lists of micro-batches) for gradient-accumulation loops. Every rank yields the same number of steps and the same number of
micro-batches per step, by construction.

Modes (``mode="auto"`` picks one):

* *indexed* (`dynabatch.loader.indexed`): map-style data (HF ``datasets.Dataset``, Parquet/Arrow files,
  or any source with a length index): every rank computes the same global plan, loads only its
  own samples by id; ``len()`` is the number of steps of the epoch. ``plan=`` replays a plan file.
* *streaming* (`dynabatch.loader.streaming`): iterable sources; each rank plans from a local buffer and
  the ranks agree on each step with one small collective.

Planning runs ahead in background threads (in each DataLoader worker for the indexed mode, in
the main process for the streaming mode) so it does not stall the training step; the time it
takes is reported as ``plan_time_s`` and logged (logger ``"dynabatch"``).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Iterator

import numpy as np
import torch

from . import state as lstate
from .access import open_access, supports_indexed
from .collective import LocalCollective, TorchCollective
from .indexed import (TOKEN_CACHE_BUDGET, TOKEN_SETTINGS_KEY, IndexedPlanner, IndexedSteps, TokenCache,
                       WorkerSplitDataset, encode_all, index_settings, load_index, read_index_table, scan_source,
                       token_cache_bytes, write_index_table)
from .steps import CollateConfig, ReadyStep
from .ahead import Ahead, fork_available
from .pixels import IMAGENET_MEAN, IMAGENET_STD
from .replay import PlanFile, ReplayPlanner
from .streaming import ChunkFeed, ChunkProducer, StreamBuffer, StreamConfig, StreamingPlanner, _identity
from ..core.baselines import BASELINE_COLLATION
from ..core.cost import CostModel
from ..core.options import PlanOptions
from ..core.plan import METHODS

logger = logging.getLogger("dynabatch")

COLLATIONS = ("padded", "packed", "packed_rows")
_DEFAULT_METHOD = {"padded": "dp", "packed": "dp_varlen", "packed_rows": "pack"}


def method_collation(method: str) -> str:
    """The collation a planning method's micro-batches are costed (and collated) with."""
    return {"dp": "padded", "dp_varlen": "packed"}.get(method) or BASELINE_COLLATION[method]


def _resolve_layout(rank, world_size) -> tuple[int, int]:
    """(rank, world size): explicit values, else torch.distributed's when initialized, else (0, 1)."""
    from loaders import Layout

    layout = Layout.resolve(rank=rank, world_size=world_size, worker_id=0, num_workers=1)
    return layout.rank, layout.world_size


def make_formatter(tokenizer, family: str, *, max_len=None, max_target_len=None, add_bos=False,
                   truncation_side="right", format_config=None, vision=None):
    """The `tokenization.Formatter` the loader tokenizes with: ``max_len`` caps the whole sequence
    (decoder-only) or the input (encoder-decoder), ``max_target_len`` the target."""
    from tokenization import FormatConfig, Formatter, load_tokenizer

    if format_config is None:
        if family == "decoder":
            format_config = FormatConfig(family="decoder", max_total_tokens=max_len, add_bos=add_bos,
                                         truncation_side=truncation_side)
        else:
            format_config = FormatConfig(family="encoder_decoder", max_input_tokens=max_len,
                                         max_target_tokens=max_target_len, add_bos=add_bos,
                                         truncation_side=truncation_side)
    elif format_config.family != family:
        raise ValueError(f"format_config.family={format_config.family!r} but the loader's family is {family!r}")
    return Formatter(load_tokenizer(tokenizer), format_config, vision=vision)


def build_index(data, *, tokenizer="bytes", family: str = "decoder", max_len: int | None = None,
                max_target_len: int | None = None, vision=None, add_bos: bool = False, truncation_side: str = "right",
                format_config=None, path=None, on_error: str = "raise", source_options: dict | None = None,
                split: str | None = None, cache_tokens: bool = False):
    """Scan a dataset once into the length index the indexed mode plans with (a `pyarrow.Table`
    with the Shapes columns and ``label_tokens``, sorted by ``sample_id``; written to ``path`` as
    Parquet when given). Pass it as ``DataLoader(..., index=path)`` with the same tokenization
    arguments. Costs one tokenization pass over the data (the loader does the same when it gets
    no index; build it once, e.g. on one node, for large data).

    ``cache_tokens=True`` (text only) also keeps every sample's token ids, as the loader with the
    same tokenization arguments collates them, in two ``large_list<int32>`` columns: a loader given
    this index then takes its token cache from the table instead of tokenizing the data again
    (see ``DataLoader(cache_tokens=)``). The ids are about 8 bytes per token, in memory and on disk."""
    source = _open_data(data, dict(source_options or {}), split)
    fmt = make_formatter(tokenizer, family, max_len=max_len, max_target_len=max_target_len, add_bos=add_bos,
                         truncation_side=truncation_side, format_config=format_config, vision=vision)
    table = scan_source(source, fmt, vision=vision, on_error=on_error, keep_tokens=cache_tokens)
    if path is not None:
        write_index_table(table, path)
    return table


def _open_data(data, source_options: dict, split):
    import loaders

    if isinstance(data, (loaders.Source, loaders.Mixture)):
        if source_options:
            raise TypeError("source_options only apply when the loader opens the data itself")
        return data
    return loaders.open_source(data, split=split, **source_options)


class DataLoader:
    """Cost-balanced micro-batches of variable-length samples (see the module docstring).

    Data and tokenization:
        data: a ``loaders`` source or ``Mixture``, a ``datasets.Dataset``/``IterableDataset``, or a
            path/glob/folder that ``loaders.open_source`` opens (``source_options``, ``split``).
        tokenizer: a ``tokenization.load_tokenizer`` spec or tokenizer object (default ``"bytes"``).
        family: ``"decoder"`` or ``"encoder_decoder"``; default from the cost model's kind.
        max_len / max_target_len: truncation in tokens (decoder: whole sequence; encoder-decoder:
            input / target), applied by the formatter and by the planner alike.
        add_bos, truncation_side, format_config: formatting (`tokenization.FormatConfig`).
        vision: a ``tokenization`` vision policy (``DynamicTiling``/``FixedResolution``); default
            ``DynamicTiling()`` for a vision-language cost model. Micro-batches then carry
            ``image_tiles`` (tiles per sample) and, with ``load_pixels=True``, ``pixel_values``.

    Planning:
        cost_model: a `CostModel` or a preset name (``"gpt"``, ``"t5"``, ``"vlm"``) on ``device``;
            default ``"gpt"``, or the cost model recorded in a replayed plan file.
        batch_tokens / batch_size: the global batch (all ranks) in tokens or in samples.
        num_stages: pipeline stages (default 1, or the plan file's).
        method: any `plan_microbatches` method (default ``"dp"`` for padded, ``"dp_varlen"`` for
            packed collation), with ``method_options``; baselines run through the same loader.
        collate: ``"padded"``, ``"packed"`` or ``"packed_rows"`` (default: the method's).
        pad_to_multiple_of: padded lengths' multiple (default: the cost model's ``pad_multiple``).
        seed, drop_last: global-batch formation (indexed) / dropping the final partial step.
        mode: ``"auto"``, ``"indexed"`` or ``"streaming"``; ``index``: a length index (Shapes
            Parquet/Arrow path, table or `Shapes`), else one is built by scanning the data
            (``index_cache``: a Parquet path where it is saved and reused).
        cache_tokens: indexed mode, text only: keep every sample's token ids in memory (flat int32
            arrays, about 8 bytes per token) and collate micro-batches from them instead of reading
            and tokenizing the records of each step again. The ids come from the index's scan
            (`build_index(cache_tokens=True)` or the loader's own scan, also saved in
            ``index_cache``), else from one tokenization pass when the loader is built. Default
            (None): on when the ids fit in 2 GiB (`dynabatch.loader.indexed.TOKEN_CACHE_BUDGET`). The
            batches are the same either way.
        plan: a plan file to replay exactly (see `dynabatch.loader.replay`).
        plan_ahead: steps planned ahead of the one being loaded.
        plan_processes: indexed mode with ``num_workers=0``: plan in this many forked child
            processes (each takes every n-th step, ``plan_ahead`` steps ahead) instead of a thread
            of the main process, so planning does not compete with loading and the training loop
            for the GIL; 0 (default): a thread. Only where ``fork`` exists and the process may
            use more than one CPU; with workers, each worker plans in a thread. It pays off on
            idle cores only (on a busy 2-core machine it measured no faster than the thread).
        buffer_tokens, chunk_size: streaming buffer lookahead (tokens) and samples per
            tokenizer call.
        collective: streaming only; a `dynabatch.Collective` (default: ``torch.distributed`` when
            initialized, else a single rank).

    Distribution and loading:
        rank, world_size: default from ``torch.distributed`` when initialized, else 0 / 1.
        num_workers, pin_memory, prefetch_factor, timeout, multiprocessing_context: as for
            ``torch.utils.data.DataLoader``.
    """

    def __init__(
        self,
        data,
        *,
        tokenizer="bytes",
        cost_model: str | CostModel | None = None,
        device: str = "a100-80gb",
        batch_tokens: int | None = None,
        batch_size: int | None = None,
        num_stages: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        timeout: float = 0,
        multiprocessing_context=None,
        collate: str | None = None,
        pad_to_multiple_of: int | None = None,
        seed: int = 0,
        drop_last: bool = False,
        family: str | None = None,
        max_len: int | None = None,
        max_target_len: int | None = None,
        method: str | None = None,
        method_options: dict | None = None,
        plan=None,
        mode: str = "auto",
        index=None,
        index_cache=None,
        vision=None,
        load_pixels: bool = False,
        pixel_mean: tuple = IMAGENET_MEAN,
        pixel_std: tuple = IMAGENET_STD,
        add_bos: bool = False,
        truncation_side: str = "right",
        format_config=None,
        decoder_start_token_id: int | None = None,
        memory_limit: float | None = None,
        schedule: str = "1f1b",
        plan_ahead: int = 2,
        buffer_tokens: int | None = None,
        chunk_size: int = 64,
        collective=None,
        on_error: str = "raise",
        source_options: dict | None = None,
        split: str | None = None,
        cache_tokens: bool | None = None,
        plan_processes: int | None = None,
    ):
        from tokenization import DynamicTiling

        if mode not in ("auto", "indexed", "streaming"):
            raise ValueError(f"mode must be 'auto', 'indexed' or 'streaming', got {mode!r}")
        if collate is not None and collate not in COLLATIONS:
            raise ValueError(f"collate must be one of {COLLATIONS}, got {collate!r}")
        if method is not None and method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
        if num_workers < 0:
            raise ValueError("num_workers must be >= 0")
        self.rank, self.world_size = _resolve_layout(rank, world_size)
        self.num_workers = int(num_workers)
        self.pin_memory = bool(pin_memory)
        self._loader_kwargs = {"timeout": timeout, "multiprocessing_context": multiprocessing_context}
        if self.num_workers > 0 and prefetch_factor is not None:
            self._loader_kwargs["prefetch_factor"] = prefetch_factor
        self.plan_ahead = int(plan_ahead)
        self.on_error = on_error

        # -- replay: the plan decides what was not given explicitly -------------------------------
        self._plan_file = PlanFile(plan) if plan is not None else None
        explicit = {"method": method, "collation": collate, "batch_tokens": batch_tokens, "batch_size": batch_size,
                    "max_len": max_len, "max_target_len": max_target_len, "family": family,
                    "pad_to_multiple_of": pad_to_multiple_of}
        if self._plan_file is not None:
            pf = self._plan_file
            if mode == "streaming":
                raise ValueError("plan= replays a plan by sample id, which needs the indexed mode")
            method = method or pf.method
            collate = collate or pf.collation
            num_stages = pf.num_stages if num_stages is None else num_stages
            family = family or pf.option("family")
            if cost_model is None and "dynabatch.cost_model" in pf.meta:
                import json

                cost_model = CostModel.from_dict(json.loads(pf.meta["dynabatch.cost_model"]))
            max_len = max_len if max_len is not None else pf.option("max_len")
            max_target_len = max_target_len if max_target_len is not None else pf.option("max_target_len")
        self.num_stages = int(num_stages or 1)

        # -- cost model, method and collation -------------------------------------------------------
        if cost_model is None:
            cost_model = "gpt"
        if isinstance(cost_model, str):
            cost_model = CostModel.preset(cost_model, device, num_stages=self.num_stages)
        elif not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a preset name or a CostModel, got {type(cost_model).__name__}")
        if pad_to_multiple_of is not None and int(pad_to_multiple_of) != cost_model.pad_multiple:
            cost_model = copy.copy(cost_model)  # plan with the padding the batches will have
            cost_model.pad_multiple = int(pad_to_multiple_of)
        self.cost = cost_model
        if method is None:
            method = _DEFAULT_METHOD[collate or "padded"]
        collation = method_collation(method)
        if collate is not None and collate != collation:
            raise ValueError(f"method {method!r} plans {collation!r} micro-batches, but collate={collate!r}; "
                             f"use collate={collation!r} or another method")
        self.method, self.collation = method, collation
        self.method_options = dict(method_options or {})
        self.family = family or ("encoder_decoder" if cost_model.kind == "encoder_decoder" else "decoder")
        if self.family not in ("decoder", "encoder_decoder"):
            raise ValueError(f"family must be 'decoder' or 'encoder_decoder', got {self.family!r}")
        self.max_len, self.max_target_len = max_len, max_target_len
        self.seed, self.drop_last = int(seed), bool(drop_last)
        self.memory_limit, self.schedule = memory_limit, schedule
        if self._plan_file is None:
            if (batch_tokens is None) == (batch_size is None):
                raise ValueError("give the global batch size either in tokens (batch_tokens=) or in samples "
                                 "(batch_size=), not both or neither")
            if (batch_tokens or batch_size) <= 0:
                raise ValueError("the global batch size must be positive")
        self.batch_tokens, self.batch_size = batch_tokens, batch_size

        # -- tokenization ---------------------------------------------------------------------------
        if vision is None and cost_model.kind == "vision_language":
            vision = DynamicTiling()
        self.vision, self.load_pixels = vision, bool(load_pixels)
        if load_pixels and vision is None:
            raise ValueError("load_pixels=True needs a vision policy (vision=DynamicTiling() or FixedResolution())")
        self.formatter = make_formatter(tokenizer, self.family, max_len=max_len, max_target_len=max_target_len,
                                        add_bos=add_bos, truncation_side=truncation_side,
                                        format_config=format_config, vision=vision)
        tok = self.formatter.tokenizer
        self.tokenizer = self.formatter.tokenizer
        self.pad_to_multiple_of = int(self.cost.pad_multiple)
        self._collate_cfg = CollateConfig(
            collation=self.collation, family=self.family, pad_id=int(tok.pad_id),
            pad_to_multiple_of=self.pad_to_multiple_of, decoder_start_token_id=decoder_start_token_id,
            vision=vision, load_pixels=self.load_pixels, pixel_mean=tuple(pixel_mean), pixel_std=tuple(pixel_std))

        # -- data and mode --------------------------------------------------------------------------
        self.source = _open_data(data, dict(source_options or {}), split)
        self.dataset = self.source  # torch.utils.data.DataLoader compatibility
        if mode == "auto":
            mode = "indexed" if (self._plan_file is not None or index is not None
                                 or self._map_style(self.source)) else "streaming"
        if mode == "indexed" and not supports_indexed(self.source):
            raise ValueError(f"{type(self.source).__name__} cannot be read by sample id (a mixture, or a source "
                             "without random access or row counts); use mode='streaming'")
        self.mode = "replay" if self._plan_file is not None else mode
        self.epoch = 0
        self._resume: dict | None = None  # where the next iteration starts (internal form)
        self._loaded: dict | None = None  # the state last loaded, until iteration starts
        self._pos: dict | None = None  # live position while iterating
        self._closers: list = []
        self.stats = {"steps": 0, "plan_time_s": 0.0, "load_time_s": 0.0, "wait_time_s": 0.0, "step_time_s": 0.0}
        self.cache_tokens = cache_tokens
        if plan_processes is not None and int(plan_processes) < 0:
            raise ValueError("plan_processes must be >= 0")
        self.plan_processes = plan_processes
        self.token_cache: TokenCache | None = None
        if self.mode in ("indexed", "replay"):
            self._setup_indexed(index, index_cache, explicit)
        else:
            self._setup_streaming(collective, buffer_tokens, chunk_size)

    # ------------------------------------------------------------------------------------------------
    @staticmethod
    def _map_style(source) -> bool:
        import loaders
        from loaders._arrow import ArrowIPCReader, ParquetReader
        from loaders._hf import HFDatasetReader

        return isinstance(source, loaders.Source) and isinstance(
            source._reader, (ParquetReader, ArrowIPCReader, HFDatasetReader))

    def _setup_indexed(self, index, index_cache, explicit) -> None:
        settings = index_settings(self.formatter, self.vision, self.source)
        text = self.vision is None
        want = text and self.cache_tokens is not False
        if index is None:
            index = self._scan_index(index_cache, settings, keep_tokens=want)
        table = read_index_table(index)
        self.index = load_index(table, self.family, self.max_len, self.max_target_len,
                                bos=int(self.formatter.config.add_bos))
        if self.index.settings is not None:
            theirs = {k: v for k, v in self.index.settings.items() if k in settings and k != "source_fingerprint"}
            diff = {k: (v, settings[k]) for k, v in theirs.items() if settings[k] != v}
            if diff:
                logger.warning("the length index was built with other tokenization settings %s (index vs loader); "
                               "its token counts may not match the batches", diff)
        if self._plan_file is not None:
            self._plan_file.check(fingerprints=self.index.fingerprints, world_size=self.world_size,
                                  num_stages=self.num_stages, explicit=explicit, index=self.index)
            self._planner = ReplayPlanner(self._plan_file, self.index, self.cost, self.max_len, self.max_target_len)
        else:
            self._planner = IndexedPlanner(self.index, self.cost, PlanOptions(
                global_batch_tokens=self.batch_tokens, global_batch_size=self.batch_size, max_len=self.max_len,
                max_target_len=self.max_target_len, method=self.method, method_options=self.method_options,
                num_stages=self.num_stages, num_ranks=self.world_size, schedule=self.schedule,
                memory_limit=self.memory_limit, seed=self.seed, drop_last=self.drop_last))
        if self.cache_tokens and not text:
            logger.warning("cache_tokens=True is ignored with a vision policy (images are loaded per step)")
        if want and self.cache_tokens is None:
            need = token_cache_bytes(self.index.shapes, self.family)
            if need > TOKEN_CACHE_BUDGET:
                want = False
                logger.info("token cache off: the ids of %d samples need up to %.1f GiB (budget %.1f GiB); pass "
                            "cache_tokens=True to keep them anyway", len(self.index), need / 2**30,
                            TOKEN_CACHE_BUDGET / 2**30)
        if want:
            self.token_cache = self._token_cache(table, settings)
        self._access = open_access(self.source)
        self._steps = IndexedSteps(self._planner, self._access, self.formatter, self._collate_cfg, rank=self.rank,
                                   vision=self.vision, load_pixels=self.load_pixels, on_error=self.on_error,
                                   plan_ahead=self.plan_ahead, exact_labels=self.index.exact_labels,
                                   tokens=self.token_cache,
                                   plan_processes=self._plan_processes())
        self._identity = {
            "index": self.index.fingerprint, "method": self.method, "collation": self.collation,
            "batch_tokens": self.batch_tokens, "batch_size": self.batch_size, "seed": self.seed,
            "drop_last": self.drop_last, "max_len": self.max_len, "max_target_len": self.max_target_len,
            "num_stages": self.num_stages,
            "plan": None if self._plan_file is None else self._plan_file.meta.get("dynabatch.dataset_fingerprint"),
        }

    def _plan_processes(self) -> int:
        n = int(self.plan_processes or 0)
        if n and (self.num_workers or not fork_available()):
            return 0  # workers plan in their own thread; no fork (or one CPU): plan in a thread
        return n

    def _token_cache(self, table, settings) -> TokenCache | None:
        """The token cache: from the index table's token columns when they were made with these
        settings, else from one tokenization pass over the data."""
        import json

        raw = (table.schema.metadata or {}).get(TOKEN_SETTINGS_KEY)
        if raw is not None and json.loads(raw) == settings:
            tc = TokenCache.from_table(self.index, table, self.family)
            if tc is not None:
                return tc
        t0 = time.perf_counter()
        tc = TokenCache.from_encoded(self.index, encode_all(self.source, self.formatter, on_error=self.on_error),
                                     self.family)
        if tc is None:
            logger.warning("token cache off: the data lacks samples of the length index (stale index?)")
        else:
            logger.info("tokenized %d samples into the token cache (%.1f MiB) in %.1f s", len(self.index),
                        tc.nbytes / 2**20, time.perf_counter() - t0)
        return tc

    def _scan_index(self, index_cache, settings, keep_tokens: bool = False):
        if index_cache is not None and os.path.exists(index_cache):
            table = read_index_table(index_cache)
            raw = (table.schema.metadata or {}).get(b"dynabatch.index_settings")
            import json

            if raw is not None and json.loads(raw) == settings:
                return table
            logger.info("index cache %s was built from other data or settings: rebuilding it", index_cache)
        t0 = time.perf_counter()
        table = scan_source(self.source, self.formatter, vision=self.vision, on_error=self.on_error,
                            keep_tokens=keep_tokens,
                            token_budget=TOKEN_CACHE_BUDGET if self.cache_tokens is None else None)
        logger.info("built the length index of %d samples in %.1f s (one tokenization pass; pass index= or "
                    "index_cache= to reuse it)", table.num_rows, time.perf_counter() - t0)
        if index_cache is not None:
            write_index_table(table, index_cache)
        return table

    def _setup_streaming(self, collective, buffer_tokens, chunk_size) -> None:
        import loaders

        if collective is None:
            import torch.distributed as dist

            if self.world_size == 1:
                collective = LocalCollective()
            elif dist.is_available() and dist.is_initialized():
                collective = TorchCollective()
            else:
                raise ValueError(f"the streaming mode with world_size={self.world_size} needs torch.distributed "
                                 "(init_process_group) or an explicit collective=")
        if collective.world_size != self.world_size or collective.rank != self.rank:
            raise ValueError(f"the collective is rank {collective.rank} of {collective.world_size}, the loader rank "
                             f"{self.rank} of {self.world_size}")
        self.collective = collective
        self.chunk_size = int(chunk_size)
        self._stream_cfg = StreamConfig(
            cost=self.cost, world_size=self.world_size, rank=self.rank, num_stages=self.num_stages,
            batch_tokens=self.batch_tokens, batch_size=self.batch_size, method=self.method, max_len=self.max_len,
            max_target_len=self.max_target_len, method_options=self.method_options, memory_limit=self.memory_limit,
            schedule=self.schedule, drop_last=self.drop_last, buffer_tokens=buffer_tokens)
        src = self.source
        if isinstance(src, loaders.Mixture):
            fp = {n: c._reader.fingerprint() for n, c in src._children.items()}
            self._mixture_offsets = {n: [src._offsets[n], src._offsets[n] + src._children[n].num_shards]
                                     for n in src.names}
            random_access = all(getattr(c._reader, "random_access", True) for c in src._children.values())
        else:
            fp = src._reader.fingerprint()
            self._mixture_offsets = None
            random_access = getattr(src._reader, "random_access", True)
        self._random_access = bool(random_access)
        self._identity = {
            "source": fp, "method": self.method, "collation": self.collation, "batch_tokens": self.batch_tokens,
            "batch_size": self.batch_size, "drop_last": self.drop_last, "max_len": self.max_len,
            "max_target_len": self.max_target_len, "num_stages": self.num_stages, "chunk_size": self.chunk_size,
            "buffer_tokens": buffer_tokens,
        }

    # -- torch.utils.data.DataLoader surface ---------------------------------------------------------
    def __len__(self) -> int:
        """Steps of the current epoch (indexed and replay modes); streaming raises TypeError."""
        if self.mode == "streaming":
            raise TypeError("len() is unknown in the streaming mode (the number of steps depends on the data "
                            "each rank reads); use the indexed mode for a known length")
        return self._planner.num_steps(self.epoch)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration runs (a pending resume of another epoch is dropped)."""
        epoch = int(epoch)
        if self._resume is not None and self._resume.get("epoch") != epoch:
            logger.info("set_epoch(%d) drops the loaded state of epoch %d", epoch, self._resume.get("epoch"))
            self._resume = None
        self.epoch = epoch

    def __iter__(self) -> Iterator[dict]:
        for ready, skip in self._ready_steps():
            for i in range(skip, len(ready.batches)):
                self._pos["microbatch"] = i + 1
                self._pos["consumed"].append(ready.step.microbatches[i].sample_ids)
                if i + 1 == len(ready.batches):
                    self._step_done(ready)
                yield self._pin(ready.batches[i])

    def steps(self) -> Iterator[list[dict]]:
        """Whole steps: the list of this rank's micro-batches of each step (gradient accumulation).

        A step counts as consumed for `state_dict` once it is yielded.
        """
        for ready, skip in self._ready_steps():
            for mb in ready.step.microbatches[skip:]:
                self._pos["consumed"].append(mb.sample_ids)
            self._pos["microbatch"] = len(ready.batches)
            self._step_done(ready)
            yield [self._pin(b) for b in ready.batches[skip:]]

    def _pin(self, batch: dict) -> dict:
        # indexed workers pin in the torch DataLoader already
        workers_pin = self.mode != "streaming" and self.num_workers > 0
        if workers_pin or not (self.pin_memory and torch.cuda.is_available()):
            return batch
        return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    # -- iteration core -------------------------------------------------------------------------------
    def _ready_steps(self):
        """(ReadyStep, micro-batches to skip) of the current epoch, with position bookkeeping."""
        self.close()
        self._loaded = None
        r = self._resume or {}
        if self.mode == "streaming":
            self._epoch_start_step = int(r.get("step", getattr(self, "_epoch_start_step", 0)))
        else:
            self._epoch_start_step = self._planner.first_step(self.epoch)
        gen = self._indexed_steps() if self.mode in ("indexed", "replay") else self._streaming_steps()
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
                self._record(ready, now - t0, now - last)
                last = now
                yield ready, skip
        finally:
            gen.close()
            if finished:
                self._epoch_done()
            else:
                self.close()

    def _record(self, ready: ReadyStep, wait: float, interval: float) -> None:
        st = self.stats
        st["steps"] += 1
        st["plan_time_s"] += ready.step.plan_time_s
        st["load_time_s"] += ready.load_time_s
        if st["steps"] > 1:  # the first step also pays for start-up (workers, index, JIT)
            st["wait_time_s"] += wait
            st["step_time_s"] += interval
        logger.debug("rank %d step %d: %d micro-batches, plan %.1f ms, load %.1f ms, waited %.1f ms of %.1f ms",
                     self.rank, ready.step.step, ready.step.num_microbatches, ready.step.plan_time_s * 1e3,
                     ready.load_time_s * 1e3, wait * 1e3, interval * 1e3)

    def _epoch_done(self) -> None:
        st = self.stats
        n = st["steps"]
        if n:
            later = max(n - 1, 1)
            logger.info("rank %d epoch %d done: %d steps, planning %.1f ms/step, loading %.1f ms/step, the training "
                        "loop waited %.1f ms of %.1f ms per step", self.rank, self.epoch, n,
                        1e3 * st["plan_time_s"] / n, 1e3 * st["load_time_s"] / n,
                        1e3 * st["wait_time_s"] / later, 1e3 * st["step_time_s"] / later)
            busy = (st["step_time_s"] - st["wait_time_s"]) / later  # seconds the loop itself spent per step
            if n >= 5 and busy >= 5e-3 and st["wait_time_s"] > 0.2 * st["step_time_s"]:
                logger.warning("rank %d: the training loop waited for data %.0f%% of the time; raise num_workers or "
                               "plan_ahead", self.rank, 100 * st["wait_time_s"] / st["step_time_s"])
        next_step = (self._pos or {}).get("next_step", self._epoch_start_step)
        self.epoch += 1
        self._pos = None
        self._resume = {"epoch": self.epoch, "step": next_step, "fresh": True}
        self.last_epoch_stats = dict(st)
        for k in st:
            st[k] = 0 if k == "steps" else 0.0

    def _step_done(self, ready: ReadyStep) -> None:
        self._pos["done"] = True
        self._pos["next_step"] = ready.step.step + 1

    def close(self, wait: bool = True) -> None:
        """Stop background planning and DataLoader workers of an unfinished iteration (``wait``: up
        to 10 s for the planning thread to finish its current step)."""
        for fn in self._closers:
            try:
                fn(wait)
            except Exception:  # closing is best effort
                pass
        self._closers = []

    def __del__(self):
        try:
            self.close(wait=False)
        except Exception:
            pass

    # -- indexed / replay --------------------------------------------------------------------------
    def _indexed_steps(self):
        epoch = self.epoch
        r = self._resume or {}
        if r.get("epoch", epoch) != epoch:
            r = {}
        start = int(r.get("step_in_epoch", 0)) if not r.get("fresh") else 0
        exclude = np.asarray(r.get("exclude", []), np.int64)
        skip = int(r.get("microbatch", 0)) if not r.get("fresh") else 0
        self._resume = None
        n = self._planner.num_steps(epoch)
        self._steps.configure(epoch, start, exclude if len(exclude) else None)
        if self.num_workers == 0:
            it = self._steps.iter_worker(0, 1)
            self._closers.append(lambda wait: it.close())
        else:
            from torch.utils.data import DataLoader as TorchDataLoader

            dl = TorchDataLoader(WorkerSplitDataset(self._steps), batch_size=None, num_workers=self.num_workers,
                                 collate_fn=_identity, pin_memory=self.pin_memory and torch.cuda.is_available(),
                                 **self._loader_kwargs)
            it = iter(dl)
            self._closers.append(lambda wait: getattr(it, "_shutdown_workers", lambda: None)())
        pending: dict[int, ReadyStep] = {}
        expect = start
        base_exclude = exclude
        for ready in it:
            ready = ready.unpacked()
            pending[ready.step.step_in_epoch] = ready
            while expect in pending:
                rd = pending.pop(expect)
                k = expect
                pos = {"epoch": epoch, "step_in_epoch": k, "step": rd.step.step, "microbatch": skip if k == start else 0,
                       "consumed": [], "exclude": base_exclude if k == start else np.zeros(0, np.int64),
                       "num_steps": n, "next_step": rd.step.step, "done": False}
                if k == start and skip:
                    pos["consumed"] = [mb.sample_ids for mb in rd.step.microbatches[:skip]]
                yield rd, (skip if k == start else 0), pos
                expect += 1
        if expect < n:
            raise RuntimeError(f"the DataLoader workers delivered steps up to {expect} of {n}")

    # -- streaming --------------------------------------------------------------------------------
    def _streaming_steps(self):
        epoch = self.epoch
        r = self._resume or {}
        if r.get("epoch", epoch) != epoch:
            r = {}
        self._resume = None
        fresh = not r or r.get("fresh")
        step = int(r.get("step", 0))
        step_in_epoch = 0 if fresh else int(r.get("step_in_epoch", 0))
        skip = 0
        producer_kw = dict(rank=self.rank, world_size=self.world_size, num_workers=self.num_workers, epoch=epoch,
                           vision=self.vision, keep_images=self.load_pixels, chunk_size=self.chunk_size,
                           on_error=self.on_error)
        buf = StreamBuffer(self.cost, self.family, self.max_len, self.max_target_len)
        loader_kwargs = {k: v for k, v in self._loader_kwargs.items() if v is not None}
        if not fresh and r.get("global") is not None:
            producer = ChunkProducer(self.source, self.formatter, global_state=r["global"], **producer_kw)
            feed = ChunkFeed(producer, loader_kwargs=loader_kwargs)
        elif not fresh:
            slots = {int(k): v for k, v in r["slots"].items()}
            producer = ChunkProducer(self.source, self.formatter, slot_states=slots, **producer_kw)
            feed = ChunkFeed(producer, rr=r["rr"], exhausted=r["exhausted"], slot_states=slots,
                             loader_kwargs=loader_kwargs)
            buf.extend(self._restore_buffer(r))
            skip = int(r.get("microbatch", 0))
        else:
            producer = ChunkProducer(self.source, self.formatter, **producer_kw)
            feed = ChunkFeed(producer, loader_kwargs=loader_kwargs)
        self._closers.append(lambda wait: feed.close())
        planner = StreamingPlanner(self._stream_cfg, self.collective, self._collate_cfg)
        extra = None
        if not self._random_access:
            extra = lambda b: {"buffer_encoded": lstate.encoded_to_json(b.items)}  # noqa: E731
        ahead = Ahead(lambda: planner.run(feed, buf, epoch=epoch, step=step, step_in_epoch=step_in_epoch,
                                          snapshot_extra=extra), self.plan_ahead, name=f"dynabatch-stream-r{self.rank}",
                      drain=True)  # never abandon a collective the other ranks' planners are in
        self._closers.insert(0, lambda wait: ahead.close(wait=10.0 if wait else 0.0))
        first = True
        for ready in ahead:
            k_skip = skip if first else 0
            pos = {"epoch": epoch, "step_in_epoch": ready.step.step_in_epoch, "step": ready.step.step,
                   "microbatch": k_skip, "consumed": [mb.sample_ids for mb in ready.step.microbatches[:k_skip]],
                   "snapshot": ready.snapshot, "next_step": ready.step.step, "done": False}
            first = False
            yield ready, k_skip, pos
        feed.close()

    def _restore_buffer(self, r: dict):
        if r.get("buffer_encoded") is not None:
            return lstate.encoded_from_json(r["buffer_encoded"])
        ids = np.asarray(r.get("buffer_ids", []), np.int64)
        if not len(ids):
            return []
        from .steps import encode_samples

        samples = open_access(self.source, generic=True).read(ids)
        toks = encode_samples(samples, self.formatter, self.vision, self.load_pixels, on_error="raise")
        if [t.sample_id for t in toks] != ids.tolist():
            raise lstate.LoaderStateError("buffered samples changed since the checkpoint (did the data change?)")
        return toks

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Exact position of this rank: everything yielded so far counts as consumed.

        Cheap: positions and ids (plan mode, step, micro-batch; streaming: source positions and
        buffered ids). Load it with `load_state_dict` on the same rank; to resume on another world
        size, collect every rank's state and load the list (or `DataLoader.merge_states` of it).
        """
        mode = self.mode
        if self._pos is None:
            if self._loaded is not None:
                return copy.deepcopy(self._loaded)
            r = self._resume or {"epoch": self.epoch, "step": 0}
            return lstate.base_state(mode, self._identity, world_size=self.world_size, rank=self.rank,
                                     num_workers=self.num_workers, epoch=r["epoch"], step=r.get("step", 0),
                                     step_in_epoch=0, microbatch=0, consumed=[], exclude=[], fresh=True,
                                     mixture_offsets=getattr(self, "_mixture_offsets", None))
        p = self._pos
        consumed = lstate._ids(np.concatenate(p["consumed"])) if p["consumed"] else []
        if mode in ("indexed", "replay"):
            k, m = p["step_in_epoch"], p["microbatch"]
            exclude = lstate._ids(p["exclude"])
            done = p["done"]
            if done:  # the whole step was yielded: the position is the start of the next step
                k, m, consumed, exclude = k + 1, 0, [], []
                if k >= p["num_steps"]:
                    return lstate.base_state(mode, self._identity, world_size=self.world_size, rank=self.rank,
                                             num_workers=self.num_workers, epoch=p["epoch"] + 1, step=p["next_step"],
                                             step_in_epoch=0, microbatch=0, consumed=[], exclude=[], fresh=True)
            return lstate.base_state(mode, self._identity, world_size=self.world_size, rank=self.rank,
                                     num_workers=self.num_workers, epoch=p["epoch"], step_in_epoch=k,
                                     step=p["step"] + (1 if done else 0), microbatch=m, consumed=consumed,
                                     exclude=exclude)
        snap = p["snapshot"]
        out = lstate.base_state(
            mode, self._identity, world_size=self.world_size, rank=self.rank, num_workers=self.num_workers,
            epoch=p["epoch"], step=p["step"], step_in_epoch=p["step_in_epoch"], microbatch=p["microbatch"],
            consumed=consumed, slots={str(k): v for k, v in snap["slots"].items()}, rr=snap["rr"],
            exhausted=snap["exhausted"], buffer_ids=lstate._ids(snap["buffer_ids"]),
            mixture_offsets=self._mixture_offsets)
        if "buffer_encoded" in snap:
            out["buffer_encoded"] = snap["buffer_encoded"]
        return copy.deepcopy(out)

    @staticmethod
    def merge_states(states: list[dict]) -> dict:
        """Combine every rank's `state_dict` into one state that loads on any world size."""
        return lstate.merge_states(states)

    def load_state_dict(self, state) -> None:
        """Resume from `state_dict` of this rank (same world size), or from the list of every rank's
        states / their `merge_states` (any world size: nothing is lost or repeated)."""
        if isinstance(state, (list, tuple)):
            state = lstate.merge_states(list(state)) if len(state) > 1 or self.world_size != 1 else state[0]
        lstate.check_state(state, self.mode, self._identity)
        state = copy.deepcopy(state)
        self.close()
        self._pos = None
        self._loaded = copy.deepcopy(state)
        self.epoch = int(state["epoch"])
        if state.get("fresh"):
            self._resume = {"epoch": self.epoch, "step": int(state.get("step", 0)), "fresh": True}
            return
        if self.mode in ("indexed", "replay"):
            self._resume = self._indexed_resume(state)
        else:
            self._resume = self._streaming_resume(state)

    def _indexed_resume(self, s: dict) -> dict:
        k = int(s["step_in_epoch"])
        if s.get("merged"):
            mbs = set(s["microbatch"])
            if s["from_world_size"] == self.world_size and len(mbs) == 1:
                return {"epoch": s["epoch"], "step": s["step"], "step_in_epoch": k, "microbatch": mbs.pop(),
                        "exclude": s["exclude_before"]}
            if self.mode == "replay" and s["exclude"]:
                raise lstate.LoaderStateError("a replayed plan cannot resume a half-done step on another world size")
            return self._skip_empty({"epoch": s["epoch"], "step": s["step"], "step_in_epoch": k, "microbatch": 0,
                                     "exclude": s["exclude"]})
        m = int(s.get("microbatch", 0))
        if s["world_size"] != self.world_size or s["rank"] != self.rank:
            if m or s.get("exclude"):
                raise lstate.LoaderStateError(
                    f"this state was taken in the middle of step {s['step']} on rank {s['rank']} of {s['world_size']}; "
                    f"to resume it on rank {self.rank} of {self.world_size}, load the list of every rank's states")
        return {"epoch": s["epoch"], "step": s["step"], "step_in_epoch": k, "microbatch": m,
                "exclude": s.get("exclude", [])}

    def _skip_empty(self, r: dict) -> dict:
        """A half-done step whose samples were all consumed is skipped."""
        epoch, k = r["epoch"], r["step_in_epoch"]
        if not r["exclude"] or self.mode == "replay":
            return r
        pos = self._planner.batches(epoch)[k]
        left = ~np.isin(self.index.shapes.sample_id[pos], np.asarray(r["exclude"], np.int64))
        if left.any():
            return r
        if k + 1 >= self._planner.num_steps(epoch):
            return {"epoch": epoch + 1, "step": r["step"] + 1, "fresh": True}
        return {"epoch": epoch, "step": r["step"] + 1, "step_in_epoch": k + 1, "microbatch": 0, "exclude": []}

    def _streaming_resume(self, s: dict) -> dict:
        if s.get("merged"):
            # A merged streaming state always re-deals the remaining data over the new layout.
            partial = any(s["microbatch"])
            return {"epoch": s["epoch"], "step": s["step"] + (1 if partial else 0),
                    "step_in_epoch": s["step_in_epoch"] + (1 if partial else 0), "global": s["global"]}
        layout = (s["world_size"], s["rank"], s["num_workers"])
        if layout != (self.world_size, self.rank, self.num_workers):
            raise lstate.LoaderStateError(
                f"this streaming state belongs to rank {s['rank']} of {s['world_size']} with num_workers="
                f"{s['num_workers']}; this loader is rank {self.rank} of {self.world_size} with num_workers="
                f"{self.num_workers}: to resume on another layout, load the list of every rank's states")
        return s

    def __repr__(self) -> str:
        return (f"DataLoader(mode={self.mode!r}, method={self.method!r}, collation={self.collation!r}, "
                f"rank={self.rank}/{self.world_size}, epoch={self.epoch})")
