"""Row-wise argmax of float32 logits; ties go to the lowest index (like np.argmax).

One block per row (1024 threads), a strided scan per thread, then a block reduction on
(value, index) pairs. NaNs are not treated specially (a NaN never wins after the first element
a thread sees).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from kernels_numba.ptx import grid_trigger, grid_wait
from kernels_numba.bf16 import NEG_INF, SIMULATOR, block_argmax

THREADS = 32 if SIMULATOR else 1024
SCRATCH = 1024 if SIMULATOR else 32


@cuda.jit
def _argmax_rows_kernel(logits, out):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    vs = cuda.shared.array(SCRATCH, np.float32)
    ids = cuda.shared.array(SCRATCH, np.int32)
    r = cuda.blockIdx.x
    bv = NEG_INF
    bi = np.int32(-1)
    for i in range(cuda.threadIdx.x, logits.shape[1], cuda.blockDim.x):
        v = logits[r, i]
        if bi < 0 or v > bv:
            bv = v
            bi = np.int32(i)
    bv, bi = block_argmax(bv, bi, vs, ids)
    if cuda.threadIdx.x == 0:
        out[r] = bi


def argmax_rows(logits, out, stream=0) -> None:
    """logits: float32 [R, V]; out: int32 [R]."""
    if logits.shape[0] == 0:
        return
    _argmax_rows_kernel[logits.shape[0], THREADS, stream](logits, out)


def argmax_rows_ref(logits: np.ndarray) -> np.ndarray:
    return np.argmax(np.asarray(logits), axis=1).astype(np.int32)
