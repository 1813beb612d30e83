"""RMSNorm and fused residual-add + RMSNorm, fp32 math, one block per row.

x may be 2-D [N, D] (rows) or 3-D [T, H, D] (per-head norm, e.g. Qwen3 q/k norm on a strided
view of the QKV buffer); any strides. out may alias x (each thread reads its elements before it
writes them). add_rms_norm updates residual in place: residual += x; out = rmsnorm(residual) * w.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda
from kernels_numba.jit import kernel as cached_jit

from kernels_numba.ptx import grid_trigger, grid_wait
from kernels_numba.bf16 import SIMULATOR, block_sum, device_function
from kernels_numba.ptx import pack_bf16x2

MAX_THREADS = 32 if SIMULATOR else 1024
SCRATCH = 1024 if SIMULATOR else 32


def _threads(d: int) -> int:
    """~4 elements per thread, a multiple of 32, at most MAX_THREADS."""
    return max(32, min(MAX_THREADS, ((d + 127) // 128) * 32))


@device_function
def inv_rms_row(x, r, eps, scratch):
    """1 / sqrt(mean(x[r]^2) + eps), the block's threads striding the row (every thread of the block
    calls it: a block sum)."""
    n = x.shape[1]
    ss = np.float32(0.0)
    for d in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        v = x[r, d]
        ss += v * v
    ss = block_sum(ss, scratch)
    return np.float32(1.0) / math.sqrt(ss / np.float32(n) + eps)


@cached_jit
def _rms_norm_2d(x, w, eps, out):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    scratch = cuda.shared.array(SCRATCH, np.float32)
    r = cuda.blockIdx.x
    n = x.shape[1]
    inv = inv_rms_row(x, r, eps, scratch)
    for d in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        out[r, d] = x[r, d] * inv * w[d]


@cached_jit
def _rms_norm_3d(x, w, eps, out):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    scratch = cuda.shared.array(SCRATCH, np.float32)
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    n = x.shape[2]
    ss = np.float32(0.0)
    for d in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        v = x[t, h, d]
        ss += v * v
    ss = block_sum(ss, scratch)
    inv = np.float32(1.0) / math.sqrt(ss / np.float32(n) + eps)
    for d in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        out[t, h, d] = x[t, h, d] * inv * w[d]


@cached_jit
def _rms_norm_bf16_2d(x, w, eps, out32):
    """rms_norm of rows into bf16 (two per uint32 of out32 [N, D/2]): the input of a library
    matmul that takes bf16, without a separate conversion pass."""
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    scratch = cuda.shared.array(SCRATCH, np.float32)
    r = cuda.blockIdx.x
    n = x.shape[1]
    inv = inv_rms_row(x, r, eps, scratch)
    for p in range(cuda.threadIdx.x, n // 2, cuda.blockDim.x):
        d = 2 * p
        out32[r, p] = pack_bf16x2(x[r, d] * inv * w[d], x[r, d + 1] * inv * w[d + 1])


@cached_jit
def _add_rms_norm_2d(x, residual, w, eps, out):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    scratch = cuda.shared.array(SCRATCH, np.float32)
    r = cuda.blockIdx.x
    n = x.shape[1]
    ss = np.float32(0.0)
    for d in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        v = residual[r, d] + x[r, d]
        residual[r, d] = v
        ss += v * v
    ss = block_sum(ss, scratch)
    inv = np.float32(1.0) / math.sqrt(ss / np.float32(n) + eps)
    for d in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        out[r, d] = residual[r, d] * inv * w[d]


@cached_jit
def _rms_norm_into_residual_2d(x, w, eps, residual):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    scratch = cuda.shared.array(SCRATCH, np.float32)
    r = cuda.blockIdx.x
    n = x.shape[1]
    inv = inv_rms_row(x, r, eps, scratch)
    for d in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        residual[r, d] += x[r, d] * inv * w[d]


@cached_jit
def _scale_rows_2d(x, scale):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    r = cuda.blockIdx.x
    for d in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
        x[r, d] *= scale


def rms_norm(x, w, eps: float, out, stream=0) -> None:
    """out = x / sqrt(mean(x^2) + eps) * w over the last axis. x, out: [N, D] or [T, H, D]; w: [D]."""
    if x.shape[0] == 0:
        return
    nt = _threads(x.shape[len(x.shape) - 1])  # (the simulator's shapes reject negative indices)
    if len(x.shape) == 2:
        _rms_norm_2d[x.shape[0], nt, stream](x, w, np.float32(eps), out)
    elif len(x.shape) == 3:
        if x.shape[1] == 0:
            return
        _rms_norm_3d[(x.shape[0], x.shape[1]), nt, stream](x, w, np.float32(eps), out)
    else:
        raise ValueError(f"rms_norm: x must be 2-D or 3-D, got shape {x.shape}")


def rms_norm_bf16(x, w, eps: float, out_u16, stream=0) -> None:
    """x float32 [N, D] (D even) -> out_u16: bf16 bits with room for N*D values (row-major [N, D])."""
    N, D = x.shape
    if N == 0:
        return
    assert D % 2 == 0 and out_u16.size >= N * D
    out32 = out_u16.reshape(out_u16.size)[:N * D].view(np.uint32).reshape(N, D // 2)
    _rms_norm_bf16_2d[N, _threads(D), stream](x, w, np.float32(eps), out32)


def add_rms_norm(x, residual, w, eps: float, out, stream=0) -> None:
    """residual += x (in place); out = rms_norm(residual) * w. x, residual, out: [T, D]; w: [D]."""
    if x.shape[0] == 0:
        return
    _add_rms_norm_2d[x.shape[0], _threads(x.shape[1]), stream](x, residual, w, np.float32(eps), out)


def rms_norm_into_residual(x, w, eps: float, residual, stream=0) -> None:
    """residual += rms_norm(x) * w (Gemma's norm after a block, before its residual add). x,
    residual: [T, D]; w: [D]."""
    if x.shape[0] == 0:
        return
    _rms_norm_into_residual_2d[x.shape[0], _threads(x.shape[1]), stream](x, w, np.float32(eps), residual)


def scale_rows(x, scale: float, stream=0) -> None:
    """x *= scale in place (Gemma's embedding scale). x: [T, D]."""
    if x.shape[0] == 0:
        return
    _scale_rows_2d[x.shape[0], _threads(x.shape[1]), stream](x, np.float32(scale))


def rms_norm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = np.asarray(x, np.float64)
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (x64 * inv * np.asarray(w, np.float64)).astype(np.float32)


def add_rms_norm_ref(x: np.ndarray, residual: np.ndarray, w: np.ndarray, eps: float):
    """Returns (out, residual_new)."""
    res = (np.asarray(residual, np.float32) + np.asarray(x, np.float32)).astype(np.float32)
    return rms_norm_ref(res, w, eps), res
