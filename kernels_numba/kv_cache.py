"""Store this step's K/V (float32) into the paged bf16 cache of one layer.

Cache layer layout: uint16 [num_blocks, block_size, num_kv_heads, head_dim]; token t goes to slot
slot_mapping[t] = block_id * block_size + offset; slot -1 = skip. One block per token.
"""

from __future__ import annotations

import numpy as np
from numba import cuda
from kernels_numba.jit import kernel as cached_jit

from kernels_numba.ptx import grid_trigger, grid_wait
from kernels_numba.bf16 import SIMULATOR, f32_to_bf16, to_bf16_bits

THREADS = 32 if SIMULATOR else 256


@cached_jit
def _store_kv_kernel(k, v, slot_mapping, k_cache, v_cache):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    t = cuda.blockIdx.x
    slot = slot_mapping[t]
    if slot < 0:
        return
    bs = k_cache.shape[1]
    blk = slot // bs
    off = slot - blk * bs
    hk = k.shape[1]
    hd = k.shape[2]
    for i in range(cuda.threadIdx.x, hk * hd, cuda.blockDim.x):
        h = i // hd
        d = i - h * hd
        k_cache[blk, off, h, d] = f32_to_bf16(k[t, h, d])
        v_cache[blk, off, h, d] = f32_to_bf16(v[t, h, d])


def store_kv(k, v, slot_mapping, k_cache_layer, v_cache_layer, stream=0) -> None:
    """k, v: float32 [T, Hk, hd] (any strides); slot_mapping: int32 [T]; caches: uint16 [NB, BS, Hk, hd]."""
    if k.shape[0] == 0:
        return
    _store_kv_kernel[k.shape[0], THREADS, stream](k, v, slot_mapping, k_cache_layer, v_cache_layer)


def store_kv_ref(k, v, slot_mapping, k_cache_layer: np.ndarray, v_cache_layer: np.ndarray) -> None:
    """In place on NumPy caches."""
    bs = k_cache_layer.shape[1]
    for t, slot in enumerate(np.asarray(slot_mapping)):
        if slot < 0:
            continue
        k_cache_layer[slot // bs, slot % bs] = to_bf16_bits(k[t])
        v_cache_layer[slot // bs, slot % bs] = to_bf16_bits(v[t])
