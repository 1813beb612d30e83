"""The MTP head's glue kernels on the device (metrale/spec/mtp_cuda.py): the rest of the head runs
the target's own kernels through CudaOps.

copy_rows   dst[dst_idx[i]] = src[src_idx[i]] (dst_idx < 0: skipped): each sequence's last target
            hidden row into the head's per-sequence store, one launch for the step.
draft_pick  per row r, after argmax_rows gave idx[r]: the draft token (idx, or d2t[idx] with a
            draft vocabulary) and its softmax probability 1 / sum_i exp(logits[r, i] - logits[r, idx]),
            the confidence the NumPy head reports (spec/drafter.py Draft.confidences).
One block per row, threads stride over the row.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from kernels_numba.bf16 import SIMULATOR, block_sum
from kernels_numba.jit import kernel as cached_jit
from kernels_numba.ptx import grid_trigger, grid_wait

THREADS = 32 if SIMULATOR else 256
SCRATCH = 1024 if SIMULATOR else 32


@cached_jit
def _copy_rows_kernel(src, src_idx, dst, dst_idx):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    i = cuda.blockIdx.x
    d = dst_idx[i]
    if d < 0:
        return
    s = src_idx[i]
    for c in range(cuda.threadIdx.x, dst.shape[1], cuda.blockDim.x):
        dst[d, c] = src[s, c]


def copy_rows(src, src_idx, dst, dst_idx, stream=0) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] for every i with dst_idx[i] >= 0. src, dst: float32
    [*, D]; src_idx, dst_idx: int32 [n] (n launches n blocks)."""
    if dst_idx.shape[0]:
        _copy_rows_kernel[dst_idx.shape[0], THREADS, stream](src, src_idx, dst, dst_idx)


def copy_rows_ref(src: np.ndarray, src_idx, dst: np.ndarray, dst_idx) -> np.ndarray:
    out = np.array(dst, copy=True)
    for s, d in zip(np.asarray(src_idx), np.asarray(dst_idx)):
        if d >= 0:
            out[d] = src[s]
    return out


@cached_jit
def _draft_pick_kernel(logits, idx, d2t, use_d2t, ids_out, conf_out):
    grid_wait()
    grid_trigger()
    scratch = cuda.shared.array(SCRATCH, np.float32)
    r = cuda.blockIdx.x
    best = idx[r]
    m = logits[r, best]
    s = np.float32(0.0)
    for i in range(cuda.threadIdx.x, logits.shape[1], cuda.blockDim.x):
        s += np.float32(math.exp(logits[r, i] - m))
    s = block_sum(s, scratch)
    if cuda.threadIdx.x == 0:
        conf_out[r] = np.float32(1.0) / s
        ids_out[r] = d2t[best] if use_d2t else best


def draft_pick(logits, idx, d2t, ids_out, conf_out, stream=0) -> None:
    """logits float32 [R, V] (a column slice is fine: V is its width); idx int32 [R] (the argmax
    of each row); d2t int32 [V] or None. Writes ids_out[r] (d2t[idx[r]], or idx[r]) and
    conf_out[r] = softmax(logits[r])[idx[r]]."""
    R = idx.shape[0]
    if R == 0:
        return
    use = d2t is not None
    _draft_pick_kernel[R, THREADS, stream](logits, idx, d2t if use else idx, use, ids_out, conf_out)


def draft_pick_ref(logits: np.ndarray, idx, d2t=None) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(logits, np.float64)
    idx = np.asarray(idx)
    rows = np.arange(len(idx))
    conf = 1.0 / np.exp(x - x[rows, idx][:, None]).sum(-1)
    ids = idx if d2t is None else np.asarray(d2t)[idx]
    return ids.astype(np.int32), conf.astype(np.float32)
