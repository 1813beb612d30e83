"""The Q4_K / Q6_K tensor-core GEMV (kernels_numba/quant_mma.py) under the simulator: x's quantization into
the mma fragments equals quant_layout.q8_quantize (rows past T zero), and the product of 1, 3 and 8
rows equals gguf's dequantization of the same blocks times the q8-rounded x (float64), with bias,
residual into the output itself, an output column offset and a row count that is not a multiple
of the 16-row tile (one or two tiles a warp); columns outside the part's window untouched."""
import numpy as np
import pytest

from kernels_numba import quant_layout as L
from kernels_numba.ptx import SIM

pytestmark = pytest.mark.skipif(not SIM, reason="run with NUMBA_ENABLE_CUDASIM=1")

from numba import cuda  # noqa: E402

from kernels_numba import quant_mma as M  # noqa: E402

K = 512


def _fragments(x: np.ndarray, T: int, xq: np.ndarray, xsc: np.ndarray) -> None:
    q, d8 = L.q8_quantize(x)
    G = K // 32
    v = np.arange(32)
    off = ((v & 15) >> 2) * 16 + (v >> 4) * 4 + (v & 3)         # token 0's byte of each value, even group
    for n in range(8):
        got = np.stack([xq[:, n * 64 + off], xq[:, n * 64 + off + 8]], axis=1).reshape(G, 32).view(np.int8)
        want = q[n].reshape(G, 32) if n < T else np.zeros((G, 32), np.int8)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(xsc[:, 2 * n], d8[n] if n < T else 0)
        s = want.astype(np.int64).sum(-1)
        np.testing.assert_allclose(xsc[:, 2 * n + 1], (d8[n] if n < T else 0) * s, rtol=1e-6)
        np.testing.assert_allclose(xsc[:, 16 + n], (d8[n] if n < T else 0) * want[:, :16].astype(np.int64).sum(-1),
                                   rtol=1e-6)


@pytest.mark.parametrize("qt,T,warps,tiles", [(L.Q4_K, 1, 2, 1), (L.Q4_K, 3, 4, 1), (L.Q4_K, 8, 2, 1),
                                              (L.Q4_K, 3, 2, 2), (L.Q6_K, 1, 2, 1), (L.Q6_K, 8, 2, 1),
                                              (L.Q6_K, 13, 2, 1)])
