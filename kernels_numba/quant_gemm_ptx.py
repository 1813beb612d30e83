"""Inline-PTX intrinsics of the block-quantized GEMM (kernels_numba/quant_gemm.py), each with a simulator twin.

  prmt(a, b, sel)           `prmt.b32`: byte k of the result is byte (sel >> 4k) & 7 of the 8 bytes
                            b:a (a bytes 0..3, b bytes 4..7); sel a compile-time constant in 0..0x7777
  fma_bf16x2(a, b, c)       `fma.rn.bf16x2`: per 16-bit half, bf16(a * b + c) rounded once (nearest even)
  cp_async8(s, i, x, r, c)  `cp.async.ca.shared.global` of 8 bytes: x[r, c:c+4] (2-D uint16, c % 4 == 0)
                            into s[i:i+2] (1-D uint32 shared, i % 2 == 0), without registers
  cp_async_zero8(s, i)      the same 8 bytes of shared memory set to zero (`st.shared.v2.u32`)
  cp_async_commit()         `cp.async.commit_group`
  cp_async_wait1() / cp_async_wait0()   `cp.async.wait_group 1 / 0`: all but the newest group / all landed
  ldcg_f32(a, i)            `ld.global.cg.f32` of a[i] (1-D float32): past L1, for values other blocks
                            of the same launch wrote (the split-K partial sums)

The simulator twins compute the same values in Python; fma_bf16x2 rounds a * b + c to float32, then
to bf16 (nearest even both times: it may differ from one rounding in the last bit on a tie, which the
GEMM's operands, small integers times a scale, do not produce). cp.async copies at once there.
"""
from __future__ import annotations

import numpy as np

from kernels_numba.ptx import SIM

__all__ = ["prmt", "fma_bf16x2", "cp_async8", "cp_async_zero8", "cp_async_commit", "cp_async_wait0",
           "cp_async_wait1", "ldcg_f32"]

if SIM:
    from kernels_numba.ptx import f32_to_bf16_bits

    def prmt(a, b, sel):
        src = int(a) & 0xFFFFFFFF | ((int(b) & 0xFFFFFFFF) << 32)
        out = 0
        for k in range(4):
            out |= ((src >> (8 * ((int(sel) >> (4 * k)) & 7))) & 0xFF) << (8 * k)
        return np.uint32(out)

    def _half(u: int) -> float:
        return float(np.uint32((u & 0xFFFF) << 16).view(np.float32))

    def fma_bf16x2(a, b, c):
        out = 0
        for k in (0, 16):
            v = _half(int(a) >> k) * _half(int(b) >> k) + _half(int(c) >> k)
            out |= int(f32_to_bf16_bits(np.array([v], np.float32))[0]) << k
        return np.uint32(out)

    def cp_async8(s, i, x, r, c):
        s[i] = np.uint32(int(x[r, c]) | (int(x[r, c + 1]) << 16))
        s[i + 1] = np.uint32(int(x[r, c + 2]) | (int(x[r, c + 3]) << 16))

    def cp_async_zero8(s, i):
        s[i] = np.uint32(0)
        s[i + 1] = np.uint32(0)

    def cp_async_commit():
        pass

    def cp_async_wait0():
        pass

    def cp_async_wait1():
        pass

    def ldcg_f32(a, i):
        return np.float32(a[i])

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _i32 = ir.IntType(32)
    _f32 = ir.FloatType()

    def _item_ptr(context, builder, aryty, ary, idx_types, idx_vals):
        arr = context.make_array(aryty)(context, builder, value=ary)
        inds = [context.cast(builder, v, t, types.intp) for v, t in zip(idx_vals, idx_types)]
        return cgutils.get_item_pointer(context, builder, aryty, arr, inds, wraparound=False)

    def _shared_addr(context, builder, sig, args):
        """The 32-bit shared-window address of s[i] (s a shared uint32 array)."""
        ptr = _item_ptr(context, builder, sig.args[0], args[0], sig.args[1:2], args[1:2])
        sp = builder.addrspacecast(builder.bitcast(ptr, ir.IntType(8).as_pointer()), ir.PointerType(ir.IntType(8), 3))
        return builder.trunc(builder.ptrtoint(sp, ir.IntType(64)), _i32)

    @intrinsic
    def prmt(typingctx, a, b, sel):
        if not isinstance(sel, types.IntegerLiteral):
            return None
        s = int(sel.literal_value)

        def gen(context, builder, sig, args):
            x, y = (context.cast(builder, v, t, types.uint32) for v, t in zip(args[:2], sig.args[:2]))
            asm = ir.InlineAsm(ir.FunctionType(_i32, [_i32, _i32]), f"prmt.b32 $0, $1, $2, {s:#x};", "=r,r,r")
            return builder.call(asm, [x, y])
        return types.uint32(a, b, sel), gen

    @intrinsic
    def fma_bf16x2(typingctx, a, b, c):
        def gen(context, builder, sig, args):
            regs = [context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args)]
            asm = ir.InlineAsm(ir.FunctionType(_i32, [_i32] * 3), "fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r")
            return builder.call(asm, regs)
        return types.uint32(a, b, c), gen

    @intrinsic
    def cp_async8(typingctx, s, i, x, r, c):
        if not (isinstance(s, types.Array) and s.dtype == types.uint32 and s.ndim == 1
                and isinstance(x, types.Array) and x.dtype == types.uint16 and x.ndim == 2):
            return None

        def gen(context, builder, sig, args):
            dst = _shared_addr(context, builder, sig, args)
            src = _item_ptr(context, builder, sig.args[2], args[2], sig.args[3:5], args[3:5])
            g = builder.addrspacecast(builder.bitcast(src, ir.IntType(8).as_pointer()), ir.PointerType(ir.IntType(8), 1))
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_i32, g.type]),
                               "cp.async.ca.shared.global [$0], [$1], 8;", "r,l", side_effect=True)
            builder.call(asm, [dst, g])
            return context.get_dummy_value()
        return types.void(s, i, x, r, c), gen

    @intrinsic
    def cp_async_zero8(typingctx, s, i):
        if not (isinstance(s, types.Array) and s.dtype == types.uint32 and s.ndim == 1):
            return None

        def gen(context, builder, sig, args):
            dst = _shared_addr(context, builder, sig, args)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_i32, _i32]), "st.shared.v2.u32 [$0], {$1, $1};",
                               "r,r", side_effect=True)
            builder.call(asm, [dst, ir.Constant(_i32, 0)])
            return context.get_dummy_value()
        return types.void(s, i), gen

    def _bare(text: str):
        def gen(context, builder, sig, args):
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True), [])
            return context.get_dummy_value()
        return gen

    @intrinsic
    def cp_async_commit(typingctx):
        return types.void(), _bare("cp.async.commit_group;")

    @intrinsic
    def cp_async_wait0(typingctx):
        return types.void(), _bare("cp.async.wait_group 0;")

    @intrinsic
    def cp_async_wait1(typingctx):
        return types.void(), _bare("cp.async.wait_group 1;")

    @intrinsic
    def ldcg_f32(typingctx, a, i):
        if not (isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 1):
            return None

        def gen(context, builder, sig, args):
            ptr = _item_ptr(context, builder, sig.args[0], args[0], sig.args[1:2], args[1:2])
            g = builder.addrspacecast(ptr, ir.PointerType(_f32, 1))
            asm = ir.InlineAsm(ir.FunctionType(_f32, [g.type]), "ld.global.cg.f32 $0, [$1];", "=f,l", side_effect=True)
            return builder.call(asm, [g])
        return types.float32(a, i), gen
