"""float32 -> bf16 activation conversion against the host rounding (simulator)."""
import numpy as np
from numba import cuda

from kernels_numba.convert import x_to_bf16, x_to_bf16_ref


def test_x_to_bf16_rounds_to_nearest_even():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 40)).astype(np.float32) * 7
    x[0, :4] = [1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -0.0, 65504.0]   # ties: round to even
    out = cuda.to_device(np.full(3 * 40 + 8, 0xFFFF, np.uint16))
    x_to_bf16(cuda.to_device(x), out)
    got = out.copy_to_host()
    np.testing.assert_array_equal(got[:120].reshape(3, 40), x_to_bf16_ref(x))
    assert (got[120:] == 0xFFFF).all()          # nothing written past T*K


def test_bf16_producers_equal_the_float_ops_rounded():
    from kernels_numba.activation import silu_mul_bf16, silu_mul_ref
    from kernels_numba.rmsnorm import rms_norm_bf16, rms_norm_ref

    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    out = cuda.to_device(np.zeros(3 * 64 + 4, np.uint16))
    rms_norm_bf16(cuda.to_device(x), cuda.to_device(w), 1e-5, out)
    want = x_to_bf16_ref(rms_norm_ref(x, w, 1e-5).astype(np.float32))
    got = out.copy_to_host()[:192].reshape(3, 64)
    assert (np.abs(got.astype(np.int32) - want.astype(np.int32)) <= 1).all()   # one bf16 ulp
    gu = rng.standard_normal((2, 96)).astype(np.float32)
    out2 = cuda.to_device(np.zeros(96, np.uint16))
    silu_mul_bf16(cuda.to_device(gu), out2)
    want2 = x_to_bf16_ref(silu_mul_ref(gu).astype(np.float32))
    got2 = out2.copy_to_host().reshape(2, 48)
    assert (np.abs(got2.astype(np.int32) - want2.astype(np.int32)) <= 1).all()
