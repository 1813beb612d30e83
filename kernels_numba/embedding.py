"""Embedding gather: bf16 table rows -> float32 activations.

One block per token, threads stride over the row. Ids outside [0, V) produce zero rows; the
slice variant (tensor parallelism) takes a vocab range [lo, hi) and zeroes ids outside it.
"""

from __future__ import annotations

import numpy as np
from numba import cuda
from kernels_numba.jit import kernel as cached_jit

from kernels_numba.ptx import grid_trigger, grid_wait
from kernels_numba.bf16 import SIMULATOR, bf16_to_f32, from_bf16_bits

THREADS = 32 if SIMULATOR else 256


@cached_jit
def _embedding_gather_kernel(table, ids, out):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    t = cuda.blockIdx.x
    tok = ids[t]
    valid = tok >= 0 and tok < table.shape[0]
    for d in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        out[t, d] = bf16_to_f32(table[tok, d]) if valid else np.float32(0.0)


@cached_jit
def _embedding_feed_kernel(table, ids, src, prev, out):
    grid_wait()
    grid_trigger()
    t = cuda.blockIdx.x
    tok = prev[src[t]] if src[t] >= 0 else ids[t]
    valid = tok >= 0 and tok < table.shape[0]
    for d in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        out[t, d] = bf16_to_f32(table[tok, d]) if valid else np.float32(0.0)
    if cuda.threadIdx.x == 0 and src[t] >= 0:
        ids[t] = tok          # the step's token ids as the host would have written them


def embedding_feed(table, ids, src, prev, out, stream=0) -> None:
    """embedding_gather where src[t] >= 0 takes token t from prev[src[t]] (the previous step's
    sampled ids, still on the device) and writes it into ids[t]: the host runs a step ahead."""
    if ids.shape[0] == 0:
        return
    _embedding_feed_kernel[ids.shape[0], THREADS, stream](table, ids, src, prev, out)


def embedding_feed_ref(table: np.ndarray, ids: np.ndarray, src: np.ndarray, prev: np.ndarray) -> np.ndarray:
    ids = np.where(np.asarray(src) >= 0, np.asarray(prev)[np.maximum(src, 0)], ids)
    return embedding_gather_ref(table, ids)


def embedding_gather(table, ids, out, stream=0) -> None:
    """out[t, :] = f32(table[ids[t], :]). table: uint16 [V, D]; ids: int32 [T]; out: float32 [T, D]."""
    if ids.shape[0] == 0:
        return
    _embedding_gather_kernel[ids.shape[0], THREADS, stream](table, ids, out)


def embedding_gather_ref(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    rows = from_bf16_bits(np.asarray(table))
    ids = np.asarray(ids)
    out = np.zeros((ids.shape[0], rows.shape[1]), np.float32)
    ok = (ids >= 0) & (ids < rows.shape[0])
    out[ok] = rows[ids[ok]]
    return out


@cached_jit
def _embedding_slice_kernel(table, ids, lo, hi, out):
    grid_wait()
    grid_trigger()
    t = cuda.blockIdx.x
    tok = ids[t]
    valid = tok >= lo and tok < hi
    row = tok - lo if valid else 0
    for d in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        out[t, d] = bf16_to_f32(table[row, d]) if valid else np.float32(0.0)


def embedding_gather_slice(table, ids, lo: int, hi: int, out, stream=0) -> None:
    """A vocab-parallel rank's embedding: out[t] = f32(table[ids[t] - lo]) for ids in [lo, hi),
    zero rows for the others (another rank holds them; the all-reduce adds them). table: uint16
    [>= hi - lo, D], its rows [0, hi - lo) the ids lo .. hi - 1."""
    if ids.shape[0] == 0:
        return
    _embedding_slice_kernel[ids.shape[0], THREADS, stream](table, ids, np.int32(lo), np.int32(hi), out)


def embedding_gather_slice_ref(table: np.ndarray, ids: np.ndarray, lo: int, hi: int) -> np.ndarray:
    rows = from_bf16_bits(np.asarray(table))
    ids = np.asarray(ids)
    out = np.zeros((ids.shape[0], rows.shape[1]), np.float32)
    ok = (ids >= lo) & (ids < hi)
    out[ok] = rows[ids[ok] - lo]
    return out
