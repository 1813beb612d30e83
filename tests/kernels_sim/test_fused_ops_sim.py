"""CudaOps.norm_linear / silu_mul_linear_residual (the CUDA backend's fused decode ops) under the
simulator, on a stand-in backend: at one row they run gemm.gemv's prologues, at more rows (or with
levers.fuse_decode off) the separate kernels; both equal the NumPy backend's composition."""
from types import SimpleNamespace

import numpy as np
import pytest

from kernels_numba.ptx import SIM, bf16_bits_to_f32, f32_to_bf16_bits

pytestmark = pytest.mark.skipif(not SIM, reason="run with NUMBA_ENABLE_CUDASIM=1")

from numba import cuda  # noqa: E402

# hidden, product rows, intermediate: the smallest the GEMV / GEMM kernels take (multiples of 64).
# Which kernels CudaOps launches depends on the rows, the levers and FUSE_MAX_K, not on these sizes;
# the simulator's cost grows with them (blocks = N / rows a block, each thread's loop with K).
K, N, F = 64, 64, 64


class _Cfg:
    rms_norm_eps = 1e-5


class _Backend:
    def __init__(self, fuse, T):
        self.fuse_decode = fuse
        self.carry_norm_sums = True
        # rows > 1 take the tiled GEMM (one 256-thread block at N = 64; the skinny one, 8 of them):
        # either is one gemm.linear launch here, and both kernels are test_gemm_sim's
        self.skinny_max_t = 1
        self.act = {"h": cuda.to_device(np.zeros((T, K), np.float32)),
                    "rows": cuda.to_device(np.zeros((T, K), np.float32)),
                    "act": cuda.to_device(np.zeros((T, F), np.float32)),
                    f"out{N}": cuda.to_device(np.zeros((T, N), np.float32)),
                    f"out{2 * F}": cuda.to_device(np.zeros((T, 2 * F), np.float32))}

    def blas_takes(self, rows, weight):
        return False

    def view(self, name, n, shape=None):       # CudaBackend.view without the cache
        v = self.act[name][:n]
        return v if shape is None else v.reshape(shape)


def _ops(fuse, T):
    from metrale.runtime.cuda_backend import CudaOps
    from metrale.runtime.numpy_backend import NumpyOps
    ops = object.__new__(CudaOps)
    ops.b, ops.s, ops.cfg = _Backend(fuse, T), 0, _Cfg()
    ops.g = type("G", (), {"tokens": T})()
    ops._ss_used, ops._resid_ss = 0, None
    import metrale.runtime.cuda_backend as cb
    ops.rows_ptr = cb._ptr(ops.b.act["rows"])     # after the test's _ptr patch
    ref = object.__new__(NumpyOps)
    ref.cfg = _Cfg()
    return ops, ref


@pytest.mark.parametrize("fuse,T", [(True, 1), (False, 1), (True, 2)])
def test_fused_ops_match_numpy(fuse, T, monkeypatch):
    import metrale.runtime.cuda_backend as cb
    monkeypatch.setattr(cb, "_ptr", id)     # simulator arrays have no __cuda_array_interface__
    rng = np.random.default_rng(T + 2 * fuse)
    x = rng.standard_normal((T, K)).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    w = f32_to_bf16_bits(rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K))
    wd = f32_to_bf16_bits(rng.standard_normal((N, F)).astype(np.float32) / np.sqrt(F))
    gu = rng.standard_normal((T, 2 * F)).astype(np.float32)
    res = rng.standard_normal((T, N)).astype(np.float32)
    ops, ref = _ops(fuse, T)
    got = ops.norm_linear(cuda.to_device(x), cuda.to_device(nw), cuda.to_device(w)).copy_to_host()
    want = ref.norm_linear(x.astype(np.float64), nw, bf16_bits_to_f32(w).astype(np.float64))
    assert np.abs(got - want).max() < 1e-2 * np.abs(want).max()
    d_res = cuda.to_device(res)
    got = ops.silu_mul_linear_residual(cuda.to_device(gu), cuda.to_device(wd), d_res).copy_to_host()
    want = ref.silu_mul_linear_residual(gu.astype(np.float64), bf16_bits_to_f32(wd).astype(np.float64), res)
    assert np.abs(got - want).max() < 1e-2 * np.abs(want).max()


