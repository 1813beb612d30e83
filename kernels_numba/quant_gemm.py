"""Many-row product on block-quantized weights: a bf16 tensor-core GEMM whose weight operand is
decoded from the blocks in registers, each weight block read once per output tile for all rows of x.

    out[t, n_off + n] = sum_k xb[t, k] w[n, k] (+ bias[n_off + n]) (+ res[t, n_off + n])

x comes as bf16 bits (xb uint16 [>= T, K], row-major: the rms_norm_bf16 / silu_mul_bf16 / x_to_bf16
producers cuBLASLt reads too); w is one part of a quantized weight in the planes the other kernels
read: Q4_K in quant_mma's fragment layout (mq, ms), Q6_K in quant_layout's planes (qs, qh, sc, dm).

A block of W warps owns BM = 16 R W weight rows (warp w the R 16-row tiles R w ..) and TB = 8 NT rows
of x (NT n-tiles of 8; more rows: more blocks, interleaved with the weight tiles so the blocks that
share a weight tile run together and read it once from HBM). It walks its K range in chunks of 128
values: the chunk of x is copied into shared memory by cp.async (double-buffered, permuted so that
lane (g, c) reads the B fragments of a group with one 16-byte load), the weights go from global
memory straight to registers, and per group of 32 values each warp

  - decodes its rows' codes to bf16 A fragments: a code byte q becomes the bf16 128 + q by a byte
    permute against 0x43 (`prmt`), then `fma.rn.bf16x2` twice: (v - 128) exactly, then q s - m (Q4_K:
    s = d sc_j, m = dmin m_j) or (q - 32) s (Q6_K: s = d s_i a 16-value half), rounded once to bf16
    (as the scratch road's bf16 image rounds it; s and m are bf16 too);
  - runs two `mma.m16n8k16` (bf16, fp32 accumulation) per 16-row tile and n-tile: values 0..15 of
    the group (low nibbles) then 16..31; inside each, mma k 2c, 2c + 1, 2c + 8, 2c + 9 are values
    4c .. 4c + 3 (the order a code word holds them), the same for A and B, so the sum is unchanged.

Split K (grid.y = KS > 1, for shapes of few weight tiles): each block writes its partial tile to
`ws` (float32, KS TT N values); the last block of a tile to arrive (an atomic counter per tile in
`cnt`, reset by that block) sums the KS partials in a fixed order (the result does not depend on
which block came last) and runs the epilogue. KS = 1 writes the epilogue from the registers.

Rows of x past T read zeros, weight rows past N are computed from clamped rows and not written.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int32, uint32

from kernels_numba.bf16 import device_function
from kernels_numba.ptx import SIM, grid_wait, lds_u32x4, mma_bf16_16816, pack_bf16x2
from kernels_numba.quant_gemm_ptx import (cp_async8, cp_async_commit, cp_async_wait1, cp_async_zero8, fma_bf16x2,
                                          ldcg_f32, prmt)
from kernels_numba.quant_gemv import _load_generated, sbyte
from kernels_numba.quant_layout import Q4_K, Q6_K
from kernels_numba.quant_mma import kq_scale_words
from kernels_numba.quant_ptx import h2f, ldg_b2, ldg_b4, ldg_b8, ldg_b16

__all__ = ["KINDS", "supports", "kind_of", "gemm", "gemm_cfg", "split_k", "x_view", "prepare", "n_tiles",
           "py_kernel", "kernel", "MAX_KS", "SMS"]

KINDS = ("q4k_mq", "q6k")       # Q4_K in the fragment layout, Q6_K on planes
KC = 128                        # values of K a chunk of x in shared memory holds
XP = 80                         # uint32 a row of x takes in a chunk buffer (64 + 16 pad: conflict-free loads)
SMS = 132                       # multiprocessors the split-K rule fills (H100 SXM; H200 the same)
MAX_KS = 16                     # most K splits
MAGIC = 0x43434343              # bf16 0x43qq = 128 + q
M4, M3 = np.uint32(0x0F0F0F0F), np.uint32(0x03030303)
U4, U16, MASK16 = np.uint32(4), np.uint32(16), np.uint32(0xFFFF)
ONE2 = np.uint32(0x3F803F80)    # bf16x2 (1, 1)
NEG128 = np.uint32(0xC300C300)  # bf16x2 (-128, -128)
NEG160 = np.uint32(0xC320C320)  # bf16x2 (-160, -160): 128 + q -> q - 32 (Q6_K)
ZERO2 = np.uint32(0)


def kind_of(qtype: int, fragments: bool) -> str | None:
    """The kernel variant for a part of this type and layout, or None (the part has none)."""
    if qtype == Q4_K and fragments:
        return "q4k_mq"
    if qtype == Q6_K and not fragments:
        return "q6k"
    return None


def supports(qtype: int, K: int, fragments: bool) -> bool:
    return kind_of(qtype, fragments) is not None and K % 256 == 0


def n_tiles(T: int) -> int:
    """n-tiles of 8 rows of x a block takes for T rows (1, 2, 4 or 8: few kernel variants)."""
    t = -(-T // 8)
    return 1 if t <= 1 else 2 if t <= 2 else 4 if t <= 4 else 8


# ----------------------------------------------------------------------------- device helpers
@device_function
def dec4(w, s2, m2, off):
    """The 4 code bytes of w -> two bf16 pairs (bytes 0, 1), (2, 3): fma(fma(128 + q, 1, off), s, m)."""
    return (fma_bf16x2(fma_bf16x2(prmt(w, MAGIC, 0x4140), ONE2, off), s2, m2),
            fma_bf16x2(fma_bf16x2(prmt(w, MAGIC, 0x4342), ONE2, off), s2, m2))


@device_function
def a_frag(wg, wh, sg, mg, sh, mh, off):
    """The mma A fragment of the code words of rows g (wg) and g + 8 (wh): (row g values 0, 1;
    row g + 8 values 0, 1; row g values 2, 3; row g + 8 values 2, 3) of the word's 4 bytes."""
    g01, g23 = dec4(wg, sg, mg, off)
    h01, h23 = dec4(wh, sh, mh, off)
    return g01, h01, g23, h23


