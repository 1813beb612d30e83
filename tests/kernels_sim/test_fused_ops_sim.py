"""CudaOps.norm_linear / silu_mul_linear_residual (the CUDA backend's fused decode ops) under the
simulator, on a stand-in backend: at one row they run gemm.gemv's prologues, at more rows (or with
levers.fuse_decode off) the separate kernels; both equal the NumPy backend's composition."""
import numpy as np
import pytest

from kernels_numba.ptx import SIM, bf16_bits_to_f32, f32_to_bf16_bits

pytestmark = pytest.mark.skipif(not SIM, reason="run with NUMBA_ENABLE_CUDASIM=1")

from numba import cuda  # noqa: E402

K, N, F = 128, 64, 128       # hidden, product rows, intermediate


class _Cfg:
    rms_norm_eps = 1e-5


class _Backend:
    def __init__(self, fuse, T):
        self.fuse_decode = fuse
        self.skinny_max_t = 256
        self.act = {"h": cuda.to_device(np.zeros((T, K), np.float32)),
                    "rows": cuda.to_device(np.zeros((T, K), np.float32)),
                    "act": cuda.to_device(np.zeros((T, F), np.float32)),
                    f"out{N}": cuda.to_device(np.zeros((T, N), np.float32)),
                    f"out{2 * F}": cuda.to_device(np.zeros((T, 2 * F), np.float32))}

    def blas_takes(self, rows, weight):
        return False


def _ops(fuse, T):
    from metrale.runtime.cuda_backend import CudaOps
    from metrale.runtime.numpy_backend import NumpyOps
    ops = object.__new__(CudaOps)
    ops.b, ops.s, ops.cfg = _Backend(fuse, T), 0, _Cfg()
    ops.g = type("G", (), {"tokens": T})()
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
