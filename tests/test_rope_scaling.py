"""metrale/models/rope.py against two independent computations, for every scaling type:
(a) Hugging Face transformers' own ROPE_INIT_FUNCTIONS, stored by tools/make_rope_golden.py in
    tests/fixtures/rope_golden.json (transformers computes in float32, hence rtol 1e-6);
(b) the published formulas written out element by element here in float64 (Meta's llama3
    apply_scaling, the YaRN paper's ramp, the NTK base formula).
And: the NumPy backend's cos/sin and the CUDA backends' float32 tables are the same numbers."""
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from metrale.models.config import ModelConfig
from metrale.models.deepseek import deepseek_softmax_scale
from metrale.models.rope import SUPPORTED_ROPE_TYPES, build_rope, check_rope_scaling, model_rope

GOLDEN = json.loads((Path(__file__).parent / "fixtures" / "rope_golden.json").read_text())["cases"]


def dense_config(rotary_dim: int, theta: float, scaling: dict | None, max_position: int,
                 head_dim: int | None = None) -> ModelConfig:
    head_dim = head_dim or rotary_dim
    return ModelConfig(architecture="llama", vocab_size=16, hidden_size=32, intermediate_size=32, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=head_dim, rope_theta=theta, max_position=max_position,
                       rotary_dim=rotary_dim if rotary_dim < head_dim else 0, extra={"rope_scaling": scaling})


def mla_config(rope_dim: int, nope_dim: int, theta: float, scaling: dict | None, max_position: int) -> ModelConfig:
    return ModelConfig(architecture="deepseek_v3", vocab_size=16, hidden_size=32, intermediate_size=32, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=nope_dim + rope_dim, rope_theta=theta,
                       max_position=max_position, kv_lora_rank=16, qk_nope_head_dim=nope_dim,
                       qk_rope_head_dim=rope_dim, v_head_dim=16, extra={"rope_scaling": scaling})


def golden_config(case: dict) -> ModelConfig:
    scaling = check_rope_scaling(case["scaling"])
    if case["kind"] == "deepseek_v3":
        return mla_config(case["rotary_dim"], case["qk_nope_head_dim"], case["theta"], scaling, case["max_position"])
    head_dim = 256 if case["kind"] == "qwen3_next" else case["rotary_dim"]
    return dense_config(case["rotary_dim"], case["theta"], scaling, case["max_position"], head_dim)


# ------------------------------------------------------------------ (a) transformers' own numbers

def test_the_fixture_covers_every_supported_type():
    kinds = {c["scaling"].get("rope_type", c["scaling"].get("type")) for c in GOLDEN.values()}
    assert kinds == set(SUPPORTED_ROPE_TYPES)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_matches_transformers(name):
    case = GOLDEN[name]
    rope = model_rope(golden_config(case))
    want = np.asarray(case["inv_freq"])
    assert rope.rotary_dim == case["rotary_dim"] == 2 * want.shape[0]
    np.testing.assert_allclose(rope.inv_freq, want, rtol=1e-6, atol=0)
    assert rope.attention_factor == pytest.approx(case["attention_factor"], rel=1e-12)
    if "softmax_scale" in case:
        assert deepseek_softmax_scale(golden_config(case)) == pytest.approx(case["softmax_scale"], rel=1e-12)


# ------------------------------------------------------------------ (b) the published formulas