@device_function
def q4k_group(wg, wh, scg, mng, sch, mnh, dg, mg, dh, mh, sh):
    """A fragments (values 4c.. of the low nibbles, then of the high nibbles) of one Q4_K group:
    code words wg / wh of rows g / g + 8, their header words of 4 scales / mins (byte sh / 8), d, dmin."""
    fs = dg * float32((scg >> sh) & uint32(255))
    fm = mg * float32((mng >> sh) & uint32(255))
    sgg, mgg = pack_bf16x2(fs, fs), pack_bf16x2(-fm, -fm)
    fs = dh * float32((sch >> sh) & uint32(255))
    fm = mh * float32((mnh >> sh) & uint32(255))
    shh, mhh = pack_bf16x2(fs, fs), pack_bf16x2(-fm, -fm)
    return (a_frag(wg & M4, wh & M4, sgg, mgg, shh, mhh, NEG128),
            a_frag((wg >> U4) & M4, (wh >> U4) & M4, sgg, mgg, shh, mhh, NEG128))


@device_function
def q6k_group(wg, hg0, hg1, wh, hh0, hh1, sc2, vg, vh, b, dg, dh):
    """A fragments of one Q6_K group (low 4 bits wg / wh, high-bit words of the two halves, shifted
    by sc2 = 2c); vg / vh: the header word of its two scales, bytes b and b + 1."""
    lg = (wg & M4) | (((hg0 >> sc2) & M3) << U4)
    ug = ((wg >> U4) & M4) | (((hg1 >> sc2) & M3) << U4)
    lh = (wh & M4) | (((hh0 >> sc2) & M3) << U4)
    uh = ((wh >> U4) & M4) | (((hh1 >> sc2) & M3) << U4)
    fa, fb = dg * float32(sbyte(vg, b)), dg * float32(sbyte(vg, b + 1))
    ha, hb = dh * float32(sbyte(vh, b)), dh * float32(sbyte(vh, b + 1))
    return (a_frag(lg, lh, pack_bf16x2(fa, fa), ZERO2, pack_bf16x2(ha, ha), ZERO2, NEG160),
            a_frag(ug, uh, pack_bf16x2(fb, fb), ZERO2, pack_bf16x2(hb, hb), ZERO2, NEG160))


