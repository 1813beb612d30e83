"""The Gemma 3 family's CUDA part (metrale/runtime/cuda_gemma.py: GemmaCuda) without a GPU: its
weight layout is the one the loader streams from a checkpoint transformers saved
(tests/fixtures/conformance/gemma3), the sliding layers get their own RoPE tables, and the attention
scale follows query_pre_attn_scalar. Its kernels run under the simulator in
tests/kernels_sim/test_gemma_ops_sim.py, the whole model on the GPU in tests/gpu/test_gemma_gpu.py."""
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from metrale.models.assemble import _load_hf
from metrale.models.families import family_for
from metrale.models.gemma import local_rope
from metrale.models.rope import model_rope
from metrale.runtime.cuda_gemma import GemmaCuda, GemmaCudaOps

FIXTURE = Path(__file__).parent / "fixtures" / "conformance" / "gemma3"


@pytest.fixture(scope="module")
def checkpoint():
    config, _, stream = _load_hf(FIXTURE)
    return config, dict(stream())


def part_of(config):
    b = SimpleNamespace(config=config, ep=None, max_tokens=16, max_rows=8, max_model_len=8, use_blas=False)
    return GemmaCuda(b)


def test_the_family_names_this_part(checkpoint):
    assert family_for(checkpoint[0]).cuda_part() is GemmaCuda


def test_random_layout_is_the_checkpoints_layout(checkpoint):
    config, weights = checkpoint
    layout = part_of(config).random_layout(0)
    assert set(layout) == set(weights)
    for name, (shape, _) in layout.items():
        assert tuple(shape) == weights[name].shape, name


def test_sliding_layers_get_their_own_rope_tables(checkpoint):
    config, _ = checkpoint
    assert any(config.sliding_layers) and not all(config.sliding_layers)
    part = part_of(config)
    plan = part.activation_plan()
    assert plan["cos_local"] == plan["cos"] and plan["sin_local"] == plan["sin"]
    local, full = local_rope(config).tables(8), model_rope(config).tables(8)
    assert not np.allclose(local[0], full[0])                 # 1e4 against 1e6: other angles
    act = {"cos": "C", "sin": "S", "cos_local": "CL", "sin_local": "SL"}
    ops = object.__new__(GemmaCudaOps)
    ops.cfg, ops.b = config, SimpleNamespace(act=act, cos="C", sin="S")
    got = [ops._rope(i) for i in range(config.num_layers)]
    assert got == [("CL", "SL") if s else ("C", "S") for s in config.sliding_layers]
    assert "cos_local" not in part_of(replace(config, local_rope_theta=0.0)).activation_plan()


def test_attention_scale_follows_query_pre_attn_scalar(checkpoint):
    from metrale.runtime.cuda_backend import CudaOps
    config, _ = checkpoint
    ops = object.__new__(CudaOps)
    ops.cfg = replace(config, query_pre_attn_scalar=100.0)
    assert ops._scale() == pytest.approx(0.1)
    ops.cfg = replace(config, query_pre_attn_scalar=0.0)
    assert ops._scale() == pytest.approx(1 / math.sqrt(config.head_dim))
