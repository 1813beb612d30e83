"""The loaders read RoPE settings from every layout and honor them:
- config.json of transformers 5 (a `rope_parameters` block) and of older versions (top-level
  `rope_theta` / `rope_scaling`) give the same config, for dense, DeepSeek and hybrid models;
- an unknown scaling type is refused at load with a one-line message naming it;
- GGUF: `<arch>.rope.scaling.*` and Llama-3.x's `rope_freqs.weight` give the same logits as the
  Hugging Face checkpoint with the matching rope_scaling (compared with the original checkpoint,
  not a GGUF round trip through transformers, which ignores rope_freqs)."""
import json
import math

import numpy as np
import pytest

from metrale.models.deepseek import tiny_deepseek_hf_config
from metrale.models.hybrid import hybrid_model_config
from metrale.models.checkpoint import deepseek_model_config, hf_model_config, load_gguf, load_hf_dir
from metrale.models.rope import model_rope
from test_gdn import qwen3_next_cfg
from test_loaders import CFG, hf_weights, logits, write_gguf, write_hf_dir

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
IDS = [3, 17, 42, 5, 9, 11, 60, 2, 33, 7, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 4, 8, 12]


def to_transformers5(cfg: dict) -> dict:
    """config.json as transformers 5 saves it: rope_theta and rope_scaling inside rope_parameters."""
    out = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling", "partial_rotary_factor")}
    scaling = dict(cfg.get("rope_scaling") or {})
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    out["rope_parameters"] = {"rope_type": kind, "rope_theta": cfg.get("rope_theta", 10000.0), **scaling}
    if "partial_rotary_factor" in cfg:
        out["rope_parameters"]["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    return out


def same_rope(a, b) -> None:
    assert a.rope_theta == b.rope_theta and a.rotary_dim == b.rotary_dim
    assert a.extra["rope_scaling"] == b.extra["rope_scaling"]
    ra, rb = model_rope(a), model_rope(b)
    assert np.array_equal(ra.inv_freq, rb.inv_freq) and ra.attention_factor == rb.attention_factor


# ---------------------------------------------------------------------------- config layouts

@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", **LLAMA3}, {"type": "linear", "factor": 2.0},
                                     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
                                     {"type": "dynamic", "factor": 2.0}])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_transformers5_layout_reads_like_the_legacy_one(model_type, scaling):
    legacy = {**CFG, "model_type": model_type, "rope_theta": 500000.0, "rope_scaling": scaling}
    a, b = hf_model_config(legacy), hf_model_config(to_transformers5(legacy))
    same_rope(a, b)
    assert b.rope_theta == 500000.0
    assert (b.extra["rope_scaling"] or {}).get("rope_type") == (None if scaling is None else
                                                                scaling.get("rope_type", scaling.get("type")))


def test_transformers5_layout_deepseek():
    legacy = tiny_deepseek_hf_config(rope_theta=20000.0)
    a, b = deepseek_model_config(legacy), deepseek_model_config(to_transformers5(legacy))
    same_rope(a, b)
    assert b.rope_theta == 20000.0 and b.extra["rope_scaling"]["rope_type"] == "yarn"
    assert model_rope(b).inv_freq.shape == (b.qk_rope_head_dim // 2,)


def test_transformers5_layout_hybrid():
    legacy = qwen3_next_cfg(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0})
    a, b = hybrid_model_config(legacy), hybrid_model_config(to_transformers5(legacy))
    same_rope(a, b)
    assert b.rotary_dim == 4 and b.extra["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


def test_default_type_in_rope_parameters_is_plain_rope():
    c = hf_model_config({**CFG, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert c.rope_theta == 1e6 and c.extra["rope_scaling"] is None


def test_per_layer_type_rope_parameters_are_refused():
    cfg = {**CFG, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    with pytest.raises(ValueError, match="per layer type"):
        hf_model_config(cfg)


# ----------------------------------------------------------------------- unknown types refused

@pytest.mark.parametrize("layout", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("reader", ["dense", "deepseek", "hybrid"])
def test_unknown_scaling_type_is_refused_at_load(reader, layout):
    base = {"dense": dict(CFG), "deepseek": tiny_deepseek_hf_config(), "hybrid": qwen3_next_cfg()}[reader]
    base["rope_scaling"] = {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}
    if layout == "rope_parameters":
        base = to_transformers5(base)
    read = {"dense": hf_model_config, "deepseek": deepseek_model_config, "hybrid": hybrid_model_config}[reader]
    with pytest.raises(ValueError) as err:
        read(base, "m")
    msg = str(err.value)
    assert "\n" not in msg and "'longrope' is not supported" in msg and msg.startswith("m: ")


def test_unknown_scaling_type_is_refused_by_load_hf_dir(tmp_path):
    write_hf_dir(tmp_path / "hf", hf_weights(np.random.default_rng(0)))
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**CFG, "rope_scaling": {"rope_type": "su", "factor": 2}}))
    with pytest.raises(ValueError, match="rope_scaling type 'su' is not supported"):
        load_hf_dir(tmp_path / "hf")


# -------------------------------------------------------------------------------------- GGUF

def llama_cpp_rope_freqs(head_dim: int, theta: float, s: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: llama3 scaling as per-frequency divisors."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high, old_len = s["factor"], s["low_freq_factor"], s["high_freq_factor"], \
        s["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


@pytest.fixture(scope="module")
def weights():
    return hf_weights(np.random.default_rng(0))


def hf_logits(tmp_path, weights, scaling):
    write_hf_dir(tmp_path / "hf", weights)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**CFG, "rope_scaling": scaling}))
    config, _, stream = load_hf_dir(tmp_path / "hf")
    return logits(config, stream(), IDS)