@device_function
def mma2(a, b0, b1, b2, b3, acc):
    """acc += the group's two k16 steps: A a[0] (low nibbles) against B (b0, b1), a[1] against (b2, b3)."""
    lo, hi = a
    d = mma_bf16_16816(lo[0], lo[1], lo[2], lo[3], b0, b1, acc[0], acc[1], acc[2], acc[3])
    return mma_bf16_16816(hi[0], hi[1], hi[2], hi[3], b2, b3, d[0], d[1], d[2], d[3])


# ----------------------------------------------------------------------------- the generated kernel
_GLOBALS = dict(cuda=cuda, float32=float32, int32=int32, uint32=uint32, min=min, grid_wait=grid_wait,
                lds_u32x4=lds_u32x4, cp_async8=cp_async8, cp_async_commit=cp_async_commit,
                cp_async_wait1=cp_async_wait1, cp_async_zero8=cp_async_zero8, ldcg_f32=ldcg_f32,
                kq_scale_words=kq_scale_words, h2f=h2f, ldg_b2=ldg_b2, ldg_b4=ldg_b4, ldg_b8=ldg_b8,
                ldg_b16=ldg_b16, device_function=device_function, q4k_group=q4k_group, q6k_group=q6k_group, mma2=mma2, MASK16=MASK16, U16=U16)


class _Src:
    """Lines of generated source at indents."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, ind: int, line: str) -> None:
        self.lines.append("    " * ind + line)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _sb_q4k(e, R: int) -> None:
    """Per super-block s: rows g and g + 8 of each tile, d / dmin and the scale / min words."""
    for r in range(R):
        e(2, f"hg0, hg1, hg2, hg3 = ldg_b16(p1, t{r}, (s << 8) + (g << 4))")
        e(2, f"hh0, hh1, hh2, hh3 = ldg_b16(p1, t{r}, (s << 8) + ((g + 8) << 4))")
        e(2, f"dg{r}, mg{r}, dh{r}, mh{r} = h2f(hg0 & MASK16), h2f(hg0 >> U16), h2f(hh0 & MASK16), h2f(hh0 >> U16)")
        e(2, f"sg{r}_0, sg{r}_1, ng{r}_0, ng{r}_1 = kq_scale_words(hg1, hg2, hg3)")
        e(2, f"sh{r}_0, sh{r}_1, nh{r}_0, nh{r}_1 = kq_scale_words(hh1, hh2, hh3)")


def _half_q4k(e, R: int) -> None:
    """Per half super-block (before the barrier): the two group pairs' code words of each tile
    (group 2 jp row g, row g + 8, group 2 jp + 1 row g, row g + 8), the half's scale words."""
    for r in range(R):
        for q in range(2):
            e(3, f"c{r}_{q} = ldg_b16(p0, t{r}, (((s << 2) + 2 * hf + {q}) << 9) + lo)")
        for w in ("sg", "ng", "sh", "nh"):
            e(3, f"{w}{r} = {w}{r}_0 if hf == 0 else {w}{r}_1")


def _group_q4k(e, R: int, ee: int) -> list[str]:
    """Group 2 jq + ee of the half, its A fragments for each tile."""
    for r in range(R):
        e(4, f"cw{r} = c{r}_0 if jq == 0 else c{r}_1")
        e(4, f"a{r} = q4k_group(cw{r}[{2 * ee}], cw{r}[{2 * ee + 1}], sg{r}, ng{r}, sh{r}, nh{r}, dg{r}, mg{r}, dh{r}, "
             f"mh{r}, uint32(8 * (2 * jq + {ee})))")
    return [f"a{r}" for r in range(R)]


