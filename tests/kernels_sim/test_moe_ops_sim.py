"""MoeCudaOps.moe_residual (metrale/runtime/cuda_moe.py: router GEMM on the padded router, moe.route,
moe.moe_experts, the shared experts) under the simulator, on a stand-in backend holding moe_plan's
buffers, against MoeNumpyOps.moe_residual (models/moe.py) with the same bf16 weights: Qwen3-MoE's
softmax top-k renormalized over 8 experts (a router of 8 rows padded to 64), and Qwen3-Next's
sigmoid-gated shared expert (DeepSeek's ungated one runs in sim_deepseek_ops.py). The rows lean
to experts 2, 5 and 7 (the last among them): 3 tiles of the grouped GEMMs' schedule run, with
several rows each, and 5 experts are empty (each 64-row tile costs seconds in the simulator)."""
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from kernels_numba.ptx import SIM

pytestmark = pytest.mark.skipif(not SIM, reason="run with NUMBA_ENABLE_CUDASIM=1")

from numba import cuda  # noqa: E402

from kernels_numba import gemm  # noqa: E402
from kernels_numba.bf16 import bf16_round, to_bf16_bits  # noqa: E402
from metrale.models.config import ModelConfig  # noqa: E402
from metrale.models.families import compose_ops  # noqa: E402
from metrale.models.moe import MoeNumpyOps, route_config  # noqa: E402
from metrale.runtime.cuda_backend import CudaBackend, CudaOps  # noqa: E402
from metrale.runtime.cuda_moe import PADDED, MoeCudaOps, moe_plan, moe_workspace, pad_router  # noqa: E402

T, D, FM, E = 5, 64, 64, 8
QWEN = ModelConfig("qwen3_moe", vocab_size=256, hidden_size=D, intermediate_size=128, num_layers=1, num_heads=2,
                   num_kv_heads=1, head_dim=32, max_position=64, qk_norm=True, n_routed_experts=E,
                   num_experts_per_tok=2, moe_intermediate_size=FM, moe_layers=(True,), norm_topk_prob=True)
GATED = replace(QWEN, n_shared_experts=1, shared_intermediate_size=FM, shared_expert_gate=True)   # Qwen3-Next


def _weights(config: ModelConfig, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    w = {"layers.0.router": rng.standard_normal((E, D)) * D ** -0.5 * 4,
         "layers.0.experts_gate_up": rng.standard_normal((E, 2 * FM, D)) * D ** -0.5,
         "layers.0.experts_down": rng.standard_normal((E, D, FM)) * FM ** -0.5}
    if config.n_shared_experts:
        w["layers.0.shared_gate_up"] = rng.standard_normal((2 * FM, D)) * D ** -0.5
        w["layers.0.shared_down"] = rng.standard_normal((D, FM)) * FM ** -0.5
    if config.shared_expert_gate:
        w["layers.0.shared_gate"] = rng.standard_normal((1, D)) * D ** -0.5 * 3
    return {k: bf16_round(v.astype(np.float32)) for k, v in w.items()}


class _Backend:
    """What MoeCudaOps reads of a CudaBackend: moe_plan's buffers, the part's routing and workspace."""
    view = CudaBackend.view
    _cached = CudaBackend._cached

    def __init__(self, config: ModelConfig):
        self.config, self.ep, self._views = config, None, {}
        self.act = {k: cuda.to_device(np.zeros(shape, dt)) for k, (shape, dt) in moe_plan(config, T, E).items()}
        self.part = SimpleNamespace(route_cfg=route_config(config), moe_ws=moe_workspace(self.act))
        self.skinny_max_t = gemm.FMA_MAX_T

    def blas_takes(self, rows, weight):
        return False


HOT = (2, 5, 7)


def _rows(rng, router):
    """T rows of h whose router logits are their own plus 4 (experts HOT) or -4 (the others)."""
    h = rng.standard_normal((T, D))
    lean = np.linalg.lstsq(router.astype(np.float64), np.where(np.isin(np.arange(E), HOT), 4.0, -4.0), rcond=None)[0]
    return (h + lean).astype(np.float32)


@pytest.mark.parametrize("config", [QWEN, GATED], ids=["qwen3_moe", "gated_shared"])
def test_moe_residual_matches_numpy(config):
    from kernels_numba.moe import route_ref
    w = _weights(config, seed=1 + config.n_shared_experts + config.shared_expert_gate)
    rng = np.random.default_rng(7)
    h = _rows(rng, w["layers.0.router"])
    ids, _ = route_ref(h @ w["layers.0.router"].T, route_config(config))
    assert set(ids.ravel().tolist()) == set(HOT) and np.bincount(ids.ravel()).max() >= 3
    residual = rng.standard_normal((T, D)).astype(np.float32)
    numpy_ops = MoeNumpyOps()
    numpy_ops.cfg, numpy_ops.b = config, SimpleNamespace(ep=None)
    want = numpy_ops.moe_residual(h, 0, w, "layers.0.", residual.copy())

    b = _Backend(config)
    ops = object.__new__(compose_ops(CudaOps, (MoeCudaOps,)))
    ops.b, ops.s, ops.cfg, ops.g = b, 0, config, SimpleNamespace(tokens=T)
    dev = {k: cuda.to_device(pad_router(v) if k.endswith(PADDED) else to_bf16_bits(v)) for k, v in w.items()}
    d_res = cuda.to_device(residual)
    out = ops.moe_residual(cuda.to_device(h), 0, dev, "layers.0.", d_res)
    got = out.copy_to_host()
    assert out is d_res                                      # accumulated into the residual stream
    moe_got, moe_want = got - residual, want - residual       # the MoE block's output
    rel = float(np.linalg.norm(moe_got - moe_want) / np.linalg.norm(moe_want))
    assert rel < 1e-2, rel                                   # the kernels round activations to bf16
    assert np.linalg.norm(moe_want) > 0.1 * np.linalg.norm(residual)
