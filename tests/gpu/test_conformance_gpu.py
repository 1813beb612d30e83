"""The conformance cases of issue 20 on the CUDA backend (run on a GPU: pytest -m gpu
tests/gpu/test_conformance_gpu.py), against the NumPy backend with the device's bf16 weights (the
NumPy backend itself is checked against transformers by tests/test_conformance.py):
- sliding window: prefill chunks and decode steps past the window equal the windowed NumPy forward
  (tensor-core and FP32 attention kernels);
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


def dense_cfg(max_model_len: int, *levers: str):
    return compose([f"cache.block_size={BS}", "cache.num_blocks=64", f"scheduler.max_model_len={max_model_len}",
                    "scheduler.max_num_seqs=4", "scheduler.max_num_batched_tokens=256", "device=cuda", *levers])


def rel_err(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check_past_the_window(config, levers=(), prompt=200, steps=6, chunk=120) -> None:
    """A prompt longer than the window in two prefill chunks (the second reads cached positions),
    then decode steps past it: every step's logits on CUDA beside the windowed NumPy twin's, fed the
    twin's greedy tokens; and the window matters (full attention gives other logits)."""
    from metrale.runtime.cuda_backend import CudaBackend
    cu = CudaBackend(config, None, cfg=dense_cfg(512, *levers))
    weights = dict(cu.export_weights())
    twin = NumpyBackend(config, iter(weights.items()), num_blocks=64, block_size=BS)
    full = NumpyBackend(replace(config, sliding_window=0), iter(weights.items()), num_blocks=64, block_size=BS)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, prompt).astype(np.int32)
    table = np.arange(1, 1 + -(-(prompt + steps) // BS), dtype=np.int32)
    errs, pos, apart = [], 0, []
    for end in [chunk, prompt] + list(range(prompt + 1, prompt + steps)):
        batch = lambda: build_batch([Segment(ids[pos:end], pos, table, "last")], BS)  # noqa: E731
        a, b, f = cu.forward(batch())[0], twin.forward(batch())[0], full.forward(batch())[0]
        assert np.isfinite(a).all()
        errs.append(rel_err(a, b))
        apart.append(rel_err(f, b))
        pos = end
        ids = np.append(ids, np.int32(b.argmax())) if end >= prompt else ids
    assert max(errs) < 3e-2, errs
    assert min(apart[1:]) > 5 * max(errs), (apart, errs)     # past the window the window matters


@pytest.mark.parametrize("kernels", ["mma", "fma"])
def test_past_the_window_cuda_matches_the_windowed_numpy_backend(kernels):
    check_past_the_window(MISTRAL, (f"levers.prefill_attention_kernel={kernels}",
                                    f"levers.decode_attention_kernel={kernels}"))


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
