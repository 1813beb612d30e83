"""MLA references: the naive (decompress K/V per head) and absorbed (attend in the latent space)
forms agree to float64 precision over a paged latent cache, chunk by chunk."""
import numpy as np
import pytest

from kernels_numba import mla as M
from kernels_numba.bf16 import to_bf16_bits


def _paged(rng, segments, bs, dk, extra=3, bits=False):
    need = [(p + n + bs - 1) // bs for p, n in segments]
    nb = sum(need) + extra
    perm = rng.permutation(nb).astype(np.int32)
    tables = np.full((len(segments), max(need) + 1), -1, np.int32)
    k = 0
    for s, m in enumerate(need):
        tables[s, :m] = perm[k:k + m]
        k += m
    cache = rng.standard_normal((nb, bs, dk))
    if bits:
        cache = to_bf16_bits(cache)
    positions = np.concatenate([np.arange(p, p + n) for p, n in segments]).astype(np.int32)
    token_seq = np.concatenate([np.full(n, s) for s, (_, n) in enumerate(segments)]).astype(np.int32)
    return cache, tables, positions, token_seq


@pytest.mark.parametrize("bits", [False, True])
def test_naive_equals_absorbed(bits):
    rng = np.random.default_rng(3)
    h, nope, rope, r, v = 4, 16, 8, 32, 12
    cache, tables, positions, token_seq = _paged(rng, [(0, 7), (9, 1), (20, 3)], 4, r + rope, bits=bits)
    q_nope = rng.standard_normal((len(positions), h, nope))
    q_pe = rng.standard_normal((len(positions), h, rope))
    w_kv_b = rng.standard_normal((h * (nope + v), r)) / np.sqrt(r)
    args = (cache, w_kv_b, tables, token_seq, positions, 0.17)
    naive = M.mla_naive_ref(q_nope, q_pe, *args)
    absorbed = M.mla_absorbed_ref(q_nope, q_pe, *args)
    assert naive.shape == (len(positions), h, v)
    np.testing.assert_allclose(absorbed, naive, rtol=1e-12, atol=1e-13)


def test_chunks_attend_to_earlier_chunks():
    """A prompt run as chunks [0,5) [5,9) [9,13) over the cache gives the one-shot outputs."""
    rng = np.random.default_rng(4)
    h, nope, rope, r, v, bs, n = 2, 8, 4, 16, 8, 4, 13
    cache, tables, _, _ = _paged(rng, [(0, n)], bs, r + rope)
    q_nope, q_pe = rng.standard_normal((n, h, nope)), rng.standard_normal((n, h, rope))
    w = rng.standard_normal((h * (nope + v), r))
    pos = np.arange(n, dtype=np.int32)
    whole = M.mla_naive_ref(q_nope, q_pe, cache, w, tables, np.zeros(n, np.int32), pos, 0.3)
    for a, b in [(0, 5), (5, 9), (9, 13)]:
        part = M.mla_absorbed_ref(q_nope[a:b], q_pe[a:b], cache, w, tables, np.zeros(b - a, np.int32), pos[a:b], 0.3)
        np.testing.assert_allclose(part, whole[a:b], rtol=1e-12, atol=1e-13)


def test_store_latent_ref_and_rows():
    rng = np.random.default_rng(5)
    cache = np.zeros((4, 2, 6))
    c_kv, k_pe = rng.standard_normal((3, 4)), rng.standard_normal((3, 2))
    M.store_latent_ref(c_kv, k_pe, np.array([5, -1, 0], np.int32), cache)
    np.testing.assert_array_equal(cache[2, 1], np.concatenate([c_kv[0], k_pe[0]]))
    np.testing.assert_array_equal(cache[0, 0], np.concatenate([c_kv[2], k_pe[2]]))
    assert np.count_nonzero(cache.reshape(8, 6).any(axis=1)) == 2
    rows = M.latent_rows_ref(cache, np.array([2, 0]), 3)
    np.testing.assert_array_equal(rows[1], cache[2, 1])
    np.testing.assert_array_equal(rows[2], cache[0, 0])


def test_mla_config_and_scratch():
    cfg = M.mla_config(576, 512, 128)
    assert cfg.group == 16
    assert M.mla_config(576, 512, 12).group == 12
    with pytest.raises(ValueError, match="even"):
        M.mla_config(575, 512, 16)
    rows, heads, width = M.mla_scratch_shape(8, 16, 576, 512, 8192)
    assert (heads, width) == (16, 514) and rows >= 8
