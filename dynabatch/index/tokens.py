"""The token cache: every sample's token ids after formatting and truncation, by length-index
position, so the DataLoader collates a step without reading or tokenizing its records again. It
comes from a token file (`dynabatch.index.token_file`: written by the scan or by one tokenization
pass, `encode_to_file`, and memory-mapped) or from an index table's token columns
(`dynabatch.index.TOKEN_COLUMNS`, kept in memory by ``build_index(cache_tokens=True)``)."""

from __future__ import annotations

import mmap
import os
import weakref

import numpy as np
import pyarrow as pa
from tokenization import count_labels, ragged_take

from .scan import natural_order
from .table import TOKEN_COLUMNS, LengthIndex
from .token_file import TokenFileError, TokenFileWriter, read_token_file

#: Bytes of a token file one process may keep mapped before it releases the pages (`TokenCache.gather`):
#: the bound of the cache's resident memory, whatever the dataset's size. A release costs a page
#: fault per sample read after it, so a smaller bound trades throughput for memory (a file under it
#: stays mapped).
RELEASE_BYTES = 256 << 20
#: The most of a file one read of a few ids maps (counted per sample and region): the kernel maps a
#: whole large folio of the page cache on a fault, up to 2 MiB (a PMD) on Linux 6.x, so random reads
#: map the whole file long before they have read its size in ids (measured: 10 samples, 0.1 MiB of
#: ids, mapped 22 MiB).
MAP_GRAIN_BYTES = 2 << 20


