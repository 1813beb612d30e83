"""CPU products with weights kept in a GGUF file's block layout (Numba @njit, parallel over rows).

y[T, R] = x[T, K] @ W[R, K].T where W's rows are the file's raw blocks: Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0 (32 columns a block), Q4_K, Q5_K, Q6_K (256 a block), and dense f32 / f16 / bf16 rows
(handled as 16-column "blocks"). Two roads, both decoding each block in registers (LLVM IR written
here as Numba intrinsics) and taking up to 8 activation rows a pass, so a block is decoded once for
8 tokens:
  matmul_into     float32 activations: blocks decoded to <16 x float>, FMAs into per-token vector
                  accumulators (`_DECODERS`, `row_dot`); every kind; the reference's arithmetic up
                  to summation order.
  matmul_q8_into  llama.cpp's: activations quantized to int8 a 32-block, weights decoded to bytes,
                  two blocks a 512-bit vpdpbusd (AVX-512 VNNI; on AVX2 pmaddubsw + pmaddwd) integer dot
                  product (`row_dot_q8`, `dpbusd`);
                  block kinds only; faster, less exact (levers.cpu_activations; docs/cpu.md).
Both prefetch each weight row's stream PREFETCH_BYTES ahead.
A token's result does not depend on the rows beside it (the same accumulation order at every width).

How the block type reaches the kernel: `as_blocks(data, kind)` views a part's uint8 rows as a
read-only array of one-field records whose field is named after the type ("q4_1", ...), so one
generic kernel specializes per type through Numba's dispatch on the array's dtype, and the decoder
is chosen when the intrinsic is typed. Kernels are cached on disk (cpu_cache.py).

References: `dequantize_ref` (the gguf package, an independent implementation), `matmul_ref` (its
dequantization @ x) and `matmul_q8_ref` (the same against x quantized as quantize_q8 does);
tests/test_cpu_quant.py checks every type against them.
Contracts: x float32 C-contiguous [T, K], K = W's columns; y float32 C-contiguous [T, R].
"""
from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels_numba.cpu_cache import CACHE

# name -> (columns a block, bytes a block). The GGUF block types first, then dense rows.
KINDS = {
    "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
    "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
    "f32": (16, 64), "f16": (16, 32), "bf16": (16, 32),
}
_DTYPES = {k: np.dtype([(k, np.uint8, (nbytes,))]) for k, (_, nbytes) in KINDS.items()}
MAX_TOKENS = 8                      # activation rows one pass over the weights multiplies
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}   # no no-NaN / no-Inf assumptions
PREFETCH_BYTES = 2048     # the dot products prefetch a row's stream this far ahead (a few rows on),
                          # so cold weights arrive before they are needed (docs/cpu.md)


def block_dtype(kind: str) -> np.dtype:
    return _DTYPES[kind]


def as_blocks(data: np.ndarray, kind: str) -> np.ndarray:
    """uint8 [R, bytes a row] (a dense matrix: its own dtype [R, K]) -> records [R, blocks a row]."""
    if kind in ("f32", "f16", "bf16") and data.dtype != np.uint8:
        data = np.ascontiguousarray(data).view(np.uint8).reshape(data.shape[0], -1)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] % KINDS[kind][1]:
        raise ValueError(f"{kind}: rows of {KINDS[kind][1]}-byte blocks expected, got {data.dtype} {data.shape}")
    if data.strides[1] != 1:
        raise ValueError(f"{kind}: each row's bytes must be contiguous")
    blocks = data.view(_DTYPES[kind])
    blocks.flags.writeable = False          # one kernel signature whatever the source (a file's map is read-only)
    return blocks


def kind_of(dtype) -> str:
    """The block kind of a records dtype made by as_blocks (NumPy or Numba)."""
    names = list(dtype.fields)
    if len(names) != 1 or names[0] not in KINDS:
        raise TypeError(f"not a block array: {dtype}")
    return names[0]


# ------------------------------------------------------------------------------------- LLVM IR

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()
W = 16                                            # lanes of every vector here
VI8, VI16, VI32, VF = (ir.VectorType(t, W) for t in (I8, I16, I32, F32))


def _cvec(ty, values):
    return ir.Constant(ir.VectorType(ty, len(values)), [ir.Constant(ty, v) for v in values])


class _IR:
    """Small helpers over an IRBuilder: loads at byte offsets of an i64 address, splats, fp16."""

    def __init__(self, builder: ir.IRBuilder):
        self.b = builder

    def at(self, addr, off: int, ty):
        a = self.b.add(addr, ir.Constant(I64, off)) if off else addr
        return self.b.inttoptr(a, ty.as_pointer())

    def load(self, addr, off: int, ty, align: int = 1):
        return self.b.load(self.at(addr, off, ty), align=align)

    def prefetch(self, addr, off: int = PREFETCH_BYTES, locality: int = 3):
        """A read prefetch of the line at addr + off (never faults): locality 3 into L1 (prefetcht0),
        2 into L2 (prefetcht1)."""
        mod, name = self.b.module, "llvm.prefetch.p0i8"
        fn = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]), name)
        self.b.call(fn, [self.at(addr, off, I8), ir.Constant(I32, 0), ir.Constant(I32, locality), ir.Constant(I32, 1)])

    def u8(self, addr, off: int):
        return self.b.zext(self.load(addr, off, I8), I32)

    def f16(self, addr, off: int):
        return self.b.fpext(self.b.bitcast(self.load(addr, off, I16), ir.HalfType()), F32)

    def splat(self, scalar, ty=VF):
        v = self.b.insert_element(ir.Constant(ty, ir.Undefined), scalar, ir.Constant(I32, 0))
        return self.b.shuffle_vector(v, ir.Constant(ty, ir.Undefined), ir.Constant(ir.VectorType(I32, ty.count), [0] * ty.count))

    def bytes16(self, addr, off: int, signed: bool = False):
        v = self.load(addr, off, VI8)
        return self.b.sext(v, VI32) if signed else self.b.zext(v, VI32)

    def ivec(self, value: int):
        return _cvec(I32, [value] * W)

    def fma(self, a, b, c):
        mod, name = self.b.module, f"llvm.fma.v{W}f32"
        fn = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(VF, [VF, VF, VF]), name)
        return self.b.call(fn, [a, b, c])

    def tofloat(self, v):
        return self.b.sitofp(v, VF)

    def scaled(self, q, d, m=None):
        """float(q) * d (+ m), q <16 x i32>; d, m float scalars."""
        f = self.tofloat(q)
        if m is None:
            return self.b.fmul(f, self.splat(d))
        return self.fma(f, self.splat(d), self.splat(m))


# Each decoder: (ir helper, i64 address of one block) -> [(first column in the block, <16 x float>)].

