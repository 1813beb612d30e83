"""FP8 e4m3 weights (kernels_numba.quant_fp8) under the CUDA simulator, at tiny sizes: the GEMV at
T = 1 (its register-sum kernel) and T = 3 (the run-time row loop) with per-tensor, per-channel and
128 x 128-style block scales (a partial last block of rows, a persistent block walking row tiles,
a partial last step of lanes), bias and residual into out's column window, against float64 x @ W
from ml_dtypes' e4m3fn decoding; the bf16 dequantization; fp8_linear's two paths."""
import numpy as np
import pytest

from kernels_numba.ptx import SIM

pytestmark = pytest.mark.skipif(not SIM, reason="run with NUMBA_ENABLE_CUDASIM=1")

from numba import cuda  # noqa: E402

from kernels_numba import quant_fp8 as F  # noqa: E402
from kernels_numba.bf16 import from_bf16_bits, to_bf16_bits  # noqa: E402


def _fp8(rng, N, K):
    q = rng.integers(0, 256, (N, K), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x30                        # e4m3fn NaN bytes: not in checkpoints
    return q


def _relerr(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


# (N, K, scales, T, cfg (warps, rows, unroll, pipe), persist, bias)
CASES = [(10, 256, "block", 1, (2, 2, 2, True), 1, False),
         (9, 160, "tensor", 3, (1, 2, 1, False), 1, True),
         (12, 512, "channel", 2, (2, 1, 2, True), 4, False)]


@pytest.mark.parametrize("N,K,kind,T,cfg,persist,bias", CASES, ids=[c[2] for c in CASES])
def test_fp8_gemv_and_dequant(N, K, kind, T, cfg, persist, bias):
    rng = np.random.default_rng(N + K)
    q = _fp8(rng, N, K)
    if kind == "block":           # 4 x 128 blocks: rows 8..9 in a partial block
        S, bn, bk = F.scale_grid(rng.uniform(0.5, 2, (3, K // 128)).astype(np.float32), N, K, (4, 128))
    elif kind == "tensor":
        S, bn, bk = F.scale_grid(np.float32(0.7), N, K)
    else:
        S, bn, bk = F.scale_grid(rng.uniform(0.5, 2, (N, 1)), N, K)
    w = F.dequant_ref(q, S, bn, bk)
    x = rng.standard_normal((T + 1, K)).astype(np.float32)
    r = rng.standard_normal((T, N + 2)).astype(np.float32)
    b = rng.standard_normal(N + 2).astype(np.float32) if bias else None
    d = cuda.to_device(r.copy())
    F.fp8_gemv(cuda.to_device(x), cuda.to_device(q), cuda.to_device(S), d, T, bn=bn, bk=bk, n_off=1,
               residual=d, bias=None if b is None else cuda.to_device(b), cfg=cfg, persist=persist)
    o = d.copy_to_host()
    assert np.array_equal(o[:, 0], r[:, 0]) and np.array_equal(o[:, N + 1], r[:, N + 1])
    assert _relerr(o[:, 1:N + 1], F.gemv_ref(x[:T], w, None if b is None else b[1:N + 1], r[:, 1:N + 1])) < 1e-6
    sc = cuda.to_device(np.zeros((N + 1, K), np.uint16))
    F.dequant_bf16(cuda.to_device(q), cuda.to_device(S), sc, bn=bn, bk=bk, n_off=1)
    assert np.array_equal(sc.copy_to_host()[1:], to_bf16_bits(w))


def test_scale_grid_shapes():
    assert F.scale_grid(2.0, 300, 256)[1:] == (300, 256)
    S, bn, bk = F.scale_grid(np.ones((300, 1)), 300, 256)
    assert S.shape == (300, 1) and (bn, bk) == (1, 256)
    S, bn, bk = F.scale_grid(np.ones((3, 2)), 300, 256, (128, 128))
    assert S.shape == (3, 2) and (bn, bk) == (128, 128)
    with pytest.raises(ValueError, match="block scales"):
        F.scale_grid(np.ones((2, 2)), 300, 256, (128, 128))
    with pytest.raises(ValueError, match="weight_block_size"):
        F.scale_grid(np.ones(7), 300, 256)


def test_fp8_linear_paths(monkeypatch):
    """fp8_linear: T = 2 through the GEMV (residual = out); T = 9 through the bf16 dequantization
    and the bf16 GEMM (its FMA path here)."""
    import ml_dtypes

    from kernels_numba import gemm
    from metrale.runtime.cuda import quant as Q
    monkeypatch.setattr(gemm, "FMA_MAX_T", 16)
    rng = np.random.default_rng(4)
    N, K = 64, 64
    q = _fp8(rng, N, K)
    d = Q.upload_fp8(q.view(ml_dtypes.float8_e4m3fn), rng.uniform(0.5, 2, (1, 1)).astype(np.float32), (128, 128))
    assert d.shape == (N, K) and (d.bn, d.bk) == (128, 128) and d.nbytes == N * K + 4
    w = F.dequant_ref(q, d.S.copy_to_host(), 128, 128)
    x = rng.standard_normal((9, K)).astype(np.float32)
    r = rng.standard_normal((9, N)).astype(np.float32)
    out = cuda.to_device(r.copy())
    Q.fp8_linear(cuda.to_device(x), d, out, 2, residual=out)
    o = out.copy_to_host()
    assert _relerr(o[:2], F.gemv_ref(x[:2], w, residual=r[:2])) < 1e-6 and np.array_equal(o[2:], r[2:])
    out = cuda.to_device(np.full((9, N), np.nan, np.float32))
    Q.fp8_linear(cuda.to_device(x), d, out, 9)
    wb = from_bf16_bits(to_bf16_bits(w)).astype(np.float64)
    assert _relerr(out.copy_to_host(), x.astype(np.float64) @ wb.T) < 1e-5
