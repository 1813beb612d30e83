"""Random weights built on the device (benchmarks of real shapes without moving gigabytes).

A counter-based hash (splitmix64 of seed and index) gives four uniforms per element; their
centred sum (Irwin-Hall) approximates a normal. Deterministic for a given seed.
"""
from __future__ import annotations

import numpy as np
from numba import cuda
from kernels_numba.jit import kernel as cached_jit

from kernels_numba.bf16 import f32_to_bf16


@cuda.jit(device=True)
def _splitmix(x):
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    return x ^ (x >> np.uint64(31))


@cached_jit
def _fill_normal_bf16_kernel(out, seed, std, mean):
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, out.shape[0], stride):
        h = _splitmix(np.uint64(seed) * np.uint64(0x100000001B3) + np.uint64(i))
        s = np.float32(0.0)
        for j in range(4):
            s += np.float32((h >> np.uint64(16 * j)) & np.uint64(0xFFFF)) * np.float32(1.0 / 65536.0)
        z = (s - np.float32(2.0)) * np.float32(1.7320508)   # var of a sum of 4 U(0,1) is 1/3
        out[i] = f32_to_bf16(mean + std * z)


def fill_normal_bf16(out_flat_u16, seed: int, std: float, mean: float = 0.0, stream=0) -> None:
    """out (1-D uint16 view) = bf16 bits of approximately N(mean, std^2) values."""
    n = out_flat_u16.shape[0]
    blocks = min(132 * 16, max(1, -(-n // 256)))
    _fill_normal_bf16_kernel[blocks, 256, stream](out_flat_u16, np.uint64(seed), np.float32(std), np.float32(mean))
