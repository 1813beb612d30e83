"""QuantOps on DeviceFP8 weights (an FP8 e4m3 checkpoint with levers.weights=native) composed onto
CudaOps under the simulator, on the stand-in backend of quant_ops_standin.py: weights are the loader's value
(metrale.models.fp8.FP8Tensor: row-stacked members, their scales regridded) uploaded as the backend
does (upload_fp8_tensor), and every reference is this file's own dequantization of the members'
e4m3 bytes and stored scales with ml_dtypes. Roads: the FP8 GEMV (T = 1, 2; float32 x, so within
fp32 rounding of float64), the bf16 road (T = 9: quant_fp8.dequant_bf16 into the scratch, then the
bf16 GEMM; against the bf16-rounded weight), the chunks road (a weight over the scratch, in chunks
of whole 128-row scale blocks, accumulating into a residual), the MLP at one row; the announced
bytes bound the uploaded ones."""
import ml_dtypes
import numpy as np
import pytest

from kernels_numba.ptx import SIM

pytestmark = pytest.mark.skipif(not SIM, reason="run with NUMBA_ENABLE_CUDASIM=1")

from numba import cuda  # noqa: E402

from kernels_numba.bf16 import from_bf16_bits, to_bf16_bits  # noqa: E402
from quant_ops_standin import EPS, quant_ops  # noqa: E402

K = 128


def _ops(T, N, scratch_elems=1 << 15, ffn=32):
    return quant_ops(T, N, K, scratch_elems, mma_rows=1, ffn=ffn)


@pytest.fixture(autouse=True)
def _sim_patches(monkeypatch):
    import metrale.runtime.cuda_backend as cb
    from kernels_numba import gemm
    monkeypatch.setattr(cb, "_ptr", id)          # simulator arrays have no __cuda_array_interface__
    monkeypatch.setattr(gemm, "FMA_MAX_T", 16)   # the mma GEMMs are slow here (test_gemm_sim has them)


