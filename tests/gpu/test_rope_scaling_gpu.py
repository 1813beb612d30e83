"""Every RoPE scaling on the CUDA backend against the NumPy backend with the same bf16 weights
(run on a GPU: pytest -m gpu tests/gpu/test_rope_scaling_gpu.py). Positions run past the original
context, and each scaled model must also differ from plain RoPE, so a table built without the
scaling fails."""
from dataclasses import replace

import numpy as np
import pytest

from metrale.models.config import ModelConfig
from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.numpy_backend import NumpyBackend
from metrale.settings import compose

pytestmark = pytest.mark.gpu

BS, N = 16, 200
BASE = ModelConfig("llama", vocab_size=4096, hidden_size=512, intermediate_size=1536, num_layers=2, num_heads=8,
                   num_kv_heads=4, head_dim=64, rope_theta=10000.0, max_position=512, name="rope-scaling")
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


def prefill_logits(backend, ids):
    blocks = np.arange(-(-len(ids) // BS), dtype=np.int32) + 1
    return backend.forward(build_batch([Segment(np.asarray(ids, np.int32), 0, blocks, "all")], BS))


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_scaled_rope_matches_numpy(kind):
    from metrale.runtime.cuda_backend import CudaBackend
    config = replace(BASE, extra={"rope_scaling": SCALINGS[kind]})
    cfg = compose([f"cache.block_size={BS}", "cache.num_blocks=64", "scheduler.max_model_len=512",
                   "scheduler.max_num_seqs=4", "scheduler.max_num_batched_tokens=256", "device=cuda"])
    cu = CudaBackend(config, None, cfg=cfg)
    weights = dict(cu.export_weights())
    cpu = NumpyBackend(config, iter(weights.items()), num_blocks=64, block_size=BS)
    plain = NumpyBackend(BASE, iter(weights.items()), num_blocks=64, block_size=BS)
    ids = np.random.default_rng(0).integers(0, BASE.vocab_size, N)
    a, b = prefill_logits(cu, ids), prefill_logits(cpu, ids)
    assert np.isfinite(a).all()
    assert rel_err(a, b) < 2e-2, rel_err(a, b)
    assert rel_err(prefill_logits(plain, ids), b) > 5 * rel_err(a, b)
