"""The conformance cases of issue 20 on the CUDA backend (run on a GPU: pytest -m gpu
tests/gpu/test_conformance_gpu.py), against the NumPy backend with the device's bf16 weights (the
NumPy backend itself is checked against transformers by tests/test_conformance.py):
- sliding window: refused past the window (no windowed kernels), exact inside it;
- DeepSeek-V3 without scoring_func / topk_method routes with sigmoid + noaux_tc on the device too."""
from dataclasses import replace

import numpy as np
import pytest

from metrale.models import deepseek as DS
from metrale.models.config import ModelConfig
from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.numpy_backend import NumpyBackend
from metrale.settings import compose
from test_deepseek_gpu import cuda_backend, last_logits, numpy_twin

pytestmark = pytest.mark.gpu

BS, WINDOW = 16, 64
MISTRAL = ModelConfig("mistral", vocab_size=4096, hidden_size=512, intermediate_size=1536, num_layers=2, num_heads=8,
                      num_kv_heads=4, head_dim=64, max_position=512, name="mistral-window", sliding_window=WINDOW)


def dense_cfg(max_model_len: int):
    return compose([f"cache.block_size={BS}", "cache.num_blocks=64", f"scheduler.max_model_len={max_model_len}",
                    "scheduler.max_num_seqs=4", "scheduler.max_num_batched_tokens=256", "device=cuda"])


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_window_smaller_than_the_context_is_refused():
    from metrale.runtime.cuda_backend import CudaBackend
    with pytest.raises(ValueError, match="sliding_window=64"):
        CudaBackend(MISTRAL, None, cfg=dense_cfg(512))


def test_inside_the_window_cuda_matches_the_windowed_numpy_backend():
    from metrale.runtime.cuda_backend import CudaBackend
    cu = CudaBackend(MISTRAL, None, cfg=dense_cfg(WINDOW))
    weights = dict(cu.export_weights())
    cpu = NumpyBackend(MISTRAL, iter(weights.items()), num_blocks=64, block_size=BS)
    ids = np.random.default_rng(0).integers(0, MISTRAL.vocab_size, WINDOW)
    table = np.arange(1, 1 + WINDOW // BS, dtype=np.int32)
    batch = lambda: build_batch([Segment(ids.astype(np.int32), 0, table, "all")], BS)  # noqa: E731
    a, b = cu.forward(batch()), cpu.forward(batch())
    assert np.isfinite(a).all() and rel_err(a, b) < 2e-2, rel_err(a, b)
    # a window as long as the context drops nothing: the windowed NumPy forward is the full one
    full = NumpyBackend(replace(MISTRAL, sliding_window=0), iter(weights.items()), num_blocks=64, block_size=BS)
    assert rel_err(full.forward(batch()), b) < 1e-5


@pytest.fixture(scope="module")
def v3_defaults(tmp_path_factory):
    cfg = {k: v for k, v in DS.tiny_cuda_deepseek_hf_config().items() if k not in ("scoring_func", "topk_method")}
    return DS.write_random_checkpoint(tmp_path_factory.mktemp("dsv3defaults"), cfg, seed=7)


def test_deepseek_v3_default_routing_on_cuda(v3_defaults):
    be, twin = cuda_backend(v3_defaults), numpy_twin(v3_defaults)
    assert (be.config.scoring_func, be.config.topk_method) == ("sigmoid", "noaux_tc")
    ids = list(range(20, 57))
    a, b = last_logits(be, ids), last_logits(twin, ids)
    assert np.isfinite(a).all() and rel_err(a, b) < 2e-2


# ---- the conformance checkpoints' tiny dims: refused on CUDA at load, naming the dim

CONFORMANCE = __import__("pathlib").Path(__file__).parents[1] / "fixtures" / "conformance"


@pytest.mark.parametrize("case, dim", [("qwen3_moe", "intermediate_size"), ("gemma3", "intermediate_size"),
                                       ("qwen3_next_moe", "linear_proj_size")])
def test_dims_off_the_gemm_tiles_are_refused_on_cuda(case, dim):
    from metrale.models.assemble import _load_hf, make_backend
    config, _, stream = _load_hf(CONFORMANCE / case)
    with pytest.raises(ValueError, match=f"needs {dim}.* to be a multiple of 64"):
        make_backend("cuda", dense_cfg(8), config, stream)
