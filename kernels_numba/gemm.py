"""Matrix products of the forward: out[T, N] = x[T, K] @ w[N, K].T (+ bias), or out += x @ w.T.

x float32 [T, K]; w bf16 bits as uint16 [N, K], row-major (PyTorch Linear layout); out float32
[T, N]; bias float32 [N] or None. Accumulation is fp32. The tensor-core paths round x to bf16
(round to nearest even) on the way in, as any bf16 GEMM does; the FMA path keeps x in fp32.

Paths, chosen by `pick_path(T, N, K)` in `linear` / `linear_residual` (FMA_MAX_T and
SKINNY_MAX_T are module constants, each call may override them or force a `path`):
  T <= FMA_MAX_T (1)   `fma`:    GEMV, one warp per output row n; 16-byte weight loads (the next
                                 ones in flight while these are used), x applied with FMAs in
                                 fp32, warp-shuffle sum. Compiled per T.
  T <= SKINNY_MAX_T    `skinny`: streaming mma: weights go from HBM straight into mma.sync B
   and skinny_cfg()              fragments (16 bytes a lane a load, no shared memory); x is the
   has a config                  A operand, read through L1 and rounded to bf16; a block owns a
                                 slab of 16*mt rows of x and 8*nt rows of w, its 8 warps split
                                 K and meet in shared memory. Memory-bound by design.
  otherwise            `tiled`:  mma.sync m16n8k16 bf16 GEMM, block tile 64 x 128 x 32, 8 warps,
                                 smem double buffer filled from registers (x converted to bf16
                                 while staging), grouped tile order for L2 reuse.
Both mma paths consume 32 consecutive k at a time with k permuted inside the mma (lane (g, t)
holds k = 8t..8t+7 of its rows, one 16-byte access), which gives conflict-free 16-byte shared
loads without ldmatrix; the permutation is the same for A and B, so the sum is unchanged.

Contracts: K % 64 == 0 and N % 64 == 0 (asserted); any T >= 0. x, w and out are C-contiguous
with 16-byte aligned rows (true of any device allocation and of row slices of one). The kernels
allocate nothing; launchers take an optional Numba stream. `linear_residual` reads out, so x and
out must not alias.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, uint32, uint64
from kernels_numba.jit import kernel as cached_jit

from kernels_numba.bf16 import f32_to_bf16
from kernels_numba.ptx import grid_trigger, grid_trigger_early, grid_trigger_late, grid_wait
from kernels_numba.ptx import (SIM, bf16_bits_to_f32, bf16hi_f32, bf16lo_f32, f32_to_bf16_bits,
                               ldg_f32x4, ldg_u16x8, lds_u32x4, mma_bf16_16816, pack_bf16x2,
                               prefetch_l2, sts_u32x4, warp_sum_f32)

__all__ = ["linear", "linear_residual", "linear_ref", "FMA_MAX_T", "SKINNY_MAX_T", "pick_path",
           "fma_path", "skinny_path", "tiled_path", "skinny_cfg", "f32_to_bf16_bits",
           "bf16_bits_to_f32", "gemv", "gemv_path", "gemv_cfg", "gemv_ref", "PROLOGUES"]

FMA_MAX_T = 1          # T <= this: fma GEMV
# Carried sums of squares (gemv ss_out -> rmsnorm_ss) are uint64 fixed point, sum * SS_SCALE: integer
# atomics add in any order to the same bits, so a greedy decode is reproducible run to run (float
# atomics were not: the order of the blocks' adds changed the last bits of the norm and, over a few
# hundred tokens, a near-tie argmax). Resolution 1.5e-5, range 2.8e14: a 4096-wide residual of RMS
# 1e-2 .. 1e5 keeps float32-level relative precision.
SS_SCALE = 65536.0
SS_UNIT = 1.0 / SS_SCALE


def ss_fixed(sum_sq: float) -> np.uint64:
    """Host: a sum of squares as the carried fixed-point value (an ss_in element)."""
    return np.uint64(round(float(sum_sq) * SS_SCALE))


def ss_value(fixed) -> float:
    """Host: a carried fixed-point sum of squares back as a float."""
    return float(np.uint64(fixed)) * SS_UNIT


SKINNY_MAX_T = 256     # T <= this (and > FMA_MAX_T): streaming mma; above: tiled
SKINNY_WARPS = 8       # warps splitting K inside one skinny block
FMA_WARPS = 4          # rows of w per fma block
FMA_UNROLL = 2         # 16-byte weight loads in flight per lane (2 and 4 measured equal)
GROUP_M = 8            # tiled path: m-tiles per group in the grouped (L2-friendly) order
TILED_THREADS = 256
SMEM_ALIGN = None if SIM else 16   # 16-byte vector access to shared memory (cudasim rejects it)


# ----------------------------------------------------------------------------- reference
def linear_ref(x: np.ndarray, w_u16: np.ndarray, bias: np.ndarray | None = None,
               residual: np.ndarray | None = None) -> np.ndarray:
    """float64 x @ bf16(w).T (+ bias) (+ residual); the oracle every path is checked against."""
    y = np.asarray(x, np.float64) @ bf16_bits_to_f32(w_u16).astype(np.float64).T
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    if residual is not None:
        y = y + np.asarray(residual, np.float64)
    return y


# ----------------------------------------------------------------------------- fma GEMV
def _make_fma(TT: int, W: int, U: int, has_bias: bool, accumulate: bool):
    """One warp per row n of w; a lane takes 8-wide k chunks lane, lane+32, ...; U chunks
    (U 16-byte loads) are in flight per lane while the previous U are being used."""
    NW = 4 * U

    def gemv_fma(x, w, out, bias):
        grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
        grid_trigger()
        K = x.shape[1]
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        n = cuda.blockIdx.x * W + warp
        acc = cuda.local.array(TT, float32)
        for i in range(TT):
            acc[i] = float32(0.0)
        wr = cuda.local.array(NW, uint32)
        wc = cuda.local.array(NW, uint32)
        zero = uint32(0)
        nch = K >> 3
        step = 32 * U
        iters = (nch + step - 1) // step
        for u in range(U):
            q = ldg_u16x8(w, n, 8 * min(lane + 32 * u, nch - 1))
            for e in range(4):
                wr[4 * u + e] = q[e]
        for it in range(iters):
            for u in range(U):
                ok = it * step + 32 * u + lane < nch
                for e in range(4):
                    wc[4 * u + e] = wr[4 * u + e] if ok else zero
            if it + 1 < iters:
                for u in range(U):
                    q = ldg_u16x8(w, n, 8 * min((it + 1) * step + 32 * u + lane, nch - 1))
                    for e in range(4):
                        wr[4 * u + e] = q[e]
            for u in range(U):
                k8 = 8 * min(it * step + 32 * u + lane, nch - 1)
                w0 = bf16lo_f32(wc[4 * u])
                w1 = bf16hi_f32(wc[4 * u])
                w2 = bf16lo_f32(wc[4 * u + 1])
                w3 = bf16hi_f32(wc[4 * u + 1])
                w4 = bf16lo_f32(wc[4 * u + 2])
                w5 = bf16hi_f32(wc[4 * u + 2])
                w6 = bf16lo_f32(wc[4 * u + 3])
                w7 = bf16hi_f32(wc[4 * u + 3])
                for tt in range(TT):
                    xa = ldg_f32x4(x, tt, k8)
                    xb = ldg_f32x4(x, tt, k8 + 4)
                    s = acc[tt]
                    s += w0 * xa[0] + w1 * xa[1] + w2 * xa[2] + w3 * xa[3]
                    s += w4 * xb[0] + w5 * xb[1] + w6 * xb[2] + w7 * xb[3]
                    acc[tt] = s
        for tt in range(TT):
            s = warp_sum_f32(acc[tt])
            if lane == 0:
                if has_bias:
                    s += bias[n]
                if accumulate:
                    out[tt, n] += s
                else:
                    out[tt, n] = s

    return gemv_fma


# ----------------------------------------------------------------------------- T = 1 GEMV
# with a fused input transform (prologue), R rows of w per warp, x through L1 or shared memory
PROLOGUES = {"plain": 0, "rmsnorm": 1, "silu_mul": 2, "rmsnorm_ss": 3}
GEMV_SMEM_MAX_K = 12288     # x staged in shared memory as float32: 48 KB of static shared memory


def gemv_ref(x, w_u16, prologue: str = "plain", norm_w=None, eps: float = 1e-6, bias=None,
             residual=None) -> np.ndarray:
    """float64 oracle of `gemv`: the prologue applied to x [1, K] (or [1, 2K] for silu_mul),
    then linear_ref."""
    x = np.asarray(x, np.float64)
    if prologue in ("rmsnorm", "rmsnorm_ss"):     # rmsnorm_ss: the same norm, its sum given
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(norm_w, np.float64)
    elif prologue == "silu_mul":
        k = x.shape[1] // 2
        g, u = x[:, :k], x[:, k:]
        x = g / (1.0 + np.exp(-g)) * u
    elif prologue != "plain":
        raise ValueError(f"unknown gemv prologue '{prologue}'")
    return linear_ref(x, w_u16, bias, residual)


def _make_gemv(W: int, R: int, U: int, P: int, KS: int, has_bias: bool, accumulate: bool, SQ: bool = False,
               GLU: bool = False, ROPE: int = 0, PF: bool = False):
    """T = 1 GEMV, R consecutive rows of w per warp (W warps a block): a lane takes 8-wide k
    chunks lane, lane+32, ...; U chunks of each of its R rows in flight (16-byte loads) while the
    previous U are used. The 8 x values of a chunk are fetched once and used for R rows.
    P (prologue, PROLOGUES): 0 x as is; 1 rmsnorm: the block first reduces sum(x^2) (x [1, K]),
    then uses x * rsqrt(mean + eps) * norm_w; 2 silu_mul: x [1, 2K] = [gate | up], uses
    silu(gate) * up; 3 rmsnorm_ss: as 1 with sum(x^2) read from ss_in[0] (written by the kernel that
    produced x: no reduction, no barrier; fixed point, see SS_SCALE). SQ: the epilogue adds the sum
    of squares of the values it writes (after the residual add) into ss_out[0], one integer atomic
    per block, for the next
    kernel's rmsnorm_ss. KS > 0: the transformed x is staged once per block in shared memory as
    float32 in dynamic shared memory (K floats, the launch passes 4K bytes; stored permuted,
    element e of chunk c at e * K/8 + c, so the lanes' scalar shared loads are conflict free);
    KS == 0: x is read (and transformed) per chunk through L1. GLU (R = 2; no bias, accumulate, SQ):
    w is [gate | up] (2I rows); warp j takes gate row n = block * W + j and up row I + n and writes
    out[0, n] = silu(gate) * up: the swiglu activation as the epilogue of the gate_up product.
    ROPE (R = 2; no accumulate, SQ; 1 half-split pairs, 2 interleaved): w is the fused QKV
    projection [(Hq + 2Hk) hd, K]; warp j takes one rotation pair (a, b) of one head (as
    qkv.qkv_rope_store: (i, i + rot/2), or (2i, 2i + 1) interleaved and for partial RoPE's
    pass-through dims) and writes, at the step's position pos[0] and slot slots[0]: q rotated into
    out [1, Hq hd], k rotated and v as they are into the bf16 caches [blocks, block_size, Hk, hd]
    (slot -1: no store). The attention input in the projection's launch: no qkv buffer, no
    rope/store kernel. PF (plain row layout only): before the PDL wait the block also prefetches all
    of its rows into L2 (`prefetch.global.L2`, one 128-byte line a thread at a time), so that weights
    stream from HBM while the kernels before it are latency-bound (o_proj after decode attention),
    and the product after the wait reads L2."""
    NT = 32 * W
    NWR = 4 * U * R
    RPW = 1 if GLU else R           # outputs a warp writes

    def gemv(x, w, out, bias, nw, eps, ss_in, ss_out, pos, cos, sin, slots, k_cache, v_cache):
        K = w.shape[1]
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        n0 = (cuda.blockIdx.x * W + warp) * RPW
        rs = (w.shape[0] >> 1) if GLU else 1   # row stride between a warp's rows
        hd = half = rh = hh = ip = pa = 0
        if ROPE:
            hd = k_cache.shape[3]
            half = hd >> 1
            rh = cos.shape[1]
            j = cuda.blockIdx.x * W + warp
            hh = j // half
            ip = j - hh * half
            pa = 2 * ip
            if ROPE == 1 and ip < rh:
                pa = ip
            n0 = hh * hd + pa
            rs = rh if (ROPE == 1 and ip < rh) else 1
        nch = K >> 3
        red = cuda.shared.array(32, float32)
        xs = cuda.shared.array(0, float32)
        wr = cuda.local.array(NWR, uint32)
        wc = cuda.local.array(NWR, uint32)
        # the first weight loads go out before the PDL wait (no earlier kernel writes weights: under
        # an early trigger they fly while the previous kernel drains) and before the prologue, whose
        # reduction / staging (x from L1/L2) runs while they are in flight
        for u in range(U):
            kc = 8 * min(lane + 32 * u, nch - 1)
            for r in range(R):
                q = ldg_u16x8(w, n0 + r * rs, kc)
                for e in range(4):
                    wr[(u * R + r) * 4 + e] = q[e]
        if PF:
            lines = K >> 6                                  # 128-byte lines a row (64 bf16)
            rb = cuda.blockIdx.x * (W * R)
            for i in range(tid, W * R * lines, NT):
                rr = i // lines
                prefetch_l2(w, rb + rr, (i - rr * lines) << 6)
        grid_wait()      # PDL: before any read of what an earlier kernel wrote (x, out, ss_in)
        grid_trigger_early()
        scale = float32(1.0)
        if P == 1:
            ss = float32(0.0)
            for k in range(tid, K, NT):
                v = x[0, k]
                ss += v * v
            ss = warp_sum_f32(ss)
            if lane == 0:
                red[warp] = ss
            cuda.syncthreads()
            tot = float32(0.0)
            for i in range(W):
                tot += red[i]
            scale = float32(1.0) / math.sqrt(tot / float32(K) + eps)
        elif P == 3:
            scale = float32(1.0) / math.sqrt(float32(ss_in[0]) * float32(SS_UNIT) / float32(K) + eps)
        if KS > 0:
            for i in range(tid, K, NT):
                e = i // nch
                c = i - e * nch
                k = 8 * c + e
                if P == 1 or P == 3:
                    xs[i] = x[0, k] * scale * nw[0, k]
                elif P == 2:
                    g = x[0, k]
                    xs[i] = g / (float32(1.0) + math.exp(-g)) * x[0, K + k]
                else:
                    xs[i] = x[0, k]
            cuda.syncthreads()
        acc = cuda.local.array(R, float32)
        for r in range(R):
            acc[r] = float32(0.0)
        xv = cuda.local.array(8, float32)
        zero = uint32(0)
        step = 32 * U
        iters = (nch + step - 1) // step
        for it in range(iters):
            for u in range(U):
                ok = it * step + 32 * u + lane < nch
                for r in range(R):
                    for e in range(4):
                        o = (u * R + r) * 4 + e
                        wc[o] = wr[o] if ok else zero
            if it + 1 < iters:
                for u in range(U):
                    kc = 8 * min((it + 1) * step + 32 * u + lane, nch - 1)
                    for r in range(R):
                        q = ldg_u16x8(w, n0 + r * rs, kc)
                        for e in range(4):
                            wr[(u * R + r) * 4 + e] = q[e]
            for u in range(U):
                c = min(it * step + 32 * u + lane, nch - 1)
                k8 = 8 * c
                if KS > 0:
                    for e in range(8):
                        xv[e] = xs[e * nch + c]
                else:
                    xa = ldg_f32x4(x, 0, k8)
                    xb = ldg_f32x4(x, 0, k8 + 4)
                    for e in range(4):
                        xv[e] = xa[e]
                        xv[4 + e] = xb[e]
                    if P == 1 or P == 3:
                        na = ldg_f32x4(nw, 0, k8)
                        nb = ldg_f32x4(nw, 0, k8 + 4)
                        for e in range(4):
                            xv[e] = xv[e] * scale * na[e]
                            xv[4 + e] = xv[4 + e] * scale * nb[e]
                    elif P == 2:
                        ua = ldg_f32x4(x, 0, K + k8)
                        ub = ldg_f32x4(x, 0, K + k8 + 4)
                        for e in range(4):
                            g = xv[e]
                            xv[e] = g / (float32(1.0) + math.exp(-g)) * ua[e]
                            g = xv[4 + e]
                            xv[4 + e] = g / (float32(1.0) + math.exp(-g)) * ub[e]
                for r in range(R):
                    o = (u * R + r) * 4
                    s = acc[r]
                    s += bf16lo_f32(wc[o]) * xv[0] + bf16hi_f32(wc[o]) * xv[1]
                    s += bf16lo_f32(wc[o + 1]) * xv[2] + bf16hi_f32(wc[o + 1]) * xv[3]
                    s += bf16lo_f32(wc[o + 2]) * xv[4] + bf16hi_f32(wc[o + 2]) * xv[5]
                    s += bf16lo_f32(wc[o + 3]) * xv[6] + bf16hi_f32(wc[o + 3]) * xv[7]
                    acc[r] = s
        grid_trigger_late()      # PDL 'late': the successor's blocks start during this epilogue
        if GLU:
            g = warp_sum_f32(acc[0])
            u = warp_sum_f32(acc[1])
            if lane == 0:
                out[0, n0] = g / (float32(1.0) + math.exp(-g)) * u
            return
        if ROPE:
            x0 = warp_sum_f32(acc[0])
            x1 = warp_sum_f32(acc[1])
            if lane == 0:
                if has_bias:
                    x0 += bias[n0]
                    x1 += bias[n0 + rs]
                hq = out.shape[1] // hd
                hk = k_cache.shape[2]
                if hh < hq + hk and ip < rh:
                    p = pos[0]
                    c = cos[p, ip]
                    sn = sin[p, ip]
                    r0 = x0 * c - x1 * sn
                    x1 = x0 * sn + x1 * c
                    x0 = r0
                pb = pa + rs
                if hh < hq:
                    out[0, hh * hd + pa] = x0
                    out[0, hh * hd + pb] = x1
                else:
                    slot = slots[0]
                    if slot >= 0:
                        bs = k_cache.shape[1]
                        blk = slot // bs
                        off = slot - blk * bs
                        if hh < hq + hk:
                            k_cache[blk, off, hh - hq, pa] = f32_to_bf16(x0)
                            k_cache[blk, off, hh - hq, pb] = f32_to_bf16(x1)
                        else:
                            v_cache[blk, off, hh - hq - hk, pa] = f32_to_bf16(x0)
                            v_cache[blk, off, hh - hq - hk, pb] = f32_to_bf16(x1)
            return
        sq = float32(0.0)
        for r in range(R):
            s = warp_sum_f32(acc[r])
            if lane == 0:
                n = n0 + r
                if has_bias:
                    s += bias[n]
                if accumulate:
                    s += out[0, n]
                out[0, n] = s
                sq += s * s
        if SQ:
            if P == 1:
                cuda.syncthreads()         # red[] held the prologue's partial sums
            if lane == 0:
                red[warp] = sq
            cuda.syncthreads()
            if tid == 0:
                tot = float32(0.0)
                for i in range(W):
                    tot += red[i]
                cuda.atomic.add(ss_out, 0, uint64(tot * float32(SS_SCALE) + float32(0.5)))

    return gemv


# ----------------------------------------------------------------------------- skinny mma
def _make_skinny(MT: int, NT: int, W: int, U: int, has_bias: bool, accumulate: bool):
    """Block = a slab of 16*MT rows of x times 8*NT rows of w; its W warps split K in 32-wide
    chunks (U per warp per step, the next step's weights in flight while this one computes);
    partial sums meet in shared memory. Slabs of one w tile are adjacent block ids, so they
    run together and share the tile through L2."""
    BNS = 8 * NT
    BMS = 16 * MT
    NACC = 4 * NT * MT
    NTHR = 32 * W
    RED = W * BMS * BNS
    NW = 4 * NT * U
    NAF = 8 * MT

    def gemm_skinny(x, w, out, bias):
        grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
        grid_trigger()
        T = x.shape[0]
        K = x.shape[1]
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        S = (T + BMS - 1) // BMS
        bid = cuda.blockIdx.x
        nb = bid // S
        m0 = (bid - nb * S) * BMS
        n0 = nb * BNS
        red = cuda.shared.array(RED, float32)
        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = float32(0.0)
        wr = cuda.local.array(NW, uint32)
        wc = cuda.local.array(NW, uint32)
        af = cuda.local.array(NAF, uint32)
        zero = uint32(0)
        nch = K >> 5
        step = W * U
        iters = (nch + step - 1) // step
        for u in range(U):
            kk = min(u * W + warp, nch - 1) * 32 + 8 * t
            for j in range(NT):
                q = ldg_u16x8(w, n0 + 8 * j + g, kk)
                for e in range(4):
                    wr[(u * NT + j) * 4 + e] = q[e]
        for it in range(iters):
            for u in range(U):
                ok = it * step + u * W + warp < nch
                for j in range(NT):
                    for e in range(4):
                        o = (u * NT + j) * 4 + e
                        wc[o] = wr[o] if ok else zero
            if it + 1 < iters:
                for u in range(U):
                    kk = min((it + 1) * step + u * W + warp, nch - 1) * 32 + 8 * t
                    for j in range(NT):
                        q = ldg_u16x8(w, n0 + 8 * j + g, kk)
                        for e in range(4):
                            wr[(u * NT + j) * 4 + e] = q[e]
            for u in range(U):
                c = it * step + u * W + warp
                ok = c < nch
                kk = min(c, nch - 1) * 32 + 8 * t
                for mt in range(MT):
                    r0 = m0 + 16 * mt + g
                    la = ok and r0 < T
                    lb = ok and r0 + 8 < T
                    xa = ldg_f32x4(x, min(r0, T - 1), kk)
                    xb = ldg_f32x4(x, min(r0, T - 1), kk + 4)
                    ya = ldg_f32x4(x, min(r0 + 8, T - 1), kk)
                    yb = ldg_f32x4(x, min(r0 + 8, T - 1), kk + 4)
                    # mma #1 of the chunk: A = (row g, k 0-1), (row g+8, k 0-1), (g, 2-3),
                    # (g+8, 2-3); mma #2: the same with k 4-5, 6-7. Packed, then selected, so
                    # the code stays one basic block.
                    p0 = pack_bf16x2(xa[0], xa[1])
                    p1 = pack_bf16x2(ya[0], ya[1])
                    p2 = pack_bf16x2(xa[2], xa[3])
                    p3 = pack_bf16x2(ya[2], ya[3])
                    p4 = pack_bf16x2(xb[0], xb[1])
                    p5 = pack_bf16x2(yb[0], yb[1])
                    p6 = pack_bf16x2(xb[2], xb[3])
                    p7 = pack_bf16x2(yb[2], yb[3])
                    af[8 * mt + 0] = p0 if la else zero
                    af[8 * mt + 1] = p1 if lb else zero
                    af[8 * mt + 2] = p2 if la else zero
                    af[8 * mt + 3] = p3 if lb else zero
                    af[8 * mt + 4] = p4 if la else zero
                    af[8 * mt + 5] = p5 if lb else zero
                    af[8 * mt + 6] = p6 if la else zero
                    af[8 * mt + 7] = p7 if lb else zero
                for mt in range(MT):
                    for j in range(NT):
                        o = (u * NT + j) * 4
                        a = (mt * NT + j) * 4
                        d = mma_bf16_16816(af[8 * mt], af[8 * mt + 1], af[8 * mt + 2],
                                           af[8 * mt + 3], wc[o], wc[o + 1],
                                           acc[a], acc[a + 1], acc[a + 2], acc[a + 3])
                        d = mma_bf16_16816(af[8 * mt + 4], af[8 * mt + 5], af[8 * mt + 6],
                                           af[8 * mt + 7], wc[o + 2], wc[o + 3],
                                           d[0], d[1], d[2], d[3])
                        acc[a] = d[0]
                        acc[a + 1] = d[1]
                        acc[a + 2] = d[2]
                        acc[a + 3] = d[3]
        for mt in range(MT):
            for j in range(NT):
                for r in range(4):
                    m = 16 * mt + g + 8 * (r >> 1)
                    nn = 8 * j + 2 * t + (r & 1)
                    red[(warp * BMS + m) * BNS + nn] = acc[(mt * NT + j) * 4 + r]
        cuda.syncthreads()
        for e in range(tid, BMS * BNS, NTHR):
            m = e // BNS
            nn = e - m * BNS
            if m0 + m < T:
                s = float32(0.0)
                for ww in range(W):
                    s += red[(ww * BMS + m) * BNS + nn]
                n = n0 + nn
                if has_bias:
                    s += bias[n]
                if accumulate:
                    out[m0 + m, n] += s
                else:
                    out[m0 + m, n] = s

    return gemm_skinny


# ----------------------------------------------------------------------------- tiled mma
def _make_tiled(BM: int, BN: int, has_bias: bool, accumulate: bool):
    WM = BM // 2            # 8 warps as 2 (m) x 4 (n)
    WN = BN // 4
    MT = WM // 16
    NT = WN // 8
    CA = BM // 64           # 8-float chunks of the A tile per thread (BM rows x 4 chunks / 256)
    CB = BN // 64
    SA = BM * 16            # uint32 per stage (32 bf16 a row)
    SB = BN * 16
    NACC = MT * NT * 4
    NRA = 8 * CA
    NRB = 4 * CB
    NAF = 8 * MT
    NBF = 4 * NT
    SA2 = 2 * SA
    SB2 = 2 * SB

    def gemm_tiled(x, w, out, bias):
        grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
        grid_trigger()
        T = x.shape[0]
        K = x.shape[1]
        N = w.shape[0]
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        wm = warp >> 2
        wn = warp & 3
        grid_m = (T + BM - 1) // BM
        grid_n = (N + BN - 1) // BN
        pid = cuda.blockIdx.x
        width = GROUP_M * grid_n
        first_m = (pid // width) * GROUP_M
        gsize = min(grid_m - first_m, GROUP_M)
        pm = first_m + (pid % width) % gsize
        pn = (pid % width) // gsize
        m0 = pm * BM
        n0 = pn * BN

        sA = cuda.shared.array(SA2, uint32, alignment=SMEM_ALIGN)
        sB = cuda.shared.array(SB2, uint32, alignment=SMEM_ALIGN)
        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = float32(0.0)
        ra = cuda.local.array(NRA, float32)
        rb = cuda.local.array(NRB, uint32)
        af = cuda.local.array(NAF, uint32)
        bf = cuda.local.array(NBF, uint32)

        nk = K >> 5
        # prologue: tile 0 into registers (rows past T / N are clamped; their outputs are dropped)
        for i in range(CA):
            q = tid + 256 * i
            row = min(m0 + (q >> 2), T - 1)
            kc = 8 * (q & 3)
            a = ldg_f32x4(x, row, kc)
            b = ldg_f32x4(x, row, kc + 4)
            for e in range(4):
                ra[8 * i + e] = a[e]
                ra[8 * i + 4 + e] = b[e]
        for i in range(CB):
            q = tid + 256 * i
            row = min(n0 + (q >> 2), N - 1)
            v = ldg_u16x8(w, row, 8 * (q & 3))
            for e in range(4):
                rb[4 * i + e] = v[e]

        for kt in range(nk):
            buf = kt & 1
            sa = buf * SA
            sb = buf * SB
            for i in range(CA):
                q = tid + 256 * i
                sts_u32x4(sA, sa + (q >> 2) * 16 + 4 * (q & 3),
                          pack_bf16x2(ra[8 * i], ra[8 * i + 1]),
                          pack_bf16x2(ra[8 * i + 2], ra[8 * i + 3]),
                          pack_bf16x2(ra[8 * i + 4], ra[8 * i + 5]),
                          pack_bf16x2(ra[8 * i + 6], ra[8 * i + 7]))
            for i in range(CB):
                q = tid + 256 * i
                sts_u32x4(sB, sb + (q >> 2) * 16 + 4 * (q & 3),
                          rb[4 * i], rb[4 * i + 1], rb[4 * i + 2], rb[4 * i + 3])
            cuda.syncthreads()
            if kt + 1 < nk:
                k1 = (kt + 1) * 32
                for i in range(CA):
                    q = tid + 256 * i
                    row = min(m0 + (q >> 2), T - 1)
                    kc = k1 + 8 * (q & 3)
                    a = ldg_f32x4(x, row, kc)
                    b = ldg_f32x4(x, row, kc + 4)
                    for e in range(4):
                        ra[8 * i + e] = a[e]
                        ra[8 * i + 4 + e] = b[e]
                for i in range(CB):
                    q = tid + 256 * i
                    row = min(n0 + (q >> 2), N - 1)
                    v = ldg_u16x8(w, row, k1 + 8 * (q & 3))
                    for e in range(4):
                        rb[4 * i + e] = v[e]
            for mt in range(MT):
                r = wm * WM + mt * 16 + g
                lo = lds_u32x4(sA, sa + r * 16 + 4 * t)
                hi = lds_u32x4(sA, sa + (r + 8) * 16 + 4 * t)
                af[8 * mt + 0] = lo[0]
                af[8 * mt + 1] = hi[0]
                af[8 * mt + 2] = lo[1]
                af[8 * mt + 3] = hi[1]
                af[8 * mt + 4] = lo[2]
                af[8 * mt + 5] = hi[2]
                af[8 * mt + 6] = lo[3]
                af[8 * mt + 7] = hi[3]
            for nt in range(NT):
                r = wn * WN + nt * 8 + g
                v = lds_u32x4(sB, sb + r * 16 + 4 * t)
                for e in range(4):
                    bf[4 * nt + e] = v[e]
            for mt in range(MT):
                for nt in range(NT):
                    o = 4 * (mt * NT + nt)
                    d = mma_bf16_16816(af[8 * mt], af[8 * mt + 1], af[8 * mt + 2], af[8 * mt + 3],
                                       bf[4 * nt], bf[4 * nt + 1],
                                       acc[o], acc[o + 1], acc[o + 2], acc[o + 3])
                    d = mma_bf16_16816(af[8 * mt + 4], af[8 * mt + 5], af[8 * mt + 6],
                                       af[8 * mt + 7], bf[4 * nt + 2], bf[4 * nt + 3],
                                       d[0], d[1], d[2], d[3])
                    acc[o] = d[0]
                    acc[o + 1] = d[1]
                    acc[o + 2] = d[2]
                    acc[o + 3] = d[3]

        for mt in range(MT):
            for nt in range(NT):
                o = 4 * (mt * NT + nt)
                row = m0 + wm * WM + mt * 16 + g
                col = n0 + wn * WN + nt * 8 + 2 * t
                if col < N:
                    b0 = float32(0.0)
                    b1 = float32(0.0)
                    if has_bias:
                        b0 = bias[col]
                        b1 = bias[col + 1]
                    for h in range(2):
                        rr = row + 8 * h
                        if rr < T:
                            if accumulate:
                                out[rr, col] += acc[o + 2 * h] + b0
                                out[rr, col + 1] += acc[o + 2 * h + 1] + b1
                            else:
                                out[rr, col] = acc[o + 2 * h] + b0
                                out[rr, col + 1] = acc[o + 2 * h + 1] + b1

    return gemm_tiled


# ----------------------------------------------------------------------------- kernel cache
_FACTORIES = {"fma": _make_fma, "skinny": _make_skinny, "tiled": _make_tiled, "gemv": _make_gemv}
_PY: dict = {}
_KERNELS: dict = {}


def py_kernel(kind: str, *cfg):
    """The undecorated Python function of a kernel variant (for compile_ptx)."""
    key = (kind,) + cfg
    if key not in _PY:
        _PY[key] = _FACTORIES[kind](*cfg)
    return _PY[key]


def kernel(kind: str, *cfg):
    """kind 'fma': (T, warps, unroll, has_bias, accumulate); 'skinny': (mt, nt, warps, unroll,
    has_bias, accumulate); 'tiled': (bm, bn, has_bias, accumulate); 'gemv': (warps, rows,
    unroll, prologue, smem (0/1), has_bias, accumulate, sumsq, glu, rope, prefetch), arguments (x, w, out, bias, norm_w,
    eps, ss_in, ss_out, positions, cos, sin, slot_mapping, k_cache, v_cache)."""
    key = (kind,) + cfg
    k = _KERNELS.get(key)
    if k is None:
        k = _KERNELS[key] = cached_jit(py_kernel(kind, *cfg))
    return k


# ----------------------------------------------------------------------------- launchers
def fma_path(T: int, N: int, unroll: int = FMA_UNROLL):
    return "fma", (T, FMA_WARPS, unroll), N // FMA_WARPS, 32 * FMA_WARPS


def skinny_cfg(T: int, N: int, K: int = 4096):
    """(mt, nt, unroll) of the streaming path for T rows and N outputs, or None where the tiled
    kernel measured faster. From bench/gemm_bench.py on the H200 (docs/gemm.md has the table):
    small N (SmolLM2's 192..1536) stays on the streaming path up to 256 rows; wide N (>= 12288:
    Llama gate|up, lm_heads) leaves it above 32 rows; the rest above 128."""
    if T <= 16:
        if N < 2048:
            return 1, 1, 4
        if N >= 65536 or K >= 8192:
            return 1, 2, 4
        return (1, 4, 2) if N >= 8192 else (1, 2, 2)
    if T <= 32:
        return (1, 2, 2) if N < 2048 else (2, 4, 1)
    if N < 2048:
        return (2, 2, 2) if T <= 64 else (4, 2, 1)
    if N >= 12288 or T > 128:
        return None
    return 4, 2, 1


def skinny_path(T: int, N: int, mt: int | None = None, nt: int | None = None,
                unroll: int | None = None, K: int = 4096):
    """Streaming mma path: mt m16 tiles of x per block (T > 16*mt takes several slabs)."""
    d = skinny_cfg(T, N, K) or (4, 2, 1)
    mt = d[0] if mt is None else mt
    nt = d[1] if nt is None else nt
    unroll = d[2] if unroll is None else unroll
    slabs = -(-T // (16 * mt))
    return "skinny", (mt, nt, SKINNY_WARPS, unroll), (N // (8 * nt)) * slabs, 32 * SKINNY_WARPS


def tiled_path(T: int, N: int, bm: int = 64, bn: int = 128):
    return "tiled", (bm, bn), -(-T // bm) * -(-N // bn), TILED_THREADS


def gemv_cfg(N: int, K: int, prologue: str = "plain"):
    """(warps, rows per warp, unroll, x in shared memory) of the T = 1 GEMV for N x K, read off
    the H200 sweep (`bench/gemm_bench.py --fma-sweep`, docs/bench/fma_sweep.json, session 2):
    large matrices (>= 16M elements) stream best with 8 warps x 2 rows (o, gate_up, down of
    Llama-3-8B: 1.01-1.07x over the old 4x1), the LM heads with 4 warps x 2 rows (K = 4096) or
    4 x 4 (K = 576: 1.18x plain, 1.73x with the rmsnorm prologue); silu_mul on small K wants x
    staged in shared memory (8 warps: 1.19x); rmsnorm on wide K wants more rows (8 x 2: 1.26x)."""
    if N >= 32768:                                   # LM heads
        return (4, 4, 1, False) if K <= 1024 else (4, 2, 2, False)
    if prologue == "silu_mul":
        return (8, 1, 2, True) if K <= 4096 else (4, 2, 2, False)
    if prologue == "rmsnorm":
        return (8, 2, 1, False) if K >= 2048 else (4, 1, 2, False)
    # plain and rmsnorm_ss (its scale is one load: nothing to amortize over more rows)
    if N * K >= 1 << 24:
        return 8, 2, 2, False
    return (8, 1, 2, False) if K <= 1024 else (4, 1, 2, False)


# Every T = 1 GEMV's warps / unroll instead of gemv_cfg's (0: the table); the backend sets these from
# levers.gemv_warps / gemv_unroll before it compiles anything (a sweep inside whole decode graphs).
GEMV_FORCE = {"warps": 0, "unroll": 0}


def gemv_path(N: int, K: int, prologue: str = "plain", warps: int | None = None,
              rows: int | None = None, unroll: int | None = None, smem: bool | None = None):
    """T = 1 GEMV with a fused prologue ('plain', 'rmsnorm', 'rmsnorm_ss', 'silu_mul'); keyword arguments
    override gemv_cfg (then GEMV_FORCE). smem=True stages x in shared memory (K <= GEMV_SMEM_MAX_K)."""
    d = gemv_cfg(N, K, prologue)
    warps = (GEMV_FORCE["warps"] or d[0]) if warps is None else warps
    rows = d[1] if rows is None else rows
    unroll = (GEMV_FORCE["unroll"] or d[2]) if unroll is None else unroll
    smem = d[3] if smem is None else smem
    assert N % (warps * rows) == 0, f"gemv: N={N} is not a multiple of warps*rows={warps * rows}"
    assert warps <= 32
    ks = 1 if smem and K <= GEMV_SMEM_MAX_K else 0
    return ("gemv", (warps, rows, unroll, PROLOGUES[prologue], ks), N // (warps * rows),
            32 * warps)


def pick_path(T: int, N: int, fma_max_t: int | None = None, skinny_max_t: int | None = None,
              K: int = 4096):
    """(kind, config-without-flags, grid, block) for a product of T rows and N outputs:
    fma if T <= fma_max_t; else streaming mma if T <= skinny_max_t and skinny_cfg has a
    config; else tiled."""
    fma_max_t = FMA_MAX_T if fma_max_t is None else fma_max_t
    skinny_max_t = SKINNY_MAX_T if skinny_max_t is None else skinny_max_t
    if T == 1 and fma_max_t >= 1:
        return gemv_path(N, K)
    if T <= fma_max_t:
        return fma_path(T, N)
    if T <= skinny_max_t and (T <= 16 or skinny_cfg(T, N, K) is not None):
        return skinny_path(T, N, K=K)
    return tiled_path(T, N)


def _launch(x, w, out, bias, stream, accumulate, fma_max_t, skinny_max_t, path=None):
    assert x.ndim == 2 and w.ndim == 2 and out.ndim == 2, "x [T,K], w [N,K], out [T,N]"
    T, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K, f"x has K={K} columns but w is {tuple(w.shape)}"
    assert tuple(out.shape) == (T, N), f"out is {tuple(out.shape)}, expected {(T, N)}"
    assert K % 64 == 0 and N % 64 == 0, f"gemm needs K and N multiples of 64, got K={K} N={N}"
    assert x.dtype == np.float32 and out.dtype == np.float32 and w.dtype == np.uint16, \
        "x, out float32; w uint16 (bf16 bits)"
    assert bias is None or tuple(bias.shape) == (N,), "bias must be float32 [N]"
    if T == 0:
        return
    if path is None:
        path = pick_path(T, N, fma_max_t, skinny_max_t, K)
    kind, cfg, grid, block = path
    k = kernel(kind, *cfg, bias is not None, accumulate, *((False, False, 0, False) if kind == "gemv" else ()))
    # without a bias the kernel never reads that argument (branch pruned): pass out as filler
    if kind == "gemv":
        assert T == 1 and cfg[3] == 0, "the gemv path of linear is T = 1, no prologue"
        f = out.reshape(out.size)                       # filler for the unused ss arguments
        k[grid, block, stream or 0](x, w, out, out if bias is None else bias, x, np.float32(0.0), f, f,
                                    *_rope_filler())
    else:
        k[grid, block, stream or 0](x, w, out, out if bias is None else bias)


def linear(x, w, out, bias=None, stream=None, *, fma_max_t: int | None = None,
           skinny_max_t: int | None = None, path=None) -> None:
    """out[T, N] = x[T, K] @ bf16(w[N, K]).T (+ bias). Device arrays in, nothing allocated.
    fma_max_t / skinny_max_t override the module thresholds; path (from fma_path, skinny_path,
    tiled_path or pick_path) forces one kernel."""
    _launch(x, w, out, bias, stream, False, fma_max_t, skinny_max_t, path)


def linear_residual(x, w, out, bias=None, stream=None, *, fma_max_t: int | None = None,
                    skinny_max_t: int | None = None, path=None) -> None:
    """out[T, N] += x[T, K] @ bf16(w[N, K]).T (+ bias): the residual add folded into the
    product's epilogue (one read of out instead of a separate add kernel)."""
    _launch(x, w, out, bias, stream, True, fma_max_t, skinny_max_t, path)


_ROPE_FILLER: list = []


def _rope_filler() -> tuple:
    """Typed stand-ins for the rope arguments of a gemv launch without the rope epilogue (device
    arrays made once, at the first eager launch: never inside a graph capture)."""
    if not _ROPE_FILLER:
        i32 = cuda.to_device(np.zeros(1, np.int32))
        f32 = cuda.to_device(np.zeros((1, 1), np.float32))
        u16 = cuda.to_device(np.zeros((1, 1, 1, 2), np.uint16))
        _ROPE_FILLER.extend([i32, f32, f32, i32, u16, u16])
    return tuple(_ROPE_FILLER)


def gemv(x, w, out, *, prologue: str = "plain", norm_w=None, eps: float = 1e-6, bias=None,
         accumulate: bool = False, stream=None, path=None, ss_in=None, ss_out=None, glu: bool = False,
         rope: tuple | None = None, interleaved: bool = False, prefetch: bool = False) -> None:
    """T = 1 product with the input transform fused into the GEMV (no launch of its own):
      plain       out[1, N] (+)= x[1, K] @ bf16(w).T (+ bias)
      rmsnorm     x -> x * rsqrt(mean(x^2) + eps) * norm_w   (norm_w float32 [K])
      rmsnorm_ss  the same, with sum(x^2) already in ss_in[0] (uint64 [1], fixed point: ss_fixed): no reduction
      silu_mul    x[1, 2K] = [gate | up] -> silu(gate) * up  (the gate_up product's output)
    accumulate adds into out (the residual stream). ss_out (uint64 [1], zeroed by the caller):
    the sum of squares of the values written is added into it, for the next rmsnorm_ss.
    glu: w is [gate | up] (2I rows) and out[1, I] = silu(x' @ gate.T) * (x' @ up.T) (x' the
    prologue's input): the down product's activation in one launch (no bias, accumulate, ss_out).
    rope = (positions, cos, sin, slot_mapping, k_cache, v_cache): w is the fused QKV projection and
    the epilogue does qkv.qkv_rope_store's work for the one token (no q/k norm): q rotated into
    out [1, Hq hd], k rotated and v into the caches (interleaved: the rotation pairs' layout).
    prefetch: before its PDL wait each block pulls all its rows into L2 (plain layout: no glu/rope).
    path: from gemv_path (default gemv_cfg). Device arrays in, nothing allocated (graph-capture safe)."""
    if prologue not in PROLOGUES:
        raise ValueError(f"gemv: unknown prologue '{prologue}' (one of {sorted(PROLOGUES)})")
    N, K = w.shape
    kx = 2 * K if prologue == "silu_mul" else K
    n_out = N // 2 if glu else (out.shape[1] if rope is not None else N)
    assert x.ndim == 2 and tuple(x.shape) == (1, kx), f"gemv: x is {tuple(x.shape)}, expected {(1, kx)}"
    assert tuple(out.shape) == (1, n_out), f"gemv: out is {tuple(out.shape)}, expected {(1, n_out)}"
    assert not glu or (bias is None and not accumulate and ss_out is None and N % 128 == 0), \
        "gemv glu: no bias / accumulate / ss_out, and N = 2I with I a multiple of 64"
    if rope is not None:
        hk, hd = rope[4].shape[2], rope[4].shape[3]
        assert not glu and not accumulate and ss_out is None and N == n_out + 2 * hk * hd, \
            f"gemv rope: w [{N}, K] is not q ({n_out}) + k + v ({hk} x {hd} each); no accumulate / ss_out"
    assert K % 64 == 0 and N % 64 == 0, f"gemm needs K and N multiples of 64, got K={K} N={N}"
    assert x.dtype == np.float32 and out.dtype == np.float32 and w.dtype == np.uint16, \
        "x, out float32; w uint16 (bf16 bits)"
    assert bias is None or tuple(bias.shape) == (N,), "bias must be float32 [N]"
    if prologue in ("rmsnorm", "rmsnorm_ss"):
        assert norm_w is not None and tuple(norm_w.shape) == (K,), f"{prologue} needs norm_w float32 [K]"
        nw = norm_w.reshape(1, K)
    else:
        nw = x
    assert (prologue == "rmsnorm_ss") == (ss_in is not None), "rmsnorm_ss and ss_in go together"
    kind, cfg, grid, block = path or gemv_path(N, K, prologue, rows=2 if glu or rope is not None else None)
    assert kind == "gemv" and cfg[3] == PROLOGUES[prologue], f"gemv: path {kind}{cfg} is not for {prologue}"
    assert cfg[4] == 0 or K <= GEMV_SMEM_MAX_K, "gemv: x staged in shared memory needs K <= 12288"
    assert not (glu or rope is not None) or cfg[1] == 2, "gemv glu / rope: two rows (gate and up, a rotation pair) a warp"
    assert not prefetch or not (glu or rope is not None), "gemv prefetch: plain row layout only"
    k = kernel(kind, *cfg, bias is not None, accumulate, ss_out is not None, glu,
               0 if rope is None else (2 if interleaved else 1), bool(prefetch))
    f = out.reshape(out.size)                           # filler for unused ss arguments
    k[grid, block, stream or 0, 4 * K if cfg[4] else 0](x, w, out, out if bias is None else bias,
                                                         nw, np.float32(eps),
                                                         f if ss_in is None else ss_in,
                                                         f if ss_out is None else ss_out,
                                                         *(_rope_filler() if rope is None else rope))
