"""Indexed mode: every rank computes the same global plan of each step from a length index and
reads its own samples by ``sample_id`` (see `dynabatch.loader.modes.indexed.steps`); `IndexedMode` is its
stateful iterator, `open_index` builds (or reads) the length index and the token cache.

Mode state (nested in the DataLoader's under ``"indexed"``, or ``"replay"``): ``identity``,
``layout``, ``epoch``, ``step``, ``step_in_epoch``, ``microbatch``, ``consumed``, ``exclude`` (ids
of the step consumed before an earlier resume on another world size) and ``fresh``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import warnings
from collections import Counter
from dataclasses import replace

import numpy as np
import torch
from tokenization import scan_stats, tokenizer_fingerprint

from ... import state as lstate
from ...ahead import fork_available
from ....index import LengthIndexError, TokenFileWriter, encode_to_file
from ....index.token_file import private_token_path
from ....index.scan import LOADER_ERRORS_KEY
from .steps import (TOKEN_SETTINGS_KEY, IndexedPlanner, IndexedSteps, TokenCache, WorkerSplitDataset,
                             index_settings, load_index, read_index_table, scan_source, token_cache_bytes,
                             write_index_table)
from ...processes import WorkerInit, collate_as_is, start_workers, warm_kernels
from ....core.plan.steps import oversized_samples
from ...records import ReadyStep
from ..base import Context, Mode

logger = logging.getLogger("dynabatch")


class VersionedPlanner:
    """A planner (`IndexedPlanner` / `ReplayPlanner` interface) whose step plans also carry the cost
    model's ``version`` at planning time."""

    def __init__(self, inner, cost):
        self.inner, self.cost = inner, cost
        self.index = inner.index

    def __getattr__(self, name):
        if name.startswith("__") or name == "inner":  # unpickling: before __dict__ is filled
            raise AttributeError(name)
        return getattr(self.inner, name)

    def plan(self, epoch: int, k: int, rank: int, exclude=None):
        version = int(getattr(self.cost, "version", 0))
        return replace(self.inner.plan(epoch, k, rank, exclude), cost_version=version)


def open_index(ctx: Context, index, index_cache):
    """(length index, its table, token cache or None) of the loader's data (scans it without ``index``).

    The token cache is a file read with pread (`dynabatch.index.token_file`): ``<index_cache>.tokens``
    beside an index cache (kept and checked on the next run), else a private file in the cache
    folder (`token_cache_folder`) deleted when the loader is (or, after a kill, at the next start;
    the folder's size is bounded: `dynabatch.index.token_file.private_token_path`); the scan writes
    it as it goes."""
    s = ctx.settings
    settings = index_settings(ctx.formatter, ctx.vision, ctx.source)
    text = ctx.vision is None
    want = text and s.cache_tokens is not False
    path = f"{index_cache}.tokens" if index_cache is not None else None
    owned, room = index_cache is None, None  # room: bytes the private folder's bound leaves
    meta = {"settings": settings, "tokenizer": tokenizer_fingerprint(ctx.formatter.tokenizer)} if want else None
    if want and path is None:  # reclaims the files of killed loaders; TokenCacheFull when over the bound
        path, room = private_token_path(token_cache_folder())
    if index is None:
        index = _scan_index(ctx, index_cache, settings, path if want else None, meta, room)
    table = read_index_table(index)
    o = ctx.options
    idx = load_index(table, ctx.family, o.max_len, o.max_target_len, bos=int(ctx.formatter.config.add_bos))
    # made from these data files with this tokenizer (when the index recorded them), else refused
    idx.check_origin(ctx.source, ctx.formatter.tokenizer, str(index) if isinstance(index, (str, os.PathLike)) else None)
    if idx.settings is not None:
        theirs = {k: v for k, v in idx.settings.items() if k in settings and k != "source_fingerprint"}
        diff = {k: (v, settings[k]) for k, v in theirs.items() if settings[k] != v}
        if diff:
            logger.warning("the length index was built with other tokenization settings %s (index vs loader); "
                           "its token counts may not match the batches", diff)
    if s.cache_tokens and not text:
        logger.warning("cache_tokens=True is ignored with a vision policy (images are loaded per step)")
    if want and s.cache_tokens is None and not os.path.exists(path):
        folder = os.path.dirname(os.path.abspath(path))
        need, free = token_cache_bytes(idx.shapes, ctx.family), shutil.disk_usage(folder).free
        if need > free:
            want = False
            logger.info("token cache off: the ids of %d samples need up to %.1f GiB on disk, %s has %.1f GiB free; "
                        "pass DataSource(cache_tokens=True) to keep them anyway", len(idx), need / 2**30, folder, free / 2**30)
    return idx, table, (_token_cache(ctx, idx, table, path, meta, owned, room) if want else None)


