"""The quantized kernels at model sizes on the GPU (pytest -m gpu): the GEMV of every GGUF type on
4096 x 4096, 14336 x 4096 and (the types an lm_head has) 128256 x 4096, and the down product's
4096 x 14336, at T = 1 (its own kernel) and T = 8 (the T >= 2 kernel), against float64 W @ x_hat
(x through the kernels' q8 quantization) from gguf's dequantization of the same bytes (on a sample
of rows for the big ones); the bf16 dequantization, the row gather and quant_linear's many-rows
path (dequantize + bf16 GEMM) and a two-part weight. Shapes and launch flags are the ones
bench/quant_kernels.py times, so its run finds these kernels in the disk cache."""
import functools

import numpy as np
import pytest

from kernels_numba import quant_layout as L

pytestmark = pytest.mark.gpu

from numba import cuda  # noqa: E402

from kernels_numba import quant_dequant as QD  # noqa: E402
from kernels_numba import quant_gemv as QG  # noqa: E402
from kernels_numba.bf16 import from_bf16_bits, to_bf16_bits  # noqa: E402

SAMPLE = 2048        # rows checked against the reference on the big shapes


@functools.lru_cache(maxsize=2)
def _weight(qt, N, K):
    """(file bytes, device planes): random blocks of the type (finite weight-sized scales)."""
    data = L.random_blocks(qt, N, K, np.random.default_rng(qt * 1000 + N + K), scale=1.0)
    filler = cuda.to_device(np.zeros((1, 16), np.uint8))
    planes = {k: (filler if v is None else cuda.to_device(v)) for k, v in L.repack(qt, data, K).items()}
    return data, planes


@functools.lru_cache(maxsize=2)
def _reference(qt, N, K):
    """gguf's dequantization of _weight's bytes (computed once a weight)."""
    return L.gguf_dequantize(qt, _weight(qt, N, K)[0])


def _rows(N, rng):
    return np.arange(N) if N <= 16384 else np.sort(rng.choice(N, SAMPLE, replace=False))


def _relerr(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


GEMV_SHAPES = ([(qt, 4096, 4096) for qt in L.TYPES] + [(qt, 14336, 4096) for qt in L.TYPES]
               + [(qt, 128256, 4096) for qt in (L.Q4_K, L.Q6_K, L.Q8_0)]
               + [(qt, 4096, 14336) for qt in (L.Q4_K, L.Q6_K, L.Q8_0)])


@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("qt,N,K", GEMV_SHAPES, ids=[f"{L.NAMES[q]}-{n}x{k}" for q, n, k in GEMV_SHAPES])
def test_gemv(qt, N, K, T):
    data, planes = _weight(qt, N, K)
    rng = np.random.default_rng(N + T)
    x = (2 * rng.standard_normal((T, K))).astype(np.float32)
    res = rng.standard_normal((T, N)).astype(np.float32)
    d_out = cuda.to_device(res)
    QG.gemv(cuda.to_device(x), planes, d_out, T, qtype=qt, residual=d_out)
    out = d_out.copy_to_host()
    assert np.isfinite(out).all()
    rows = _rows(N, rng)
    w = _reference(qt, N, K) if N <= 16384 else L.gguf_dequantize(qt, data[rows])
    ref = L.gemv_ref(x, w, residual=res[:, rows])
    assert _relerr(out[:, rows], ref) < 2e-5
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    assert _relerr(out[:, rows] - res[:, rows], exact) < 3e-2          # what q8 activations cost


@pytest.mark.parametrize("qt", [L.Q4_K, L.Q5_0])
def test_gemv_bias_and_column_window(qt):
    """bias, no residual, and a part's rows written at columns [n_off, n_off + N) of a wider out."""
    N, K, off = 4096, 4096, 1024
    data, planes = _weight(qt, N, K)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, K)).astype(np.float32)
    b = rng.standard_normal(N + 2 * off).astype(np.float32)
    d_out = cuda.to_device(np.full((2, N + 2 * off), np.nan, np.float32))
    QG.gemv(cuda.to_device(x), planes, d_out, 2, qtype=qt, n_off=off, bias=cuda.to_device(b))
    out = d_out.copy_to_host()
    assert np.isnan(out[:, :off]).all() and np.isnan(out[:, off + N:]).all()
    ref = L.gemv_ref(x, _reference(qt, N, K), b[off:off + N])
    assert _relerr(out[:, off:off + N], ref) < 2e-5


