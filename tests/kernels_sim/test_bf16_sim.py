"""bf16 conversions and the reductions of kernels_numba.bf16 under the simulator."""
import ml_dtypes
import numpy as np
from numba import cuda

from kernels_numba.bf16 import (
    block_argmax,
    block_max,
    block_sum,
    bf16_to_f32,
    f32_to_bf16,
    from_bf16_bits,
    group_sum,
    ldg_u64x2,
    pack_bf16x2,
    to_bf16_bits,
    unpack_bf16x2,
    unpack_bf16x4,
)


@cuda.jit
def _convert_kernel(x, bits, back, packed, unpacked):
    i = cuda.grid(1)
    if i < x.shape[0]:
        bits[i] = f32_to_bf16(x[i])
        back[i] = bf16_to_f32(bits[i])
        if i % 2 == 0:
            packed[i // 2] = pack_bf16x2(x[i], x[i + 1])
            a, b = unpack_bf16x2(packed[i // 2])
            unpacked[i] = a
            unpacked[i + 1] = b


def test_conversions_match_ml_dtypes():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(40) * 10.0 ** rng.integers(-30, 30, 40),
                        [0.0, -0.0, np.inf, -np.inf, np.nan, 1.00390625, 1.01171875, 3.0e38]]).astype(np.float32)
    bits = np.zeros(x.shape, np.uint16)
    back = np.zeros(x.shape, np.float32)
    packed = np.zeros(x.shape[0] // 2, np.uint32)
    unpacked = np.zeros(x.shape, np.float32)
    _convert_kernel[1, 64](x, bits, back, packed, unpacked)
    want = to_bf16_bits(x)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(bits[finite], want[finite])
    assert np.isnan(from_bf16_bits(bits[~finite])).all()
    np.testing.assert_array_equal(back[finite], x[finite].astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(packed.view(np.uint16)[finite], want[finite])
    np.testing.assert_array_equal(unpacked[finite], back[finite])


@cuda.jit
def _unpack4_kernel(words, out):
    i = cuda.grid(1)
    if i < words.shape[0] // 2:
        w0, w1 = ldg_u64x2(words, (2 * i,))
        a, b, c, d = unpack_bf16x4(w0)
        e, f, g, h = unpack_bf16x4(w1)
        out[8 * i], out[8 * i + 1], out[8 * i + 2], out[8 * i + 3] = a, b, c, d
        out[8 * i + 4], out[8 * i + 5], out[8 * i + 6], out[8 * i + 7] = e, f, g, h


def test_unpack_bf16x4_and_16_byte_load():
    x = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    bits = to_bf16_bits(x)
    out = np.zeros(64, np.float32)
    _unpack4_kernel[1, 32](bits.view(np.uint64), out)
    np.testing.assert_array_equal(out, from_bf16_bits(bits))


@cuda.jit
def _reduce_kernel(x, sums, maxes, gsums, amax):
    s1 = cuda.shared.array(1024, np.float32)
    s2 = cuda.shared.array(1024, np.int32)
    tid = cuda.threadIdx.x
    v = x[tid]
    tot = block_sum(v, s1)
    mx = block_max(v, s1)
    gs = group_sum(v, 8, s1)
    bv, bi = block_argmax(v, np.int32(tid), s1, s2)
    gsums[tid] = gs
    if tid == 0:
        sums[0] = tot
        maxes[0] = mx
        amax[0] = bi


def test_reductions():
    x = np.random.default_rng(2).standard_normal(64).astype(np.float32)
    x[40] = x[13] = x.max() + 1.0  # a tie: the lower index wins
    sums, maxes, gsums, amax = np.zeros(1, np.float32), np.zeros(1, np.float32), np.zeros(64, np.float32), np.zeros(1, np.int32)
    _reduce_kernel[1, 64](x, sums, maxes, gsums, amax)
    np.testing.assert_allclose(sums[0], x.sum(), rtol=1e-5)
    assert maxes[0] == x.max()
    np.testing.assert_allclose(gsums, np.repeat(x.reshape(8, 8).sum(1), 8), rtol=1e-5, atol=1e-6)
    assert amax[0] == 13
