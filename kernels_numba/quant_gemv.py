"""GEMV of few rows (T = 1..8) against a block-quantized weight, dequantized in registers:

    out[t, n_off + n] = sum_k x_hat[t, k] w[n, k] (+ bias[n_off + n]) (+ res[t, n_off + n])

x float32 [>= T, K] (read rows 0..T-1); w one part of a QuantizedTensor in the planes of
quant_layout.repack (qs, qh, sc, dm: uint8 [N, bytes a row]); out / res float32 [>= T, N_total]
(res may be out: the residual add of the decoder's o / down products); bias float32 [N_total].
Accumulation is fp32 of exact int32 dot products.

How (llama.cpp's mmvq, laid out for 16-byte loads). The block first quantizes x into shared
memory the way llama.cpp's q8_1 does (int8 per value, a float scale d8 and the integer sum of
each group of 32: ~1.3 T K bytes of dynamic shared memory), 8 lanes a group (one 16-byte load of x
each, the group's absmax and sums by xor-shuffles), so activations need no extra launch. The weights
then stream: lanes split K, one UNIT a lane at a time, U a step: a unit is a group of 32 (legacy
types: its 16 bytes of codes in one `ld.global.nc.v4`, its 2-4 scale bytes, Q5 its 4 bytes of high
bits) or half a super-block (K-quants: four such loads, Q5_K / Q6_K one / two more of high bits, and
the super-block's 16-byte scale header, which the two lanes of a super-block share through L1).
Each 32-bit word of codes becomes two dp4a operands with a mask and a shift (Q5 / Q6 add their
high bits with a shift and a mask); dp4a against the int8 x words (`ld.shared.v4`) gives the
group's integer dot, and the group's scale and offset are applied once per group in fp32:
    Q4_0 / Q5_0: d d8 (dot - 8|16 sum)       Q8_0: d d8 dot
    Q4_1 / Q5_1: d8 (d dot + m sum)          Q4_K / Q5_K: d8 (d sc dot - dmin m sum)
    Q6_K: d d8 (s_a (dot_a - 32 sum_a) + s_b (dot_b - 32 sum_b))   (two 16-value halves)
Geometry (gemv_cfg): W warps a block; a warp holds SPLIT lane groups of 32/SPLIT lanes, each
group R rows; the grid is persistent (a block stages x once and walks row tiles); the next step's
loads are in flight while a step computes (PIPE), the first step's before the PDL wait and the x
staging. The lane-group sums meet by xor-shuffles; lane 0 of a group adds bias / residual, stores.
T = 1 has its own kernel (sums in registers); T = 2..8 share one (a run-time loop over x's rows,
the lanes' partial sums in shared memory). The source is generated with every loop over rows,
units and groups written out (registers stay scalars), under the kernel cache directory.

Contracts: K % 32 == 0 (K-quants: K % 256 == 0); T <= 8 with the shared memory above within the
device's opt-in limit (`max_rows`; above 48 KB the launcher raises the kernel's attribute); planes
as repack makes them (16-byte aligned rows). The kernels allocate nothing.
"""
from __future__ import annotations

import os


import numpy as np
from numba import cuda, float32, int32, uint32

from kernels_numba.bf16 import device_function
from kernels_numba.ptx import (SIM, grid_trigger_early, grid_trigger_late, grid_wait, ldg_f32x4,
                               lds_u32x4, shfl_xor_f32)
from kernels_numba.quant_layout import (KQUANTS, NAMES, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K,
                                        Q8_0, TYPES)
from kernels_numba.quant_ptx import (bits_f32, dp4a_ss, dp4a_us, f32_bits, h2f, ldg_b2, ldg_b4,
                                     ldg_b16, ldg_b16s, rni, shfl_xor_i32)

__all__ = ["gemv", "gemv_cfg", "gemv_path", "max_rows", "smem_bytes", "py_kernel", "kernel",
           "MAX_T", "SMEM_LIMIT"]

MAX_T = 8
# weights' 16-byte loads with the streaming hints (ldg_b16s: L1 no-allocate, L2 256-byte fetch); read
# when a kernel's source is generated (bench/quant_kernels.py --hint 0 measures without)
STREAM_HINT = {"on": True}
SMEM_LIMIT = 48 * 1024          # dynamic shared memory without the opt-in attribute
BIG_SMEM = 76 * 1024            # above: fewer than 3 blocks fit a multiprocessor (8 warps a block)

M4 = np.uint32(0x0F0F0F0F)
M10 = np.uint32(0x10101010)
M30 = np.uint32(0x30303030)
U0, U1, U2, U3, U4 = (np.uint32(i) for i in range(5))
U8, U16, U24 = np.uint32(8), np.uint32(16), np.uint32(24)
MASK16 = np.uint32(0xFFFF)
B255 = np.uint32(255)


