"""The Q4_K / Q6_K tensor-core GEMV (kernels_numba/quant_mma.py) under the simulator: x's quantization into
the mma fragments equals quant_layout.q8_quantize in the documented layout, every byte (rows past T
zero, one and two n-tiles; _want_x builds the same bytes in NumPy and feeds the products, whose
quantize_x launch cost ten times their own), and the product of 1, 3 and 8 rows (13 on Q6_K; 1, 5
and 11 on the fragment layout) equals gguf's dequantization of the same blocks times the q8-rounded x
(float64), with bias, residual into the output itself, an output column offset and a row count that
is not a multiple of the 16-row tile (one or two tiles a warp); columns outside the part's window
untouched."""
import numpy as np
import pytest

from kernels_numba import quant_layout as L
from kernels_numba.ptx import SIM

pytestmark = pytest.mark.skipif(not SIM, reason="run with NUMBA_ENABLE_CUDASIM=1")

from numba import cuda  # noqa: E402

from kernels_numba import quant_mma as M  # noqa: E402

K = 512


def _want_x(x: np.ndarray, T: int, nt: int) -> tuple[np.ndarray, np.ndarray]:
    """The (xq, xsc) quantize_x writes for x's first T rows in nt n-tiles, every byte (rows past T
    zero), built in NumPy from q8_quantize and the module docstring's layouts: token n of n-tile u,
    value v of group 2p + e at xq[p, 512 u + 16 (4 n + c) + 8 e + 4 (v >> 4) + (v & 3)],
    c = (v & 15) >> 2; (d8, d8 * sum q, d8 * sum of q's values 0..15) at xsc[group, 24 u + 2 n],
    [.., 24 u + 2 n + 1], [.., 24 u + 16 + n]."""
    Kx = x.shape[1]
    G = Kx // 32
    rows = np.zeros((8 * nt, Kx), np.float32)
    rows[:T] = x[:T]
    q, d8 = L.q8_quantize(rows)
    q = q.reshape(nt, 8, G, 32)
    u, n, gi, v = np.meshgrid(*map(np.arange, (nt, 8, G, 32)), indexing="ij")
    xq = np.zeros((G // 2, 512 * nt), np.uint8)
    xq[gi >> 1, 512 * u + 16 * (4 * n + ((v & 15) >> 2)) + 8 * (gi & 1) + 4 * (v >> 4) + (v & 3)] = q.view(np.uint8)
    d8 = d8.reshape(nt, 8, G)
    s = q.astype(np.int64).sum(-1).astype(np.float32)
    s0 = q[..., :16].astype(np.int64).sum(-1).astype(np.float32)
    xsc = np.zeros((G, 24 * nt), np.float32)
    u, n, gi = np.meshgrid(*map(np.arange, (nt, 8, G)), indexing="ij")
    xsc[gi, 24 * u + 2 * n] = d8
    xsc[gi, 24 * u + 2 * n + 1] = d8 * s
    xsc[gi, 24 * u + 16 + n] = d8 * s0
    return xq, xsc


KX = 256         # quantize_x's width here (8 groups, 4 pairs); the products read _want_x's bytes at K = 512


@pytest.mark.parametrize("T", [1, 13])        # one n-tile, rows past T; two, the second partial
def test_quantize_x_writes_the_fragment_layout(T):
    """quantize_x's xq / xsc equal _want_x byte for byte, every byte written (rows past T zeros):
    the buffers the products below are given (and the fused norm / activation quantizations are
    checked against) are quantize_x's."""
    rng = np.random.default_rng(40 + T)
    nt = M.n_tiles(T)
    x = rng.standard_normal((T, KX)).astype(np.float32)
    x[0, :32] *= 50                                              # one group of large values
    x[T - 1, 64:96] = 0                                          # a group of zeros: d8 = 0
    xq = cuda.to_device(np.full((KX // 64, 512 * nt), 9, np.uint8))
    xsc = cuda.to_device(np.full((KX // 32, 24 * nt), 9, np.float32))
    M.quantize_x(cuda.to_device(x), T, xq, xsc, tiles=nt)
    want_xq, want_xsc = _want_x(x, T, nt)
    np.testing.assert_array_equal(xq.copy_to_host(), want_xq)
    np.testing.assert_array_equal(xsc.copy_to_host(), want_xsc)


@pytest.mark.parametrize("qt,T,warps,tiles", [(L.Q4_K, 1, 2, 1), (L.Q4_K, 3, 4, 1), (L.Q4_K, 8, 2, 1),
                                              (L.Q4_K, 3, 2, 2), (L.Q6_K, 1, 2, 1), (L.Q6_K, 8, 2, 1),
                                              (L.Q6_K, 13, 2, 1)])
def test_product_equals_reference(qt, T, warps, tiles):
    """x's fragments from _want_x (quantize_x's bytes: test_quantize_x_writes_the_fragment_layout)."""
    rng = np.random.default_rng(T)
    N = 40                                                       # two full tiles and a half one
    data = L.random_blocks(qt, N, K, rng, scale=K ** -0.5 / 0.03)
    w = L.gguf_dequantize(qt, data)
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[0, :32] *= 50                                              # one group of large values
    xq, xsc = map(cuda.to_device, _want_x(x, T, M.n_tiles(T)))
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
    xq, xsc = map(cuda.to_device, _want_x(x, T, M.n_tiles(T)))         # quantize_x's bytes
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


KF = 256         # the fused quantizations' width: 8 groups, a loop of 8 over them in norm_quantize_x's warp


@pytest.mark.parametrize("T", [1, 12])        # one n-tile; two, the second partial
def test_norm_quantize_equals_rms_norm_then_quantize(T):
    """norm_quantize_x: the normed rows equal rmsnorm.rms_norm's and xq / xsc equal quantize_x of
    them (_want_x: quantize_x's bytes, checked against it above), byte for byte, n-tiles past T
    included (zeros), every byte of the buffers written; rows of out past T untouched."""
    from kernels_numba import rmsnorm
    rng = np.random.default_rng(20 + T)
    nt = M.n_tiles(T)
    x = rng.standard_normal((T, KF)).astype(np.float32) * 3
    w = (1 + 0.1 * rng.standard_normal(KF)).astype(np.float32)
    ref = cuda.device_array((T, KF), np.float32)
    rmsnorm.rms_norm(cuda.to_device(x), cuda.to_device(w), 1e-5, ref)
    ref = ref.copy_to_host()
    xq = cuda.to_device(np.full((KF // 64, 512 * nt), 9, np.uint8))
    xsc = cuda.to_device(np.full((KF // 32, 24 * nt), 9, np.float32))
    out = cuda.to_device(np.full((8 * nt, KF), np.nan, np.float32))
    M.norm_quantize_x(cuda.to_device(x), cuda.to_device(w), 1e-5, T, xq, xsc, out, tiles=nt)
    got = out.copy_to_host()
    np.testing.assert_array_equal(got[:T], ref)
    assert np.isnan(got[T:]).all()
    want_xq, want_xsc = _want_x(ref, T, nt)
    np.testing.assert_array_equal(xq.copy_to_host(), want_xq)
    np.testing.assert_array_equal(xsc.copy_to_host(), want_xsc)


@pytest.mark.parametrize("T", [1, 12])
def test_silu_quantize_equals_silu_mul_then_quantize(T):
    """silu_quantize_x: the activation equals activation.silu_mul's and xq / xsc equal quantize_x
    of it (_want_x), byte for byte, every byte of the buffers written."""
    from kernels_numba import activation
    rng = np.random.default_rng(30 + T)
    nt = M.n_tiles(T)
    gu = cuda.to_device((rng.standard_normal((T, 2 * KF)) * 2).astype(np.float32))
    ref = cuda.device_array((T, KF), np.float32)
    activation.silu_mul(gu, ref)
    ref = ref.copy_to_host()
    xq = cuda.to_device(np.full((KF // 64, 512 * nt), 9, np.uint8))
    xsc = cuda.to_device(np.full((KF // 32, 24 * nt), 9, np.float32))
    out = cuda.to_device(np.full((T, KF), np.nan, np.float32))
    M.silu_quantize_x(gu, T, xq, xsc, out, tiles=nt)
    np.testing.assert_array_equal(out.copy_to_host(), ref)
    want_xq, want_xsc = _want_x(ref, T, nt)
    np.testing.assert_array_equal(xq.copy_to_host(), want_xq)
    np.testing.assert_array_equal(xsc.copy_to_host(), want_xsc)
