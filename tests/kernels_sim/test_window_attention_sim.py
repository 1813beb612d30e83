"""Sliding-window attention (window > 0: a query at position p reads positions p - W + 1..p) in the
four CUDA attention kernels under the simulator, against attention_ref with the same window: the
FP32 decode kernel (split-K and not), the tensor-core decode kernel (a window start that is not a
multiple of its key step, split-K), and both prefill kernels (windows shorter than a key tile, a
chunk after cached positions, a query tile whose first rows reach back past its last rows' window)."""
import numpy as np
import pytest

from kernels_numba import attention as A
from kernels_numba import flash_decode as FD
from kernels_numba import flash_prefill as F
from kernels_numba.bf16 import bf16_round

from test_attention_sim import make_batch


@pytest.mark.parametrize("window,partitions", [(5, 1), (20, 3), (200, None)])
def test_paged_attention_window(window, partitions):
    rng = np.random.default_rng(window)
    hd, hq, hk = 64, 4, 2
    q, kc, vc, tables, token_seq, _, positions = make_batch(rng, hd, hq, hk, [(70, 1), (3, 2), (30, 3)])
    want = A.attention_ref(q, kc, vc, tables, token_seq, positions, 0.2, window=window)
    assert not np.allclose(want, A.attention_ref(q, kc, vc, tables, token_seq, positions, 0.2)) or window >= 74
    out = np.full_like(q, np.nan)
    scratch = np.zeros((4 * q.shape[0], hq, hd + 2), np.float32)
    A.paged_attention(q, kc, vc, tables, token_seq, positions, 0.2, out, scratch=scratch, partitions=partitions,
                      window=window)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("window,partitions", [(13, 1), (21, 2)])
def test_flash_decode_window(window, partitions):
    """Key steps of 8 from a multiple of 8 below the window's start: the keys before it masked."""
    rng = np.random.default_rng(10 + window)
    hd, hq, hk, bs = 64, 4, 1, 4
    q, kc, vc, tables, token_seq, _, positions = make_batch(rng, hd, hq, hk, [(44, 1), (5, 1), (60, 1)], bs)
    want = A.attention_ref(q, kc, vc, tables, token_seq, positions, 0.125, window=window)
    out = np.full_like(q, np.nan)
    scratch = np.zeros((8 * q.shape[0], hq, hd + 2), np.float32)
    cfg = FD.flash_decode_config(hd, hq // hk, bs, warps=2, keys=8)
    FD.flash_decode_attention(q, kc, vc, tables, token_seq, positions, 0.125, out, scratch=scratch,
                              partitions=partitions, config=cfg, window=window)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-2)
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < 3e-3


def test_prefill_attention_window():
    rng = np.random.default_rng(3)
    hd, hq, hk = 64, 4, 2
    q, kc, vc, tables, token_seq, starts, positions = make_batch(rng, hd, hq, hk, [(0, 12), (20, 6), (40, 1)])
    want = A.attention_ref(q, kc, vc, tables, token_seq, positions, 0.2, window=4)
    out = np.full_like(q, np.nan)
    A.prefill_attention(q, kc, vc, tables, starts, positions, 0.2, out, max_query_len=12, window=4)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=2e-5)


def test_flash_prefill_window():
    """32-key tiles, 2 warps of 16 rows, window 4: in (20, 32) warp 0's rows 32-35 have no key in
    the block's first tile (what they add there is rescaled to 0 at their first key) and warp 1 skips that tile;
    (45, 20) is a chunk after cached positions."""
    rng = np.random.default_rng(4)
    hd, hq, hk = 64, 2, 1
    q, kc, vc, tables, token_seq, starts, positions = make_batch(rng, hd, hq, hk, [(0, 40), (45, 20), (20, 32)], bs=16)
    q = q * np.float32(2.0)
    want = A.attention_ref(bf16_round(q), kc, vc, tables, token_seq, positions, 0.125, window=4)
    out = np.full_like(q, np.nan)
    cfg = F.flash_config(hd, block_k=32, v_early=False, warps=2)
    F.flash_prefill_attention(q, kc, vc, tables, starts, positions, 0.125, out, max_query_len=40, config=cfg,
                              window=4)
    assert np.isfinite(out).all()
    assert np.abs(out - want).max() < 3e-2
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < 1e-2
