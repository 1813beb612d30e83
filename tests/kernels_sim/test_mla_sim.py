"""mla_decode (absorbed MLA over the paged bf16 latent cache; split-K and not) and store_latent
under the simulator, against the float64 references, on a ragged batch: a decode row, a prefill
chunk with earlier context (chunked prefill reads the earlier chunks' latents), a verify block."""
import numpy as np
import pytest
from numba import cuda

from kernels_numba import mla as M
from kernels_numba.bf16 import from_bf16_bits, to_bf16_bits


def make_batch(rng, segments, dk, bs=4, extra=3):
    need = [(p + n + bs - 1) // bs for p, n in segments]
    nb = sum(need) + extra
    perm = rng.permutation(nb).astype(np.int32)
    tables = np.full((len(segments), max(need) + 1), -1, np.int32)
    k = 0
    for s, m in enumerate(need):
        tables[s, :m] = perm[k:k + m]
        k += m
    cache = to_bf16_bits(rng.standard_normal((nb, bs, dk)))
    positions = np.concatenate([np.arange(p, p + n) for p, n in segments]).astype(np.int32)
    token_seq = np.concatenate([np.full(n, s) for s, (_, n) in enumerate(segments)]).astype(np.int32)
    return cache, tables, positions, token_seq


@pytest.mark.parametrize("r,rope,heads,group,segments,partitions", [
    (32, 16, 4, 4, [(9, 1), (5, 2)], None),      # one head group, no split
    (64, 16, 4, 2, [(18, 1)], 3),                  # 40 words per row (two lane passes), split-K
])
def test_mla_decode(r, rope, heads, group, segments, partitions):
    rng = np.random.default_rng(r + heads)
    cache, tables, positions, token_seq = make_batch(rng, segments, r + rope)
    t = len(positions)
    q = rng.standard_normal((t, heads, r + rope)).astype(np.float32)
    scale = 0.15
    want = M.mla_latent_ref(q, cache, tables, token_seq, positions, scale, r)
    out = cuda.to_device(np.full((t, heads, r), np.nan, np.float32))
    scratch = np.zeros((4 * t, heads, r + 2), np.float32)
    M.mla_decode(cuda.to_device(q), cuda.to_device(cache.view(np.uint32)), cuda.to_device(tables),
                 cuda.to_device(token_seq), cuda.to_device(positions), scale, out, scratch=cuda.to_device(scratch),
                 partitions=partitions, config=M.mla_config(r + rope, r, heads, group=group))
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-4, atol=2e-5)


def test_kernel_in_the_absorbed_pipeline_equals_naive():
    """bf16 cache written by store_latent; q absorbed on the host; kernel; up-projection: the
    naive form's output (to the float32 rounding of the kernel)."""
    rng = np.random.default_rng(9)
    h, nope, rope, r, v, bs = 2, 8, 8, 16, 8, 4
    n_ctx = 7
    c_kv, k_pe = rng.standard_normal((n_ctx, r)).astype(np.float32), rng.standard_normal((n_ctx, rope)).astype(np.float32)
    cache = np.zeros((3, bs, r + rope), np.uint16)
    table = np.array([[2, 0]], np.int32)
    slots = (table[0, np.arange(n_ctx) // bs] * bs + np.arange(n_ctx) % bs).astype(np.int32)
    slots[3] = -1                                   # "do not store": that row stays zero
    M.store_latent(c_kv, k_pe, slots, cache)
    ref_cache = np.zeros((3, bs, r + rope), np.float32)
    M.store_latent_ref(from_bf16_bits(to_bf16_bits(c_kv)), from_bf16_bits(to_bf16_bits(k_pe)), slots, ref_cache)
    np.testing.assert_array_equal(from_bf16_bits(cache), ref_cache)
    positions = np.array([6, 4], np.int32)
    seq = np.zeros(2, np.int32)
    q_nope, q_pe = rng.standard_normal((2, h, nope)), rng.standard_normal((2, h, rope))
    w = rng.standard_normal((h * (nope + v), r)) / 4
    q_abs = np.concatenate([M.absorb_q(q_nope, w), q_pe], -1).astype(np.float32)
    lat = np.zeros((2, h, r), np.float32)
    M.mla_decode(q_abs, cache, table, seq, positions, 0.2, lat, config=M.mla_config(r + rope, r, h))
    want = M.mla_naive_ref(q_nope, q_pe, cache, w, table, seq, positions, 0.2)
    np.testing.assert_allclose(M.unabsorb(lat, w, nope), want, rtol=1e-4, atol=1e-5)
