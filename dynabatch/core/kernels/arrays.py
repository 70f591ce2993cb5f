"""Arrays as the kernels take them: one memory layout, one dtype, writable, so each kernel compiles
once per dtype, not once more per caller's flags (numba types a read-only array, e.g. one read zero-copy
from Arrow, apart from a writable one, and compiles the kernel and everything it calls again)."""

from __future__ import annotations

import numpy as np


def kernel_array(x, dtype) -> np.ndarray:
    """``x`` as a C-contiguous, writable array of ``dtype`` (a copy only where it is not one already)."""
    a = np.ascontiguousarray(x, dtype)
    return a if a.flags.writeable else a.copy()
