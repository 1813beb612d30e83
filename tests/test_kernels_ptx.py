"""The real (non-simulator) path of every kernel of bf16/embedding/rmsnorm/rope/activation/
kv_cache/attention/argmax compiles for sm_90, with the instructions it is written for (warp
shuffles, 16-byte `ld.global.nc.v2.u64` KV loads), no float64 arithmetic and no local memory;
where nvJitLink is present the PTX is also assembled to SASS and checked for spills."""

import pytest
from numba import cuda, types

from kernels_numba.bf16 import SIMULATOR

pytestmark = pytest.mark.skipif(SIMULATOR, reason="compile_ptx needs the real CUDA target")

F32, I32, BOOL = types.float32, types.int32, types.boolean
F32_1, I32_1 = types.Array(F32, 1, "C"), types.Array(I32, 1, "C")
F32_2, F32_2A, F32_3, F32_3A = (types.Array(F32, 2, "C"), types.Array(F32, 2, "A"),
                                 types.Array(F32, 3, "C"), types.Array(F32, 3, "A"))
U16_2, U16_4, U64_4 = (types.Array(types.uint16, 2, "C"), types.Array(types.uint16, 4, "C"),
                       types.Array(types.uint64, 4, "C"))
I32_2 = types.Array(I32, 2, "C")


from ptx_util import no_gpu_needed, ptx_of, sass_info  # noqa: E402,F401  (autouse fixture)


def test_small_kernels():
    from kernels_numba import activation, argmax, embedding, kv_cache, rmsnorm, rope

    ptx_of(embedding._embedding_gather_kernel, (U16_2, I32_1, F32_2))
    ptx_of(embedding._embedding_feed_kernel, (U16_2, I32_1, I32_1, I32_1, F32_2))
    for k, sig in [(rmsnorm._rms_norm_2d, (F32_2A, F32_1, F32, F32_2A)),
                   (rmsnorm._rms_norm_3d, (F32_3A, F32_1, F32, F32_3A)),
                   (rmsnorm._add_rms_norm_2d, (F32_2, F32_2, F32_1, F32, F32_2))]:
        assert "shfl.sync.bfly.b32" in ptx_of(k, sig)
    p = ptx_of(rope._rope_kernel, (F32_3A, F32_3A, I32_1, F32_2, F32_2, BOOL))
    assert "fma.rn.f32" in p or "mul.f32" in p
    ptx_of(activation._silu_mul_kernel, (F32_2, F32_2))
    ptx_of(kv_cache._store_kv_kernel, (F32_3A, F32_3A, I32_1, U16_4, U16_4))
    p = ptx_of(argmax._argmax_rows_kernel, (F32_2, I32_1, types.Array(types.uint64, 1, "C")))
    assert "shfl.sync.bfly.b32" in p and "atom.global.max.u64" in p and "atom.global.exch.b64" in p


def test_bf16_helpers():
    import numpy as np
    from kernels_numba.bf16 import bf16_to_f32, f32_to_bf16, ldg_u64x2, unpack_bf16x4

    @cuda.jit
    def k(x, bits, words, out):
        i = cuda.grid(1)
        bits[i] = f32_to_bf16(x[i])
        w0, w1 = ldg_u64x2(words, (0, 0, 0, 2 * i))
        a, b, c, d = unpack_bf16x4(w0)
        out[i] = bf16_to_f32(bits[i]) + a + b + c + d + np.float32(w1 & np.uint64(1))

    p = ptx_of(k, (F32_1, types.Array(types.uint16, 1, "C"), U64_4, F32_1))
    assert "ld.global.nc.v2.u64" in p
    assert "mov.b32" in p  # bf16 <-> f32 are bit moves, no conversion instructions


@pytest.mark.parametrize("hd,hq,hk", [(64, 9, 3), (128, 32, 8), (128, 28, 4), (256, 8, 8)])
def test_attention_kernels(hd, hq, hk):
    from kernels_numba import attention as A

    cfg = A.decode_config(hd, hq // hk)
    p = ptx_of(A._decode_kernel(cfg), (F32_3A, U64_4, U64_4, I32_2, I32_1, I32_1, F32, I32, I32, F32_3, F32_3))
    assert p.count("ld.global.nc.v2.u64") >= 2  # K and V rows, 16 bytes a lane a load
    assert "shfl.sync.bfly.b32" in p and "bar.sync" in p
    info = sass_info(p)
    if info is not None:
        assert info[1] == 0, f"decode kernel {cfg} spills ({info[0]} registers)"

    if hd <= 256:
        pc = A.prefill_config(hd, hq // hk)
        p = ptx_of(A._prefill_kernel(pc), (F32_3A, U64_4, U64_4, I32_2, I32_1, I32_1, F32, I32, F32_3))
        assert "ld.global.nc.v2.u64" in p and "shfl.sync.bfly.b32" in p and "ld.shared.f32" in p
        info = sass_info(p)
        if info is not None:
            assert info[1] == 0, f"prefill kernel {pc} spills ({info[0]} registers)"

    ptx_of(A._merge_partitions_kernel, (F32_3, I32_1, I32, I32, I32, I32, F32_3))


def test_convert_kernel_uses_vector_loads_and_bf16x2():
    from kernels_numba import convert

    p = ptx_of(convert._x_to_bf16_kernel, (F32_2, types.Array(types.uint32, 1, "C")))
    assert "cvt.rn.bf16x2.f32" in p and "ld.global.nc.v4.f32" in p


def test_bf16_producers_compile():
    from kernels_numba import activation, rmsnorm

    U32_2 = types.Array(types.uint32, 2, "C")
    assert "cvt.rn.bf16x2.f32" in ptx_of(rmsnorm._rms_norm_bf16_2d, (F32_2, F32_1, F32, U32_2))
    assert "cvt.rn.bf16x2.f32" in ptx_of(activation._silu_mul_bf16_kernel, (F32_2, U32_2))
