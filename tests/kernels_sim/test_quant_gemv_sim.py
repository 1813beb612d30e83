"""The quantized kernels under the CUDA simulator, at tiny sizes, against references:
quant_gemv (every GGUF type; rows past the last full row tile, a last K step that only some lanes
fill, T = 1..3, bias, residual into out's column window) against float64 W @ x_hat (x through the
kernels' q8 quantization: the arithmetic emulated exactly) and, loosely, against W @ x; the bf16
dequantization and the row gather against gguf's own dequantization; quant_linear's two paths and
a two-part (Q4_K over Q6_K) weight through metrale.runtime.cuda.quant."""
import numpy as np
import pytest

from kernels_numba import quant_layout as L
from kernels_numba.ptx import SIM

pytestmark = pytest.mark.skipif(not SIM, reason="run with NUMBA_ENABLE_CUDASIM=1")

from numba import cuda  # noqa: E402

from kernels_numba import quant_dequant as QD  # noqa: E402
from kernels_numba import quant_gemv as QG  # noqa: E402
from kernels_numba.bf16 import from_bf16_bits, to_bf16_bits  # noqa: E402

FILLER = None


def _dev(planes):
    global FILLER
    if FILLER is None:
        FILLER = cuda.to_device(np.zeros((1, 16), np.uint8))
    return {k: (FILLER if v is None else cuda.to_device(v)) for k, v in planes.items()}