# ----------------------------------------------------------------------------- decoding helpers
@device_function
def q4_ops(q0, q1, q2, q3):
    """The 8 dp4a operand words (values 4w.. of half 0, then half 1) of a group's 4 qs words."""
    return (q0 & M4, q1 & M4, q2 & M4, q3 & M4,
            (q0 >> U4) & M4, (q1 >> U4) & M4, (q2 >> U4) & M4, (q3 >> U4) & M4)


@device_function
def q5_ops(q0, q1, q2, q3, h):
    """q4_ops with bit 4 from the group's qh word (value 16h + 4w + b at bit 8b + 4h + w)."""
    return ((q0 & M4) | ((h << U4) & M10), (q1 & M4) | ((h << U3) & M10),
            (q2 & M4) | ((h << U2) & M10), (q3 & M4) | ((h << U1) & M10),
            ((q0 >> U4) & M4) | (h & M10), ((q1 >> U4) & M4) | ((h >> U1) & M10),
            ((q2 >> U4) & M4) | ((h >> U2) & M10), ((q3 >> U4) & M4) | ((h >> U3) & M10))


@device_function
def q6_ops(q0, q1, q2, q3, h0, h1):
    """q4_ops with bits 4..5 from the group's two qh words (half h: bits 8b + 2w of word h)."""
    return ((q0 & M4) | ((h0 << U4) & M30), (q1 & M4) | ((h0 << U2) & M30),
            (q2 & M4) | (h0 & M30), (q3 & M4) | ((h0 >> U2) & M30),
            ((q0 >> U4) & M4) | ((h1 << U4) & M30), ((q1 >> U4) & M4) | ((h1 << U2) & M30),
            ((q2 >> U4) & M4) | (h1 & M30), ((q3 >> U4) & M4) | ((h1 >> U2) & M30))


@device_function
def kq_scale_min(s1, s2, s3, j):
    """6-bit scale and min of group j (0..7) of a Q4_K / Q5_K super-block, from the header's
    words 1..3 (the 12 scale bytes)."""
    sh = uint32((j & 3) * 8)
    a = s1 >> sh
    b = s2 >> sh
    c = s3 >> sh
    if j < 4:
        sc = a & uint32(63)
        mn = b & uint32(63)
    else:
        sc = (c & uint32(15)) | ((a >> U2) & uint32(0x30))
        mn = ((c >> U4) & uint32(15)) | ((b >> U2) & uint32(0x30))
    return int32(sc), int32(mn)


@device_function
def kq_scale_min_h(s1, s2, s3, g, h):
    """kq_scale_min of group 4h + g (g constant, h 0/1 per lane): both halves' extraction, selected."""
    sh = uint32(8 * g)
    a = s1 >> sh
    b = s2 >> sh
    c = s3 >> sh
    if h:
        sc = (c & uint32(15)) | ((a >> U2) & uint32(0x30))
        mn = ((c >> U4) & uint32(15)) | ((b >> U2) & uint32(0x30))
    else:
        sc = a & uint32(63)
        mn = b & uint32(63)
    return int32(sc), int32(mn)


@device_function
def sbyte(w, b):
    """Signed byte b (0..3) of the word w, as int32."""
    return int32(w << uint32(24 - 8 * b)) >> 24


# ----------------------------------------------------------------------------- the kernel
_GLOBALS = dict(cuda=cuda, float32=float32, int32=int32, uint32=uint32, min=min, max=max, abs=abs,
                grid_wait=grid_wait, grid_trigger_early=grid_trigger_early,
                grid_trigger_late=grid_trigger_late, ldg_f32x4=ldg_f32x4, lds_u32x4=lds_u32x4,
                shfl_xor_f32=shfl_xor_f32, shfl_xor_i32=shfl_xor_i32, bits_f32=bits_f32,
                f32_bits=f32_bits, dp4a_us=dp4a_us, dp4a_ss=dp4a_ss, h2f=h2f, rni=rni, ldg_b2=ldg_b2,
                ldg_b4=ldg_b4, ldg_b16=ldg_b16, ldg_b16s=ldg_b16s, q4_ops=q4_ops, q5_ops=q5_ops, q6_ops=q6_ops,
                kq_scale_min=kq_scale_min, kq_scale_min_h=kq_scale_min_h, sbyte=sbyte, MASK16=MASK16, U8=U8, U16=U16, U24=U24,
                B255=B255)


