"""CPU products with weights kept in a GGUF file's block layout (Numba @njit, parallel over rows).

y[T, R] = x[T, K] @ W[R, K].T where W's rows are the file's raw blocks: Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0 (32 columns a block), Q4_K, Q5_K, Q6_K (256 a block), and dense f32 / f16 / bf16 rows
(handled as 16-column "blocks"). Activations stay float32: each block is decoded in registers into
<16 x float> vectors (LLVM IR written here, `_DECODERS`) and multiplied into per-token vector
accumulators with FMAs, up to 8 activation rows a pass so a block is decoded once for 8 tokens.
llama.cpp instead quantizes activations to 8 bits a block and takes integer dot products
(VNNI); on this path float activations measured as fast at decode (weight bytes dominate) and keep
the reference's arithmetic (docs/performance.md, "Fast CPU path").

How the block type reaches the kernel: `as_blocks(data, kind)` views a part's uint8 rows as an
array of one-field records whose field is named after the type ("q4_1", ...), so one generic
kernel specializes per type through Numba's dispatch on the array's dtype, and the decoder is
chosen when the intrinsic is typed. Kernels are cached on disk (cache=True); `compile_all` builds
every specialization the runtime uses, once, with a line on stderr per family it had to compile.

References: `dequantize_ref` (the gguf package, an independent implementation) and
`matmul_ref` (its dequantization @ x); tests/test_cpu_quant.py checks every type against them.
Contracts: x float32 C-contiguous [T, K], K = W's columns; y float32 with unit column stride.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

# name -> (columns a block, bytes a block). The GGUF block types first, then dense rows.
KINDS = {
    "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
    "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
    "f32": (16, 64), "f16": (16, 32), "bf16": (16, 32),
}
_DTYPES = {k: np.dtype([(k, np.uint8, (nbytes,))]) for k, (_, nbytes) in KINDS.items()}
MAX_TOKENS = 8                      # activation rows one pass over the weights multiplies
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}   # no no-NaN / no-Inf assumptions


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

    def u8(self, addr, off: int):
        return self.b.zext(self.load(addr, off, I8), I32)

    def f16(self, addr, off: int):
        return self.b.fpext(self.b.bitcast(self.load(addr, off, I16), ir.HalfType()), F32)

    def splat(self, scalar, ty=VF):
        v = self.b.insert_element(ir.Constant(ty, ir.Undefined), scalar, ir.Constant(I32, 0))
        return self.b.shuffle_vector(v, ir.Constant(ty, ir.Undefined), ir.Constant(ir.VectorType(I32, W), [0] * W))

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


def _hsum(b: ir.IRBuilder, v):
    n = W
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


# ------------------------------------------------------------------------------------- kernels

ROWS_A_CHUNK = 16        # weight rows a parallel work item takes at up to MAX_TOKENS activation rows
ROWS_A_TILE = 64         # ... and with more: its token tiles reuse them from L1/L2
TOKEN_TILE = 64          # activation rows a work item takes (64 x K floats stay in L2; all of x, at
                         # a 512-token prefill, would not: 3.5x slower measured)


@njit(inline="always")
def _put(y, t, c, v, accumulate):
    if accumulate:
        y[t, c] += v
    else:
        y[t, c] = v


@njit(fastmath=FASTMATH)
def _chunk(w, x, y, col0, r0, r1, t0, t1, accumulate):
    """Rows r0:r1 of W against activation rows t0:t1: up to 8 rows of x a pass over the weights."""
    xa, xs = x.ctypes.data, x.strides[0]
    t = t0
    while t < t1:
        left, xt = t1 - t, xa + t * xs
        if left >= 8:
            for r in range(r0, r1):
                s = row_dot(w, r, xt, xs, 8)
                for i in range(8):
                    _put(y, t + i, col0 + r, s[i], accumulate)
            t += 8
        elif left >= 4:
            for r in range(r0, r1):
                s = row_dot(w, r, xt, xs, 4)
                for i in range(4):
                    _put(y, t + i, col0 + r, s[i], accumulate)
            t += 4
        elif left >= 2:
            for r in range(r0, r1):
                s = row_dot(w, r, xt, xs, 2)
                _put(y, t, col0 + r, s[0], accumulate)
                _put(y, t + 1, col0 + r, s[1], accumulate)
            t += 2
        else:
            for r in range(r0, r1):
                _put(y, t, col0 + r, row_dot(w, r, xt, xs, 1)[0], accumulate)
            t += 1


MAX_PARTS = 4            # block arrays one matmul_into call takes (a tuple of this length, padded)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def matmul_into(parts, count, col0s, x, y, accumulate):
    """y[:, col0s[p]:col0s[p] + R_p] = x @ W_p.T (accumulate: +=) for the first `count` block arrays
    W_p [R_p, blocks] of the tuple `parts` (one kind, as_blocks; MAX_PARTS long, so one compiled
    kernel a kind: `pad_parts`), all in one parallel loop over (row chunk, token tile) items."""
    T = x.shape[0]
    rows = ROWS_A_CHUNK if T <= MAX_TOKENS else ROWS_A_TILE
    tiles = (T + TOKEN_TILE - 1) // TOKEN_TILE
    first = np.zeros(count + 1, np.int64)
    for p in range(count):
        first[p + 1] = first[p] + (parts[p].shape[0] + rows - 1) // rows
    for item in prange(first[count] * tiles):
        tile, c = item // first[count], item % first[count]     # a token tile stays in L2 over all rows
        p = 0
        while c >= first[p + 1]:
            p += 1
        w = parts[p]
        r0 = (c - first[p]) * rows
        t0 = tile * TOKEN_TILE
        _chunk(w, x, y, col0s[p], r0, min(w.shape[0], r0 + rows), t0, min(T, t0 + TOKEN_TILE), accumulate)


def pad_parts(blocks: list) -> tuple:
    """Up to MAX_PARTS block arrays of one kind as matmul_into's tuple (repeats fill it)."""
    if not 1 <= len(blocks) <= MAX_PARTS:
        raise ValueError(f"1 to {MAX_PARTS} parts a call, got {len(blocks)}")
    return tuple(blocks) + (blocks[0],) * (MAX_PARTS - len(blocks))


@njit(parallel=True, cache=True)
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
