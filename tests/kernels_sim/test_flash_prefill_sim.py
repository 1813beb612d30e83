"""flash_prefill_attention (mma.sync FA2-style prefill) under the simulator vs attention_ref on
bf16-rounded q: segments of different lengths (a fresh prompt longer than one query tile and one
key tile, chunks starting mid-sequence after cached positions), KV block 16 scattered over the
cache, GQA group 2 (one kv head, and two), head_dim 64. The simulator twins of mma.sync /
shfl.bfly / ex2 in kernels_numba/ptx.py run the real kernel code, lane for lane. The simulator
pays per block x key tile: the smallest head counts and segments that still reach every branch."""
import numpy as np
import pytest

from kernels_numba import flash_prefill as F
from kernels_numba.attention import attention_ref
from kernels_numba.bf16 import bf16_round

from test_attention_sim import make_batch as attention_batch


def make_batch(rng, hd, hq, hk, segments, bs=16, extra_blocks=3):
    """test_attention_sim's batch (segments: [(first_position, num_tokens)], scattered blocks)
    with block 16 and q doubled (scores spread wider than N(0, 1))."""
    q, *rest = attention_batch(rng, hd, hq, hk, segments, bs, extra_blocks)
    return (q * np.float32(2.0), *rest)


def _check(out, want):
    assert np.isfinite(out).all()
    err = np.abs(out - want)
    # bf16 rounding of q*scale and of P: a few 1e-3 relative on O
    assert err.max() < 3e-2, err.max()
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < 1e-2


def test_flash_prefill_matches_reference():
    """Default geometry (64 query rows, 64-key tiles, V loads during Q.K^T)."""
    rng = np.random.default_rng(3)
    hd, hq, hk = 64, 2, 1  # GQA group 2 (two kv heads: the other geometry's test)
    # (0, 70): a second query tile of 6 rows (warps 1-3 idle, rows clamped) whose first key tile
    # needs no causal mask; (37, 30): a chunk after cached keys over two key tiles, the second
    # partial and skipped by warp 0 (its rows all precede it), the segment's second query tile empty
    segments = [(0, 70), (37, 30)]
    q, kc, vc, tables, token_seq, starts, positions = make_batch(rng, hd, hq, hk, segments)
    scale = hd ** -0.5
    want = attention_ref(bf16_round(q), kc, vc, tables, token_seq, positions, scale)
    out = np.full_like(q, np.nan)
    F.flash_prefill_attention(q, kc.view(np.uint64), vc.view(np.uint64), tables, starts, positions, scale, out,
                              max_query_len=70)
    _check(out, want)


def test_flash_prefill_other_geometry():
    """The head_dim-128 geometry choices at head_dim 64: 32-key tiles, V loads after the softmax,
    2 warps; uint16 caches (viewed as uint64 by the launcher); a chunk after 45 cached positions."""
    rng = np.random.default_rng(5)
    hd, hq, hk = 64, 4, 2  # two kv heads (h // 2 != h % 2 for heads 1 and 2)
    segments = [(45, 20), (0, 40)]
    q, kc, vc, tables, token_seq, starts, positions = make_batch(rng, hd, hq, hk, segments)
    scale = hd ** -0.5
    want = attention_ref(bf16_round(q), kc, vc, tables, token_seq, positions, scale)
    out = np.full_like(q, np.nan)
    cfg = F.flash_config(hd, block_k=32, v_early=False, warps=2)
    F.flash_prefill_attention(q, kc, vc, tables, starts, positions, scale, out, max_query_len=40, config=cfg)
    _check(out, want)


def test_flash_config_checks():
    assert F.flash_config(128).block_q == 64
    with pytest.raises(ValueError):
        F.flash_config(48)
    with pytest.raises(ValueError):
        F.flash_config(64, block_k=48)
