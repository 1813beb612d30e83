"""kernels_numba.gemm on a real GPU at model sizes, each path against the float64 reference."""
import functools

import numpy as np
import pytest

from kernels_numba import gemm
from kernels_numba.ptx import bf16_bits_to_f32, f32_to_bf16_bits

pytestmark = pytest.mark.gpu

from numba import cuda  # noqa: E402

# (N, K): Llama-3-8B o_proj / down_proj; SmolLM2-135M kv_proj / up_proj / down_proj
SHAPES = [(4096, 4096), (4096, 14336), (192, 576), (1536, 576), (576, 1536)]
PATHS = {"fma": gemm.fma_path, "skinny": gemm.skinny_path, "tiled": gemm.tiled_path,
         "auto": lambda T, N: None}
# every streaming config the dispatcher can pick (gemm.skinny_cfg)
SKINNY_CFGS = [(1, 1, 4), (1, 2, 2), (1, 2, 4), (1, 4, 2), (2, 4, 1), (2, 2, 2), (4, 2, 1)]


@functools.lru_cache(maxsize=None)
def _weights(N, K):
    """bf16 weights (host bits, device copy, float64 copy), made once per shape."""
    w = f32_to_bf16_bits(np.random.default_rng(N * 7 + K).standard_normal((N, K), np.float32)
                         / np.float32(np.sqrt(K)))
    return w, cuda.to_device(w), bf16_bits_to_f32(w).astype(np.float64)


def _case(seed, T, N, K, bias):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32) if bias else None
    return x, b


def _ref(x, w64, b=None, r=None):
    y = x.astype(np.float64) @ w64.T
    return y + (0 if b is None else b) + (0 if r is None else r)


def _check(out, ref):
    assert np.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < 1e-2, f"relative error {err:.2e}"
    return err


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("path,T", [("fma", 1), ("fma", 3), ("skinny", 1), ("skinny", 7),
                                    ("skinny", 16), ("skinny", 40), ("skinny", 200),
                                    ("tiled", 17), ("tiled", 300), ("auto", 2), ("auto", 24),
                                    ("auto", 64), ("auto", 100), ("auto", 256)])
def test_linear(path, T, N, K):
    _, d_w, w64 = _weights(N, K)
    x, b = _case(T * 1000 + N + K, T, N, K, bias=(T % 2 == 1))
    d_out = cuda.to_device(np.full((T, N), np.nan, np.float32))
    gemm.linear(cuda.to_device(x), d_w, d_out, None if b is None else cuda.to_device(b),
                path=PATHS[path](T, N))
    _check(d_out.copy_to_host(), _ref(x, w64, b))


@pytest.mark.parametrize("path,T", [("fma", 2), ("skinny", 9), ("tiled", 200)])
def test_linear_residual(path, T):
    N, K = 4096, 4096
    _, d_w, w64 = _weights(N, K)
    x, _ = _case(T, T, N, K, bias=False)
    r = np.random.default_rng(5).standard_normal((T, N)).astype(np.float32)
    d_out = cuda.to_device(r)
    gemm.linear_residual(cuda.to_device(x), d_w, d_out, path=PATHS[path](T, N))
    _check(d_out.copy_to_host(), _ref(x, w64, None, r))


@pytest.mark.parametrize("cfg", SKINNY_CFGS)
@pytest.mark.parametrize("T", [5, 50])
def test_skinny_configs(cfg, T):
    N, K = 1536, 4096
    _, d_w, w64 = _weights(N, K)
    x, b = _case(T + sum(cfg), T, N, K, bias=True)
    d_out = cuda.to_device(np.full((T, N), np.nan, np.float32))
    gemm.linear(cuda.to_device(x), d_w, d_out, cuda.to_device(b),
                path=gemm.skinny_path(T, N, *cfg))
    _check(d_out.copy_to_host(), _ref(x, w64, b))


def test_large_prefill_tile():
    T, N, K = 1000, 4096, 4096          # tiled path; T not a tile multiple
    _, d_w, w64 = _weights(N, K)
    x, b = _case(3, T, N, K, bias=True)
    assert gemm.pick_path(T, N)[0] == "tiled"
    d_out = cuda.to_device(np.full((T, N), np.nan, np.float32))
    s = cuda.stream()
    gemm.linear(cuda.to_device(x), d_w, d_out, cuda.to_device(b), stream=s)
    s.synchronize()
    _check(d_out.copy_to_host(), _ref(x, w64, b))


def test_linear_ref_matches_helper():
    w, _, w64 = _weights(192, 576)
    x, b = _case(1, 3, 192, 576, bias=True)
    assert np.allclose(gemm.linear_ref(x, w, b), _ref(x, w64, b))
