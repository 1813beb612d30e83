"""GEMV of few rows (T = 1..8) against a Q4_K weight on the int8 tensor cores:

    out[t, n_off + n] = sum_k x_hat[t, k] w[n, k] (+ bias[n_off + n]) (+ res[t, n_off + n])

The dp4a GEMV (quant_gemv) decodes every group once per row of x, so its time grows with T (2 rows
take twice one row's time). Here one `mma.m16n8k32.u8.s8` takes a group of 32 values of 16 weight
rows against the same 32 values of all 8 rows of x: the decoding is done once for every row of x,
and x's rows past T are zeros.

  quantize_x(x, T, xq, xsc)   x float32 [>= T, K] -> int8 per group of 32 as quant_layout.q8_quantize
                              (rows T..7 zero), in the mma's B-fragment order, groups in pairs: xq
                              uint8 [G / 2, 512], lane (g, c) of a warp reads token g's 8 bytes of group
                              2p + e at p, 16 lane + 8 e (values 4c..4c+3, then 16+4c..16+4c+3); xsc
                              float32 [G, 24]: (d8, d8 * sum of the int8 values) of token t at 2t, 2t + 1,
                              d8 * the sum of values 0..15 at 16 + t (Q6_K's halves).
  gemv(...)                   on quant_layout's planes as they are (the bytes every other Q4_K kernel
                              reads): a block of W warps takes 16 weight rows (or 16 R), warp w the
                              super-blocks w, w + W, ... (one 16-byte header a row and super-block, one
                              4-byte word of codes per row of the fragment and group).
  gemv_mq(...)                on the fragment layout (repack_mq: the same bytes, reordered so that a
                              warp's loads are whole 512-byte runs): per super-block four 16-byte code
                              loads a lane, two of headers, four of x.
The warps' partial sums meet in shared memory. Group j of super-block s contributes
d8 (d sc_j (q . xq) - dmin m_j sum(xq)), as in quant_gemv.

Fragment layout (repack_mq), Q4_K rows in tiles of 16 (the last padded with zero rows):
  mq  uint8 [tiles, NSB 2048]: super-block s, group pair jp (groups 2jp + e), lane l = 4 g + c at
      ((4 s + jp) 32 + l) 16 + 8 e + 4 h: word c of the group's 16 code bytes (quant_layout's qs
      order: byte b = value b | value 16 + b << 4) of row 16 tile + g + 8 h.
  ms  uint8 [tiles, NSB 256]: the 16-byte header of row 16 tile + r, super-block s, at (16 s + r) 16.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32

from kernels_numba.activation import silu_mul_at
from kernels_numba.bf16 import device_function
from kernels_numba.rmsnorm import SCRATCH as RMS_SCRATCH, _threads as rms_threads, inv_rms_row
from kernels_numba.ptx import SIM, grid_trigger, grid_wait, ldg_f32x4, pack_bf16x2, shfl_xor_f32
from kernels_numba.quant_gemv import _load_generated, kq_scale_min, q4_ops, sbyte
from kernels_numba.quant_layout import Q4_K, Q6_K
from kernels_numba.quant_ptx import h2f, ldg_b2, ldg_b4, ldg_b8, ldg_b16, mma_u8s8, rni, shfl_xor_i32, stg_u16x8

__all__ = ["TYPES", "MAX_T", "MAX_TILED_T", "n_tiles", "quantize_x", "gemv", "gemv_mq", "x_buffers", "supports", "repack_mq", "mq_nbytes",
           "dequant_mq_ref", "dequant_mq_bf16"]

TYPES = (Q4_K, Q6_K)
MAX_T = 8           # rows of the planes' Q4_K kernel
MAX_TILED_T = 64    # rows of the fragment layout's and Q6_K's kernels (8 n-tiles of 8 rows)
WARPS = 8           # a block's warps (each a slice of the super-blocks)
TILES = 1           # 16-row tiles a warp takes
BLOCKS = 0          # launch bound: blocks a multiprocessor (0: none)
M4 = np.uint32(0x0F0F0F0F)
M3 = np.uint32(0x03030303)
B63 = np.uint32(0x3F3F3F3F)
B30 = np.uint32(0x30303030)
U2 = np.uint32(2)
MASK16 = np.uint32(0xFFFF)
U4, U16 = np.uint32(4), np.uint32(16)


@device_function
def kq_scale_words(s1, s2, s3):
    """The 8 6-bit scales and mins of a Q4_K header's words 1..3, a byte each: (scales of groups
    0..3, of 4..7, mins of 0..3, of 4..7) (quant_gemv.kq_scale_min for all groups at once)."""
    return (s1 & B63, (s3 & M4) | ((s1 >> U2) & B30), s2 & B63, ((s3 >> U4) & M4) | ((s2 >> U2) & B30))


def supports(qtype: int, K: int) -> bool:
    return qtype in TYPES and K % 256 == 0


# ----------------------------------------------------------------------------- x -> int8 fragments
@device_function
def _put_group(val, gi, u, n, v, xq, xsc):
    """Lane v of a warp holding value v of group gi of token n of n-tile u: the group's int8 values
    into xq, its (d8, d8 sum, d8 half-0 sum) into xsc (the module docstring's layouts)."""
    a = abs(val)
    for off in (1, 2, 4, 8, 16):
        a = max(a, shfl_xor_f32(a, off))
    inv = float32(127.0) / a if a > float32(0.0) else float32(0.0)
    q = rni(val * inv)
    s = q
    for off in (1, 2, 4, 8):
        s = int32(s + shfl_xor_i32(s, off))
    s0 = s                          # lane 0: the sum of values 0..15 (Q6_K's first half)
    s = int32(s + shfl_xor_i32(s, 16))
    c = (v & 15) >> 2
    xq[gi >> 1, 512 * u + ((n * 4 + c) << 4) + ((gi & 1) << 3) + ((v >> 4) << 2) + (v & 3)] = uint32(q) & uint32(255)
    if v == 0:
        d8 = a / float32(127.0)
        xsc[gi, 24 * u + 2 * n] = d8
        xsc[gi, 24 * u + 2 * n + 1] = d8 * float32(s)
        xsc[gi, 24 * u + 16 + n] = d8 * float32(s0)


def _quantize(x, T, xq, xsc):
    grid_wait()                     # PDL: x is written by the kernel before
    grid_trigger()
    gi = cuda.blockIdx.x
    u = cuda.blockIdx.y             # n-tile
    tid = cuda.threadIdx.x
    n = tid >> 5                    # token (row of x) in the n-tile
    v = tid & 31                    # value of the group
    val = x[8 * u + n, gi * 32 + v] if 8 * u + n < T else float32(0.0)
    _put_group(val, gi, u, n, v, xq, xsc)


def _norm_quantize(x, w, eps, T, xq, xsc, out):
    """Row r of the n-tiles: out[r] = RMSNorm(x[r]) * w (rmsnorm's inv_rms_row, so the bytes of
    rmsnorm.rms_norm), quantized into xq / xsc as _quantize would; rows past T quantize zeros."""
    grid_wait()
    grid_trigger()
    scratch = cuda.shared.array(RMS_SCRATCH, float32)
    r = cuda.blockIdx.x
    K = x.shape[1]
    tid = cuda.threadIdx.x
    live = r < T
    inv = inv_rms_row(x, r, eps, scratch) if live else float32(1.0)    # uniform over the block
    v = tid & 31
    for gi in range(tid >> 5, K // 32, cuda.blockDim.x >> 5):
        val = float32(0.0)
        if live:
            d = gi * 32 + v
            val = x[r, d] * inv * w[d]
            out[r, d] = val
        _put_group(val, gi, r >> 3, r & 7, v, xq, xsc)


def _silu_quantize(gate_up, T, xq, xsc, out):
    """out = silu(gate) * up (as activation.silu_mul computes it) for the n-tiles' rows, quantized
    into xq / xsc as _quantize would; rows past T quantize zeros."""
    grid_wait()
    grid_trigger()
    gi = cuda.blockIdx.x
    u = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    n = tid >> 5
    v = tid & 31
    r = 8 * u + n
    val = float32(0.0)
    if r < T:
        f = gi * 32 + v
        val = silu_mul_at(gate_up, r, f, out.shape[1])
        out[r, f] = val
    _put_group(val, gi, u, n, v, xq, xsc)


_QUANTIZE: list = []
_NORM_QUANTIZE: list = []
_SILU_QUANTIZE: list = []


def _compiled(cache: list, fn):
    if not cache:
        if SIM:
            cache.append(cuda.jit(fn))
        else:
            from kernels_numba.jit import kernel as cached_kernel
            cache.append(cached_kernel(fn))
    return cache[0]


def silu_quantize_x(gate_up, T: int, xq, xsc, out, stream=0, tiles: int = 1) -> None:
    """out[:T] = activation.silu_mul(gate_up[:T]) and quantize_x(out, T, xq, xsc, tiles) in one
    launch (the activation in front of the down product on the tensor-core GEMV)."""
    F = out.shape[1]
    G = F // 32
    assert 1 <= T <= 8 * tiles and gate_up.shape[0] >= T and out.shape[0] >= T and gate_up.shape[1] == 2 * F
    assert 2 * xq.shape[0] >= G and xq.shape[1] >= 512 * tiles and xsc.shape[1] >= 24 * tiles and xsc.shape[0] >= G
    _compiled(_SILU_QUANTIZE, _silu_quantize)[(G, tiles), 256, stream](gate_up, T, xq, xsc, out)


def norm_quantize_x(x, w, eps: float, T: int, xq, xsc, out, stream=0, tiles: int = 1) -> None:
    """out[:T] = rmsnorm.rms_norm(x[:T], w, eps) and quantize_x(out, T, xq, xsc, tiles) in one launch
    (the norm in front of a product on the tensor-core GEMV: one launch fewer, the same bytes)."""
    G = x.shape[1] // 32
    assert 1 <= T <= 8 * tiles and x.shape[0] >= T and out.shape[0] >= T and 2 * xq.shape[0] >= G
    assert xq.shape[1] >= 512 * tiles and xsc.shape[1] >= 24 * tiles and xsc.shape[0] >= G
    _compiled(_NORM_QUANTIZE, _norm_quantize)[8 * tiles, rms_threads(x.shape[1]), stream](x, w, float32(eps), T, xq, xsc, out)


def quantize_x(x, T: int, xq, xsc, stream=0, tiles: int = 1) -> None:
    """xq / xsc as the module docstring says, for the K = 32 G columns of x's first T rows, in
    `tiles` n-tiles of 8 rows (n-tile u at xq columns 512 u.., xsc columns 24 u..)."""
    G = x.shape[1] // 32
    assert 1 <= T <= 8 * tiles and x.shape[0] >= T and 2 * xq.shape[0] >= G and xsc.shape[0] >= G
    assert xq.shape[1] >= 512 * tiles and xsc.shape[1] >= 24 * tiles
    _compiled(_QUANTIZE, _quantize)[(G, tiles), 256, stream](x, T, xq, xsc)


_XBUF: dict = {}


def x_buffers(K: int):
    """The (xq, xsc) device buffers for activations of up to K columns (made before any graph capture:
    upload_quantized calls this with the model's widest K; one pair serves every product, the
    stream orders each product's read before the next quantization)."""
    have = _XBUF.get("K", 0)
    if K > have:
        G = K // 32
        T8 = MAX_TILED_T // 8
        _XBUF.update(K=K, xq=cuda.device_array((G // 2, 512 * T8), np.uint8),
                     xsc=cuda.device_array((G, 24 * T8), np.float32))
    return _XBUF["xq"], _XBUF["xsc"]


# ----------------------------------------------------------------------------- the GEMV
_GLOBALS = dict(cuda=cuda, float32=float32, int32=int32, uint32=uint32, min=min, grid_wait=grid_wait,
                ldg_f32x4=ldg_f32x4, h2f=h2f, ldg_b4=ldg_b4, ldg_b8=ldg_b8, ldg_b16=ldg_b16, mma_u8s8=mma_u8s8,
                kq_scale_min=kq_scale_min, kq_scale_words=kq_scale_words, sbyte=sbyte, ldg_b2=ldg_b2, M3=M3, M4=M4, MASK16=MASK16, U4=U4, U16=U16)


def _source(W: int, has_bias: bool, has_res: bool, R: int = 1) -> str:
    """The Q4_K kernel with the 8 groups of a super-block written out (their loads first). R: 16-row
    tiles a warp takes (R = 2: each x fragment load serves two mmas)."""
    L = []

    def emit(ind, line):
        L.append("    " * ind + line)

    RT = range(2 * R)                               # fragment rows g + 8 i of the block's 16 R rows
    emit(0, "def gemv(xq, xsc, qs, sc, out, bias, res, n_off, T):")
    for ln in ("N = qs.shape[0]", "NSB = sc.shape[1] >> 4", "tid = cuda.threadIdx.x", "lane = tid & 31",
               "warp = tid >> 5", "g = lane >> 2", "c = lane & 3", f"row0 = cuda.blockIdx.x * {16 * R}",
               "cw = c << 2", "xo = lane << 4", "grid_wait()"):
        emit(1, ln)
    for i in RT:
        emit(1, f"r{i} = min(row0 + g + {8 * i}, N - 1)")
        emit(1, f"acc{i}_0 = float32(0.0)")
        emit(1, f"acc{i}_1 = float32(0.0)")
    emit(1, f"for s in range(warp, NSB, {W}):")
    for i in RT:
        emit(2, f"h{i}_0, h{i}_1, h{i}_2, h{i}_3 = ldg_b16(sc, r{i}, s << 4)")
    for j in range(8):
        emit(2, f"o{j} = (({j} * NSB + s) << 4) + cw")
        for i in RT:
            emit(2, f"w{i}_{j} = ldg_b4(qs, r{i}, o{j})")
    for j in range(8):
        emit(2, f"xa{j}, xb{j} = ldg_b8(xq, 4 * s + {j >> 1}, xo + {8 * (j & 1)})")
        emit(2, f"xs{j} = ldg_f32x4(xsc, 8 * s + {j}, cw)")
    for i in RT:
        emit(2, f"d{i} = h2f(h{i}_0 & MASK16)")
        emit(2, f"m{i} = h2f(h{i}_0 >> U16)")
    for j in range(8):
        for t in range(R):
            a, b = 2 * t, 2 * t + 1             # rows g + 16 t and g + 16 t + 8
            emit(2, f"e0, e1, e2, e3 = mma_u8s8(w{a}_{j} & M4, w{b}_{j} & M4, (w{a}_{j} >> U4) & M4, "
                    f"(w{b}_{j} >> U4) & M4, xa{j}, xb{j})")
            for i, (lo, hi) in ((a, ("e0", "e1")), (b, ("e2", "e3"))):
                emit(2, f"sv, mv = kq_scale_min(h{i}_1, h{i}_2, h{i}_3, {j})")
                emit(2, f"fs = d{i} * float32(sv)")
                emit(2, f"fm = m{i} * float32(mv)")
                emit(2, f"acc{i}_0 += fs * xs{j}[0] * float32({lo}) - fm * xs{j}[1]")
                emit(2, f"acc{i}_1 += fs * xs{j}[2] * float32({hi}) - fm * xs{j}[3]")
    # the warps' sums: [warp][16 R rows][8 tokens]; row g + 8 i at (g + 8 i) 8
    RB = 128 * R
    emit(1, f"sm = cuda.shared.array({W * RB}, float32)")
    emit(1, f"b = warp * {RB} + g * 8 + 2 * c")
    for i in RT:
        emit(1, f"sm[b + {64 * i}] = acc{i}_0")
        emit(1, f"sm[b + {64 * i + 1}] = acc{i}_1")
    emit(1, "cuda.syncthreads()")
    emit(1, f"for q in range(tid, {RB}, {32 * W}):")
    emit(2, "a = sm[q]")
    for w in range(1, W):
        emit(2, f"a += sm[{w * RB} + q]")
    emit(2, "n = row0 + (q >> 3)")
    emit(2, "t = q & 7")
    emit(2, "if t < T and n < N:")
    emit(3, "col = n_off + n")
    emit(3, "out[t, col] = a" + (" + bias[col]" if has_bias else "") + (" + res[t, col]" if has_res else ""))
    return "\n".join(L) + "\n"


def _epilogue(emit, W: int, NT: int, accs: list, has_bias: bool, has_res: bool) -> None:
    """The warps' sums through shared memory [warp][16 rows][8 NT tokens], then out. accs[u]: the
    lane's (row g token 2c, row g token 2c + 1, row g + 8 token 2c, row g + 8 token 2c + 1) of n-tile u."""
    RB, TW = 128 * NT, 8 * NT
    emit(1, f"sm = cuda.shared.array({W * RB}, float32)")
    emit(1, f"b = warp * {RB} + g * {TW} + 2 * c")
    for u, (a0, a1, a2, a3) in enumerate(accs):
        for off, v in ((0, a0), (1, a1), (8 * TW, a2), (8 * TW + 1, a3)):
            emit(1, f"sm[b + {off + 8 * u}] = {v}")
    emit(1, "cuda.syncthreads()")
    emit(1, f"for q in range(tid, {RB}, {32 * W}):")
    emit(2, "a = sm[q]")
    for w in range(1, W):
        emit(2, f"a += sm[{w * RB} + q]")
    emit(2, f"n = row0 + q // {TW}")
    emit(2, f"t = q % {TW}")
    emit(2, "if t < T and n < N:")
    emit(3, "col = n_off + n")
    emit(3, "out[t, col] = a" + (" + bias[col]" if has_bias else "") + (" + res[t, col]" if has_res else ""))


def _source_mq(W: int, has_bias: bool, has_res: bool, NT: int = 1) -> str:
    """The kernel on the fragment layout, a super-block's weight loads first, its 8 groups written
    out; NT n-tiles of 8 rows of x (up to 8 NT rows), each group's codes decoded once for all."""
    L = []

    def emit(ind, line):
        L.append("    " * ind + line)

    UU = range(NT)
    emit(0, "def gemv(xq, xsc, mq, ms, out, bias, res, n_off, T, N):")
    for ln in ("NSB = ms.shape[1] >> 8", "tid = cuda.threadIdx.x", "lane = tid & 31", "warp = tid >> 5",
               "g = lane >> 2", "c = lane & 3", "tile = cuda.blockIdx.x", "row0 = tile * 16", "cw = c << 2",
               "lo = lane << 4", "grid_wait()"):
        emit(1, ln)
    for u in UU:
        for k in range(4):
            emit(1, f"acc{u}_{k} = float32(0.0)")
    emit(1, f"for s in range(warp, NSB, {W}):")
    emit(2, "hg0, hg1, hg2, hg3 = ldg_b16(ms, tile, (s << 8) + (g << 4))")
    emit(2, "hh0, hh1, hh2, hh3 = ldg_b16(ms, tile, (s << 8) + ((g + 8) << 4))")
    for jp in range(4):
        emit(2, f"q{jp}_0, q{jp}_1, q{jp}_2, q{jp}_3 = ldg_b16(mq, tile, ((((s << 2) + {jp}) << 9)) + lo)")
    emit(2, "dg = h2f(hg0 & MASK16)")
    emit(2, "mg = h2f(hg0 >> U16)")
    emit(2, "dh = h2f(hh0 & MASK16)")
    emit(2, "mh = h2f(hh0 >> U16)")
    emit(2, "sg0, sg1, ng0, ng1 = kq_scale_words(hg1, hg2, hg3)")
    emit(2, "sh0, sh1, nh0, nh1 = kq_scale_words(hh1, hh2, hh3)")
    for jp in range(4):
        for u in UU:
            emit(2, f"x{u}_0, x{u}_1, x{u}_2, x{u}_3 = ldg_b16(xq, (s << 2) + {jp}, {512 * u} + lo)")
        for e in (0, 2):
            j = 2 * jp + e // 2
            wg, wh = f"q{jp}_{e}", f"q{jp}_{e + 1}"
            emit(2, f"a0 = {wg} & M4")
            emit(2, f"a1 = {wh} & M4")
            emit(2, f"a2 = ({wg} >> U4) & M4")
            emit(2, f"a3 = ({wh} >> U4) & M4")
            byte = lambda w: f"float32(({w}{j >> 2} >> uint32({8 * (j & 3)})) & uint32(255))"  # noqa: E731
            emit(2, f"fsg = dg * {byte('sg')}")
            emit(2, f"fmg = mg * {byte('ng')}")
            emit(2, f"fsh = dh * {byte('sh')}")
            emit(2, f"fmh = mh * {byte('nh')}")
            for u in UU:
                emit(2, f"xs = ldg_f32x4(xsc, 8 * s + {j}, {24 * u} + cw)")
                emit(2, f"d0, d1, d2, d3 = mma_u8s8(a0, a1, a2, a3, x{u}_{e}, x{u}_{e + 1})")
                emit(2, f"acc{u}_0 += fsg * xs[0] * float32(d0) - fmg * xs[1]")
                emit(2, f"acc{u}_1 += fsg * xs[2] * float32(d1) - fmg * xs[3]")
                emit(2, f"acc{u}_2 += fsh * xs[0] * float32(d2) - fmh * xs[1]")
                emit(2, f"acc{u}_3 += fsh * xs[2] * float32(d3) - fmh * xs[3]")
    _epilogue(emit, W, NT, [tuple(f"acc{u}_{k}" for k in range(4)) for u in UU], has_bias, has_res)
    return "\n".join(L) + "\n"


def _source_q6(W: int, has_bias: bool, has_res: bool, NT: int = 1) -> str:
    """Q6_K on quant_layout's planes: a group's two 16-value halves have their own scales, so each
    takes its own mma (x's other half zero); codes 0..63 as u8 and the -32 offset through x's half
    sums. NT n-tiles of 8 rows of x."""
    L = []

    def emit(ind, line):
        L.append("    " * ind + line)

    UU = range(NT)
    emit(0, "def gemv(xq, xsc, qs, qh, sc, dm, out, bias, res, n_off, T):")
    for ln in ("N = qs.shape[0]", "NSB = dm.shape[1] >> 1", "tid = cuda.threadIdx.x", "lane = tid & 31",
               "warp = tid >> 5", "g = lane >> 2", "c = lane & 3", "row0 = cuda.blockIdx.x * 16",
               "r0 = min(row0 + g, N - 1)", "r1 = min(row0 + g + 8, N - 1)", "cw = c << 2", "xo = lane << 4",
               "sh = uint32(2 * c)", "z = uint32(0)", "grid_wait()"):
        emit(1, ln)
    for u in UU:
        for k in range(4):
            emit(1, f"acc{u}_{k} = float32(0.0)")
    emit(1, f"for s in range(warp, NSB, {W}):")
    for i in range(2):
        emit(2, f"v{i}_0, v{i}_1, v{i}_2, v{i}_3 = ldg_b16(sc, r{i}, s << 4)")
        emit(2, f"dd{i} = h2f(ldg_b2(dm, r{i}, s << 1))")
    for j in range(8):
        emit(2, f"o{j} = (({j} * NSB + s) << 4) + cw")
        emit(2, f"p{j} = ((({j >> 1} * NSB + s) << 4) + {8 * (j & 1)})")
        for i in range(2):
            emit(2, f"w{i}_{j} = ldg_b4(qs, r{i}, o{j})")
            emit(2, f"ha{i}_{j} = ldg_b4(qh, r{i}, p{j})")
            emit(2, f"hb{i}_{j} = ldg_b4(qh, r{i}, p{j} + 4)")
    for j in range(8):
        for i in range(2):
            emit(2, f"lo{i} = (w{i}_{j} & M4) | (((ha{i}_{j} >> sh) & M3) << U4)")
            emit(2, f"hi{i} = ((w{i}_{j} >> U4) & M4) | (((hb{i}_{j} >> sh) & M3) << U4)")
            wv = f"v{i}_{j >> 1}"
            emit(2, f"fa{i} = dd{i} * float32(sbyte({wv}, {2 * (j & 1)}))")
            emit(2, f"fb{i} = dd{i} * float32(sbyte({wv}, {2 * (j & 1) + 1}))")
        for u in UU:
            emit(2, f"xa, xb = ldg_b8(xq, 4 * s + {j >> 1}, {512 * u} + xo + {8 * (j & 1)})")
            emit(2, f"xs = ldg_f32x4(xsc, 8 * s + {j}, {24 * u} + cw)")
            emit(2, f"xh0 = xsc[8 * s + {j}, {24 * u + 16} + 2 * c]")
            emit(2, f"xh1 = xsc[8 * s + {j}, {24 * u + 17} + 2 * c]")
            emit(2, "a0, a1, a2, a3 = mma_u8s8(lo0, lo1, hi0, hi1, xa, z)")
            emit(2, "b0, b1, b2, b3 = mma_u8s8(lo0, lo1, hi0, hi1, z, xb)")
            # row g: token 2c (a0 | b0), 2c + 1 (a1 | b1); row g + 8: a2 | b2, a3 | b3
            for k, (i, t, lo_v, hi_v) in enumerate(((0, 0, "a0", "b0"), (0, 1, "a1", "b1"), (1, 0, "a2", "b2"),
                                                    (1, 1, "a3", "b3"))):
                d8, xs, xh = f"xs[{2 * t}]", f"xs[{2 * t + 1}]", f"xh{t}"
                emit(2, f"acc{u}_{k} += fa{i} * ({d8} * float32({lo_v}) - float32(32.0) * {xh}) + "
                        f"fb{i} * ({d8} * float32({hi_v}) - float32(32.0) * ({xs} - {xh}))")
    _epilogue(emit, W, NT, [tuple(f"acc{u}_{k}" for k in range(4)) for u in UU], has_bias, has_res)
    return "\n".join(L) + "\n"


_HEADER = """# generated by kernels_numba.quant_mma._source: {cfg}
from kernels_numba.quant_mma import _GLOBALS
globals().update(_GLOBALS)

"""
_PY: dict = {}
_KERNELS: dict = {}


def py_kernel(W: int, has_bias: bool, has_res: bool, R: int = 1, NT: int = 1):
    """R = 0: the fragment layout's kernel (gemv_mq); R = -1: Q6_K's; NT: their n-tiles of 8 rows."""
    key = (W, has_bias, has_res, R, NT)
    if key not in _PY:
        src = (_source(W, has_bias, has_res, R) if R > 0 else _source_mq(W, has_bias, has_res, NT) if R == 0
               else _source_q6(W, has_bias, has_res, NT))
        if SIM:
            ns = dict(_GLOBALS)
            exec(compile(src, f"<quant_mma {key}>", "exec"), ns)
            _PY[key] = ns["gemv"]
        else:
            _PY[key] = _load_generated(_HEADER.format(cfg=key) + src, prefix="quant_mma")
    return _PY[key]


def kernel(W: int, has_bias: bool, has_res: bool, R: int = 1, blocks: int = 0, NT: int = 1):
    """blocks: the launch bound's blocks a multiprocessor (0: none)."""
    key = (W, has_bias, has_res, R, blocks, NT)
    k = _KERNELS.get(key)
    if k is None:
        if SIM:
            k = cuda.jit(py_kernel(W, has_bias, has_res, R, NT))
        else:
            from kernels_numba.jit import kernel as cached_kernel
            opts = {"launch_bounds": (32 * W, blocks)} if blocks else {}
            k = cached_kernel(py_kernel(W, has_bias, has_res, R, NT), **opts)
        _KERNELS[key] = k
    return k


def n_tiles(T: int) -> int:
    """n-tiles of 8 rows a launch of T rows takes (1, 2, 4 or 8: few kernel variants)."""
    t = -(-T // 8)
    return 1 if t <= 1 else 2 if t <= 2 else 4 if t <= 4 else 8


def gemv(xq, xsc, planes: dict, out, T: int, *, qtype: int, n_off: int = 0, bias=None, residual=None,
         stream=0, warps: int = WARPS, tiles: int = TILES, blocks: int = BLOCKS) -> None:
    """out[:T, n_off:n_off+N] = x[:T] @ w.T (+ bias[n_off:]) (+ residual[:T, n_off:]) for one part w,
    x already through quantize_x into (xq, xsc). Device arrays in, nothing allocated."""
    assert qtype in TYPES, f"quant mma: type {qtype}"
    qs, sc = planes["qs"], planes["sc"]
    N = qs.shape[0]
    b, r = out if bias is None else bias, out if residual is None else residual
    if qtype == Q6_K:
        assert 1 <= T <= MAX_TILED_T and out.shape[0] >= T and n_off + N <= out.shape[1]
        k = kernel(warps, bias is not None, residual is not None, -1, blocks, n_tiles(T))
        k[-(-N // 16), 32 * warps, stream](xq, xsc, qs, planes["qh"], sc, planes["dm"], out, b, r, n_off, T)
        return
    assert 1 <= T <= MAX_T and out.shape[0] >= T and n_off + N <= out.shape[1]
    k = kernel(warps, bias is not None, residual is not None, tiles, blocks)
    k[-(-N // (16 * tiles)), 32 * warps, stream](xq, xsc, qs, sc, out, b, r, n_off, T)


def mq_warps(N: int, T: int) -> int:
    """Warps a block of gemv_mq takes for N rows of T tokens (one block a 16-row tile). At one n-tile
    few tiles want more warps a tile to keep enough loads in flight, many tiles fewer; from two
    n-tiles WARPS (16 warps of 8 n-tiles exceed the registers; docs/quant.md "Warps by shape")."""
    if n_tiles(T) > 1:
        return WARPS
    tiles = -(-N // 16)
    return 4 if tiles >= 1024 else 8 if tiles >= 384 else 16


def gemv_mq(xq, xsc, planes: dict, out, T: int, N: int, *, n_off: int = 0, bias=None, residual=None,
            stream=0, warps: int = 0, blocks: int = BLOCKS) -> None:
    """gemv on a part in the fragment layout (planes 'mq', 'ms' of repack_mq; N its rows); warps 0:
    mq_warps(N, T)."""
    mq, ms = planes["mq"], planes["ms"]
    warps = warps or mq_warps(N, T)
    assert 1 <= T <= MAX_TILED_T and out.shape[0] >= T and n_off + N <= out.shape[1] and mq.shape[0] * 16 >= N
    k = kernel(warps, bias is not None, residual is not None, 0, blocks, n_tiles(T))
    k[-(-N // 16), 32 * warps, stream](xq, xsc, mq, ms, out, out if bias is None else bias,
                                       out if residual is None else residual, n_off, T, N)


# ----------------------------------------------------------------------------- the fragment layout
def repack_mq(data: np.ndarray, cols: int) -> dict:
    """A Q4_K tensor's file bytes uint8 [rows, cols / 256 * 144] -> {'mq', 'ms'} (module docstring)."""
    from kernels_numba.quant_layout import repack
    rows = data.shape[0]
    nsb = cols // 256
    tiles = -(-rows // 16)
    planes = repack(Q4_K, data, cols)
    # qs is in K-quant position order (group 8s + j at j NSB + s); back to natural groups
    qs = np.ascontiguousarray(planes["qs"].reshape(rows, 8, nsb, 16).swapaxes(1, 2)).reshape(rows, nsb * 8, 16)
    pad = np.zeros((tiles * 16, nsb * 8, 16), np.uint8)
    pad[:rows] = qs
    # [tile, h, g, s, jp, e, c, byte] -> [tile, s, jp, g, c, e, h, byte]
    v = pad.reshape(tiles, 2, 8, nsb, 4, 2, 4, 4).transpose(0, 3, 4, 2, 6, 5, 1, 7)
    hdr = np.zeros((tiles * 16, nsb, 16), np.uint8)
    hdr[:rows] = planes["sc"].reshape(rows, nsb, 16)
    return {"mq": np.ascontiguousarray(v).reshape(tiles, nsb * 2048),
            "ms": np.ascontiguousarray(hdr.reshape(tiles, 16, nsb, 16).transpose(0, 2, 1, 3)).reshape(tiles, nsb * 256)}


def mq_nbytes(rows: int, cols: int) -> int:
    """Bytes of repack_mq's planes: the file's, rows rounded up to 16."""
    return -(-rows // 16) * 16 * (cols // 256) * 144


def dequant_mq_ref(planes: dict, rows: int, cols: int) -> np.ndarray:
    """float32 [rows, cols] decoded from the fragment layout (the NumPy inverse of repack_mq)."""
    from kernels_numba.quant_layout import _f16, kq_scale_min
    mq, ms = planes["mq"], planes["ms"]
    tiles, nsb = mq.shape[0], cols // 256
    v = mq.reshape(tiles, nsb, 4, 8, 4, 2, 2, 4).transpose(0, 6, 3, 1, 2, 5, 4, 7)   # -> [tile, h, g, s, jp, e, c, b]
    qs = np.ascontiguousarray(v).reshape(tiles * 16, nsb * 8, 16)[:rows]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)             # [rows, G, 32]
    hd = np.ascontiguousarray(ms.reshape(tiles, nsb, 16, 16).transpose(0, 2, 1, 3)).reshape(tiles * 16, nsb, 16)[:rows]
    d, dmin = _f16(hd[..., 0:2]), _f16(hd[..., 2:4])
    sc, mn = kq_scale_min(hd)
    dl = (d * sc.astype(np.float32)).reshape(rows, nsb * 8, 1)
    ml = (dmin * mn.astype(np.float32)).reshape(rows, nsb * 8, 1)
    return (dl * q - ml).reshape(rows, cols)


def _dequant_mq(mq, ms, out, n_off, N):
    """One thread a (row, group): its 4 code words gathered from the fragments, 32 bf16 stored."""
    grid_wait()
    grid_trigger()
    K = out.shape[1]
    G = K >> 5
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    m = i // G
    if m >= N:
        return
    gi = i - m * G
    s = gi >> 3
    j = gi & 7
    tile = m >> 4
    rt = m & 15
    base = ((((s << 2) + (j >> 1)) << 9) + (((rt & 7) * 4) << 4) + ((j & 1) << 3) + ((rt >> 3) << 2))
    w0 = ldg_b4(mq, tile, base)
    w1 = ldg_b4(mq, tile, base + 16)
    w2 = ldg_b4(mq, tile, base + 32)
    w3 = ldg_b4(mq, tile, base + 48)
    hd = ldg_b16(ms, tile, (s << 8) + (rt << 4))
    scj, mnj = kq_scale_min(hd[1], hd[2], hd[3], j)
    dl = h2f(hd[0] & MASK16) * float32(scj)
    ml = h2f(hd[0] >> U16) * float32(mnj)
    ops = q4_ops(w0, w1, w2, w3)
    vals = cuda.local.array(32, float32)
    for w in range(8):
        for bb in range(4):
            vals[4 * w + bb] = dl * float32((ops[w] >> uint32(8 * bb)) & uint32(255)) - ml
    for e in range(4):
        o = 8 * e
        stg_u16x8(out, n_off + m, 32 * gi + o, pack_bf16x2(vals[o], vals[o + 1]), pack_bf16x2(vals[o + 2], vals[o + 3]),
                  pack_bf16x2(vals[o + 4], vals[o + 5]), pack_bf16x2(vals[o + 6], vals[o + 7]))


_DEQ: list = []


def dequant_mq_bf16(planes: dict, out, N: int, n_off: int = 0, stream=0) -> None:
    """out[n_off + n, :] = bf16(w[n, :]) for the N rows of a part in the fragment layout (out uint16
    [N_total, K]): the many-rows road's scratch image."""
    if not _DEQ:
        _DEQ.append(cuda.jit(_dequant_mq) if SIM else __import__("kernels_numba.jit", fromlist=["kernel"]).kernel(_dequant_mq))
    G = out.shape[1] // 32
    threads = 128
    _DEQ[0][-(-N * G // threads), threads, stream](planes["mq"], planes["ms"], out, n_off, N)
