"""MoE references: DeepSeek routing (softmax / sigmoid, group-limited top-k, correction bias,
normalisation, scaling), the stable permutation, grouped GEMMs and the weighted un-permutation."""
import numpy as np
import pytest

from kernels_numba import moe as M
from kernels_numba.bf16 import from_bf16_bits, to_bf16_bits
from metrale.models.deepseek import expert_mlp, local_experts


def test_route_v3_group_limited_by_hand():
    """8 experts in 4 groups of 2; the 2 best groups by top-2 sum of (sigmoid + bias) survive;
    weights are the sigmoid scores without bias, normalised, times the scaling factor."""
    cfg = M.RouteConfig(8, 2, "sigmoid", "noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                        routed_scaling_factor=2.0)
    logits = np.array([[4.0, -4.0, 0.1, 0.2, 1.0, 1.0, -3.0, 3.5]])
    bias = np.array([0, 0, 0, 0, 0, 0, 0, 0.0])
    ids, w = M.route_ref(logits, cfg, bias)
    # group sums: g0 .982+.018=1.0, g1 .525+.550=1.075, g2 .731*2=1.462, g3 .047+.971=1.018
    # -> groups 2 and 1 survive: experts 4, 5 (equal: lower index first), then 3
    assert ids.tolist() == [[4, 5]]
    np.testing.assert_allclose(w, [[1.0, 1.0]])
    ids, _ = M.route_ref(logits, cfg, np.array([0, 0, 0, 0, 0, 0.01, 0, 0.0]))
    assert ids.tolist() == [[5, 4]]              # the bias picks, the weights ignore it
    greedy = M.RouteConfig(8, 2, "sigmoid")
    assert M.route_ref(logits, greedy)[0].tolist() == [[0, 7]]


def test_route_softmax_v2_and_plain():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 16))
    ids, w = M.route_ref(logits, M.RouteConfig(16, 3, routed_scaling_factor=1.0))
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_array_equal(ids, np.argsort(-p, axis=-1)[:, :3])
    np.testing.assert_allclose(w, np.take_along_axis(p, ids, -1))
    cfg = M.RouteConfig(16, 3, "softmax", "group_limited_greedy", n_group=4, topk_group=1, routed_scaling_factor=16.0)
    ids, w = M.route_ref(logits, cfg)
    assert (ids // 4 == ids[:, :1] // 4).all()             # all from the single surviving group
    best_group = np.argmax(p.reshape(6, 4, 4).max(-1), axis=-1)
    np.testing.assert_array_equal(ids[:, 0] // 4, best_group)
    np.testing.assert_allclose(w, 16.0 * np.take_along_axis(p, ids, -1))
    with pytest.raises(ValueError, match="topk_method"):
        M.RouteConfig(16, 2, method="best")
    with pytest.raises(ValueError, match="exceeds"):
        M.RouteConfig(16, 5, "sigmoid", "noaux_tc", n_group=4, topk_group=1)


def test_permute_ref_is_a_stable_sort():
    ids = np.array([[2, 0], [1, 2], [2, 1], [0, 3]], np.int32)
    sorted_slot, slot_row, off = M.permute_ref(ids, 5)
    assert sorted_slot.tolist() == [1, 6, 2, 5, 0, 3, 4, 7]
    assert off.tolist() == [0, 2, 4, 7, 8, 8]
    np.testing.assert_array_equal(sorted_slot[slot_row], np.arange(8))


def test_moe_experts_ref_matches_a_direct_loop():
    rng = np.random.default_rng(1)
    t, d, f, e, k = 7, 16, 8, 5, 2
    x = rng.standard_normal((t, d))
    gu, dn = to_bf16_bits(rng.standard_normal((e, 2 * f, d))), to_bf16_bits(rng.standard_normal((e, d, f)))
    ids, w = M.route_ref(rng.standard_normal((t, e)), M.RouteConfig(e, k))
    want = np.zeros((t, d))
    g64, d64 = from_bf16_bits(gu).astype(np.float64), from_bf16_bits(dn).astype(np.float64)
    for i in range(t):
        for j in range(k):
            h = g64[ids[i, j]] @ x[i]
            want[i] += w[i, j] * (d64[ids[i, j]] @ (h[:f] / (1 + np.exp(-h[:f])) * h[f:]))
    np.testing.assert_allclose(M.moe_experts_ref(x, ids, w, gu, dn), want, rtol=1e-12)
    # the NumPy backend's expert path (float weights) agrees
    np.testing.assert_allclose(local_experts(x, ids, w, g64, d64), want, rtol=1e-12)
    rows = rng.standard_normal((4, d))
    np.testing.assert_allclose(expert_mlp(rows, np.array([3, 3, 0, 4]), g64, d64)[2],
                               d64[0] @ (lambda h: h[:f] / (1 + np.exp(-h[:f])) * h[f:])(g64[0] @ rows[2]))


def test_tile_schedule_bound():
    assert M.max_tiles(1, 256) == 2
    assert M.max_tiles(8 * 4096, 256) == 512 + 256
