"""The Numba CPU layer kernels (kernels_numba/cpu_layers.py) against their NumPy references: RMSNorm,
silu*mul, RoPE + K/V write (both pairings, partial rotary, per-head norms) and paged causal
attention (GQA, ragged segments, sliding window), on the serial and the parallel variants."""
import numpy as np
import pytest

from kernels_numba import cpu_layers as L


@pytest.mark.parametrize("T", [1, L.PARALLEL_MIN_ROWS + 3])
def test_rms_norm_and_silu_mul(T, rng):
    x = rng.standard_normal((T, 48)).astype(np.float32)
    w = rng.standard_normal(48).astype(np.float32)
    out = np.empty_like(x)
    L.rms_norm(x, w, 1e-5, out)
    np.testing.assert_allclose(out, L.rms_norm_ref(x, w, 1e-5), rtol=2e-6, atol=2e-6)
    gu = rng.standard_normal((T, 64)).astype(np.float32) * 4
    out = np.empty((T, 32), np.float32)
    L.silu_mul(gu, out)
    np.testing.assert_allclose(out, L.silu_mul_ref(gu), rtol=2e-6, atol=2e-6)


def rope_ref(x, cos, sin, interleaved):
    from metrale.runtime.numpy_backend import apply_rope
    return apply_rope(x, cos, sin, interleaved)


@pytest.mark.parametrize("interleaved,rot,norms", [(True, 16, False), (False, 8, True)])
@pytest.mark.parametrize("T", [3, L.PARALLEL_MIN_ROWS + 1])
def test_rope_to_cache(interleaved, rot, norms, T, rng):
    Hq, Hk, hd, slots = 4, 2, 16, 40
    qkv = rng.standard_normal((T, (Hq + 2 * Hk) * hd)).astype(np.float32)
    ang = rng.uniform(0, 6, (T, rot // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    qn, kn = ((1 + 0.1 * rng.standard_normal(hd)).astype(np.float32) for _ in range(2))
    none = np.zeros(0, np.float32)
    slot = rng.permutation(slots)[:T].astype(np.int32)
    slot[1] = -1                                           # a token whose K/V is not stored
    k_flat, v_flat = np.zeros((slots, Hk, hd), np.float32), np.zeros((slots, Hk, hd), np.float32)
    q = np.empty((T, Hq, hd), np.float32)
    L.rope_to_cache(qkv, cos, sin, interleaved, qn if norms else none, kn if norms else none, 1e-6, slot,
                    k_flat, v_flat, q)
    qr = qkv[:, :Hq * hd].reshape(T, Hq, hd)
    kr = qkv[:, Hq * hd:(Hq + Hk) * hd].reshape(T, Hk, hd)
    if norms:
        qr, kr = L.rms_norm_ref(qr, qn, 1e-6), L.rms_norm_ref(kr, kn, 1e-6)
    np.testing.assert_allclose(q, rope_ref(qr, cos, sin, interleaved), rtol=1e-5, atol=1e-5)
    keep = slot >= 0
    np.testing.assert_allclose(k_flat[slot[keep]], rope_ref(kr, cos, sin, interleaved)[keep], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(v_flat[slot[keep]], qkv[keep, (Hq + Hk) * hd:].reshape(-1, Hk, hd))
    assert not np.delete(k_flat, slot[keep], axis=0).any()


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("lens", [[(1, 9), (1, 30), (1, 2)], [(40, 40), (3, 20), (1, 7)]])   # (new tokens, context)
def test_paged_attention(lens, window, rng):
    Hq, Hk, hd, bs, nblocks = 6, 2, 16, 4, 64
    k_cache = rng.standard_normal((nblocks, bs, Hk, hd)).astype(np.float32)
    v_cache = rng.standard_normal((nblocks, bs, Hk, hd)).astype(np.float32)
    perm = rng.permutation(nblocks).astype(np.int32)
    tables = np.zeros((len(lens), 12), np.int32)
    starts, positions, used = [0], [], 0
    for s, (n, ctx) in enumerate(lens):
        need = -(-ctx // bs)
        tables[s, :need] = perm[used:used + need]
        used += need
        positions += list(range(ctx - n, ctx))
        starts.append(starts[-1] + n)
    positions, starts = np.array(positions, np.int32), np.array(starts, np.int32)
    q = rng.standard_normal((len(positions), Hq, hd)).astype(np.float32)
    out = np.empty_like(q)
    L.paged_attention(q, k_cache, v_cache, tables, starts, positions, window, 0.25, out)
    want = L.paged_attention_ref(q, k_cache, v_cache, tables, starts, positions, window, 0.25)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
