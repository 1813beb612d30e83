"""The Qwen3-MoE family's CUDA part (metrale/runtime/cuda_moe.py: MoeCuda) without a GPU: its
weight layout names and shapes are the ones the loader streams from a checkpoint transformers
saved (tests/fixtures/conformance/qwen3_moe), the router is padded for the GEMM tiles and
unpadded on export, its buffers follow the batch, and what the kernels cannot run is refused.
Its op (MoeCudaOps.moe_residual) runs under the simulator in tests/kernels_sim/test_moe_ops_sim.py,
the whole model on the GPU in tests/gpu/test_moe_gpu.py."""
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kernels_numba.bf16 import bf16_round, from_bf16_bits
from metrale.models.assemble import _load_hf
from metrale.models.families import family_for
from metrale.runtime.cuda_moe import MoeCuda

FIXTURE = Path(__file__).parent / "fixtures" / "conformance" / "qwen3_moe"


@pytest.fixture(scope="module")
def checkpoint():
    config, _, stream = _load_hf(FIXTURE)
    return config, dict(stream())


def part_of(config, max_tokens: int = 16):
    b = SimpleNamespace(config=config, ep=None, max_tokens=max_tokens, max_rows=8, max_model_len=64, use_blas=False)
    return MoeCuda(b)


def test_the_family_names_this_part(checkpoint):
    config, _ = checkpoint
    assert family_for(config).cuda_part() is MoeCuda


def test_random_layout_is_the_checkpoints_layout(checkpoint):
    config, weights = checkpoint
    layout = part_of(config).random_layout(0)
    assert set(layout) == set(weights)
    for name, (shape, _) in layout.items():
        want = weights[name].shape
        if name.endswith(".router"):
            assert shape == (64, want[1]) and want[0] == config.n_routed_experts
        else:
            assert tuple(shape) == want, name


def test_prepare_pads_the_router_and_export_undoes_it(checkpoint):
    config, weights = checkpoint
    part = part_of(config)
    device = dict(part.prepare(weights.items()))
    router = device["layers.1.router"]
    assert router.shape == (64, config.hidden_size) and not router[config.n_routed_experts:].any()
    host = {n: (from_bf16_bits(a) if a.dtype == np.uint16 else a) for n, a in device.items()}
    back = dict(part.export(host.items()))
    assert set(back) == set(weights)
    for name, w in weights.items():
        np.testing.assert_array_equal(back[name], bf16_round(w) if w.ndim >= 2 else w)


def test_buffers_follow_the_batch_and_the_experts(checkpoint):
    config, _ = checkpoint
    plan = part_of(config, max_tokens=16).activation_plan()
    k = config.num_experts_per_tok
    assert plan["moe_topk_ids"][0] == (16, k) and plan["moe_router"][0] == (16, 64)
    assert plan["moe_h"][0] == (16 * k, 2 * config.moe_intermediate_size)
    assert plan["moe_counts"][0][1] == config.n_routed_experts
    assert "residual" in plan and "attn_scratch" in plan          # the dense attention's own


def test_dims_name_what_the_gemm_tiles_need(checkpoint):
    config, _ = checkpoint
    dims = dict(part_of(config).gemm_dims())
    assert dims["moe_intermediate_size"] == 32 and dims["intermediate_size"] == 96   # layer 0 is dense
    all_moe = replace(config, moe_layers=(True, True))
    assert "intermediate_size" not in dict(part_of(all_moe).gemm_dims())


def test_the_hybrid_moe_part_pads_the_shared_gate():
    """Qwen3-Next's MoE layers (tests/fixtures/conformance/qwen3_next_moe): the sigmoid-gated shared
    expert's [1, D] gate is padded to 64 rows like the router, its buffers planned, its layout the
    checkpoint's."""
    from metrale.runtime.cuda_moe import HybridMoeCuda
    config, _, stream = _load_hf(FIXTURE.parent / "qwen3_next_moe")
    weights = dict(stream())
    assert config.shared_expert_gate and family_for(config).cuda_part() is HybridMoeCuda
    b = SimpleNamespace(config=config, ep=None, max_tokens=16, max_rows=8, max_model_len=64, use_blas=False)
    part = HybridMoeCuda(b)
    layout = part.random_layout(0)
    assert set(layout) == set(weights)
    gate = next(n for n in weights if n.endswith(".shared_gate"))
    assert weights[gate].shape == (1, config.hidden_size) and layout[gate][0] == (64, config.hidden_size)
    device = dict(part.prepare(weights.items()))
    assert device[gate].shape == (64, config.hidden_size) and not device[gate][1:].any()
    host = {n: (from_bf16_bits(a) if a.dtype == np.uint16 else a) for n, a in device.items()}
    back = dict(part.export(host.items()))
    np.testing.assert_array_equal(back[gate], bf16_round(weights[gate]))
    plan = part.activation_plan()
    assert plan["moe_shared_gate"][0] == (16, 64) and plan["moe_shared_out"][0] == (16, config.hidden_size)
    assert "gdn_conv" in plan                                   # the hybrid part's own
