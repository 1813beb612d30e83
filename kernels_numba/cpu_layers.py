"""CPU kernels of a decoder layer besides its products (Numba @njit): RMSNorm, silu(gate) * up,
RoPE with the K/V write into the paged cache, and causal attention over the paged cache.

Each has its NumPy reference beside it (`*_ref`, the arithmetic of metrale's NumPy backend);
exp is `fast_exp` (Cephes' expf, vectorizable; np.exp would be a scalar libm call per element).
Row bodies are separate @njit functions called from the prange loops (inlined there, Numba's parfor
passes would turn their slice assignments into nested parallel loops).
tests/test_cpu_layers.py compares them. float32 throughout; fast-math without the no-NaN /
no-Inf assumptions (masked scores are -inf before the softmax, and the reference keeps inf/NaN).
Shapes: x [T, D]; qkv [T, (Hq + 2 Hk) hd]; a layer's cache k, v [blocks, block_size, Hk, hd].
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from kernels_numba.cpu_cache import CACHE

FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
# Every kernel of the CPU path compiles with error_model="numpy": Python's model checks each float
# division for zero and raises, and that branch keeps LLVM from vectorizing the loop (docs/cpu.md).
QUERY_TILE = 32          # query rows of one attention work item (they share its gathered keys)


@intrinsic
def _pow2(typingctx, k):
    """2.0 ** k for int32 k in [-126, 127], by building the float's exponent bits."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.shl(builder.add(args[0], ir.Constant(i32, 127)), ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())

    return sig, codegen


@njit(fastmath=FASTMATH, inline="always", error_model="numpy")
def fast_exp(x):
    """expf as Cephes computes it (range reduction by ln 2, a degree-7 polynomial; ~1e-7 relative),
    written so LLVM's loop vectorizer can vectorize it (np.exp is a scalar libm call here).
    Arguments are clamped to [-87, 88]: below, the result is 2^-126 * e^(x+87) ~ 0, not a subnormal."""
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    k = np.floor(x * np.float32(1.44269504) + np.float32(0.5))
    r = x - k * np.float32(0.693359375) + k * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * _pow2(np.int32(k))


PARALLEL_MIN_ROWS = 16   # fewer rows than this: the row-wise kernels run on the calling thread
                         # (a parallel region costs more than a few rows of work)


@njit(fastmath=FASTMATH, error_model="numpy")
def _rms_row(x, weight, eps, out, t):
    D = x.shape[1]
    ss = np.float32(0.0)
    for d in range(D):
        ss += x[t, d] * x[t, d]
    inv = np.float32(1.0) / np.sqrt(ss / np.float32(D) + np.float32(eps))
    for d in range(D):
        out[t, d] = x[t, d] * inv * weight[d]


@njit(fastmath=FASTMATH, cache=CACHE, error_model="numpy")
def _rms_norm_serial(x, weight, eps, out):
    for t in range(x.shape[0]):
        _rms_row(x, weight, eps, out, t)


@njit(parallel=True, fastmath=FASTMATH, cache=CACHE, error_model="numpy")
def _rms_norm_parallel(x, weight, eps, out):
    for t in prange(x.shape[0]):
        _rms_row(x, weight, eps, out, t)


def rms_norm(x, weight, eps, out):
    """out [T, D] = x / sqrt(mean(x^2) + eps) * weight."""
    (_rms_norm_parallel if x.shape[0] >= PARALLEL_MIN_ROWS else _rms_norm_serial)(x, weight, eps, out)


def rms_norm_ref(x, weight, eps):
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(var + eps) * weight


@njit(fastmath=FASTMATH, error_model="numpy")
def _silu_row(gate_up, out, t):
    F = out.shape[1]
    for j in range(F):
        g = gate_up[t, j]
        out[t, j] = g / (np.float32(1.0) + fast_exp(-g)) * gate_up[t, F + j]


@njit(fastmath=FASTMATH, cache=CACHE, error_model="numpy")
def _silu_mul_serial(gate_up, out):
    for t in range(out.shape[0]):
        _silu_row(gate_up, out, t)


@njit(parallel=True, fastmath=FASTMATH, cache=CACHE, error_model="numpy")
def _silu_mul_parallel(gate_up, out):
    for t in prange(out.shape[0]):
        _silu_row(gate_up, out, t)


def silu_mul(gate_up, out):
    """out [T, F] = silu(gate_up[:, :F]) * gate_up[:, F:]."""
    (_silu_mul_parallel if out.shape[0] >= PARALLEL_MIN_ROWS else _silu_mul_serial)(gate_up, out)