@pytest.mark.parametrize("qt", L.TYPES, ids=[L.NAMES[t] for t in L.TYPES])
def test_dequant_and_gather(qt):
    N, K = 14336, 4096
    data, planes = _weight(qt, N, K)
    w = _reference(qt, N, K)
    scratch = cuda.device_array((N, K), np.uint16)
    QD.dequant_bf16(planes, scratch, qt)
    got = from_bf16_bits(scratch.copy_to_host())
    want = from_bf16_bits(to_bf16_bits(w))
    # fp32 d q + m may be fused (one rounding) where gguf rounds twice: at most one bf16 step apart
    step = np.abs(want) * 2.0 ** -7 + 1e-30
    assert (np.abs(got - want) <= step).all()
    assert np.mean(got == want) > 0.999
    ids = np.array([0, N - 1, -5, N, 77, 12345], np.int32)
    d_out = cuda.to_device(np.full((len(ids), K), np.nan, np.float32))
    QD.gather_rows(planes, cuda.to_device(ids), d_out, qt)
    out = d_out.copy_to_host()
    for i, r in enumerate(ids):
        if 0 <= r < N:
            assert np.allclose(out[i], w[r], rtol=1e-6, atol=1e-7)
        else:
            assert not out[i].any()


@pytest.mark.parametrize("fragments,mma_rows", [(False, 0), (False, 2), (True, 1)])
def test_quant_linear_many_rows_and_parts(fragments, mma_rows):
    """quant_linear on a qkv-like weight (Q4_K q|k over Q6_K v, Llama-3-8B's 6144 x 4096): T = 1
    and 8 through the GEMV, T = 32 through it in the fragment layout (up to 64 rows) and otherwise
    through dequantize + the bf16 GEMM, T = 512 always the latter, residual in out; the Q4_K part on
    the dp4a GEMV, on the tensor-core one from 2 rows, or in the fragment layout."""
    import gguf

    from metrale.models.quantized import QuantizedPart, QuantizedTensor
    from metrale.runtime.cuda import quant as Q
    K = 4096
    a, _ = _weight(L.Q4_K, 5120, K)
    b, _ = _weight(L.Q6_K, 1024, K)
    qt = QuantizedTensor((QuantizedPart(gguf.GGMLQuantizationType.Q4_K, 5120, K, a),
                          QuantizedPart(gguf.GGMLQuantizationType.Q6_K, 1024, K, b)))
    dq = Q.upload_quantized(qt, fragments=fragments)
    w = np.concatenate([L.gguf_dequantize(L.Q4_K, a), L.gguf_dequantize(L.Q6_K, b)])
    wb = from_bf16_bits(to_bf16_bits(w)).astype(np.float64)
    scratch = cuda.device_array(Q.scratch_elems(dq), np.uint16)
    rng = np.random.default_rng(3)
    for T in (1, 8, 32, 512):
        x = rng.standard_normal((T, K)).astype(np.float32)
        r = rng.standard_normal((T, 6144)).astype(np.float32)
        d_out = cuda.to_device(r)
        Q.quant_linear(cuda.to_device(x), dq, d_out, T, residual=d_out, scratch=scratch, mma_rows=mma_rows)
        out = d_out.copy_to_host()
        if T <= Q.gemv_rows(dq, mma_rows):
            assert _relerr(out, L.gemv_ref(x, w, residual=r)) < 2e-5, T
        else:      # bf16 weights, x rounded to bf16 by the tensor-core path
            xb = from_bf16_bits(to_bf16_bits(x)).astype(np.float64)
            assert _relerr(out - r, xb @ wb.T) < 2e-3, T


def test_quant_embedding_vocab():
    from metrale.runtime.cuda import quant as Q
    N, K = 128256, 4096
    data, planes = _weight(L.Q4_K, N, K)
    dq = Q.DeviceQuantized((Q.DevicePart(L.Q4_K, N, K, 0, planes, data.nbytes),))
    ids = np.array([128255, 0, 64000, 128256, -1], np.int32)
    d_out = cuda.to_device(np.full((5, K), np.nan, np.float32))
    Q.quant_embedding(cuda.to_device(ids), dq, d_out)
    out = d_out.copy_to_host()
    w = L.gguf_dequantize(L.Q4_K, data[ids[:3]])
    assert np.allclose(out[:3], w, rtol=1e-6, atol=1e-7) and not out[3:].any()