def _sb_q6k(e, R: int) -> None:
    """Per super-block s: the 16 int8 scales and the fp16 d of rows g and g + 8 of each tile."""
    for r in range(R):
        e(2, f"vg{r} = ldg_b16(p2, rg{r}, s << 4)")
        e(2, f"vh{r} = ldg_b16(p2, rh{r}, s << 4)")
        e(2, f"dg{r}, dh{r} = h2f(ldg_b2(p3, rg{r}, s << 1)), h2f(ldg_b2(p3, rh{r}, s << 1))")


def _half_q6k(e, R: int) -> None:
    pass


def _group_q6k(e, R: int, ee: int) -> list[str]:
    """Group j = 4 hf + 2 jq + ee: a word of low bits and the 8 bytes of high bits a row; its scales
    2 j, 2 j + 1 are bytes 2 (j & 1), + 1 of header word j >> 1."""
    e(4, f"j = 4 * hf + 2 * jq + {ee}")
    for r in range(R):
        for row in ("g", "h"):
            e(4, f"w{row} = ldg_b4(p0, r{row}{r}, ((j * NSB + s) << 4) + cw)")
            e(4, f"q{row}0, q{row}1 = ldg_b8(p1, r{row}{r}, (((j >> 1) * NSB + s) << 4) + {8 * ee})")
        for row in ("g", "h"):      # header word 2 hf + jq, chosen without indexing a tuple at run time
            e(4, f"v{row} = (v{row}{r}[0] if jq == 0 else v{row}{r}[1]) if hf == 0 else "
                 f"(v{row}{r}[2] if jq == 0 else v{row}{r}[3])")
        e(4, f"a{r} = q6k_group(wg, qg0, qg1, wh, qh0, qh1, sc2, vg, vh, {2 * ee}, dg{r}, dh{r})")
    return [f"a{r}" for r in range(R)]


_PARTS = {"q4k_mq": (_sb_q4k, _half_q4k, _group_q4k), "q6k": (_sb_q6k, _half_q6k, _group_q6k)}


