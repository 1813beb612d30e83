"""Causal attention over the paged bf16 KV cache: a decode-oriented split-K kernel and a tiled
flash-attention-style prefill kernel, with a float64 reference.

Contract (both kernels): query token t (segment seq) attends to KV positions 0..positions[t] of
its segment (with window W > 0: positions[t] - W + 1..positions[t], sliding-window attention),
read through block_tables[seq]; K/V of the step are already stored. A table entry
of -1 reads block 0 (padding rows of a CUDA graph cannot fault; their output is garbage).
q is float32 [T, Hq, hd] (any strides), out float32 [T, Hq, hd]; caches are one layer, bf16 bits
[num_blocks, block_size, Hk, hd] as uint16, or the same memory viewed as uint64
[num_blocks, block_size, Hk, hd/4] (pass pre-made uint64 views to skip a per-call view). Hq is a
multiple of Hk (GQA); hd a multiple of 8 (16-byte K/V loads: rows must be 16-byte aligned,
true of any device allocation and its per-layer slices). Softmax is online, all math fp32.

paged_attention (decode rows, verify blocks and short prefill chunks in one ragged batch):
  grid (partitions, Hk, T); one block of 128 threads per (token, kv head, context partition)
  serves all Hq/Hk query heads of the group, so each K/V element is read once per group. A K/V
  row is read by `tpt` lanes with 16-byte (8 x bf16) loads; per chunk of C positions the block
  writes the logits to shared memory, updates the running max/sum once per chunk, then
  accumulates P.V in registers. With more than one partition (split-K, "flash-decoding") each
  block writes its unnormalised partial output plus (max, sum) to `scratch` [rows, Hq, hd + 2]
  (row = t * partitions + p) and a second kernel merges them. Tokens whose context fits one
  partition are written directly.
prefill_attention (long prefill segments): grid (query tiles, Hk, S); a tile is RQ (token, head)
  rows of one segment (RQ / G tokens x the G heads of a kv head); K and V tiles of BK positions
  are staged in shared memory as f32 and reused by all rows of the tile; plain FP32 FMA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda
from kernels_numba.jit import kernel as cached_jit

from kernels_numba.ptx import grid_trigger, grid_trigger_early, grid_trigger_late, grid_wait
from kernels_numba.bf16 import (
    NEG_INF,
    SIMULATOR,
    f32_to_bf16,
    from_bf16_bits,
    group_max,
    group_sum,
    group_sum_vec,
    ldg_u64x2,
    unpack_bf16x4,
)

# Blocks the split-K heuristic aims for. H200 sweep (bench/kernels_bench.py --sweep, Llama-3-8B
# heads, session 2): B=1 ctx 512 takes 96 us unsplit, 34 / 23 / 20 us in 4 / 8 / 16 partitions;
# B=32 ctx 1024: 136 us in 8 partitions, 122-125 in 2-4; B=128 ctx 1024: 429 unsplit, 451 in 2.
TARGET_BLOCKS = 16 if SIMULATOR else 1024
MIN_PART = 8 if SIMULATOR else 64      # smallest partition (tokens): B=1 splits 1024 tokens 16 ways
NO_SPLIT_PART = 1 << 30
# Launches whose max_context is at most this never split (the decode kernel writes the output, no
# merge launch). 0: off — one launch fewer did not pay for the lost parallelism (96 vs 20 us above).
NO_SPLIT_CONTEXT = 0


# ---------------------------------------------------------------- decode / ragged: config


@dataclass(frozen=True)
class DecodeConfig:
    head_dim: int
    group: int  # query heads per kv head
    tpt: int  # lanes per KV row (power of two <= 32)
    vpl: int  # 16-byte pieces (8 x bf16) per lane per row
    threads: int
    chunk: int  # tokens per softmax chunk (logits staged in shared memory)
    unroll: int  # rows in flight per lane group


def decode_config(head_dim: int, group: int, **override) -> DecodeConfig:
    """Launch geometry of paged_attention; keyword overrides (tpt, unroll, chunk) are for tuning."""
    if head_dim % 8:
        raise ValueError(f"attention: head_dim {head_dim} must be a multiple of 8")
    pieces = head_dim // 8
    tpt = 32
    while pieces % tpt:
        tpt //= 2
    # Fewer lanes per row = fewer shuffles per token, but more q/acc registers per lane.
    while tpt > 2 and group * 8 * (pieces // (tpt // 2)) <= 32:
        tpt //= 2
    tpt = override.get("tpt", tpt)
    if pieces % tpt or tpt & (tpt - 1) or tpt > 32:
        raise ValueError(f"paged_attention: tpt={tpt} must be a power of two <= 32 dividing {pieces}")
    threads = 64 if SIMULATOR else 128
    # rows in flight per lane group: 4 measured best at every batch of the H200 sweep (hd 128)
    unroll = override.get("unroll", 1 if SIMULATOR else max(1, 4 // (pieces // tpt)))
    per_iter = (threads // tpt) * unroll
    chunk = max(per_iter, override.get("chunk", 32 if SIMULATOR else 128))
    chunk = (chunk + per_iter - 1) // per_iter * per_iter
    return DecodeConfig(head_dim, group, tpt, pieces // tpt, threads, chunk, unroll)


def decode_partitions(
    num_tokens: int, num_kv_heads: int, max_context: int, cfg: DecodeConfig, scratch_rows: int,
    no_split_context: int | None = None,
) -> tuple[int, int]:
    """(partitions, partition_size) for a launch; (1, huge) means no split (always when
    max_context <= no_split_context, default NO_SPLIT_CONTEXT)."""
    if max_context <= (NO_SPLIT_CONTEXT if no_split_context is None else no_split_context):
        return 1, NO_SPLIT_PART
    max_parts = max(1, -(-max_context // MIN_PART))
    want = -(-TARGET_BLOCKS // max(1, num_tokens * num_kv_heads))
    parts = min(want, max_parts, scratch_rows // max(1, num_tokens))
    if parts <= 1:
        return 1, NO_SPLIT_PART
    part = -(-max_context // parts)
    part = -(-part // MIN_PART) * MIN_PART
    return -(-max_context // part), part


def paged_attention_scratch_shape(
    max_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_context: int
) -> tuple[int, int, int]:
    """Shape of the float32 split-K scratch that lets every batch size up to max_tokens split."""
    cfg = decode_config(head_dim, num_q_heads // num_kv_heads)
    rows = 1
    for t in range(1, max_tokens + 1):
        parts, _ = decode_partitions(t, num_kv_heads, max_context, cfg, 1 << 40)
        if parts > 1:
            rows = max(rows, t * parts)
    return rows, num_q_heads, head_dim + 2


# ---------------------------------------------------------------- decode / ragged: kernels


@lru_cache(maxsize=None)
def _decode_kernel(cfg: DecodeConfig):
    HD, G, TPT, VPL, NT, C, U = cfg.head_dim, cfg.group, cfg.tpt, cfg.vpl, cfg.threads, cfg.chunk, cfg.unroll
    NG = NT // TPT  # lane groups (one KV row each per step)
    TPI = NG * U  # rows per iteration of the block
    NW = NT // 32
    QN = VPL * 8
    KW = VPL * 2  # uint64 words per lane per row

    @cached_jit
    def kernel(q, k_cache, v_cache, block_tables, token_seq, positions, scale, part_size, window, out, scratch):
        grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
        grid_trigger()
        p = cuda.blockIdx.x
        h = cuda.blockIdx.y
        t = cuda.blockIdx.z
        grid_parts = cuda.gridDim.x
        ctx = positions[t] + 1
        lo = window_start(ctx, window, 1)
        nparts = min((ctx - lo + part_size - 1) // part_size, grid_parts)
        if p >= nparts:
            return
        p0 = lo + p * part_size
        p1 = ctx if p == nparts - 1 else p0 + part_size
        seq = token_seq[t]
        bs = k_cache.shape[1]
        tid = cuda.threadIdx.x
        grp = tid // TPT
        lane = tid - grp * TPT
        warp = tid // 32
        lane32 = tid - warp * 32

        s_logit = cuda.shared.array((G, C), np.float32)
        s_m = cuda.shared.array(G, np.float32)
        s_l = cuda.shared.array(G, np.float32)
        s_alpha = cuda.shared.array(G, np.float32)
        s_acc = cuda.shared.array((NG, G, HD), np.float32)
        red = cuda.shared.array(NT, np.float32)
        red2 = cuda.shared.array((NT, G), np.float32)

        qf = cuda.local.array((G, QN), np.float32)
        acc = cuda.local.array((G, QN), np.float32)
        part = cuda.local.array(G, np.float32)
        kw = cuda.local.array((U, KW), np.uint64)

        for g in range(G):
            for v in range(VPL):
                d = (v * TPT + lane) * 8
                for e in range(8):
                    qf[g, v * 8 + e] = q[t, h * G + g, d + e] * scale
                    acc[g, v * 8 + e] = np.float32(0.0)
        if tid < G:
            s_m[tid] = NEG_INF
            s_l[tid] = np.float32(0.0)

        for c0 in range(p0, p1, C):
            n = min(C, p1 - c0)
            # ---- logits of this chunk -> s_logit
            for base in range(0, n, TPI):
                for u in range(U):
                    j = base + u * NG + grp
                    if j < n:
                        pos = c0 + j
                        bi = pos // bs
                        blk = max(block_tables[seq, bi], 0)  # -1 (unused table slot) reads block 0
                        off = pos - bi * bs
                        for v in range(VPL):
                            w0, w1 = ldg_u64x2(k_cache, (blk, off, h, 2 * (v * TPT + lane)))
                            kw[u, 2 * v] = w0
                            kw[u, 2 * v + 1] = w1
                    else:
                        for v in range(KW):
                            kw[u, v] = np.uint64(0)
                for u in range(U):
                    for g in range(G):
                        part[g] = np.float32(0.0)
                    for v in range(KW):
                        k0, k1, k2, k3 = unpack_bf16x4(kw[u, v])
                        for g in range(G):
                            part[g] += (
                                qf[g, v * 4] * k0
                                + qf[g, v * 4 + 1] * k1
                                + qf[g, v * 4 + 2] * k2
                                + qf[g, v * 4 + 3] * k3
                            )
                    group_sum_vec(part, G, TPT, red2)
                    j = base + u * NG + grp
                    if lane == 0 and j < n:
                        for g in range(G):
                            s_logit[g, j] = part[g]
            cuda.syncthreads()
            # ---- running max / sum per head (one warp per head), logits -> probabilities
            for g0 in range(0, G, NW):
                g = g0 + warp
                mx = NEG_INF
                m_old = NEG_INF
                if g < G:
                    m_old = s_m[g]
                    for j in range(lane32, n, 32):
                        mx = max(mx, s_logit[g, j])
                mx = group_max(mx, 32, red)
                m_new = max(m_old, mx)
                sm = np.float32(0.0)
                if g < G:
                    for j in range(lane32, n, 32):
                        ex = math.exp(s_logit[g, j] - m_new)
                        s_logit[g, j] = ex
                        sm += ex
                sm = group_sum(sm, 32, red)
                if g < G and lane32 == 0:
                    alpha = math.exp(m_old - m_new)
                    s_alpha[g] = alpha
                    s_l[g] = s_l[g] * alpha + sm
                    s_m[g] = m_new
            cuda.syncthreads()
            # ---- acc = acc * alpha + P . V
            for g in range(G):
                a = s_alpha[g]
                for x in range(QN):
                    acc[g, x] *= a
            for base in range(0, n, TPI):
                for u in range(U):
                    j = base + u * NG + grp
                    if j < n:
                        pos = c0 + j
                        bi = pos // bs
                        blk = max(block_tables[seq, bi], 0)  # -1 (unused table slot) reads block 0
                        off = pos - bi * bs
                        for v in range(VPL):
                            w0, w1 = ldg_u64x2(v_cache, (blk, off, h, 2 * (v * TPT + lane)))
                            kw[u, 2 * v] = w0
                            kw[u, 2 * v + 1] = w1
                for u in range(U):
                    j = base + u * NG + grp
                    if j < n:
                        for g in range(G):
                            part[g] = s_logit[g, j]
                        for v in range(KW):
                            v0, v1, v2, v3 = unpack_bf16x4(kw[u, v])
                            for g in range(G):
                                pg = part[g]
                                acc[g, v * 4] += pg * v0
                                acc[g, v * 4 + 1] += pg * v1
                                acc[g, v * 4 + 2] += pg * v2
                                acc[g, v * 4 + 3] += pg * v3
            cuda.syncthreads()

        # ---- merge the lane groups, then write the output or the split-K partial
        for g in range(G):
            for v in range(VPL):
                d = (v * TPT + lane) * 8
                for e in range(8):
                    s_acc[grp, g, d + e] = acc[g, v * 8 + e]
        cuda.syncthreads()
        for o in range(tid, G * HD, NT):
            g = o // HD
            d = o - g * HD
            tot = np.float32(0.0)
            for r in range(NG):
                tot += s_acc[r, g, d]
            hq = h * G + g
            if nparts == 1:
                out[t, hq, d] = tot / s_l[g]
            else:
                row = t * grid_parts + p
                scratch[row, hq, d] = tot
                if d == 0:
                    scratch[row, hq, HD] = s_m[g]
                    scratch[row, hq, HD + 1] = s_l[g]

    return kernel


@cuda.jit(device=True)
def window_start(ctx, window, align):
    """The first key position a query at ctx - 1 attends to (window 0: full causal attention),
    rounded down to a multiple of align (where a kernel's key steps start)."""
    lo = max(0, ctx - window) if window > 0 else 0
    return lo - lo % align


@cuda.jit(device=True)
def _merge_scale(scratch, base, nparts, hq, hd):
    """(max, 1 / sum) of the nparts softmax states of head hq in scratch rows base.."""
    m = NEG_INF
    for p in range(nparts):
        m = max(m, scratch[base + p, hq, hd])
    den = np.float32(0.0)
    for p in range(nparts):
        den += math.exp(scratch[base + p, hq, hd] - m) * scratch[base + p, hq, hd + 1]
    return m, np.float32(1.0) / den


@cuda.jit(device=True)
def _merged(scratch, base, nparts, hq, hd, d, m, inv):
    num = np.float32(0.0)
    for p in range(nparts):
        num += math.exp(scratch[base + p, hq, hd] - m) * scratch[base + p, hq, d]
    return num * inv


@cached_jit
def _merge_partitions_kernel(scratch, positions, part_size, grid_parts, window, align, out):
    grid_trigger_early()   # before the wait: the o_proj GEMV may launch (and prefetch its weights) while
    grid_wait()      # the attention this merge waits for still runs; then PDL: before any read
    grid_trigger_late()   # PDL 'late': the o_proj GEMV launches once the attention is done
    hq = cuda.blockIdx.x
    t = cuda.blockIdx.y
    ctx = positions[t] + 1
    nparts = min((ctx - window_start(ctx, window, align) + part_size - 1) // part_size, grid_parts)
    if nparts <= 1:
        return
    hd = out.shape[2]
    m, inv = _merge_scale(scratch, t * grid_parts, nparts, hq, hd)
    for d in range(cuda.threadIdx.x, hd, cuda.blockDim.x):
        out[t, hq, d] = _merged(scratch, t * grid_parts, nparts, hq, hd, d, m, inv)


@cached_jit
def _merge_partitions_bf16_kernel(scratch, positions, part_size, grid_parts, window, align, out):
    """_merge_partitions_kernel writing bf16 bits into out uint16 [T, Hq * hd] (a library
    matmul's input, no conversion launch)."""
    grid_trigger_early()   # before the wait, as _merge_partitions_kernel
    grid_wait()      # PDL: before any read of what an earlier kernel wrote
    grid_trigger_late()
    hq = cuda.blockIdx.x
    t = cuda.blockIdx.y
    ctx = positions[t] + 1
    nparts = min((ctx - window_start(ctx, window, align) + part_size - 1) // part_size, grid_parts)
    if nparts <= 1:
        return
    hd = scratch.shape[2] - 2
    m, inv = _merge_scale(scratch, t * grid_parts, nparts, hq, hd)
    for d in range(cuda.threadIdx.x, hd, cuda.blockDim.x):
        out[t, hq * hd + d] = f32_to_bf16(_merged(scratch, t * grid_parts, nparts, hq, hd, d, m, inv))


def _as_u64(cache):
    return cache if cache.dtype == np.uint64 else cache.view(np.uint64)


def cache_views(name: str, q, k_cache, v_cache):
    """(k, v, kv heads): a layer's K/V caches as uint64 views (16-byte loads), checked against
    q [T, Hq, hd]; shared by every attention launcher (decode, prefill, tensor-core variants)."""
    kc, vc = _as_u64(k_cache), _as_u64(v_cache)
    hk = kc.shape[2]
    if q.shape[1] % hk or kc.shape[3] * 4 != q.shape[2]:
        raise ValueError(f"{name}: q {q.shape} does not match cache {kc.shape} (uint64 view)")
    return kc, vc, hk


def paged_attention(
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
    config: DecodeConfig | None = None,
    stream=0,
    no_split_context: int | None = None,
    window: int = 0,
) -> None:
    """Causal paged attention for a ragged batch (see module docstring); window > 0: each query
    reads only its last `window` positions (sliding-window attention).

    scratch: float32 [rows, Hq, hd + 2] from paged_attention_scratch_shape, allocated once by the
    caller; None disables split-K. max_context: upper bound on positions + 1 in this batch
    (default block_tables.shape[1] * block_size; keep it fixed under CUDA graph capture since it
    sets the grid). partitions: force the number of split-K partitions (tests); None = heuristic.
    config: launch geometry override (tuning; see decode_config).
    no_split_context: no split-K (and no merge launch) when max_context is at most this
    (default NO_SPLIT_CONTEXT; 0 = split whenever the heuristic wants to).
    """
    num_tokens, hq, hd = q.shape
    if num_tokens == 0:
        return
    kc, vc, hk = cache_views("paged_attention", q, k_cache_layer, v_cache_layer)
    cfg = config or decode_config(hd, hq // hk)
    if max_context is None:
        max_context = block_tables.shape[1] * kc.shape[1]
    if window > 0:
        max_context = min(max_context, window)      # the keys one query reads
    rows = 0 if scratch is None else scratch.shape[0]
    if partitions is None:
        parts, part = decode_partitions(num_tokens, hk, max_context, cfg, rows, no_split_context)
    elif partitions <= 1:
        parts, part = 1, NO_SPLIT_PART
    else:
        part = -(-max_context // partitions)
        parts = -(-max_context // part)
        if num_tokens * parts > rows:
            raise ValueError(f"paged_attention: scratch has {rows} rows, needs {num_tokens * parts}")
    if scratch is None or parts == 1:
        scratch = np.zeros((1, 1, hd + 2), np.float32) if isinstance(out, np.ndarray) else out
    _decode_kernel(cfg)[(parts, hk, num_tokens), cfg.threads, stream](
        q, kc, vc, block_tables, token_seq, positions, np.float32(scale), np.int32(part), np.int32(window), out, scratch
    )
    if parts > 1:
        _merge_partitions_kernel[(hq, num_tokens), min(128, max(32, hd)), stream](
            scratch, positions, np.int32(part), np.int32(parts), np.int32(window), np.int32(1), out
        )


# ---------------------------------------------------------------- prefill (flash-style)


@dataclass(frozen=True)
class PrefillConfig:
    head_dim: int
    group: int
    rows: int  # (token, head) rows per query tile
    block_k: int  # KV positions per K/V tile
    tx: int  # threads across tile columns
    ty: int  # threads across tile rows


def prefill_config(head_dim: int, group: int, **override) -> PrefillConfig:
    """Tile geometry of prefill_attention; keyword overrides (rows, block_k, tx, ty) are for tuning."""
    if SIMULATOR:
        rows, bk, tx, ty = 8, 8, 4, 4
    elif head_dim <= 128:
        rows, bk, tx, ty = 32, 32, 16, 8
    else:
        rows, bk, tx, ty = 16, 16, 16, 8
    rows, bk = override.get("rows", rows), override.get("block_k", bk)
    tx, ty = override.get("tx", tx), override.get("ty", ty)
    if rows % ty or bk % tx or tx & (tx - 1) or tx > 32 or (tx * ty) % (1 if SIMULATOR else 32):
        raise ValueError(f"prefill_attention: bad tile rows={rows} block_k={bk} tx={tx} ty={ty}")
    if group > rows:
        raise ValueError(f"prefill_attention: {group} query heads per kv head exceed the tile ({rows} rows)")
    if head_dim % tx or head_dim % 8:
        raise ValueError(f"prefill_attention: head_dim {head_dim} must be a multiple of {max(tx, 8)}")
    return PrefillConfig(head_dim, group, rows, bk, tx, ty)


@lru_cache(maxsize=None)
def _prefill_kernel(cfg: PrefillConfig):
    HD, G, RQ, BK, TX, TY = cfg.head_dim, cfg.group, cfg.rows, cfg.block_k, cfg.tx, cfg.ty
    NT = TX * TY
    RM = RQ // TY  # rows per thread: ty + TY * i
    CN = BK // TX  # score columns per thread: tx + TX * c
    OC = HD // TX  # output columns per thread: tx + TX * x
    BQ = RQ // G  # query tokens per tile
    ROWS = BQ * G
    PIECES = HD // 8  # 16-byte pieces per K/V row
    HD1 = HD + 1  # padded shared rows: no bank conflicts on column reads
    BK1 = BK + 1

    @cached_jit
    def kernel(q, k_cache, v_cache, block_tables, seq_query_start, positions, scale, window, out):
        grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
        grid_trigger()
        tile = cuda.blockIdx.x
        h = cuda.blockIdx.y
        seq = cuda.blockIdx.z
        t0 = seq_query_start[seq] + tile * BQ
        t_end = seq_query_start[seq + 1]
        if t0 >= t_end:
            return
        t1 = min(t0 + BQ, t_end)
        tid = cuda.threadIdx.x
        ty = tid // TX
        tx = tid - ty * TX
        bs = k_cache.shape[1]

        s_q = cuda.shared.array((RQ, HD1), np.float32)
        s_kv = cuda.shared.array((BK, HD1), np.float32)
        s_p = cuda.shared.array((RQ, BK1), np.float32)
        red = cuda.shared.array(NT, np.float32)

        for idx in range(tid, RQ * HD, NT):
            r = idx // HD
            d = idx - r * HD
            tok = t0 + r // G
            if r < ROWS and tok < t1:
                s_q[r, d] = q[tok, h * G + r % G, d] * scale
            else:
                s_q[r, d] = np.float32(0.0)

        qpos = cuda.local.array(RM, np.int64)
        m = cuda.local.array(RM, np.float32)
        lsum = cuda.local.array(RM, np.float32)
        o = cuda.local.array((RM, OC), np.float32)
        sc = cuda.local.array((RM, CN), np.float32)
        qv = cuda.local.array(RM, np.float32)
        vv = cuda.local.array(OC, np.float32)
        for i in range(RM):
            r = ty + TY * i
            tok = t0 + r // G
            qpos[i] = positions[tok] if (r < ROWS and tok < t1) else -1
            m[i] = NEG_INF
            lsum[i] = np.float32(0.0)
            for x in range(OC):
                o[i, x] = np.float32(0.0)
        kv_end = positions[t1 - 1] + 1
        first_pos = positions[t0]
        k_lo = window_start(first_pos + 1, window, BK)        # the tile's first row's first key, tile-aligned

        for k0 in range(k_lo, kv_end, BK):
            # ---- K tile -> shared (f32)
            cuda.syncthreads()
            for idx in range(tid, BK * PIECES, NT):
                j = idx // PIECES
                w = idx - j * PIECES
                pos = k0 + j
                if pos < kv_end:
                    bi = pos // bs
                    blk = max(block_tables[seq, bi], 0)
                    w0, w1 = ldg_u64x2(k_cache, (blk, pos - bi * bs, h, 2 * w))
                else:
                    w0 = w1 = np.uint64(0)
                f0, f1, f2, f3 = unpack_bf16x4(w0)
                s_kv[j, 8 * w] = f0
                s_kv[j, 8 * w + 1] = f1
                s_kv[j, 8 * w + 2] = f2
                s_kv[j, 8 * w + 3] = f3
                f0, f1, f2, f3 = unpack_bf16x4(w1)
                s_kv[j, 8 * w + 4] = f0
                s_kv[j, 8 * w + 5] = f1
                s_kv[j, 8 * w + 6] = f2
                s_kv[j, 8 * w + 7] = f3
            cuda.syncthreads()
            # ---- scores
            for i in range(RM):
                for c in range(CN):
                    sc[i, c] = np.float32(0.0)
            for d in range(HD):
                for i in range(RM):
                    qv[i] = s_q[ty + TY * i, d]
                for c in range(CN):
                    kd = s_kv[tx + TX * c, d]
                    for i in range(RM):
                        sc[i, c] += qv[i] * kd
            # ---- causal mask, online softmax, P -> shared
            masked = k0 + BK - 1 > first_pos or (window > 0 and k0 <= kv_end - 1 - window)
            for i in range(RM):
                mx = NEG_INF
                for c in range(CN):
                    key = k0 + tx + TX * c
                    if masked and (key > qpos[i] or (window > 0 and key <= qpos[i] - window)):
                        sc[i, c] = NEG_INF
                    mx = max(mx, sc[i, c])
                mx = group_max(mx, TX, red)
                m_new = max(m[i], mx)
                rs = np.float32(0.0)
                if m_new == NEG_INF:
                    alpha = np.float32(1.0)
                    for c in range(CN):
                        sc[i, c] = np.float32(0.0)
                else:
                    alpha = math.exp(m[i] - m_new)
                    for c in range(CN):
                        sc[i, c] = math.exp(sc[i, c] - m_new)
                        rs += sc[i, c]
                rs = group_sum(rs, TX, red)
                lsum[i] = lsum[i] * alpha + rs
                m[i] = m_new
                for x in range(OC):
                    o[i, x] *= alpha
                for c in range(CN):
                    s_p[ty + TY * i, tx + TX * c] = sc[i, c]
            cuda.syncthreads()
            # ---- V tile -> shared
            for idx in range(tid, BK * PIECES, NT):
                j = idx // PIECES
                w = idx - j * PIECES
                pos = k0 + j
                if pos < kv_end:
                    bi = pos // bs
                    blk = max(block_tables[seq, bi], 0)
                    w0, w1 = ldg_u64x2(v_cache, (blk, pos - bi * bs, h, 2 * w))
                else:
                    w0 = w1 = np.uint64(0)
                f0, f1, f2, f3 = unpack_bf16x4(w0)
                s_kv[j, 8 * w] = f0
                s_kv[j, 8 * w + 1] = f1
                s_kv[j, 8 * w + 2] = f2
                s_kv[j, 8 * w + 3] = f3
                f0, f1, f2, f3 = unpack_bf16x4(w1)
                s_kv[j, 8 * w + 4] = f0
                s_kv[j, 8 * w + 5] = f1
                s_kv[j, 8 * w + 6] = f2
                s_kv[j, 8 * w + 7] = f3
            cuda.syncthreads()
            # ---- O += P V
            for j in range(BK):
                for x in range(OC):
                    vv[x] = s_kv[j, tx + TX * x]
                for i in range(RM):
                    pj = s_p[ty + TY * i, j]
                    for x in range(OC):
                        o[i, x] += pj * vv[x]

        for i in range(RM):
            r = ty + TY * i
            tok = t0 + r // G
            if r < ROWS and tok < t1:
                inv = np.float32(1.0) / lsum[i]
                for x in range(OC):
                    out[tok, h * G + r % G, tx + TX * x] = o[i, x] * inv

    return kernel


def prefill_attention(
    q,
    k_cache_layer,
    v_cache_layer,
    block_tables,
    seq_query_start,
    positions,
    scale: float,
    out,
    max_query_len: int | None = None,
    config: PrefillConfig | None = None,
    stream=0,
    window: int = 0,
) -> None:
    """Causal attention for prefill segments, tiled (see module docstring); window > 0: sliding.

    seq_query_start: int32 [S + 1]; positions must increase by one inside a segment.
    max_query_len: longest segment in this batch (sets the grid; default T).
    config: tile geometry override (tuning; see prefill_config).
    """
    num_tokens, hq, hd = q.shape
    num_seqs = seq_query_start.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return
    kc, vc, hk = cache_views("prefill_attention", q, k_cache_layer, v_cache_layer)
    cfg = config or prefill_config(hd, hq // hk)
    qlen = num_tokens if max_query_len is None else max_query_len
    per_tile = cfg.rows // cfg.group
    tiles = max(1, -(-qlen // per_tile))
    _prefill_kernel(cfg)[(tiles, hk, num_seqs), cfg.tx * cfg.ty, stream](
        q, kc, vc, block_tables, seq_query_start, positions, np.float32(scale), np.int32(window), out
    )


# ---------------------------------------------------------------- reference


def token_seq_from_starts(seq_query_start) -> np.ndarray:
    starts = np.asarray(seq_query_start, np.int64)
    return np.repeat(np.arange(starts.shape[0] - 1, dtype=np.int32), np.diff(starts)).astype(np.int32)


def attention_ref(q, k_cache_layer, v_cache_layer, block_tables, token_seq, positions, scale: float,
                  window: int = 0) -> np.ndarray:
    """float64 [T, Hq, hd]; caches are bf16 bits [NB, BS, Hk, hd] as uint16 (or their uint64
    view), read through the block table. Any subset of a batch's tokens may be passed. window > 0:
    each query reads its last `window` positions only."""
    q = np.asarray(q, np.float64)
    kc = np.asarray(k_cache_layer)
    vc = np.asarray(v_cache_layer)
    if kc.dtype != np.uint16:
        kc, vc = kc.view(np.uint16), vc.view(np.uint16)
    tables = np.asarray(block_tables)
    token_seq = np.asarray(token_seq)
    positions = np.asarray(positions)
    num_tokens, hq, hd = q.shape
    bs, hk = kc.shape[1], kc.shape[2]
    g = hq // hk
    out = np.zeros((num_tokens, hq, hd), np.float64)
    for seq in np.unique(token_seq):  # one segment's K/V in memory at a time
        rows = np.nonzero(token_seq == seq)[0]
        pos = np.arange(int(positions[rows].max()) + 1)
        blk = tables[seq, pos // bs]
        k = from_bf16_bits(kc[blk, pos % bs]).astype(np.float64)  # [L, Hk, hd]
        v = from_bf16_bits(vc[blk, pos % bs]).astype(np.float64)
        for t in rows:
            n = int(positions[t]) + 1
            lo = max(0, n - window) if window > 0 else 0
            s = np.einsum("kgd,lkd->kgl", q[t].reshape(hk, g, hd), k[lo:n]) * scale
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            out[t] = np.einsum("kgl,lkd->kgd", p, v[lo:n]).reshape(hq, hd)
    return out
