"""FP8 e4m3 weights (Hugging Face fp8 checkpoints) on the device: a GEMV for few rows and a bf16
dequantization for the many-rows path, with their NumPy references.

    out[t, n_off + n] = sum_k x[t, k] w[n, k] (+ bias) (+ res),   w[n, k] = e4m3(q[n, k]) S[n // bn, k // bk]

q uint8 [N, K] (the checkpoint's float8_e4m3fn bytes, [out, in] as torch Linear keeps them); S float32
[ceil(N / bn), ceil(K / bk)], the scales of `scale_grid`: one per tensor (bn, bk = N, K), per output
channel (1, K) or per 128 x 128 block (`weight_block_size` of the checkpoint's quantization_config:
DeepSeek-V3, Qwen3-FP8; its `weight_scale_inv` multiplies, despite the name). x float32 is used as it
is: no activation quantization, fp32 accumulation, so the product is exact but for fp32 rounding.

GEMV (T = 1..8): a lane takes 16 consecutive weights of a row (one `ld.global.nc.v4`), converts
them with `cvt.rn.f16x2.e4m3x2` (two a conversion, exact) and `cvt.f32.f16`, multiplies them with x
read through L1 (four 16-byte loads, shared by the warp's R rows), and scales the 16-weight partial
dot by its block's scale (bk is a multiple of 16, so one scale a chunk). Warps of a block take R
rows each; the grid is persistent as quant_gemv's (row tiles walked, the next step's loads in flight,
the first before the PDL wait); a variant per bucket of T (1, 2, 4, 8) keeps a sum per row of x and
row of the weights in registers, the rows of x unrolled. Generated source, as quant_gemv's.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32

from kernels_numba.ptx import (SIM, grid_trigger, grid_trigger_early, grid_trigger_late, grid_wait,
                               ldg_f32x4, pack_bf16x2, shfl_xor_f32)
from kernels_numba.quant_gemv import PERSIST, STREAM_HINT, sm_count
from kernels_numba.quant_ptx import e4m3x2_f32, ldg_b16, ldg_b16s, stg_u16x8

__all__ = ["scale_grid", "dequant_ref", "gemv_ref", "fp8_gemv", "fp8_gemv_cfg", "dequant_bf16",
           "py_kernel", "kernel", "MAX_T"]

MAX_T = 8
U16 = np.uint32(16)


# ----------------------------------------------------------------------------- host side
def scale_grid(scale, N: int, K: int, block: tuple[int, int] | None = None) -> tuple[np.ndarray, int, int]:
    """A checkpoint's scale as (S float32 [ceil(N / bn), ceil(K / bk)], bn, bk): a scalar (per
    tensor), [N] or [N, 1] (per channel), or with `block` = weight_block_size its block grid."""
    s = np.asarray(scale, np.float32)
    if block is not None:
        bn, bk = (int(b) for b in block)
        want = (-(-N // bn), -(-K // bk))
        if s.shape != want:
            raise ValueError(f"fp8 block scales for [{N}, {K}] in {bn} x {bk} blocks are {want}, got {s.shape}")
        S = s
    elif s.size == 1:
        S, bn, bk = s.reshape(1, 1), N, K
    elif s.size == N:
        S, bn, bk = s.reshape(N, 1), 1, K
    else:
        raise ValueError(f"fp8 scale of shape {s.shape} for a [{N}, {K}] weight: give weight_block_size")
    if bk % 16:
        raise ValueError(f"fp8 scale blocks of {bk} columns: the kernels need a multiple of 16")
    return np.ascontiguousarray(S, np.float32), bn, bk


def dequant_ref(q: np.ndarray, S: np.ndarray, bn: int, bk: int) -> np.ndarray:
    """float32 [N, K] of e4m3 bytes q times their block scales (ml_dtypes' e4m3fn: the reference)."""
    import ml_dtypes
    N, K = q.shape
    w = np.ascontiguousarray(q, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return w * np.repeat(np.repeat(S, bn, 0)[:N], bk, 1)[:, :K]


def gemv_ref(x, w, bias=None, residual=None) -> np.ndarray:
    y = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    if residual is not None:
        y = y + np.asarray(residual, np.float64)
    return y


# ----------------------------------------------------------------------------- GEMV
def _source(TT: int, W: int, R: int, U: int, PIPE: bool, has_bias: bool, has_res: bool) -> str:
    """The GEMV for T <= TT rows of x (TT = 1, 2, 4 or 8): a sum a row of x and row of the weights
    in registers, the rows of x unrolled (rows t >= T load row T - 1 and are not written)."""
    RPB = W * R
    RR, UU, TR = range(R), range(U), range(TT)
    L = []

    def emit(ind, line):
        L.append("    " * ind + line)

    emit(0, "def fp8_gemv(x, q, S, out, bias, res, n_off, T, bn, bk):")
    for ln in ("K = x.shape[1]", "N = q.shape[0]", "nch = K >> 4", "tid = cuda.threadIdx.x", "lane = tid & 31",
               f"wrow = (tid >> 5) * {R}", "bid = cuda.blockIdx.x", "nblk = cuda.gridDim.x",
               f"iters = (nch + {32 * U - 1}) // {32 * U}", f"ntiles = (N + {RPB - 1}) // {RPB}",
               "total = ((ntiles - bid + nblk - 1) // nblk) * iters"):
        emit(1, ln)
    for t in TR:
        emit(1, f"xr{t} = min({t}, T - 1)")
    names = [f"{r}_{v}_{e}" for r in RR for v in UU for e in range(4)]
    if PIPE:
        for nm in names:
            emit(1, f"wr{nm} = uint32(0)")
    for t in TR:
        for r in RR:
            emit(1, f"acc{t}_{r} = float32(0.0)")
    emit(1, f"for s in range(total + {int(PIPE)}):")
    ind = 2
    if PIPE:
        emit(2, "if s > 0:")
        for nm in names:
            emit(3, f"wc{nm} = wr{nm}")
        emit(2, "if s < total:")
        ind = 3
    emit(ind, "lt = s // iters")
    emit(ind, "lit = s - lt * iters")
    emit(ind, f"lrow = (bid + lt * nblk) * {RPB} + wrow")
    for v in UU:
        emit(ind, f"u{v} = min((lit * {U} + {v}) * 32 + lane, nch - 1) << 4")
    for r in RR:
        emit(ind, f"nr = min(lrow + {r}, N - 1)")
        for v in UU:
            emit(ind, f"g = {'ldg_b16s' if STREAM_HINT['on'] else 'ldg_b16'}(q, nr, u{v})")
            emit(ind, ", ".join(f"wr{r}_{v}_{e}" for e in range(4)) + " = g[0], g[1], g[2], g[3]")
    emit(2, "if s == 0:")
    emit(3, "grid_wait()")
    emit(3, "grid_trigger_early()")
    ind = 2
    if PIPE:
        emit(2, "if s > 0:")
        ind = 3
    src = "wc" if PIPE else "wr"
    emit(ind, f"cs = s - {int(PIPE)}")
    emit(ind, "tl = cs // iters")
    emit(ind, "it = cs - tl * iters")
    emit(ind, f"row0 = (bid + tl * nblk) * {RPB} + wrow")
    for v in UU:
        emit(ind, f"c = (it * {U} + {v}) * 32 + lane")
        emit(ind, f"ok{v} = c < nch")
        emit(ind, f"k{v} = min(c, nch - 1) << 4")
        for r in RR:
            emit(ind, f"sc{r}_{v} = S[min(row0 + {r}, N - 1) // bn, k{v} // bk]")
            for e in range(4):
                b = f"{src}{r}_{v}_{e}"
                emit(ind, f"f{r}_{v}_{4 * e}, f{r}_{v}_{4 * e + 1} = e4m3x2_f32({b} & MASK16)")
                emit(ind, f"f{r}_{v}_{4 * e + 2}, f{r}_{v}_{4 * e + 3} = e4m3x2_f32({b} >> U16)")
    for t in TR:
        for v in UU:
            for j in range(4):
                emit(ind, f"x{j} = ldg_f32x4(x, xr{t}, k{v} + {4 * j})")
            for r in RR:
                terms = " + ".join(f"f{r}_{v}_{4 * j + e} * x{j}[{e}]" for j in range(4) for e in range(4))
                emit(ind, f"d = {terms}")
                emit(ind, f"acc{t}_{r} += (d * sc{r}_{v}) if ok{v} else float32(0.0)")
    emit(ind, "if it == iters - 1:")
    emit(ind + 1, "grid_trigger_late()")
    eind = ind + 1
    for t in TR:
        for r in RR:
            emit(eind, f"a = acc{t}_{r}")
            emit(eind, f"acc{t}_{r} = float32(0.0)")
            for off in (16, 8, 4, 2, 1):
                emit(eind, f"a += shfl_xor_f32(a, {off})")
            emit(eind, f"n = row0 + {r}")
            cond = "lane == 0 and n < N" + (f" and {t} < T" if TT > 1 else "")
            emit(eind, f"if {cond}:")
            emit(eind + 1, "col = n_off + n")
            val = "a" + (" + bias[col]" if has_bias else "") + (f" + res[{t}, col]" if has_res else "")
            emit(eind + 1, f"out[{t}, col] = {val}")
    return "\n".join(L) + "\n"


_GLOBALS = dict(cuda=cuda, float32=float32, uint32=uint32, min=min, grid_wait=grid_wait,
                grid_trigger_early=grid_trigger_early, grid_trigger_late=grid_trigger_late,
                ldg_f32x4=ldg_f32x4, ldg_b16=ldg_b16, ldg_b16s=ldg_b16s, e4m3x2_f32=e4m3x2_f32, shfl_xor_f32=shfl_xor_f32,
                MASK16=np.uint32(0xFFFF), U16=U16)

_HEADER = """# generated by kernels_numba.quant_fp8._source: {cfg}
from kernels_numba.quant_fp8 import _GLOBALS
globals().update(_GLOBALS)

"""

_PY: dict = {}
_KERNELS: dict = {}


def py_kernel(*cfg):
    """The kernel function of (TT (1, 2, 4 or 8: x rows it takes), warps, rows, unroll, pipe, has_bias, has_res), with
    quant_gemv's current STREAM_HINT."""
    key = cfg + (STREAM_HINT["on"],)
    if key not in _PY:
        src = _source(*cfg)
        if SIM:
            ns = dict(_GLOBALS)
            exec(compile(src, f"<quant_fp8 {cfg}>", "exec"), ns)
            _PY[key] = ns["fp8_gemv"]
        else:
            from kernels_numba.quant_gemv import _load_generated
            _PY[key] = _load_generated(_HEADER.format(cfg=cfg) + src, "fp8_gemv", "quant_fp8")
    return _PY[key]


def launch_bounds(tt: int, warps: int) -> tuple[int, int]:
    """3 blocks of 128 threads a multiprocessor (<= 168 registers; at 4 blocks the T = 1 kernel with
    two rows and two chunks a lane spills 72 bytes)."""
    return 32 * warps, max(1, 3 * 4 // warps)


def kernel(*cfg):
    key = cfg + (STREAM_HINT["on"],)
    k = _KERNELS.get(key)
    if k is None:
        if SIM:
            k = cuda.jit(py_kernel(*cfg))
        else:
            from kernels_numba.jit import kernel as cached_kernel
            k = cached_kernel(py_kernel(*cfg), launch_bounds=launch_bounds(cfg[0], cfg[1]))
        _KERNELS[key] = k
    return k


def fp8_gemv_cfg(N: int, K: int, T: int = 1) -> tuple[int, int, int, bool]:
    """(warps, rows, unroll, pipe): one chunk of 16 weights a lane a step, the next step's loads in
    flight; few row tiles (N <= 8192 at K <= 4096: qkv, o) take 4 rows a warp in blocks of 4 warps,
    larger products 2 rows a warp in blocks of 8 (the fastest of bench.quant_kernels --types FP8
    --sweep at one row on the 8B shapes; docs/quant.md). Beyond 2 rows of x, 2 rows a warp in blocks
    of 4: the registers hold a sum per row of x and row of the weights, and 3 such blocks fit a
    multiprocessor with no spill (8 warps a block would fit one)."""
    if T > 2:
        return 4, 2, 1, True
    if N <= 8192 and K <= 4096:
        return 4, 4, 1, True
    return 8, 2, 1, True


def x_rows_bucket(T: int) -> int:
    """The kernel variant for T rows of x: 1, 2, 4 or 8 (its sums stay in registers)."""
    return 1 << (T - 1).bit_length()


def fp8_gemv(x, q, S, out, T: int, *, bn: int, bk: int, n_off: int = 0, bias=None, residual=None,
             stream=0, cfg=None, persist: int | None = None) -> None:
    """out[:T, n_off:n_off+N] = x[:T] @ (e4m3(q) S).T (+ bias) (+ residual). Device arrays; nothing
    allocated. q uint8 [N, K], S float32 from scale_grid, x / out / residual float32."""
    N, K = q.shape
    assert 1 <= T <= MAX_T and x.shape[1] == K and K % 16 == 0 and bk % 16 == 0, (T, K, bk)
    assert x.dtype == np.float32 and out.dtype == np.float32 and q.dtype == np.uint8
    assert n_off + N <= out.shape[1] and out.shape[0] >= T and x.shape[0] >= T
    warps, rows, unroll, pipe = cfg or fp8_gemv_cfg(N, K, T)
    k = kernel(x_rows_bucket(T), warps, rows, unroll, pipe, bias is not None, residual is not None)
    tiles = -(-N // (warps * rows))
    grid = min(tiles, (PERSIST if persist is None else persist) * sm_count())
    k[grid, 32 * warps, stream](x, q, S, out, out if bias is None else bias,
                                out if residual is None else residual, n_off, T, bn, bk)


# ----------------------------------------------------------------------------- many rows: dequantize
@cuda.jit
def _dequant_bf16_kernel(q, S, out, n_off, bn, bk):
    grid_wait()
    grid_trigger()
    N, K = q.shape
    nch = K >> 4
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    n = i // nch
    if n >= N:
        return
    k = (i - n * nch) << 4
    s = S[n // bn, k // bk]
    g = ldg_b16(q, n, k)
    for h in range(2):
        a0, a1 = e4m3x2_f32(g[2 * h] & np.uint32(0xFFFF))
        a2, a3 = e4m3x2_f32(g[2 * h] >> U16)
        b0, b1 = e4m3x2_f32(g[2 * h + 1] & np.uint32(0xFFFF))
        b2, b3 = e4m3x2_f32(g[2 * h + 1] >> U16)
        stg_u16x8(out, n_off + n, k + 8 * h, pack_bf16x2(a0 * s, a1 * s), pack_bf16x2(a2 * s, a3 * s),
                  pack_bf16x2(b0 * s, b1 * s), pack_bf16x2(b2 * s, b3 * s))


def dequant_bf16(q, S, out, *, bn: int, bk: int, n_off: int = 0, stream=0) -> None:
    """out[n_off:n_off+N] (uint16 bf16 bits [N_total, K]) = bf16(e4m3(q) S)."""
    N, K = q.shape
    assert out.dtype == np.uint16 and out.shape[1] == K and n_off + N <= out.shape[0] and K % 16 == 0
    total = N * (K // 16)
    _dequant_bf16_kernel[-(-total // 128), 128, stream](q, S, out, n_off, bn, bk)