def _relerr(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


# (type, N, K, T, warps, rows, split, unroll, bias, persist): a handful of blocks each (the simulator
# runs a Python thread per CUDA thread). N leaves a partial last row tile; K leaves lanes idle in the
# last step (legacy: 5 groups over 16-lane groups x unroll 2; K-quants: 2-3 super-blocks over 16
# lanes); persist 1 (the simulator counts 1 multiprocessor): one block walks every row tile.
CASES = [
    (L.Q4_0, 7, 160, 2, 1, 2, 2, 2, False, 1),
    (L.Q4_1, 5, 160, 1, 1, 1, 2, 2, True, 4),
    (L.Q5_0, 5, 96, 3, 1, 2, 1, 1, False, 1),
    (L.Q5_1, 7, 160, 1, 1, 2, 2, 2, False, 4),
    (L.Q8_0, 5, 160, 2, 1, 1, 2, 2, True, 1),
    (L.Q4_K, 7, 512, 2, 1, 2, 2, 1, False, 1),
    (L.Q5_K, 5, 768, 1, 1, 1, 2, 1, True, 4),
    (L.Q6_K, 7, 512, 1, 1, 2, 2, 1, False, 1),
]


@pytest.mark.parametrize("qt,N,K,T,warps,rows,split,unroll,bias,persist", CASES, ids=[L.NAMES[c[0]] for c in CASES])
def test_gemv_and_dequant(qt, N, K, T, warps, rows, split, unroll, bias, persist):
    rng = np.random.default_rng(qt * 7 + N)
    data = L.random_blocks(qt, N, K, rng)
    w = L.gguf_dequantize(qt, data)                     # the independent reference
    planes = _dev(L.repack(qt, data, K))
    x = (2 * rng.standard_normal((T + 1, K))).astype(np.float32)   # one row more than T: unread
    off = 3
    res = rng.standard_normal((T, N + off + 2)).astype(np.float32)
    b = rng.standard_normal(N + off + 2).astype(np.float32) if bias else None
    d_out = cuda.to_device(res.copy())
    path = QG.gemv_path(qt, N, K, T, warps=warps, rows=rows, split=split, unroll=unroll,
                        pipe=qt != L.Q5_K, persist=persist)
    assert path[1] < -(-N // (warps * rows * split)) or persist > 1
    QG.gemv(cuda.to_device(x), planes, d_out, T, qtype=qt, n_off=off, residual=d_out,
            bias=None if b is None else cuda.to_device(b), stream=0, path=path)
    out = d_out.copy_to_host()
    win = slice(off, off + N)
    bb = None if b is None else b[win]
    assert np.array_equal(out[:, :off], res[:, :off]) and np.array_equal(out[:, off + N:], res[:, off + N:]), \
        "columns outside [n_off, n_off + N) were written"
    assert _relerr(out[:, win], L.gemv_ref(x[:T], w, bb, res[:, win])) < 1e-5
    exact = x[:T].astype(np.float64) @ w.T.astype(np.float64)
    assert _relerr(out[:, win] - res[:, win] - (0 if bb is None else bb), exact) < 3e-2   # q8 activations
    # bf16 dequantization into rows [2, 2 + N) of a scratch, and the row gather (ids out of range: zeros)
    scratch = cuda.to_device(np.full((N + 3, K), 0x7FC0, np.uint16))
    QD.dequant_bf16(planes, scratch, qt, n_off=2)
    s = scratch.copy_to_host()
    assert np.array_equal(s[2:2 + N], to_bf16_bits(w)) and (s[:2] == 0x7FC0).all() and (s[2 + N:] == 0x7FC0).all()
    ids = np.array([N - 1, -1, 0, N], np.int32)
    g = cuda.to_device(np.full((4, K), np.nan, np.float32))
    QD.gather_rows(planes, cuda.to_device(ids), g, qt)
    gh = g.copy_to_host()
    assert np.array_equal(gh[0], w[N - 1]) and np.array_equal(gh[2], w[0])
    assert not gh[1].any() and not gh[3].any()


def _quantized(parts):
    from metrale.models.quantized import QuantizedPart, QuantizedTensor
    import gguf
    return QuantizedTensor(tuple(QuantizedPart(gguf.GGMLQuantizationType(qt), d.shape[0], K, d)
                                 for qt, K, d in parts))


def test_quant_linear_two_parts_gemv():
    """A fused qkv-like weight (Q4_K rows over Q6_K rows) through quant_linear at T = 1 with the
    residual in out: each part writes its own columns."""
    from metrale.runtime.cuda import quant as Q
    rng = np.random.default_rng(11)
    K = 256
    a = L.random_blocks(L.Q4_K, 16, K, rng)
    b = L.random_blocks(L.Q6_K, 8, K, rng)
    dq = Q.upload_quantized(_quantized([(L.Q4_K, K, a), (L.Q6_K, K, b)]))
    assert dq.shape == (24, K) and dq.types == ("Q4_K", "Q6_K") and dq.nbytes == a.nbytes + b.nbytes
    w = np.concatenate([L.gguf_dequantize(L.Q4_K, a), L.gguf_dequantize(L.Q6_K, b)])
    x = rng.standard_normal((2, K)).astype(np.float32)
    r = rng.standard_normal((2, 24)).astype(np.float32)
    d_out = cuda.to_device(r.copy())
    Q.quant_linear(cuda.to_device(x), dq, d_out, 1, residual=d_out)
    o = d_out.copy_to_host()
    assert _relerr(o[:1], L.gemv_ref(x[:1], w, residual=r[:1])) < 1e-5 and np.array_equal(o[1:], r[1:])


def test_quant_linear_many_rows(monkeypatch):
    """T = 9 > GEMV_MAX_ROWS: the weight dequantized into the caller's bf16 scratch, then the bf16
    GEMM (its FMA path here: the mma paths are slow in the simulator and have tests of their own),
    the residual from another array."""
    from kernels_numba import gemm
    from metrale.runtime.cuda import quant as Q
    monkeypatch.setattr(gemm, "FMA_MAX_T", 16)
    rng = np.random.default_rng(13)
    K = 64
    data = L.random_blocks(L.Q5_1, 64, K, rng)
    dq = Q.upload_quantized(_quantized([(L.Q5_1, K, data)]))
    x = rng.standard_normal((9, K)).astype(np.float32)
    r = rng.standard_normal((9, 64)).astype(np.float32)
    d_out = cuda.to_device(np.full((9, 64), np.nan, np.float32))
    scratch = cuda.device_array(Q.scratch_elems(dq), np.uint16)
    Q.quant_linear(cuda.to_device(x), dq, d_out, 9, residual=cuda.to_device(r), scratch=scratch)
    wb = from_bf16_bits(to_bf16_bits(L.gguf_dequantize(L.Q5_1, data))).astype(np.float64)
    assert _relerr(d_out.copy_to_host(), x.astype(np.float64) @ wb.T + r) < 1e-5


def test_quant_embedding():
    from metrale.runtime.cuda import quant as Q
    rng = np.random.default_rng(12)
    K = 64
    data = L.random_blocks(L.Q8_0, 10, K, rng)
    dq = Q.upload_quantized(_quantized([(L.Q8_0, K, data)]))
    out = cuda.to_device(np.full((3, K), np.nan, np.float32))
    Q.quant_embedding(cuda.to_device(np.array([9, 0, 10], np.int32)), dq, out)
    o = out.copy_to_host()
    w = L.gguf_dequantize(L.Q8_0, data)
    assert np.array_equal(o[0], w[9]) and np.array_equal(o[1], w[0]) and not o[2].any()
