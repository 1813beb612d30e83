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