# ----------------------------------------------------------------------------- FP8 e4m3
FP8_SHAPES = [(4096, 4096, "block"), (14336, 4096, "channel"), (4096, 14336, "block"), (128256, 4096, "tensor")]


@functools.lru_cache(maxsize=1)
def _fp8_weight(N, K, kind):
    from kernels_numba import quant_fp8 as F
    rng = np.random.default_rng(N + K)
    q = rng.integers(0, 256, (N, K), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x30
    if kind == "block":
        S, bn, bk = F.scale_grid(rng.uniform(0.01, 0.02, (-(-N // 128), -(-K // 128))).astype(np.float32), N, K, (128, 128))
    elif kind == "channel":
        S, bn, bk = F.scale_grid(rng.uniform(0.01, 0.02, N), N, K)
    else:
        S, bn, bk = F.scale_grid(np.float32(0.015), N, K)
    return q, S, bn, bk, cuda.to_device(q), cuda.to_device(S)


@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("N,K,kind", FP8_SHAPES, ids=[f"{n}x{k}-{s}" for n, k, s in FP8_SHAPES])
def test_fp8_gemv(N, K, kind, T):
    from kernels_numba import quant_fp8 as F
    q, S, bn, bk, d_q, d_S = _fp8_weight(N, K, kind)
    rng = np.random.default_rng(T + N)
    x = rng.standard_normal((T, K)).astype(np.float32)
    r = rng.standard_normal((T, N)).astype(np.float32)
    d_out = cuda.to_device(r)
    F.fp8_gemv(cuda.to_device(x), d_q, d_S, d_out, T, bn=bn, bk=bk, residual=d_out)
    out = d_out.copy_to_host()
    rows = _rows(N, rng)
    w = F.dequant_ref(q[rows], S[rows // bn] if bn < N else S, 1 if bn < N else len(rows), bk)
    assert _relerr(out[:, rows], F.gemv_ref(x, w, residual=r[:, rows])) < 2e-6


def test_fp8_dequant_and_linear():
    from kernels_numba import quant_fp8 as F
    from metrale.runtime.cuda import quant as Q
    N, K = 4096, 4096
    q, S, bn, bk, d_q, d_S = _fp8_weight(N, K, "block")
    w = F.dequant_ref(q, S, bn, bk)
    scratch = cuda.device_array((N, K), np.uint16)
    F.dequant_bf16(d_q, d_S, scratch, bn=bn, bk=bk)
    got = from_bf16_bits(scratch.copy_to_host())
    want = from_bf16_bits(to_bf16_bits(w))
    assert (np.abs(got - want) <= np.abs(want) * 2.0 ** -7 + 1e-30).all() and np.mean(got == want) > 0.999
    d = Q.DeviceFP8(d_q, d_S, bn, bk)
    rng = np.random.default_rng(5)
    for T in (4, 64):
        x = rng.standard_normal((T, K)).astype(np.float32)
        d_out = cuda.to_device(np.zeros((T, N), np.float32))
        Q.fp8_linear(cuda.to_device(x), d, d_out, T, residual=d_out, scratch=scratch)
        out = d_out.copy_to_host()
        if T <= 8:
            assert _relerr(out, F.gemv_ref(x, w)) < 2e-6
        else:
            xb = from_bf16_bits(to_bf16_bits(x)).astype(np.float64)
            assert _relerr(out, xb @ from_bf16_bits(to_bf16_bits(w)).astype(np.float64).T) < 2e-3


MMA_SHAPES = [(4096, 4096), (14336, 4096), (128256, 4096), (4096, 14336)]


@pytest.mark.parametrize("T", [1, 2, 8])
@pytest.mark.parametrize("N,K", MMA_SHAPES, ids=[f"Q4_K-{n}x{k}" for n, k in MMA_SHAPES])
def test_mma_gemv_q4k(N, K, T):
    """The tensor-core GEMV (kernels_numba/quant_mma.py) after its x quantization, residual into out."""
    from kernels_numba import quant_mma as QM
    data, planes = _weight(L.Q4_K, N, K)
    rng = np.random.default_rng(N + T + 1)
    x = (2 * rng.standard_normal((T, K))).astype(np.float32)
    res = rng.standard_normal((T, N)).astype(np.float32)
    d_out = cuda.to_device(res)
    xq, xsc = QM.x_buffers(K)
    QM.quantize_x(cuda.to_device(x), T, xq, xsc)
    QM.gemv(xq, xsc, planes, d_out, T, qtype=L.Q4_K, residual=d_out)
    out = d_out.copy_to_host()
    assert np.isfinite(out).all()
    rows = _rows(N, rng)
    w = _reference(L.Q4_K, N, K) if N <= 16384 else L.gguf_dequantize(L.Q4_K, data[rows])
    assert _relerr(out[:, rows], L.gemv_ref(x, w, residual=res[:, rows])) < 2e-5


@pytest.mark.parametrize("T", [1, 8, 40])
@pytest.mark.parametrize("N,K", MMA_SHAPES, ids=[f"Q4_K-{n}x{k}" for n, k in MMA_SHAPES])
def test_fragment_layout_gemv_q4k(N, K, T):
    """gemv_mq on repack_mq's layout at the 8B shapes, with the warps mq_warps gives each (4, 8, 16)."""
    from kernels_numba import quant_mma as QM
    data, _ = _weight(L.Q4_K, N, K)
    planes = {k: cuda.to_device(v) for k, v in QM.repack_mq(data, K).items()}
    rng = np.random.default_rng(N + T + 2)
    x = (2 * rng.standard_normal((T, K))).astype(np.float32)
    res = rng.standard_normal((T, N)).astype(np.float32)
    d_out = cuda.to_device(res)
    xq, xsc = QM.x_buffers(K)
    QM.quantize_x(cuda.to_device(x), T, xq, xsc, tiles=QM.n_tiles(T))
    QM.gemv_mq(xq, xsc, planes, d_out, T, N, residual=d_out)
    out = d_out.copy_to_host()
    assert np.isfinite(out).all()
    rows = _rows(N, rng)
    w = _reference(L.Q4_K, N, K) if N <= 16384 else L.gguf_dequantize(L.Q4_K, data[rows])
    assert _relerr(out[:, rows], L.gemv_ref(x, w, residual=res[:, rows])) < 2e-5


@pytest.mark.parametrize("T", [1, 8, 40])
def test_fused_quantizations_equal_their_two_launches(T):
    """norm_quantize_x and silu_quantize_x write the bytes of rms_norm / silu_mul then quantize_x
    (Llama-3-8B's K = 4096 and F = 14336)."""
    from kernels_numba import activation, rmsnorm
    from kernels_numba import quant_mma as QM
    rng = np.random.default_rng(40 + T)
    nt = QM.n_tiles(T)
    for K, fused in ((4096, "norm"), (14336, "silu")):
        xq0, xsc0 = QM.x_buffers(K)
        shape_q, shape_s = (K // 64, 512 * nt), (K // 32, 24 * nt)
        ref = cuda.device_array((T, K), np.float32)
        if fused == "norm":
            x = cuda.to_device(rng.standard_normal((T, K)).astype(np.float32))
            w = cuda.to_device((1 + 0.1 * rng.standard_normal(K)).astype(np.float32))
            rmsnorm.rms_norm(x, w, 1e-5, ref)
        else:
            gu = cuda.to_device((2 * rng.standard_normal((T, 2 * K))).astype(np.float32))
            activation.silu_mul(gu, ref)
        QM.quantize_x(ref, T, xq0, xsc0, tiles=nt)
        want = (xq0.copy_to_host()[:shape_q[0], :shape_q[1]], xsc0.copy_to_host()[:shape_s[0], :shape_s[1]])
        out = cuda.to_device(np.full((T, K), np.nan, np.float32))
        if fused == "norm":
            QM.norm_quantize_x(x, w, 1e-5, T, xq0, xsc0, out, tiles=nt)
        else:
            QM.silu_quantize_x(gu, T, xq0, xsc0, out, tiles=nt)
        cuda.synchronize()
        np.testing.assert_array_equal(out.copy_to_host(), ref.copy_to_host())
        np.testing.assert_array_equal(xq0.copy_to_host()[:shape_q[0], :shape_q[1]], want[0])
        np.testing.assert_array_equal(xsc0.copy_to_host()[:shape_s[0], :shape_s[1]], want[1])