def silu_mul_ref(gate_up):
    f = gate_up.shape[-1] // 2
    g = gate_up[:, :f]
    return g / (1.0 + np.exp(-g)) * gate_up[:, f:]


@njit(fastmath=FASTMATH, inline="always", error_model="numpy")
def _head_norm(v, w, eps):
    n = v.shape[0]
    ss = np.float32(0.0)
    for d in range(n):
        ss += v[d] * v[d]
    inv = np.float32(1.0) / np.sqrt(ss / np.float32(n) + np.float32(eps))
    for d in range(n):
        v[d] = v[d] * inv * w[d]


@njit(fastmath=FASTMATH, inline="always", error_model="numpy")
def _rope(v, cos, sin, interleaved):
    half = cos.shape[0]
    if interleaved:
        for i in range(half):
            a, b = v[2 * i], v[2 * i + 1]
            v[2 * i] = a * cos[i] - b * sin[i]
            v[2 * i + 1] = a * sin[i] + b * cos[i]
    else:
        for i in range(half):
            a, b = v[i], v[half + i]
            v[i] = a * cos[i] - b * sin[i]
            v[half + i] = a * sin[i] + b * cos[i]


@njit(fastmath=FASTMATH, error_model="numpy")
def _rope_row(t, qkv, cos, sin, interleaved, q_norm, k_norm, eps, slots, k_flat, v_flat, q_out):
    Hq, hd = q_out.shape[1], q_out.shape[2]
    Hk = k_flat.shape[1]
    rot = 2 * cos.shape[1]
    for h in range(Hq):
        q = q_out[t, h]
        q[:] = qkv[t, h * hd:(h + 1) * hd]
        if q_norm.shape[0]:
            _head_norm(q, q_norm, eps)
        _rope(q[:rot], cos[t], sin[t], interleaved)
    s = slots[t]
    if s < 0:
        return
    for h in range(Hk):
        k = k_flat[s, h]
        k[:] = qkv[t, (Hq + h) * hd:(Hq + h + 1) * hd]
        if k_norm.shape[0]:
            _head_norm(k, k_norm, eps)
        _rope(k[:rot], cos[t], sin[t], interleaved)
        v_flat[s, h, :] = qkv[t, (Hq + Hk + h) * hd:(Hq + Hk + h + 1) * hd]


@njit(fastmath=FASTMATH, cache=CACHE, error_model="numpy")
def _rope_serial(qkv, cos, sin, interleaved, q_norm, k_norm, eps, slots, k_flat, v_flat, q_out):
    for t in range(q_out.shape[0]):
        _rope_row(t, qkv, cos, sin, interleaved, q_norm, k_norm, eps, slots, k_flat, v_flat, q_out)


@njit(parallel=True, fastmath=FASTMATH, cache=CACHE, error_model="numpy")
def _rope_parallel(qkv, cos, sin, interleaved, q_norm, k_norm, eps, slots, k_flat, v_flat, q_out):
    for t in prange(q_out.shape[0]):
        _rope_row(t, qkv, cos, sin, interleaved, q_norm, k_norm, eps, slots, k_flat, v_flat, q_out)


def rope_to_cache(qkv, cos, sin, interleaved, q_norm, k_norm, eps, slots, k_flat, v_flat, q_out):
    """q_out [T, Hq, hd] = RoPE(norm(q)); k_flat[slot], v_flat[slot] [Hk, hd] = RoPE(norm(k)), v for
    every token whose slots[t] >= 0. cos/sin [T, rot/2] float32 (rot <= hd: the first rot dims
    rotate); q_norm/k_norm [hd] per-head RMSNorm weights, or empty for none."""
    fn = _rope_parallel if q_out.shape[0] >= PARALLEL_MIN_ROWS else _rope_serial
    fn(qkv, cos, sin, interleaved, q_norm, k_norm, eps, slots, k_flat, v_flat, q_out)


@njit(cache=CACHE, error_model="numpy")
def _attention_items(seq_start, num_kv_heads):
    """Work items (sequence, kv head, first query row, end query row): QUERY_TILE rows each."""
    S = seq_start.shape[0] - 1
    n = 0
    for s in range(S):
        n += (seq_start[s + 1] - seq_start[s] + QUERY_TILE - 1) // QUERY_TILE
    items = np.empty((n * num_kv_heads, 4), np.int64)
    i = 0
    for s in range(S):
        for a in range(seq_start[s], seq_start[s + 1], QUERY_TILE):
            for h in range(num_kv_heads):
                items[i, 0], items[i, 1], items[i, 2] = s, h, a
                items[i, 3] = min(a + QUERY_TILE, seq_start[s + 1])
                i += 1
    return items


