"""float32 -> bf16 conversion of activation rows, for library matmuls that take bf16 inputs.

    x_to_bf16(x [T, K] float32, out [T, K] uint16 bf16 bits)

Each thread converts 8 consecutive floats (two 16-byte loads, one 16-byte store), rounding to
nearest even as `cvt.rn.bf16x2.f32` does. K must be a multiple of 8. Allocation-free, graph-safe.
"""
from __future__ import annotations

import numpy as np
from numba import cuda
from kernels_numba.jit import kernel as cached_jit

from kernels_numba.ptx import grid_trigger, grid_wait
from kernels_numba.ptx import SIM, f32_to_bf16_bits, ldg_f32x4, pack_bf16x2

THREADS = 32 if SIM else 256


def x_to_bf16_ref(x: np.ndarray) -> np.ndarray:
    return f32_to_bf16_bits(x)


@cached_jit
def _x_to_bf16_kernel(x, out32):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x     # 8-float group index
    groups = x.shape[1] // 8
    if i >= x.shape[0] * groups:
        return
    r = i // groups
    c = (i - r * groups) * 8
    a0, a1, a2, a3 = ldg_f32x4(x, r, c)
    b0, b1, b2, b3 = ldg_f32x4(x, r, c + 4)
    o = r * (x.shape[1] // 2) + c // 2
    out32[o] = pack_bf16x2(a0, a1)
    out32[o + 1] = pack_bf16x2(a2, a3)
    out32[o + 2] = pack_bf16x2(b0, b1)
    out32[o + 3] = pack_bf16x2(b2, b3)


def x_to_bf16(x, out, stream=None) -> None:
    T, K = x.shape
    assert K % 8 == 0, f"x_to_bf16 needs K a multiple of 8, got {K}"
    assert out.dtype == np.uint16 and out.size >= T * K, "out: uint16 with room for T*K values"
    if T == 0:
        return
    n = T * K // 8
    out32 = out.reshape(out.size).view(np.uint32)
    _x_to_bf16_kernel[(n + THREADS - 1) // THREADS, THREADS, stream or 0](x, out32)