def _source(kind: str, W: int, R: int, NT: int, has_bias: bool, has_res: bool) -> str:
    """The kernel source of one variant (module docstring): runtime loops over super-blocks, their
    halves (x chunks) and group pairs; each group's tiles and n-tiles written out."""
    e = _Src()
    e.lines.append(_helpers(has_bias, has_res))
    TB, NTH = 8 * NT, 32 * W
    sb_part, half_part, group_part = _PARTS[kind]
    e(0, "def gemm(xb, p0, p1, p2, p3, out, bias, res, ws, cnt, n_off, T, N, Z):")
    for ln in ("K = xb.shape[1]", "NSB = K >> 8", "tid = cuda.threadIdx.x", "lane = tid & 31", "warp = tid >> 5",
               "g = lane >> 2", "c = lane & 3", "cw = c << 2", "lo = lane << 4", "sc2 = uint32(2 * c)",
               "mb = cuda.blockIdx.x // Z", f"tz = (cuda.blockIdx.x - mb * Z) * {TB}",
               "ks = cuda.blockIdx.y", "KS = cuda.gridDim.y", "sb0 = ks * NSB // KS", "sb1 = (ks + 1) * NSB // KS",
               f"tile0 = mb * {R * W} + warp * {R}",
               f"xs = cuda.shared.array({2 * TB * XP}, uint32)", "grid_wait()"):
        e(1, ln)
    if kind == "q4k_mq":
        e(1, "ntl = p0.shape[0]")
        for r in range(R):
            e(1, f"t{r} = min(tile0 + {r}, ntl - 1)")
    else:
        for r in range(R):
            e(1, f"rg{r} = min((tile0 + {r}) * 16 + g, N - 1)")
            e(1, f"rh{r} = min((tile0 + {r}) * 16 + g + 8, N - 1)")
    for r in range(R):
        for u in range(NT):
            e(1, f"acc{r}_{u} = (float32(0.0), float32(0.0), float32(0.0), float32(0.0))")

    def stage(ind: int, chunk: str, buf: str) -> None:
        """cp.async of chunk `chunk` of x (values 128 chunk ..) into buffer `buf`: piece p of row n
        (values 4p .. 4p + 3: group p >> 3, half (p >> 2) & 1, lane p & 3) to its B-fragment slot."""
        e(ind, f"k0 = ({chunk}) * {KC}")
        e(ind, f"base = ({buf}) * {TB * XP}")
        e(ind, f"for i in range(tid, {TB * 32}, {NTH}):")
        e(ind + 1, "n = i >> 5")
        e(ind + 1, "p = i & 31")
        e(ind + 1, f"dst = base + n * {XP} + (((p >> 3) << 2) + (p & 3)) * 4 + ((p >> 2) & 1) * 2")
        e(ind + 1, "if tz + n < T:")
        e(ind + 2, "cp_async8(xs, dst, xb, tz + n, k0 + 4 * p)")
        e(ind + 1, "else:")
        e(ind + 2, "cp_async_zero8(xs, dst)")

    stage(1, "2 * sb0", "0")
    e(1, "cp_async_commit()")
    e(1, "for s in range(sb0, sb1):")
    sb_part(e, R)
    e(2, "for hf in range(2):            # chunk 2 s + hf of x, in buffer hf")
    half_part(e, R)
    e(3, "if 2 * s + hf + 1 < 2 * sb1:")
    stage(4, "2 * s + hf + 1", "1 - hf")
    e(3, "cp_async_commit()")
    e(3, "cp_async_wait1()")
    e(3, "cuda.syncthreads()")
    e(3, "for jq in range(2):        # group pair 2 hf + jq")
    for ee in range(2):
        frags = group_part(e, R, ee)
        for u in range(NT):
            e(4, f"b0, b1, b2, b3 = lds_u32x4(xs, hf * {TB * XP} + ({8 * u} + g) * {XP} + ((2 * jq + {ee}) * 4 + c) * 4)")
            for r in range(R):
                e(4, f"acc{r}_{u} = mma2({frags[r]}, b0, b1, b2, b3, acc{r}_{u})")
    e(3, "cuda.syncthreads()")
    _epilogue(e, R, W, NT, has_bias, has_res)
    return e.text()


def _helpers(has_bias: bool, has_res: bool) -> str:
    """Device functions of the generated module: a lane's 4 accumulators of a fragment into out
    (epilogue) or into the split-K partials."""
    tail = (" + bias[col]" if has_bias else "") + (" + res[t, col]" if has_res else "")
    e = _Src()
    e(0, "@device_function")
    e(0, "def put4(out, bias, res, acc, m, t, T, N, n_off):")
    for k in range(4):
        e(1, f"if t + {k & 1} < T and m + {8 * (k >> 1)} < N:")
        e(2, f"col = n_off + m + {8 * (k >> 1)}")
        e(2, f"out[t + {k & 1}, col] = acc[{k}]" + tail.replace("[t,", f"[t + {k & 1},"))
    e(0, "")
    e(0, "@device_function")
    e(0, "def part4(ws, acc, m, row, N):")
    for k in range(4):
        e(1, f"if m + {8 * (k >> 1)} < N:")
        e(2, f"ws[(row + {k & 1}) * N + m + {8 * (k >> 1)}] = acc[{k}]")
    e(0, "")
    e(0, "")
    return e.text()


