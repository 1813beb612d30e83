"""Inline-PTX device intrinsics that Numba cannot emit by itself, each with a simulator twin.

Kernels call these names and get, on a real GPU, one instruction each:
  ldg_u16x8(a, r, c)    16-byte `ld.global.nc.v4.u32` of a[r, c:c+8] (2-D uint16) -> 4 x uint32
  ldg_f32x4(a, r, c)    16-byte `ld.global.nc.v4.f32` of a[r, c:c+4] (2-D float32) -> 4 x float32
  lds_u32x4(s, i)       16-byte `ld.shared.v4.u32` of s[i:i+4] (1-D uint32 shared) -> 4 x uint32
  sts_u32x4(s, i, a, b, c, d)   16-byte `st.shared.v4.u32`
  pack_bf16x2(lo, hi)   `cvt.rn.bf16x2.f32`: two float32 -> one uint32 of bf16 (lo in bits 0..15)
  bf16lo_f32(u) / bf16hi_f32(u)  the bf16 in the low / high half of a uint32, as float32
  mma_bf16_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)
                        `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` (PTX ISA layout)
  warp_sum_f32(v)       sum over the 32 lanes of a warp (shfl.sync.bfly), every lane gets it
  shfl_xor_f32(v, m)    `shfl.sync.bfly.b32`: the v of lane (lane ^ m), all 32 lanes, m in 1..31
  ex2_f32(x)            `ex2.approx.ftz.f32`: 2**x (-inf and large negative x give +0)
  ldsm_x4_trans(s, i)   `ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16`: lane L names row L & 7 of
                        8x8 bf16 matrix L >> 3 by s[i:i+4] (1-D uint32 shared, i a multiple of 4);
                        returns, per matrix m, {M_m[2t][g], M_m[2t+1][g]} packed (lo = row 2t),
                        g = lane >> 2, t = lane & 3: the mma B fragment of a row-major [k][n] tile

Invariants: vector accesses need 16-byte aligned addresses (c a multiple of 8 for u16, 4 for f32,
row pitch a multiple of 16 bytes; i a multiple of 4; shared arrays declared with alignment=16).
Warp-collective calls (mma, warp_sum) must be reached by all 32 lanes of a warp the same number
of times, as on the hardware.

Under NUMBA_ENABLE_CUDASIM=1 the same names are plain Python: loads are indexing, and the
warp-collective ones exchange values between the simulator's lane threads through a per-warp
barrier, so kernels that use mma and warp sums run unchanged in the simulator (slowly).
"""
from __future__ import annotations

import numpy as np

from numba.cuda.core import config as _config

SIM = bool(_config.ENABLE_CUDASIM)

__all__ = ["SIM", "ldg_u16x8", "ldg_f32x4", "lds_u32x4", "sts_u32x4", "pack_bf16x2",
           "bf16lo_f32", "bf16hi_f32", "mma_bf16_16816", "warp_sum_f32", "bf16_bits_to_f32",
           "f32_to_bf16_bits", "shfl_xor_f32", "ex2_f32", "ldsm_x4_trans"]


