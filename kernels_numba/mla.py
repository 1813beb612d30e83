"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent cache, with float64 references.

The latent cache of one layer is bf16 bits [num_blocks, block_size, Dk] as uint16, Dk =
kv_lora_rank + qk_rope_head_dim: per token the RMS-normed compressed KV c (kv_lora_rank values)
followed by the RoPE'd shared key k_pe. Blocks have the KV cache's block size and are addressed
by the same block tables and slot mapping (slot = block * block_size + offset, -1 = skip).

Two equal forms of one head h (W = kv_b_proj weight viewed [H, nope + v, r], W_UK = W[:, :nope],
W_UV = W[:, nope:]):
  naive     k_nope = W_UK[h] c, v = W_UV[h] c per cached token; softmax(q.k * scale) . v
  absorbed  q_lat = W_UK[h]^T q_nope; scores = [q_lat | q_pe] . [c | k_pe] (MQA over the latent
            rows, one shared "kv head" of width Dk); out_lat = softmax . c; out = W_UV[h] out_lat.
The absorbed form reads Dk values per cached token for all heads at once: the decode form.

mla_decode (the absorbed attention; decode rows, verify blocks and prefill chunks of one ragged
batch alike): q_abs float32 [T, H, Dk] (already absorbed, any strides), out float32 [T, H, Dv]
with Dv = kv_lora_rank, the first Dv latent columns being the values. Grid (partitions, H / G, T),
one block per (token, group of G heads, context partition); q of the G heads sits in shared
memory (scale folded in); for each chunk of C positions a warp takes a latent row (32 lanes x
4-byte loads, coalesced), computes the G logits and reduces them with shuffles; online softmax per
chunk as in kernels_numba.attention; then every thread accumulates P.c for its Dv/2/threads
column pairs of all G heads in registers. Split-K over context partitions writes partials to
`scratch` [rows, H, Dv + 2] merged by attention's merge kernel (same layout). Token t attends to
positions 0..positions[t] of its segment; table entries of -1 read block 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda
from kernels_numba.jit import kernel as cached_jit

from kernels_numba.attention import NO_SPLIT_PART, TARGET_BLOCKS, _merge_partitions_kernel
from kernels_numba.bf16 import (NEG_INF, SIMULATOR, bf16_to_f32, f32_to_bf16, from_bf16_bits, group_max,
                                group_sum, group_sum_vec, unpack_bf16x2)

__all__ = ["MlaConfig", "mla_config", "mla_decode", "mla_scratch_shape", "store_latent", "head_linear",
           "head_linear_ref", "copy_heads",
           "latent_rows_ref", "mla_naive_ref", "mla_absorbed_ref", "mla_latent_ref", "absorb_q",
           "unabsorb", "store_latent_ref"]


# ---------------------------------------------------------------- references (float64)

def _latent_f64(cache_layer) -> np.ndarray:
    c = np.asarray(cache_layer)
    if c.dtype == np.uint32:
        c = c.view(np.uint16)
    if c.dtype == np.uint16:
        return from_bf16_bits(c).astype(np.float64)
    return c.astype(np.float64, copy=False)


