"""Tensor-core decode attention over the paged bf16 KV cache: the same contract and call signature
as attention.paged_attention (reference attention.attention_ref), so the backend can switch by a
lever. No shared memory in the main loop, no block barrier until the final merge.

Contract: query token t (segment token_seq[t]) attends to KV positions 0..positions[t] (window W > 0: the last W of them) of its
segment through block_tables (an entry of -1 reads block 0: CUDA-graph padding rows, position 0,
are finite garbage, never a fault). q float32 [T, Hq, hd] (any strides), out float32 [T, Hq, hd];
caches one layer of bf16 bits [num_blocks, block_size, Hk, hd] as uint16 or its uint64 view;
hd a multiple of 64 (64, 128, 256); G = Hq / Hk in 1..8; any block_size (one block-table read per
step when block_size is a multiple of `keys`, else one per key). Split-K partitions use
attention's scratch layout [rows, Hq, hd + 2] (unnormalised O, max in natural-log units, sum) and
its `_merge_partitions_kernel`, so `paged_attention_scratch_shape` still sizes the scratch.

Geometry: grid (partitions, Hk, T), a block of W = 4 warps per (token, kv head, partition); warp w
takes steps w, w + W, ... of KT = 16 keys of the partition and keeps its own online softmax; the
W states meet once in shared memory at the end. Per step, per warp (hd = 128, Llama-3-8B):
  - S = Q K^T with mma.sync m16n8k16 bf16: A = Q (the G heads are rows 0..G-1, rows >= G and the
    whole upper half 8..15 are zero registers; Q x scale x log2 e converted once to bf16 A
    fragments, hd / 8 registers); B = K straight from global memory: lane (g, t) loads key g of an
    8-key n-tile with 16-byte loads of dims 32c + 8t .. 32c + 8t + 7 (the reduction index is
    permuted identically in Q, as gemm.py's skinny kernel does), one load feeds two mma.
    KT / 8 n-tiles x hd / 16 mma.
  - online softmax in the log2 domain on the accumulators (row max over the 4 lanes of a quad with
    two shfl.bfly; ex2.approx); keys past the partition end masked.
  - O += P V with mma.sync m16n8k8 **tf32**: a tf32 operand is one element per 32-bit register,
    so V needs no transpose. P comes straight from the S accumulators (lane (g, t) holds
    S[g][2t], S[g][2t+1] = tf32 A slots (g, t) and (g, t + 4): key k-slot t <-> key 2t, slot t + 4
    <-> key 2t + 1); V's B fragment of n-tile i is V[key 2t][dim], V[key 2t + 1][dim] with the
    output dims permuted so that n-tile i = 8h + e, column n holds dim 64h + 8n + e: lane (g, t)
    then needs dims 64h + 8g .. 64h + 8g + 7 of keys 2t and 2t + 1, i.e. 16-byte loads, each
    feeding 8 mma (bf16 -> tf32 is a shift or a mask). hd / 8 mma per 8 keys. The bf16 m16n8k16
    alternative packs two keys of one dim per register (a transpose: 2-byte gathers, or shared
    staging + ldmatrix.trans + barriers); tf32 trades that for twice the mma count, which is far
    from a limit here (below).
Both K and V of a step are issued one phase ahead (K of step i+1 flies during softmax and P.V of
step i, V of step i+1 during S of step i+1): per lane 2 x KT x hd x 2 / 32 bytes = 256 B
(hd 128, KT 16) of loads in flight, 8 KB per warp.

Expected speed (H200, unmeasured when written): ptxas 13.0 gives 209 registers at hd 128 (G 4
or 8; no spills; capping at 168 spills), 124 at hd 64 G 3, 165 with keys=8 -> 8 resident warps
per SM at hd 128 -> ~64 KB of loads in flight per SM, 2x the ~25-30 KB that 4.2 TB/s x ~0.9 us
of loaded latency needs across 132 SMs; tensor work per 8 keys x 512 B of K+V (hd 128) is 24
mma.sync (8 bf16 + 16 tf32), ~40 SM cycles against the ~256 cycles the bytes take at
16 B/clk/SM; per 16 B loaded a lane issues ~3 mma + ~10 ALU ops.
So it should be bandwidth-bound: expect 3-3.6 TB/s (70-85% of the 4.23 TB/s copy rate) at batch
32-128 and contexts >= 1024, i.e. ~2.5-3x the CUDA-core kernel (1.0-1.25 TB/s). Small batches are
launch-/latency-bound (B=1: split-K to ~2000 warps, partitions of >= 64 keys, plus the merge).

Precision: q rounded to bf16 (after scaling), P rounded to tf32 (cvt.rna), K/V exact, fp32
accumulation: rel. L2 ~4e-4 vs the float64 reference in the simulator, between the FP32 kernel
and flash_prefill (which rounds P to bf16).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from numba import cuda
from kernels_numba.jit import kernel as cached_jit

from kernels_numba.ptx import grid_trigger_early, grid_trigger_late, grid_wait
from kernels_numba.attention import (  # noqa: F401 (reference and shared scratch layout)
    NO_SPLIT_PART,
    _merge_partitions_bf16_kernel,
    _merge_partitions_kernel,
    cache_views,
    window_start,
    attention_ref,
    paged_attention_scratch_shape,
)
from kernels_numba.bf16 import f32_to_bf16, ldg_u64x2
from kernels_numba.ptx import (
    SIM,
    bf16hi_f32,
    bf16lo_f32,
    ex2_f32,
    mma_bf16_16816,
    mma_tf32_1688,
    pack_bf16x2,
    shfl_xor_f32,
    tf32_rna,
)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG = np.float32(-1.0e30)  # finite "minus infinity": no inf - inf
# Warps the split heuristic aims for: one 4-warp block per SM (132 SMs). Splitting further costs
# each extra partition its start-up, its scratch write and the merge, which at moderate contexts
# outweighs the extra warps (H200, graph-timed, 8B heads, ctx 512: B=32 unsplit 24.4 us a layer vs
# 39.6 us in the 3 partitions that 132 x 16 warps asked for; B=1 8 partitions 8.8 us vs 16.7
# unsplit; bench/decode_floor.py, docs/bench/raw/s4_decode_floor.json).
TARGET_WARPS = 64 if SIM else 132 * 4


@dataclass(frozen=True)
class FlashDecodeConfig:
    head_dim: int
    group: int  # query heads per kv head (rows of the mma A operand), 1..8
    block_size: int  # KV cache block size (a compile-time constant: cheap addressing)
    warps: int = 4  # warps per block, each with its own online softmax over interleaved steps
    keys: int = 16  # keys per warp step (multiple of 8): 2 * keys * hd * 2 / 32 B in flight a lane
    out_bf16: bool = False  # out is uint16 bf16 bits [T, Hq * hd] (a cuBLASLt input), not float32 [T, Hq, hd]

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def granule(self) -> int:
        """Partition sizes are multiples of this (every warp step inside one partition)."""
        return self.warps * self.keys


def flash_decode_config(head_dim: int, group: int, block_size: int = 16, **override) -> FlashDecodeConfig:
    cfg = FlashDecodeConfig(head_dim, group, block_size, override.get("warps", 4), override.get("keys", 16),
                            override.get("out_bf16", False))
    if head_dim % 64 or head_dim <= 0:
        raise ValueError(f"flash_decode: head_dim {head_dim} must be a multiple of 64")
    if not 1 <= group <= 8:
        raise ValueError(f"flash_decode: {group} query heads per kv head (1..8 supported)")
    if cfg.keys % 8 or cfg.keys <= 0 or cfg.warps <= 0:
        raise ValueError(f"flash_decode: keys {cfg.keys} must be a multiple of 8")
    if 4 * cfg.warps * group * (head_dim + 2) > 48 * 1024:
        raise ValueError("flash_decode: the warp merge exceeds 48 KB of shared memory")
    return cfg


def flash_decode_partitions(
    num_tokens: int, num_kv_heads: int, max_context: int, cfg: FlashDecodeConfig, scratch_rows: int,
    no_split_context: int = 0,
) -> tuple[int, int]:
    """(partitions, partition_size): about TARGET_WARPS warps in the grid, partitions of at least
    one granule (W x KT keys), at most scratch_rows / T; (1, huge) = no split."""
    if max_context <= no_split_context:
        return 1, NO_SPLIT_PART
    gran = cfg.granule
    want = -(-TARGET_WARPS // max(1, num_tokens * num_kv_heads * cfg.warps))
    parts = min(want, -(-max_context // gran), scratch_rows // max(1, num_tokens))
    if parts <= 1:
        return 1, NO_SPLIT_PART
    part = -(-max_context // parts)
    part = -(-part // gran) * gran
    return -(-max_context // part), part


def _make_kernel(cfg: FlashDecodeConfig):
    HD, G, BS, W, KT = cfg.head_dim, cfg.group, cfg.block_size, cfg.warps, cfg.keys
    NT = 32 * W
    KC = HD // 32  # 16-byte K pieces per lane per key (32-dim reduction chunks)
    NN = KT // 8  # 8-key n-tiles of S per step
    H = HD // 64  # 16-byte V pieces per lane per key
    NO = HD // 8  # tf32 n-tiles of O
    NQ = HD // 8  # Q fragment words per lane (rows g only)
    NKR = NN * KC * 2  # uint64 words of K per lane per step
    NVR = NN * 2 * H * 2  # uint64 words of V per lane per step
    ONE_BLOCK = BS % KT == 0  # a step never crosses a cache block: one table read per step
    NO2 = 2 * NO  # O accumulators per lane (rows g only: the upper half is never kept)
    NN2 = 2 * NN  # S / P values per lane per step
    SO = W * G * HD
    if cfg.out_bf16:
        @cuda.jit(device=True)
        def store(out, tok, hq, d, v):
            out[tok, hq * HD + d] = f32_to_bf16(v)
    else:
        @cuda.jit(device=True)
        def store(out, tok, hq, d, v):
            out[tok, hq, d] = v
    SW = W * G
    U32 = np.uint64(0xFFFFFFFF)
    S32 = np.uint64(32)
    Z = np.uint32(0)
    ZF = np.float32(0.0)

    def flash_decode(q, k_cache, v_cache, block_tables, token_seq, positions, qscale, part_size, window, out,
                     scratch):
        grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
        grid_trigger_early()
        p = cuda.blockIdx.x
        h = cuda.blockIdx.y
        tok = cuda.blockIdx.z
        grid_parts = cuda.gridDim.x
        ctx = positions[tok] + 1
        klo = ctx - window if window > 0 else 0           # keys before klo are masked
        lo = window_start(ctx, window, KT)                # steps start KT-aligned (ONE_BLOCK)
        nparts = min((ctx - lo + part_size - 1) // part_size, grid_parts)
        if p >= nparts:
            return
        p0 = lo + p * part_size
        p1 = ctx if p == nparts - 1 else p0 + part_size
        seq = token_seq[tok]
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        tq = lane & 3

        s_o = cuda.shared.array(SO, np.float32)
        s_m = cuda.shared.array(SW, np.float32)
        s_l = cuda.shared.array(SW, np.float32)
        qf = cuda.local.array(NQ, np.uint32)
        kr = cuda.local.array(NKR, np.uint64)
        vr = cuda.local.array(NVR, np.uint64)
        o = cuda.local.array(NO2, np.float32)
        sc = cuda.local.array(NN2, np.float32)

        # ---- Q rows (head h * G + g; rows >= G zero) as bf16 A fragments, k permuted like K
        hq0 = h * G + min(g, G - 1)
        for kc in range(KC):
            for e in range(4):
                d = 32 * kc + 8 * tq + 2 * e
                w = pack_bf16x2(q[tok, hq0, d] * qscale, q[tok, hq0, d + 1] * qscale)
                qf[4 * kc + e] = w if g < G else Z
        for i in range(2 * NO):
            o[i] = ZF
        m = NEG
        lsum = ZF

        nsteps = (p1 - p0 + KT - 1) // KT
        n_my = (nsteps - warp + W - 1) // W if nsteps > warp else 0
        last = ctx - 1

        for it in range(n_my + 1):
            kb = p0 + (warp + it * W) * KT  # key base of step it (loads)
            cb = kb - W * KT  # key base of step it - 1 (compute)
            if it > 0:
                # ---- S = Q K^T of step it - 1 (log2 units), keys past the partition masked
                for n in range(NN):
                    c0 = ZF
                    c1 = ZF
                    for kc in range(KC):
                        a = kr[(n * KC + kc) * 2]
                        b = kr[(n * KC + kc) * 2 + 1]
                        d4 = mma_bf16_16816(qf[4 * kc], Z, qf[4 * kc + 1], Z, a & U32, a >> S32,
                                            c0, c1, ZF, ZF)
                        d4 = mma_bf16_16816(qf[4 * kc + 2], Z, qf[4 * kc + 3], Z, b & U32, b >> S32,
                                            d4[0], d4[1], ZF, ZF)
                        c0 = d4[0]
                        c1 = d4[1]
                    key = cb + 8 * n + 2 * tq
                    sc[2 * n] = c0 if key >= klo and key < p1 else NEG
                    sc[2 * n + 1] = c1 if key + 1 >= klo and key + 1 < p1 else NEG
            if it < n_my:
                # ---- K of step it -> registers (lane (g, t): key g of each n-tile, dims 32c + 8t..)
                if ONE_BLOCK:
                    blk = max(block_tables[seq, kb // BS], 0)
                for n in range(NN):
                    pos = min(kb + 8 * n + g, last)
                    bi = pos // BS
                    if not ONE_BLOCK:
                        blk = max(block_tables[seq, bi], 0)
                    off = pos - bi * BS
                    for kc in range(KC):
                        a, b = ldg_u64x2(k_cache, (blk, off, h, 2 * (4 * kc + tq)))
                        kr[(n * KC + kc) * 2] = a
                        kr[(n * KC + kc) * 2 + 1] = b
            if it > 0:
                # ---- online softmax (row g; quad = the 4 lanes of the row)
                mx = NEG
                for i in range(2 * NN):
                    mx = max(mx, sc[i])
                mx = max(mx, shfl_xor_f32(mx, 1))
                mx = max(mx, shfl_xor_f32(mx, 2))
                mn = max(m, mx)
                al = ex2_f32(m - mn)
                m = mn
                rs = ZF
                for i in range(2 * NN):
                    pv = tf32_rna(ex2_f32(sc[i] - mn))
                    sc[i] = pv
                    rs += pv
                lsum = lsum * al + rs
                for i in range(2 * NO):
                    o[i] *= al
                # ---- O += P V (tf32): slot t <-> key 2t, slot t + 4 <-> key 2t + 1
                for n in range(NN):
                    pa = sc[2 * n]
                    pb = sc[2 * n + 1]
                    for hh in range(H):
                        ia = ((n * 2) * H + hh) * 2
                        ib = ((n * 2 + 1) * H + hh) * 2
                        for e2 in range(4):
                            wa = vr[ia + (e2 >> 1)]
                            wb = vr[ib + (e2 >> 1)]
                            sh = np.uint64(32 * (e2 & 1))
                            ua = np.uint32((wa >> sh) & U32)
                            ub = np.uint32((wb >> sh) & U32)
                            i0 = 8 * hh + 2 * e2  # n-tiles of dims 64hh + 8n + 2e2 (+1)
                            d4 = mma_tf32_1688(pa, ZF, pb, ZF, bf16lo_f32(ua), bf16lo_f32(ub),
                                               o[2 * i0], o[2 * i0 + 1], ZF, ZF)
                            o[2 * i0] = d4[0]
                            o[2 * i0 + 1] = d4[1]
                            d4 = mma_tf32_1688(pa, ZF, pb, ZF, bf16hi_f32(ua), bf16hi_f32(ub),
                                               o[2 * i0 + 2], o[2 * i0 + 3], ZF, ZF)
                            o[2 * i0 + 2] = d4[0]
                            o[2 * i0 + 3] = d4[1]
            if it < n_my:
                # ---- V of step it -> registers (lane (g, t): keys 2t, 2t + 1 of each n-tile,
                # dims 64h + 8g .. 64h + 8g + 7)
                if ONE_BLOCK:
                    blk = max(block_tables[seq, kb // BS], 0)
                for n in range(NN):
                    for j in range(2):
                        pos = min(kb + 8 * n + 2 * tq + j, last)
                        bi = pos // BS
                        if not ONE_BLOCK:
                            blk = max(block_tables[seq, bi], 0)
                        off = pos - bi * BS
                        for hh in range(H):
                            a, b = ldg_u64x2(v_cache, (blk, off, h, 2 * (8 * hh + g)))
                            vr[((n * 2 + j) * H + hh) * 2] = a
                            vr[((n * 2 + j) * H + hh) * 2 + 1] = b

        grid_trigger_late()      # PDL 'late': the successor's blocks start during the merge below
        # ---- merge the warps' softmax states in shared memory; write out or the split-K partial
        lsum += shfl_xor_f32(lsum, 1)
        lsum += shfl_xor_f32(lsum, 2)
        if g < G:
            base = (warp * G + g) * HD
            for hh in range(H):
                for e in range(8):
                    i = 8 * hh + e
                    d = 64 * hh + 16 * tq + e
                    s_o[base + d] = o[2 * i]
                    s_o[base + d + 8] = o[2 * i + 1]
            if tq == 0:
                s_m[warp * G + g] = m
                s_l[warp * G + g] = lsum
        cuda.syncthreads()
        for idx in range(tid, G * HD, NT):
            gg = idx // HD
            d = idx - gg * HD
            mm = NEG
            for w in range(W):
                mm = max(mm, s_m[w * G + gg])
            num = ZF
            den = ZF
            for w in range(W):
                f = ex2_f32(s_m[w * G + gg] - mm)
                num += f * s_o[(w * G + gg) * HD + d]
                den += f * s_l[w * G + gg]
            hq = h * G + gg
            if nparts == 1:
                store(out, tok, hq, d, num / den)
            else:
                row = tok * grid_parts + p
                scratch[row, hq, d] = num
                if d == 0:
                    scratch[row, hq, HD] = mm * np.float32(LN2)
                    scratch[row, hq, HD + 1] = den

    return flash_decode


@lru_cache(maxsize=None)
def py_kernel(cfg: FlashDecodeConfig):
    """The undecorated kernel function of a config (for compile_ptx)."""
    return _make_kernel(cfg)


@lru_cache(maxsize=None)
def _kernel(cfg: FlashDecodeConfig):
    return cached_jit(py_kernel(cfg))


def flash_decode_attention(
    q,
    k_cache_layer,
    v_cache_layer,
    block_tables,
    token_seq,
    positions,
    scale: float,
    out,
    scratch=None,
    max_context: int | None = None,
    partitions: int | None = None,
    config: FlashDecodeConfig | None = None,
    stream=0,
    no_split_context: int | None = None,
    window: int = 0,
) -> None:
    """Causal paged attention for a ragged batch on the tensor cores (see module docstring); the
    arguments are those of attention.paged_attention. scratch: float32 [rows, Hq, hd + 2] (from
    paged_attention_scratch_shape), None = no split. max_context sets the grid (keep it fixed under
    CUDA-graph capture; a longer context is still handled: the last partition stretches).
    partitions forces the split count; no_split_context (default 0): never split when max_context
    is at most this. out may also be uint16 with room for [T, Hq * hd]: the result as bf16 bits,
    row-major (the staging input of a cuBLASLt product: no conversion launch). window > 0: each
    query reads its last `window` positions (sliding-window attention). Allocates nothing."""
    num_tokens, hq, hd = q.shape
    if num_tokens == 0:
        return
    kc, vc, hk = cache_views("flash_decode", q, k_cache_layer, v_cache_layer)
    cfg = config or flash_decode_config(hd, hq // hk, kc.shape[1])
    bf16 = out.dtype == np.uint16
    if bf16:
        out = out.reshape(out.size)[:num_tokens * hq * hd].reshape(num_tokens, hq * hd)
    if cfg.out_bf16 != bf16:
        cfg = replace(cfg, out_bf16=bf16)
    if (cfg.head_dim, cfg.group, cfg.block_size) != (hd, hq // hk, kc.shape[1]):
        raise ValueError(f"flash_decode: config {cfg} does not match q {q.shape} / cache {kc.shape}")
    if max_context is None:
        max_context = block_tables.shape[1] * kc.shape[1]
    if window > 0:
        max_context = min(max_context, window)      # the keys one query reads
    rows = 0 if scratch is None else scratch.shape[0]
    if partitions is None:
        parts, part = flash_decode_partitions(num_tokens, hk, max_context, cfg, rows, no_split_context or 0)
    elif partitions <= 1:
        parts, part = 1, NO_SPLIT_PART
    else:
        part = -(-max_context // partitions)
        part = -(-part // cfg.granule) * cfg.granule
        parts = -(-max_context // part)
        if num_tokens * parts > rows:
            raise ValueError(f"flash_decode: scratch has {rows} rows, needs {num_tokens * parts}")
    if scratch is None or parts == 1:
        if isinstance(out, np.ndarray):
            scratch = np.zeros((1, 1, hd + 2), np.float32)
        elif not bf16:
            scratch = out              # an unused float32 [., ., .] argument
        elif scratch is None:
            scratch = q
    _kernel(cfg)[(parts, hk, num_tokens), cfg.threads, stream](
        q, kc, vc, block_tables, token_seq, positions, np.float32(scale * LOG2E), np.int32(part), np.int32(window), out,
        scratch
    )
    if parts > 1:
        merge = _merge_partitions_bf16_kernel if bf16 else _merge_partitions_kernel
        merge[(hq, num_tokens), min(128, max(32, hd)), stream](scratch, positions, np.int32(part), np.int32(parts),
                                                                np.int32(window), np.int32(cfg.keys), out)

