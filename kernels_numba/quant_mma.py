"""GEMV of few rows (T = 1..8) against a Q4_K weight on the int8 tensor cores:

    out[t, n_off + n] = sum_k x_hat[t, k] w[n, k] (+ bias[n_off + n]) (+ res[t, n_off + n])

The dp4a GEMV (quant_gemv) decodes every group once per row of x, so its time grows with T (2 rows
take twice one row's time). Here one `mma.m16n8k32.u8.s8` takes a group of 32 values of 16 weight
rows against the same 32 values of all 8 rows of x: the decoding is done once for every row of x,
and x's rows past T are zeros.

Two launches:
  quantize_x(x, T, xq, xsc)   x float32 [>= T, K] -> int8 per group of 32 as quant_layout.q8_quantize
                              (rows T..7 zero), in the mma's B-fragment order: xq uint8 [G, 256], lane
                              (g, c) of a warp reads token g's 8 bytes at (4 g + c) 8 (values 4c..4c+3,
                              then 16+4c..16+4c+3); xsc float32 [G, 16]: (d8, d8 * sum of the int8
                              values) of token t at 2t, 2t + 1.
  gemv(...)                   a block of W warps takes 16 weight rows; warp w the super-blocks w, w + W, ...
                              of the row (one 16-byte header a row and super-block, 8 groups: one 4-byte
                              word of codes per row of the fragment and group, from quant_layout's planes
                              as they are); the warps' partial sums meet in shared memory.
The weights' planes are quant_layout.repack's (the same bytes every other Q4_K kernel reads).
Group j of super-block s contributes d8 (d sc_j (q . xq) - dmin m_j sum(xq)), as in quant_gemv.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32

from kernels_numba.ptx import SIM, grid_wait, ldg_f32x4, shfl_xor_f32
from kernels_numba.quant_gemv import _load_generated, kq_scale_min
from kernels_numba.quant_layout import Q4_K
from kernels_numba.quant_ptx import h2f, ldg_b4, ldg_b8, ldg_b16, mma_u8s8, rni, shfl_xor_i32

__all__ = ["TYPES", "MAX_T", "quantize_x", "gemv", "x_buffers", "supports"]

TYPES = (Q4_K,)
MAX_T = 8
WARPS = 8           # a block's warps (each a slice of the super-blocks)
TILES = 1           # 16-row tiles a warp takes
BLOCKS = 0          # launch bound: blocks a multiprocessor (0: none)
M4 = np.uint32(0x0F0F0F0F)
MASK16 = np.uint32(0xFFFF)
U4, U16 = np.uint32(4), np.uint32(16)


def supports(qtype: int, K: int) -> bool:
    return qtype in TYPES and K % 256 == 0


# ----------------------------------------------------------------------------- x -> int8 fragments
def _quantize(x, T, xq, xsc):
    gi = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    n = tid >> 5                    # token (row of x)
    v = tid & 31                    # value of the group
    grid_wait()
    val = x[n, gi * 32 + v] if n < T else float32(0.0)
    a = abs(val)
    for off in (1, 2, 4, 8, 16):
        a = max(a, shfl_xor_f32(a, off))
    inv = float32(127.0) / a if a > float32(0.0) else float32(0.0)
    q = rni(val * inv)
    s = q
    for off in (1, 2, 4, 8, 16):
        s = int32(s + shfl_xor_i32(s, off))
    c = (v & 15) >> 2
    xq[gi, ((n * 4 + c) << 3) + ((v >> 4) << 2) + (v & 3)] = uint32(q) & uint32(255)
    if v == 0:
        d8 = a / float32(127.0)
        xsc[gi, 2 * n] = d8
        xsc[gi, 2 * n + 1] = d8 * float32(s)


_QUANTIZE: list = []


def _quantize_kernel():
    if not _QUANTIZE:
        if SIM:
            _QUANTIZE.append(cuda.jit(_quantize))
        else:
            from kernels_numba.jit import kernel as cached_kernel
            _QUANTIZE.append(cached_kernel(_quantize))
    return _QUANTIZE[0]


def quantize_x(x, T: int, xq, xsc, stream=0) -> None:
    """xq / xsc as the module docstring says, for the K = 32 G columns of x's first T rows."""
    G = x.shape[1] // 32
    assert 1 <= T <= MAX_T and x.shape[0] >= T and xq.shape[0] >= G and xsc.shape[0] >= G
    _quantize_kernel()[G, 256, stream](x, T, xq, xsc)


