"""The kernels the Gemma 3 CUDA part adds (runtime/cuda_gemma.py) under the simulator against
their references: GELU-tanh gating, the RMSNorm added into the residual after a block, the
embedding scale, final logit softcapping; and GemmaCudaOps.norm_residual / embed_scaled composed
onto CudaOps, on a stand-in backend."""
import math
from types import SimpleNamespace

import numpy as np
from numba import cuda

from kernels_numba.activation import gelu_tanh_mul, gelu_tanh_mul_ref, softcap
from kernels_numba.rmsnorm import rms_norm_into_residual, rms_norm_ref, scale_rows


def test_gelu_tanh_mul_matches_the_tanh_formula():
    rng = np.random.default_rng(0)
    gu = (3 * rng.standard_normal((3, 2 * 40))).astype(np.float32)
    out = np.zeros((3, 40), np.float32)
    gelu_tanh_mul(gu, out)
    np.testing.assert_allclose(out, gelu_tanh_mul_ref(gu), rtol=2e-6, atol=2e-6)
    g = gu[:, :40].astype(np.float64)          # GELU's tanh form differs from erf's by < 1e-3 here
    erf_form = 0.5 * g * (1 + np.vectorize(math.erf)(g / math.sqrt(2))) * gu[:, 40:]
    assert 0 < np.abs(out - erf_form).max() < 2e-2


def test_rms_norm_into_residual_adds_the_normed_block_output():
    rng = np.random.default_rng(1)
    x = (5 * rng.standard_normal((4, 72))).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(72)).astype(np.float32)
    res = rng.standard_normal((4, 72)).astype(np.float32)
    d = cuda.to_device(res)
    rms_norm_into_residual(x, w, 1e-6, d)
    np.testing.assert_allclose(d.copy_to_host(), res + rms_norm_ref(x, w, 1e-6), rtol=2e-6, atol=2e-6)


def test_scale_rows_and_softcap_in_place():
    rng = np.random.default_rng(2)
    x = (40 * rng.standard_normal((3, 50))).astype(np.float32)
    d = cuda.to_device(x)
    scale_rows(d, 25.3)
    np.testing.assert_allclose(d.copy_to_host(), x * np.float32(25.3), rtol=1e-6)
    d = cuda.to_device(x)
    softcap(d, 30.0)
    got = d.copy_to_host()
    np.testing.assert_allclose(got, 30.0 * np.tanh(x.astype(np.float64) / 30.0), rtol=2e-6, atol=2e-5)
    assert np.abs(got).max() < 30.0 < np.abs(x).max()


def test_gemma_ops_on_cuda_ops():
    """embed_scaled (the gather, then the scale in place) and norm_residual (into the same residual)
    through GemmaCudaOps on CudaOps, against what models/gemma.py's NumPy ops compute."""
    from kernels_numba.bf16 import from_bf16_bits, to_bf16_bits
    from metrale.models.families import compose_ops
    from metrale.runtime.cuda_backend import CudaOps
    from metrale.runtime.cuda_gemma import GemmaCudaOps
    rng = np.random.default_rng(3)
    T, D = 3, 64
    table = to_bf16_bits(rng.standard_normal((20, D)))
    ids = np.array([4, 19, 0], np.int32)
    resid = cuda.to_device(np.zeros((T, D), np.float32))
    b = SimpleNamespace(overlap=False, carry_norm_sums=False, fuse_decode=True, act={"residual": resid},
                        view=lambda name, n, shape=None: resid[:n])
    ops = object.__new__(compose_ops(CudaOps, (GemmaCudaOps,)))
    ops.b, ops.s, ops.cfg, ops.g = b, 0, SimpleNamespace(rms_norm_eps=1e-6), SimpleNamespace(tokens=T)
    ops.token_ids = cuda.to_device(ids)
    emb = ops.embed_scaled(cuda.to_device(table), math.sqrt(D)).copy_to_host()
    np.testing.assert_allclose(emb, from_bf16_bits(table)[ids] * np.float32(math.sqrt(D)), rtol=1e-6)
    x = (3 * rng.standard_normal((T, D))).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    want = emb + rms_norm_ref(x, w, 1e-6)
    got = ops.norm_residual(cuda.to_device(x), cuda.to_device(w), resid).copy_to_host()
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
