"""The block-quantized GEMM (kernels_numba/quant_gemm.py) under the simulator: Q4_K in the fragment
layout and Q6_K on planes, against (a) the NumPy emulation of its arithmetic (bf16 x, weights decoded
to bf16 as q s - m with s, m in bf16, float64 sums) within float32 accumulation, and (b) gguf's
dequantization of the same blocks times bf16 x within bf16 weight rounding. Shapes cover the tile
edges at the smallest sizes: N = 40 (a padded 16-row tile and a weight block past the last tile),
K = 512 (two super-blocks, four x chunks), T = 13 (rows past T in the last n-tile) and T = 20 in
n-tiles of 8 (three x-row blocks), one K split and two (the last block sums the partials), bias,
residual into the output itself, an output column offset (columns outside the part untouched)."""
import numpy as np
import pytest

from kernels_numba import quant_layout as L
from kernels_numba.ptx import SIM, bf16_bits_to_f32, f32_to_bf16_bits

pytestmark = pytest.mark.skipif(not SIM, reason="run with NUMBA_ENABLE_CUDASIM=1")

from numba import cuda  # noqa: E402

from kernels_numba import quant_gemm as G  # noqa: E402
from kernels_numba import quant_mma as M  # noqa: E402

K, N = 512, 40


def _bf16(a) -> np.ndarray:
    return bf16_bits_to_f32(f32_to_bf16_bits(np.asarray(a, np.float32))).astype(np.float64)


def _emulated(qt: int, data: np.ndarray) -> np.ndarray:
    """The weights as the kernel decodes them: bf16(q s - m) (Q4_K) or bf16((q - 32) s) (Q6_K), s and
    m rounded to bf16 first, from the file's codes and scales."""
    f = L._codes(qt, data, K)
    q = f["q"].astype(np.float64)                                          # [N, G, 32]
    if qt == L.Q4_K:
        hd = f["header"]
        d, dmin = L._f16(hd[..., 0:2]), L._f16(hd[..., 2:4])               # [N, nsb, 1]
        sc, mn = L.kq_scale_min(hd)                                        # [N, nsb, 8]
        s = _bf16((d * sc.astype(np.float32)).astype(np.float32)).reshape(N, -1, 1)
        m = _bf16((dmin * mn.astype(np.float32)).astype(np.float32)).reshape(N, -1, 1)
        return _bf16(q * s - m).reshape(N, K)
    d = L._f16(f["d"])                                                      # [N, nsb, 1]
    sv = f["scales"].view(np.int8).astype(np.float32)                       # [N, nsb, 16]
    s = _bf16((d * sv).astype(np.float32)).reshape(N, -1, 2, 1)
    return _bf16((q.reshape(N, -1, 2, 16) - 32) * s).reshape(N, K)


def _planes(qt: int, data: np.ndarray) -> tuple[dict, str]:
    if qt == L.Q4_K:
        return {k: cuda.to_device(v) for k, v in M.repack_mq(data, K).items()}, "q4k_mq"
    return {k: cuda.to_device(v) for k, v in L.repack(qt, data, K).items() if v is not None}, "q6k"


@pytest.mark.parametrize("qt,T,cfg", [(L.Q4_K, 13, (1, 2, 2, 1)), (L.Q4_K, 20, (2, 1, 1, 2)),
                                      (L.Q6_K, 13, (1, 2, 2, 2)), (L.Q6_K, 20, (1, 1, 1, 1))])
def test_product_equals_reference(qt, T, cfg):
    rng = np.random.default_rng(T + qt)
    data = L.random_blocks(qt, N, K, rng, scale=K ** -0.5 / 0.03)
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[0, :32] *= 50                                                         # one group of large values
    xb = f32_to_bf16_bits(x)
    res = rng.standard_normal((T, N + 8)).astype(np.float32)
    bias = rng.standard_normal(N + 8).astype(np.float32)
    out = cuda.to_device(res)
    planes, kind = _planes(qt, data)
    G.prepare(N, K, T, min_ws=2 * 24 * N)
    G.gemm(cuda.to_device(xb), planes, kind, out, T, N, n_off=4, bias=cuda.to_device(bias), residual=out, cfg=cfg)
    got = out.copy_to_host()[:, 4:4 + N] - bias[4:4 + N] - res[:, 4:4 + N]
    xd = bf16_bits_to_f32(xb).astype(np.float64)
    want = xd @ _emulated(qt, data).T
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()
    gguf = xd @ L.gguf_dequantize(qt, data).astype(np.float64).T
    assert np.abs(got - gguf).max() <= 2e-2 * np.abs(gguf).max()
    after = out.copy_to_host()
    np.testing.assert_array_equal(after[:, :4], res[:, :4])
    np.testing.assert_array_equal(after[:, 4 + N:], res[:, 4 + N:])


def test_split_counters_reset_and_plain_output():
    """No bias, no residual, K split in two twice in a row: the second launch finds its counters at
    zero (the last block of each tile reset them) and writes the same values."""
    rng = np.random.default_rng(5)
    T = 9
    data = L.random_blocks(L.Q4_K, N, K, rng, scale=K ** -0.5 / 0.03)
    xb = f32_to_bf16_bits(rng.standard_normal((T, K)).astype(np.float32))
    planes, kind = _planes(L.Q4_K, data)
    G.prepare(N, K, T, min_ws=2 * 24 * N)
    outs = []
    for _ in range(2):
        out = cuda.to_device(np.full((T, N), 7.0, np.float32))
        G.gemm(cuda.to_device(xb), planes, kind, out, T, N, cfg=(1, 2, 2, 2))
        outs.append(out.copy_to_host())
    np.testing.assert_array_equal(outs[0], outs[1])
    want = bf16_bits_to_f32(xb).astype(np.float64) @ _emulated(L.Q4_K, data).T
    assert np.abs(outs[0] - want).max() <= 2e-5 * np.abs(want).max()
    assert not G._BUF["cnt"].copy_to_host().any()