def _epilogue(e, R: int, W: int, NT: int, has_bias: bool, has_res: bool) -> None:
    """KS = 1: the registers into out. KS > 1: the partial tile into ws, then the last block of the
    tile sums the KS partials in order into out."""
    BM, TB, NTH = 16 * R * W, 8 * NT, 32 * W
    tail = (" + bias[col]" if has_bias else "") + (" + res[t, col]" if has_res else "")
    e(1, "if KS == 1:")
    for r in range(R):
        for u in range(NT):
            e(2, f"put4(out, bias, res, acc{r}_{u}, (tile0 + {r}) * 16 + g, tz + {8 * u} + 2 * c, T, N, n_off)")
    e(1, "else:")
    e(2, f"TT = Z * {TB}")
    for r in range(R):
        for u in range(NT):
            e(2, f"part4(ws, acc{r}_{u}, (tile0 + {r}) * 16 + g, ks * TT + tz + {8 * u} + 2 * c, N)")
    e(2, "cuda.threadfence()")
    e(2, "cuda.syncthreads()")
    e(2, "last = cuda.shared.array(1, int32)")
    e(2, "if tid == 0:")
    e(3, "slot = cuda.blockIdx.x")
    e(3, "prev = cuda.atomic.add(cnt, slot, 1)")
    e(3, "last[0] = 1 if prev == KS - 1 else 0")
    e(3, "if prev == KS - 1:")
    e(4, "cnt[slot] = 0")
    e(2, "cuda.syncthreads()")
    e(2, "if last[0] == 1:")
    e(3, "cuda.threadfence()")
    e(3, f"for q in range(tid, {BM * TB}, {NTH}):")
    e(4, f"t = tz + q // {BM}")
    e(4, f"m = mb * {BM} + q % {BM}")
    e(4, "if t < T and m < N:")
    e(5, "a = float32(0.0)")
    e(5, "for k in range(KS):")
    e(6, "a += ldcg_f32(ws, (k * TT + t) * N + m)")
    e(5, "col = n_off + m")
    e(5, f"out[t, col] = a{tail}")


_HEADER = """# generated by kernels_numba.quant_gemm._source: {cfg}
from kernels_numba.quant_gemm import _GLOBALS
globals().update(_GLOBALS)

"""
_PY: dict = {}
_KERNELS: dict = {}


def py_kernel(kind: str, W: int, R: int, NT: int, has_bias: bool, has_res: bool):
    key = (kind, W, R, NT, has_bias, has_res)
    if key not in _PY:
        src = _source(*key)
        if SIM:
            ns = dict(_GLOBALS)
            exec(compile(src, f"<quant_gemm {key}>", "exec"), ns)
            _PY[key] = ns["gemm"]
        else:
            _PY[key] = _load_generated(_HEADER.format(cfg=key) + src, func="gemm", prefix="quant_gemm")
    return _PY[key]


def kernel(kind: str, W: int, R: int, NT: int, has_bias: bool, has_res: bool):
    key = (kind, W, R, NT, has_bias, has_res)
    k = _KERNELS.get(key)
    if k is None:
        if SIM:
            k = cuda.jit(py_kernel(*key))
        else:
            from kernels_numba.jit import kernel as cached_kernel
            k = cached_kernel(py_kernel(*key))
        _KERNELS[key] = k
    return k


