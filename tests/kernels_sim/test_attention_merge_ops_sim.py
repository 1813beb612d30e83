"""CudaOps.attention_linear_residual with levers.fuse_attention_merge under the simulator: decode
attention leaves split-K partials and the o_proj GEMV merges them (gemm.gemv 'merge'); the residual
equals the path with the merge kernel and the plain GEMV, with the carried norm sum as well."""
import math

import numpy as np
import pytest

from kernels_numba.ptx import SIM, f32_to_bf16_bits

pytestmark = pytest.mark.skipif(not SIM, reason="run with NUMBA_ENABLE_CUDASIM=1")

from numba import cuda  # noqa: E402

from test_flash_decode_sim import make_batch  # noqa: E402

HD, HQ, HK, BS = 64, 4, 2, 16


class _Cfg:
    rms_norm_eps = 1e-5
    head_dim = HD
    q_size = HQ * HD


class _Backend:
    def __init__(self, fused, kc, vc):
        self.fuse_decode, self.carry_norm_sums, self.skinny_max_t = True, True, 256
        self.flash_decode, self.prefill_min_tokens = True, 64
        self.fuse_attention_merge, self.prefetch_o_proj = fused, False
        self.k_cache64, self.v_cache64 = [kc], [vc]
        self.attn_scratch = np.zeros((16, HQ, HD + 2), np.float32)
        self.act = {"attn": np.zeros((1, HQ, HD), np.float32), "residual": None,
                    "norm_ss": np.zeros(4, np.uint64)}

    def blas_takes(self, rows, weight):
        return False

    def view(self, name, n, shape=None):
        v = self.act[name][:n]
        return v if shape is None else v.reshape(shape)


@pytest.mark.parametrize("ctx", [70, 9])
def test_fused_merge_equals_the_merge_kernel_path(ctx, monkeypatch):
    import metrale.runtime.cuda_backend as cb
    from metrale.runtime.cuda_backend import CudaOps
    monkeypatch.setattr(cb, "_ptr", id)
    monkeypatch.setattr(cb.flash_decode, "TARGET_WARPS", 64)   # a split at these sizes
    rng = np.random.default_rng(ctx)
    q, kc, vc, tables, token_seq, positions = make_batch(rng, HD, HQ, HK, [ctx], BS)
    K, N = HQ * HD, 64
    w = f32_to_bf16_bits(rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K))
    res0 = rng.standard_normal((1, N)).astype(np.float32)
    outs = []
    real = cb.gemm.gemv
    for fused in (False, True):
        b = _Backend(fused, kc.view(np.uint64), vc.view(np.uint64))
        res = res0.copy()
        b.act["residual"] = res
        ops = object.__new__(CudaOps)
        ops.b, ops.s, ops.cfg = b, 0, _Cfg()
        ops.g = type("G", (), {"tokens": 1, "max_query_len": 1, "max_context": 128})()
        ops._ss_used, ops._resid_ss = 0, None
        ops.block_tables, ops.token_seq, ops.positions = tables, token_seq, positions
        ops.rows_ptr = id(None)
        monkeypatch.setattr(CudaOps, "_buf", lambda self, name, n=None: self.b.act[name][:n or 1])
        calls = []
        monkeypatch.setattr(cb.gemm, "gemv", lambda *a, **k: calls.append(k.get("prologue", "plain")) or real(*a, **k))
        out = ops.attention_linear_residual(q, 0, w, res)
        assert out is res and calls == (["merge"] if fused else ["plain"])
        outs.append((res.copy(), ops._resid_ss is not None and int(b.act["norm_ss"][0])))
    np.testing.assert_allclose(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    assert outs[0][1] and abs(outs[1][1] - outs[0][1]) <= 1e-4 * outs[0][1]   # the carried sum too
    assert math.isfinite(float(outs[1][0].sum()))