_XBUF: dict = {}


def x_buffers(K: int):
    """The (xq, xsc) device buffers for activations of up to K columns (made before any graph capture:
    upload_quantized calls this with the model's widest K; one pair serves every product, the
    stream orders each product's read before the next quantization)."""
    have = _XBUF.get("K", 0)
    if K > have:
        G = K // 32
        _XBUF.update(K=K, xq=cuda.device_array((G, 256), np.uint8), xsc=cuda.device_array((G, 16), np.float32))
    return _XBUF["xq"], _XBUF["xsc"]


# ----------------------------------------------------------------------------- the GEMV
_GLOBALS = dict(cuda=cuda, float32=float32, int32=int32, uint32=uint32, min=min, grid_wait=grid_wait,
                ldg_f32x4=ldg_f32x4, h2f=h2f, ldg_b4=ldg_b4, ldg_b8=ldg_b8, ldg_b16=ldg_b16, mma_u8s8=mma_u8s8,
                kq_scale_min=kq_scale_min, M4=M4, MASK16=MASK16, U4=U4, U16=U16)


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
               "cw = c << 2", "xo = (g * 4 + c) << 3", "grid_wait()"):
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
        emit(2, f"xa{j}, xb{j} = ldg_b8(xq, 8 * s + {j}, xo)")
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


_HEADER = """# generated by kernels_numba.quant_mma._source: {cfg}
from kernels_numba.quant_mma import _GLOBALS
globals().update(_GLOBALS)

"""
_PY: dict = {}
_KERNELS: dict = {}


def py_kernel(W: int, has_bias: bool, has_res: bool, R: int = 1):
    key = (W, has_bias, has_res, R)
    if key not in _PY:
        src = _source(*key)
        if SIM:
            ns = dict(_GLOBALS)
            exec(compile(src, f"<quant_mma {key}>", "exec"), ns)
            _PY[key] = ns["gemv"]
        else:
            _PY[key] = _load_generated(_HEADER.format(cfg=key) + src, prefix="quant_mma")
    return _PY[key]


def kernel(W: int, has_bias: bool, has_res: bool, R: int = 1, blocks: int = 0):
    """blocks: the launch bound's blocks a multiprocessor (0: none)."""
    key = (W, has_bias, has_res, R, blocks)
    k = _KERNELS.get(key)
    if k is None:
        if SIM:
            k = cuda.jit(py_kernel(W, has_bias, has_res, R))
        else:
            from kernels_numba.jit import kernel as cached_kernel
            opts = {"launch_bounds": (32 * W, blocks)} if blocks else {}
            k = cached_kernel(py_kernel(W, has_bias, has_res, R), **opts)
        _KERNELS[key] = k
    return k


def gemv(xq, xsc, planes: dict, out, T: int, *, qtype: int, n_off: int = 0, bias=None, residual=None,
         stream=0, warps: int = WARPS, tiles: int = TILES, blocks: int = BLOCKS) -> None:
    """out[:T, n_off:n_off+N] = x[:T] @ w.T (+ bias[n_off:]) (+ residual[:T, n_off:]) for one part w,
    x already through quantize_x into (xq, xsc). Device arrays in, nothing allocated."""
    assert qtype in TYPES, f"quant mma: type {qtype}"
    qs, sc = planes["qs"], planes["sc"]
    N = qs.shape[0]
    assert 1 <= T <= MAX_T and out.shape[0] >= T and n_off + N <= out.shape[1]
    k = kernel(warps, bias is not None, residual is not None, tiles, blocks)
    k[-(-N // (16 * tiles)), 32 * warps, stream](xq, xsc, qs, sc, out, out if bias is None else bias,
                                       out if residual is None else residual, n_off, T)
