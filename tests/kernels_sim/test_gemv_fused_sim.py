"""kernels_numba.gemm.gemv (T = 1 GEMV with a fused prologue) under the CUDA simulator: each
prologue (plain, rmsnorm, silu_mul), rows per warp 1/2/4, x through L1 or shared memory, bias and
accumulate, against the float64 NumPy oracle gemv_ref."""
import numpy as np
import pytest

from kernels_numba import gemm
from kernels_numba.ptx import SIM, f32_to_bf16_bits

pytestmark = pytest.mark.skipif(not SIM, reason="run with NUMBA_ENABLE_CUDASIM=1")

from numba import cuda  # noqa: E402


def _relerr(out, ref):
    assert np.isfinite(out).all(), "NaN/Inf in output (unwritten element?)"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


# (prologue, N, K, warps, rows, unroll, smem, bias, accumulate); the simulator is slow: a few
# blocks each. K = 320 / 192 leave a partial last step (40 / 24 chunks of 8 over 32 lanes).
CASES = [
    ("plain", 64, 320, 4, 2, 2, False, True, False),
    ("plain", 64, 192, 2, 4, 1, True, False, True),
    ("rmsnorm", 64, 576, 4, 1, 2, False, False, False),
    ("rmsnorm", 128, 320, 2, 4, 1, True, True, False),
    ("silu_mul", 64, 320, 4, 2, 1, False, False, True),
    ("silu_mul", 64, 192, 2, 2, 2, True, False, True),
]


@pytest.mark.parametrize("prologue,N,K,warps,rows,unroll,smem,bias,acc", CASES)
def test_gemv_prologue(prologue, N, K, warps, rows, unroll, smem, bias, acc):
    rng = np.random.default_rng(N + K + rows)
    kx = 2 * K if prologue == "silu_mul" else K
    x = (rng.standard_normal((1, kx)) * 2).astype(np.float32)
    w = f32_to_bf16_bits(rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K))
    nw = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32) if prologue == "rmsnorm" else None
    b = rng.standard_normal(N).astype(np.float32) if bias else None
    r = rng.standard_normal((1, N)).astype(np.float32) if acc else None
    d_out = cuda.to_device(r.copy() if acc else np.full((1, N), np.nan, np.float32))
    path = gemm.gemv_path(N, K, prologue, warps=warps, rows=rows, unroll=unroll, smem=smem)
    assert path[1][4] == int(smem)
    gemm.gemv(cuda.to_device(x), cuda.to_device(w), d_out, prologue=prologue,
              norm_w=None if nw is None else cuda.to_device(nw), eps=1e-5,
              bias=None if b is None else cuda.to_device(b), accumulate=acc, path=path)
    ref = gemm.gemv_ref(x, w, prologue, nw, 1e-5, b, r)
    assert _relerr(d_out.copy_to_host(), ref) < 1e-5


def test_linear_t1_goes_through_gemv():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 128)).astype(np.float32)
    w = f32_to_bf16_bits(rng.standard_normal((64, 128)).astype(np.float32))
    path = gemm.pick_path(1, 64, K=128)
    assert path[0] == "gemv" and path[1][3] == 0
    d_out = cuda.to_device(np.full((1, 64), np.nan, np.float32))
    gemm.linear(cuda.to_device(x), cuda.to_device(w), d_out)
    assert _relerr(d_out.copy_to_host(), gemm.linear_ref(x, w)) < 1e-5
    with pytest.raises(ValueError, match="prologue"):
        gemm.gemv(x, w, d_out, prologue="gelu")


