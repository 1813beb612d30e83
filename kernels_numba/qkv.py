"""Fused attention input: split the QKV projection, (optional) per-head q/k RMSNorm, RoPE,
store K/V into the paged bf16 cache, write rotated Q. One launch per layer instead of three.

qkv [T, Hq*hd + 2*Hk*hd] f32 (q | k | v columns); grid (T, Hq + 2*Hk), block hd/2 threads,
each thread owning one rotation pair. RoPE pairs: interleaved (x[2i], x[2i+1]) for GGUF llama
weights, half-split (x[i], x[i+hd/2]) for Hugging Face weights. slot_mapping[t] = -1 skips the
store (padding rows of a CUDA graph). q_norm/k_norm are used only when has_qk_norm (Qwen3).
Partial RoPE (cos/sin tables [max_pos, rot/2] with rot < hd, Qwen3-Next): the first rot dims
rotate (half-split pairs (x[i], x[i+rot/2])), the others pass through.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda
from kernels_numba.jit import kernel as cached_jit

from kernels_numba.ptx import grid_trigger, grid_wait
from kernels_numba.bf16 import SIMULATOR, block_sum, f32_to_bf16

SCRATCH = 1024 if SIMULATOR else 32


@cached_jit
def _qkv_rope_store_kernel(qkv, positions, cos, sin, slot_mapping, q_norm, k_norm, has_qk_norm, eps,
                           interleaved, q_out, k_cache, v_cache):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    scratch = cuda.shared.array(SCRATCH, np.float32)
    t = cuda.blockIdx.x
    hh = cuda.blockIdx.y
    i = cuda.threadIdx.x
    hq = q_out.shape[1]
    hk = k_cache.shape[2]
    hd = q_out.shape[2]
    half = hd // 2
    rh = cos.shape[1]                       # rotated pairs: rot/2 (< half with partial RoPE)
    if interleaved or i >= rh:              # i >= rh: a pass-through pair of partial RoPE
        a = 2 * i
        b = 2 * i + 1
    else:
        a = i
        b = i + rh
    block_size = k_cache.shape[1]
    slot = slot_mapping[t]
    if hh >= hq + hk:                       # V head: copy into the cache
        base = hq * hd + hk * hd + (hh - hq - hk) * hd
        if slot >= 0 and i < half:
            blk = slot // block_size
            off = slot % block_size
            v_cache[blk, off, hh - hq - hk, i] = f32_to_bf16(qkv[t, base + i])
            v_cache[blk, off, hh - hq - hk, i + half] = f32_to_bf16(qkv[t, base + i + half])
        return
    is_q = hh < hq
    base = hh * hd if is_q else hq * hd + (hh - hq) * hd
    x0 = np.float32(0.0)
    x1 = np.float32(0.0)
    if i < half:
        x0 = qkv[t, base + a]
        x1 = qkv[t, base + b]
    if has_qk_norm:                          # block-uniform branch: the reduction is collective
        ss = block_sum(x0 * x0 + x1 * x1, scratch)
        inv = np.float32(1.0) / math.sqrt(ss / np.float32(hd) + eps)
        if i < half:
            if is_q:
                x0 = x0 * inv * q_norm[a]
                x1 = x1 * inv * q_norm[b]
            else:
                x0 = x0 * inv * k_norm[a]
                x1 = x1 * inv * k_norm[b]
    if i >= half:
        return
    r0 = x0
    r1 = x1
    if i < rh:
        pos = positions[t]
        c = cos[pos, i]
        s = sin[pos, i]
        r0 = x0 * c - x1 * s
        r1 = x0 * s + x1 * c
    if is_q:
        q_out[t, hh, a] = r0
        q_out[t, hh, b] = r1
    elif slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        k_cache[blk, off, hh - hq, a] = f32_to_bf16(r0)
        k_cache[blk, off, hh - hq, b] = f32_to_bf16(r1)


def qkv_rope_store(qkv, positions, cos, sin, slot_mapping, q_out, k_cache_layer, v_cache_layer, *,
                   interleaved: bool, q_norm=None, k_norm=None, eps: float = 1e-6, stream=0) -> None:
    """q_out [T, Hq, hd] f32; k/v_cache_layer [num_blocks, block_size, Hk, hd] uint16 (bf16)."""
    T, hq, hd = q_out.shape
    hk = k_cache_layer.shape[2]
    has_norm = q_norm is not None
    if not has_norm:   # unused arguments still need arrays of the right type
        q_norm = k_norm = cos[0]
    threads = max(32, (hd // 2 + 31) // 32 * 32)
    _qkv_rope_store_kernel[(T, hq + 2 * hk), threads, stream](
        qkv, positions, cos, sin, slot_mapping, q_norm, k_norm, has_norm, np.float32(eps),
        interleaved, q_out, k_cache_layer, v_cache_layer)


def qkv_rope_store_ref(qkv, positions, cos, sin, slot_mapping, hq: int, hk: int, hd: int,
                       k_cache_layer: np.ndarray, v_cache_layer: np.ndarray, *, interleaved: bool,
                       q_norm=None, k_norm=None, eps: float = 1e-6) -> np.ndarray:
    """Returns rotated q [T, Hq, hd] (float64); stores bf16-rounded K/V into the given caches."""
    from kernels_numba.bf16 import to_bf16_bits
    T = qkv.shape[0]
    x = np.asarray(qkv, dtype=np.float64)
    q = x[:, :hq * hd].reshape(T, hq, hd)
    k = x[:, hq * hd:(hq + hk) * hd].reshape(T, hk, hd)
    v = x[:, (hq + hk) * hd:].reshape(T, hk, hd)
    if q_norm is not None:
        q = q / np.sqrt((q * q).mean(-1, keepdims=True) + eps) * q_norm
        k = k / np.sqrt((k * k).mean(-1, keepdims=True) + eps) * k_norm
    c = np.asarray(cos, np.float64)[positions][:, None, :]
    s = np.asarray(sin, np.float64)[positions][:, None, :]

    def rot(z):
        rd = 2 * c.shape[-1]                 # partial RoPE: dims from rd on pass through
        if rd < z.shape[-1]:
            return np.concatenate([rot(z[..., :rd]), z[..., rd:]], axis=-1)
        out = np.empty_like(z)
        if interleaved:
            z0, z1 = z[..., 0::2], z[..., 1::2]
            out[..., 0::2], out[..., 1::2] = z0 * c - z1 * s, z0 * s + z1 * c
        else:
            h = z.shape[-1] // 2
            z0, z1 = z[..., :h], z[..., h:]
            out[..., :h], out[..., h:] = z0 * c - z1 * s, z0 * s + z1 * c
        return out

    q, k = rot(q), rot(k)
    bs = k_cache_layer.shape[1]
    for t in range(T):
        slot = int(slot_mapping[t])
        if slot >= 0:
            k_cache_layer[slot // bs, slot % bs] = to_bf16_bits(k[t])
            v_cache_layer[slot // bs, slot % bs] = to_bf16_bits(v[t])
    return q


@cached_jit
def _gather_rows_kernel(x, rows, out):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    r = cuda.blockIdx.x
    src = rows[r]
    for d in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
        out[r, d] = x[src, d]


def gather_rows(x, rows, out, stream=0) -> None:
    """out[r] = x[rows[r]]: the hidden rows that need logits."""
    if out.shape[0]:
        _gather_rows_kernel[out.shape[0], 128, stream](x, rows, out)


def gather_rows_ref(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    return np.asarray(x)[np.asarray(rows)]
