"""Tensor-core (mma.sync m16n8k16 bf16) varlen causal prefill attention over the paged KV cache,
flash-attention-2 style. Same contract and call signature as attention.prefill_attention (the
reference is attention.attention_ref), so the backend can switch between them with a lever.

Contract: query token t of segment s attends to the KV positions 0..positions[t] of its segment (window W > 0: the last W),
read through block_tables[s] (an entry of -1 reads block 0); positions increase by one inside a
segment (chunked prefill: a chunk starting at position p0 also reads the p0 cached positions
before it). q float32 [T, Hq, hd] (any strides), out float32 [T, Hq, hd]; caches one layer of bf16
bits [num_blocks, block_size, Hk, hd] as uint16 or its uint64 view [.., hd / 4]; Hq a multiple of
Hk (GQA: query head h reads kv head h // (Hq / Hk)); hd a multiple of 32 (64 and 128 tested).
q is rounded to bf16 after the softmax scale is applied (and P to bf16 before P.V): expect bf16
tolerance against the float64 reference, not the 1e-4 of the FP32 kernel.

Geometry (FlashConfig): grid (Hq, ceil(max_query_len / BQ), S), 32 * warps threads (4 warps,
BQ = 64 query rows of one head per block; tiles are visited heaviest-first: tile index
reversed). Each warp owns 16 query rows:
  - Q (x softmax scale x log2 e) is read once, converted to bf16 A fragments held in registers
    (hd / 4 uint32 per lane);
  - the block walks K/V tiles of BK = 64 positions up to the causal limit of its last row; per
    tile K and V are staged row-major in shared memory as bf16 pairs ([BK][hd/2 + pad] uint32)
    from 16-byte global loads held in registers one phase ahead (the next K's loads fly during
    P.V; V's during Q.K^T when v_early, else right after the softmax), two barriers per tile;
  - S = Q K^T: 2 * (hd / 32) * (BK / 8) mma per warp, K B fragments by 16-byte ld.shared;
  - online softmax in the log2 domain on the accumulators (row max over the 4 lanes of a quad
    with two shfl.bfly, ex2.approx), causal mask only on tiles crossing the warp's diagonal,
    warps whose rows all precede the tile skip it;
  - O += P V: P is repacked to bf16 A fragments straight from the S accumulators (the FA2
    register trick: the m16n8 C layout of two adjacent S tiles is the m16n8k16 A layout), V B
    fragments by ldmatrix.x4.trans (4 matrices = 32 keys x 8 dims), 2 * (BK / 32) * (hd / 8) mma;
  - the row sums are reduced over the quad once at the end and O / l written as float32.
Q.K^T permutes its reduction index (head_dim) identically in both operands so that every
fragment is one 16-byte shared load (as gemm.py's tiled kernel): lane t holds dims 8t..8t+7 of
each 32-wide chunk. Row pitches: K 16 words mod 32 (a quarter-warp reads rows g, g+1 x 4 lanes:
32 distinct banks), V 4 words mod 32 (ldmatrix's 8 rows hit 8 distinct 16-byte bank groups).

Resources (ptxas 13.0, sm_90, no launch bounds): hd 64: 176 registers, 21 KB static shared, no
spills; hd 128 (BK 64): 255 registers with 40-88 bytes of spills, 37 KB shared; hd 128 with
block_k=32: 250 registers, no spills, 19 KB. Either way 2 blocks (8 warps) per SM by registers.
Live state per lane (hd 128): Q 32 + S/P 32 + O 64 + staged K/V 32 words + addressing.

Expected speed on the H200 (unmeasured when written): per 2 mma (m16n8k16 = 4096 FLOP each) a
warp issues one 16-byte ld.shared (Q.K^T) or one ldmatrix.x4 (P.V) (512 B, 4 shared-memory
cycles of the SM), so shared-memory bandwidth alone caps the SM near 0.5 mma per clock, about the
mma.sync issue rate (~60-70% of the 780-810 TFLOP/s dense bf16 peak measured in docs/gemm.md).
With no cp.async pipelining (one tile of loads in flight, two barriers per tile), only 8 warps
per SM, exp2/max/rescale work on the FMA/MUFU pipes and causal imbalance we expect 120-250
TFLOP/s on the 8B shape at 4,096 tokens, i.e. roughly 25-45% of mma.sync peak (15-30% of the
dense bf16 peak): 10-20x the FP32 FMA kernel (~12 TFLOP/s). Larger gains need 32 rows per warp
(halves shared traffic per mma, registers permitting), cp.async multi-stage staging and fewer
hoisted 64-bit addresses (Numba indexes in int64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda
from kernels_numba.jit import kernel as cached_jit

from kernels_numba.ptx import grid_trigger, grid_wait
from kernels_numba.attention import attention_ref, cache_views, token_seq_from_starts, window_start  # noqa: F401 (reference)
from kernels_numba.ptx import (
    SIM,
    ex2_f32,
    lds_u32x4,
    ldsm_x4_trans,
    mma_bf16_16816,
    pack_bf16x2,
    shfl_xor_f32,
    sts_u32x4,
)
from kernels_numba.bf16 import ldg_u64x2

LOG2E = 1.4426950408889634
SMEM_ALIGN = None if SIM else 16  # 16-byte shared accesses (the simulator rejects alignment=)
NEG = np.float32(-1.0e30)  # finite "minus infinity": no inf - inf, safe under any math flags


@dataclass(frozen=True)
class FlashConfig:
    head_dim: int
    warps: int = 4  # 16 query rows per warp: BQ = 16 * warps
    block_k: int = 64  # KV positions per staged tile (multiple of 32)
    v_early: bool = True  # V loads fly during Q.K^T (+2 * block_k * head_dim / (8 * 32 * warps) regs)

    @property
    def block_q(self) -> int:
        return 16 * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps


def flash_config(head_dim: int, **override) -> FlashConfig:
    cfg = FlashConfig(head_dim, override.get("warps", 4), override.get("block_k", 64),
                      override.get("v_early", head_dim <= 64))
    if head_dim % 32:
        raise ValueError(f"flash_prefill_attention: head_dim {head_dim} must be a multiple of 32")
    if cfg.block_k % 32 or cfg.block_k <= 0:
        raise ValueError(f"flash_prefill_attention: block_k {cfg.block_k} must be a multiple of 32")
    nt = cfg.threads
    if (cfg.block_k * head_dim // 8) % nt or (cfg.block_k // 2 * head_dim // 8) % nt:
        raise ValueError(f"flash_prefill_attention: a {cfg.block_k} x {head_dim} tile does not split "
                         f"over {nt} threads")
    k_pitch, v_pitch = _pitches(cfg)
    if 4 * cfg.block_k * (k_pitch + v_pitch) > 48 * 1024:
        raise ValueError("flash_prefill_attention: tiles exceed 48 KB of static shared memory")
    return cfg


def _pitches(cfg: FlashConfig) -> tuple[int, int]:
    """Row pitches (uint32 words) of the K and V tiles: K 16 mod 32 (16-byte reads of rows g, g+1
    by a quarter-warp), V 4 mod 32 (ldmatrix: 8 consecutive rows in 8 distinct 16-byte bank groups)."""
    kw = cfg.head_dim // 2
    return kw + (16 - kw) % 32, kw + (4 - kw) % 32


def _make_kernel(cfg: FlashConfig):
    HD, W, BK = cfg.head_dim, cfg.warps, cfg.block_k
    BQ = 16 * W
    NT = 32 * W
    KP, VP = _pitches(cfg)
    KC = HD // 32  # 32-wide reduction chunks of S = Q K^T
    NS = BK // 8  # n8 tiles of S per warp
    NB = BK // 32  # 32-key chunks of P.V
    ND = HD // 8  # n8 tiles of O per warp
    PC = HD // 8  # 16-byte pieces per K/V row
    NKI = BK * PC // NT  # K pieces per thread per tile
    V_EARLY = cfg.v_early
    SK = BK * KP  # shared words (constants: the shape must be a compile-time literal)
    SV = BK * VP
    NQF = HD // 4  # Q fragment words per lane
    NSA = NS * 4
    NOA = ND * 4
    NKR = 2 * NKI
    U32 = np.uint64(0xFFFFFFFF)
    S32 = np.uint64(32)

    def flash_prefill(q, k_cache, v_cache, block_tables, seq_query_start, positions, qscale, window, out):
        grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
        grid_trigger()
        h = cuda.blockIdx.x
        seq = cuda.blockIdx.z
        tile = cuda.gridDim.y - 1 - cuda.blockIdx.y  # heaviest (latest) tiles first
        t_beg = seq_query_start[seq]
        t_end = seq_query_start[seq + 1]
        t0 = t_beg + tile * BQ
        if t0 >= t_end:
            return
        t1 = min(t0 + BQ, t_end)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        bs = k_cache.shape[1]
        hk = h // (q.shape[1] // k_cache.shape[2])

        sK = cuda.shared.array(SK, np.uint32, alignment=SMEM_ALIGN)
        sV = cuda.shared.array(SV, np.uint32, alignment=SMEM_ALIGN)
        qf = cuda.local.array(NQF, np.uint32)
        s = cuda.local.array(NSA, np.float32)
        o = cuda.local.array(NOA, np.float32)
        kr = cuda.local.array(NKR, np.uint64)
        vr = cuda.local.array(NKR, np.uint64)

        # ---- this warp's rows (padding rows past t1 clamp to the last row: finite, never written)
        w0 = t0 + 16 * warp
        active = w0 < t1
        r0 = min(w0 + g, t1 - 1)
        r1 = min(w0 + g + 8, t1 - 1)
        qp0 = positions[r0]
        qp1 = positions[r1]
        wfirst = positions[min(w0, t1 - 1)]
        wlast = positions[min(w0 + 15, t1 - 1)]
        for kc in range(KC):
            for e in range(4):
                d = 32 * kc + 8 * t + 2 * e
                qf[8 * kc + 2 * e] = pack_bf16x2(q[r0, h, d] * qscale, q[r0, h, d + 1] * qscale)
                qf[8 * kc + 2 * e + 1] = pack_bf16x2(q[r1, h, d] * qscale, q[r1, h, d + 1] * qscale)
        for i in range(ND * 4):
            o[i] = np.float32(0.0)
        m0 = NEG
        m1 = NEG
        l0 = np.float32(0.0)
        l1 = np.float32(0.0)

        kv_end = positions[t1 - 1] + 1
        n_kt = (kv_end + BK - 1) // BK
        kt_lo = window_start(positions[t0] + 1, window, BK) // BK     # the block's first tile

        # ---- prologue: K tile kt_lo into registers
        for i in range(NKI):
            idx = tid + NT * i
            j = idx // PC
            c = idx - j * PC
            pos = kt_lo * BK + j
            if pos < kv_end:
                bi = pos // bs
                blk = max(block_tables[seq, bi], 0)
                a, b = ldg_u64x2(k_cache, (blk, pos - bi * bs, hk, 2 * c))
            else:
                a = np.uint64(0)
                b = np.uint64(0)
            kr[2 * i] = a
            kr[2 * i + 1] = b

        for kt in range(kt_lo, n_kt):
            k0 = kt * BK
            # K(kt) registers -> shared (S(kt-1) reads finished before the last barrier)
            for i in range(NKI):
                idx = tid + NT * i
                j = idx // PC
                c = idx - j * PC
                a = kr[2 * i]
                b = kr[2 * i + 1]
                sts_u32x4(sK, j * KP + 4 * c, a & U32, a >> S32, b & U32, b >> S32)
            # V(kt) loads in flight during S (V_EARLY) or issued after the softmax
            if V_EARLY:
                for i in range(NKI):
                    idx = tid + NT * i
                    j = idx // PC
                    c = idx - j * PC
                    pos = k0 + j
                    if pos < kv_end:
                        bi = pos // bs
                        blk = max(block_tables[seq, bi], 0)
                        a, b = ldg_u64x2(v_cache, (blk, pos - bi * bs, hk, 2 * c))
                    else:
                        a = np.uint64(0)
                        b = np.uint64(0)
                    vr[2 * i] = a
                    vr[2 * i + 1] = b
            cuda.syncthreads()

            run = active and k0 <= wlast and (window == 0 or k0 + BK > wfirst - window + 1)  # warp-uniform
            if run:
                # ---- S = Q K^T (log2 units)
                for i in range(NS * 4):
                    s[i] = np.float32(0.0)
                for kc in range(KC):
                    for nt in range(NS):
                        row = 8 * nt + g
                        v = lds_u32x4(sK, row * KP + 16 * kc + 4 * t)
                        d = mma_bf16_16816(qf[8 * kc], qf[8 * kc + 1], qf[8 * kc + 2], qf[8 * kc + 3],
                                           v[0], v[1], s[4 * nt], s[4 * nt + 1], s[4 * nt + 2],
                                           s[4 * nt + 3])
                        d = mma_bf16_16816(qf[8 * kc + 4], qf[8 * kc + 5], qf[8 * kc + 6],
                                           qf[8 * kc + 7], v[2], v[3], d[0], d[1], d[2], d[3])
                        s[4 * nt] = d[0]
                        s[4 * nt + 1] = d[1]
                        s[4 * nt + 2] = d[2]
                        s[4 * nt + 3] = d[3]
                # ---- causal mask (tiles crossing this warp's diagonal only) and row maxima
                if k0 + BK - 1 > wfirst:
                    for nt in range(NS):
                        key = k0 + 8 * nt + 2 * t
                        if key > qp0:
                            s[4 * nt] = NEG
                        if key + 1 > qp0:
                            s[4 * nt + 1] = NEG
                        if key > qp1:
                            s[4 * nt + 2] = NEG
                        if key + 1 > qp1:
                            s[4 * nt + 3] = NEG
                # keys before a row's window; a row with no key yet in this tile gets P = 1 here
                # (NEG - NEG), which the rescale by ex2(NEG - m) = 0 at its first real key wipes
                if window > 0 and k0 <= wlast - window:
                    for nt in range(NS):
                        key = k0 + 8 * nt + 2 * t
                        if key <= qp0 - window:
                            s[4 * nt] = NEG
                        if key + 1 <= qp0 - window:
                            s[4 * nt + 1] = NEG
                        if key <= qp1 - window:
                            s[4 * nt + 2] = NEG
                        if key + 1 <= qp1 - window:
                            s[4 * nt + 3] = NEG
                mx0 = NEG
                mx1 = NEG
                for nt in range(NS):
                    mx0 = max(mx0, max(s[4 * nt], s[4 * nt + 1]))
                    mx1 = max(mx1, max(s[4 * nt + 2], s[4 * nt + 3]))
                mx0 = max(mx0, shfl_xor_f32(mx0, 1))
                mx1 = max(mx1, shfl_xor_f32(mx1, 1))
                mx0 = max(mx0, shfl_xor_f32(mx0, 2))
                mx1 = max(mx1, shfl_xor_f32(mx1, 2))
                mn0 = max(m0, mx0)
                mn1 = max(m1, mx1)
                al0 = ex2_f32(m0 - mn0)
                al1 = ex2_f32(m1 - mn1)
                m0 = mn0
                m1 = mn1
                rs0 = np.float32(0.0)
                rs1 = np.float32(0.0)
                for nt in range(NS):
                    p = ex2_f32(s[4 * nt] - mn0)
                    s[4 * nt] = p
                    rs0 += p
                    p = ex2_f32(s[4 * nt + 1] - mn0)
                    s[4 * nt + 1] = p
                    rs0 += p
                    p = ex2_f32(s[4 * nt + 2] - mn1)
                    s[4 * nt + 2] = p
                    rs1 += p
                    p = ex2_f32(s[4 * nt + 3] - mn1)
                    s[4 * nt + 3] = p
                    rs1 += p
                l0 = l0 * al0 + rs0
                l1 = l1 * al1 + rs1
                for dn in range(ND):
                    o[4 * dn] *= al0
                    o[4 * dn + 1] *= al0
                    o[4 * dn + 2] *= al1
                    o[4 * dn + 3] *= al1

            if not V_EARLY:
                for i in range(NKI):
                    idx = tid + NT * i
                    j = idx // PC
                    c = idx - j * PC
                    pos = k0 + j
                    if pos < kv_end:
                        bi = pos // bs
                        blk = max(block_tables[seq, bi], 0)
                        a, b = ldg_u64x2(v_cache, (blk, pos - bi * bs, hk, 2 * c))
                    else:
                        a = np.uint64(0)
                        b = np.uint64(0)
                    vr[2 * i] = a
                    vr[2 * i + 1] = b
            # V(kt) registers -> shared, row-major (P.V(kt-1) reads finished before the barrier above)
            for i in range(NKI):
                idx = tid + NT * i
                j = idx // PC
                c = idx - j * PC
                a = vr[2 * i]
                b = vr[2 * i + 1]
                sts_u32x4(sV, j * VP + 4 * c, a & U32, a >> S32, b & U32, b >> S32)
            # K(kt+1) loads in flight during P.V
            if kt + 1 < n_kt:
                for i in range(NKI):
                    idx = tid + NT * i
                    j = idx // PC
                    c = idx - j * PC
                    pos = k0 + BK + j
                    if pos < kv_end:
                        bi = pos // bs
                        blk = max(block_tables[seq, bi], 0)
                        a, b = ldg_u64x2(k_cache, (blk, pos - bi * bs, hk, 2 * c))
                    else:
                        a = np.uint64(0)
                        b = np.uint64(0)
                    kr[2 * i] = a
                    kr[2 * i + 1] = b
            cuda.syncthreads()

            if run:
                # ---- O += P V: A fragments straight from the S accumulators
                for nb in range(NB):
                    n0 = 4 * nb
                    a00 = pack_bf16x2(s[4 * n0], s[4 * n0 + 1])
                    a01 = pack_bf16x2(s[4 * n0 + 2], s[4 * n0 + 3])
                    a02 = pack_bf16x2(s[4 * n0 + 4], s[4 * n0 + 5])
                    a03 = pack_bf16x2(s[4 * n0 + 6], s[4 * n0 + 7])
                    a10 = pack_bf16x2(s[4 * n0 + 8], s[4 * n0 + 9])
                    a11 = pack_bf16x2(s[4 * n0 + 10], s[4 * n0 + 11])
                    a12 = pack_bf16x2(s[4 * n0 + 12], s[4 * n0 + 13])
                    a13 = pack_bf16x2(s[4 * n0 + 14], s[4 * n0 + 15])
                    for dn in range(ND):
                        v = ldsm_x4_trans(sV, (32 * nb + lane) * VP + 4 * dn)
                        d = mma_bf16_16816(a00, a01, a02, a03, v[0], v[1],
                                           o[4 * dn], o[4 * dn + 1], o[4 * dn + 2], o[4 * dn + 3])
                        d = mma_bf16_16816(a10, a11, a12, a13, v[2], v[3], d[0], d[1], d[2], d[3])
                        o[4 * dn] = d[0]
                        o[4 * dn + 1] = d[1]
                        o[4 * dn + 2] = d[2]
                        o[4 * dn + 3] = d[3]

        # ---- epilogue: quad-reduce the row sums, write O / l
        l0 += shfl_xor_f32(l0, 1)
        l1 += shfl_xor_f32(l1, 1)
        l0 += shfl_xor_f32(l0, 2)
        l1 += shfl_xor_f32(l1, 2)
        if active:
            if w0 + g < t1:
                inv = np.float32(1.0) / l0
                for dn in range(ND):
                    d = 8 * dn + 2 * t
                    out[w0 + g, h, d] = o[4 * dn] * inv
                    out[w0 + g, h, d + 1] = o[4 * dn + 1] * inv
            if w0 + g + 8 < t1:
                inv = np.float32(1.0) / l1
                for dn in range(ND):
                    d = 8 * dn + 2 * t
                    out[w0 + g + 8, h, d] = o[4 * dn + 2] * inv
                    out[w0 + g + 8, h, d + 1] = o[4 * dn + 3] * inv

    return flash_prefill


@lru_cache(maxsize=None)
def py_kernel(cfg: FlashConfig):
    """The undecorated kernel function of a config (for compile_ptx)."""
    return _make_kernel(cfg)


@lru_cache(maxsize=None)
def _kernel(cfg: FlashConfig):
    return cached_jit(py_kernel(cfg))


def flash_prefill_attention(
    q,
    k_cache64,
    v_cache64,
    block_tables,
    seq_query_start,
    positions,
    scale: float,
    out,
    max_query_len: int | None = None,
    config: FlashConfig | None = None,
    stream=0,
    window: int = 0,
) -> None:
    """Causal attention for prefill segments on the tensor cores (see module docstring); the
    arguments are those of attention.prefill_attention. Allocates nothing; the grid depends only
    on (Hq, max_query_len, S), so keep max_query_len fixed under CUDA-graph capture. window > 0:
    each query reads its last `window` positions (sliding-window attention)."""
    num_tokens, hq, hd = q.shape
    num_seqs = seq_query_start.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return
    kc, vc, hk = cache_views("flash_prefill_attention", q, k_cache64, v_cache64)
    cfg = config or flash_config(hd)
    if cfg.head_dim != hd:
        raise ValueError(f"flash_prefill_attention: config for head_dim {cfg.head_dim}, q has {hd}")
    qlen = num_tokens if max_query_len is None else max_query_len
    tiles = max(1, -(-qlen // cfg.block_q))
    _kernel(cfg)[(hq, tiles, num_seqs), cfg.threads, stream](
        q, kc, vc, block_tables, seq_query_start, positions, np.float32(scale * LOG2E), np.int32(window), out
    )