@pytest.mark.parametrize("N,K,warps,rows,smem,acc", [(64, 320, 4, 2, False, True), (128, 192, 2, 4, True, False)])
def test_sumsq_epilogue_feeds_rmsnorm_ss(N, K, warps, rows, smem, acc):
    """A GEMV with ss_out writes its outputs and adds their sum of squares (after the residual
    add) into ss_out[0], across blocks; a second GEMV with the rmsnorm_ss prologue normalizes
    those outputs from that sum alone and equals the rmsnorm prologue's oracle."""
    rng = np.random.default_rng(N + K)
    x = rng.standard_normal((1, K)).astype(np.float32)
    w = f32_to_bf16_bits(rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K))
    r = rng.standard_normal((1, N)).astype(np.float32) if acc else None
    d_out = cuda.to_device(r.copy() if acc else np.full((1, N), np.nan, np.float32))
    ss = cuda.to_device(np.zeros(1, np.uint64))
    path = gemm.gemv_path(N, K, "plain", warps=warps, rows=rows, unroll=1, smem=smem)
    gemm.gemv(cuda.to_device(x), cuda.to_device(w), d_out, accumulate=acc, path=path, ss_out=ss)
    h = d_out.copy_to_host()
    assert _relerr(h, gemm.gemv_ref(x, w, "plain", residual=r)) < 1e-5
    assert abs(gemm.ss_value(ss.copy_to_host()[0]) - float((h.astype(np.float64) ** 2).sum())) < 1e-4 * float((h ** 2).sum())
    # the consumer: N inputs, 64 outputs, normalized by the carried sum
    w2 = f32_to_bf16_bits(rng.standard_normal((64, N)).astype(np.float32) / np.sqrt(N))
    nw = (1 + 0.2 * rng.standard_normal(N)).astype(np.float32)
    d2 = cuda.to_device(np.full((1, 64), np.nan, np.float32))
    path2 = gemm.gemv_path(64, N, "rmsnorm_ss", warps=2, rows=1, unroll=1, smem=smem)
    gemm.gemv(d_out, cuda.to_device(w2), d2, prologue="rmsnorm_ss", norm_w=cuda.to_device(nw), eps=1e-5,
              ss_in=ss, path=path2)
    assert _relerr(d2.copy_to_host(), gemm.gemv_ref(h, w2, "rmsnorm", nw, 1e-5)) < 1e-5


@pytest.mark.parametrize("prologue,I,K,warps,unroll,smem", [
    ("plain", 64, 320, 4, 2, False),
    ("rmsnorm", 128, 192, 2, 1, True),
    ("rmsnorm_ss", 64, 576, 4, 1, False),
])
def test_gemv_glu_epilogue(prologue, I, K, warps, unroll, smem):
    """glu=True: w = [gate | up] (2I rows), out[1, I] = silu(gate) * up of the prologue's input,
    against the float64 oracle (the plain product, then silu * mul)."""
    rng = np.random.default_rng(I + K)
    x = (rng.standard_normal((1, K)) * 2).astype(np.float32)
    w = f32_to_bf16_bits(rng.standard_normal((2 * I, K)).astype(np.float32) / np.sqrt(K))
    nw = (1 + 0.2 * rng.standard_normal(K)).astype(np.float32) if prologue != "plain" else None
    ss = np.array([gemm.ss_fixed(np.sum(x.astype(np.float64) ** 2))], np.uint64) if prologue == "rmsnorm_ss" else None
    d_out = cuda.to_device(np.full((1, I), np.nan, np.float32))
    path = gemm.gemv_path(2 * I, K, prologue, warps=warps, rows=2, unroll=unroll, smem=smem)
    gemm.gemv(cuda.to_device(x), cuda.to_device(w), d_out, prologue=prologue,
              norm_w=None if nw is None else cuda.to_device(nw), eps=1e-5, path=path, glu=True,
              ss_in=None if ss is None else cuda.to_device(ss))
    gu = gemm.gemv_ref(x, w, "rmsnorm" if nw is not None else "plain", nw, 1e-5).astype(np.float64)
    g, u = gu[:, :I], gu[:, I:]
    ref = g / (1 + np.exp(-g)) * u
    assert _relerr(d_out.copy_to_host(), ref) < 1e-5
    with pytest.raises(AssertionError, match="glu"):
        gemm.gemv(cuda.to_device(x), cuda.to_device(w), d_out, prologue=prologue, path=path, glu=True,
                  norm_w=None if nw is None else cuda.to_device(nw), accumulate=True,
                  ss_in=None if ss is None else cuda.to_device(ss))