def gguf_logits(tmp_path, weights, extra):
    write_gguf(tmp_path / "m.gguf", weights, extra)
    config, _, stream = load_gguf(tmp_path / "m.gguf")
    return config, logits(config, stream(), IDS)


def test_gguf_rope_freqs_give_llama3_scaling(tmp_path, weights):
    want = hf_logits(tmp_path, weights, {"rope_type": "llama3", **LLAMA3})
    ff = llama_cpp_rope_freqs(8, 10000.0, LLAMA3)
    assert len(set(ff.tolist())) == 2           # the tiny head has a kept and a scaled band
    config, got = gguf_logits(tmp_path, weights, lambda w: w.add_tensor("rope_freqs.weight", ff))
    np.testing.assert_allclose(config.extra["rope_freq_factors"], ff)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    _, ignored = gguf_logits(tmp_path, weights, None)
    assert np.abs(ignored - want).max() > 1e-2   # without rope_freqs the positions rotate otherwise


def test_gguf_rope_freqs_of_the_wrong_length_are_refused(tmp_path, weights):
    write_gguf(tmp_path / "m.gguf", weights, lambda w: w.add_tensor("rope_freqs.weight", np.ones(3, np.float32)))
    with pytest.raises(ValueError, match="rope_freqs has 3 factors"):
        load_gguf(tmp_path / "m.gguf")


def test_gguf_linear_scaling(tmp_path, weights):
    import gguf
    want = hf_logits(tmp_path, weights, {"type": "linear", "factor": 4.0})

    def linear(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    config, got = gguf_logits(tmp_path, weights, linear)
    assert config.extra["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    _, plain = gguf_logits(tmp_path, weights, None)
    assert np.abs(plain - want).max() > 1e-2


def test_gguf_yarn_scaling(tmp_path, weights):
    import gguf
    want = hf_logits(tmp_path, weights, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                         "beta_fast": 16.0, "beta_slow": 2.0})

    def yarn(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(32)
        w.add_rope_scaling_yarn_beta_fast(16.0)
        w.add_rope_scaling_yarn_beta_slow(2.0)

    config, got = gguf_logits(tmp_path, weights, yarn)
    assert model_rope(config).attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


def test_gguf_unknown_scaling_type_is_refused(tmp_path, weights):
    import gguf

    def longrope(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        w.add_rope_scaling_factor(4.0)

    write_gguf(tmp_path / "m.gguf", weights, longrope)
    with pytest.raises(ValueError, match="rope_scaling type 'longrope' is not supported"):
        load_gguf(tmp_path / "m.gguf")


def test_gguf_factor_without_a_type_is_linear_as_in_llama_cpp():
    from metrale.models.checkpoint import gguf_rope_scaling
    assert gguf_rope_scaling({"llama.rope.scaling.factor": 4.0}, "llama") == {"rope_type": "linear", "factor": 4.0}
    assert gguf_rope_scaling({"llama.rope.scale_linear": 2.0}, "llama") == {"rope_type": "linear", "factor": 2.0}
    assert gguf_rope_scaling({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, "llama") is None
    assert gguf_rope_scaling({}, "llama") is None


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                      "beta_fast": 16.0, "beta_slow": 2.0}])
def test_gguf_export_writes_the_scaling_back(tmp_path, scaling):
    from dataclasses import replace
    from bench import gguf_export as ge
    from metrale.models.checkpoint import random_weights
    from test_gguf_export import TINY, export
    config = replace(TINY, extra={"rope_scaling": scaling})
    back, _, _ = load_gguf(export(tmp_path, config, list(random_weights(config, seed=3)), ge.F32))
    assert back.extra["rope_scaling"] == scaling


def test_gguf_export_refuses_what_it_cannot_write(tmp_path):
    from dataclasses import replace
    from bench import gguf_export as ge
    from test_gguf_export import TINY, export
    config = replace(TINY, extra={"rope_scaling": {"rope_type": "llama3", **LLAMA3}})
    with pytest.raises(ValueError, match="rope scaling 'llama3'"):
        export(tmp_path, config, [], ge.F32)


def test_shape_presets_may_carry_a_scaling():
    from metrale.models.checkpoint import random_model_config
    preset = {"architecture": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
              "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "rope_theta": 500000.0, "max_position": 128}
    assert random_model_config(preset, "p").extra["rope_scaling"] is None
    c = random_model_config({**preset, "rope_scaling": {"type": "linear", "factor": 2.0}}, "p")
    assert c.extra["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="p: rope_scaling type 'su'"):
        random_model_config({**preset, "rope_scaling": {"type": "su"}}, "p")
