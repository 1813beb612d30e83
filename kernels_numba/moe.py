"""Mixture of experts (DeepSeek-V2/V3 style): routing, permutation, grouped expert GEMMs and
un-permutation, each with its float64 NumPy reference.

Shapes: x float32 [T, D]; router logits float32 [T, E]; topk_ids int32 [T, K]; topk_weights
float32 [T, K]; expert weights bf16 bits (uint16) stacked per expert: gate_up [E, 2F, D] (rows
gate | up), down [E, D, F]. A "slot" is one (token, choice) pair, s = t * K + k.

Routing (`route`, one thread per token, everything in registers): scores = softmax or sigmoid of
the logits; choice = scores + e_score_correction_bias (noaux_tc); with n_group > 1 the experts are
split into n_group equal groups, a group scores max(choice) (group_limited_greedy) or the sum of
its top-2 choices (noaux_tc), the topk_group best groups survive; the K best surviving experts by
choice are picked in descending order, ties to the lower index (k passes, each the best element
after the previous one in (score desc, index asc) order: no sort, no mask array). Weights are the
scores (without bias), optionally normalised to sum 1 (norm_topk_prob), times
routed_scaling_factor.

Permutation (counting sort, stable, deterministic: no atomics on global memory):
  `_count`   grid = slot blocks of S slots; per-block expert histogram in shared memory
  `_scan`    one block: expert offsets [E+1], per-(block, expert) bases, and the tile schedule of
             the grouped GEMM (tile i = rows tile_row[i].. of expert tile_expert[i]; -1 = none)
  `_scatter` grid = slot blocks; a slot's row = base + number of earlier slots of its block with
             the same expert; writes sorted_slot[row] = s and slot_row[s] = row
Grouped GEMM (`grouped_linear`): out[r] = x[row_index[r]] @ W[e(r)].T for the rows r of each
expert e; the mma.sync m16n8k16 bf16 tiling of kernels_numba.gemm's tiled path (block tile 64 x
BN x 32, 8 warps, smem double buffer, x rounded to bf16 on staging), one block per (tile of one
expert's rows, BN outputs); rows are gathered from x through row_index (no permuted copy of x).
Contracts as gemm: D, F multiples of 64; rows 16-byte aligned.
Un-permutation (`unpermute`): out[t] (+)= sum_k w[t, k] * y[slot_row[t*K + k]], summed in k order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, uint32
from kernels_numba.jit import kernel as cached_jit

from kernels_numba.activation import silu_mul
from kernels_numba.bf16 import SIMULATOR, from_bf16_bits
from kernels_numba.gemm import SMEM_ALIGN
from kernels_numba.ptx import (ldg_f32x4, ldg_u16x8, lds_u32x4, mma_bf16_16816, pack_bf16x2,
                               sts_u32x4)

__all__ = ["RouteConfig", "route", "route_ref", "permute", "permute_ref", "grouped_linear",
           "grouped_linear_ref", "unpermute", "unpermute_ref", "moe_experts", "moe_experts_ref",
           "MoeWorkspace", "moe_workspace", "max_tiles", "GEMM_BM"]

SLOTS = 32 if SIMULATOR else 256     # slots per permutation block
ROUTE_THREADS = 32 if SIMULATOR else 64
UNPERMUTE_THREADS = 32 if SIMULATOR else 128
GEMM_BM = 64
GEMM_THREADS = 256


# ----------------------------------------------------------------------------- references

from kernels_numba.moe_ref import RouteConfig, route_ref  # noqa: E402,F401  (CUDA-free: moe_ref.py)


def permute_ref(topk_ids, num_experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted_slot [N], slot_row [N], offsets [E+1]): slots sorted by expert (stable)."""
    flat = np.asarray(topk_ids).reshape(-1)
    sorted_slot = np.argsort(flat, kind="stable").astype(np.int32)
    slot_row = np.empty_like(sorted_slot)
    slot_row[sorted_slot] = np.arange(flat.size, dtype=np.int32)
    offsets = np.zeros(num_experts + 1, np.int32)
    np.cumsum(np.bincount(flat, minlength=num_experts), out=offsets[1:])
    return sorted_slot, slot_row, offsets


def _w64(w) -> np.ndarray:
    w = np.asarray(w)
    return from_bf16_bits(w).astype(np.float64) if w.dtype == np.uint16 else w.astype(np.float64, copy=False)