# ----------------------------------------------------------------------------- geometry
def split_k(N: int, K: int, T: int, W: int, R: int, NT: int, sms: int = SMS) -> int:
    """K splits for a product: 1 when the (weight tile, x-row block) blocks already fill 3/4 of the
    multiprocessors; else as many as fit them in one wave, each split at least 2 super-blocks."""
    blocks = -(-N // (16 * R * W)) * -(-T // (8 * NT))
    if 4 * blocks >= 3 * sms:
        return 1
    return max(1, min(MAX_KS, sms // blocks, (K // 256) // 2))


def gemm_cfg(N: int, K: int, T: int) -> tuple[int, int, int, int]:
    """(W warps, R tiles a warp, NT n-tiles, KS splits): 8 warps of 2 tiles (256 weight rows a block:
    x re-read from L2 once per 256 rows) where the weight has 1,024 tiles or more (gate_up, lm_head),
    else 4 warps of 2 tiles and K split to fill the machine."""
    NT = n_tiles(T)
    W, R = (8, 2) if N >= 16384 else (4, 2)
    return W, R, NT, split_k(N, K, T, W, R, NT)


# ----------------------------------------------------------------------------- buffers
_BUF: dict = {}


def prepare(N: int, K: int, max_rows: int, min_ws: int = 0) -> None:
    """Make the device buffers a product of N x K weights and up to max_rows rows needs (the bf16 x,
    the split-K partials, at least min_ws values, and counters), now: before any graph capture. They
    only grow."""
    need_x = max_rows * K
    need_ws = min_ws
    for T in sorted({min(t, max_rows) for t in (9, 16, 17, 32, 33, 64, max_rows)}):
        W, R, NT, KS = gemm_cfg(N, K, T)
        if KS > 1:
            need_ws = max(need_ws, KS * -(-T // (8 * NT)) * 8 * NT * N)
    if need_x > _BUF.get("x", (0,))[0]:
        _BUF["x"] = (need_x, cuda.device_array(need_x, np.uint16))
        _BUF.pop("views", None)
    if max(need_ws, 1) > _BUF.get("ws", (0,))[0]:
        _BUF["ws"] = (max(need_ws, 1), cuda.device_array(max(need_ws, 1), np.float32))
    if "cnt" not in _BUF:
        _BUF["cnt"] = cuda.to_device(np.zeros(4 * MAX_KS * SMS, np.int32))
    _BUF.setdefault("filler", cuda.to_device(np.zeros((1, 16), np.uint8)))


def x_flat():
    """The bf16 x buffer (flat uint16): where the producers write the rows of x."""
    return _BUF["x"][1]


def x_view(T: int, K: int):
    """The bf16 x buffer as [T, K] (cached: a Numba reshape costs Python time every step)."""
    views = _BUF.setdefault("views", {})
    v = views.get((T, K))
    if v is None:
        v = views[(T, K)] = _BUF["x"][1][:T * K].reshape(T, K)
    return v


def gemm(xb, planes: dict, kind: str, out, T: int, N: int, *, n_off: int = 0, bias=None, residual=None,
         stream=0, cfg: tuple[int, int, int, int] | None = None) -> None:
    """out[:T, n_off:n_off + N] = xb[:T] @ w.T (+ bias[n_off:]) (+ residual[:T, n_off:]) for one part w
    (planes of `kind`, N rows); residual may be out itself. xb uint16 [>= T, K] bf16. cfg: (W, R, NT,
    KS), default gemm_cfg. prepare(N, K, T) must have run (graph-capture safe: nothing allocated)."""
    K = xb.shape[1]
    W, R, NT, KS = cfg or gemm_cfg(N, K, T)
    assert kind in KINDS and K % 256 == 0 and T >= 1 and xb.shape[0] >= T and out.shape[0] >= T
    assert n_off + N <= out.shape[1] and 1 <= KS <= K // 256
    Z = -(-T // (8 * NT))
    blocks = -(-N // (16 * R * W)) * Z
    ws, cnt = _BUF["ws"][1], _BUF["cnt"]
    if KS > 1:
        assert KS * Z * 8 * NT * N <= ws.size and blocks <= cnt.size, "quant_gemm: prepare() for this shape first"
    f = _BUF["filler"]
    if kind == "q4k_mq":
        p = (planes["mq"], planes["ms"], f, f)
        assert planes["mq"].shape[0] * 16 >= N
    else:
        p = (planes["qs"], planes["qh"], planes["sc"], planes["dm"])
    k = kernel(kind, W, R, NT, bias is not None, residual is not None)
    k[(blocks, KS), 32 * W, stream](xb, *p, out, out if bias is None else bias, out if residual is None else residual,
                                   ws, cnt, n_off, T, N, Z)

