"""QuantOps (metrale/runtime/cuda/quant.py: the CUDA backend's ops on DeviceQuantized weights,
levers.weights=native) composed onto CudaOps under the simulator, on a stand-in backend, against
the NumPy composition on gguf's dequantization of the same blocks: the GEMV road (T <= 8; x through
the kernels' q8 quantization in the reference), the bf16 road (T = 9: the scratch image and the bf16
GEMM), the chunks road (a weight over the scratch: row chunks across parts into column windows,
also accumulating into a residual), the MLP at one row, the quantized embedding with fed ids."""

import numpy as np
import pytest

from kernels_numba import quant_layout as L
from kernels_numba.ptx import SIM

pytestmark = pytest.mark.skipif(not SIM, reason="run with NUMBA_ENABLE_CUDASIM=1")

from numba import cuda  # noqa: E402

from kernels_numba.bf16 import from_bf16_bits, to_bf16_bits  # noqa: E402
from quant_ops_standin import EPS, quant_ops  # noqa: E402

K = 256          # the K-quants' super-block


def _ops(T, N, scratch_elems=1 << 16, overlap=False, token_ids=None, token_src=None, mma_rows=0, ffn=64):
    return quant_ops(T, N, K, scratch_elems, overlap, token_ids, token_src, mma_rows, ffn)


def _weight(parts, seed, fragments=False):
    """(DeviceQuantized, float64 reference [N, K]) of row-stacked random parts (type, rows, cols)."""
    import gguf
    from metrale.models.quantized import QuantizedPart, QuantizedTensor
    from metrale.runtime.cuda.quant import upload_quantized
    rng = np.random.default_rng(seed)
    qparts = []
    for qt, rows, cols in parts:
        data = L.random_blocks(qt, rows, cols, rng, scale=0.3)
        qparts.append(QuantizedPart(gguf.GGMLQuantizationType(qt), rows, cols, data))
    t = QuantizedTensor(tuple(qparts))
    return upload_quantized(t, fragments=fragments), t.dequantize().astype(np.float64)


