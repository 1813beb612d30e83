"""flash_decode_attention (mma.sync bf16 S, tf32 P.V) under the simulator vs attention_ref: several
sequences with different contexts (1, inside one step, over several steps and partitions),
scattered blocks, G = 3 and 4, head_dim 64 and 128, block size 4 (a table read per key) and 16
(one per step), split-K (forced and heuristic) and not, CUDA-graph padding rows."""
import numpy as np
import pytest
from numba import cuda

from kernels_numba import attention as A
from kernels_numba import flash_decode as FD

from test_attention_sim import make_batch as attention_batch


def make_batch(rng, hd, hq, hk, contexts, bs, extra_blocks=3):
    """One decode token per sequence at position ctx - 1 (test_attention_sim's batch)."""
    q, kc, vc, tables, token_seq, _, positions = attention_batch(rng, hd, hq, hk, [(c - 1, 1) for c in contexts],
                                                                 bs, extra_blocks)
    return q, kc, vc, tables, token_seq, positions


def check(out, want):
    assert np.isfinite(out).all()
    rel = np.linalg.norm(out - want) / np.linalg.norm(want)
    assert rel < 3e-3, rel  # q bf16, P tf32: measured ~4e-4
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-2)


@pytest.mark.parametrize("hd,hq,hk,bs,contexts,partitions,over", [
    (64, 4, 1, 4, [1, 13, 45], None, {"warps": 2, "keys": 8}),   # heuristic split, table read per key
    (64, 6, 2, 16, [37, 1], 3, {"warps": 2, "keys": 8}),         # G=3, forced 3-way split, one read per step
    (128, 4, 1, 16, [40, 3], 1, {"warps": 2}),                   # hd 128, no split, KT=16
    (64, 3, 1, 16, [70], 2, {}),                                 # default geometry (4 warps x 16 keys), split
    (128, 4, 1, 16, [1, 33, 100], None, {}),                     # G=4, hd 128, default geometry, heuristic (1 kv head: 2 above)
])
def test_flash_decode(hd, hq, hk, bs, contexts, partitions, over):
    rng = np.random.default_rng(hd + hq + bs)
    q, kc, vc, tables, token_seq, positions = make_batch(rng, hd, hq, hk, contexts, bs)
    scale = hd ** -0.5
    want = A.attention_ref(q, kc, vc, tables, token_seq, positions, scale)
    out = np.full_like(q, np.nan)
    scratch = np.zeros((8 * q.shape[0], hq, hd + 2), np.float32)
    cfg = FD.flash_decode_config(hd, hq // hk, bs, **over)
    FD.flash_decode_attention(q, kc, vc, tables, token_seq, positions, scale, out, scratch=scratch,
                              partitions=partitions, config=cfg)
    check(out, want)


def test_flash_decode_graph_padding_and_short_max_context():
    """uint64 device views; two CUDA-graph padding rows (position 0, a sequence whose table is all
    -1: finite garbage allowed); max_context below the real context (the last partition
    stretches)."""
    rng = np.random.default_rng(5)
    hd, hq, hk, bs = 64, 4, 1, 16
    q, kc, vc, tables, token_seq, positions = make_batch(rng, hd, hq, hk, [50, 20], bs)
    tables = np.concatenate([tables, np.full((1, tables.shape[1]), -1, np.int32)])
    q = np.concatenate([q, rng.standard_normal((2, hq, hd)).astype(np.float32)])
    token_seq = np.array([0, 1, 2, 2], np.int32)
    positions = np.array([49, 19, 0, 0], np.int32)
    cfg = FD.flash_decode_config(hd, hq // hk, bs, warps=2, keys=8)
    want = A.attention_ref(q[:2], kc, vc, tables[:2], token_seq[:2], positions[:2], 0.3)
    d_out = cuda.to_device(np.full_like(q, np.nan))
    d_scr = cuda.to_device(np.zeros((16, hq, hd + 2), np.float32))
    FD.flash_decode_attention(cuda.to_device(q), cuda.to_device(kc.view(np.uint64)),
                              cuda.to_device(vc.view(np.uint64)), cuda.to_device(tables),
                              cuda.to_device(token_seq), cuda.to_device(positions), 0.3, d_out,
                              scratch=d_scr, max_context=32, partitions=2, config=cfg)
    out = d_out.copy_to_host()
    assert np.isfinite(out).all()
    check(out[:2], want)


def test_partition_heuristic():
    cfg = FD.flash_decode_config(128, 4, 16)
    rows = A.paged_attention_scratch_shape(64, 32, 8, 128, 8192)[0]
    for t in (1, 2, 7, 32, 64):
        parts, part = FD.flash_decode_partitions(t, 8, 8192, cfg, rows)
        assert parts == 1 or (t * parts <= rows and part % cfg.granule == 0 and parts * part >= 8192)
    assert FD.flash_decode_partitions(4, 8, 4096, cfg, 0) == (1, A.NO_SPLIT_PART)


@pytest.mark.parametrize("contexts,partitions", [([100, 37, 5, 64], 3), ([130, 1], 4), ([200], 2)])
def test_flash_decode_over_a_large_bucket(contexts, partitions):
    """The grid is sized for a graph bucket (max_context 1024) far above the real contexts: the
    partitions past a token's context exit, and the merge agrees with the split."""
    rng = np.random.default_rng(sum(contexts))
    hd, hq, hk, bs = 64, 4, 1, 16
    q, kc, vc, tables, token_seq, positions = make_batch(rng, hd, hq, hk, contexts, bs)
    want = A.attention_ref(q, kc, vc, tables, token_seq, positions, hd ** -0.5)
    out = np.full_like(q, np.nan)
    scratch = np.zeros((8 * q.shape[0], hq, hd + 2), np.float32)
    cfg = FD.flash_decode_config(hd, hq // hk, bs, warps=2, keys=8)
    FD.flash_decode_attention(q, kc, vc, tables, token_seq, positions, hd ** -0.5, out, scratch=scratch,
                              max_context=1024, partitions=partitions, config=cfg)
    check(out, want)


@pytest.mark.parametrize("partitions", [1, 3])
def test_flash_decode_bf16_out_equals_rounded_float_out(partitions):
    """out uint16 (room for [T, Hq * hd], as cuBLASLt's staging buffer): bf16 bits of what the
    float32 output holds, unsplit (the kernel's store) and split (the bf16 merge kernel)."""
    from kernels_numba.ptx import f32_to_bf16_bits
    rng = np.random.default_rng(11 + partitions)
    hd, hq, hk, bs = 64, 6, 2, 16
    q, kc, vc, tables, token_seq, positions = make_batch(rng, hd, hq, hk, [37, 70], bs)
    cfg = FD.flash_decode_config(hd, hq // hk, bs, warps=2, keys=8)
    scratch = np.zeros((8 * q.shape[0], hq, hd + 2), np.float32)
    out = np.full_like(q, np.nan)
    FD.flash_decode_attention(q, kc, vc, tables, token_seq, positions, 0.2, out, scratch=scratch,
                              partitions=partitions, config=cfg)
    staged = np.full(q.size + 7, 0xFFFF, np.uint16)            # bigger than needed, as blas_input's view
    FD.flash_decode_attention(q, kc, vc, tables, token_seq, positions, 0.2, staged, scratch=scratch,
                              partitions=partitions, config=cfg)
    np.testing.assert_array_equal(staged[:q.size], f32_to_bf16_bits(out).reshape(-1))
    assert (staged[q.size:] == 0xFFFF).all()