def _unit_words(qt: int) -> tuple[int, int, int, int]:
    """(qs, qh, sc, dm) 32-bit words a unit (a group; K-quants: half a super-block) holds in registers."""
    kq = qt in KQUANTS
    qs = 8 if qt == Q8_0 else (16 if kq else 4)
    qh = {Q5_0: 1, Q5_1: 1, Q5_K: 4, Q6_K: 8}.get(qt, 0)
    sc = 4 if kq else 0
    dm = 1 if (not kq or qt == Q6_K) else 0
    return qs, qh, sc, dm


def _gemv_source(QT: int, ONE: bool, W: int, R: int, SPLIT: int, U: int, PIPE: bool, has_bias: bool,
                 has_res: bool, SB: int = 4) -> str:
    """The kernel's source with every loop over rows, units and groups written out (LLVM does not
    unroll bodies this large, and a register array it indexes in a kept loop goes to local
    memory): the unit's words, dp4a operands and scales are scalars. The rows of x are a run-time
    loop (T is an argument), so one kernel serves T = 2..8 and the code does not grow with T; ONE:
    the T = 1 kernel (no loop, the partial sums in registers: LLVM hoists the group decoding out of
    the T loop, which costs ~40 registers)."""
    assert SPLIT in (1, 2, 4) and QT in TYPES
    KQ = QT in KQUANTS
    Q6 = QT == Q6_K
    Q5 = QT in (Q5_0, Q5_1, Q5_K)
    HAS_MIN = QT in (Q4_1, Q5_1)
    OFFSET = {Q4_0: 8, Q5_0: 16}.get(QT, 0)
    LG = 32 // SPLIT
    NG = 4 if KQ else 1             # groups a unit (K-quants: half a super-block, groups 4h .. 4h + 3)
    NT = 32 * W
    RPB = W * R * SPLIT
    QSW, QHW, SCW, DMW = _unit_words(QT)
    UW = QSW + QHW + SCW + DMW
    O_QH, O_SC, O_DM = QSW, QSW + QHW, QSW + QHW + SCW
    RR, UU, GG = range(R), range(U), range(NG)
    L = []

    def emit(ind, line):
        L.append("    " * ind + line)

    def load(ind, step, dst):
        emit(ind, f"lt = {step} // iters")
        emit(ind, f"lit = {step} - lt * iters")
        emit(ind, f"lrow = (bid + lt * nblk) * {RPB} + wrow")
        for r in RR:
            emit(ind, f"nr{r} = min(lrow + {r * SPLIT}, N - 1)")
        for v in UU:
            emit(ind, f"u{v} = min((lit * {U} + {v}) * {LG} + li, NUN - 1)")
            if KQ:      # units 0 .. NSB-1: first halves, NSB .. 2 NSB-1: second halves (lanes of a
                emit(ind, f"h{v} = 1 if u{v} >= NSB else 0")     # quarter-warp on consecutive x slots)
                emit(ind, f"s{v} = u{v} - h{v} * NSB")
        for r in RR:
            for v in UU:
                w = f"{dst}{r}_{v}_"

                def words(base, expr):
                    emit(ind, f"q = {'ldg_b16s' if STREAM_HINT['on'] else 'ldg_b16'}({expr})")
                    emit(ind, ", ".join(f"{w}{base + e}" for e in range(4)) + " = q[0], q[1], q[2], q[3]")
                if KQ:       # half h of super-block s: groups 4h + g at positions (4h + g) NSB + s
                    for g in range(4):
                        words(4 * g, f"qs, nr{r}, ((4 * h{v} + {g}) * NSB + s{v}) << 4")
                    for p in range(QHW // 4):     # Q5_K: quad h; Q6_K: pairs 2h, 2h + 1
                        jq = f"h{v}" if QT == Q5_K else f"(2 * h{v} + {p})"
                        words(O_QH + 4 * p, f"qh, nr{r}, ({jq} * NSB + s{v}) << 4")
                    words(O_SC, f"sc, nr{r}, s{v} << 4")
                    if Q6:
                        emit(ind, f"{w}{O_DM} = ldg_b2(dm, nr{r}, s{v} << 1)")
                else:
                    for h in range(QSW // 4):
                        words(4 * h, f"qs, nr{r}, ({h} * G + u{v}) << 4" if QT == Q8_0 else f"qs, nr{r}, u{v} << 4")
                    if QHW:
                        emit(ind, f"{w}{O_QH} = ldg_b4(qh, nr{r}, u{v} << 2)")
                    emit(ind, f"{w}{O_DM} = " + (f"ldg_b4(dm, nr{r}, u{v} << 2)" if HAS_MIN else f"ldg_b2(dm, nr{r}, u{v} << 1)"))

    def unit_heads(ind, src):
        """Per unit of the step: its index, whether it is inside the row, its K-quant super-block scales."""
        for v in UU:
            emit(ind, f"u = (it * {U} + {v}) * {LG} + li")
            emit(ind, f"ok{v} = u < NUN")
            emit(ind, f"uc{v} = min(u, NUN - 1)")
            if KQ:
                emit(ind, f"hb{v} = 1 if uc{v} >= NSB else 0")
                emit(ind, f"sb{v} = uc{v} - hb{v} * NSB")
            for r in RR:
                w = f"{src}{r}_{v}_"
                if Q6:
                    emit(ind, f"dd{r}_{v} = h2f({w}{O_DM})")
                elif KQ:
                    emit(ind, f"dk{r}_{v} = h2f({w}{O_SC} & MASK16)")
                    emit(ind, f"mk{r}_{v} = h2f({w}{O_SC} >> U16)")

    def group(ind, src, r, v, j):
        """Group j of unit v of row r: its dp4a operands p0..p7 and scales (f1, f2 / sa, sb)."""
        w = f"{src}{r}_{v}_"
        qw = ", ".join(f"{w}{4 * j + e}" for e in range(4))
        dst = ", ".join(f"p{e}" for e in range(8))
        if QT == Q8_0:
            emit(ind, f"{dst} = " + ", ".join(f"{w}{e}" for e in range(8)))
        elif Q6:
            emit(ind, f"{dst} = q6_ops({qw}, {w}{O_QH + 2 * j}, {w}{O_QH + 2 * j + 1})")
        elif Q5:
            emit(ind, f"{dst} = q5_ops({qw}, {w}{O_QH + j})")
        else:
            emit(ind, f"{dst} = q4_ops({qw})")
        if Q6:       # group 4h + j: scales 8h + 2j, 8h + 2j + 1 (word 2h + j / 2)
            lo, hi = f"{w}{O_SC + j // 2}", f"{w}{O_SC + 2 + j // 2}"
            emit(ind, f"sw = {hi} if hb{v} else {lo}")
            emit(ind, f"sa = sbyte(sw, {2 * (j & 1)})")
            emit(ind, f"sb = sbyte(sw, {2 * (j & 1) + 1})")
        elif KQ:
            emit(ind, f"scj, mnj = kq_scale_min_h({w}{O_SC + 1}, {w}{O_SC + 2}, {w}{O_SC + 3}, {j}, hb{v})")
            emit(ind, f"f1 = dk{r}_{v} * float32(scj)")
            emit(ind, f"f2 = mk{r}_{v} * float32(mnj)")
        else:
            emit(ind, f"f1 = h2f({w}{O_DM} & MASK16)")
            if HAS_MIN:
                emit(ind, f"f2 = h2f({w}{O_DM} >> U16)")

    def products(ind, src):
        """For each row t of x (a run-time loop): every group of the step decoded in registers (at
        T = 1 once; each further row of x decodes again: registers over ALU work), dotted with the
        row's int8 x, added to the lane's partial sums in shared memory (XA + (t R + r) NT + tid)."""
        if ONE:
            emit(ind, "t = 0")
            ind -= 1
        else:
            emit(ind, "for t in range(T):")
            for r in RR:
                emit(ind + 1, f"ps{r} = float32(0.0)")
        dp = "dp4a_ss" if QT == Q8_0 else "dp4a_us"
        xs = ["xa[0]", "xa[1]", "xa[2]", "xa[3]", "xb[0]", "xb[1]", "xb[2]", "xb[3]"]
        for v in UU:
            for j in GG:
                emit(ind + 1, f"slot = (4 * hb{v} + {j}) * NSB + sb{v}" if KQ else f"slot = uc{v}")
                emit(ind + 1, "xa = lds_u32x4(sm, ((2 * t) * G + slot) * 4)")
                emit(ind + 1, "xb = lds_u32x4(sm, ((2 * t + 1) * G + slot) * 4)")
                emit(ind + 1, "d8 = bits_f32(sm[XD + t * G + slot])")
                emit(ind + 1, "s32 = int32(sm[XS + t * G + slot])")
                if Q6:
                    emit(ind + 1, "sh0 = int32(sm[XH + t * G + slot])")
                for r in RR:
                    group(ind + 1, src, r, v, j)
                    if Q6:
                        emit(ind + 1, f"da = {dp}(p0, xa[0], 0)")
                        for e in range(1, 4):
                            emit(ind + 1, f"da = {dp}(p{e}, {xs[e]}, da)")
                        emit(ind + 1, f"db = {dp}(p4, xb[0], 0)")
                        for e in range(5, 8):
                            emit(ind + 1, f"db = {dp}(p{e}, {xs[e]}, db)")
                        emit(ind + 1, "S = int32(sa * int32(da - 32 * sh0) + sb * int32(db - 32 * (s32 - sh0)))")
                        val = f"dd{r}_{v} * d8 * float32(S)"
                    else:
                        emit(ind + 1, f"dot = {dp}(p0, xa[0], 0)")
                        for e in range(1, 8):
                            emit(ind + 1, f"dot = {dp}(p{e}, {xs[e]}, dot)")
                        if QT == Q8_0:
                            val = "f1 * d8 * float32(dot)"
                        elif OFFSET:
                            val = f"f1 * d8 * float32(int32(dot - {OFFSET} * s32))"
                        elif HAS_MIN:
                            val = "d8 * (f1 * float32(dot) + f2 * float32(s32))"
                        else:
                            val = "d8 * (f1 * float32(dot) - f2 * float32(s32))"
                    emit(ind + 1, f"{'acc' if ONE else 'ps'}{r} += ({val}) if ok{v} else float32(0.0)")
        if not ONE:
            for r in RR:
                emit(ind + 1, f"ia = XA + (t * {R} + {r}) * {NT} + tid")
                emit(ind + 1, f"sm[ia] = f32_bits(bits_f32(sm[ia]) + ps{r})")

    def epilogue(ind):
        emit(ind, "grid_trigger_late()")
        if ONE:
            emit(ind, "t = 0")
            ind -= 1
        else:
            emit(ind, "for t in range(T):")
        for r in RR:
            if ONE:
                emit(ind + 1, f"a = acc{r}")
                emit(ind + 1, f"acc{r} = float32(0.0)")
            else:
                emit(ind + 1, f"ia = XA + (t * {R} + {r}) * {NT} + tid")
                emit(ind + 1, "a = bits_f32(sm[ia])")
                emit(ind + 1, "sm[ia] = uint32(0)")
            off = LG // 2
            while off:
                emit(ind + 1, f"a += shfl_xor_f32(a, {off})")
                off //= 2
            emit(ind + 1, f"n = row0 + {r * SPLIT}")
            emit(ind + 1, "if li == 0 and n < N:")
            emit(ind + 2, "col = n_off + n")
            val = "a" + (" + bias[col]" if has_bias else "") + (" + res[t, col]" if has_res else "")
            emit(ind + 2, f"out[t, col] = {val}")

    emit(0, "def gemv(x, qs, qh, sc, dm, out, bias, res, n_off, T):")
    for ln in (
            "K = x.shape[1]", "G = K >> 5", "NSB = K >> 8", f"NUN = {'2 * NSB' if KQ else 'G'}", "N = qs.shape[0]",
            "tid = cuda.threadIdx.x", "lane = tid & 31", f"gi = lane // {LG}", f"li = lane - gi * {LG}",
            f"wrow = (tid >> 5) * {R * SPLIT} + gi", "bid = cuda.blockIdx.x", "nblk = cuda.gridDim.x",
            f"iters = (NUN + {LG * U - 1}) // {LG * U}", f"ntiles = (N + {RPB - 1}) // {RPB}",
            "total = ((ntiles - bid + nblk - 1) // nblk) * iters", "sm = cuda.shared.array(0, uint32" + ("" if SIM else ", alignment=16") + ")",
            "XD = T * (K >> 2)", "XS = XD + T * G", f"XH = XS + T * G", f"XA = XH + {'T * G' if Q6 else '0'}"):
        emit(1, ln)
    if PIPE:
        for nm in (f"{r}_{v}_{k}" for r in RR for v in UU for k in range(UW)):
            emit(1, f"wr{nm} = uint32(0)")
    if ONE:
        for r in RR:
            emit(1, f"acc{r} = float32(0.0)")
    emit(1, f"for s in range(total + {int(PIPE)}):")
    if PIPE:
        emit(2, "if s > 0:")
        for nm in (f"{r}_{v}_{k}" for r in RR for v in UU for k in range(UW)):
            emit(3, f"wc{nm} = wr{nm}")
        emit(2, "if s < total:")
        load(3, "s", "wr")
    else:
        load(2, "s", "wr")
    # the first step's weights are in flight (no earlier kernel writes weights) while the block waits
    # for its PDL predecessor and quantizes x into shared memory
    emit(2, "if s == 0:")
    emit(3, "grid_wait()")
    emit(3, "grid_trigger_early()")
    emit(3, "KC = K >> 2")
    emit(3, "items = T * KC")
    if not ONE:
        emit(3, f"for i in range(tid, T * {R * NT}, {NT}):")
        emit(4, "sm[XA + i] = uint32(0)")
    emit(3, f"for base in range(0, items, {NT * SB}):")
    for bq in range(SB):
        emit(4, f"i{bq} = base + {bq * NT} + tid")
        emit(4, f"ic = min(i{bq}, items - 1)")
        emit(4, f"t{bq} = ic // KC")
        emit(4, f"c{bq} = ic - t{bq} * KC")
        emit(4, f"xv{bq} = ldg_f32x4(x, t{bq}, c{bq} << 2)")
    for bq in range(SB):
        for ln in _STAGE.format(slot="(g & 7) * NSB + (g >> 3)" if KQ else "g", q6="" if Q6 else "#", b=bq).splitlines():
            emit(4, ln)
    emit(3, "cuda.syncthreads()")
    ind = 2
    if PIPE:
        emit(2, "if s > 0:")
        ind = 3
    emit(ind, f"cs = s - {int(PIPE)}")
    emit(ind, "tl = cs // iters")
    emit(ind, "it = cs - tl * iters")
    emit(ind, f"row0 = (bid + tl * nblk) * {RPB} + wrow")
    unit_heads(ind, "wc" if PIPE else "wr")
    products(ind, "wc" if PIPE else "wr")
    emit(ind, "if it == iters - 1:")
    epilogue(ind + 1)
    return "\n".join(L) + "\n"


# x -> int8 groups in shared memory: 8 lanes a group, 4 values a lane (one 16-byte load), the
# group's absmax and sums by xor-shuffles inside the 8 lanes (all lanes take part: the loop is
# block-uniform). Layout (32-bit words): x int8 at ((t 2 + half) G + slot) 4 + word, d8 at
# XD + t G + slot, the group's sum at XS + ..., its first half's sum at XH + ... (Q6_K); the lanes'
# partial sums (float bits) at XA + (t R + r) NT + tid.
_STAGE = """a = max(max(abs(xv{b}[0]), abs(xv{b}[1])), max(abs(xv{b}[2]), abs(xv{b}[3])))
a = max(a, shfl_xor_f32(a, 1))
a = max(a, shfl_xor_f32(a, 2))
a = max(a, shfl_xor_f32(a, 4))
inv = float32(127.0) / a if a > float32(0.0) else float32(0.0)
q0 = rni(xv{b}[0] * inv)
q1 = rni(xv{b}[1] * inv)
q2 = rni(xv{b}[2] * inv)
q3 = rni(xv{b}[3] * inv)
word = ((uint32(q0) & B255) | ((uint32(q1) & B255) << U8) | ((uint32(q2) & B255) << U16)
        | ((uint32(q3) & B255) << U24))
hs = int32(q0 + q1 + q2 + q3)
hs = int32(hs + shfl_xor_i32(hs, 1))
hs = int32(hs + shfl_xor_i32(hs, 2))
tot = int32(hs + shfl_xor_i32(hs, 4))
g = c{b} >> 3
cc = c{b} & 7
slot = {slot}
if i{b} < items:
    sm[((t{b} * 2 + (cc >> 2)) * G + slot) * 4 + (cc & 3)] = word
    if cc == 0:
        sm[XD + t{b} * G + slot] = f32_bits(a / float32(127.0))
        sm[XS + t{b} * G + slot] = uint32(tot)
        {q6}sm[XH + t{b} * G + slot] = uint32(hs)"""

_HEADER = """# generated by kernels_numba.quant_gemv._gemv_source: {name} {cfg}
from kernels_numba.quant_gemv import *  # noqa: F401,F403
from kernels_numba.quant_gemv import _GLOBALS
globals().update(_GLOBALS)

"""


def _make_gemv(*cfg):
    """The kernel function of cfg, from a generated module written under the kernel cache directory
    (a real file, so Numba's on-disk cache can key it: content-addressed, written once)."""
    src = _gemv_source(*cfg)
    text = _HEADER.format(name=NAMES[cfg[0]], cfg=cfg[1:]) + src
    if SIM:
        ns = dict(_GLOBALS)
        exec(compile(src, f"<quant_gemv {NAMES[cfg[0]]} {cfg[1:]}>", "exec"), ns)
        return ns["gemv"]
    return _load_generated(text)


def _load_generated(text: str, func: str = "gemv", prefix: str = "quant_gemv"):
    import hashlib
    import importlib.util
    from kernels_numba.jit import cache_dir
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    folder = cache_dir() / "generated"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{prefix}_{digest}.py"
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(f"_metrale_{prefix}_{digest}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, func)


# ----------------------------------------------------------------------------- kernel cache
_PY: dict = {}
_KERNELS: dict = {}


def py_kernel(*cfg):
    """The undecorated kernel of (qtype, one (T = 1), warps, rows, split, unroll, pipe, has_bias,
    has_res), with the current STREAM_HINT."""
    key = cfg + (STREAM_HINT["on"],)
    if key not in _PY:
        _PY[key] = _make_gemv(*cfg)
    return _PY[key]


def launch_bounds(qtype: int, one: bool, warps: int) -> tuple[int, int]:
    """(threads, blocks a multiprocessor) ptxas is held to: 4 blocks of 128 threads (<= 128
    registers; without the bound it takes 130-144 at T = 1) except Q6_K and the T > 1 kernels, 3
    (<= 168: at 128, Q6_K spills 96 bytes); fewer with 8 warps."""
    blocks = 4 if one and qtype != Q6_K else 3
    return 32 * warps, max(1, blocks * 4 // warps)


def kernel(*cfg):
    """The launchable kernel of py_kernel's cfg (on the GPU: on-disk cached, kernels_numba.jit)."""
    key = cfg + (STREAM_HINT["on"],)
    k = _KERNELS.get(key)
    if k is None:
        if SIM:
            k = cuda.jit(py_kernel(*cfg))
        else:
            from kernels_numba.jit import kernel as cached_kernel
            k = cached_kernel(py_kernel(*cfg), launch_bounds=launch_bounds(cfg[0], cfg[1], cfg[2]))
        _KERNELS[key] = k
    return k


# ----------------------------------------------------------------------------- configuration
def smem_bytes(qtype: int, T: int, K: int, warps: int = 4, rows: int = 1) -> int:
    """Dynamic shared memory of a launch: x as int8 + d8 + sums (+ half sums for Q6_K) + the lanes'
    partial sums for T > 1 (T rows x rows x threads)."""
    return 4 * (T * (K // 4) + T * (K // 32) * (3 if qtype == Q6_K else 2) + (T * rows * 32 * warps if T > 1 else 0))


_LIMIT: list = []


def smem_limit() -> int:
    """Dynamic shared memory a launch may take: the device's opt-in maximum (227 KB on sm_90; the
    launcher raises the kernel's attribute, `_allow_smem`), 48 KB in the simulator or if raising
    it failed once."""
    if not _LIMIT:
        lim = SMEM_LIMIT
        if not SIM:
            try:
                lim = int(cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            except Exception:       # pragma: no cover - older drivers / attribute names
                pass
        _LIMIT.append(lim)
    return _LIMIT[0]


def max_rows(qtype: int, K: int) -> int:
    """Largest T one launch takes (<= MAX_T, the staged x within smem_limit())."""
    t = MAX_T
    while t > 1 and smem_bytes(qtype, t, K, *_cfg_smem(qtype, K, t)) > smem_limit():
        t -= 1
    return t


def _cfg_smem(qtype, K, T):
    c = gemv_cfg(qtype, 0, K, T)
    return c[0], c[1]


def _lanes(nun: int, unrolls) -> tuple[int, int]:
    """(split, unroll) whose steps (32 / split lanes x unroll units) cover a row's nun units with the
    fewest idle lanes; ties: the fewest lane groups, then the unroll nearest 4."""
    best = None
    for split in (1, 2, 4):
        lg = 32 // split
        for u in unrolls:
            idle = -(-nun // (lg * u)) * lg * u - nun
            key = (idle, split, abs(u - 4))
            if best is None or key < best[0]:
                best = (key, split, u)
    return best[1], best[2]


def gemv_cfg(qtype: int, N: int, K: int, T: int = 1) -> tuple[int, int, int, int, bool]:
    """(warps, rows, split, unroll, pipe). A lane takes units: a group (legacy types, up to 4 a
    step; Q8_0: 2, each two 16-byte loads) or half a K-quant super-block (one a step: four 16-byte
    loads of codes and the super-block's 16-byte header, which the two lanes of the super-block share
    through L1). split and unroll leave the fewest lanes idle (K = 4096: a whole warp a row, one
    step; 14336: 16 lanes a K-quant row, 7 steps); the next step's loads are in flight while a step
    computes (pipe) for T <= 2 and where x fills shared memory. One row a lane group. 8 warps a block
    where x of T rows leaves room for 1-2 blocks only (T = 8 at K = 14336) and for K >= 8192 (the x
    staging, 4 loads a thread a round trip to L2, then takes half as many round trips). To be tuned
    on the device (bench/quant_kernels.py --sweep)."""
    big = smem_bytes(qtype, T, K, 8, 1) > BIG_SMEM
    # K >= 8192: 8 warps share the x staging (its L2 round trips); not Q6_K (150 registers: one block
    # of 8 warps a multiprocessor, against three of 4)
    warps = 8 if big or (K >= 8192 and qtype != Q6_K) else 4
    if qtype in KQUANTS:
        split, unroll = _lanes(2 * (K // 256), (1,))
    else:
        split, unroll = _lanes(K // 32, (1, 2) if qtype == Q8_0 else (1, 2, 3, 4))
    return warps, 1, split, unroll, T <= 2 or big


PERSIST = 4          # blocks a multiprocessor: the grid is min(row tiles, PERSIST x SMs)
_SMS: list = []


def sm_count() -> int:
    if not _SMS:
        _SMS.append(1 if SIM else int(cuda.get_current_device().MULTIPROCESSOR_COUNT))
    return _SMS[0]


def gemv_path(qtype: int, N: int, K: int, T: int, *, warps=None, rows=None, split=None, unroll=None,
              pipe=None, persist=None):
    """(cfg, grid, block): gemv_cfg with overrides; a persistent grid of at most persist x SMs
    blocks, each staging x once and walking row tiles bid, bid + grid, ... (the next tile's first
    loads in flight while the current one finishes)."""
    d = gemv_cfg(qtype, N, K, T)
    cfg = (d[0] if warps is None else warps, d[1] if rows is None else rows,
           d[2] if split is None else split, d[3] if unroll is None else unroll,
           d[4] if pipe is None else bool(pipe))
    tiles = -(-N // (cfg[0] * cfg[1] * cfg[2]))
    return cfg, min(tiles, (PERSIST if persist is None else persist) * sm_count()), 32 * cfg[0]


def gemv(x, planes: dict, out, T: int, *, qtype: int, n_off: int = 0, bias=None, residual=None,
         stream=0, path=None) -> None:
    """out[:T, n_off:n_off+N] = x[:T] @ w.T (+ bias[n_off:]) (+ residual[:T, n_off:]) for one part
    w (its device planes: 'qs', 'qh', 'sc', 'dm'; absent planes any small uint8 2-D array).
    Device arrays in, nothing allocated (graph-capture safe)."""
    qs = planes["qs"]
    N = qs.shape[0]
    K = x.shape[1]
    assert 1 <= T <= MAX_T and x.shape[0] >= T and out.shape[0] >= T, f"quant gemv: T={T} rows"
    assert K % (256 if qtype in KQUANTS else 32) == 0, f"{NAMES[qtype]}: K={K}"
    assert x.dtype == np.float32 and out.dtype == np.float32, "x, out float32"
    assert n_off + N <= out.shape[1], f"quant gemv: columns {n_off}+{N} past out {tuple(out.shape)}"
    cfg, grid, block = path or gemv_path(qtype, N, K, T)
    nbytes = smem_bytes(qtype, T, K, cfg[0], cfg[1])
    assert nbytes <= smem_limit(), f"quant gemv: {T} rows of K={K} need {nbytes} bytes of shared memory"
    k = kernel(qtype, T == 1, *cfg, bias is not None, residual is not None)
    args = (x, qs, planes["qh"], planes["sc"], planes["dm"], out, out if bias is None else bias,
            out if residual is None else residual, n_off, T)
    if nbytes > SMEM_LIMIT and not _allow_smem(k, args):
        step = max_rows(qtype, K)                        # the opt-in failed: launches of fewer rows
        for t0 in range(0, T, step):
            t = min(step, T - t0)
            gemv(x[t0:t0 + t], planes, out[t0:t0 + t], t, qtype=qtype, n_off=n_off, bias=bias,
                 residual=None if residual is None else residual[t0:t0 + t], stream=stream)
        return
    k[grid, block, stream, nbytes](*args)


_OPTIN: dict = {}


def _allow_smem(k, args) -> bool:
    """Raise the compiled kernel's dynamic shared memory limit to smem_limit() (once a kernel and
    device); False (and the limit back to 48 KB for every later launch) if the driver refuses."""
    try:
        kern = k._compile_for_args(*args)
        key = (id(kern), cuda.get_current_device().id)
        if key not in _OPTIN:
            from numba.cuda.cudadrv.driver import binding, driver
            fn = kern._codelibrary.get_cufunc()
            attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            driver.cuKernelSetAttribute(attr, smem_limit(), fn.handle, fn.device.id)
            _OPTIN[key] = kern
        return True
    except Exception as e:       # pragma: no cover - depends on the driver
        import warnings
        warnings.warn(f"quant gemv: dynamic shared memory above 48 KB refused ({e}); launching fewer rows")
        _LIMIT[:] = [SMEM_LIMIT]
        return False
