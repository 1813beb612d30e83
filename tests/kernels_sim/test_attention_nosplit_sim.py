"""paged_attention at short contexts (max_context <= no_split_context): one partition, the decode
kernel writes the output itself and the split-K merge kernel is not launched, even with a scratch
(the CUDA backend always passes one)."""
import numpy as np
import pytest
from numba import cuda

from kernels_numba import attention as A
from kernels_numba.bf16 import SIMULATOR

from test_attention_sim import make_batch

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="run with NUMBA_ENABLE_CUDASIM=1")


class _NoLaunch:
    def __getitem__(self, cfg):
        raise AssertionError("the split-K merge kernel was launched")


def test_short_context_skips_the_merge(monkeypatch):
    rng = np.random.default_rng(11)
    hd, hq, hk = 64, 3, 1
    ctx = 32
    q, kc, vc, tables, token_seq, _, positions = make_batch(rng, hd, hq, hk, [(ctx - 1, 1), (5, 1)])
    cfg = A.decode_config(hd, hq // hk, chunk=8)   # short chunks: the heuristic would split 32
    rows = 64
    assert A.decode_partitions(2, hk, ctx, cfg, rows, no_split_context=ctx) == (1, A.NO_SPLIT_PART)
    assert A.decode_partitions(2, hk, ctx, cfg, rows, no_split_context=0)[0] > 1   # would split
    monkeypatch.setattr(A, "_merge_partitions_kernel", _NoLaunch())
    want = A.attention_ref(q, kc, vc, tables, token_seq, positions, 0.125)
    d_out = cuda.to_device(np.full_like(q, np.nan))
    d_scr = cuda.to_device(np.full((rows, hq, hd + 2), np.nan, np.float32))
    A.paged_attention(cuda.to_device(q), cuda.to_device(kc), cuda.to_device(vc), cuda.to_device(tables),
                      cuda.to_device(token_seq), cuda.to_device(positions), 0.125, d_out, scratch=d_scr,
                      max_context=ctx, config=cfg, no_split_context=ctx)
    np.testing.assert_allclose(d_out.copy_to_host(), want, rtol=1e-4, atol=2e-5)
