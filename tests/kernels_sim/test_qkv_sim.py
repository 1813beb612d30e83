"""qkv_rope_store and gather_rows under the CUDA simulator against their references."""
import numpy as np
import pytest
from numba import cuda

from kernels_numba.bf16 import from_bf16_bits
from kernels_numba.qkv import gather_rows, gather_rows_ref, qkv_rope_store, qkv_rope_store_ref
from metrale.models.rope import build_rope


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_rope_store(interleaved, qk_norm):
    rng = np.random.default_rng(int(interleaved) * 2 + int(qk_norm))
    T, hq, hk, hd, nb, bs = 3, 4, 2, 8, 4, 4
    qkv = rng.standard_normal((T, (hq + 2 * hk) * hd)).astype(np.float32)
    positions = np.array([0, 5, 9], dtype=np.int32)
    slots = np.array([1, 6, -1], dtype=np.int32)
    cos, sin = build_rope(hd, 10000.0).tables(16)
    qn = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32) if qk_norm else None
    kn = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32) if qk_norm else None
    kc = np.full((nb, bs, hk, hd), 7, np.uint16)
    vc = np.full((nb, bs, hk, hd), 7, np.uint16)
    kc_ref, vc_ref = kc.copy(), vc.copy()
    q_ref = qkv_rope_store_ref(qkv, positions, cos, sin, slots, hq, hk, hd, kc_ref, vc_ref,
                               interleaved=interleaved, q_norm=qn, k_norm=kn)
    d_kc, d_vc = cuda.to_device(kc), cuda.to_device(vc)
    d_q = cuda.to_device(np.full((T, hq, hd), np.nan, np.float32))
    qkv_rope_store(cuda.to_device(qkv), cuda.to_device(positions), cuda.to_device(cos), cuda.to_device(sin),
                   cuda.to_device(slots), d_q, d_kc, d_vc, interleaved=interleaved,
                   q_norm=None if qn is None else cuda.to_device(qn), k_norm=None if kn is None else cuda.to_device(kn))
    np.testing.assert_allclose(d_q.copy_to_host(), q_ref, rtol=1e-5, atol=1e-5)
    got_k, got_v = d_kc.copy_to_host(), d_vc.copy_to_host()
    # bf16 rounding of f32 vs f64 inputs may differ by one ulp
    np.testing.assert_allclose(from_bf16_bits(got_k), from_bf16_bits(kc_ref), rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(got_v, vc_ref)
    assert (got_k[3] == 7).all(), "the slot -1 row must not be stored"


def test_gather_rows():
    x = np.random.default_rng(0).standard_normal((5, 40)).astype(np.float32)
    rows = np.array([4, 0, 2], dtype=np.int32)
    out = cuda.to_device(np.zeros((3, 40), np.float32))
    gather_rows(cuda.to_device(x), cuda.to_device(rows), out)
    np.testing.assert_array_equal(out.copy_to_host(), gather_rows_ref(x, rows))
