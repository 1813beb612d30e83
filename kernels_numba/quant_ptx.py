"""Inline-PTX intrinsics of the quantized kernels (quant_gemv, quant_dequant), each with a simulator twin.

  ldg_b16(a, r, c)    `ld.global.nc.v4.u32` of the 16 bytes a[r, c:c+16] (2-D uint8, c % 16 == 0) -> 4 x uint32
  ldg_b16s(a, r, c)   the same for streamed weights: `.L1::no_allocate.L2::256B` (no L1 line kept for
                      data read once; L2 fetches the 256-byte block: the warp's neighbours come next)
  ldg_b4(a, r, c)     `ld.global.nc.u32` of a[r, c:c+4] (c % 4 == 0) -> uint32 (little-endian)
  ldg_b2(a, r, c)     `ld.global.nc.u16` of a[r, c:c+2] (c % 2 == 0) -> uint32 (zero-extended)
  stg_u16x8(a, r, c, v0, v1, v2, v3)   `st.global.v4.u32` of 8 uint16 a[r, c:c+8] (2-D uint16, c % 8 == 0)
  stg_f32x4(a, r, c, v0, v1, v2, v3)   `st.global.v4.f32` of a[r, c:c+4] (2-D float32, c % 4 == 0)
  dp4a_us(a, b, c)    `dp4a.u32.s32`: c + sum of the 4 unsigned bytes of a times the 4 signed bytes of b -> int32
  dp4a_ss(a, b, c)    `dp4a.s32.s32`: both signed
  h2f(u)              `cvt.f32.f16` of the fp16 in bits 0..15 of u -> float32
  rni(f)              `cvt.rni.s32.f32`: f rounded to the nearest integer (ties to even) -> int32
  f32_bits(f) / bits_f32(u)   reinterpretation float32 <-> uint32
  shfl_xor_i32(v, m)  `shfl.sync.bfly.b32` of an int32 (all 32 lanes, m in 1..31)
  ldg_b8(a, r, c)     `ld.global.nc.v2.u32` of a[r, c:c+8] (c % 8 == 0) -> 2 x uint32
  mma_u8s8(a0, a1, a2, a3, b0, b1) -> (d0, d1, d2, d3)
                      `mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32` with zero accumulators: A 16 x 32
                      unsigned bytes, B 32 x 8 signed bytes, D int32 (PTX ISA fragments, g = lane >> 2,
                      c = lane & 3: a0 = A[g][4c..4c+3], a1 = A[g+8][4c..], a2 = A[g][16+4c..],
                      a3 = A[g+8][16+4c..]; b0 = B[4c..4c+3][g], b1 = B[16+4c..][g]; d0, d1 = D[g][2c, 2c+1],
                      d2, d3 = D[g+8][2c, 2c+1])
  e4m3x2_f32(u)       `cvt.rn.f16x2.e4m3x2` of the two fp8 e4m3 bytes in bits 0..15 of u, each then
                      `cvt.f32.f16` -> (float32 of the low byte, float32 of the high byte); exact

Numba has none of these (no dp4a, no fp16 conversion of raw bits, no 16-byte loads of byte arrays).
Loads are of read-only data (`.nc`): weights, and the x the kernel only reads.
"""
from __future__ import annotations

import numpy as np

from kernels_numba.ptx import SIM

__all__ = ["ldg_b16", "ldg_b16s", "ldg_b8", "mma_u8s8", "ldg_b4", "ldg_b2", "stg_u16x8", "stg_f32x4", "dp4a_us", "dp4a_ss", "h2f",
           "rni", "f32_bits", "bits_f32", "shfl_xor_i32", "e4m3x2_f32"]

