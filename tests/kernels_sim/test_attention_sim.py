"""paged_attention (split-K and not) and prefill_attention under the simulator vs attention_ref,
on one ragged batch mixing a decode row, a prefill chunk with earlier context and a verify block."""
import numpy as np
import pytest
from numba import cuda

from kernels_numba import attention as A
from kernels_numba.bf16 import to_bf16_bits


def make_batch(rng, hd, hq, hk, segments, bs=4, extra_blocks=5):
    """segments: [(first_position, num_tokens)]; blocks are scattered over the cache."""
    need = [(p + n + bs - 1) // bs for p, n in segments]
    nb = sum(need) + extra_blocks
    perm = rng.permutation(nb).astype(np.int32)
    tables = np.full((len(segments), max(need) + 1), -1, np.int32)
    k = 0
    for s, m in enumerate(need):
        tables[s, :m] = perm[k:k + m]
        k += m
    kc = to_bf16_bits(rng.standard_normal((nb, bs, hk, hd)))
    vc = to_bf16_bits(rng.standard_normal((nb, bs, hk, hd)))
    positions = np.concatenate([np.arange(p, p + n) for p, n in segments]).astype(np.int32)
    token_seq = np.concatenate([np.full(n, s) for s, (_, n) in enumerate(segments)]).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum([n for _, n in segments])]).astype(np.int32)
    q = rng.standard_normal((positions.shape[0], hq, hd)).astype(np.float32)
    return q, kc, vc, tables, token_seq, starts, positions


MIXED = [(20, 1), (9, 5), (30, 3)]


@pytest.mark.parametrize("hd,hq,hk,segments,partitions", [
    (64, 4, 2, MIXED, None),       # heuristic: 9 tokens x 2 kv heads, no split
    (64, 4, 2, [(70, 1), (3, 2)], 3),  # forced split-K, a context over three partitions
    (128, 6, 2, MIXED, 1),          # head_dim 128, 3 query heads per kv head, no split
])
def test_paged_attention(hd, hq, hk, segments, partitions):
    rng = np.random.default_rng(hd + hq)
    q, kc, vc, tables, token_seq, _, positions = make_batch(rng, hd, hq, hk, segments)
    scale = hd ** -0.5
    want = A.attention_ref(q, kc, vc, tables, token_seq, positions, scale)
    out = np.full_like(q, np.nan)
    scratch = np.zeros((4 * q.shape[0], hq, hd + 2), np.float32)
    A.paged_attention(q, kc, vc, tables, token_seq, positions, scale, out, scratch=scratch, partitions=partitions)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=2e-5)


def test_paged_attention_device_views_and_short_max_context():
    """uint64 device views (as the CUDA backend passes them); max_context below the real context:
    the last partition stretches to the end, nothing is dropped."""
    rng = np.random.default_rng(7)
    hd, hq, hk = 64, 2, 1
    q, kc, vc, tables, token_seq, _, positions = make_batch(rng, hd, hq, hk, [(69, 1), (12, 1)])
    want = A.attention_ref(q, kc, vc, tables, token_seq, positions, 0.3)
    assert A.decode_partitions(2, hk, 40, A.decode_config(hd, hq // hk), 8) == (3, 16)  # 3 x 16 < 70
    d_out = cuda.to_device(np.full_like(q, np.nan))
    d_scr = cuda.to_device(np.zeros((8, hq, hd + 2), np.float32))
    A.paged_attention(cuda.to_device(q), cuda.to_device(kc.view(np.uint64)), cuda.to_device(vc.view(np.uint64)),
                      cuda.to_device(tables), cuda.to_device(token_seq), cuda.to_device(positions), 0.3, d_out,
                      scratch=d_scr, max_context=40)
    np.testing.assert_allclose(d_out.copy_to_host(), want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("hd,hq,hk", [(64, 4, 2), (128, 3, 1)])
def test_prefill_attention(hd, hq, hk):
    rng = np.random.default_rng(hd * hq)
    segments = [(0, 7), (9, 5), (30, 1)]
    q, kc, vc, tables, token_seq, starts, positions = make_batch(rng, hd, hq, hk, segments)
    scale = hd ** -0.5
    want = A.attention_ref(q, kc, vc, tables, token_seq, positions, scale)
    out = np.full_like(q, np.nan)
    A.prefill_attention(q, kc, vc, tables, starts, positions, scale, out, max_query_len=7)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=2e-5)


def test_scratch_shape_bounds_the_split():
    rows, hq, width = A.paged_attention_scratch_shape(64, 32, 8, 128, 8192)
    assert (hq, width) == (32, 130)
    cfg = A.decode_config(128, 4)
    for t in (1, 2, 7, 32, 64):
        parts, part = A.decode_partitions(t, 8, 8192, cfg, rows)
        assert t * parts <= rows or parts == 1
        assert parts * part >= 8192
