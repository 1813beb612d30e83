"""bf16 <-> f32 conversions, warp/block reductions, and the SIMULATOR flag every kernel module uses.

bf16 lives on the device as uint16 bits: f32 = (uint32(u16) << 16) reinterpreted; f32 -> bf16
rounds to nearest even (NaN stays a quiet NaN), the same as ml_dtypes.

The CUDA simulator (NUMBA_ENABLE_CUDASIM=1) has no warp shuffles and no bit reinterpretation, so
every device helper here has two bodies chosen at import time: shuffles and libdevice bitcasts on
the GPU, shared-memory exchanges and table lookups in the simulator. Kernel code calls the same
names either way. Invariants for callers:
- reductions are collective: every thread of the block (simulator) / of the warp (GPU) calls them
  the same number of times, so loops around them must be block-uniform;
- `scratch` arguments are shared float32 arrays with at least max(32, blockDim.x) entries
  (`scratch2d`: [blockDim.x, n]); the GPU bodies use at most 32 entries, the simulator all;
- block sizes are multiples of 32.
"""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
from numba import cuda
from numba.cuda.core import config as _numba_cuda_config

SIMULATOR: bool = bool(_numba_cuda_config.ENABLE_CUDASIM)
FULL_MASK = 0xFFFFFFFF
NEG_INF = np.float32(-np.inf)


def device_function(fn):
    """`cuda.jit(device=True)`, force-inlined on the GPU (the simulator has no such option)."""
    if SIMULATOR:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


# ---------------------------------------------------------------- host helpers


def to_bf16_bits(a) -> np.ndarray:
    """float array -> bf16 bits (uint16), round to nearest even."""
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32).astype(ml_dtypes.bfloat16)).view(np.uint16)


def from_bf16_bits(u) -> np.ndarray:
    """bf16 bits (uint16) -> float32."""
    return np.ascontiguousarray(np.asarray(u, dtype=np.uint16)).view(ml_dtypes.bfloat16).astype(np.float32)