if SIM:
    from kernels_numba import ptx as _ptx

    def _word(a, r, c):
        return int(a[r, c]) | (int(a[r, c + 1]) << 8) | (int(a[r, c + 2]) << 16) | (int(a[r, c + 3]) << 24)

    def ldg_b16(a, r, c):
        return (np.uint32(_word(a, r, c)), np.uint32(_word(a, r, c + 4)),
                np.uint32(_word(a, r, c + 8)), np.uint32(_word(a, r, c + 12)))

    ldg_b16s = None          # (set below: the same as ldg_b16)

    def ldg_b4(a, r, c):
        return np.uint32(_word(a, r, c))

    def ldg_b8(a, r, c):
        return np.uint32(_word(a, r, c)), np.uint32(_word(a, r, c + 4))

    def _mma_u8s8_op(slots):
        A = np.zeros((16, 32), np.int64)
        B = np.zeros((32, 8), np.int64)
        for lane, (a, b) in enumerate(slots):
            g, c = lane >> 2, lane & 3
            for i, (row, col) in enumerate(((g, 4 * c), (g + 8, 4 * c), (g, 16 + 4 * c), (g + 8, 16 + 4 * c))):
                A[row, col:col + 4] = _bytes(a[i], False)
            B[4 * c:4 * c + 4, g] = _bytes(b[0], True)
            B[16 + 4 * c:20 + 4 * c, g] = _bytes(b[1], True)
        D = A @ B
        return [tuple(np.int32(v) for v in (D[lane >> 2, 2 * (lane & 3)], D[lane >> 2, 2 * (lane & 3) + 1],
                                            D[(lane >> 2) + 8, 2 * (lane & 3)], D[(lane >> 2) + 8, 2 * (lane & 3) + 1]))
                for lane in range(len(slots))]

    def mma_u8s8(a0, a1, a2, a3, b0, b1):
        st, lane = _ptx._my_warp()
        return st.exchange(lane, _mma_u8s8_op, ((a0, a1, a2, a3), (b0, b1)))

    def ldg_b2(a, r, c):
        return np.uint32(int(a[r, c]) | (int(a[r, c + 1]) << 8))

    ldg_b16s = ldg_b16

    def stg_u16x8(a, r, c, v0, v1, v2, v3):
        for i, v in enumerate((v0, v1, v2, v3)):
            v = int(v)
            a[r, c + 2 * i] = v & 0xFFFF
            a[r, c + 2 * i + 1] = (v >> 16) & 0xFFFF

    def stg_f32x4(a, r, c, v0, v1, v2, v3):
        a[r, c] = v0
        a[r, c + 1] = v1
        a[r, c + 2] = v2
        a[r, c + 3] = v3

    def _bytes(v, signed):
        v = int(v) & 0xFFFFFFFF
        out = [(v >> (8 * i)) & 0xFF for i in range(4)]
        return [b - 256 if signed and b >= 128 else b for b in out]

    def dp4a_us(a, b, c):
        s = int(c) + sum(x * y for x, y in zip(_bytes(a, False), _bytes(b, True)))
        return np.int32(s)

    def dp4a_ss(a, b, c):
        s = int(c) + sum(x * y for x, y in zip(_bytes(a, True), _bytes(b, True)))
        return np.int32(s)

    def h2f(u):
        return np.float32(np.uint16(int(u) & 0xFFFF).view(np.float16))

    def rni(f):
        return np.int32(np.rint(np.float32(f)))

    def f32_bits(f):
        return np.float32(f).view(np.uint32)

    def bits_f32(u):
        return np.uint32(int(u) & 0xFFFFFFFF).view(np.float32)

    import ml_dtypes as _mld

    _E4M3 = np.arange(256, dtype=np.uint8).view(_mld.float8_e4m3fn).astype(np.float32)

    def e4m3x2_f32(u):
        u = int(u)
        return _E4M3[u & 0xFF], _E4M3[(u >> 8) & 0xFF]

    def shfl_xor_i32(v, m):
        st, lane = _ptx._my_warp()
        m = int(m)
        return st.exchange(lane, lambda slots: [np.int32(slots[i ^ m]) for i in range(len(slots))],
                           np.int32(v))

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _i16 = ir.IntType(16)
    _i32 = ir.IntType(32)
    _f32 = ir.FloatType()

    def _gptr(context, builder, sig, args):
        """addrspace(1) i8* of a[r, c] (no wraparound, no bounds check)."""
        aryty = sig.args[0]
        arr = context.make_array(aryty)(context, builder, value=args[0])
        inds = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:3], sig.args[1:3])]
        ptr = cgutils.get_item_pointer(context, builder, aryty, arr, inds, wraparound=False)
        return builder.addrspacecast(builder.bitcast(ptr, ir.IntType(8).as_pointer()),
                                     ir.PointerType(ir.IntType(8), 1))

    def _is_2d(a, dtype):
        return isinstance(a, types.Array) and a.dtype == dtype and a.ndim == 2

    def _ldg16(op):
        def gen(context, builder, sig, args):
            p = _gptr(context, builder, sig, args)
            sty = ir.LiteralStructType([_i32] * 4)
            asm = ir.InlineAsm(ir.FunctionType(sty, [p.type]), op + " {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l")
            res = builder.call(asm, [p])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])
        return gen

    @intrinsic
    def ldg_b16(typingctx, a, r, c):
        if not _is_2d(a, types.uint8):
            return None
        return types.UniTuple(types.uint32, 4)(a, r, c), _ldg16("ld.global.nc.v4.u32")

    @intrinsic
    def ldg_b16s(typingctx, a, r, c):
        if not _is_2d(a, types.uint8):
            return None
        return types.UniTuple(types.uint32, 4)(a, r, c), _ldg16("ld.global.nc.L1::no_allocate.L2::256B.v4.u32")

    @intrinsic
    def ldg_b8(typingctx, a, r, c):
        if not _is_2d(a, types.uint8):
            return None

        def gen(context, builder, sig, args):
            p = _gptr(context, builder, sig, args)
            sty = ir.LiteralStructType([_i32] * 2)
            asm = ir.InlineAsm(ir.FunctionType(sty, [p.type]), "ld.global.nc.v2.u32 {$0, $1}, [$2];", "=r,=r,l")
            res = builder.call(asm, [p])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(2)])
        return types.UniTuple(types.uint32, 2)(a, r, c), gen

    @intrinsic
    def mma_u8s8(typingctx, a0, a1, a2, a3, b0, b1):
        def gen(context, builder, sig, args):
            regs = [context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args)]
            sty = ir.LiteralStructType([_i32] * 4)
            asm = ir.InlineAsm(ir.FunctionType(sty, [_i32] * 7),
                               "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 "
                               "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $10, $10, $10};",
                               "=r,=r,=r,=r,r,r,r,r,r,r,r")
            res = builder.call(asm, regs + [ir.Constant(_i32, 0)])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])
        return types.UniTuple(types.int32, 4)(a0, a1, a2, a3, b0, b1), gen

    @intrinsic
    def ldg_b4(typingctx, a, r, c):
        if not _is_2d(a, types.uint8):
            return None

        def gen(context, builder, sig, args):
            p = _gptr(context, builder, sig, args)
            asm = ir.InlineAsm(ir.FunctionType(_i32, [p.type]), "ld.global.nc.u32 $0, [$1];", "=r,l")
            return builder.call(asm, [p])
        return types.uint32(a, r, c), gen

    @intrinsic
    def ldg_b2(typingctx, a, r, c):
        if not _is_2d(a, types.uint8):
            return None

        def gen(context, builder, sig, args):
            p = _gptr(context, builder, sig, args)
            asm = ir.InlineAsm(ir.FunctionType(_i16, [p.type]), "ld.global.nc.u16 $0, [$1];", "=h,l")
            return builder.zext(builder.call(asm, [p]), _i32)
        return types.uint32(a, r, c), gen

    def _stg_v4(reg, ptxty, llty, nbty):
        def gen(context, builder, sig, args):
            p = _gptr(context, builder, sig, args)
            vals = [context.cast(builder, v, t, nbty) for v, t in zip(args[3:], sig.args[3:])]
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [p.type] + [llty] * 4),
                               f"st.global.v4.{ptxty} [$0], {{$1, $2, $3, $4}};",
                               f"l,{reg},{reg},{reg},{reg}", side_effect=True)
            builder.call(asm, [p] + vals)
            return context.get_dummy_value()
        return gen

    @intrinsic
    def stg_u16x8(typingctx, a, r, c, v0, v1, v2, v3):
        if not _is_2d(a, types.uint16):
            return None
        return types.none(a, r, c, v0, v1, v2, v3), _stg_v4("r", "u32", _i32, types.uint32)

    @intrinsic
    def stg_f32x4(typingctx, a, r, c, v0, v1, v2, v3):
        if not _is_2d(a, types.float32):
            return None
        return types.none(a, r, c, v0, v1, v2, v3), _stg_v4("f", "f32", _f32, types.float32)

    def _dp4a(kind):
        def gen(context, builder, sig, args):
            a, b = (context.cast(builder, v, t, types.uint32) for v, t in zip(args[:2], sig.args[:2]))
            c = context.cast(builder, args[2], sig.args[2], types.int32)
            asm = ir.InlineAsm(ir.FunctionType(_i32, [_i32] * 3), f"dp4a.{kind}.s32 $0, $1, $2, $3;", "=r,r,r,r")
            return builder.call(asm, [a, b, c])
        return gen

    @intrinsic
    def dp4a_us(typingctx, a, b, c):
        return types.int32(a, b, c), _dp4a("u32")

    @intrinsic
    def dp4a_ss(typingctx, a, b, c):
        return types.int32(a, b, c), _dp4a("s32")

    @intrinsic
    def h2f(typingctx, u):
        def gen(context, builder, sig, args):
            v = builder.trunc(context.cast(builder, args[0], sig.args[0], types.uint32), _i16)
            return builder.call(ir.InlineAsm(ir.FunctionType(_f32, [_i16]), "cvt.f32.f16 $0, $1;", "=f,h"), [v])
        return types.float32(u), gen

    @intrinsic
    def rni(typingctx, f):
        def gen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], types.float32)
            return builder.call(ir.InlineAsm(ir.FunctionType(_i32, [_f32]), "cvt.rni.s32.f32 $0, $1;", "=r,f"), [v])
        return types.int32(f), gen

    @intrinsic
    def f32_bits(typingctx, f):
        def gen(context, builder, sig, args):
            return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.float32), _i32)
        return types.uint32(f), gen

    @intrinsic
    def bits_f32(typingctx, u):
        def gen(context, builder, sig, args):
            return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.uint32), _f32)
        return types.float32(u), gen

    @intrinsic
    def e4m3x2_f32(typingctx, u):
        def gen(context, builder, sig, args):
            v = builder.trunc(context.cast(builder, args[0], sig.args[0], types.uint32), _i16)
            sty = ir.LiteralStructType([_f32, _f32])
            asm = ir.InlineAsm(ir.FunctionType(sty, [_i16]),
                               "{ .reg .b16 lo, hi; .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; "
                               "mov.b32 {lo, hi}, t; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }", "=f,=f,h")
            r = builder.call(asm, [v])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(r, 0), builder.extract_value(r, 1)])
        return types.UniTuple(types.float32, 2)(u), gen

    @intrinsic
    def shfl_xor_i32(typingctx, v, m):
        def gen(context, builder, sig, args):
            x = context.cast(builder, args[0], sig.args[0], types.int32)
            mm = context.cast(builder, args[1], sig.args[1], types.int32)
            fty = ir.FunctionType(_i32, [_i32, _i32, _i32, _i32])
            shfl = cgutils.get_or_insert_function(builder.module, fty, "llvm.nvvm.shfl.sync.bfly.i32")
            return builder.call(shfl, [ir.Constant(_i32, 0xFFFFFFFF), x, mm, ir.Constant(_i32, 0x1F)])
        return types.int32(v, m), gen