GATHER_MIN_QUERIES = 4     # query rows from which a work item gathers its keys (transposed) first


@njit(fastmath=FASTMATH, error_model="numpy")
def _attend_item(items, it, q, k_cache, v_cache, block_tables, positions, window, scale, out):
    if items[it, 3] - items[it, 2] >= GATHER_MIN_QUERIES:
        _attend_gathered(items, it, q, k_cache, v_cache, block_tables, positions, window, scale, out)
    else:
        _attend_direct(items, it, q, k_cache, v_cache, block_tables, positions, window, scale, out)


@njit(fastmath=FASTMATH, error_model="numpy")
def _attend_direct(items, it, q, k_cache, v_cache, block_tables, positions, window, scale, out):
    """Few query rows (decode): each key and value row is read once, where the cache holds it, for
    all the query heads of its kv head."""
    hd = q.shape[2]
    bs, Hk = k_cache.shape[1], k_cache.shape[2]
    G = q.shape[1] // Hk
    s, kvh, a, b = items[it, 0], items[it, 1], items[it, 2], items[it, 3]
    sc = np.empty((G, positions[b - 1] + 1), np.float32)
    acc = np.empty((G, hd), np.float32)
    top = np.empty(G, np.float32)
    total = np.empty(G, np.float32)
    for i in range(a, b):
        p = positions[i]
        j0 = max(0, p - window + 1) if window > 0 else 0
        qs = q[i, kvh * G:(kvh + 1) * G]
        top[:] = -np.inf
        for blk_i in range(j0 // bs, p // bs + 1):
            blk = block_tables[s, blk_i]
            for off in range(max(j0 - blk_i * bs, 0), min(bs, p + 1 - blk_i * bs)):
                kr = k_cache[blk, off, kvh]
                for g in range(G):
                    qg = qs[g]
                    dot = np.float32(0.0)
                    for d in range(hd):
                        dot += qg[d] * kr[d]
                    dot *= np.float32(scale)
                    sc[g, blk_i * bs + off] = dot
                    top[g] = max(top[g], dot)
        total[:] = 0.0
        acc[:] = 0.0
        for blk_i in range(j0 // bs, p // bs + 1):
            blk = block_tables[s, blk_i]
            for off in range(max(j0 - blk_i * bs, 0), min(bs, p + 1 - blk_i * bs)):
                vr = v_cache[blk, off, kvh]
                for g in range(G):
                    e = fast_exp(sc[g, blk_i * bs + off] - top[g])
                    total[g] += e
                    ag = acc[g]
                    for d in range(hd):
                        ag[d] += e * vr[d]
        for g in range(G):
            inv = np.float32(1.0) / total[g]
            for d in range(hd):
                out[i, kvh * G + g, d] = acc[g, d] * inv


@njit(fastmath=FASTMATH, error_model="numpy")
def _attend_gathered(items, it, q, k_cache, v_cache, block_tables, positions, window, scale, out):
    hd = q.shape[2]
    bs, Hk = k_cache.shape[1], k_cache.shape[2]
    G = q.shape[1] // Hk
    s, kvh, a, b = items[it, 0], items[it, 1], items[it, 2], items[it, 3]
    lo = max(0, positions[a] - window + 1) if window > 0 else 0
    n = positions[b - 1] + 1 - lo
    kt = np.empty((hd, n), np.float32)         # the item's keys and values, transposed: every
    vt = np.empty((hd, n), np.float32)         # inner loop below runs over keys, contiguous
    for j in range(n):
        pos = lo + j
        blk, off = block_tables[s, pos // bs], pos % bs
        for d in range(hd):
            kt[d, j] = k_cache[blk, off, kvh, d]
            vt[d, j] = v_cache[blk, off, kvh, d]
    scores = np.empty(n, np.float32)
    for i in range(a, b):
        p = positions[i]
        j0 = max(0, p - window + 1 - lo) if window > 0 else 0
        m = p + 1 - lo - j0                    # visible keys; the loops index views from 0, which
        sc = scores[j0:j0 + m]                 # keeps Numba's negative-index check out of them
        for g in range(G):
            h = kvh * G + g
            for j in range(m):
                sc[j] = 0.0
            for d in range(hd):
                qd = q[i, h, d] * np.float32(scale)
                kd = kt[d, j0:j0 + m]
                for j in range(m):
                    sc[j] += qd * kd[j]
            top = sc[0]
            for j in range(1, m):
                top = max(top, sc[j])
            total = np.float32(0.0)
            for j in range(m):
                e = fast_exp(sc[j] - top)
                sc[j] = e
                total += e
            inv = np.float32(1.0) / total
            for d in range(hd):
                vd = vt[d, j0:j0 + m]
                acc = np.float32(0.0)
                for j in range(m):
                    acc += sc[j] * vd[j]
                out[i, h, d] = acc * inv


@njit(fastmath=FASTMATH, cache=CACHE, error_model="numpy")
def _attention_serial(q, k_cache, v_cache, block_tables, seq_start, positions, window, scale, out):
    items = _attention_items(seq_start, k_cache.shape[2])
    for it in range(items.shape[0]):
        _attend_item(items, it, q, k_cache, v_cache, block_tables, positions, window, scale, out)


@njit(parallel=True, fastmath=FASTMATH, cache=CACHE, error_model="numpy")
def _attention_parallel(q, k_cache, v_cache, block_tables, seq_start, positions, window, scale, out):
    items = _attention_items(seq_start, k_cache.shape[2])
    for it in prange(items.shape[0]):
        _attend_item(items, it, q, k_cache, v_cache, block_tables, positions, window, scale, out)


PARALLEL_MIN_SCORES = 1024      # query-key pairs (times query heads) from which attention runs in parallel
                                # (the A/B that set it: docs/cpu.md)


def paged_attention(q, k_cache, v_cache, block_tables, seq_start, positions, window, scale, out):
    """out [T, Hq, hd] = softmax(q k^T * scale) v over each query's visible keys: positions j <= p
    (and j > p - window when window > 0) of its sequence, read through its block table. GQA:
    query head h reads kv head h // (Hq / Hk). The keys a work item (a sequence, a kv head and up to
    QUERY_TILE query rows) needs are gathered once, K transposed, so a query's scores are one
    contiguous FMA loop over keys."""
    pairs = (int(positions.max()) + 1) * q.shape[0] * q.shape[1] if q.shape[0] else 0
    fn = _attention_parallel if pairs >= PARALLEL_MIN_SCORES else _attention_serial
    fn(q, k_cache, v_cache, block_tables, seq_start, positions, window, scale, out)


def warm() -> None:
    """Calls every kernel here once on tiny inputs of the runtime's types (compiles or loads them)."""
    x = np.ones((1, 16), np.float32)
    ro = np.ones(16, np.float32)             # a norm weight
    for fn in (_rms_norm_serial, _rms_norm_parallel):
        fn(x, ro, 1e-5, np.empty_like(x))
    for fn in (_silu_mul_serial, _silu_mul_parallel):
        fn(np.ones((1, 32), np.float32), np.empty((1, 16), np.float32))
    k = np.zeros((2, 4, 1, 8), np.float32)
    q = np.empty((1, 2, 8), np.float32)
    cs = np.ones((1, 4), np.float32)
    none = ro[:0]
    for fn in (_rope_serial, _rope_parallel):
        fn(np.ones((1, 32), np.float32), cs, cs, True, none, none, 1e-5, np.zeros(1, np.int32),
           k.reshape(-1, 1, 8), k.copy().reshape(-1, 1, 8), q)
    for fn in (_attention_serial, _attention_parallel):
        fn(q, k, k, np.zeros((1, 1), np.int32), np.array([0, 1], np.int32), np.zeros(1, np.int32), 0, 1.0,
           np.empty_like(q))


def paged_attention_ref(q, k_cache, v_cache, block_tables, seq_start, positions, window, scale):
    """The NumPy backend's arithmetic: per sequence, the cached keys up to its last position, masked."""
    T, Hq, hd = q.shape
    bs, Hk = k_cache.shape[1], k_cache.shape[2]
    out = np.zeros_like(q)
    for s in range(len(seq_start) - 1):
        a, b = seq_start[s], seq_start[s + 1]
        ctx = int(positions[b - 1]) + 1
        blocks = block_tables[s, :-(-ctx // bs)]
        k = k_cache[blocks].reshape(-1, Hk, hd)[:ctx]
        v = v_cache[blocks].reshape(-1, Hk, hd)[:ctx]
        keys, p = np.arange(ctx)[None, :], positions[a:b, None]
        masked = (keys > p) | ((keys <= p - window) if window else False)
        qs = q[a:b].reshape(b - a, Hk, Hq // Hk, hd)
        scores = np.einsum("nkgd,ckd->kgnc", qs, k) * scale
        scores[..., masked] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        w = np.exp(scores)
        w /= w.sum(axis=-1, keepdims=True)
        out[a:b] = np.einsum("kgnc,ckd->nkgd", w, v).reshape(b - a, Hq, hd)
    return out