def bf16_round(a) -> np.ndarray:
    """Round float values to bf16 precision, returned as float32 (what the cache stores)."""
    return np.asarray(a, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


# ---------------------------------------------------------------- conversions

if SIMULATOR:
    _BF16_TO_F32 = (np.arange(65536, dtype=np.uint32) << np.uint32(16)).view(np.float32)

    def _f32_bits(x) -> int:
        return struct.unpack("<I", struct.pack("<f", float(x)))[0]

    def _rne_bits(b: int) -> int:
        if (b & 0x7FFFFFFF) > 0x7F800000:
            return ((b >> 16) | 0x40) & 0xFFFF
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF

    @cuda.jit(device=True)
    def bf16_to_f32(u):
        return _BF16_TO_F32[int(u) & 0xFFFF]

    @cuda.jit(device=True)
    def f32_to_bf16(x):
        return np.uint16(_rne_bits(_f32_bits(x)))

    @cuda.jit(device=True)
    def unpack_bf16x2(w):
        w = int(w)
        return _BF16_TO_F32[w & 0xFFFF], _BF16_TO_F32[(w >> 16) & 0xFFFF]

    @cuda.jit(device=True)
    def unpack_bf16x4(w):
        w = int(w)
        return (
            _BF16_TO_F32[w & 0xFFFF],
            _BF16_TO_F32[(w >> 16) & 0xFFFF],
            _BF16_TO_F32[(w >> 32) & 0xFFFF],
            _BF16_TO_F32[(w >> 48) & 0xFFFF],
        )

    @cuda.jit(device=True)
    def pack_bf16x2(a, b):
        return np.uint32(_rne_bits(_f32_bits(a)) | (_rne_bits(_f32_bits(b)) << 16))

    @cuda.jit(device=True)
    def f32_order_key(x):
        b = _f32_bits(float(x) + 0.0)
        return np.uint32((~b) & 0xFFFFFFFF) if b & 0x80000000 else np.uint32(b | 0x80000000)

else:
    from numba.cuda import libdevice

    @device_function
    def bf16_to_f32(u):
        return libdevice.int_as_float(np.int32(np.uint32(u) << np.uint32(16)))

    @device_function
    def _rne(x):
        b = np.uint32(libdevice.float_as_int(x))
        if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            return (b >> np.uint32(16)) | np.uint32(0x40)
        return (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)

    @device_function
    def f32_to_bf16(x):
        return np.uint16(_rne(x))

    @device_function
    def f32_order_key(x):
        """uint32 whose unsigned order is x's float order (-0.0 taken as +0.0)."""
        b = np.uint32(libdevice.float_as_int(x + np.float32(0.0)))
        if b & np.uint32(0x80000000):
            return ~b
        return b | np.uint32(0x80000000)

    @device_function
    def unpack_bf16x2(w):
        w = np.uint32(w)
        return (
            libdevice.int_as_float(np.int32(w << np.uint32(16))),
            libdevice.int_as_float(np.int32(w & np.uint32(0xFFFF0000))),
        )

    @device_function
    def unpack_bf16x4(w):
        lo = np.uint32(w & np.uint64(0xFFFFFFFF))
        hi = np.uint32(w >> np.uint64(32))
        return (
            libdevice.int_as_float(np.int32(lo << np.uint32(16))),
            libdevice.int_as_float(np.int32(lo & np.uint32(0xFFFF0000))),
            libdevice.int_as_float(np.int32(hi << np.uint32(16))),
            libdevice.int_as_float(np.int32(hi & np.uint32(0xFFFF0000))),
        )

    @device_function
    def pack_bf16x2(a, b):
        return np.uint32(_rne(a) | (_rne(b) << np.uint32(16)))


# ---------------------------------------------------------------- 16-byte loads

if SIMULATOR:

    def ldg_u64x2(a, idx):
        """(a[idx], a[idx with last index + 1]) of a uint64 array: one 16-byte load on the GPU."""
        *head, last = idx
        return a[idx], a[(*head, last + 1)]

else:
    from llvmlite import ir as _ir
    from numba import types as _types
    from numba.cuda import cgutils as _cgutils
    from numba.cuda.extending import intrinsic as _intrinsic

    @_intrinsic
    def ldg_u64x2(typingctx, a, idx):
        """`ld.global.nc.v2.u64` of a[idx], a[idx with last index + 1]; idx is a tuple of a.ndim
        ints; the address must be 16-byte aligned (last index even, row pitch a multiple of 16 B)."""
        if not (
            isinstance(a, _types.Array)
            and a.dtype == _types.uint64
            and isinstance(idx, _types.BaseTuple)
            and len(idx) == a.ndim
        ):
            return None

        def gen(context, builder, sig, args):
            aryty, idxty = sig.args
            arr = context.make_array(aryty)(context, builder, value=args[0])
            vals = _cgutils.unpack_tuple(builder, args[1], len(idxty))
            inds = [context.cast(builder, v, t, _types.intp) for v, t in zip(vals, idxty)]
            ptr = _cgutils.get_item_pointer(context, builder, aryty, arr, inds, wraparound=False)
            gptr = builder.addrspacecast(
                builder.bitcast(ptr, _ir.IntType(8).as_pointer()), _ir.PointerType(_ir.IntType(8), 1)
            )
            i64 = _ir.IntType(64)
            fty = _ir.FunctionType(_ir.LiteralStructType([i64, i64]), [gptr.type])
            asm = _ir.InlineAsm(fty, "ld.global.nc.v2.u64 {$0, $1}, [$2];", "=l,=l,l")
            res = builder.call(asm, [gptr])
            parts = [builder.extract_value(res, 0), builder.extract_value(res, 1)]
            return context.make_tuple(builder, sig.return_type, parts)

        return _types.UniTuple(_types.uint64, 2)(a, idx), gen


# ---------------------------------------------------------------- reductions


@device_function
def _argmax_better(ov, oi, bv, bi):
    """Is candidate (ov, oi) better than (bv, bi)? Index < 0 marks an empty candidate."""
    if oi < 0:
        return False
    return bi < 0 or ov > bv or (ov == bv and oi < bi)


if SIMULATOR:

    @cuda.jit(device=True)
    def group_sum(v, width, scratch):
        """Sum over each aligned group of `width` lanes (power of two <= 32); all lanes get it."""
        tid = cuda.threadIdx.x
        cuda.syncthreads()
        scratch[tid] = v
        cuda.syncthreads()
        base = tid - tid % width
        s = np.float32(0.0)
        for i in range(width):
            s += scratch[base + i]
        return np.float32(s)

    @cuda.jit(device=True)
    def group_max(v, width, scratch):
        tid = cuda.threadIdx.x
        cuda.syncthreads()
        scratch[tid] = v
        cuda.syncthreads()
        base = tid - tid % width
        m = scratch[base]
        for i in range(1, width):
            m = max(m, scratch[base + i])
        return np.float32(m)

    @cuda.jit(device=True)
    def group_sum_vec(vals, n, width, scratch2d):
        """In-place group_sum of vals[0:n] (a local array), one exchange for all n values."""
        tid = cuda.threadIdx.x
        cuda.syncthreads()
        for j in range(n):
            scratch2d[tid, j] = vals[j]
        cuda.syncthreads()
        base = tid - tid % width
        for j in range(n):
            s = np.float32(0.0)
            for i in range(width):
                s += scratch2d[base + i, j]
            vals[j] = s

    @cuda.jit(device=True)
    def block_sum(v, scratch):
        """Sum over the whole block, returned to every thread."""
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        cuda.syncthreads()
        scratch[tid] = v
        cuda.syncthreads()
        s = np.float32(0.0)
        for i in range(nt):
            s += scratch[i]
        cuda.syncthreads()
        return np.float32(s)

    @cuda.jit(device=True)
    def block_max(v, scratch):
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        cuda.syncthreads()
        scratch[tid] = v
        cuda.syncthreads()
        m = scratch[0]
        for i in range(1, nt):
            m = max(m, scratch[i])
        cuda.syncthreads()
        return np.float32(m)

    @cuda.jit(device=True)
    def block_argmax(v, idx, vscratch, iscratch):
        """(max value, its lowest index) over the block; ties go to the lower index; idx < 0 = empty."""
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        cuda.syncthreads()
        vscratch[tid] = v
        iscratch[tid] = idx
        cuda.syncthreads()
        bv = vscratch[0]
        bi = iscratch[0]
        for i in range(1, nt):
            ov = vscratch[i]
            oi = iscratch[i]
            if _argmax_better(ov, oi, bv, bi):
                bv = ov
                bi = oi
        cuda.syncthreads()
        return bv, bi

else:

    @device_function
    def group_sum(v, width, scratch):
        """Sum over each aligned group of `width` lanes (power of two <= 32); all lanes get it."""
        off = width >> 1
        while off > 0:
            v += cuda.shfl_xor_sync(FULL_MASK, v, off)
            off >>= 1
        return v

    @device_function
    def group_max(v, width, scratch):
        off = width >> 1
        while off > 0:
            v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, off))
            off >>= 1
        return v

    @device_function
    def group_sum_vec(vals, n, width, scratch2d):
        """In-place group_sum of vals[0:n] (a local array)."""
        for j in range(n):
            v = vals[j]
            off = width >> 1
            while off > 0:
                v += cuda.shfl_xor_sync(FULL_MASK, v, off)
                off >>= 1
            vals[j] = v

    @device_function
    def block_sum(v, scratch):
        """Sum over the whole block, returned to every thread."""
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        off = 16
        while off > 0:
            v += cuda.shfl_xor_sync(FULL_MASK, v, off)
            off >>= 1
        cuda.syncthreads()
        if lane == 0:
            scratch[warp] = v
        cuda.syncthreads()
        s = np.float32(0.0)
        for w in range(cuda.blockDim.x >> 5):
            s += scratch[w]
        return s

    @device_function
    def block_max(v, scratch):
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        off = 16
        while off > 0:
            v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, off))
            off >>= 1
        cuda.syncthreads()
        if lane == 0:
            scratch[warp] = v
        cuda.syncthreads()
        m = scratch[0]
        for w in range(1, cuda.blockDim.x >> 5):
            m = max(m, scratch[w])
        return m

    @device_function
    def block_argmax(v, idx, vscratch, iscratch):
        """(max value, its lowest index) over the block; ties go to the lower index; idx < 0 = empty."""
        lane = cuda.threadIdx.x & 31
        warp = cuda.threadIdx.x >> 5
        off = 16
        while off > 0:
            ov = cuda.shfl_xor_sync(FULL_MASK, v, off)
            oi = cuda.shfl_xor_sync(FULL_MASK, idx, off)
            if _argmax_better(ov, oi, v, idx):
                v = ov
                idx = oi
            off >>= 1
        cuda.syncthreads()
        if lane == 0:
            vscratch[warp] = v
            iscratch[warp] = idx
        cuda.syncthreads()
        bv = vscratch[0]
        bi = iscratch[0]
        for w in range(1, cuda.blockDim.x >> 5):
            ov = vscratch[w]
            oi = iscratch[w]
            if _argmax_better(ov, oi, bv, bi):
                bv = ov
                bi = oi
        return bv, bi