def test_product_equals_reference(qt, T, warps, tiles):
    rng = np.random.default_rng(T)
    N = 40                                                       # two full tiles and a half one
    data = L.random_blocks(qt, N, K, rng, scale=K ** -0.5 / 0.03)
    w = L.gguf_dequantize(qt, data)
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[0, :32] *= 50                                              # one group of large values
    nt = M.n_tiles(T)
    xq = cuda.to_device(np.zeros((K // 64, 512 * nt), np.uint8))
    xsc = cuda.to_device(np.zeros((K // 32, 24 * nt), np.float32))
    M.quantize_x(cuda.to_device(x), T, xq, xsc, tiles=nt)
    if T <= 8:
        _fragments(x, T, xq.copy_to_host(), xsc.copy_to_host())
    res = rng.standard_normal((T, N + 8)).astype(np.float32)
    bias = rng.standard_normal(N + 8).astype(np.float32)
    out = cuda.to_device(res)
    planes = {k: cuda.to_device(v) for k, v in L.repack(qt, data, K).items() if v is not None}
    M.gemv(xq, xsc, planes, out, T, qtype=qt, n_off=4, bias=cuda.to_device(bias), residual=out, warps=warps, tiles=tiles)
    got = out.copy_to_host()
    want = L.gemv_ref(x, w) + bias[4:4 + N] + res[:, 4:4 + N]
    assert np.abs(got[:, 4:4 + N] - want).max() <= 1e-5 * np.abs(want).max()
    np.testing.assert_array_equal(got[:, :4], res[:, :4])
    np.testing.assert_array_equal(got[:, 4 + N:], res[:, 4 + N:])


@pytest.mark.parametrize("T", [1, 5, 11])
def test_q4k_fragment_layout_product_and_dequant(T):
    """gemv_mq on repack_mq's planes (N = 24: a padded tile) and dequant_mq_bf16 into a column
    window of a wider bf16 image, against gguf's dequantization."""
    from kernels_numba.bf16 import from_bf16_bits, to_bf16_bits
    rng = np.random.default_rng(20 + T)
    N = 24
    data = L.random_blocks(L.Q4_K, N, K, rng, scale=K ** -0.5 / 0.03)
    w = L.gguf_dequantize(L.Q4_K, data)
    host = M.repack_mq(data, K)
    np.testing.assert_array_equal(M.dequant_mq_ref(host, N, K), w)
    assert sum(v.nbytes for v in host.values()) == M.mq_nbytes(N, K)
    planes = {k: cuda.to_device(v) for k, v in host.items()}
    x = rng.standard_normal((T, K)).astype(np.float32)
    nt = M.n_tiles(T)
    xq = cuda.to_device(np.zeros((K // 64, 512 * nt), np.uint8))
    xsc = cuda.to_device(np.zeros((K // 32, 24 * nt), np.float32))
    M.quantize_x(cuda.to_device(x), T, xq, xsc, tiles=nt)
    res = rng.standard_normal((T, N + 4)).astype(np.float32)
    out = cuda.to_device(res)
    M.gemv_mq(xq, xsc, planes, out, T, N, n_off=2, residual=out, warps=2)
    got = out.copy_to_host()
    want = L.gemv_ref(x, w) + res[:, 2:2 + N]
    assert np.abs(got[:, 2:2 + N] - want).max() <= 1e-5 * np.abs(want).max()
    np.testing.assert_array_equal(got[:, :2], res[:, :2])
    img = cuda.to_device(np.zeros((N + 8, K), np.uint16))
    M.dequant_mq_bf16(planes, img, N, n_off=8)
    h = img.copy_to_host()
    np.testing.assert_array_equal(h[8:], to_bf16_bits(w))
    assert not h[:8].any()
    assert np.array_equal(from_bf16_bits(h[8:]), from_bf16_bits(to_bf16_bits(w)))


@pytest.mark.parametrize("T", [1, 5, 12])
def test_norm_quantize_equals_rms_norm_then_quantize(T):
    """norm_quantize_x: the normed rows equal rmsnorm.rms_norm's and xq / xsc equal quantize_x of
    them, byte for byte, n-tiles past T included (zeros); rows of out past T untouched."""
    from kernels_numba import rmsnorm
    rng = np.random.default_rng(20 + T)
    nt = M.n_tiles(T)
    x = rng.standard_normal((T, K)).astype(np.float32) * 3
    w = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    ref = cuda.device_array((T, K), np.float32)
    rmsnorm.rms_norm(cuda.to_device(x), cuda.to_device(w), 1e-5, ref)
    xq0 = cuda.to_device(np.full((K // 64, 512 * nt), 7, np.uint8))
    xsc0 = cuda.to_device(np.full((K // 32, 24 * nt), 7, np.float32))
    M.quantize_x(ref, T, xq0, xsc0, tiles=nt)
    xq = cuda.to_device(np.full((K // 64, 512 * nt), 9, np.uint8))
    xsc = cuda.to_device(np.full((K // 32, 24 * nt), 9, np.float32))
    out = cuda.to_device(np.full((8 * nt, K), np.nan, np.float32))
    M.norm_quantize_x(cuda.to_device(x), cuda.to_device(w), 1e-5, T, xq, xsc, out, tiles=nt)
    got = out.copy_to_host()
    np.testing.assert_array_equal(got[:T], ref.copy_to_host())
    assert np.isnan(got[T:]).all()
    np.testing.assert_array_equal(xq.copy_to_host(), xq0.copy_to_host())
    np.testing.assert_array_equal(xsc.copy_to_host(), xsc0.copy_to_host())


@pytest.mark.parametrize("T", [1, 12])
def test_silu_quantize_equals_silu_mul_then_quantize(T):
    """silu_quantize_x: the activation equals activation.silu_mul's and xq / xsc equal quantize_x
    of it, byte for byte."""
    from kernels_numba import activation
    rng = np.random.default_rng(30 + T)
    nt = M.n_tiles(T)
    gu = cuda.to_device((rng.standard_normal((T, 2 * K)) * 2).astype(np.float32))
    ref = cuda.device_array((T, K), np.float32)
    activation.silu_mul(gu, ref)
    xq0, xsc0 = cuda.device_array((K // 64, 512 * nt), np.uint8), cuda.device_array((K // 32, 24 * nt), np.float32)
    M.quantize_x(ref, T, xq0, xsc0, tiles=nt)
    xq, xsc = cuda.device_array((K // 64, 512 * nt), np.uint8), cuda.device_array((K // 32, 24 * nt), np.float32)
    out = cuda.to_device(np.full((T, K), np.nan, np.float32))
    M.silu_quantize_x(gu, T, xq, xsc, out, tiles=nt)
    np.testing.assert_array_equal(out.copy_to_host(), ref.copy_to_host())
    np.testing.assert_array_equal(xq.copy_to_host(), xq0.copy_to_host())
    np.testing.assert_array_equal(xsc.copy_to_host(), xsc0.copy_to_host())
