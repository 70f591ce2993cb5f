"""The token cache: every sample's token ids after formatting and truncation, by length-index
position, so the DataLoader collates a step without reading or tokenizing its records again. It
comes from a token file (`dynabatch.index.token_file`: written by the scan or by one tokenization
pass, `encode_to_file`, read with one ``pread`` per sample and region, so its pages stay in the
OS page cache and never count in the process's memory) or from an index table's token columns
(`dynabatch.index.TOKEN_COLUMNS`, kept in memory by ``build_index(cache_tokens=True)``)."""

from __future__ import annotations

import os
import weakref

import numpy as np
import pyarrow as pa
from tokenization import count_labels, ragged_take

from .reads import pread_ragged
from .scan import natural_order
from .table import TOKEN_COLUMNS, LengthIndex
from .token_file import TokenFileError, TokenFileWriter, read_token_file

# the token file is read with pread where the platform has it (POSIX), else through its memory map
_PREAD = hasattr(os, "pread")


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
        self.path = path  # the token file, if any (input_ids and second: its memory map, for reference)
        self._fd: int | None = None  # the token file open for pread (forked workers share it)
        self._identity_ids = bool(len(index) == 0 or (index.shapes.sample_id[0] == 0 and
                                  index.shapes.sample_id[-1] == len(index) - 1))

    def __getstate__(self) -> dict:
        """Pickled (spawned workers) by the file's path, not its ids: the child maps the same file."""
        state = dict(self.__dict__)
        state["_fd"] = None  # a descriptor of this process: the child opens the file itself
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
        # one sample comes back as a view: copied, so no caller holds on to (or reads through) the arrays
        return (np.array(taken) if len(pos) == 1 else taken), lengths

    def positions(self, sample_ids) -> np.ndarray:
        ids = np.asarray(sample_ids, np.int64)
        if self._identity_ids and len(ids) and ids.min() >= 0 and ids.max() < len(self.index):
            return ids
        return self.index.positions(ids)

    def gather(self, sample_ids, positions=None):
        """(input ids, input lengths, labels or target ids, their lengths) of these samples, in
        order: int32 arrays and int64 lengths (``positions``: their index positions, if known).
        From a token file, each sample's ids are read with ``pread`` (`pread_ragged`): the file's
        pages stay in the OS page cache, so the process's memory does not grow with the dataset."""
        pos = self.positions(sample_ids) if positions is None else np.asarray(positions, np.int64)
        if self.rows is not None:
            pos = self.rows[pos]
        if self.path is None or not len(pos) or not _PREAD:
            return self._gather(pos)  # in memory (or read through the map without pread)
        lengths = self.input_offsets[pos + 1] - self.input_offsets[pos]
        slen = self.second_offsets[pos + 1] - self.second_offsets[pos]
        # the file holds the input ids from byte 0, then the second ids (`dynabatch.index.token_file`)
        flat = self._read(self.input_offsets[pos], lengths)
        second = self._read(self.second_offsets[pos] + len(self.input_ids), slen)
        return flat, lengths, second, slen

    def _read(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Ids ``[s, s + n)`` of the token file for every ``(s, n)``, concatenated (int32)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            weakref.finalize(self, os.close, self._fd)
        out = np.empty(int(lengths.sum()), np.int32)
        bad = pread_ragged(self._fd, 4 * starts, 4 * lengths, out.view(np.uint8))
        if bad >= 0:
            raise TokenFileError(f"token cache {self.path}: the ids at values {int(starts[bad])}-"
                                 f"{int(starts[bad] + lengths[bad])} could not be read (the file was cut "
                                 "short or replaced while in use); delete it and restart the epoch")
        return out

    def _gather(self, pos: np.ndarray):
        """`gather` of offset rows ``pos`` from the arrays, in one pass."""
        flat, lengths = self._take(self.input_ids, self.input_offsets, pos)
        if self.second_offsets is self.input_offsets:
            return flat, lengths, self._take(self.second, self.input_offsets, pos)[0], lengths
        return (flat, lengths, *self._take(self.second, self.second_offsets, pos))

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
                   progress: bool | None = None, max_bytes: int | None = None) -> str:
    """One tokenization pass over ``source`` (natural order) under ``formatter`` into the token file
    ``path`` (footer: ``meta``), batch by batch: the cache of an index that came without one.
    ``max_bytes``: the file's bound (`TokenFileWriter`)."""
    family = formatter.config.family
    writer = TokenFileWriter(path, max_bytes)
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