def plain(dim: int, theta: float) -> list[float]:
    return [theta ** (-2.0 * i / dim) for i in range(dim // 2)]


def test_default_is_the_engine_s_former_formula_bit_for_bit():
    for rot, theta in ((64, 100000.0), (128, 500000.0), (8, 10000.0)):
        old = 1.0 / (theta ** (np.arange(rot // 2, dtype=np.float64) * 2.0 / rot))
        assert np.array_equal(build_rope(rot, theta).inv_freq, old)


def test_linear_divides_every_frequency():
    np.testing.assert_allclose(build_rope(64, 10000.0, {"type": "linear", "factor": 4.0}).inv_freq,
                               np.array(plain(64, 10000.0)) / 4.0, rtol=1e-14)


def test_dynamic_uses_the_ntk_base_at_max_position_times_factor():
    dim, theta, factor, max_pos = 64, 10000.0, 2.0, 2048
    seq_len = max_pos * factor
    base = theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    np.testing.assert_allclose(build_rope(dim, theta, {"rope_type": "dynamic", "factor": factor}, max_pos).inv_freq,
                               plain(dim, base), rtol=1e-14)


def test_llama3_matches_meta_apply_scaling():
    factor, low, high, old_len, theta, dim = 8.0, 1.0, 4.0, 8192, 500000.0, 128
    want = []
    for f in plain(dim, theta):      # Meta's reference, element by element
        wavelen = 2 * math.pi / f
        if wavelen < old_len / high:
            want.append(f)
        elif wavelen > old_len / low:
            want.append(f / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            want.append((1 - smooth) * f / factor + smooth * f)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
               "original_max_position_embeddings": old_len}
    np.testing.assert_allclose(build_rope(dim, theta, scaling, 131072).inv_freq, want, rtol=1e-12)


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_matches_the_paper(truncate):
    dim, theta, factor, orig, beta_fast, beta_slow = 64, 10000.0, 16.0, 4096, 32.0, 1.0
    # dims whose wavelength turns beta times within the original context (YaRN eq. 17-18)
    def dim_of(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    want = []
    for i, f in enumerate(plain(dim, theta)):
        gamma = 1.0 - min(max((i - low) / (high - low), 0.0), 1.0)      # 1: keep, 0: interpolate
        want.append(f / factor * (1 - gamma) + f * gamma)
    scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig, "truncate": truncate}
    rope = build_rope(dim, theta, scaling, 65536)
    np.testing.assert_allclose(rope.inv_freq, want, rtol=1e-12)
    assert rope.attention_factor == pytest.approx(0.1 * math.log(factor) + 1.0, rel=1e-14)


def test_yarn_attention_factor_scales_cos_and_sin():
    rope = build_rope(16, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 128)
    pos = np.array([0, 5, 100])
    cos, sin = rope.cos_sin(pos)
    angles = pos[:, None] * rope.inv_freq[None, :]
    np.testing.assert_allclose(cos, np.cos(angles) * rope.attention_factor, rtol=1e-15)
    np.testing.assert_allclose(sin, np.sin(angles) * rope.attention_factor, rtol=1e-15)
    assert rope.attention_factor > 1.0


def test_yarn_without_factor_takes_the_context_ratio():
    a = build_rope(32, 10000.0, {"rope_type": "yarn", "original_max_position_embeddings": 1024}, 8192)
    b = build_rope(32, 10000.0, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024}, 8192)
    assert np.array_equal(a.inv_freq, b.inv_freq) and a.attention_factor == b.attention_factor


def test_legacy_type_key_and_rope_type_agree():
    s = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    a = build_rope(32, 10000.0, {"type": "llama3", **s}, 512)
    b = build_rope(32, 10000.0, {"rope_type": "llama3", **s}, 512)
    assert np.array_equal(a.inv_freq, b.inv_freq)


@pytest.mark.parametrize("kind", ["longrope", "su", "mrope"])
def test_an_unknown_type_names_itself_and_the_supported_ones(kind):
    with pytest.raises(ValueError, match=f"'{kind}' is not supported .*default, linear, dynamic, llama3, yarn"):
        build_rope(32, 10000.0, {"rope_type": kind, "factor": 2.0})


def test_freq_factors_divide_the_frequencies():
    ff = np.array([1.0, 2.0, 4.0, 8.0])
    np.testing.assert_allclose(build_rope(8, 10000.0, freq_factors=ff).inv_freq, np.array(plain(8, 10000.0)) / ff,
                               rtol=1e-14)
    with pytest.raises(ValueError, match="rope_freqs has 3 factors"):
        build_rope(8, 10000.0, freq_factors=ff[:3])


# ------------------------------------------------ one table for the NumPy and the CUDA backends

def numpy_backend_cos_sin(config: ModelConfig, positions: np.ndarray):
    from metrale.models.checkpoint import random_weights
    from metrale.runtime.batch import Segment, build_batch
    from metrale.runtime.numpy_backend import NumpyBackend
    be = NumpyBackend(config, random_weights(config, seed=0), num_blocks=4, block_size=16)
    segment = Segment(np.zeros(len(positions), np.int32), int(positions[0]), np.arange(4, dtype=np.int32))
    batch = build_batch([segment], 16)
    assert np.array_equal(batch.positions, positions)
    return be.rope_for(batch)


def cuda_tables(config: ModelConfig, max_len: int):
    from metrale.runtime.cuda_backend import CudaBackend
    return CudaBackend._rope_host_tables(SimpleNamespace(config=config, max_model_len=max_len))


@pytest.mark.parametrize("name", sorted(n for n, c in GOLDEN.items() if c["kind"] != "deepseek_v3"))
def test_numpy_backend_and_cuda_tables_agree(name):
    config = golden_config(GOLDEN[name])
    positions = np.arange(40, 56, dtype=np.int32)
    cos, sin = numpy_backend_cos_sin(config, positions)
    t_cos, t_sin = cuda_tables(config, 64)
    assert t_cos.dtype == np.float32 and t_cos.shape == (64, model_rope(config).rotary_dim // 2)
    assert np.array_equal(t_cos[positions], cos.astype(np.float32))
    assert np.array_equal(t_sin[positions], sin.astype(np.float32))


@pytest.mark.parametrize("name", sorted(n for n, c in GOLDEN.items() if c["kind"] == "deepseek_v3"))
def test_numpy_mla_and_cuda_tables_agree(name):
    from metrale.runtime.numpy_backend import NumpyBackend
    config = golden_config(GOLDEN[name])
    positions = np.array([0, 7, 63])
    cos, sin = NumpyBackend.rope_for(SimpleNamespace(rope=model_rope(config)), SimpleNamespace(positions=positions))
    t_cos, t_sin = cuda_tables(config, 64)
    assert np.array_equal(t_cos[positions], cos.astype(np.float32))
    assert np.array_equal(t_sin[positions], sin.astype(np.float32))
