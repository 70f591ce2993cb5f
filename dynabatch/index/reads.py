"""Many byte ranges of a file read in one call: `pread_ragged`, a kernel that calls the C library's
``pread`` once per range (no Python loop over samples, no memory map whose pages would count in the
process's memory), beside `pread_ragged_reference` (``os.pread``)."""

from __future__ import annotations

import os

import numpy as np
from numba import types

from ..core.kernels.compile_once import njit  # numba's njit, its compile lock installed (compile_once)

# pread(fd, buffer, count, offset) of the C library, linked by name: a cached kernel stays valid in
# every process (a ctypes function pointer would be an address of one process only)
_pread = types.ExternalFunction("pread", types.intp(types.intc, types.voidptr, types.uintp, types.int64))


@njit(cache=True, nogil=True)
def pread_ragged(fd, offsets, nbytes, out):
    """Read ``nbytes[i]`` bytes at byte ``offsets[i]`` of the open file ``fd`` for every range ``i``,
    one after another into ``out`` (uint8, ``nbytes.sum()`` bytes). Returns -1, or the first range
    that could not be read whole (a read error, or the end of the file)."""
    at = 0
    for i in range(len(offsets)):
        done = 0
        while done < nbytes[i]:
            got = _pread(fd, out[at + done:].ctypes.data, nbytes[i] - done, offsets[i] + done)
            if got <= 0:
                return i
            done += got
        at += nbytes[i]
    return -1


def pread_ragged_reference(fd: int, offsets, nbytes, out) -> int:
    """`pread_ragged` with ``os.pread`` in a loop."""
    at = 0
    for i, (offset, n) in enumerate(zip(np.asarray(offsets).tolist(), np.asarray(nbytes).tolist())):
        if n == 0:  # nothing to read (the kernel makes no call)
            continue
        try:
            data = os.pread(fd, n, offset)
        except OSError:
            return i
        if len(data) < n:  # os.pread repeats a short read itself only up to the end of the file
            return i
        out[at:at + n] = np.frombuffer(data, np.uint8)
        at += n
    return -1