def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Host helper: float32 -> bf16 bits (uint16), round to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(a, dtype=np.float32))
    return np.where(nan, np.uint16(0x7FC0), r).astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    """Host helper: bf16 bits (uint16) -> float32."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


if SIM:
    import threading

    def _f32(u):
        return np.uint32(u).view(np.float32)

    def ldg_u16x8(a, r, c):
        v = [int(a[r, c + i]) for i in range(8)]
        return (np.uint32(v[0] | (v[1] << 16)), np.uint32(v[2] | (v[3] << 16)),
                np.uint32(v[4] | (v[5] << 16)), np.uint32(v[6] | (v[7] << 16)))

    def ldg_f32x4(a, r, c):
        return (np.float32(a[r, c]), np.float32(a[r, c + 1]),
                np.float32(a[r, c + 2]), np.float32(a[r, c + 3]))

    def lds_u32x4(s, i):
        return (np.uint32(s[i]), np.uint32(s[i + 1]), np.uint32(s[i + 2]), np.uint32(s[i + 3]))

    def sts_u32x4(s, i, a, b, c, d):
        s[i] = a
        s[i + 1] = b
        s[i + 2] = c
        s[i + 3] = d

    def _bf16_bits(x) -> int:
        return int(f32_to_bf16_bits(np.array([x], dtype=np.float32))[0])

    def pack_bf16x2(lo, hi):
        return np.uint32(_bf16_bits(lo) | (_bf16_bits(hi) << 16))

    def bf16lo_f32(u):
        return _f32((int(u) & 0xFFFF) << 16)

    def bf16hi_f32(u):
        return _f32(int(u) & 0xFFFF0000)

    class _Warp:
        """Lanes of one simulated warp meet at a barrier; the last to arrive runs the op and wakes
        each other lane through its own lock (one wake a lane an exchange). The results of one
        exchange stay readable until the next completes, which needs every lane to arrive again."""

        def __init__(self, nlanes: int):
            self.n, self.arrived, self.broken = nlanes, 0, False
            self.slots: list = [None] * nlanes
            self.out: list = [None] * nlanes
            self.lock = threading.Lock()
            self.wake = [threading.Lock() for _ in range(nlanes)]
            for w in self.wake:
                w.acquire()

        def exchange(self, lane: int, op, value):
            with self.lock:
                if self.broken:
                    raise threading.BrokenBarrierError
                self.slots[lane] = value
                self.arrived += 1
                if self.arrived == self.n:
                    self.arrived = 0
                    try:
                        self.out = op(self.slots)
                    except BaseException:
                        self.broken = True
                        raise
                    finally:
                        for i, w in enumerate(self.wake):
                            if i != lane:
                                w.release()
                    return self.out[lane]
            if not self.wake[lane].acquire(timeout=120):
                with self.lock:
                    self.broken = True
                raise threading.BrokenBarrierError
            if self.broken:
                raise threading.BrokenBarrierError
            return self.out[lane]

    _warps: dict = {}
    _warps_lock = threading.Lock()

    def _my_warp():
        t = threading.current_thread()
        bd = t._manager._block_dim
        nthreads = int(np.prod(bd))
        tid = t.thread_id
        w = tid // 32
        key = (tuple(t.blockIdx), w, tuple(bd))
        with _warps_lock:
            st = _warps.get(key)
            if st is None:
                st = _warps[key] = _Warp(min(32, nthreads - 32 * w))
        return st, tid % 32

    def _sum_op(slots):
        s = np.float32(0)
        for v in slots:
            s = np.float32(s + np.float32(v))
        return [s] * len(slots)

    def warp_sum_f32(v):
        st, lane = _my_warp()
        return st.exchange(lane, _sum_op, v)

    def _unpack2(u):
        u = int(u)
        return bf16lo_f32(u), bf16hi_f32(u)

    def _mma_op(slots):
        A = np.zeros((16, 16), np.float64)
        B = np.zeros((16, 8), np.float64)
        C = np.zeros((16, 8), np.float64)
        for lane, (a, b, c) in enumerate(slots):
            g, t = lane >> 2, lane & 3
            A[g, 2 * t:2 * t + 2] = _unpack2(a[0])
            A[g + 8, 2 * t:2 * t + 2] = _unpack2(a[1])
            A[g, 2 * t + 8:2 * t + 10] = _unpack2(a[2])
            A[g + 8, 2 * t + 8:2 * t + 10] = _unpack2(a[3])
            B[2 * t:2 * t + 2, g] = _unpack2(b[0])
            B[2 * t + 8:2 * t + 10, g] = _unpack2(b[1])
            C[g, 2 * t:2 * t + 2] = c[0], c[1]
            C[g + 8, 2 * t:2 * t + 2] = c[2], c[3]
        D = (A @ B + C).astype(np.float32)
        out = []
        for lane in range(len(slots)):
            g, t = lane >> 2, lane & 3
            out.append((D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]))
        return out

    def mma_bf16_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        st, lane = _my_warp()
        return st.exchange(lane, _mma_op, ((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3)))

    def shfl_xor_f32(v, m):
        st, lane = _my_warp()
        m = int(m)
        return st.exchange(lane, lambda slots: [np.float32(slots[i ^ m]) for i in range(len(slots))],
                           np.float32(v))

    def ex2_f32(x):
        with np.errstate(over="ignore", under="ignore"):
            return np.float32(np.exp2(np.float32(x)))

    def _ldsm_trans_op(slots):
        rows = [[int(s_[i_ + k]) for k in range(4)] for s_, i_ in slots]  # lane L: row L&7 of L>>3

        def elem(m, r, c):
            w = rows[8 * m + r][c >> 1]
            return (w >> (16 * (c & 1))) & 0xFFFF

        out = []
        for lane in range(len(slots)):
            g, t = lane >> 2, lane & 3
            out.append(tuple(np.uint32(elem(m, 2 * t, g) | (elem(m, 2 * t + 1, g) << 16))
                             for m in range(4)))
        return out

    def ldsm_x4_trans(s, i):
        st, lane = _my_warp()
        return st.exchange(lane, _ldsm_trans_op, (s, int(i)))

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _i32 = ir.IntType(32)
    _f32t = ir.FloatType()

    def _elem_ptr(context, builder, aryty, ary, idx_types, idx_vals):
        """Pointer to ary[idx...] (no wraparound, no bounds check)."""
        arr = context.make_array(aryty)(context, builder, value=ary)
        inds = [context.cast(builder, v, t, types.intp) for v, t in zip(idx_vals, idx_types)]
        return cgutils.get_item_pointer(context, builder, aryty, arr, inds, wraparound=False)

    def _tuple(context, builder, rettype, asm_result, n):
        vals = [builder.extract_value(asm_result, i) for i in range(n)]
        return context.make_tuple(builder, rettype, vals)

    def _ldg_v4(elem_llty, reg, ptxty):
        def gen(context, builder, sig, args):
            aryty = sig.args[0]
            ptr = _elem_ptr(context, builder, aryty, args[0], sig.args[1:], args[1:])
            gptr = builder.addrspacecast(builder.bitcast(ptr, ir.IntType(8).as_pointer()),
                                         ir.PointerType(ir.IntType(8), 1))
            sty = ir.LiteralStructType([elem_llty] * 4)
            fty = ir.FunctionType(sty, [gptr.type])
            asm = ir.InlineAsm(fty, f"ld.global.nc.v4.{ptxty} {{$0, $1, $2, $3}}, [$4];",
                               f"={reg},={reg},={reg},={reg},l")
            return _tuple(context, builder, sig.return_type, builder.call(asm, [gptr]), 4)
        return gen

    @intrinsic
    def ldg_u16x8(typingctx, a, r, c):
        if not (isinstance(a, types.Array) and a.dtype == types.uint16 and a.ndim == 2):
            return None
        return types.UniTuple(types.uint32, 4)(a, r, c), _ldg_v4(_i32, "r", "u32")

    @intrinsic
    def ldg_f32x4(typingctx, a, r, c):
        if not (isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 2):
            return None
        return types.UniTuple(types.float32, 4)(a, r, c), _ldg_v4(_f32t, "f", "f32")

    def _shared_v4_ptr(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], sig.args[1:2], args[1:2])
        vty = ir.VectorType(_i32, 4)
        return builder.addrspacecast(builder.bitcast(ptr, vty.as_pointer()),
                                     ir.PointerType(vty, 3))

    @intrinsic
    def lds_u32x4(typingctx, s, i):
        if not (isinstance(s, types.Array) and s.dtype == types.uint32 and s.ndim == 1):
            return None

        def gen(context, builder, sig, args):
            v = builder.load(_shared_v4_ptr(context, builder, sig, args), align=16)
            vals = [builder.extract_element(v, ir.Constant(_i32, k)) for k in range(4)]
            return context.make_tuple(builder, sig.return_type, vals)
        return types.UniTuple(types.uint32, 4)(s, i), gen

    @intrinsic
    def sts_u32x4(typingctx, s, i, a, b, c, d):
        if not (isinstance(s, types.Array) and s.dtype == types.uint32 and s.ndim == 1):
            return None

        def gen(context, builder, sig, args):
            p = _shared_v4_ptr(context, builder, sig, args)
            v = ir.Constant(ir.VectorType(_i32, 4), ir.Undefined)
            for k in range(4):
                x = context.cast(builder, args[2 + k], sig.args[2 + k], types.uint32)
                v = builder.insert_element(v, x, ir.Constant(_i32, k))
            builder.store(v, p, align=16)
            return context.get_dummy_value()
        return types.void(s, i, a, b, c, d), gen

    @intrinsic
    def pack_bf16x2(typingctx, lo, hi):
        def gen(context, builder, sig, args):
            lo_, hi_ = (context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args))
            fty = ir.FunctionType(_i32, [_f32t, _f32t])
            # cvt.rn.bf16x2.f32 d, a, b: d.hi = bf16(a), d.lo = bf16(b)
            return builder.call(ir.InlineAsm(fty, "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f"),
                                [hi_, lo_])
        return types.uint32(lo, hi), gen

    def _bits_to_f32(mask_hi: bool):
        def gen(context, builder, sig, args):
            u = context.cast(builder, args[0], sig.args[0], types.uint32)
            u = builder.and_(u, ir.Constant(_i32, 0xFFFF0000)) if mask_hi else \
                builder.shl(u, ir.Constant(_i32, 16))
            return builder.bitcast(u, _f32t)
        return gen

    @intrinsic
    def bf16lo_f32(typingctx, u):
        return types.float32(u), _bits_to_f32(False)

    @intrinsic
    def bf16hi_f32(typingctx, u):
        return types.float32(u), _bits_to_f32(True)

    @intrinsic
    def mma_bf16_16816(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        def gen(context, builder, sig, args):
            regs = [context.cast(builder, v, t, types.uint32)
                    for v, t in zip(args[:6], sig.args[:6])]
            accs = [context.cast(builder, v, t, types.float32)
                    for v, t in zip(args[6:], sig.args[6:])]
            sty = ir.LiteralStructType([_f32t] * 4)
            fty = ir.FunctionType(sty, [_i32] * 6 + [_f32t] * 4)
            asm = ir.InlineAsm(
                fty,
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3")
            return _tuple(context, builder, sig.return_type, builder.call(asm, regs + accs), 4)
        sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        return sig, gen

    @intrinsic
    def warp_sum_f32(typingctx, v):
        # an intrinsic, not a device function: compile_ptx of a kernel calling a device function
        # needs a GPU (the dispatcher asks the current device for its compute capability)
        def gen(context, builder, sig, args):
            x = context.cast(builder, args[0], sig.args[0], types.float32)
            fty = ir.FunctionType(_f32t, [_i32, _f32t, _i32, _i32])
            shfl = cgutils.get_or_insert_function(builder.module, fty,
                                                  "llvm.nvvm.shfl.sync.bfly.f32")
            for off in (16, 8, 4, 2, 1):
                y = builder.call(shfl, [ir.Constant(_i32, 0xFFFFFFFF), x, ir.Constant(_i32, off),
                                        ir.Constant(_i32, 0x1F)])
                x = builder.fadd(x, y)
            return x
        return types.float32(v), gen


    @intrinsic
    def shfl_xor_f32(typingctx, v, m):
        def gen(context, builder, sig, args):
            x = context.cast(builder, args[0], sig.args[0], types.float32)
            mm = context.cast(builder, args[1], sig.args[1], types.int32)
            fty = ir.FunctionType(_f32t, [_i32, _f32t, _i32, _i32])
            shfl = cgutils.get_or_insert_function(builder.module, fty,
                                                  "llvm.nvvm.shfl.sync.bfly.f32")
            return builder.call(shfl, [ir.Constant(_i32, 0xFFFFFFFF), x, mm, ir.Constant(_i32, 0x1F)])
        return types.float32(v, m), gen

    @intrinsic
    def ex2_f32(typingctx, x):
        def gen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], types.float32)
            fty = ir.FunctionType(_f32t, [_f32t])
            return builder.call(ir.InlineAsm(fty, "ex2.approx.ftz.f32 $0, $1;", "=f,f"), [v])
        return types.float32(x), gen


    @intrinsic
    def ldsm_x4_trans(typingctx, s, i):
        if not (isinstance(s, types.Array) and s.dtype == types.uint32 and s.ndim == 1):
            return None

        def gen(context, builder, sig, args):
            p = _shared_v4_ptr(context, builder, sig, args)
            addr = builder.ptrtoint(p, ir.IntType(64))
            sty = ir.LiteralStructType([_i32] * 4)
            fty = ir.FunctionType(sty, [ir.IntType(64)])
            asm = ir.InlineAsm(fty, "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 "
                               "{$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", side_effect=True)
            return _tuple(context, builder, sig.return_type, builder.call(asm, [addr]), 4)
        return types.UniTuple(types.uint32, 4)(s, i), gen


# ----------------------------------------------------------------------------- tf32 mma
# (appended for kernels_numba/flash_decode.py)
#   mma_tf32_1688(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)
#       `mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`; a*/b* are float32 values whose bits
#       are the tf32 operands (the tensor core ignores the low 13 mantissa bits; bf16 values are
#       exact). Layout (PTX ISA, g = lane >> 2, t = lane & 3): a0 = A[g][t], a1 = A[g+8][t],
#       a2 = A[g][t+4], a3 = A[g+8][t+4]; b0 = B[t][g], b1 = B[t+4][g]; C/D as m16n8k16.
#   tf32_rna(x)  `cvt.rna.tf32.f32`: x rounded to tf32 (nearest, ties away), as float32
__all__ += ["mma_tf32_1688", "tf32_rna"]

if SIM:
    def _tf32_trunc(x) -> float:
        u = np.array([x], np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
        return float(u.view(np.float32)[0])

    def _mma_tf32_op(slots):
        A = np.zeros((16, 8), np.float64)
        B = np.zeros((8, 8), np.float64)
        C = np.zeros((16, 8), np.float64)
        for lane, (a, b, c) in enumerate(slots):
            g, t = lane >> 2, lane & 3
            A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4] = (_tf32_trunc(v) for v in a)
            B[t, g], B[t + 4, g] = _tf32_trunc(b[0]), _tf32_trunc(b[1])
            C[g, 2 * t:2 * t + 2] = c[0], c[1]
            C[g + 8, 2 * t:2 * t + 2] = c[2], c[3]
        D = (A @ B + C).astype(np.float32)
        out = []
        for lane in range(len(slots)):
            g, t = lane >> 2, lane & 3
            out.append((D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]))
        return out

    def mma_tf32_1688(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        st, lane = _my_warp()
        return st.exchange(lane, _mma_tf32_op, ((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3)))

    def tf32_rna(x):
        u = int(np.array([x], np.float32).view(np.uint32)[0])
        if (u & 0x7F800000) != 0x7F800000:  # inf / nan pass through
            u = (u + 0x1000) & 0xFFFFE000
        return np.uint32(u).view(np.float32)

else:
    @intrinsic
    def mma_tf32_1688(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        def gen(context, builder, sig, args):
            regs = [builder.bitcast(context.cast(builder, v, t, types.float32), _i32)
                    for v, t in zip(args[:6], sig.args[:6])]
            accs = [context.cast(builder, v, t, types.float32)
                    for v, t in zip(args[6:], sig.args[6:])]
            sty = ir.LiteralStructType([_f32t] * 4)
            fty = ir.FunctionType(sty, [_i32] * 6 + [_f32t] * 4)
            asm = ir.InlineAsm(
                fty,
                "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3")
            return _tuple(context, builder, sig.return_type, builder.call(asm, regs + accs), 4)
        sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        return sig, gen

    @intrinsic
    def tf32_rna(typingctx, x):
        def gen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], types.float32)
            fty = ir.FunctionType(_i32, [_f32t])
            r = builder.call(ir.InlineAsm(fty, "cvt.rna.tf32.f32 $0, $1;", "=r,f"), [v])
            return builder.bitcast(r, _f32t)
        return types.float32(x), gen


# ----------------------------------------------------------------------------- grid dependency control
# (programmatic dependent launch, sm_90+; kernels_numba/pdl.py launches the kernels that call these)
#   grid_wait()     `griddepcontrol.wait`: block until every prerequisite grid has completed and its
#                   memory is visible. A kernel that calls it FIRST may be launched with programmatic
#                   stream serialization: it then starts while its predecessor is still running.
#                   Without that launch attribute it returns at once.
#   grid_trigger()  `griddepcontrol.launch_dependents`: once every CTA of this grid has issued it (or
#                   exited), the next PDL-launched grid may be scheduled. Call it after grid_wait().
#   grid_trigger_late()  the same instruction at a kernel's end of streaming (after its main loop,
#                   before its reductions and stores): compiled in only in the `late` mode, so a
#                   successor's blocks start (and issue their weight loads) while this grid finishes
#                   its epilogue, not while it streams.
#   grid_trigger_early()  grid_trigger() of a kernel that also has a late site: compiled in only in
#                   the `early` mode (in `late` mode such a kernel triggers late, every other kernel
#                   still early).
__all__ += ["grid_wait", "grid_trigger", "grid_trigger_early", "grid_trigger_late"]
TRIGGER_MODES = ("early", "late", "exit")

if SIM:
    def grid_wait():
        return None

    def grid_trigger():
        return None

    def grid_trigger_late():
        return None

    def grid_trigger_early():
        return None

else:
    # Which trigger calls compile to the instruction, read when a kernel compiles (pdl.set_trigger,
    # from levers.pdl_trigger): `early` grid_trigger() and grid_trigger_early(); `late`
    # grid_trigger() and grid_trigger_late(); `exit` none (a successor launches as this grid's
    # blocks exit).
    TRIGGER = {"mode": "early"}

    def _griddepcontrol(op: str, modes: tuple = ()):
        def gen(context, builder, sig, args):
            if modes and TRIGGER["mode"] not in modes:
                return context.get_dummy_value()
            fty = ir.FunctionType(ir.VoidType(), [])
            builder.call(ir.InlineAsm(fty, f"griddepcontrol.{op};", "~{memory}", side_effect=True), [])
            return context.get_dummy_value()
        return gen

    @intrinsic
    def grid_wait(typingctx):
        return types.none(), _griddepcontrol("wait")

    @intrinsic
    def grid_trigger(typingctx):
        return types.none(), _griddepcontrol("launch_dependents", ("early", "late"))

    @intrinsic
    def grid_trigger_early(typingctx):
        return types.none(), _griddepcontrol("launch_dependents", ("early",))

    @intrinsic
    def grid_trigger_late(typingctx):
        return types.none(), _griddepcontrol("launch_dependents", ("late",))


# ----------------------------------------------------------------------------- L2 prefetch
#   prefetch_l2(a, r, c)   `prefetch.global.L2` of the 128-byte line holding a[r, c] (2-D uint16):
#                          a kernel parked at its PDL wait pulls weights it will stream into L2
#                          while the kernels before it are latency-bound (decode attention).
__all__ += ["prefetch_l2"]

if SIM:
    def prefetch_l2(a, r, c):
        return None

else:
    @intrinsic
    def prefetch_l2(typingctx, a, r, c):
        if not (isinstance(a, types.Array) and a.dtype == types.uint16 and a.ndim == 2):
            return None

        def gen(context, builder, sig, args):
            ptr = _elem_ptr(context, builder, sig.args[0], args[0], sig.args[1:], args[1:])
            gptr = builder.addrspacecast(builder.bitcast(ptr, ir.IntType(8).as_pointer()),
                                         ir.PointerType(ir.IntType(8), 1))
            fty = ir.FunctionType(ir.VoidType(), [gptr.type])
            builder.call(ir.InlineAsm(fty, "prefetch.global.L2 [$0];", "l", side_effect=True), [gptr])
            return context.get_dummy_value()
        return types.none(a, r, c), gen