def test_carried_norm_sums_match_numpy(monkeypatch):
    """One row with the residual's sum of squares carried (CudaOps._carry_norm): the o_proj and
    down GEMVs add sum(residual^2) into norm_ss slots, and the next norm_linear reads its slot
    (gemm.gemv rmsnorm_ss) instead of launching a norm; the results equal the NumPy composition."""
    import metrale.runtime.cuda_backend as cb
    monkeypatch.setattr(cb, "_ptr", id)
    rng = np.random.default_rng(11)
    ops, ref = _ops(True, 1)
    b = ops.b
    residual = rng.standard_normal((1, K)).astype(np.float32)
    b.act.update({"residual": cuda.to_device(residual.copy()), "norm_ss": cuda.to_device(np.zeros(4, np.uint64)),
                  f"out{K}": cuda.to_device(np.zeros((1, K), np.float32))})
    assert ops._carry_norm()
    attn = rng.standard_normal((1, K)).astype(np.float32)
    w_o = f32_to_bf16_bits(rng.standard_normal((K, K)).astype(np.float32) / np.sqrt(K))
    w_gu = f32_to_bf16_bits(rng.standard_normal((2 * F, K)).astype(np.float32) / np.sqrt(K))
    w_d = f32_to_bf16_bits(rng.standard_normal((K, F)).astype(np.float32) / np.sqrt(F))
    nw = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    f64 = lambda a: bf16_bits_to_f32(a).astype(np.float64)  # noqa: E731
    prologues = []
    real_gemv = cb.gemm.gemv

    def spy(*a, **k):
        prologues.append(k.get("prologue", "plain"))
        return real_gemv(*a, **k)
    monkeypatch.setattr(cb.gemm, "gemv", spy)
    monkeypatch.setattr(cb.rmsnorm, "rms_norm", None)     # a separate norm launch would fail here
    res = b.act["residual"]
    ops.linear_residual(cuda.to_device(attn), cuda.to_device(w_o), res)
    want_res = ref.linear_residual(attn.astype(np.float64), f64(w_o), residual.astype(np.float64))
    assert ops._resid_ss is not None
    gu = ops.norm_linear(res, cuda.to_device(nw), cuda.to_device(w_gu))
    want_gu = ref.norm_linear(want_res, nw, f64(w_gu))
    got_gu = gu.copy_to_host()
    assert np.abs(got_gu - want_gu).max() < 1e-2 * np.abs(want_gu).max()
    ops.silu_mul_linear_residual(gu, cuda.to_device(w_d), res)
    want_res = ref.silu_mul_linear_residual(got_gu.astype(np.float64), f64(w_d), want_res)
    got_res = res.copy_to_host()
    assert np.abs(got_res - want_res).max() < 1e-2 * np.abs(want_res).max()
    ss = [cb.gemm.ss_value(v) for v in b.act["norm_ss"].copy_to_host()]
    assert ops._ss_used == 2 and abs(ss[1] - float((got_res.astype(np.float64) ** 2).sum())) < 1e-3 * ss[1]
    out = ops.norm_linear(res, cuda.to_device(nw), cuda.to_device(w_o)).copy_to_host()
    want = ref.norm_linear(got_res.astype(np.float64), nw, f64(w_o))
    assert np.abs(out - want).max() < 1e-2 * np.abs(want).max()
    # o_proj (plain + sums), the norm as the consumer's prologue, down (silu_mul + sums), again
    assert prologues == ["plain", "rmsnorm_ss", "silu_mul", "rmsnorm_ss"]


