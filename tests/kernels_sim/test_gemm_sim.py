"""kernels_numba.gemm under the CUDA simulator: all three paths (fma GEMV, skinny mma, tiled mma).

The simulator runs mma.sync, warp sums and the vector loads through kernels_numba.ptx's Python
twins (lanes meet at a per-warp barrier), so the real kernels' indexing is what is checked here.
"""
import numpy as np
import pytest

from kernels_numba import gemm
from kernels_numba.ptx import SIM, bf16_bits_to_f32, f32_to_bf16_bits

pytestmark = pytest.mark.skipif(not SIM, reason="run with NUMBA_ENABLE_CUDASIM=1")

from numba import cuda  # noqa: E402


def _data(rng, T, N, K, bias=False):
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = f32_to_bf16_bits(rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K))
    b = rng.standard_normal(N).astype(np.float32) if bias else None
    return x, w, b


def _relerr(out, ref):
    assert np.isfinite(out).all(), "NaN/Inf in output (unwritten element?)"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _run(x, w, b, residual, path):
    T, N = x.shape[0], w.shape[0]
    out0 = residual.copy() if residual is not None else np.full((T, N), np.nan, np.float32)
    d_out = cuda.to_device(out0)
    d_b = cuda.to_device(b) if b is not None else None
    gemm._launch(cuda.to_device(x), cuda.to_device(w), d_out, d_b, None,
                 residual is not None, None, None, path=path)
    return d_out.copy_to_host()


def test_bf16_helpers_round_to_nearest_even():
    v = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e38], np.float32)
    bits = f32_to_bf16_bits(v)
    assert bits[1] == 0x3F80          # halfway 1 + 2^-8 rounds down to even
    assert bits[2] == 0x3F82          # halfway 1 + 3*2^-8 rounds up to even
    assert np.allclose(bf16_bits_to_f32(bits), v, rtol=1e-2)


@pytest.mark.parametrize("T,u,bias,residual", [(1, 2, False, False), (3, 1, True, True)])
def test_fma_path(T, u, bias, residual):
    rng = np.random.default_rng(T)
    N, K = 64, 320                  # 40 chunks of 8: a partial last step
    x, w, b = _data(rng, T, N, K, bias)
    r = rng.standard_normal((T, N)).astype(np.float32) if residual else None
    out = _run(x, w, b, r, gemm.fma_path(T, N, unroll=u))
    assert _relerr(out, gemm.linear_ref(x, w, b, r)) < 1e-5


@pytest.mark.parametrize("T,N,K,mt,nt,u,bias,residual", [
    (5, 64, 576, 1, 2, 1, True, False),     # 18 chunks over 8 warps: partial steps; rows past T in the slab
    (16, 64, 128, 1, 1, 2, False, True),    # a full slab (T = 1's config: its rows past T are T = 5's)
    (40, 64, 64, 2, 1, 1, True, True),      # two slabs of 32 rows, the second partial
    (20, 64, 64, 4, 2, 1, False, False)])
def test_skinny_path(T, N, K, mt, nt, u, bias, residual):
    rng = np.random.default_rng(100 + T)
    x, w, b = _data(rng, T, N, K, bias)
    r = rng.standard_normal((T, N)).astype(np.float32) if residual else None
    out = _run(x, w, b, r, gemm.skinny_path(T, N, mt, nt, u))
    assert _relerr(out, gemm.linear_ref(x, w, b, r)) < 1e-2


@pytest.mark.parametrize("T,N,K,tile,bias,residual", [(20, 128, 64, (64, 64), False, False),
                                                      (40, 192, 64, (64, 128), True, True),
                                                      (33, 128, 64, (128, 128), True, False)])
def test_tiled_path(T, N, K, tile, bias, residual):
    rng = np.random.default_rng(200 + T)
    x, w, b = _data(rng, T, N, K, bias)
    r = rng.standard_normal((T, N)).astype(np.float32) if residual else None
    out = _run(x, w, b, r, gemm.tiled_path(T, N, *tile))
    assert _relerr(out, gemm.linear_ref(x, w, b, r)) < 1e-2


def test_linear_dispatch_and_shape_checks():
    rng = np.random.default_rng(7)
    x, w, b = _data(rng, 2, 64, 64, True)
    d_out = cuda.to_device(np.full((2, 64), np.nan, np.float32))
    gemm.linear(cuda.to_device(x), cuda.to_device(w), d_out, cuda.to_device(b))
    assert _relerr(d_out.copy_to_host(), gemm.linear_ref(x, w, b)) < 1e-2
    with pytest.raises(AssertionError, match="multiples of 64"):
        gemm.linear(cuda.to_device(x[:, :48].copy()), cuda.to_device(w[:, :48].copy()),
                    cuda.to_device(np.zeros((2, 64), np.float32)))
    assert gemm.pick_path(1, 4096, fma_max_t=1)[0] == "gemv"
    assert gemm.pick_path(1, 4096, fma_max_t=0)[0] != "gemv"
    assert gemm.pick_path(8, 4096, fma_max_t=1, skinny_max_t=16)[0] == "skinny"
    assert gemm.pick_path(17, 4096, fma_max_t=1, skinny_max_t=16)[0] == "tiled"
    assert gemm.pick_path(100, 4096, skinny_max_t=128)[:3] == ("skinny", (4, 2, 8, 1), 512)