def _dec_q4_0(e: _IR, a):
    d, q = e.f16(a, 0), e.bytes16(a, 2)
    lo = e.b.sub(e.b.and_(q, e.ivec(15)), e.ivec(8))
    hi = e.b.sub(e.b.lshr(q, e.ivec(4)), e.ivec(8))
    return [(0, e.scaled(lo, d)), (16, e.scaled(hi, d))]


def _dec_q4_1(e: _IR, a):
    d, m, q = e.f16(a, 0), e.f16(a, 2), e.bytes16(a, 4)
    return [(0, e.scaled(e.b.and_(q, e.ivec(15)), d, m)), (16, e.scaled(e.b.lshr(q, e.ivec(4)), d, m))]


def _q5_high(e: _IR, a, off: int):
    """The fifth bits of a 32-column block as <16 x i32> lo / hi, each 0 or 16."""
    qh = e.splat(e.load(a, off, I32), VI32)
    lo = e.b.shl(e.b.and_(e.b.lshr(qh, _cvec(I32, range(16))), e.ivec(1)), e.ivec(4))
    hi = e.b.shl(e.b.and_(e.b.lshr(qh, _cvec(I32, range(16, 32))), e.ivec(1)), e.ivec(4))
    return lo, hi


def _dec_q5_0(e: _IR, a):
    d, q = e.f16(a, 0), e.bytes16(a, 6)
    hlo, hhi = _q5_high(e, a, 2)
    lo = e.b.sub(e.b.or_(e.b.and_(q, e.ivec(15)), hlo), e.ivec(16))
    hi = e.b.sub(e.b.or_(e.b.lshr(q, e.ivec(4)), hhi), e.ivec(16))
    return [(0, e.scaled(lo, d)), (16, e.scaled(hi, d))]


def _dec_q5_1(e: _IR, a):
    d, m, q = e.f16(a, 0), e.f16(a, 2), e.bytes16(a, 8)
    hlo, hhi = _q5_high(e, a, 4)
    lo = e.b.or_(e.b.and_(q, e.ivec(15)), hlo)
    hi = e.b.or_(e.b.lshr(q, e.ivec(4)), hhi)
    return [(0, e.scaled(lo, d, m)), (16, e.scaled(hi, d, m))]


def _dec_q8_0(e: _IR, a):
    d = e.f16(a, 0)
    return [(0, e.scaled(e.bytes16(a, 2, signed=True), d)), (16, e.scaled(e.bytes16(a, 18, signed=True), d))]


def _k4_scale_min(e: _IR, a, s: int):
    """6-bit scale and min of sub-block s of a Q4_K / Q5_K block (their 12 scale bytes at a + 4)."""
    b = lambda i: e.u8(a, 4 + i)  # noqa: E731
    if s < 4:
        return e.b.and_(b(s), ir.Constant(I32, 63)), e.b.and_(b(s + 4), ir.Constant(I32, 63))
    sc = e.b.or_(e.b.and_(b(s + 4), ir.Constant(I32, 15)), e.b.shl(e.b.lshr(b(s - 4), ir.Constant(I32, 6)), ir.Constant(I32, 4)))
    mn = e.b.or_(e.b.lshr(b(s + 4), ir.Constant(I32, 4)), e.b.shl(e.b.lshr(b(s), ir.Constant(I32, 6)), ir.Constant(I32, 4)))
    return sc, mn