def _rms(x, w):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def _relerr(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.fixture(autouse=True)
def _sim_patches(monkeypatch):
    import metrale.runtime.cuda_backend as cb
    from kernels_numba import gemm
    monkeypatch.setattr(cb, "_ptr", id)          # simulator arrays have no __cuda_array_interface__
    monkeypatch.setattr(gemm, "FMA_MAX_T", 16)   # the mma GEMMs are slow here (test_gemm_sim has them)


@pytest.mark.parametrize("T,mma_rows", [(1, 0), (9, 0), (3, 2), (1, 1), (9, 1)])
def test_norm_linear_gemv_and_bf16_roads(T, mma_rows):
    """A qkv-like weight (Q4_K rows over Q6_K rows) with a bias: T <= 8 the quant GEMV (the dp4a
    road at one row, its kernel at T = 1..3 test_quant_gemv_sim's; with mma_rows 2 at T = 3: the
    Q4_K part on the tensor-core GEMV, the Q6_K part on the dp4a one; with 1, the Q4_K part in the
    fragment layout), T = 9 the scratch's bf16 image and the bf16 GEMM; with 1,
    T = 9 is the tensor-core kernels of n-tiles (the Q4_K part in the fragment layout, Q6_K on its
    planes; the chunks test below has the fragment layout's dequantization)."""
    dq, w = _weight([(L.Q4_K, 64, K), (L.Q6_K, 64, K)], seed=T, fragments=mma_rows == 1)
    assert dq.parts[0].fragments == (mma_rows == 1) and not dq.parts[1].fragments
    rng = np.random.default_rng(10 + T)
    x = rng.standard_normal((T, K)).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    bias = rng.standard_normal(128).astype(np.float32)
    ops = _ops(T, 128, mma_rows=mma_rows)
    got = ops.norm_linear(cuda.to_device(x), cuda.to_device(nw), dq, cuda.to_device(bias)).copy_to_host()
    h = _rms(x, nw)
    if T <= 8 or (mma_rows == 1 and T <= 64):
        want = L.gemv_ref(h.astype(np.float32), w, bias=bias)
        assert _relerr(got, want) < 3e-3
    else:
        wb = from_bf16_bits(to_bf16_bits(w.astype(np.float32))).astype(np.float64)
        assert _relerr(got, h @ wb.T + bias) < 1e-5


def test_chunks_road_on_fragment_tiles():
    """T = 9 on a Q4_K weight of 128 rows in the fragment layout, scratch of 64 rows: two chunks of
    four 16-row tiles each, each into its column window of out (norm_linear; the chunks into a
    residual are the next test's)."""
    dq, w = _weight([(L.Q4_K, 128, K)], seed=11, fragments=True)
    wb = from_bf16_bits(to_bf16_bits(w.astype(np.float32))).astype(np.float64)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((9, K)).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    ops = _ops(9, 128, scratch_elems=64 * K)
    got = ops.norm_linear(cuda.to_device(x), cuda.to_device(nw), dq).copy_to_host()
    assert _relerr(got, _rms(x, nw) @ wb.T) < 1e-5


def test_chunks_road_across_parts_and_into_a_residual():
    """T = 9 on a 128-row weight (Q8_0 96 rows over Q4_0 32) with a scratch of 64 rows: two chunks,
    the second across the parts, each accumulating into its column window of the residual
    (linear_residual; the chunks into out are the test above's)."""
    dq, w = _weight([(L.Q8_0, 96, K), (L.Q4_0, 32, K)], seed=5)
    wb = from_bf16_bits(to_bf16_bits(w.astype(np.float32))).astype(np.float64)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((9, K)).astype(np.float32)
    ops = _ops(9, 128, scratch_elems=64 * K)
    res = rng.standard_normal((9, 128)).astype(np.float32)
    d_res = cuda.to_device(res)
    assert ops.linear_residual(cuda.to_device(x), dq, d_res) is d_res
    assert _relerr(d_res.copy_to_host(), x.astype(np.float64) @ wb.T + res) < 1e-5


def test_mlp_residual_one_row():
    """norm -> gate_up (Q5_K) GEMV -> silu*mul -> down (Q4_1, K = 64) GEMV accumulating into the residual."""
    F = 64
    gu, w_gu = _weight([(L.Q5_K, 2 * F, K)], seed=7)
    down, w_down = _weight([(L.Q4_1, K, F)], seed=8)
    rng = np.random.default_rng(9)
    res = rng.standard_normal((1, K)).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    ops = _ops(1, 2 * F)
    d_res = cuda.to_device(res)
    ops.mlp_residual(d_res, cuda.to_device(nw), gu, down)
    g = L.gemv_ref(_rms(res, nw).astype(np.float32), w_gu)
    a = (g[:, :F] / (1 + np.exp(-g[:, :F])) * g[:, F:]).astype(np.float32)
    want = L.gemv_ref(a, w_down) + res
    got = d_res.copy_to_host()
    assert _relerr(got - res, want - res) < 3e-3


@pytest.mark.parametrize("T,mma_rows", [(1, 1), (3, 2)])
def test_mlp_residual_on_the_tensor_cores(T, mma_rows, monkeypatch):
    """norm -> gate_up -> silu*mul -> down, both Q4_K, on the tensor-core GEMV: the norm and the
    activation each quantize x in their own launch (norm_quantize_x, silu_quantize_x); in the
    fragment layout at one row, on planes at three."""
    F = 256
    gu, w_gu = _weight([(L.Q4_K, 2 * F, K)], seed=17, fragments=mma_rows == 1)
    down, w_down = _weight([(L.Q4_K, K, F)], seed=18, fragments=mma_rows == 1)
    rng = np.random.default_rng(19)
    res = rng.standard_normal((T, K)).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    ops = _ops(T, 2 * F, mma_rows=mma_rows, ffn=F)
    from kernels_numba import quant_mma
    launches = []
    for name in ("norm_quantize_x", "silu_quantize_x", "quantize_x"):
        fn = getattr(quant_mma, name)
        monkeypatch.setattr(quant_mma, name, lambda *a, _f=fn, _n=name, **k: (launches.append(_n), _f(*a, **k)))
    d_res = cuda.to_device(res)
    ops.mlp_residual(d_res, cuda.to_device(nw), gu, down)
    assert launches == ["norm_quantize_x", "silu_quantize_x"]
    g = L.gemv_ref(_rms(res, nw).astype(np.float32), w_gu)
    a = (g[:, :F] / (1 + np.exp(-g[:, :F])) * g[:, F:]).astype(np.float32)
    want = L.gemv_ref(a, w_down) + res
    assert _relerr(d_res.copy_to_host() - res, want - res) < 3e-3


def test_quantized_embedding_with_fed_ids():
    """Rows 0 and 2 take the previous step's argmax (rows 1 and 0 of it), row 1 its own id; the
    fed ids are written back as embedding_feed does."""
    dq, w = _weight([(L.Q6_K, 64, K)], seed=11)
    ids, src = np.array([0, 5, 0], np.int32), np.array([1, -1, 0], np.int32)
    ops = _ops(3, 64, overlap=True, token_ids=ids, token_src=src)
    got = ops.embed(dq).copy_to_host()
    want_ids = np.array([3, 5, 7], np.int32)
    np.testing.assert_array_equal(ops.token_ids.copy_to_host(), want_ids)
    np.testing.assert_allclose(got, w[want_ids], rtol=1e-6, atol=1e-7)