@pytest.mark.parametrize("carry", [True, False])
def test_mlp_residual_glu_epilogue_matches_numpy(carry, monkeypatch):
    """One row whose down input is too wide for the silu*mul prologue (FUSE_MAX_K lowered below F
    and K here): CudaOps.mlp_residual runs silu*mul as the gate_up GEMV's epilogue (glu) and down as a
    plain GEMV, with the norm carried (rmsnorm_ss) or launched; the residual equals NumPy's."""
    import metrale.runtime.cuda_backend as cb
    monkeypatch.setattr(cb, "_ptr", id)
    monkeypatch.setattr(cb, "FUSE_MAX_K", 32)
    rng = np.random.default_rng(12 + carry)
    ops, ref = _ops(True, 1)
    b = ops.b
    b.carry_norm_sums = carry
    residual = rng.standard_normal((1, K)).astype(np.float32)
    b.act.update({"residual": cuda.to_device(residual.copy()), "norm_ss": cuda.to_device(np.zeros(4, np.uint64)),
                  f"out{K}": cuda.to_device(np.zeros((1, K), np.float32))})
    w_o = f32_to_bf16_bits(rng.standard_normal((K, K)).astype(np.float32) / np.sqrt(K))
    w_gu = f32_to_bf16_bits(rng.standard_normal((2 * F, K)).astype(np.float32) / np.sqrt(K))
    w_d = f32_to_bf16_bits(rng.standard_normal((K, F)).astype(np.float32) / np.sqrt(F))
    nw = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    f64 = lambda a: bf16_bits_to_f32(a).astype(np.float64)  # noqa: E731
    calls = []
    real_gemv = cb.gemm.gemv

    def spy(*a, **k):
        calls.append((k.get("prologue", "plain"), k.get("glu", False)))
        return real_gemv(*a, **k)
    monkeypatch.setattr(cb.gemm, "gemv", spy)
    res = b.act["residual"]
    attn = rng.standard_normal((1, K)).astype(np.float32)
    ops.linear_residual(cuda.to_device(attn), cuda.to_device(w_o), res)      # leaves the carried sum
    want = ref.linear_residual(attn.astype(np.float64), f64(w_o), residual.astype(np.float64))
    ops.mlp_residual(res, cuda.to_device(nw), cuda.to_device(w_gu), cuda.to_device(w_d))
    want = ref.mlp_residual(want, nw, f64(w_gu), f64(w_d))
    got = res.copy_to_host()
    assert np.abs(got - want).max() < 1e-2 * np.abs(want).max()
    assert [c for c in calls if c[1]] == [("rmsnorm_ss" if carry else "plain", True)], calls


@pytest.mark.parametrize("fuse", [True, False])
def test_norm_qkv_to_cache_rope_epilogue_equals_the_launches(fuse, monkeypatch):
    """CudaOps.norm_qkv_to_cache at one row: fused, the QKV GEMV rotates q into the q buffer and
    stores rotated k and v at the slot (gemm.gemv rope); unfused, norm + linear + qkv_rope_store.
    Same q and caches (to a bf16 rounding)."""
    import metrale.runtime.cuda_backend as cb
    from kernels_numba.ptx import bf16_bits_to_f32
    monkeypatch.setattr(cb, "_ptr", id)
    hq, hk, hd, bs = 2, 1, 32, 4
    rng = np.random.default_rng(21)
    x = rng.standard_normal((1, K)).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    w = f32_to_bf16_bits(rng.standard_normal(((hq + 2 * hk) * hd, K)).astype(np.float32) / np.sqrt(K))
    ang = rng.uniform(0, 6, (16, hd // 2))
    results = []
    real = cb.qkv.qkv_rope_store
    for fused in (fuse, False):
        ops, _ = _ops(fused, 1)
        b = ops.b
        b.carry_norm_sums = False
        b.cos, b.sin = cuda.to_device(np.cos(ang).astype(np.float32)), cuda.to_device(np.sin(ang).astype(np.float32))
        b.kv = SimpleNamespace(k=[cuda.to_device(np.zeros((3, bs, hk, hd), np.uint16))],
                               v=[cuda.to_device(np.zeros((3, bs, hk, hd), np.uint16))])
        b.act.update({"q": cuda.to_device(np.zeros((1, hq, hd), np.float32)),
                      f"out{w.shape[0]}": cuda.to_device(np.zeros((1, w.shape[0]), np.float32))})
        ops.cfg.rope_interleaved, ops.cfg.q_size = False, hq * hd
        ops.positions, ops.slot_mapping = cuda.to_device(np.array([9], np.int32)), cuda.to_device(np.array([6], np.int32))
        launched = []
        monkeypatch.setattr(cb.qkv, "qkv_rope_store", lambda *a, **k: launched.append(1) or real(*a, **k))
        q = ops.norm_qkv_to_cache(cuda.to_device(x), cuda.to_device(nw), cuda.to_device(w), None, 0, None, None)
        assert bool(launched) == (not fused)
        results.append((q.copy_to_host(), bf16_bits_to_f32(b.kv.k[0].copy_to_host()),
                        bf16_bits_to_f32(b.kv.v[0].copy_to_host())))
    (q1, k1, v1), (q0, k0, v0) = results
    assert _rel(q1, q0) < 1e-5 and np.abs(k1[1, 2]).max() > 0
    np.testing.assert_allclose(k1, k0, rtol=1e-2, atol=1e-3)
    np.testing.assert_allclose(v1, v0, rtol=1e-2, atol=1e-3)


def _rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)
