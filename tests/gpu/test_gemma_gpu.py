"""Gemma 3 on the CUDA backend (runtime/cuda_gemma.py) against the NumPy backend with the device's
bf16 weights (the NumPy Gemma 3 forward itself is checked against transformers by
tests/test_conformance.py): random weights of a shape with 270M's 256-dim heads and one kv head,
sliding and full layers with their own RoPE bases, query_pre_attn_scalar apart from head_dim, the
embedding scale, tied embeddings and logit softcapping; greedy tokens of a mixed batch with decode
graphs, prefill logits, graphs on = graphs off, prefill chunks and decode steps past the window (run on a GPU: pytest -m gpu tests/gpu/test_gemma_gpu.py)."""
import math

import numpy as np
import pytest

from metrale.models.config import ModelConfig
from test_deepseek_gpu import BS
from test_moe_gpu import check_graphs_on_equals_off, check_greedy_tokens, check_prefill_logits, cuda_and_twin

pytestmark = pytest.mark.gpu

GEMMA3 = ModelConfig("gemma3", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=3, num_heads=2,
                     num_kv_heads=1, head_dim=256, max_position=512, rope_theta=1e6, qk_norm=True,
                     tie_word_embeddings=True, name="gemma3-tiny", sliding_window=128,
                     sliding_layers=(True, True, False), local_rope_theta=1e4, query_pre_attn_scalar=128.0,
                     final_logit_softcapping=30.0, embed_scale=math.sqrt(256), hidden_act="gelu_tanh",
                     extra={"rope_scaling": None, "local_rope_scaling": None})


@pytest.fixture(scope="module")
def pair():
    return cuda_and_twin(GEMMA3)


def test_greedy_tokens_match_numpy_mixed_batch(pair):
    check_greedy_tokens(*pair)


def test_prefill_logits_match_numpy(pair):
    assert np.abs(check_prefill_logits(*pair)).max() < 30.0          # softcapped


def test_graphs_on_equals_graphs_off(pair):
    check_graphs_on_equals_off(pair[0], GEMMA3)


def test_past_the_window_matches_numpy():
    """Sliding layers (window 128) and a full one, through a 200-token prompt and decode steps."""
    from test_conformance_gpu import check_past_the_window
    check_past_the_window(GEMMA3)
