"""Qwen3-MoE (Llama / Qwen3 attention with q/k norms, a dense first layer, softmax top-2 of 8
experts renormalized) on the CUDA backend (runtime/cuda_moe.py) against the NumPy backend with the
device's bf16 weights (the NumPy MoE family itself is checked against transformers by
tests/test_conformance.py): random weights of a shape whose GEMM dims are multiples of 64, greedy
tokens of a mixed batch with decode graphs, prefill logits, graphs on = graphs off (run on a GPU:
pytest -m gpu tests/gpu/test_moe_gpu.py)."""
import numpy as np
import pytest

from metrale.models.config import ModelConfig
from metrale.runtime.numpy_backend import NumpyBackend
from metrale.settings import compose
from test_deepseek_gpu import BS, NEW, PROMPTS, assert_same_tokens, generate, last_logits

pytestmark = pytest.mark.gpu

QWEN3_MOE = ModelConfig("qwen3_moe", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=3,
                        num_heads=4, num_kv_heads=2, head_dim=64, max_position=256, qk_norm=True,
                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                        moe_layers=(False, True, True), norm_topk_prob=True, name="qwen3-moe-tiny")


def cfg(**levers):
    over = [f"cache.block_size={BS}", "cache.num_blocks=64", "scheduler.max_model_len=128",
            "scheduler.max_num_seqs=8", "scheduler.max_num_batched_tokens=128", "device=cuda"]
    return compose(over + [f"levers.{k}={str(v).lower()}" for k, v in levers.items()])


def cuda_and_twin(config):
    """A CUDA backend of random weights and the NumPy backend on exactly its (bf16) weights."""
    from metrale.runtime.cuda_backend import CudaBackend
    cu = CudaBackend(config, None, cfg=cfg())
    return cu, NumpyBackend(config, iter(dict(cu.export_weights()).items()), num_blocks=64, block_size=BS)


def check_greedy_tokens(cu, twin) -> None:
    got, want = generate(cu, PROMPTS, NEW, chunk=5), generate(twin, PROMPTS, NEW, chunk=5)
    assert len(cu.graphs) > 0, "decode steps did not replay CUDA graphs"
    assert_same_tokens(got, want, twin, PROMPTS)


def check_prefill_logits(cu, twin):
    a, b = last_logits(cu, PROMPTS[1]), last_logits(twin, PROMPTS[1])
    assert np.isfinite(a).all()
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2
    return a


def check_graphs_on_equals_off(cu, config) -> None:
    from metrale.runtime.cuda_backend import CudaBackend
    off = CudaBackend(config, iter(dict(cu.export_weights()).items()), cfg=cfg(cuda_graphs=False))
    a, b = generate(cu, PROMPTS, NEW, chunk=5), generate(off, PROMPTS, NEW, chunk=5)
    assert len(off.graphs) == 0 and a == b


@pytest.fixture(scope="module")
def pair():
    return cuda_and_twin(QWEN3_MOE)


def test_greedy_tokens_match_numpy_mixed_batch(pair):
    check_greedy_tokens(*pair)


def test_prefill_logits_match_numpy(pair):
    check_prefill_logits(*pair)


def test_graphs_on_equals_graphs_off(pair):
    check_graphs_on_equals_off(pair[0], QWEN3_MOE)


# ---- Qwen3-Next with MoE layers (HybridMoeCuda): Gated DeltaNet + gated attention, the sigmoid-gated shared expert

def hybrid_moe_config():
    from test_hybrid_gpu import CONFIG
    from metrale.models.hybrid import hybrid_model_config
    return hybrid_model_config({**CONFIG, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                "shared_expert_intermediate_size": 128, "mlp_only_layers": [0], "norm_topk_prob": True})


def test_hybrid_moe_logits_match_numpy_through_the_states():
    """A prompt, then greedy decode steps through the GDN states and the KV cache: every step's logits
    on CUDA beside the NumPy twin's, fed the same tokens."""
    from metrale.runtime.batch import Segment, build_batch
    from metrale.runtime.cuda_backend import CudaBackend
    config = hybrid_moe_config()
    assert config.shared_expert_gate and config.is_moe_layer(1) and not config.is_moe_layer(0)
    cu = CudaBackend(config, None, cfg=cfg(cuda_graphs=False))
    twin = NumpyBackend(config, iter(dict(cu.export_weights()).items()), num_blocks=64, block_size=BS,
                        num_state_slots=2, num_state_checkpoints=0)
    ids = np.array(PROMPTS[1], np.int32)
    table = np.arange(1, 1 + -(-(len(ids) + 8) // BS), dtype=np.int32)
    pos, errs = 0, []
    for _ in range(8):
        batch = lambda: build_batch([Segment(ids[pos:], pos, table, "last", state_slot=1)], BS)  # noqa: E731
        a, b = cu.forward(batch())[0], twin.forward(batch())[0]
        assert np.isfinite(a).all()
        errs.append(float(np.linalg.norm(a - b) / np.linalg.norm(b)))
        pos, ids = len(ids), np.append(ids, np.int32(b.argmax()))
    assert max(errs) < 3e-2, errs
