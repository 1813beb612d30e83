"""MoE kernels under the simulator: routing (V3 sigmoid + bias + group-limited, V2 softmax
group-limited, plain), the counting-sort permutation (several slot blocks) with its GEMM tile
schedule, and the whole routed layer (gathered grouped mma GEMMs, silu*mul, weighted
un-permutation into the residual) against the float64 references."""
import numpy as np
import pytest

from kernels_numba import moe as M
from kernels_numba.bf16 import to_bf16_bits


@pytest.mark.parametrize("cfg,bias", [
    (M.RouteConfig(16, 4, "sigmoid", "noaux_tc", 4, 2, True, 2.5), True),
    (M.RouteConfig(12, 3, "softmax", "group_limited_greedy", 3, 2, False, 16.0), False),
    (M.RouteConfig(10, 2), False)])
def test_route(cfg, bias):
    rng = np.random.default_rng(cfg.num_experts)
    t = 37
    logits = rng.standard_normal((t, cfg.num_experts)).astype(np.float32)
    b = (0.1 * rng.standard_normal(cfg.num_experts)).astype(np.float32) if bias else None
    ids = np.full((t, cfg.top_k), -9, np.int32)
    w = np.zeros((t, cfg.top_k), np.float32)
    M.route(logits, cfg, ids, w, b)
    want_ids, want_w = M.route_ref(logits, cfg, b)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=1e-5)


def test_permute_and_schedule():
    rng = np.random.default_rng(1)
    t, k, e = 45, 2, 8                                   # 90 slots: 3 blocks of 32 in the simulator
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
    ids[ids == 5] = 4                                    # expert 5 empty, expert 4 crowded
    ids[:, 1] = np.where(ids[:, 0] == ids[:, 1], 6 - (ids[:, 0] == 6), ids[:, 1])
    ws = M.moe_workspace(t, k, e, 64, 64)
    tiles = M.permute(ids, e, ws)
    sorted_slot, slot_row, off = M.permute_ref(ids, e)
    np.testing.assert_array_equal(ws.sorted_slot, sorted_slot)
    np.testing.assert_array_equal(ws.slot_row, slot_row)
    np.testing.assert_array_equal(ws.offsets, off)
    sched = [(x, r) for x in range(e) for r in range(off[x], off[x + 1], M.GEMM_BM)]
    assert tiles == M.max_tiles(t * k, e)
    assert list(zip(ws.tile_expert[:len(sched)], ws.tile_row[:len(sched)])) == sched
    assert (ws.tile_expert[len(sched):tiles] == -1).all()


def test_moe_layer():
    """Two experts, 5 tokens x top-2: the real tiled mma GEMMs (gather of token rows for
    gate_up), silu*mul, down, weighted un-permutation added into a residual."""
    rng = np.random.default_rng(2)
    t, k, e, d, f = 5, 2, 2, 64, 64
    x = rng.standard_normal((t, d)).astype(np.float32)
    gu = to_bf16_bits(rng.standard_normal((e, 2 * f, d)) / 8)
    dn = to_bf16_bits(rng.standard_normal((e, d, f)) / 8)
    ids = np.tile(np.array([[1, 0]], np.int32), (t, 1))
    ids[2] = [0, 1]
    w = rng.uniform(0.2, 1.0, (t, k)).astype(np.float32)
    residual = rng.standard_normal((t, d)).astype(np.float32)
    out = residual.copy()
    M.moe_experts(x, ids, w, gu, dn, out, M.moe_workspace(t, k, e, d, f))
    want = residual + M.moe_experts_ref(x, ids, w, gu, dn)
    assert np.linalg.norm(out - want) / np.linalg.norm(want - residual) < 1e-2   # x, h rounded to bf16