def token_cache_folder() -> str:
    """Folder of the loaders' private token files: ``$DYNABATCH_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/dynabatch`` (``~/.cache/dynabatch``); on disk, not a RAM-backed /tmp."""
    folder = os.environ.get("DYNABATCH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "dynabatch")
    os.makedirs(folder, exist_ok=True)
    return folder


def _token_cache(ctx: Context, index, table, path: str, meta: dict, owned: bool,
                 room: int | None) -> TokenCache | None:
    """From the index table's token columns when made with these settings (held in memory by the
    caller already), else the token file ``path`` (written by the scan just now, or by an earlier run
    beside the index cache), else one tokenization pass into it."""
    raw = (table.schema.metadata or {}).get(TOKEN_SETTINGS_KEY)
    if raw is not None and json.loads(raw) == meta["settings"]:
        tc = TokenCache.from_table(index, table, ctx.family)
        if tc is not None:
            return tc
    args = dict(settings=meta["settings"], tokenizer=meta["tokenizer"], owned=owned)
    if os.path.exists(path):
        tc = TokenCache.from_file(index, path, **args)
        if tc is not None:
            return tc
        logger.info("token cache %s lacks samples of the length index: rebuilding it", path)
    t0 = time.perf_counter()
    encode_to_file(ctx.source, ctx.formatter, path, meta, on_error=ctx.settings.on_error,
                   progress=ctx.settings.progress, max_bytes=room)
    tc = TokenCache.from_file(index, path, **args)
    if tc is None:
        logger.warning("token cache off: the data lacks samples of the length index (stale index?)")
    else:
        logger.info("tokenized %d samples into the token cache %s (%.1f MiB on disk) in %.1f s", len(index), path,
                    tc.nbytes / 2**20, time.perf_counter() - t0)
    return tc


def _scan_index(ctx: Context, index_cache, settings, token_path: str | None, meta: dict | None,
                room: int | None = None):
    """The index table: the index cache when made with ``settings``, else a scan (written to the
    index cache; with ``token_path`` the scan also writes the token file there, of at most ``room`` bytes)."""
    if index_cache is not None and os.path.exists(index_cache):
        try:
            table = read_index_table(index_cache)
        except LengthIndexError as e:  # a cache edited or damaged since it was written is made again
            logger.warning("%s: rebuilding the index cache", e)
            table = None
        raw = (table.schema.metadata or {}).get(b"dynabatch.index_settings") if table is not None else None
        if raw is not None and json.loads(raw) == settings:
            return table
        logger.info("index cache %s was built from other data or settings: rebuilding it", index_cache)
    t0 = time.perf_counter()
    writer = TokenFileWriter(token_path, room) if token_path is not None else None
    try:
        table = scan_source(ctx.source, ctx.formatter, vision=ctx.vision, on_error=ctx.settings.on_error,
                            progress=ctx.settings.progress, token_sink=writer.add if writer else None)
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
    if writer is not None:
        writer.finish(meta)
    elif index_cache is not None and os.path.exists(f"{index_cache}.tokens"):
        os.unlink(f"{index_cache}.tokens")  # the ids of the data the rebuilt index replaces
    logger.info("built the length index of %d samples in %.1f s (one tokenization pass; pass index= or "
                "index_cache= of DataSource to reuse it)", table.num_rows, time.perf_counter() - t0)
    if index_cache is not None:
        write_index_table(table, index_cache)
    return table


class IndexedMode(Mode):
    """Steps of the indexed mode (``planner``: an `IndexedPlanner`, or a `ReplayPlanner`)."""

    name = "indexed"

    def __init__(self, ctx: Context, index, planner, token_cache=None, plan_fingerprint=None):
        import loaders

        o = ctx.options
        identity = {"index": index.fingerprint, "method": o.method, "collation": o.collation,
                    "global_batch_tokens": o.global_batch_tokens, "global_batch_size": o.global_batch_size,
                    "seed": o.seed, "drop_last": o.drop_last, "max_len": o.max_len,
                    "max_target_len": o.max_target_len, "num_stages": o.num_stages, "plan": plan_fingerprint}
        super().__init__(ctx, identity)
        self.index, self.token_cache = index, token_cache
        self.planner = VersionedPlanner(planner, ctx.cost)
        s = ctx.settings
        n = int(s.plan_processes or 0)
        if n and (ctx.num_workers or not fork_available()):
            n = 0  # workers plan in their own thread; no fork (or one CPU): plan in a thread
        self.steps = IndexedSteps(self.planner, loaders.open_access(ctx.source), ctx.formatter, ctx.collate,
                                  rank=ctx.rank, vision=ctx.vision, load_pixels=s.load_pixels, on_error=s.on_error,
                                  plan_ahead=s.plan_ahead, exact_labels=index.exact_labels, tokens=token_cache,
                                  plan_processes=n)

    def num_steps(self, epoch: int | None = None) -> int:
        return self.planner.num_steps(self.epoch if epoch is None else epoch)

    def _first_step(self) -> int:
        return self.planner.first_step(self.epoch)

    def _generate(self):
        epoch, s = self.epoch, self.ctx.settings
        r = self._resume or {}
        if r.get("epoch", epoch) != epoch:
            r = {}
        start = int(r.get("step_in_epoch", 0)) if not r.get("fresh") else 0
        exclude = np.asarray(r.get("exclude", []), np.int64)
        skip = int(r.get("microbatch", 0)) if not r.get("fresh") else 0
        self._resume = None
        n = self.planner.num_steps(epoch)
        self.steps.configure(epoch, start, exclude if len(exclude) else None)
        if self.ctx.num_workers or self.steps.plan_processes:
            # the children inherit every planning kernel compiled: none compiles (or forks) mid-compile
            warm_kernels(self.ctx.cost, self.ctx.options)
        if self.ctx.num_workers == 0:
            it = self.steps.iter_worker(0, 1)
            self._closers.append(lambda wait: it.close())
        else:
            from torch.utils.data import DataLoader as TorchDataLoader

            kw = dict(s.loader_kwargs)
            kw["worker_init_fn"] = WorkerInit(kw.get("worker_init_fn"))  # workers die with this process
            dl = TorchDataLoader(WorkerSplitDataset(self.steps), batch_size=None, num_workers=self.ctx.num_workers,
                                 collate_fn=collate_as_is, pin_memory=s.pin_memory and torch.cuda.is_available(), **kw)
            it = start_workers(lambda: iter(dl))  # forked while no thread compiles a kernel
            self._closers.append(lambda wait: getattr(it, "_shutdown_workers", lambda: None)())
        pending: dict[int, ReadyStep] = {}
        expect = start
        for ready in it:
            ready = ready.unpacked()
            pending[ready.step.step_in_epoch] = ready
            while expect in pending:
                rd = pending.pop(expect)
                first = expect == start
                pos = {"epoch": epoch, "step_in_epoch": expect, "step": rd.step.step, "microbatch": skip if first else 0,
                       "consumed": [mb.sample_ids for mb in rd.step.microbatches[:skip]] if first else [],
                       "exclude": exclude if first else np.zeros(0, np.int64), "num_steps": n,
                       "next_step": rd.step.step, "done": False}
                yield rd, (skip if first else 0), pos
                expect += 1
        if expect < n:
            raise RuntimeError(f"the DataLoader workers delivered steps up to {expect} of {n}")

    def _position_state(self, p: dict, consumed: list) -> dict:
        k, m, exclude, done = p["step_in_epoch"], p["microbatch"], lstate._ids(p["exclude"]), p["done"]
        if done:  # the whole step was yielded: the position is the start of the next step
            k, m, consumed, exclude = k + 1, 0, [], []
            if k >= p["num_steps"]:
                return self._fresh_state(p["epoch"] + 1, p["next_step"])
        return self._state(epoch=p["epoch"], step=p["step"] + (1 if done else 0), step_in_epoch=k, microbatch=m,
                           consumed=consumed, exclude=exclude)

    def _resume_from(self, s: dict) -> dict:
        k = int(s["step_in_epoch"])
        if s.get("merged"):
            mbs = set(s["microbatch"])
            if s["from_world_size"] == self.ctx.world_size and len(mbs) == 1:
                return {"epoch": s["epoch"], "step": s["step"], "step_in_epoch": k, "microbatch": mbs.pop(),
                        "exclude": s["exclude_before"]}
            if self.name == "replay" and s["exclude"]:
                raise lstate.LoaderStateError("a replayed plan cannot resume a half-done step on another world size")
            return self._skip_empty({"epoch": s["epoch"], "step": s["step"], "step_in_epoch": k, "microbatch": 0,
                                     "exclude": s["exclude"]})
        m = int(s.get("microbatch", 0))
        L = s["layout"]
        if (L["world_size"], L["rank"]) != (self.ctx.world_size, self.ctx.rank) and (m or s.get("exclude")):
            raise lstate.LoaderStateError(
                f"this state was taken in the middle of step {s['step']} on rank {L['rank']} of {L['world_size']}; "
                f"to resume it on rank {self.ctx.rank} of {self.ctx.world_size}, load the list of every rank's states")
        return {"epoch": s["epoch"], "step": s["step"], "step_in_epoch": k, "microbatch": m,
                "exclude": s.get("exclude", [])}

    def _skip_empty(self, r: dict) -> dict:
        """A half-done step whose samples were all consumed is skipped."""
        epoch, k = r["epoch"], r["step_in_epoch"]
        if not r["exclude"] or self.name == "replay":
            return r
        pos = self.planner.batches(epoch)[k]
        if (~np.isin(self.index.shapes.sample_id[pos], np.asarray(r["exclude"], np.int64))).any():
            return r
        if k + 1 >= self.planner.num_steps(epoch):
            return {"epoch": epoch + 1, "step": r["step"] + 1, "fresh": True}
        return {"epoch": epoch, "step": r["step"] + 1, "step_in_epoch": k + 1, "microbatch": 0, "exclude": []}


def build_indexed(ctx: Context, index=None, index_cache=None) -> IndexedMode:
    """The indexed mode of a loader: length index (scanned when not given), planner, token cache.
    Raises ValueError when the data gives no step; warns when samples outweigh the global batch."""
    idx, table, tokens = open_index(ctx, index, index_cache)
    check_not_empty(ctx, len(idx), table)
    planner = IndexedPlanner(idx, ctx.cost, ctx.options)
    warning = oversized_samples(idx.shapes, ctx.cost, ctx.options)
    if warning is not None:
        warnings.warn(warning, UserWarning, stacklevel=4)
    if planner.num_steps(0) == 0:
        o = ctx.options
        raise ValueError(f"the data ({len(idx)} samples) holds less than one full global batch "
                         f"({o.global_batch_tokens or o.global_batch_size}) and drop_last=True: no step to train; "
                         "lower the global batch or keep the last batch (drop_last=False)")
    return IndexedMode(ctx, idx, planner, tokens)


def check_not_empty(ctx: Context, samples: int, table=None) -> None:
    """ValueError naming the data and its files when its length index (``table``, with the scan's
    counts of skipped records) holds no sample: every record skipped as bad (how many, by kind), or none."""
    if samples:
        return
    errors = Counter(getattr(ctx.source, "error_counts", None) or {})
    meta = (table.schema.metadata or {}) if table is not None else {}
    errors.update(json.loads(meta.get(LOADER_ERRORS_KEY, b"{}")))  # the scan's, counted in its copy of the source
    stats = scan_stats(table) if table is not None else None
    if stats is not None and stats.num_skipped:
        errors["tokenization"] += stats.num_skipped
    files = _file_names(ctx.source)
    more = f" and {len(files) - _FILES_SHOWN} more" if len(files) > _FILES_SHOWN else ""
    where = f" ({', '.join(files[:_FILES_SHOWN])}{more})" if files else ""
    name = f"the data {getattr(ctx.source, 'name', type(ctx.source).__name__)!r}{where}"
    if not errors:
        raise ValueError(f"{name} holds no samples: nothing to train on; check the paths/split")
    first = f"; the first: {stats.skipped[0][0]}: {stats.skipped[0][1]}" if stats is not None and stats.skipped else ""
    raise ValueError(f"{name} holds no samples: all {sum(errors.values())} of its records were skipped as bad "
                     f"(on_error='skip'; by kind: {dict(sorted(errors.items()))}{first}); nothing to train on: "
                     "fix the records or their field mapping (source_options={'mapping': ...}), or read them "
                     "with on_error='raise' to see the first error with its file and line")


_FILES_SHOWN = 3  # data files an error names


def _file_names(source) -> list[str]:
    """The data files of a source (full paths or URLs), or of a mixture (its recorded names)."""
    shards = getattr(source, "shards", None)
    if shards is not None:
        return [s.path or s.name for s in shards]
    import loaders

    return [name for name, *_ in loaders.file_fingerprints(source)]
