"""8-bit-activation CPU products on legacy GGUF blocks regrouped 16 rows at a time (Q4_0, Q4_1, Q8_0).

The blocks of 16 consecutive rows are interleaved once at load (`repack_x16`: the same bytes,
another order, as llama.cpp's CPU "repack" buffers do): for each 32-column block, the 16 rows'
f16 scales (and offsets), then their quant bytes 4 at a time, so that one 512-bit load holds 4
bytes of each of 16 rows and one vpdpbusd against 4 activation bytes broadcast to every lane sums
16 rows at once. No horizontal sums, the scales applied as vectors: ~8x fewer instructions a
weight byte than the row-wise kernels of cpu_quant.py (row_dot_q8), which stream a row at a time.

Activations: int8 in natural column order and (dx, dx * sum of the block's int8) a 32-block
(`quantize_flat`; the same rounding as cpu_quant.quantize_q8). References: cpu_quant.matmul_q8_ref
(tests/test_cpu_x16.py). Contracts: rows a multiple of 16 (`repackable`); x float32 C-contiguous
[T, K]; y float32 C-contiguous [T, R].
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels_numba import cpu_quant as Q
from kernels_numba.cpu_cache import CACHE

X16_KINDS = ("q4_0", "q4_1", "q8_0")
GROUP = 16                                        # rows a group
_SCALES = {"q4_0": 2, "q4_1": 4, "q8_0": 2}       # bytes of f16 scale (+ offset) leading a block
_DTYPES = {k: np.dtype([(k + "x16", np.uint8, (GROUP * Q.KINDS[k][1],))]) for k in X16_KINDS}
GROUPS_A_CHUNK = 2                                # groups a parallel work item takes at up to 8 tokens
GROUPS_A_TILE = 4                                 # ... and with more (their token tiles reuse them)
PREFETCH = ()                                     # (bytes ahead, locality) the block loop prefetches: none
                                                  # (2 KiB ahead cost batch 1 15-35% on an AVX2 EPYC: docs/cpu.md)

I8, I16, I32, I64, F32 = Q.I8, Q.I16, Q.I32, Q.I64, Q.F32
VF, VI8_64, VI32_16 = Q.VF, Q.VI8_64, Q.VI32_16
VH = ir.VectorType(ir.HalfType(), 16)


def repackable(kind: str, rows: int) -> bool:
    return kind in X16_KINDS and rows % GROUP == 0


def repack_x16(data: np.ndarray, kind: str, done=None, chunk: int = 4096) -> np.ndarray:
    """uint8 [R, bytes a row] of `kind` blocks -> read-only records [R / 16, blocks a row], each the
    16 rows' block b: their scales (f16 x 16; Q4_1: then the offsets), then their quant bytes as
    [quant bytes / 4][16 rows][4]. `chunk` rows at a time, each handed to done(rows) once copied
    (the caller may drop their pages: a large matrix is never resident twice)."""
    cols, nbytes = Q.KINDS[kind]
    rows, width = data.shape
    if not repackable(kind, rows) or width % nbytes:
        raise ValueError(f"{kind} x16: rows a multiple of {GROUP} of whole blocks expected, got {data.shape}")
    nb, head = width // nbytes, _SCALES[kind]
    quads = (nbytes - head) // 4
    out = np.empty((rows // GROUP, nb, GROUP * nbytes), np.uint8)    # written through views: no temporaries
    for r0 in range(0, rows, chunk):
        src = data[r0:r0 + chunk]
        G = src.shape[0] // GROUP
        t = src.reshape(G, GROUP, nb, nbytes).transpose(0, 2, 1, 3)                    # [G, nb, 16, nbytes]
        dst = out[r0 // GROUP:r0 // GROUP + G]
        for i in range(0, head, 2):
            dst[..., GROUP * i:GROUP * (i + 2)].reshape(G, nb, GROUP, 2)[...] = t[..., i:i + 2]
        dst[..., GROUP * head:].reshape(G, nb, quads, GROUP, 4)[...] = \
            t[..., head:].reshape(G, nb, GROUP, quads, 4).transpose(0, 1, 3, 2, 4)
        if done is not None:
            done(src)
    blocks = out.view(_DTYPES[kind])[..., 0]
    blocks.flags.writeable = False
    return blocks


def unpack_rows(blocks: np.ndarray, kind: str, rows: np.ndarray) -> np.ndarray:
    """uint8 [len(rows), bytes a row]: rows of a repack_x16 array in the file's block layout."""
    _, nbytes = Q.KINDS[kind]
    head = _SCALES[kind]
    raw = blocks.view(np.uint8).reshape(blocks.shape[0], blocks.shape[1], GROUP * nbytes)[rows // GROUP]
    i = (rows % GROUP)[:, None, None]
    fields = [np.take_along_axis(raw[..., GROUP * f:GROUP * (f + 2)].reshape(len(rows), -1, GROUP, 2), i[..., None], 2)[:, :, 0]
              for f in range(0, head, 2)]
    quants = raw[..., GROUP * head:].reshape(len(rows), raw.shape[1], -1, GROUP, 4)
    quants = np.take_along_axis(quants, i[..., None, None], 3)[:, :, :, 0].reshape(len(rows), raw.shape[1], -1)
    return np.concatenate(fields + [quants], axis=-1).reshape(len(rows), -1)


def _x16_kind(w) -> str | None:
    if not isinstance(w, types.Array) or w.ndim != 2 or not isinstance(w.dtype, types.Record):
        return None
    names = list(w.dtype.fields)
    return names[0][:-3] if len(names) == 1 and names[0][:-3] in X16_KINDS and names[0].endswith("x16") else None


def _bcast32(e, addr):
    """<16 x i32> of the 4 bytes at addr, in every lane."""
    return e.splat(e.load(addr, 0, I32), VI32_16)


@intrinsic
def group_dot(typingctx, w, g, q_addr, q_stride, s_addr, s_stride, out_addr, ntok):
    """out[t, i] = x[t] . W[16 g + i] for t < ntok (a literal 1..8), i < 16, out float32 [ntok, 16]
    at out_addr; x as quantize_flat's int8 rows (q_addr, rows q_stride bytes apart) and
    (dx, dx * sum) pairs a block (s_addr, rows s_stride bytes apart); W as repack_x16 left it."""
    kind = _x16_kind(w)
    if kind is None or not isinstance(ntok, types.IntegerLiteral):
        return None
    n = ntok.literal_value
    _, nbytes = Q.KINDS[kind]
    head, span = _SCALES[kind], GROUP * Q.KINDS[kind][1]
    steps = (nbytes - head) // 4                  # 64-byte loads of quant bytes a block (16 rows x 4)
    signed = kind == "q8_0" and Q.q8_0_signed()   # its bytes as they are (no c term)
    sig = types.void(w, g, q_addr, q_stride, s_addr, s_stride, out_addr, ntok)

    def codegen(context, builder, signature, args):
        e = Q._IR(builder)
        mod = builder.module
        fma = Q._intrinsic_fn(mod, "llvm.fma.v16f32", VF, [VF] * 3)
        base, nblocks = Q._row_base(context, builder, w, args[0], args[1])
        qrows = [builder.add(args[2], builder.mul(args[3], ir.Constant(I64, t))) for t in range(n)]
        srows = [builder.add(args[4], builder.mul(args[5], ir.Constant(I64, t))) for t in range(n)]
        zero = ir.Constant(VF, [ir.Constant(F32, 0.0)] * 16)
        izero = ir.Constant(VI32_16, [ir.Constant(I32, 0)] * 16)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(n)]
        with cgutils.for_range(builder, nblocks) as loop:
            b = loop.index
            a = builder.add(base, builder.mul(b, ir.Constant(I64, span)))
            for ahead, locality in PREFETCH:
                e.prefetch(a, ahead, locality)
            d = builder.fpext(e.load(a, 0, VH, align=1), VF)
            if kind == "q4_1":
                c = builder.fpext(e.load(a, 32, VH, align=1), VF)
            else:
                c = None if signed else builder.fmul(d, e.splat(ir.Constant(F32, -8.0 if kind == "q4_0" else -128.0)))
            col = builder.mul(b, ir.Constant(I64, 32))
            sums = [[izero, izero] for _ in range(n)]
            for k in range(steps):
                v = e.load(a, 16 * head + 64 * k, VI8_64)
                if kind == "q8_0":
                    units = [(v if signed else builder.xor(v, Q._cvec(I8, [0x80] * 64)), 4 * k, k % 2)]
                else:
                    units = [(builder.and_(v, Q._cvec(I8, [15] * 64)), 4 * k, 0),
                             (builder.lshr(v, Q._cvec(I8, [4] * 64)), 16 + 4 * k, 1)]
                for u, off, chain in units:
                    u = builder.bitcast(u, VI32_16)
                    for t in range(n):
                        xb = _bcast32(e, builder.add(qrows[t], builder.add(col, ir.Constant(I64, off))))
                        sums[t][chain] = Q.dpbusd(builder, sums[t][chain], u, xb, signed)
            for t in range(n):
                f = builder.sitofp(builder.add(sums[t][0], sums[t][1]), VF)
                sp = builder.add(srows[t], builder.mul(b, ir.Constant(I64, 8)))
                dx = e.splat(e.load(sp, 0, F32, align=4))
                acc = builder.call(fma, [f, builder.fmul(d, dx), builder.load(accs[t])])
                if c is not None:
                    acc = builder.call(fma, [c, e.splat(e.load(sp, 4, F32, align=4)), acc])
                builder.store(acc, accs[t])
        for t in range(n):
            ptr = builder.inttoptr(builder.add(args[6], ir.Constant(I64, 64 * t)), VF.as_pointer())
            builder.store(builder.load(accs[t]), ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(fastmath=Q.FASTMATH, error_model="numpy")
def quantize_flat(x, xq, xs, t0, t1):
    """Rows t0:t1 of x [T, K] as int8 xq [T, K] (round(x / dx), dx = max|x| / 127 a 32-block) and
    xs [T, K / 32, 2] = (dx, dx * sum of the block's xq)."""
    nb = x.shape[1] // 32
    for t in range(t0, t1):
        for b in range(nb):
            top = np.float32(0.0)
            for j in range(32):
                top = max(top, abs(x[t, 32 * b + j]))
            dx = top / np.float32(127.0)
            inv = np.float32(1.0) / dx if top > 0 else np.float32(0.0)
            s = 0
            for j in range(32):
                v = np.int32(np.rint(x[t, 32 * b + j] * inv))
                xq[t, 32 * b + j] = v
                s += v
            xs[t, b, 0] = dx
            xs[t, b, 1] = dx * np.float32(s)


@njit(fastmath=Q.FASTMATH, error_model="numpy")
def _chunk_x16(w, xq, xs, y, col0, g0, g1, t0, t1, residual):
    """Groups g0:g1 of W against activation rows t0:t1, up to 8 tokens a pass over the weights."""
    qa, qs_ = xq.ctypes.data, xq.strides[0]
    sa, ss = xs.ctypes.data, xs.strides[0]
    out = np.empty((8, GROUP), np.float32)
    oa = out.ctypes.data
    res = residual.shape[0] > 0
    t = t0
    while t < t1:
        left, qt, st = t1 - t, qa + t * qs_, sa + t * ss
        n = 8 if left >= 8 else 4 if left >= 4 else 2 if left >= 2 else 1
        for g in range(g0, g1):
            if n == 8:
                group_dot(w, g, qt, qs_, st, ss, oa, 8)
            elif n == 4:
                group_dot(w, g, qt, qs_, st, ss, oa, 4)
            elif n == 2:
                group_dot(w, g, qt, qs_, st, ss, oa, 2)
            else:
                group_dot(w, g, qt, qs_, st, ss, oa, 1)
            c = col0 + GROUP * g
            for i in range(n):
                for r in range(GROUP):
                    y[t + i, c + r] = out[i, r] + residual[t + i, c + r] if res else out[i, r]
        t += n


def scales_shape(tokens: int, cols: int) -> tuple[int, int, int]:
    """quantize_flat's xs."""
    return tokens, cols // 32, 2


@njit(parallel=True, fastmath=Q.FASTMATH, cache=CACHE, error_model="numpy")
def matmul_x16_into(parts, count, col0s, x, norm, eps, normed, xq, xs, residual, y):
    """cpu_quant.matmul_q8_into for repack_x16 parts: x (or RMSNorm(x) into `normed`, given `norm`)
    quantized into xq [T, K] int8 and xs (scales_shape), then 16 rows a vpdpbusd."""
    T = x.shape[0]
    tiles = (T + Q.TOKEN_TILE - 1) // Q.TOKEN_TILE
    src = normed if norm.shape[0] else x
    if T <= Q.TOKEN_TILE:
        if norm.shape[0]:
            Q._rms_rows(x, norm, eps, normed, 0, T)
        quantize_flat(src, xq, xs, 0, T)
    else:
        for tile in prange(tiles):
            a, b = tile * Q.TOKEN_TILE, min(T, (tile + 1) * Q.TOKEN_TILE)
            if norm.shape[0]:
                Q._rms_rows(x, norm, eps, normed, a, b)
            quantize_flat(src, xq, xs, a, b)
    per = GROUPS_A_CHUNK if T <= Q.MAX_TOKENS else GROUPS_A_TILE
    first = Q._work_items(parts, count, per)
    for item in prange(first[count] * tiles):
        tile, p, c = Q._work_item(first, count, item)
        w = parts[p]
        g0 = c * per
        t0 = tile * Q.TOKEN_TILE
        _chunk_x16(w, xq, xs, y, col0s[p], g0, min(w.shape[0], g0 + per), t0, min(T, t0 + Q.TOKEN_TILE), residual)