def _member(rng, rows, cols, kind):
    """(e4m3 bytes, stored scale, float64 dequantization written here) of one checkpoint weight."""
    q = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x38                         # no e4m3fn NaN bytes (checkpoints have none)
    v = q.view(ml_dtypes.float8_e4m3fn).astype(np.float64) / 1024
    if kind == "tensor":
        s = np.asarray(rng.uniform(0.5, 2.0), np.float32)
        full = np.full((rows, cols), float(s))
    elif kind == "channel":
        s = rng.uniform(0.5, 2.0, (rows, 1)).astype(np.float32)
        full = np.repeat(s.astype(np.float64), cols, 1)
    else:
        bn, bk = kind
        s = rng.uniform(0.5, 2.0, (-(-rows // bn), -(-cols // bk))).astype(np.float32)
        full = np.repeat(np.repeat(s.astype(np.float64), bn, 0), bk, 1)[:rows, :cols]
    s_stored = s / np.float32(1024)        # weights of at most ~0.9 (e4m3 spans up to 448)
    return q, s_stored, v * full


def _weight(seed, rows, kind, cols=K):
    """(DeviceFP8, float64 [sum(rows), cols], the FP8Tensor) of row-stacked members."""
    from metrale.models.fp8 import FP8Tensor
    from metrale.runtime.cuda.quant import upload_fp8_tensor
    rng = np.random.default_rng(seed)
    block = kind if isinstance(kind, tuple) else None
    members = [_member(rng, r, cols, kind) for r in rows]
    ts = [FP8Tensor.of(q, s, block) for q, s, _ in members]
    t = ts[0] if len(ts) == 1 else FP8Tensor.stack(ts)
    return upload_fp8_tensor(t), np.concatenate([w for _, _, w in members]), t


def _rms(x, w):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def _relerr(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def _bf16(w):
    return from_bf16_bits(to_bf16_bits(w.astype(np.float32))).astype(np.float64)


KINDS = {"block128": (128, 128), "block32": (16, 32), "channel": "channel", "tensor": "tensor"}


@pytest.mark.parametrize("kind,T", [("block128", 1), ("block32", 2), ("tensor", 1), ("block128", 9)])
def test_norm_linear_roads(kind, T):
    """A qkv-like stack (32 + 16 + 16 rows) with a bias through norm_linear: T <= 8 the FP8 GEMV,
    T = 9 the scratch's bf16 image and the bf16 GEMM. 128-row blocks over 32-row members go to
    one-row blocks of 128 columns; 16 x 32 ones stack whole; per tensor goes to per channel (the
    grid per-channel checkpoints load in)."""
    dq, w, t = _weight(T, (32, 16, 16), KINDS[kind])
    assert dq.shape == (64, K)
    assert (t.bn, t.bk) == {"block128": (1, 128), "block32": (16, 32), "channel": (1, K), "tensor": (1, K)}[kind]
    rng = np.random.default_rng(10 + T)
    x = rng.standard_normal((T, K)).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    bias = rng.standard_normal(64).astype(np.float32)
    ops = _ops(T, 64)
    got = ops.norm_linear(cuda.to_device(x), cuda.to_device(nw), dq, cuda.to_device(bias)).copy_to_host()
    h = _rms(x, nw)
    if T <= 8:
        assert _relerr(got, h.astype(np.float32).astype(np.float64) @ w.T + bias) < 1e-5
    else:
        assert _relerr(got, h @ _bf16(w).T + bias) < 1e-5


def test_chunks_road_in_whole_scale_blocks():
    """T = 9 on a 128-row weight of 64 x 64 blocks with a scratch of 64 rows: two chunks, each a
    whole row of scale blocks, accumulating into its column window of the residual (linear_residual)."""
    from metrale.runtime.cuda.quant import row_chunks
    dq, w, _ = _weight(5, (128,), (64, 64))
    chunks = row_chunks(dq, 64 * K + 100)
    assert [(n0, c.shape, tuple(c.S.shape)) for n0, c in chunks] == [(0, (64, K), (1, 2)), (64, (64, K), (1, 2))]
    rng = np.random.default_rng(6)
    x = rng.standard_normal((9, K)).astype(np.float32)
    res = rng.standard_normal((9, 128)).astype(np.float32)
    ops = _ops(9, 128, scratch_elems=64 * K)
    d_res = cuda.to_device(res)
    assert ops.linear_residual(cuda.to_device(x), dq, d_res) is d_res
    assert _relerr(d_res.copy_to_host() - res, x.astype(np.float64) @ _bf16(w).T) < 1e-5


def test_mlp_residual_one_row():
    """norm -> gate_up (per channel) FP8 GEMV -> silu*mul -> down (64 x 16 blocks, K = 32) FP8 GEMV
    accumulating into the residual."""
    F = 32
    gu, w_gu, _ = _weight(7, (F, F), "channel")
    down, w_down, _ = _weight(8, (K,), (64, 16), cols=F)
    rng = np.random.default_rng(9)
    res = rng.standard_normal((1, K)).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    ops = _ops(1, 2 * F, ffn=F)
    d_res = cuda.to_device(res)
    ops.mlp_residual(d_res, cuda.to_device(nw), gu, down)
    g = _rms(res, nw).astype(np.float32).astype(np.float64) @ w_gu.T
    a = (g[:, :F] / (1 + np.exp(-g[:, :F])) * g[:, F:]).astype(np.float32).astype(np.float64)
    assert _relerr(d_res.copy_to_host() - res, a @ w_down.T) < 1e-5


def test_announced_bytes_bound_the_upload():
    from metrale.models.quantized import QuantizedStream
    from metrale.runtime.cuda.quant import device_bytes_bound
    dq, _, t = _weight(3, (32, 16, 16), (128, 128))
    parts = QuantizedStream.of([("layers.0.qkv", t)]).parts["layers.0.qkv"]
    assert dq.nbytes == t.nbytes == 64 * K + 4 * 64 * 1
    assert dq.nbytes <= device_bytes_bound(parts) <= dq.nbytes + 512


@pytest.mark.parametrize("T", [3, 5, 8])
def test_gemv_rows_of_x_in_registers(T):
    """The GEMV variants for 4 and 8 rows of x with fewer rows given: every given row right (bias and
    residual added), the rows of `out` past T untouched."""
    from kernels_numba import quant_fp8 as F
    rng = np.random.default_rng(T)
    q, s, w = _member(rng, 24, K, (16, 32))
    S, bn, bk = F.scale_grid(s, 24, K, (16, 32))
    x = rng.standard_normal((T, K)).astype(np.float32)
    bias = rng.standard_normal(24).astype(np.float32)
    res = rng.standard_normal((8, 24)).astype(np.float32)
    d_out = cuda.to_device(res.copy())
    F.fp8_gemv(cuda.to_device(x), cuda.to_device(q), cuda.to_device(S), d_out, T, bn=bn, bk=bk,
               bias=cuda.to_device(bias), residual=d_out)
    got = d_out.copy_to_host()
    assert F.x_rows_bucket(T) in (4, 8)
    assert _relerr(got[:T], x.astype(np.float64) @ w.T + bias + res[:T]) < 1e-5
    assert np.array_equal(got[T:], res[T:])