def grouped_linear_ref(x, w, offsets, row_index=None) -> np.ndarray:
    """float64 out[r] = x[row_index[r]] @ W[e].T for offsets[e] <= r < offsets[e+1];
    w [E, N, K] bf16 bits or float."""
    x = np.asarray(x, np.float64)
    rows = x if row_index is None else x[np.asarray(row_index)]
    w = _w64(w)
    out = np.zeros((rows.shape[0], w.shape[1]))
    for e in range(w.shape[0]):
        a, b = int(offsets[e]), int(offsets[e + 1])
        if b > a:
            out[a:b] = rows[a:b] @ w[e].T
    return out


def unpermute_ref(y, slot_row, topk_weights) -> np.ndarray:
    """float64 out[t] = sum_k w[t, k] * y[slot_row[t*K + k]]."""
    w = np.asarray(topk_weights, np.float64)
    t, k = w.shape
    y = np.asarray(y, np.float64)[np.asarray(slot_row)].reshape(t, k, -1)
    return np.einsum("tk,tkd->td", w, y)


def moe_experts_ref(x, topk_ids, topk_weights, w_gate_up, w_down) -> np.ndarray:
    """float64 sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k]."""
    e = w_gate_up.shape[0]
    sorted_slot, slot_row, offsets = permute_ref(topk_ids, e)
    k = np.asarray(topk_ids).shape[1]
    h = grouped_linear_ref(x, w_gate_up, offsets, sorted_slot // k)
    f = h.shape[1] // 2
    a = h[:, :f] / (1.0 + np.exp(-h[:, :f])) * h[:, f:]
    return unpermute_ref(grouped_linear_ref(a, w_down, offsets), slot_row, topk_weights)


# ----------------------------------------------------------------------------- routing kernel

@lru_cache(maxsize=None)
def _route_kernel(cfg: RouteConfig, has_bias: bool):
    E, K, NG, TG = cfg.num_experts, cfg.top_k, cfg.n_group, cfg.topk_group
    GS = E // NG
    SOFTMAX = cfg.scoring == "softmax"
    GROUPED = cfg.grouped
    TOP2 = cfg.method == "noaux_tc"
    NORM = cfg.norm_topk_prob and K > 1
    INF = np.float32(np.inf)

    @cuda.jit(device=True)
    def score(logits, t, e, mx, inv_den):
        v = logits[t, e]
        if SOFTMAX:
            return math.exp(v - mx) * inv_den
        return float32(1.0) / (float32(1.0) + math.exp(-v))

    @cuda.jit(device=True)
    def choice(logits, bias, t, e, mx, inv_den):
        c = score(logits, t, e, mx, inv_den)
        if has_bias:
            c += bias[e]
        return c

    @cuda.jit(device=True)
    def after(v, i, pv, pi):
        """(v, i) comes after (pv, pi) in (value desc, index asc) order."""
        return v < pv or (v == pv and i > pi)

    def kernel(logits, bias, scale, topk_ids, topk_w):
        t = cuda.grid(1)
        if t >= logits.shape[0]:
            return
        mx = -INF
        inv_den = float32(1.0)
        if SOFTMAX:
            for e in range(E):
                mx = max(mx, logits[t, e])
            den = float32(0.0)
            for e in range(E):
                den += math.exp(logits[t, e] - mx)
            inv_den = float32(1.0) / den
        gmask = np.int64(-1)
        if GROUPED:
            gmask = np.int64(0)
            pv = INF
            pg = -1
            for r in range(TG):
                bv = -INF
                bg = -1
                for g in range(NG):
                    m1 = -INF
                    m2 = -INF
                    for i in range(GS):
                        c = choice(logits, bias, t, g * GS + i, mx, inv_den)
                        if c > m1:
                            m2 = m1
                            m1 = c
                        elif c > m2:
                            m2 = c
                    gv = m1 + m2 if TOP2 else m1
                    if after(gv, g, pv, pg) and (bg < 0 or gv > bv):
                        bv = gv
                        bg = g
                gmask |= np.int64(1) << np.int64(bg)
                pv = bv
                pg = bg
        pv = INF
        pe = -1
        wsum = float32(0.0)
        for j in range(K):
            bv = -INF
            be = -1
            for e in range(E):
                if (gmask >> np.int64(e // GS)) & np.int64(1):
                    c = choice(logits, bias, t, e, mx, inv_den)
                    if after(c, e, pv, pe) and (be < 0 or c > bv):
                        bv = c
                        be = e
            topk_ids[t, j] = be
            w = score(logits, t, be, mx, inv_den)
            topk_w[t, j] = w
            wsum += w
            pv = bv
            pe = be
        f = scale
        if NORM:
            f = scale / (wsum + float32(1e-20))
        for j in range(K):
            topk_w[t, j] *= f

    return cached_jit(kernel)


def route(logits, cfg: RouteConfig, topk_ids, topk_weights, bias=None, stream=0) -> None:
    """Device routing: logits float32 [T, E] -> topk_ids int32 [T, K], topk_weights float32 [T, K]."""
    t, e = logits.shape
    if e != cfg.num_experts or tuple(topk_ids.shape) != (t, cfg.top_k):
        raise ValueError(f"moe.route: logits {logits.shape}, ids {topk_ids.shape} do not match {cfg}")
    if t == 0:
        return
    k = _route_kernel(cfg, bias is not None)
    k[-(-t // ROUTE_THREADS), ROUTE_THREADS, stream](
        logits, logits[0] if bias is None else bias, np.float32(cfg.routed_scaling_factor), topk_ids, topk_weights)


# ----------------------------------------------------------------------------- permutation

@lru_cache(maxsize=None)
def _permute_kernels(E: int, S: int):
    @cached_jit
    def count(ids, counts):
        b = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        hist = cuda.shared.array(E, int32)
        for e in range(tid, E, S):
            hist[e] = 0
        cuda.syncthreads()
        s = b * S + tid
        if s < ids.size:
            cuda.atomic.add(hist, ids[s // ids.shape[1], s % ids.shape[1]], 1)
        cuda.syncthreads()
        for e in range(tid, E, S):
            counts[b, e] = hist[e]

    @cached_jit
    def scan(counts, base, offsets, tile_expert, tile_row, bm):
        tid = cuda.threadIdx.x
        nb = counts.shape[0]
        for e in range(tid, E, cuda.blockDim.x):
            tot = 0
            for b in range(nb):
                tot += counts[b, e]
            offsets[e + 1] = tot
        cuda.syncthreads()
        if tid == 0:
            offsets[0] = 0
            for e in range(E):
                offsets[e + 1] += offsets[e]
            i = 0
            for e in range(E):
                for r in range(offsets[e], offsets[e + 1], bm):
                    tile_expert[i] = e
                    tile_row[i] = r
                    i += 1
            for j in range(i, tile_expert.shape[0]):
                tile_expert[j] = -1
                tile_row[j] = 0
        cuda.syncthreads()
        for e in range(tid, E, cuda.blockDim.x):
            run = offsets[e]
            for b in range(nb):
                base[b, e] = run
                run += counts[b, e]

    @cached_jit
    def scatter(ids, base, sorted_slot, slot_row):
        b = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        s_e = cuda.shared.array(S, int32)
        s = b * S + tid
        k = ids.shape[1]
        e = -1
        if s < ids.size:
            e = ids[s // k, s % k]
        s_e[tid] = e
        cuda.syncthreads()
        if e >= 0:
            rank = 0
            for i in range(tid):
                if s_e[i] == e:
                    rank += 1
            row = base[b, e] + rank
            sorted_slot[row] = s
            slot_row[s] = row

    return count, scan, scatter


def max_tiles(num_slots: int, num_experts: int, bm: int = GEMM_BM) -> int:
    """Upper bound on the grouped GEMM's row tiles: sum_e ceil(n_e / bm)."""
    return -(-num_slots // bm) + min(num_experts, num_slots)


@dataclass
class MoeWorkspace:
    """Buffers of one MoE layer call, allocated once for max_tokens (host or device arrays)."""
    counts: object        # int32 [slot blocks, E]
    base: object          # int32 [slot blocks, E]
    offsets: object       # int32 [E + 1]
    tile_expert: object   # int32 [max tiles]
    tile_row: object      # int32 [max tiles]
    sorted_slot: object   # int32 [T * K]
    slot_row: object      # int32 [T * K]
    h: object             # float32 [T * K, 2F]
    a: object             # float32 [T * K, F]
    y: object             # float32 [T * K, D]


def moe_workspace(max_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                  device: bool = False) -> MoeWorkspace:
    n = max_tokens * top_k
    nb = max(1, -(-n // SLOTS))
    mk = (lambda shape, dt: cuda.device_array(shape, dt)) if device else (lambda shape, dt: np.zeros(shape, dt))
    tiles = max_tiles(n, num_experts)
    return MoeWorkspace(mk((nb, num_experts), np.int32), mk((nb, num_experts), np.int32),
                        mk(num_experts + 1, np.int32), mk(tiles, np.int32), mk(tiles, np.int32),
                        mk(n, np.int32), mk(n, np.int32), mk((n, 2 * inter), np.float32),
                        mk((n, inter), np.float32), mk((n, hidden), np.float32))


def permute(topk_ids, num_experts: int, ws: MoeWorkspace, stream=0) -> int:
    """Counting sort of the T*K slots by expert into ws (sorted_slot, slot_row, offsets, tile
    schedule). Returns the number of tile entries to launch (the schedule's capacity)."""
    t, k = topk_ids.shape
    n = t * k
    if n == 0:
        return 0
    nb = -(-n // SLOTS)
    count, scan, scatter = _permute_kernels(num_experts, SLOTS)
    count[nb, SLOTS, stream](topk_ids, ws.counts[:nb])
    tiles = max_tiles(n, num_experts)
    scan[1, 32 if SIMULATOR else 256, stream](ws.counts[:nb], ws.base[:nb], ws.offsets,
                                               ws.tile_expert[:tiles], ws.tile_row[:tiles], GEMM_BM)
    scatter[nb, SLOTS, stream](topk_ids, ws.base[:nb], ws.sorted_slot[:n], ws.slot_row[:n])
    return tiles


# ----------------------------------------------------------------------------- grouped GEMM

def _make_grouped(BN: int, gather: bool):
    """gemm.py's tiled mma kernel with the row tile taken from the expert schedule: rows
    tile_row[i] .. min(+64, offsets[e+1]) of expert e = tile_expert[i], A rows gathered through
    row_index (token = sorted slot // K) when `gather`, B = W[e] ([E*N, K] viewed 2-D)."""
    BM = GEMM_BM
    WM = BM // 2
    WN = BN // 4
    MT = WM // 16
    NT = WN // 8
    CA = BM // 64
    CB = BN // 64
    SA = BM * 16
    SB = BN * 16
    NACC = MT * NT * 4
    NRA = 8 * CA
    NRB = 4 * CB
    NAF = 8 * MT
    NBF = 4 * NT
    SA2 = 2 * SA
    SB2 = 2 * SB

    def grouped_gemm(x, row_index, k_div, w, out, tile_expert, tile_row, offsets):
        e = tile_expert[cuda.blockIdx.x]
        if e < 0:
            return
        K = x.shape[1]
        N = out.shape[1]
        m0 = tile_row[cuda.blockIdx.x]
        m_end = offsets[e + 1]
        n0 = cuda.blockIdx.y * BN
        wrow0 = e * N
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        wm = warp >> 2
        wn = warp & 3

        sA = cuda.shared.array(SA2, uint32, alignment=SMEM_ALIGN)
        sB = cuda.shared.array(SB2, uint32, alignment=SMEM_ALIGN)
        acc = cuda.local.array(NACC, float32)
        for i in range(NACC):
            acc[i] = float32(0.0)
        ra = cuda.local.array(NRA, float32)
        rb = cuda.local.array(NRB, uint32)
        af = cuda.local.array(NAF, uint32)
        bf = cuda.local.array(NBF, uint32)
        arow = cuda.local.array(CA, int32)
        for i in range(CA):
            r = min(m0 + ((tid + 256 * i) >> 2), m_end - 1)
            if gather:
                arow[i] = row_index[r] // k_div
            else:
                arow[i] = r

        nk = K >> 5
        for i in range(CA):
            q = tid + 256 * i
            kc = 8 * (q & 3)
            a = ldg_f32x4(x, arow[i], kc)
            b = ldg_f32x4(x, arow[i], kc + 4)
            for j in range(4):
                ra[8 * i + j] = a[j]
                ra[8 * i + 4 + j] = b[j]
        for i in range(CB):
            q = tid + 256 * i
            v = ldg_u16x8(w, wrow0 + n0 + (q >> 2), 8 * (q & 3))
            for j in range(4):
                rb[4 * i + j] = v[j]

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
                    kc = k1 + 8 * (q & 3)
                    a = ldg_f32x4(x, arow[i], kc)
                    b = ldg_f32x4(x, arow[i], kc + 4)
                    for j in range(4):
                        ra[8 * i + j] = a[j]
                        ra[8 * i + 4 + j] = b[j]
                for i in range(CB):
                    q = tid + 256 * i
                    v = ldg_u16x8(w, wrow0 + n0 + (q >> 2), k1 + 8 * (q & 3))
                    for j in range(4):
                        rb[4 * i + j] = v[j]
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
                for j in range(4):
                    bf[4 * nt + j] = v[j]
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
                for h in range(2):
                    rr = row + 8 * h
                    if rr < m_end:
                        out[rr, col] = acc[o + 2 * h]
                        out[rr, col + 1] = acc[o + 2 * h + 1]

    return grouped_gemm


_GROUPED: dict = {}


def grouped_kernel(bn: int, gather: bool, jit: bool = True):
    key = (bn, gather)
    if key not in _GROUPED:
        _GROUPED[key] = _make_grouped(bn, gather)
    return cached_jit(_GROUPED[key]) if jit else _GROUPED[key]


@lru_cache(maxsize=None)
def _grouped_jit(bn: int, gather: bool):
    return grouped_kernel(bn, gather)


def grouped_linear(x, w, out, ws: MoeWorkspace, tiles: int, row_index=None, k_div: int = 1,
                   bn: int | None = None, stream=0) -> None:
    """out[r] = x[row_index[r] // k_div] @ bf16(W[e]).T for the rows r of expert e (schedule and
    offsets in ws, from permute). x float32 [*, K]; w uint16 [E, N, K]; out float32 [rows, N]."""
    e, n, k = w.shape
    assert k == x.shape[1] and out.shape[1] == n, f"grouped_linear: x {x.shape}, w {w.shape}, out {out.shape}"
    assert k % 64 == 0 and n % 64 == 0, f"grouped_linear needs K and N multiples of 64, got K={k} N={n}"
    assert x.dtype == np.float32 and out.dtype == np.float32 and w.dtype == np.uint16
    if tiles == 0:
        return
    bn = bn or (128 if n % 128 == 0 else 64)
    w2 = w.reshape(e * n, k)
    kern = _grouped_jit(bn, row_index is not None)
    kern[(tiles, n // bn), GEMM_THREADS, stream](
        x, ws.tile_row if row_index is None else row_index, np.int32(k_div), w2, out,
        ws.tile_expert[:tiles], ws.tile_row[:tiles], ws.offsets)


# ----------------------------------------------------------------------------- un-permutation

@cached_jit
def _unpermute_kernel(y, slot_row, topk_w, out, accumulate):
    t = cuda.blockIdx.x
    k = topk_w.shape[1]
    for d in range(cuda.threadIdx.x, out.shape[1], cuda.blockDim.x):
        s = float32(0.0)
        for j in range(k):
            s += topk_w[t, j] * y[slot_row[t * k + j], d]
        if accumulate:
            out[t, d] += s
        else:
            out[t, d] = s


def unpermute(y, slot_row, topk_weights, out, accumulate: bool = False, stream=0) -> None:
    """out[t] (+)= sum_k w[t, k] * y[slot_row[t*K + k]] (float32)."""
    t = out.shape[0]
    if t == 0:
        return
    _unpermute_kernel[t, UNPERMUTE_THREADS, stream](y, slot_row, topk_weights, out, accumulate)


# ----------------------------------------------------------------------------- the layer

def moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down, out, ws: MoeWorkspace,
                accumulate: bool = True, stream=0) -> None:
    """out[t] (+)= sum_k w[t, k] * expert_{ids[t, k]}(x[t]) with SwiGLU experts: permute, grouped
    gate_up GEMM over the gathered rows, silu*mul, grouped down GEMM, weighted un-permutation
    (accumulate=True adds into out: the residual stream). Shared experts are a dense MLP outside."""
    t, k = topk_ids.shape
    n = t * k
    if n == 0:
        return
    e, f2, _ = w_gate_up.shape
    tiles = permute(topk_ids, e, ws, stream)
    h, a, y = ws.h[:n], ws.a[:n], ws.y[:n]
    grouped_linear(x, w_gate_up, h, ws, tiles, row_index=ws.sorted_slot[:n], k_div=k, stream=stream)
    silu_mul(h, a, stream)
    grouped_linear(a, w_down, y, ws, tiles, stream=stream)
    unpermute(y, ws.slot_row[:n], topk_weights, out, accumulate, stream)
