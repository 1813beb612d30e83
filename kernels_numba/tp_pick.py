"""Greedy picks across tensor-parallel ranks (each rank holds a vocabulary slice of the logits).

pack_pairs: each row's local argmax (argmax.argmax_rows over the slice's real columns) as a
(value, global index) pair of float32, the index exact below 2^24 (every vocabulary here); a rank
with an empty slice packs (-inf, lo). pick_pairs: the ranks' pairs all-gathered as [N, R, 2]
-> the global argmax id of each row, the first rank's on ties (it holds the lower index: what
np.argmax over the whole row gives). One thread a row: R <= a step's logits rows.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from kernels_numba.jit import kernel as cached_jit
from kernels_numba.ptx import grid_trigger, grid_wait
from kernels_numba.bf16 import NEG_INF

THREADS = 128


@cached_jit
def _pack_pairs_kernel(logits, idx, width, lo, pairs):
    grid_wait()
    grid_trigger()
    r = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if r < pairs.shape[0]:
        if width > 0:
            i = idx[r]
            pairs[r, 0] = logits[r, i]
            pairs[r, 1] = np.float32(lo + i)
        else:
            pairs[r, 0] = NEG_INF
            pairs[r, 1] = np.float32(lo)


@cached_jit
def _pick_pairs_kernel(gathered, out):
    grid_wait()
    grid_trigger()
    r = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if r < out.shape[0]:
        best = gathered[0, r, 0]
        pick = gathered[0, r, 1]
        for k in range(1, gathered.shape[0]):
            v = gathered[k, r, 0]
            if v > best:
                best = v
                pick = gathered[k, r, 1]
        out[r] = np.int32(pick)


def pack_pairs(logits, idx, width: int, lo: int, pairs, stream=0) -> None:
    """pairs[r] = (logits[r, idx[r]], lo + idx[r]). logits float32 [R, >= width]; idx int32 [R]
    (the slice's argmax); pairs float32 [R, 2]."""
    R = pairs.shape[0]
    if R:
        _pack_pairs_kernel[-(-R // THREADS), THREADS, stream](logits, idx, np.int32(width), np.int32(lo), pairs)


def pick_pairs(gathered, out, stream=0) -> None:
    """out[r] = the index of the largest value over gathered[:, r] (float32 [N, R, 2]), int32 [R]."""
    R = out.shape[0]
    if R:
        _pick_pairs_kernel[-(-R // THREADS), THREADS, stream](gathered, out)


def pack_pairs_ref(logits: np.ndarray, width: int, lo: int) -> np.ndarray:
    out = np.empty((logits.shape[0], 2), np.float32)
    if width == 0:
        out[:, 0], out[:, 1] = -np.inf, lo
        return out
    idx = np.argmax(logits[:, :width], axis=-1)
    out[:, 0] = logits[np.arange(logits.shape[0]), idx]
    out[:, 1] = idx + lo
    return out


def pick_pairs_ref(gathered: np.ndarray) -> np.ndarray:
    best = np.argmax(gathered[:, :, 0], axis=0)
    return gathered[best, np.arange(gathered.shape[1]), 1].astype(np.int32)