def latent_rows_ref(cache_layer, block_table, length: int) -> np.ndarray:
    """float64 [length, Dk]: a segment's latent rows 0..length-1 read through its block table.
    cache_layer: bf16 bits (uint16, or its uint32 view) or a float array [NB, BS, Dk]."""
    c = _latent_f64(cache_layer)
    pos = np.arange(length)
    bs = c.shape[1]
    return c[np.asarray(block_table)[pos // bs], pos % bs]


def store_latent_ref(c_kv, k_pe, slot_mapping, cache_layer) -> None:
    """cache_layer (float array) [slot] = [c_kv | k_pe] for slots >= 0."""
    flat = cache_layer.reshape(-1, cache_layer.shape[-1])
    keep = np.asarray(slot_mapping) >= 0
    r = c_kv.shape[1]
    flat[slot_mapping[keep], :r] = c_kv[keep]
    flat[slot_mapping[keep], r:] = k_pe[keep]


def _split_kv_b(w_kv_b, num_heads: int, nope: int):
    w = np.asarray(w_kv_b, np.float64)
    w = w.reshape(num_heads, w.shape[0] // num_heads, w.shape[1])
    return w[:, :nope], w[:, nope:]          # W_UK [H, nope, r], W_UV [H, v, r]


def _segments(token_seq):
    token_seq = np.asarray(token_seq)
    for seq in np.unique(token_seq):
        yield int(seq), np.nonzero(token_seq == seq)[0]


def _causal_softmax(scores: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """scores [n, H, L] of n query tokens at `positions`; masked beyond each token's position."""
    mask = np.arange(scores.shape[-1])[None, None, :] > positions[:, None, None]
    s = np.where(mask, -np.inf, scores)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(axis=-1, keepdims=True)


def mla_naive_ref(q_nope, q_pe, cache_layer, w_kv_b, block_tables, token_seq, positions,
                  scale: float) -> np.ndarray:
    """float64 [T, H, v]: K and V decompressed per head from every cached latent row."""
    q_nope, q_pe = np.asarray(q_nope, np.float64), np.asarray(q_pe, np.float64)
    positions = np.asarray(positions)
    num_heads, nope = q_nope.shape[1], q_nope.shape[2]
    w_uk, w_uv = _split_kv_b(w_kv_b, num_heads, nope)
    r = w_uk.shape[2]
    out = np.zeros((q_nope.shape[0], num_heads, w_uv.shape[1]))
    for seq, rows in _segments(token_seq):
        lat = latent_rows_ref(cache_layer, np.asarray(block_tables)[seq], int(positions[rows].max()) + 1)
        c, k_pe = lat[:, :r], lat[:, r:]
        k_nope = np.einsum("lr,hnr->lhn", c, w_uk)
        v = np.einsum("lr,hvr->lhv", c, w_uv)
        s = (np.einsum("thn,lhn->thl", q_nope[rows], k_nope) + np.einsum("thd,ld->thl", q_pe[rows], k_pe)) * scale
        out[rows] = np.einsum("thl,lhv->thv", _causal_softmax(s, positions[rows]), v)
    return out


def absorb_q(q_nope, w_kv_b) -> np.ndarray:
    """q_lat [T, H, r] = W_UK[h]^T q_nope[t, h] (float64)."""
    q_nope = np.asarray(q_nope, np.float64)
    w_uk, _ = _split_kv_b(w_kv_b, q_nope.shape[1], q_nope.shape[2])
    return np.einsum("thn,hnr->thr", q_nope, w_uk)


def unabsorb(out_lat, w_kv_b, nope: int) -> np.ndarray:
    """out [T, H, v] = W_UV[h] out_lat[t, h] (float64)."""
    out_lat = np.asarray(out_lat, np.float64)
    _, w_uv = _split_kv_b(w_kv_b, out_lat.shape[1], nope)
    return np.einsum("thr,hvr->thv", out_lat, w_uv)


def mla_latent_ref(q_abs, cache_layer, block_tables, token_seq, positions, scale: float,
                   value_dim: int) -> np.ndarray:
    """float64 [T, H, value_dim]: attention of q_abs [T, H, Dk] over the latent rows (one shared
    kv head), values = the first value_dim latent columns. The oracle of mla_decode."""
    q_abs = np.asarray(q_abs, np.float64)
    positions = np.asarray(positions)
    out = np.zeros((q_abs.shape[0], q_abs.shape[1], value_dim))
    for seq, rows in _segments(token_seq):
        lat = latent_rows_ref(cache_layer, np.asarray(block_tables)[seq], int(positions[rows].max()) + 1)
        s = np.einsum("thd,ld->thl", q_abs[rows], lat) * scale
        out[rows] = np.einsum("thl,lr->thr", _causal_softmax(s, positions[rows]), lat[:, :value_dim])
    return out


def mla_absorbed_ref(q_nope, q_pe, cache_layer, w_kv_b, block_tables, token_seq, positions,
                     scale: float) -> np.ndarray:
    """float64 [T, H, v]: q absorbed into the latent space, attention over the latent rows,
    output up-projected. Equal to mla_naive_ref (associativity of the two products)."""
    q_lat = absorb_q(q_nope, w_kv_b)
    q_abs = np.concatenate([q_lat, np.asarray(q_pe, np.float64)], axis=-1)
    lat = mla_latent_ref(q_abs, cache_layer, block_tables, token_seq, positions, scale, q_lat.shape[2])
    return unabsorb(lat, w_kv_b, np.asarray(q_nope).shape[2])


# ---------------------------------------------------------------- store kernel

STORE_THREADS = 32 if SIMULATOR else 128


@cached_jit
def _store_latent_kernel(c_kv, k_pe, slot_mapping, cache):
    t = cuda.blockIdx.x
    slot = slot_mapping[t]
    if slot < 0:
        return
    bs = cache.shape[1]
    blk = slot // bs
    off = slot - blk * bs
    r = c_kv.shape[1]
    dk = cache.shape[2]
    for d in range(cuda.threadIdx.x, dk, cuda.blockDim.x):
        x = c_kv[t, d] if d < r else k_pe[t, d - r]
        cache[blk, off, d] = f32_to_bf16(x)


def store_latent(c_kv, k_pe, slot_mapping, cache_layer, stream=0) -> None:
    """cache_layer[slot] = bf16([c_kv[t] | k_pe[t]]); c_kv float32 [T, r], k_pe float32 [T, rope]
    (any strides: slices of the kv_a output), cache_layer uint16 [NB, BS, r + rope]."""
    t = c_kv.shape[0]
    if t == 0:
        return
    if c_kv.shape[1] + k_pe.shape[1] != cache_layer.shape[2]:
        raise ValueError(f"store_latent: {c_kv.shape[1]} + {k_pe.shape[1]} values != cache width {cache_layer.shape[2]}")
    _store_latent_kernel[t, STORE_THREADS, stream](c_kv, k_pe, slot_mapping, cache_layer)


# ---------------------------------------------------------------- decode kernel


@dataclass(frozen=True)
class MlaConfig:
    latent_dim: int     # Dk = kv_lora_rank + rope dim (q_abs width, latent row width)
    value_dim: int      # Dv = kv_lora_rank
    group: int          # query heads per block
    threads: int
    chunk: int          # positions per softmax chunk


def mla_config(latent_dim: int, value_dim: int, num_heads: int, **override) -> MlaConfig:
    """Launch geometry: the largest group of heads <= 16 dividing num_heads (q of a group takes
    group * Dk * 4 bytes of shared memory: 36 KB for DeepSeek's 16 x 576)."""
    if latent_dim % 2 or value_dim % 2 or value_dim > latent_dim:
        raise ValueError(f"mla: latent width {latent_dim} and value width {value_dim} must be even, value <= latent")
    group = override.get("group") or max(g for g in range(1, min(16, num_heads) + 1) if num_heads % g == 0)
    if num_heads % group:
        raise ValueError(f"mla: group {group} does not divide {num_heads} heads")
    threads = override.get("threads", 32 if SIMULATOR else 128)
    chunk = override.get("chunk", 8 if SIMULATOR else 64)
    if threads % 32 or chunk % (threads // 32):
        raise ValueError(f"mla: threads {threads} must be a multiple of 32 and chunk {chunk} of the warps")
    return MlaConfig(latent_dim, value_dim, group, threads, chunk)


def mla_partitions(num_tokens: int, head_groups: int, max_context: int, cfg: MlaConfig,
                   scratch_rows: int) -> tuple[int, int]:
    """(partitions, partition size) of a launch; (1, huge) = no split. Aims at TARGET_BLOCKS."""
    max_parts = max(1, -(-max_context // cfg.chunk))
    want = -(-TARGET_BLOCKS // max(1, num_tokens * head_groups))
    parts = min(want, max_parts, scratch_rows // max(1, num_tokens))
    if parts <= 1:
        return 1, NO_SPLIT_PART
    part = -(-max_context // parts)
    part = -(-part // cfg.chunk) * cfg.chunk
    return -(-max_context // part), part


def mla_scratch_shape(max_tokens: int, num_heads: int, latent_dim: int, value_dim: int,
                      max_context: int) -> tuple[int, int, int]:
    """float32 split-K scratch that lets every batch size up to max_tokens split."""
    cfg = mla_config(latent_dim, value_dim, num_heads)
    rows = 1
    for t in range(1, max_tokens + 1):
        parts, _ = mla_partitions(t, num_heads // cfg.group, max_context, cfg, 1 << 40)
        if parts > 1:
            rows = max(rows, t * parts)
    return rows, num_heads, value_dim + 2


@lru_cache(maxsize=None)
def _mla_kernel(cfg: MlaConfig):
    DK, DV, G, NT, C = cfg.latent_dim, cfg.value_dim, cfg.group, cfg.threads, cfg.chunk
    NW = NT // 32
    KW = DK // 2                     # uint32 words (2 x bf16) per latent row
    KI = (KW + 31) // 32             # words per lane per row
    VW = DV // 2
    VI = (VW + NT - 1) // NT         # value word pairs per thread
    return _build_mla_kernel(DK, DV, G, NT, C, NW, KW, KI, VW, VI)


def _build_mla_kernel(DK, DV, G, NT, C, NW, KW, KI, VW, VI):
    VI2 = 2 * VI
    RED2 = (NT, G) if SIMULATOR else (1, 1)    # group_sum_vec's exchange: the simulator only

    def kernel(q, cache, block_tables, token_seq, positions, scale, part_size, out, scratch):
        p = cuda.blockIdx.x
        h0 = cuda.blockIdx.y * G
        t = cuda.blockIdx.z
        grid_parts = cuda.gridDim.x
        ctx = positions[t] + 1
        nparts = min((ctx + part_size - 1) // part_size, grid_parts)
        if p >= nparts:
            return
        p0 = p * part_size
        p1 = ctx if p == nparts - 1 else p0 + part_size
        seq = token_seq[t]
        bs = cache.shape[1]
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid - warp * 32

        s_q = cuda.shared.array((G, DK), np.float32)
        s_logit = cuda.shared.array((G, C), np.float32)
        s_m = cuda.shared.array(G, np.float32)
        s_l = cuda.shared.array(G, np.float32)
        s_alpha = cuda.shared.array(G, np.float32)
        red = cuda.shared.array(NT, np.float32)
        red2 = cuda.shared.array(RED2, np.float32)

        acc = cuda.local.array((G, VI2), np.float32)
        part = cuda.local.array(G, np.float32)
        kw = cuda.local.array(KI, np.uint32)

        for i in range(tid, G * DK, NT):
            g = i // DK
            d = i - g * DK
            s_q[g, d] = q[t, h0 + g, d] * scale
        for g in range(G):
            for x in range(VI2):
                acc[g, x] = np.float32(0.0)
        if tid < G:
            s_m[tid] = NEG_INF
            s_l[tid] = np.float32(0.0)
        cuda.syncthreads()

        for c0 in range(p0, p1, C):
            n = min(C, p1 - c0)
            # ---- logits: one latent row per warp, G dot products, shuffle-reduced
            for base in range(0, n, NW):
                j = base + warp
                if j < n:
                    pos = c0 + j
                    bi = pos // bs
                    blk = max(block_tables[seq, bi], 0)
                    off = pos - bi * bs
                    for i in range(KI):
                        w = i * 32 + lane
                        kw[i] = cache[blk, off, min(w, KW - 1)]
                for g in range(G):
                    part[g] = np.float32(0.0)
                if j < n:
                    for i in range(KI):
                        w = i * 32 + lane
                        if w < KW:
                            k0, k1 = unpack_bf16x2(kw[i])
                            for g in range(G):
                                part[g] += s_q[g, 2 * w] * k0 + s_q[g, 2 * w + 1] * k1
                group_sum_vec(part, G, 32, red2)
                if lane == 0 and j < n:
                    for g in range(G):
                        s_logit[g, j] = part[g]
            cuda.syncthreads()
            # ---- running max / sum per head (one warp per head)
            for g0 in range(0, G, NW):
                g = g0 + warp
                mx = NEG_INF
                m_old = NEG_INF
                if g < G:
                    m_old = s_m[g]
                    for j in range(lane, n, 32):
                        mx = max(mx, s_logit[g, j])
                mx = group_max(mx, 32, red)
                m_new = max(m_old, mx)
                sm = np.float32(0.0)
                if g < G:
                    for j in range(lane, n, 32):
                        ex = math.exp(s_logit[g, j] - m_new)
                        s_logit[g, j] = ex
                        sm += ex
                sm = group_sum(sm, 32, red)
                if g < G and lane == 0:
                    alpha = math.exp(m_old - m_new)
                    s_alpha[g] = alpha
                    s_l[g] = s_l[g] * alpha + sm
                    s_m[g] = m_new
            cuda.syncthreads()
            # ---- acc = acc * alpha + P . c
            for g in range(G):
                a = s_alpha[g]
                for x in range(VI2):
                    acc[g, x] *= a
            for j in range(n):
                pos = c0 + j
                bi = pos // bs
                blk = max(block_tables[seq, bi], 0)
                off = pos - bi * bs
                for i in range(VI):
                    w = i * NT + tid
                    if w < VW:
                        v0, v1 = unpack_bf16x2(cache[blk, off, w])
                        for g in range(G):
                            pg = s_logit[g, j]
                            acc[g, 2 * i] += pg * v0
                            acc[g, 2 * i + 1] += pg * v1
            cuda.syncthreads()

        for i in range(VI):
            w = i * NT + tid
            if w < VW:
                for g in range(G):
                    hq = h0 + g
                    if nparts == 1:
                        inv = np.float32(1.0) / s_l[g]
                        out[t, hq, 2 * w] = acc[g, 2 * i] * inv
                        out[t, hq, 2 * w + 1] = acc[g, 2 * i + 1] * inv
                    else:
                        row = t * grid_parts + p
                        scratch[row, hq, 2 * w] = acc[g, 2 * i]
                        scratch[row, hq, 2 * w + 1] = acc[g, 2 * i + 1]
                        if w == 0:
                            scratch[row, hq, DV] = s_m[g]
                            scratch[row, hq, DV + 1] = s_l[g]

    kernel.__name__ = f"mla_decode_dk{DK}_dv{DV}_g{G}"
    return cached_jit(kernel)


def _as_u32(cache):
    return cache if cache.dtype == np.uint32 else cache.view(np.uint32)


def mla_decode(q_abs, cache_layer, block_tables, token_seq, positions, scale: float, out,
               scratch=None, max_context: int | None = None, partitions: int | None = None,
               config: MlaConfig | None = None, stream=0) -> None:
    """out[t, h] = softmax_l(q_abs[t, h] . latent[l] * scale) . latent[l, :Dv] over positions
    0..positions[t] of token t's segment (see the module docstring).

    cache_layer: uint16 [NB, BS, Dk] bf16 bits or its uint32 view [NB, BS, Dk/2] (rows 4-byte
    aligned). scratch: float32 mla_scratch_shape(...) allocated once, None disables split-K;
    max_context / partitions / config as in attention.paged_attention."""
    num_tokens, num_heads, dk = q_abs.shape
    if num_tokens == 0:
        return
    cache = _as_u32(cache_layer)
    dv = out.shape[2]
    if cache.shape[2] * 2 != dk or out.shape[:2] != q_abs.shape[:2]:
        raise ValueError(f"mla_decode: q {q_abs.shape}, cache {cache.shape} (uint32 view) and out {out.shape} disagree")
    cfg = config or mla_config(dk, dv, num_heads)
    if max_context is None:
        max_context = block_tables.shape[1] * cache.shape[1]
    rows = 0 if scratch is None else scratch.shape[0]
    groups = num_heads // cfg.group
    if partitions is None:
        parts, part = mla_partitions(num_tokens, groups, max_context, cfg, rows)
    elif partitions <= 1:
        parts, part = 1, NO_SPLIT_PART
    else:
        part = -(-max_context // partitions)
        parts = -(-max_context // part)
        if num_tokens * parts > rows:
            raise ValueError(f"mla_decode: scratch has {rows} rows, needs {num_tokens * parts}")
    if scratch is None or parts == 1:
        scratch = np.zeros((1, 1, dv + 2), np.float32) if isinstance(out, np.ndarray) else out
    _mla_kernel(cfg)[(parts, groups, num_tokens), cfg.threads, stream](
        q_abs, cache, block_tables, token_seq, positions, np.float32(scale), np.int32(part), out, scratch)
    if parts > 1:
        _merge_partitions_kernel[(num_heads, num_tokens), min(128, max(32, dv)), stream](
            scratch, positions, np.int32(part), np.int32(parts), np.int32(0), np.int32(1), out)


# ---------------------------------------------------------------- per-head products

HEAD_WARPS = 1 if SIMULATOR else 4     # output columns per block (a warp each)
HEAD_TOKENS = 8                        # token rows per block sharing each weight read


def head_linear_ref(x, w) -> np.ndarray:
    """float64 out[t, h] = W[h] @ x[t, h]: x [T, H, K], w [H, N, K] (bf16 bits or float)."""
    w = np.asarray(w)
    w = from_bf16_bits(w).astype(np.float64) if w.dtype == np.uint16 else w.astype(np.float64)
    return np.einsum("thk,hnk->thn", np.asarray(x, np.float64), w)


@lru_cache(maxsize=None)
def _head_linear_kernel(TT: int, NW: int):
    RED = 32 * NW                      # a compile-time constant for shared.array

    @cached_jit
    def kernel(x, w, out):
        h = cuda.blockIdx.y
        t0 = cuda.blockIdx.z * TT
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid - warp * 32
        n = cuda.blockIdx.x * NW + warp
        T = x.shape[0]
        K = x.shape[2]
        red = cuda.shared.array(RED, np.float32)
        acc = cuda.local.array(TT, np.float32)
        for i in range(TT):
            acc[i] = np.float32(0.0)
        if n < w.shape[1]:
            for k in range(lane, K, 32):
                wv = bf16_to_f32(w[h, n, k])
                for i in range(TT):
                    if t0 + i < T:
                        acc[i] += x[t0 + i, h, k] * wv
        for i in range(TT):
            v = group_sum(acc[i], 32, red)     # every thread takes part (shuffles / barriers)
            if lane == 0 and n < w.shape[1] and t0 + i < T:
                out[t0 + i, h, n] = v

    return kernel


def head_linear(x, w, out, stream=0) -> None:
    """out[t, h, n] = sum_k x[t, h, k] * bf16(w[h, n, k]): one small product per head (MLA's
    q absorption through W_UK^T and up-projection through W_UV). x float32 [T, H, K], out float32
    [T, H, N], any strides (slices of wider buffers); w uint16 [H, N, K]. A warp per output column
    and head, lanes over K (coalesced weight rows), HEAD_TOKENS rows per block share each weight
    value. Memory-bound on the weights at decode; a plain loop for long prefills (no tensor cores)."""
    t, h, k = x.shape
    if t == 0:
        return
    if tuple(w.shape) != (h, out.shape[2], k) or tuple(out.shape[:2]) != (t, h):
        raise ValueError(f"head_linear: x {x.shape}, w {w.shape}, out {out.shape} disagree")
    grid = (-(-out.shape[2] // HEAD_WARPS), h, -(-t // HEAD_TOKENS))
    _head_linear_kernel(HEAD_TOKENS, HEAD_WARPS)[grid, 32 * HEAD_WARPS, stream](x, w, out)


@cached_jit
def _copy_heads_kernel(src, dst):
    t = cuda.blockIdx.x
    d_n = src.shape[2]
    for i in range(cuda.threadIdx.x, src.shape[1] * d_n, cuda.blockDim.x):
        h = i // d_n
        d = i - h * d_n
        dst[t, h, d] = src[t, h, d]


def copy_heads(src, dst, stream=0) -> None:
    """dst[t, h, :] = src[t, h, :] for strided [T, H, D] views (q_pe into the tail of q_abs)."""
    if src.shape[0] == 0:
        return
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"copy_heads: {src.shape} != {dst.shape}")
    _copy_heads_kernel[src.shape[0], STORE_THREADS, stream](src, dst)