def _dec_k(e: _IR, a, five: bool):
    d, dmin = e.f16(a, 0), e.f16(a, 2)
    qs = 48 if five else 16
    out = []
    for s in range(8):
        sc, mn = _k4_scale_min(e, a, s)
        d1 = e.b.fmul(d, e.b.uitofp(sc, F32))
        m1 = e.b.fneg(e.b.fmul(dmin, e.b.uitofp(mn, F32)))
        for half in (0, 16):
            q = e.bytes16(a, qs + 32 * (s // 2) + half)
            q = e.b.lshr(q, e.ivec(4)) if s % 2 else e.b.and_(q, e.ivec(15))
            if five:
                h = e.b.and_(e.b.lshr(e.bytes16(a, 16 + half), e.ivec(s)), e.ivec(1))
                q = e.b.or_(q, e.b.shl(h, e.ivec(4)))
            out.append((32 * s + half, e.scaled(q, d1, m1)))
    return out


def _dec_q6_k(e: _IR, a):
    d = e.f16(a, 208)
    out = []
    for sb in range(8):
        h, k = divmod(sb, 4)
        for half in (0, 16):
            ql = e.bytes16(a, 64 * h + 32 * (k & 1) + half)
            ql = e.b.lshr(ql, e.ivec(4)) if k >= 2 else e.b.and_(ql, e.ivec(15))
            qh = e.b.and_(e.b.lshr(e.bytes16(a, 128 + 32 * h + half), e.ivec(2 * k)), e.ivec(3))
            q = e.b.sub(e.b.or_(ql, e.b.shl(qh, e.ivec(4))), e.ivec(32))
            sc = e.b.sitofp(e.b.sext(e.load(a, 192 + 2 * sb + half // 16, I8), I32), F32)
            out.append((32 * sb + half, e.scaled(q, e.b.fmul(d, sc))))
    return out


def _dec_f32(e: _IR, a):
    return [(0, e.load(a, 0, VF, align=4))]


def _dec_f16(e: _IR, a):
    return [(0, e.b.fpext(e.b.bitcast(e.load(a, 0, VI16, align=2), ir.VectorType(ir.HalfType(), W)), VF))]


def _dec_bf16(e: _IR, a):
    bits = e.b.shl(e.b.zext(e.load(a, 0, VI16, align=2), VI32), e.ivec(16))
    return [(0, e.b.bitcast(bits, VF))]


_DECODERS = {
    "q4_0": _dec_q4_0, "q4_1": _dec_q4_1, "q5_0": _dec_q5_0, "q5_1": _dec_q5_1, "q8_0": _dec_q8_0,
    "q4_k": lambda e, a: _dec_k(e, a, five=False), "q5_k": lambda e, a: _dec_k(e, a, five=True),
    "q6_k": _dec_q6_k, "f32": _dec_f32, "f16": _dec_f16, "bf16": _dec_bf16,
}


def _hsum(b: ir.IRBuilder, v, n: int = W):
    while n > 1:
        n //= 2
        lo = b.shuffle_vector(v, v, _cvec(I32, range(n)))
        hi = b.shuffle_vector(v, v, _cvec(I32, range(n, 2 * n)))
        v = b.fadd(lo, hi)
    return b.extract_element(v, ir.Constant(I32, 0))


def _row_base(context, builder, arrty, arr, row):
    a = context.make_array(arrty)(context, builder, arr)
    base = builder.ptrtoint(a.data, I64)
    stride = builder.extract_value(a.strides, 0)
    nblocks = builder.extract_value(a.shape, 1)
    return builder.add(base, builder.mul(row, stride)), nblocks


def _block_array_kind(w) -> str | None:
    if not isinstance(w, types.Array) or w.ndim != 2 or not isinstance(w.dtype, types.Record):
        return None
    names = list(w.dtype.fields)
    return names[0] if len(names) == 1 and names[0] in KINDS else None


@intrinsic
def row_dot(typingctx, w, row, x_addr, x_stride, ntok):
    """(x[t] . W[row] for t < ntok) as a tuple of float32: W a block array (as_blocks), x_addr the
    address of x[0, 0] (float32, rows x_stride bytes apart), ntok a literal 1..MAX_TOKENS."""
    kind = _block_array_kind(w)
    if kind is None or not isinstance(ntok, types.IntegerLiteral):
        return None
    n = ntok.literal_value
    cols, nbytes = KINDS[kind]
    decode = _DECODERS[kind]
    sig = types.UniTuple(types.float32, n)(w, row, x_addr, x_stride, ntok)

    def codegen(context, builder, signature, args):
        e = _IR(builder)
        rowp, nblocks = _row_base(context, builder, w, args[0], args[1])
        x0, xs = args[2], args[3]
        xrows = [builder.add(x0, builder.mul(xs, ir.Constant(I64, t))) for t in range(n)]
        per_block = cols // W
        # two FMA chains a token, taking a block's vectors in turn (dense rows: two blocks a step);
        # the same for every ntok, so a token's result does not depend on the rows beside it
        unroll = 2 if per_block == 1 else 1
        chains = 2
        zero = ir.Constant(VF, [ir.Constant(F32, 0.0)] * W)
        accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(chains)] for _ in range(n)]

        def blocks(b0, count):
            k = 0
            for u in range(count):
                b = builder.add(b0, ir.Constant(I64, u))
                addr = builder.add(rowp, builder.mul(b, ir.Constant(I64, nbytes)))
                col0 = builder.mul(b, ir.Constant(I64, cols * 4))
                e.prefetch(addr)
                for off, wv in decode(e, addr):
                    for t in range(n):
                        xa = builder.add(builder.add(xrows[t], col0), ir.Constant(I64, off * 4))
                        xv = builder.load(builder.inttoptr(xa, VF.as_pointer()), align=4)
                        acc = accs[t][k % chains]
                        builder.store(e.fma(wv, xv, builder.load(acc)), acc)
                    k += 1

        steps = builder.udiv(nblocks, ir.Constant(I64, unroll))
        with cgutils.for_range(builder, steps) as loop:
            blocks(builder.mul(loop.index, ir.Constant(I64, unroll)), unroll)
        if unroll > 1:
            last = builder.sub(nblocks, ir.Constant(I64, 1))
            odd = builder.icmp_unsigned("!=", builder.urem(nblocks, ir.Constant(I64, unroll)), ir.Constant(I64, 0))
            with builder.if_then(odd):
                blocks(last, 1)
        sums = []
        for t in range(n):
            v = builder.load(accs[t][0])
            for acc in accs[t][1:]:
                v = builder.fadd(v, builder.load(acc))
            sums.append(_hsum(builder, v))
        return context.make_tuple(builder, signature.return_type, sums)

    return sig, codegen


@intrinsic
def rows4_dot(typingctx, w, row, x_addr):
    """(x . W[row + i] for i < 4) as a tuple of float32, one activation row: the decode shape. Four
    rows a pass share each x load and give the core four independent weight streams; each row's
    accumulation is row_dot's (two chains, blocks in order), so results equal row_dot's."""
    kind = _block_array_kind(w)
    if kind is None:
        return None
    cols, nbytes = KINDS[kind]
    decode = _DECODERS[kind]
    sig = types.UniTuple(types.float32, 4)(w, row, x_addr)

    def codegen(context, builder, signature, args):
        e = _IR(builder)
        a = context.make_array(w)(context, builder, args[0])
        base, stride = builder.ptrtoint(a.data, I64), builder.extract_value(a.strides, 0)
        nblocks = builder.extract_value(a.shape, 1)
        rowps = [builder.add(base, builder.mul(builder.add(args[1], ir.Constant(I64, i)), stride)) for i in range(4)]
        per_block = cols // W
        unroll = 2 if per_block == 1 else 1
        zero = ir.Constant(VF, [ir.Constant(F32, 0.0)] * W)
        accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(2)] for _ in range(4)]

        def blocks(b0, count):
            k = 0
            for u in range(count):
                b = builder.add(b0, ir.Constant(I64, u))
                col0 = builder.mul(b, ir.Constant(I64, cols * 4))
                addrs = [builder.add(rp, builder.mul(b, ir.Constant(I64, nbytes))) for rp in rowps]
                for a in addrs:
                    e.prefetch(a)
                decoded = [decode(e, a) for a in addrs]
                for j, (off, _) in enumerate(decoded[0]):
                    xa = builder.add(builder.add(args[2], col0), ir.Constant(I64, off * 4))
                    xv = builder.load(builder.inttoptr(xa, VF.as_pointer()), align=4)
                    for i in range(4):
                        acc = accs[i][k % 2]
                        builder.store(e.fma(decoded[i][j][1], xv, builder.load(acc)), acc)
                    k += 1

        steps = builder.udiv(nblocks, ir.Constant(I64, unroll))
        with cgutils.for_range(builder, steps) as loop:
            blocks(builder.mul(loop.index, ir.Constant(I64, unroll)), unroll)
        if unroll > 1:
            odd = builder.icmp_unsigned("!=", builder.urem(nblocks, ir.Constant(I64, unroll)), ir.Constant(I64, 0))
            with builder.if_then(odd):
                blocks(builder.sub(nblocks, ir.Constant(I64, 1)), 1)
        sums = [_hsum(builder, builder.fadd(builder.load(accs[i][0]), builder.load(accs[i][1]))) for i in range(4)]
        return context.make_tuple(builder, signature.return_type, sums)

    return sig, codegen


@intrinsic
def row_decode(typingctx, w, row, out_addr):
    """Writes W[row] as float32 at out_addr (the row's columns, contiguous)."""
    kind = _block_array_kind(w)
    if kind is None:
        return None
    cols, nbytes = KINDS[kind]
    decode = _DECODERS[kind]
    sig = types.void(w, row, out_addr)

    def codegen(context, builder, signature, args):
        e = _IR(builder)
        rowp, nblocks = _row_base(context, builder, w, args[0], args[1])
        with cgutils.for_range(builder, nblocks) as loop:
            b = loop.index
            addr = builder.add(rowp, builder.mul(b, ir.Constant(I64, nbytes)))
            col0 = builder.add(args[2], builder.mul(b, ir.Constant(I64, cols * 4)))
            for off, wv in decode(e, addr):
                p = builder.inttoptr(builder.add(col0, ir.Constant(I64, off * 4)), VF.as_pointer())
                builder.store(wv, p, align=4)
        return context.get_dummy_value()

    return sig, codegen


# ------------------------------------------------------ 8-bit activations, integer dot products

# The llama.cpp road: activations quantized to int8 a 32-column block (scale dx = max|x| / 127), a
# block's weights decoded in registers to unsigned bytes u with w = a * u + c, and the block's
# product  sum(w * x) = a * dx * sum(u * xq) + c * dx * sum(xq)  taken by vpdpbusd (AVX-512 VNNI:
# 64 byte products an instruction; unsigned weights times signed activations). Q6_K's two scales a
# block are a per-half scale vector; its and Q4_0 / Q5_0 / Q8_0's zero points are the c term.
Q8_KINDS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")
VI8_32, VI32_8, VF8 = ir.VectorType(I8, 32), ir.VectorType(I32, 8), ir.VectorType(F32, 8)


def _bvec(value: int):
    return _cvec(I8, [value] * 32)


def _join16(e: _IR, lo, hi):
    return e.b.shuffle_vector(lo, hi, _cvec(I32, range(32)))


# Each u8 decoder: (ir helper, block address) -> [(first column, <32 x i8> u, (a_lo, a_hi), (c_lo, c_hi))]
# for every 32 columns of the block: w = a * u + c, with a and c per 16-column half; c is None where
# there is no offset (Q8_0's signed bytes on AVX2), and the kernels then skip its term.

def _u8_legacy(e: _IR, a, kind: str):
    d = e.f16(a, 0)
    m = e.f16(a, 2) if kind in ("q4_1", "q5_1") else None
    if kind == "q8_0":
        u = e.load(a, 2, VI8_32)
        if q8_0_signed():
            return [(0, u, (d, d), (None, None))]
        c = e.b.fmul(d, ir.Constant(F32, -128.0))                   # w = d * (u - 128), u unsigned
        return [(0, e.b.xor(u, _bvec(0x80)), (d, d), (c, c))]
    off = {"q4_0": 2, "q4_1": 4, "q5_0": 6, "q5_1": 8}[kind]
    q = e.load(a, off, VI8)
    u = _join16(e, e.b.and_(q, _cvec(I8, [15] * 16)), e.b.lshr(q, _cvec(I8, [4] * 16)))
    if kind in ("q5_0", "q5_1"):
        qh = e.b.insert_element(ir.Constant(ir.VectorType(I32, 32), ir.Undefined), e.load(a, off - 4, I32), ir.Constant(I32, 0))
        qh = e.b.shuffle_vector(qh, ir.Constant(ir.VectorType(I32, 32), ir.Undefined), _cvec(I32, [0] * 32))
        bits = e.b.and_(e.b.lshr(qh, _cvec(I32, range(32))), _cvec(I32, [1] * 32))
        u = e.b.or_(u, e.b.shl(e.b.trunc(bits, VI8_32), _bvec(4)))
    if m is None:
        c = e.b.fmul(d, ir.Constant(F32, -8.0 if kind == "q4_0" else -16.0))
        return [(0, u, (d, d), (c, c))]
    return [(0, u, (d, d), (m, m))]


def _u8_k(e: _IR, a, five: bool):
    d, dmin = e.f16(a, 0), e.f16(a, 2)
    qs = 48 if five else 16
    out = []
    for s in range(8):
        sc, mn = _k4_scale_min(e, a, s)
        d1 = e.b.fmul(d, e.b.uitofp(sc, F32))
        m1 = e.b.fneg(e.b.fmul(dmin, e.b.uitofp(mn, F32)))
        q = e.load(a, qs + 32 * (s // 2), VI8_32)
        u = e.b.lshr(q, _bvec(4)) if s % 2 else e.b.and_(q, _bvec(15))
        if five:
            h = e.b.and_(e.b.lshr(e.load(a, 16, VI8_32), _bvec(s)), _bvec(1))
            u = e.b.or_(u, e.b.shl(h, _bvec(4)))
        out.append((32 * s, u, (d1, d1), (m1, m1)))
    return out


def _u8_q6_k(e: _IR, a):
    d = e.f16(a, 208)
    out = []
    for sb in range(8):
        h, k = divmod(sb, 4)
        ql = e.load(a, 64 * h + 32 * (k & 1), VI8_32)
        ql = e.b.lshr(ql, _bvec(4)) if k >= 2 else e.b.and_(ql, _bvec(15))
        qh = e.b.and_(e.b.lshr(e.load(a, 128 + 32 * h, VI8_32), _bvec(2 * k)), _bvec(3))
        u = e.b.or_(ql, e.b.shl(qh, _bvec(4)))                      # w = d * sc * (u - 32)
        sc = [e.b.fmul(d, e.b.sitofp(e.b.sext(e.load(a, 192 + 2 * sb + i, I8), I32), F32)) for i in (0, 1)]
        cs = [e.b.fmul(x, ir.Constant(F32, -32.0)) for x in sc]
        out.append((32 * sb, u, tuple(sc), tuple(cs)))
    return out


_U8_DECODERS = {k: (lambda e, a, k=k: _u8_legacy(e, a, k)) for k in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")}
_U8_DECODERS.update({"q4_k": lambda e, a: _u8_k(e, a, False), "q5_k": lambda e, a: _u8_k(e, a, True),
                     "q6_k": _u8_q6_k})


VI8_64, VI32_16 = ir.VectorType(I8, 64), ir.VectorType(I32, 16)
Q8_LANES = 32             # floats a pair of 32-column units keeps per token in quantize_q8's xs
# Within a pair of 32-column units A, B (64 columns), the order of quantize_q8's int8 and of the
# pair decoders' weight bytes: A's first 16, B's first 16, A's last 16, B's last 16 (the nibble
# split of two legacy 4-bit blocks gives it without a shuffle). vpdpbusd lane groups of 4 then
# hold A lo, B lo, A hi, B hi.
_PAIR_ORDER = list(range(16)) + list(range(32, 48)) + list(range(16, 32)) + list(range(48, 64))
_GROUPS = (0, 1, 0, 1)    # lane group -> unit (A 0, B 1)


def _lanes(e: _IR, values):
    """<len(values) * 4 x float>: each scalar of `values` repeated 4 times (one per i32 lane group)."""
    vec = ir.VectorType(F32, len(values))
    v = ir.Constant(vec, ir.Undefined)
    for i, x in enumerate(values):
        v = e.b.insert_element(v, x, ir.Constant(I32, i))
    return e.b.shuffle_vector(v, ir.Constant(vec, ir.Undefined), _cvec(I32, [i // 4 for i in range(4 * len(values))]))


def _intrinsic_fn(mod, name: str, ret, args):
    return mod.globals.get(name) or ir.Function(mod, ir.FunctionType(ret, args), name)


@functools.lru_cache(maxsize=None)
def int8_dot() -> str | None:
    """How this CPU takes the q8 road's u8 x s8 dot products: "vnni" (AVX-512 VNNI's vpdpbusd),
    "avx2" (vpmaddubsw + vpmaddwd, llama.cpp's AVX2 road) or None (the road is unavailable)."""
    from llvmlite import binding
    f = binding.get_host_cpu_features()
    if f.get("avx512vnni") and f.get("avx512vl"):
        return "vnni"
    return "avx2" if f.get("avx2") else None


def q8_0_signed() -> bool:
    """Whether the q8 kernels take Q8_0's bytes as they are (signed; AVX2) rather than offset by 128
    to unsigned ones (vpdpbusd's u8 operand; the -128 returns through the block's c term)."""
    return int8_dot() == "avx2"


def dpbusd(builder, acc, u, x, signed: bool = False):
    """acc + vpdpbusd(u, x) on <16 x i32> or <8 x i32> operands: each i32 lane adds the four
    products of its bytes of u (unsigned) and x (signed). Without VNNI, AVX2's pmaddubsw (pairs to
    saturating i16) and pmaddwd (pairs to i32) give the same sums: no pair passes i16 for u < 128
    (every decoder but Q8_0's) and x in [-127, 127]. `signed` (AVX2 only): u holds signed bytes,
    taken as |u| times x with u's sign (llama.cpp's AVX2 road), pairs at most 2 * 128 * 127."""
    lanes = u.type.count
    mod = builder.module
    if int8_dot() == "vnni":
        assert not signed, "vpdpbusd takes unsigned weight bytes"
        return builder.call(_intrinsic_fn(mod, f"llvm.x86.avx512.vpdpbusd.{32 * lanes}", u.type, [u.type] * 3),
                            [acc, u, x])
    v8, v16, v32 = ir.VectorType(I8, 32), ir.VectorType(I16, 16), ir.VectorType(I32, 8)
    maddubs = _intrinsic_fn(mod, "llvm.x86.avx2.pmadd.ub.sw", v16, [v8, v8])
    maddwd = _intrinsic_fn(mod, "llvm.x86.avx2.pmadd.wd", v32, [v16, v16])
    sign = _intrinsic_fn(mod, "llvm.x86.avx2.psign.b", v8, [v8, v8])
    absb = _intrinsic_fn(mod, "llvm.abs.v32i8", v8, [v8, ir.IntType(1)])
    ub, xb = builder.bitcast(u, ir.VectorType(I8, 4 * lanes)), builder.bitcast(x, ir.VectorType(I8, 4 * lanes))
    ones = _cvec(I16, [1] * 16)
    halves = []
    for h in range(lanes // 8):
        pick = _cvec(I32, range(32 * h, 32 * h + 32))
        uh, xh = builder.shuffle_vector(ub, ub, pick), builder.shuffle_vector(xb, xb, pick)
        if signed:
            uh, xh = builder.call(absb, [uh, ir.Constant(ir.IntType(1), 0)]), builder.call(sign, [xh, uh])
        halves.append(builder.call(maddwd, [builder.call(maddubs, [uh, xh]), ones]))
    s = halves[0] if lanes == 8 else builder.shuffle_vector(halves[0], halves[1], _cvec(I32, range(16)))
    return builder.add(acc, s)


def _pair_of_units(e: _IR, ua, ub):
    """Two u8-decoder units -> (<64 x i8> in pair order, <16 x float> lane scales, lane offsets)."""
    u = e.b.shuffle_vector(ua[1], ub[1], _cvec(I32, _PAIR_ORDER))
    return u, _lanes(e, [ua[2][0], ub[2][0], ua[2][1], ub[2][1]]), _lanes(e, [ua[3][0], ub[3][0], ua[3][1], ub[3][1]])


def _dm_pair(e: _IR, a, b):
    """<4 x float> (dA, mA, dB, mB): the f16 scale and offset leading the blocks at a and b."""
    v = ir.Constant(ir.VectorType(I32, 2), ir.Undefined)
    v = e.b.insert_element(v, e.load(a, 0, I32), ir.Constant(I32, 0))
    v = e.b.insert_element(v, e.load(b, 0, I32), ir.Constant(I32, 1))
    return e.b.fpext(e.b.bitcast(v, ir.VectorType(ir.HalfType(), 4)), ir.VectorType(F32, 4))


def _d_pair(e: _IR, a, b):
    """<2 x float> (dA, dB): the f16 scale leading the blocks at a and b."""
    v = ir.Constant(ir.VectorType(I16, 2), ir.Undefined)
    v = e.b.insert_element(v, e.load(a, 0, I16), ir.Constant(I32, 0))
    v = e.b.insert_element(v, e.load(b, 0, I16), ir.Constant(I32, 1))
    return e.b.fpext(e.b.bitcast(v, ir.VectorType(ir.HalfType(), 2)), ir.VectorType(F32, 2))


def _spread(e: _IR, v, picks):
    """<16 x float>: lane group g takes element picks[g] of v."""
    return e.b.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), _cvec(I32, [picks[i // 4] for i in range(16)]))


def _pair_q4(e: _IR, a, b, kind: str):
    """Two consecutive Q4_0 / Q4_1 blocks: one nibble split of their 32 bytes gives pair order."""
    off = 4 if kind == "q4_1" else 2
    q = e.b.shuffle_vector(e.load(a, off, VI8), e.load(b, off, VI8), _cvec(I32, range(32)))
    u = e.b.shuffle_vector(e.b.and_(q, _bvec(15)), e.b.lshr(q, _bvec(4)), _cvec(I32, range(64)))
    if kind == "q4_1":
        dm = _dm_pair(e, a, b)                                # dA mA dB mB
        return u, _spread(e, dm, [0, 2, 0, 2]), _spread(e, dm, [1, 3, 1, 3])
    d = _spread(e, _d_pair(e, a, b), [0, 1, 0, 1])
    return u, d, e.b.fmul(d, e.splat(ir.Constant(F32, -8.0)))


def _pair_q8_0(e: _IR, a, b):
    lo = e.b.shuffle_vector(e.load(a, 2, VI8), e.load(b, 2, VI8), _cvec(I32, range(32)))
    hi = e.b.shuffle_vector(e.load(a, 18, VI8), e.load(b, 18, VI8), _cvec(I32, range(32)))
    u = e.b.shuffle_vector(lo, hi, _cvec(I32, range(64)))
    d = _spread(e, _d_pair(e, a, b), [0, 1, 0, 1])
    if q8_0_signed():
        return u, d, None
    return e.b.xor(u, _cvec(I8, [0x80] * 64)), d, e.b.fmul(d, e.splat(ir.Constant(F32, -128.0)))


def _legacy_pair(e: _IR, a, b, kind: str):
    if kind in ("q4_0", "q4_1"):
        return _pair_q4(e, a, b, kind)
    if kind == "q8_0":
        return _pair_q8_0(e, a, b)
    return _pair_of_units(e, _U8_DECODERS[kind](e, a)[0], _U8_DECODERS[kind](e, b)[0])


@intrinsic
def row_dot_q8(typingctx, w, row, q_addr, q_stride, s_addr, s_stride, ntok):
    """(x[t] . W[row] for t < ntok) with x given as quantize_q8's int8 rows (q_addr, rows q_stride
    bytes apart) and scale lanes (s_addr, rows s_stride bytes apart: Q8_LANES floats a 64 columns);
    W a block array of a Q8_KINDS kind; ntok a literal 1..MAX_TOKENS.

    Two 32-column units a step (two legacy blocks, or two sub-blocks of a K block): their 64 weight
    bytes (pair order) against the token's 64 int8 in one 512-bit vpdpbusd, whose 16 lanes each sum
    4 columns; lane groups take the units' half scales. A token's accumulation order does not
    depend on ntok. An odd last unit (legacy rows of an odd block count) takes a 256-bit step."""
    kind = _block_array_kind(w)
    if kind not in Q8_KINDS or not isinstance(ntok, types.IntegerLiteral):
        return None
    n = ntok.literal_value
    cols, nbytes = KINDS[kind]
    decode = _U8_DECODERS[kind]
    legacy = cols == 32
    signed = kind == "q8_0" and q8_0_signed()
    sig = types.UniTuple(types.float32, n)(w, row, q_addr, q_stride, s_addr, s_stride, ntok)

    def codegen(context, builder, signature, args):
        e = _IR(builder)
        mod = builder.module
        fma16 = _intrinsic_fn(mod, "llvm.fma.v16f32", VF, [VF] * 3)
        fma8 = _intrinsic_fn(mod, "llvm.fma.v8f32", VF8, [VF8] * 3)
        rowp, nblocks = _row_base(context, builder, w, args[0], args[1])
        qrows = [builder.add(args[2], builder.mul(args[3], ir.Constant(I64, t))) for t in range(n)]
        srows = [builder.add(args[4], builder.mul(args[5], ir.Constant(I64, t))) for t in range(n)]
        zero = ir.Constant(VF, [ir.Constant(F32, 0.0)] * W)
        accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(2)] for _ in range(n)]
        tails = [cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0)) for _ in range(n)]
        izero16 = ir.Constant(VI32_16, [ir.Constant(I32, 0)] * 16)
        izero8 = ir.Constant(VI32_8, [ir.Constant(I32, 0)] * 8)

        def pair(u, wsc, cvec, p, k: int):
            """Pair p's weight bytes u (pair order) and lane scales; k alternates the chains."""
            u = builder.bitcast(u, VI32_16)
            qoff = builder.mul(p, ir.Constant(I64, 64))
            soff = builder.mul(p, ir.Constant(I64, 4 * Q8_LANES))
            for t in range(n):
                xq = builder.load(builder.inttoptr(builder.add(qrows[t], qoff), VI32_16.as_pointer()), align=1)
                sp = builder.add(srows[t], soff)
                dx = builder.load(builder.inttoptr(sp, VF.as_pointer()), align=4)
                isum = builder.sitofp(dpbusd(builder, izero16, u, xq, signed), VF)
                main, other = accs[t][k % 2], accs[t][(k + 1) % 2]
                builder.store(builder.call(fma16, [isum, builder.fmul(wsc, dx), builder.load(main)]), main)
                if cvec is not None:
                    sv = e.load(sp, 64, VF, align=4)
                    builder.store(builder.call(fma16, [cvec, sv, builder.load(other)]), other)

        if legacy:
            with cgutils.for_range(builder, builder.udiv(nblocks, ir.Constant(I64, 2))) as loop:
                i = loop.index
                a = builder.add(rowp, builder.mul(i, ir.Constant(I64, 2 * nbytes)))
                e.prefetch(a)
                pair(*_legacy_pair(e, a, builder.add(a, ir.Constant(I64, nbytes)), kind), i, 0)
            odd = builder.icmp_unsigned("!=", builder.urem(nblocks, ir.Constant(I64, 2)), ir.Constant(I64, 0))
            with builder.if_then(odd):                  # natural order, lanes 0-7 and 16-23
                last = builder.sub(nblocks, ir.Constant(I64, 1))
                _, u, (alo, ahi), (clo, chi) = decode(e, builder.add(rowp, builder.mul(last, ir.Constant(I64, nbytes))))[0]
                u = builder.bitcast(u, VI32_8)
                p = builder.udiv(last, ir.Constant(I64, 2))
                qoff = builder.mul(p, ir.Constant(I64, 64))
                soff = builder.mul(p, ir.Constant(I64, 4 * Q8_LANES))
                wsc = _lanes(e, [alo, ahi])
                cvec = None if clo is None else _lanes(e, [clo, chi])
                for t in range(n):
                    xq = builder.load(builder.inttoptr(builder.add(qrows[t], qoff), VI32_8.as_pointer()), align=1)
                    sp = builder.add(srows[t], soff)
                    dx = e.load(sp, 0, VF8, align=4)
                    isum = builder.sitofp(dpbusd(builder, izero8, u, xq, signed), VF8)
                    if cvec is None:
                        v = builder.fmul(isum, builder.fmul(wsc, dx))
                    else:
                        sv = e.load(sp, 64, VF8, align=4)
                        v = builder.call(fma8, [isum, builder.fmul(wsc, dx), builder.fmul(cvec, sv)])
                    builder.store(_hsum(builder, v, 8), tails[t])
        else:
            with cgutils.for_range(builder, nblocks) as loop:
                b = loop.index
                a = builder.add(rowp, builder.mul(b, ir.Constant(I64, nbytes)))
                e.prefetch(a)
                units = decode(e, a)
                per = len(units) // 2
                for j in range(per):
                    p = builder.add(builder.mul(b, ir.Constant(I64, per)), ir.Constant(I64, j))
                    pair(*_pair_of_units(e, units[2 * j], units[2 * j + 1]), p, j)
        sums = []
        for t in range(n):
            v = builder.fadd(builder.load(accs[t][0]), builder.load(accs[t][1]))
            sums.append(builder.fadd(_hsum(builder, v), builder.load(tails[t])))
        return context.make_tuple(builder, signature.return_type, sums)

    return sig, codegen


# ------------------------------------------------------------------------------------- kernels

ROWS_A_CHUNK = 16        # weight rows a parallel work item takes at up to MAX_TOKENS activation rows
ROWS_A_TILE = 64         # ... and with more: its token tiles reuse them from L1/L2
TOKEN_TILE = 64          # activation rows a work item takes (64 x K floats stay in L2; all of x, at
                         # a 512-token prefill, would not: 3.5x slower measured)


# The row loops write y in place, without a helper: Numba increfs arrays handed to an inlined
# function, an atomic per row on a line both threads share (docs/cpu.md).

@njit(fastmath=FASTMATH, error_model="numpy")
def _chunk(w, x, y, col0, r0, r1, t0, t1, residual):
    """Rows r0:r1 of W against activation rows t0:t1: up to 8 rows of x a pass over the weights."""
    xa, xs = x.ctypes.data, x.strides[0]
    res = residual.shape[0] > 0
    t = t0
    while t < t1:
        left, xt = t1 - t, xa + t * xs
        if left >= 8:
            for r in range(r0, r1):
                s = row_dot(w, r, xt, xs, 8)
                for i in range(8):
                    y[t + i, col0 + r] = s[i] + residual[t + i, col0 + r] if res else s[i]
            t += 8
        elif left >= 4:
            for r in range(r0, r1):
                s = row_dot(w, r, xt, xs, 4)
                for i in range(4):
                    y[t + i, col0 + r] = s[i] + residual[t + i, col0 + r] if res else s[i]
            t += 4
        elif left >= 2:
            for r in range(r0, r1):
                s = row_dot(w, r, xt, xs, 2)
                for i in range(2):
                    y[t + i, col0 + r] = s[i] + residual[t + i, col0 + r] if res else s[i]
            t += 2
        else:
            r = r0
            while r + 4 <= r1:
                s = rows4_dot(w, r, xt)
                for i in range(4):
                    y[t, col0 + r + i] = s[i] + residual[t, col0 + r + i] if res else s[i]
                r += 4
            for r in range(r, r1):
                v = row_dot(w, r, xt, xs, 1)[0]
                y[t, col0 + r] = v + residual[t, col0 + r] if res else v
            t += 1


MAX_PARTS = 4            # block arrays one matmul_into call takes (a tuple of this length, padded)


@njit(fastmath=FASTMATH, error_model="numpy")
def _rms_rows(x, weight, eps, out, t0, t1):
    D = x.shape[1]
    for t in range(t0, t1):
        ss = np.float32(0.0)
        for d in range(D):
            ss += x[t, d] * x[t, d]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(D) + np.float32(eps))
        for d in range(D):
            out[t, d] = x[t, d] * inv * weight[d]


@njit(error_model="numpy")
def _work_items(parts, count, rows):
    """first[p]: the first parallel work item of part p (items of `rows` rows; first[count] in all)."""
    first = np.zeros(count + 1, np.int64)
    for p in range(count):
        first[p + 1] = first[p] + (parts[p].shape[0] + rows - 1) // rows
    return first


@njit(error_model="numpy")
def _work_item(first, count, item):
    """(token tile, part, index within the part) of parallel work item `item` (_work_items' table)."""
    tile, c = item // first[count], item % first[count]
    p = 0
    while c >= first[p + 1]:
        p += 1
    return tile, p, (c - first[p])


@njit(parallel=True, fastmath=FASTMATH, cache=CACHE, error_model="numpy")
def matmul_into(parts, count, col0s, x, norm, eps, normed, residual, y):
    """y[:, col0s[p]:col0s[p] + R_p] = (residual +) x' @ W_p.T for the first `count` block arrays W_p
    [R_p, blocks] of the tuple `parts` (one kind, as_blocks; MAX_PARTS long, so one compiled kernel
    a kind: `pad_parts`), in one parallel loop over (row chunk, token tile) items. x' = x, or with
    `norm` (weights [K]; empty: none) RMSNorm(x) written to `normed` [T, K] first. `residual` [T, R]
    or empty [0, 0]."""
    T = x.shape[0]
    src = x
    if norm.shape[0]:
        if T <= TOKEN_TILE:
            _rms_rows(x, norm, eps, normed, 0, T)
        else:
            for tile in prange((T + TOKEN_TILE - 1) // TOKEN_TILE):
                _rms_rows(x, norm, eps, normed, tile * TOKEN_TILE, min(T, (tile + 1) * TOKEN_TILE))
        src = normed
    rows = ROWS_A_CHUNK if T <= MAX_TOKENS else ROWS_A_TILE
    tiles = (T + TOKEN_TILE - 1) // TOKEN_TILE
    first = _work_items(parts, count, rows)
    for item in prange(first[count] * tiles):
        tile, p, c = _work_item(first, count, item)     # a token tile stays in L2 over all rows
        w = parts[p]
        r0 = c * rows
        t0 = tile * TOKEN_TILE
        _chunk(w, src, y, col0s[p], r0, min(w.shape[0], r0 + rows), t0, min(T, t0 + TOKEN_TILE), residual)


def q8_scales_shape(tokens: int, cols: int) -> tuple[int, int, int]:
    """quantize_q8's xs: Q8_LANES floats a token a 64 columns (an odd last 32 padded)."""
    return tokens, (cols // 32 + 1) // 2, Q8_LANES


@njit(fastmath=FASTMATH, error_model="numpy")
def quantize_q8(x, xq, xs, t0, t1):
    """Rows t0:t1 of x [T, K] as int8 xq [T, K] (round(x / dx), dx = max|x| / 127 a 32-block), each
    64 columns in pair order (q8_order; an odd last block as it is), and their scale lanes xs
    (q8_scales_shape): in xs[t, p], for the lane groups g of 4 (A lo, B lo, A hi, B hi of blocks
    2p, 2p + 1), dx of g's block at lanes 4g..4g+3 and dx * (sum of g's 16 xq) / 4 at 16 + 4g.."""
    nb = x.shape[1] // 32
    for t in range(t0, t1):
        if nb % 2:
            xs[t, nb // 2, :] = 0
        for b in range(nb):
            top = np.float32(0.0)
            for j in range(32):
                top = max(top, abs(x[t, 32 * b + j]))
            dx = top / np.float32(127.0)
            inv = np.float32(1.0) / dx if top > 0 else np.float32(0.0)
            p, unit = b // 2, b % 2
            paired = 2 * p + 1 < nb
            for half in range(2):
                s = 0
                g = 2 * half + unit if paired else half            # the tail block: groups 0, 1
                dst = 64 * p + 16 * g
                for j in range(16):
                    v = np.int32(np.rint(x[t, 32 * b + 16 * half + j] * inv))
                    xq[t, dst + j] = v
                    s += v
                for i in range(4):
                    xs[t, p, 4 * g + i] = dx
                    xs[t, p, 16 + 4 * g + i] = dx * np.float32(s) * np.float32(0.25)


def q8_order(cols: int) -> np.ndarray:
    """The source column of each of quantize_q8's xq columns (pair order)."""
    order = np.arange(cols)
    for p in range(cols // 64):
        order[64 * p:64 * p + 64] = 64 * p + np.array(_PAIR_ORDER)
    return order


def q8_block_scales(xs: np.ndarray, cols: int) -> np.ndarray:
    """dx [T, cols / 32] read back from quantize_q8's xs."""
    return xs[:, :, [0, 4]].reshape(xs.shape[0], -1)[:, :cols // 32]


@njit(fastmath=FASTMATH, error_model="numpy")
def _chunk_q8(w, xq, xs, y, col0, r0, r1, t0, t1, residual):
    qa, qs_ = xq.ctypes.data, xq.strides[0]
    sa, ss = xs.ctypes.data, xs.strides[0]
    res = residual.shape[0] > 0
    t = t0
    while t < t1:
        left, qt, st = t1 - t, qa + t * qs_, sa + t * ss
        if left >= 8:
            for r in range(r0, r1):
                s = row_dot_q8(w, r, qt, qs_, st, ss, 8)
                for i in range(8):
                    y[t + i, col0 + r] = s[i] + residual[t + i, col0 + r] if res else s[i]
            t += 8
        elif left >= 4:
            for r in range(r0, r1):
                s = row_dot_q8(w, r, qt, qs_, st, ss, 4)
                for i in range(4):
                    y[t + i, col0 + r] = s[i] + residual[t + i, col0 + r] if res else s[i]
            t += 4
        elif left >= 2:
            for r in range(r0, r1):
                s = row_dot_q8(w, r, qt, qs_, st, ss, 2)
                for i in range(2):
                    y[t + i, col0 + r] = s[i] + residual[t + i, col0 + r] if res else s[i]
            t += 2
        else:
            for r in range(r0, r1):
                v = row_dot_q8(w, r, qt, qs_, st, ss, 1)[0]
                y[t, col0 + r] = v + residual[t, col0 + r] if res else v
            t += 1


@njit(parallel=True, fastmath=FASTMATH, cache=CACHE, error_model="numpy")
def matmul_q8_into(parts, count, col0s, x, norm, eps, normed, xq, xs, residual, y):
    """matmul_into with 8-bit activations: x (or RMSNorm(x) into `normed`, given `norm`) quantized
    into xq [T, K] int8 and xs (q8_scales_shape, quantize_q8), then integer block dot products
    (row_dot_q8) for the Q8_KINDS block arrays of `parts`."""
    T = x.shape[0]
    tiles = (T + TOKEN_TILE - 1) // TOKEN_TILE
    src = x
    if norm.shape[0]:
        src = normed
    if T <= TOKEN_TILE:
        if norm.shape[0]:
            _rms_rows(x, norm, eps, normed, 0, T)
        quantize_q8(src, xq, xs, 0, T)
    else:
        for tile in prange(tiles):
            a, b = tile * TOKEN_TILE, min(T, (tile + 1) * TOKEN_TILE)
            if norm.shape[0]:
                _rms_rows(x, norm, eps, normed, a, b)
            quantize_q8(src, xq, xs, a, b)
    rows = ROWS_A_CHUNK if T <= MAX_TOKENS else ROWS_A_TILE
    first = _work_items(parts, count, rows)
    for item in prange(first[count] * tiles):
        tile, p, c = _work_item(first, count, item)
        w = parts[p]
        r0 = c * rows
        t0 = tile * TOKEN_TILE
        _chunk_q8(w, xq, xs, y, col0s[p], r0, min(w.shape[0], r0 + rows), t0, min(T, t0 + TOKEN_TILE), residual)


def pad_parts(blocks: list) -> tuple:
    """Up to MAX_PARTS block arrays of one kind as matmul_into's tuple (repeats fill it)."""
    if not 1 <= len(blocks) <= MAX_PARTS:
        raise ValueError(f"1 to {MAX_PARTS} parts a call, got {len(blocks)}")
    return tuple(blocks) + (blocks[0],) * (MAX_PARTS - len(blocks))


@njit(parallel=True, cache=CACHE, error_model="numpy")
def decode_rows(w, rows, out):
    """out[i] = W[rows[i]] as float32 (the embedding lookup of a quantized table)."""
    for i in prange(rows.shape[0]):
        row_decode(w, rows[i], out[i:].ctypes.data)


# ----------------------------------------------------------------------------------- references

_GGUF_NAMES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1", "q8_0": "Q8_0",
               "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K", "f32": "F32", "f16": "F16", "bf16": "BF16"}


def dequantize_ref(data: np.ndarray, kind: str) -> np.ndarray:
    """float32 [R, K] of uint8 rows of `kind` blocks, by the gguf package (the independent reference)."""
    import gguf
    raw = np.ascontiguousarray(data.view(np.uint8).reshape(data.shape[0], -1))
    t = gguf.GGMLQuantizationType[_GGUF_NAMES[kind]]
    if kind == "f32":
        return raw.view(np.float32).copy()
    if kind == "f16":
        return raw.view(np.float16).astype(np.float32)
    return np.asarray(gguf.quants.dequantize(raw, t), dtype=np.float32)


def matmul_ref(x: np.ndarray, data: np.ndarray, kind: str) -> np.ndarray:
    return x.astype(np.float64) @ dequantize_ref(data, kind).astype(np.float64).T


def quantize_q8_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(xq int8 [T, K], dx float32 [T, K / 32]) as quantize_q8 computes them (round half to even)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    dx = (np.abs(blocks).max(-1) / np.float32(127.0)).astype(np.float32)
    inv = np.divide(np.float32(1.0), dx, out=np.zeros_like(dx), where=dx > 0)
    return np.rint(blocks * inv[..., None]).astype(np.int8).reshape(x.shape), dx


def matmul_q8_ref(x: np.ndarray, data: np.ndarray, kind: str) -> np.ndarray:
    """The q8 path's arithmetic in float64: gguf's dequantized W against x quantized as quantize_q8."""
    xq, dx = quantize_q8_ref(x)
    xd = xq.reshape(x.shape[0], -1, 32).astype(np.float64) * dx[..., None].astype(np.float64)
    return xd.reshape(x.shape) @ dequantize_ref(data, kind).astype(np.float64).T