@pytest.mark.parametrize("interleaved,rot,bias,slot", [(False, 32, False, 5), (True, 32, True, 9),
                                                        (False, 16, False, -1)])
def test_gemv_rope_epilogue_equals_linear_then_rope_store(interleaved, rot, bias, slot):
    """rope: the fused QKV GEMV writes rotated q and stores rotated k and v into the caches at the
    step's slot, as gemm.linear followed by qkv.qkv_rope_store (full and partial RoPE, both pair
    layouts, a bias, and slot -1: nothing stored)."""
    from kernels_numba import qkv as Q
    from kernels_numba.ptx import bf16_bits_to_f32
    rng = np.random.default_rng(rot + slot + interleaved)
    hq, hk, hd, K, bs, pos = 2, 1, 32, 128, 4, 7
    N = (hq + 2 * hk) * hd
    x = rng.standard_normal((1, K)).astype(np.float32)
    w = f32_to_bf16_bits(rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K))
    b = rng.standard_normal(N).astype(np.float32) if bias else None
    ang = rng.uniform(0, 6, (16, rot // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    kc0 = rng.integers(0, 1 << 15, (4, bs, hk, hd), dtype=np.uint16)
    vc0 = rng.integers(0, 1 << 15, (4, bs, hk, hd), dtype=np.uint16)
    d_q, d_k, d_v = cuda.to_device(np.full((1, hq * hd), np.nan, np.float32)), cuda.to_device(kc0), cuda.to_device(vc0)
    rope = (cuda.to_device(np.array([pos], np.int32)), cuda.to_device(cos), cuda.to_device(sin),
            cuda.to_device(np.array([slot], np.int32)), d_k, d_v)
    path = gemm.gemv_path(N, K, "plain", warps=2, rows=2, unroll=1)
    gemm.gemv(cuda.to_device(x), cuda.to_device(w), d_q, bias=None if b is None else cuda.to_device(b), path=path,
              rope=rope, interleaved=interleaved)
    proj = gemm.linear_ref(x, w, b)
    kc, vc = kc0.copy(), vc0.copy()
    want_q = Q.qkv_rope_store_ref(proj, np.array([pos]), cos, sin, np.array([slot]), hq, hk, hd, kc, vc,
                                  interleaved=interleaved)
    assert _relerr(d_q.copy_to_host().reshape(1, hq, hd), want_q) < 1e-5
    for got, want in ((d_k.copy_to_host(), kc), (d_v.copy_to_host(), vc)):
        if slot < 0:
            np.testing.assert_array_equal(got, want)               # untouched
        else:
            g, t = bf16_bits_to_f32(got), bf16_bits_to_f32(want)
            np.testing.assert_allclose(g, t, rtol=1e-2, atol=1e-3)  # one bf16 rounding apart at most


def test_gemv_prefetch_changes_nothing():
    """prefetch=True (an L2 hint before the PDL wait; a no-op in the simulator) gives the same
    output as without, with accumulate and the carried sum of squares."""
    rng = np.random.default_rng(3)
    N, K = 128, 256
    x = rng.standard_normal((1, K)).astype(np.float32)
    w = f32_to_bf16_bits(rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K))
    r = rng.standard_normal((1, N)).astype(np.float32)
    outs = []
    for pf in (False, True):
        d = cuda.to_device(r.copy())
        ss = cuda.to_device(np.zeros(1, np.uint64))
        gemm.gemv(cuda.to_device(x), cuda.to_device(w), d, accumulate=True, ss_out=ss, prefetch=pf,
                  path=gemm.gemv_path(N, K, "plain", warps=2, rows=2, unroll=1))
        outs.append((d.copy_to_host(), ss.copy_to_host()))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    assert _relerr(outs[1][0], gemm.gemv_ref(x, w, "plain", residual=r)) < 1e-5
    with pytest.raises(AssertionError, match="prefetch"):
        gemm.gemv(cuda.to_device(x), cuda.to_device(np.concatenate([w, w])), cuda.to_device(np.zeros((1, N), np.float32)),
                  glu=True, prefetch=True)
