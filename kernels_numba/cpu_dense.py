"""A dense decoder layer's three fused steps on the CPU, each one Numba call (the Ops that
metrale/models/llama.py calls per layer): the products of kernels_numba/cpu_quant.py and the layer
kernels of cpu_layers.py composed inside Numba, so a layer costs three dispatches from Python
instead of seven and none of their glue (its measured gain: docs/cpu.md).

  attn_in    RMSNorm -> qkv product (+ bias) -> per-head norms, RoPE, K/V into the paged cache -> q
  attn_out   paged attention -> o product + residual
  mlp        RMSNorm -> gate|up product -> silu * mul -> down product + residual

Each weight is one kind group of cpu_quant.matmul_into (its parts tuple, count and first columns;
CpuOps takes the unfused road for a matrix of several kinds). `road` picks the products' kernel by
its type, when Numba types the call (so the other is not compiled): an int8 array (Q8, any length)
matmul_q8_into, a float32 one (F32) matmul_into; parts regrouped by cpu_x16 take matmul_x16_into. Small batches run the row-wise kernels on the
calling thread, as cpu_layers does.

Cached on disk with the other CPU kernels (cpu_cache.py: stamped by all of cpu_*.py, since these
call into two other modules).
References: the unfused composition (tests/test_cpu_dense.py compares them).
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.np.ufunc.parallel import _launch_threads
from numba.extending import overload

from kernels_numba import cpu_layers as L
from kernels_numba import cpu_quant as Q
from kernels_numba import cpu_x16 as X
from kernels_numba.cpu_cache import CACHE

Q8, F32 = np.zeros(0, np.int8), np.zeros(0, np.float32)     # the two values of `road`

# These cached functions call parallel kernels; loaded from the disk cache, a caller does not start
# Numba's threading layer for them (numba#8578): its first call then crashed or returned garbage
# unless a parallel kernel had run first. Started here, before any of them can run.
_launch_threads()


def _product(parts, count, cols, x, norm, eps, normed, residual, y, road):
    raise NotImplementedError("called from Numba only")


@overload(_product)
def _product_road(parts, count, cols, x, norm, eps, normed, residual, y, road):
    if X._x16_kind(parts.dtype) is not None:
        def x16(parts, count, cols, x, norm, eps, normed, residual, y, road):
            xq = np.empty(x.shape, np.int8)
            xs = np.empty((x.shape[0], x.shape[1] // 32, 2), np.float32)       # X.scales_shape
            X.matmul_x16_into(parts, count, cols, x, norm, eps, normed, xq, xs, residual, y)
        return x16
    if isinstance(road, types.Array) and road.dtype == types.int8:
        def q8(parts, count, cols, x, norm, eps, normed, residual, y, road):
            xq = np.empty(x.shape, np.int8)
            xs = np.empty((x.shape[0], (x.shape[1] // 32 + 1) // 2, Q.Q8_LANES), np.float32)   # Q.q8_scales_shape
            Q.matmul_q8_into(parts, count, cols, x, norm, eps, normed, xq, xs, residual, y)
        return q8

    def f32(parts, count, cols, x, norm, eps, normed, residual, y, road):
        Q.matmul_into(parts, count, cols, x, norm, eps, normed, residual, y)
    return f32


@njit(cache=CACHE, error_model="numpy")
def attn_in(x, norm, eps, parts, count, cols, bias, cos, sin, interleaved, q_norm, k_norm, slots,
            k_flat, v_flat, q_out, road):
    """q_out [T, Hq, hd] and the batch's K/V from the residual stream x [T, D]."""
    T = x.shape[0]
    Hq, hd, Hk = q_out.shape[1], q_out.shape[2], k_flat.shape[1]
    qkv = np.empty((T, (Hq + 2 * Hk) * hd), np.float32)
    _product(parts, count, cols, x, norm, eps, np.empty_like(x), np.empty((0, 0), np.float32), qkv, road)
    if bias.shape[0]:
        for t in range(T):
            qkv[t] += bias
    if T >= L.PARALLEL_MIN_ROWS:
        L._rope_parallel(qkv, cos, sin, interleaved, q_norm, k_norm, eps, slots, k_flat, v_flat, q_out)
    else:
        L._rope_serial(qkv, cos, sin, interleaved, q_norm, k_norm, eps, slots, k_flat, v_flat, q_out)


@njit(cache=CACHE, error_model="numpy")
def attn_out(q, k_cache, v_cache, block_tables, seq_start, positions, window, scale, parallel,
             parts, count, cols, residual, road):
    """residual + attention(q) @ W_o.T, [T, D]."""
    T = q.shape[0]
    att = np.empty(q.shape, np.float32)
    if parallel:
        L._attention_parallel(q, k_cache, v_cache, block_tables, seq_start, positions, window, scale, att)
    else:
        L._attention_serial(q, k_cache, v_cache, block_tables, seq_start, positions, window, scale, att)
    flat = att.reshape(T, q.shape[1] * q.shape[2])
    y = np.empty(residual.shape, np.float32)
    _product(parts, count, cols, flat, np.empty(0, np.float32), 0.0, flat, residual, y, road)
    return y


@njit(cache=CACHE, error_model="numpy")
def mlp(x, norm, eps, gu_parts, gu_count, gu_cols, ffn, dn_parts, dn_count, dn_cols, road):
    """x + down(silu(gate) * up) of RMSNorm(x), [T, D]; ffn the intermediate size."""
    T = x.shape[0]
    gu = np.empty((T, 2 * ffn), np.float32)
    _product(gu_parts, gu_count, gu_cols, x, norm, eps, np.empty_like(x), np.empty((0, 0), np.float32), gu, road)
    act = np.empty((T, ffn), np.float32)
    if T >= L.PARALLEL_MIN_ROWS:
        L._silu_mul_parallel(gu, act)
    else:
        L._silu_mul_serial(gu, act)
    y = np.empty(x.shape, np.float32)
    _product(dn_parts, dn_count, dn_cols, act, np.empty(0, np.float32), 0.0, act, x, y, road)
    return y


@njit(cache=CACHE, error_model="numpy")
def layers(x, stack, count, num_heads, eps, cos, sin, interleaved, slots, k_pool, v_pool, block_tables, seq_start,
           positions, scale, parallel, road):
    """The first `count` layers of `stack` on the residual stream x [T, D], each attn_in -> attn_out
    -> mlp, in one call (no Python between layers). stack: one tuple a layer, (attn_norm, qkv parts,
    count, cols, qkv bias, q_norm, k_norm, o parts, count, cols, mlp_norm, gate_up parts, count,
    cols, ffn, down parts, count, cols, window) as CpuOps.dense_layers builds it; k_pool, v_pool
    [layers, blocks, block_size, kv heads, head_dim]."""
    T = x.shape[0]
    Hk, hd = k_pool.shape[3], k_pool.shape[4]
    for i in range(count):
        s = stack[i]
        k, v = k_pool[i], v_pool[i]
        q = np.empty((T, num_heads, hd), np.float32)
        attn_in(x, s[0], eps, s[1], s[2], s[3], s[4], cos, sin, interleaved, s[5], s[6], slots,
                k.reshape(-1, Hk, hd), v.reshape(-1, Hk, hd), q, road)
        x = attn_out(q, k, v, block_tables, seq_start, positions, s[18], scale, parallel, s[7], s[8], s[9], x, road)
        x = mlp(x, s[10], eps, s[11], s[12], s[13], s[14], s[15], s[16], s[17], road)
    return x