class TokenCache:
    """Every sample's token ids after formatting and truncation, by length-index position:
    flat int32 arrays plus offsets (input ids; labels for decoder-only models, target ids for
    encoder-decoder ones). ``gather`` returns a micro-batch's concatenated ids without reading or
    tokenizing the records again; the collated tensors are exactly those of the uncached path."""

    def __init__(self, index: "LengthIndex", input_ids, input_offsets, second, second_offsets, rows=None,
                 path: str | None = None):
        self.index = index
        self.input_ids = input_ids if isinstance(input_ids, np.memmap) else np.asarray(input_ids, np.int32)
        self.input_offsets = np.asarray(input_offsets, np.int64)
        self.second = second if isinstance(second, np.memmap) else np.asarray(second, np.int32)
        self.second_offsets = np.asarray(second_offsets, np.int64)
        self.rows = rows  # index position -> row of the offsets (None: the same)
        self.path = path  # the memory-mapped token file, if any
        self._mapped = 0  # bytes of the file counted as mapped by this process's reads (see gather)
        self._identity_ids = bool(len(index) == 0 or (index.shapes.sample_id[0] == 0 and
                                  index.shapes.sample_id[-1] == len(index) - 1))

    def __getstate__(self) -> dict:
        """Pickled (spawned workers) by the file's path, not its ids: the child maps the same file."""
        state = dict(self.__dict__)
        if self.path is not None:
            state["input_ids"] = state["second"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.path is not None:
            a, b = int(self.input_offsets[-1]), int(self.second_offsets[-1])
            values = np.memmap(self.path, np.int32, mode="r", shape=(a + b,)) if a + b else np.zeros(0, np.int32)
            self.input_ids, self.second = values[:a], values[a:]

    @property
    def nbytes(self) -> int:
        return int(self.input_ids.nbytes + self.second.nbytes + self.input_offsets.nbytes + self.second_offsets.nbytes)

    @staticmethod
    def _take(values: np.ndarray, offsets: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Concatenated slices ``values[offsets[p]:offsets[p+1]]`` for ``p`` in ``pos``, and their lengths."""
        lengths = offsets[pos + 1] - offsets[pos]
        taken = ragged_take(values, offsets[pos], lengths)
        # one sample comes back as a view: of a token file, it would be read (mapped) after the release
        return (np.array(taken) if len(pos) == 1 else taken), lengths

    def positions(self, sample_ids) -> np.ndarray:
        ids = np.asarray(sample_ids, np.int64)
        if self._identity_ids and len(ids) and ids.min() >= 0 and ids.max() < len(self.index):
            return ids
        return self.index.positions(ids)

    def gather(self, sample_ids, positions=None):
        """(input ids, input lengths, labels or target ids, their lengths) of these samples, in
        order: int32 arrays and int64 lengths (``positions``: their index positions, if known).
        From a token file larger than `RELEASE_BYTES`, the samples are read in windows of about
        `RELEASE_BYTES` of mapped pages, each released before the next is read (see `MAP_GRAIN_BYTES`);
        a smaller file stays mapped (at most its size, no page faults after a release)."""
        pos = self.positions(sample_ids) if positions is None else np.asarray(positions, np.int64)
        if self.rows is not None:
            pos = self.rows[pos]
        if self.path is None or not len(pos) or self.input_ids.nbytes + self.second.nbytes <= RELEASE_BYTES:
            return self._gather(pos)  # in memory, or a file small enough to stay mapped whole
        lengths = self.input_offsets[pos + 1] - self.input_offsets[pos]
        slen = self.second_offsets[pos + 1] - self.second_offsets[pos]
        mapped = self._mapped + np.cumsum(4 * (lengths + slen) + 2 * MAP_GRAIN_BYTES)
        # a release after each sample whose pages cross a multiple of RELEASE_BYTES: at most
        # RELEASE_BYTES plus one sample's pages stay mapped
        ends = np.flatnonzero(np.diff(mapped // RELEASE_BYTES, prepend=self._mapped // RELEASE_BYTES)) + 1
        self._mapped = int(mapped[-1])
        if not len(ends):
            return self._gather(pos)
        cuts = np.concatenate([[0], ends, [len(pos)]]) if ends[-1] < len(pos) else np.concatenate([[0], ends])
        flat = self._windows(self.input_ids, self.input_offsets[pos], lengths, cuts)
        second = self._windows(self.second, self.second_offsets[pos], slen, cuts)
        return flat, lengths, second, slen

    def _windows(self, values, starts, lengths, cuts) -> np.ndarray:
        """``values[s:s + n]`` of every sample, concatenated, read window by window (samples
        ``cuts[k]:cuts[k + 1]``), the mapped pages released after each."""
        ends = np.concatenate([[0], np.cumsum(lengths)])
        src = np.repeat(starts - ends[:-1], lengths) + np.arange(ends[-1], dtype=np.int64)
        out = np.empty(int(ends[-1]), np.int32)
        for k in range(len(cuts) - 1):  # windows (a few per step), not samples
            a, b = ends[cuts[k]], ends[cuts[k + 1]]
            np.take(values, src[a:b], out=out[a:b])
            self._release()
        return out

    def _gather(self, pos: np.ndarray):
        """`gather` of offset rows ``pos``, read in one pass."""
        flat, lengths = self._take(self.input_ids, self.input_offsets, pos)
        if self.second_offsets is self.input_offsets:
            return flat, lengths, self._take(self.second, self.input_offsets, pos)[0], lengths
        return (flat, lengths, *self._take(self.second, self.second_offsets, pos))

    def _release(self) -> None:
        """Unmap the file pages read so far from this process: they count in its RSS until then
        and would add up to the whole file over an epoch; they stay in the page cache (a later
        read is a minor fault, not a disk read)."""
        mm = getattr(self.input_ids, "_mmap", None)
        if mm is not None:
            mm.madvise(mmap.MADV_DONTNEED)

    def label_counts(self, sample_ids, family: str) -> np.ndarray:
        """Loss labels of these samples from the cached ids (`tokenization.count_labels`)."""
        _, lengths, second, slen = self.gather(sample_ids)
        return count_labels(second, slen if family == "encoder_decoder" else lengths, family)

    @classmethod
    def from_encoded(cls, index: "LengthIndex", encs: dict, family: str) -> "TokenCache | None":
        """From ``{sample_id: EncodedSample}``; None when a sample of the index is missing."""
        ids = index.shapes.sample_id
        try:
            ordered = [encs[int(i)] for i in ids.tolist()]
        except KeyError:
            return None
        inp, off, second, soff = _flat_columns(ordered, family)
        return cls(index, inp, off, second, soff if family == "encoder_decoder" else off)

    @classmethod
    def from_table(cls, index: "LengthIndex", table: pa.Table, family: str) -> "TokenCache | None":
        """From an index table's token columns (see `TOKEN_COLUMNS`); None without them."""
        if not all(c in table.column_names for c in TOKEN_COLUMNS):
            return None
        cols = []
        for c in TOKEN_COLUMNS:
            arr = table.column(c).combine_chunks()
            if isinstance(arr, pa.ChunkedArray):
                arr = arr.chunk(0) if arr.num_chunks else pa.array([], pa.large_list(pa.int32()))
            offsets = arr.offsets.to_numpy().astype(np.int64)
            values = arr.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
            cols.append((values[offsets[0]:offsets[-1]] if len(offsets) else values[:0], offsets - offsets[0]))
        (inp, off), (second, soff) = cols
        tids = table.column("sample_id").to_numpy(zero_copy_only=False).astype(np.int64)
        if len(tids) != len(index) or not np.array_equal(tids, index.shapes.sample_id):
            pos = np.argsort(tids, kind="stable")
            if len(tids) != len(index) or not np.array_equal(tids[pos], index.shapes.sample_id):
                return None
            inp, lens = cls._take(inp, off, pos)
            off = np.concatenate([[0], np.cumsum(lens)])
            second, slens = cls._take(second, soff, pos)
            soff = np.concatenate([[0], np.cumsum(slens)])
        same = family == "decoder" and np.array_equal(off, soff)
        return cls(index, inp, off, second, off if same else soff)


    @classmethod
    def from_file(cls, index: "LengthIndex", path: str, *, settings: dict, tokenizer: str,
                  owned: bool = False) -> "TokenCache | None":
        """The token file at ``path`` memory-mapped (checked by `read_token_file` against
        ``settings`` and the ``tokenizer`` fingerprint: `TokenFileError` naming it otherwise); None
        when it lacks samples of ``index``. ``owned``: a private file, deleted with this cache."""
        ids, inp, off, second, soff = read_token_file(path, settings=settings, tokenizer=tokenizer)
        rows = None
        want = index.shapes.sample_id
        if len(ids) != len(want) or not np.array_equal(ids, want):
            order = np.argsort(ids, kind="stable")
            found = np.minimum(np.searchsorted(ids[order], want), max(len(ids) - 1, 0))
            if not len(ids) or not np.array_equal(ids[order][found], want):
                return None
            rows = order[found]
        tc = cls(index, inp, off, second, soff, rows=rows, path=str(path))
        if owned:
            weakref.finalize(tc, _remove_owned, str(path), os.getpid())
        return tc


def _remove_owned(path: str, pid: int) -> None:
    """Delete a private token file, from the process that made it only (forked workers share it)."""
    if os.getpid() == pid and os.path.exists(path):
        os.unlink(path)


def encode_to_file(source, formatter, path: str, meta: dict, *, batch_size: int = 512, on_error: str = "raise",
                   progress: bool | None = None) -> str:
    """One tokenization pass over ``source`` (natural order) under ``formatter`` into the token file
    ``path`` (footer: ``meta``), batch by batch: the cache of an index that came without one."""
    family = formatter.config.family
    writer = TokenFileWriter(path)
    try:
        for encs in _encoded_batches(source, formatter, batch_size, on_error, progress):
            inp, off, second, soff = _flat_columns(encs, family)
            writer.add([e.sample_id for e in encs], inp, np.diff(off), second, np.diff(soff))
    except BaseException:
        writer.discard()
        raise
    return writer.finish(meta)


def _flat_columns(encs, family: str):
    """Flat int32 ids and int64 offsets of input ids and labels / target ids of EncodedSamples."""
    def flat(arrays):
        lengths = np.fromiter((len(a) for a in arrays), np.int64, count=len(arrays))
        values = np.concatenate(arrays).astype(np.int32, copy=False) if len(arrays) else np.zeros(0, np.int32)
        return values, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    inp, off = flat([e.input_ids for e in encs])
    if family == "encoder_decoder":
        second, soff = flat([e.target_ids for e in encs])
    else:
        second, soff = flat([e.labels if e.labels is not None else e.input_ids for e in encs])
    return inp, off, second, soff


def token_cache_bytes(shapes, family: str) -> int:
    """Upper bound of the token cache's memory (int32 ids; untruncated lengths)."""
    inp = shapes.input_tokens.astype(np.int64).sum()
    tgt = shapes.target_tokens.astype(np.int64).sum()
    return int(4 * (2 * (inp + tgt) if family == "decoder" else inp + tgt) + 16 * len(shapes))


def _encoded_batches(source, formatter, batch_size: int, on_error: str, progress: bool | None):
    """Lists of `EncodedSample` of a whole source in natural order, ``batch_size`` samples read at a
    time (a tqdm bar of samples; ``progress`` None: only on a terminal)."""
    from tqdm.auto import tqdm

    batch: list[dict] = []
    with tqdm(total=getattr(source, "num_rows", None), desc="dynabatch: tokenize (token cache)", unit="sample",
              disable=None if progress is None else not progress, dynamic_ncols=True) as bar:
        for sample in natural_order(source):
            batch.append(sample)
            if len(batch) >= batch_size:
                yield [e for e in formatter.encode_batch(batch, on_error=on_error) if e is not None]
                bar.update(len(batch))
                batch = []
        if batch:
            yield [e for e in formatter.encode_batch(batch, on_error=on_error) if e is not None]
            bar.update(len(batch))


def encode_all(source, formatter, *, batch_size: int = 512, on_error: str = "raise",
               progress: bool | None = None) -> dict:
    """``{sample_id: EncodedSample}`` of a whole source under ``formatter`` (one tokenization pass,
    natural order), in memory (the DataLoader writes a token file instead: `encode_to_file`).
    ``progress``: a tqdm bar of samples (None: only on a terminal)."""
    return {int(e.sample_id): e for encs in _encoded_batches(source, formatter, batch_size, on_error, progress)
            for e in encs}
