"""What the loaders must read or refuse so that no checkpoint gives silently wrong answers:
- sliding windows as transformers applies them (Mistral, Qwen2/Qwen3 use_sliding_window, GGUF);
- the CUDA backend takes a context past the window (its kernels attend inside it);
- DeepSeek routing keys absent from a config take transformers' defaults;
- a tokenizer with more ids than the model's vocabulary is refused at load.
The logits side of each is tests/test_conformance.py."""
import json

import numpy as np
import pytest

from metrale import Engine
from metrale.models.config import ModelConfig
from metrale.models.deepseek import tiny_deepseek_hf_config
from metrale.models.checkpoint import deepseek_model_config, hf_model_config, load_gguf
from test_loaders import CFG, hf_weights, write_gguf, write_hf_dir


def windows(c: ModelConfig) -> list[int]:
    return [c.layer_window(i) for i in range(c.num_layers)]


# ---------------------------------------------------------------------------- sliding window

def test_mask_is_transformers_sliding_window_overlay():
    from metrale.runtime.numpy_backend import attention_mask
    m = attention_mask(np.array([0, 5, 9]), 10, window=4)
    visible = [list(np.flatnonzero(~row)) for row in m]
    assert visible == [[0], [2, 3, 4, 5], [6, 7, 8, 9]]
    assert not attention_mask(np.array([9]), 10)[0].any()


@pytest.mark.parametrize("extra, want", [
    ({}, [4096, 4096]),                       # MistralConfig's default when the key is absent
    ({"sliding_window": None}, [0, 0]),       # Mistral v0.2+: null = full attention
    ({"sliding_window": 16}, [16, 16]),
])
def test_mistral_window(extra, want):
    assert windows(hf_model_config({**CFG, "model_type": "mistral", **extra})) == want


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.parametrize("extra, want", [
    ({"sliding_window": 16}, [0, 0]),                                          # use_sliding_window off
    ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, [0, 16]),
    ({"use_sliding_window": True, "sliding_window": 16}, [0, 0]),               # max_window_layers 28
    ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0,
      "layer_types": ["sliding_attention", "full_attention"]}, [16, 0]),         # layer_types win
])
def test_qwen_window(model_type, extra, want):
    assert windows(hf_model_config({**CFG, "model_type": model_type, **extra})) == want


def test_llama_has_no_window():
    assert windows(hf_model_config({**CFG, "sliding_window": 16})) == [0, 0]


def test_gguf_sliding_window_key(tmp_path):
    weights = hf_weights(np.random.default_rng(0))
    write_gguf(tmp_path / "w.gguf", weights, extra=lambda w: w.add_sliding_window(8))
    write_gguf(tmp_path / "full.gguf", weights)
    assert windows(load_gguf(tmp_path / "w.gguf")[0]) == [8, 8]
    assert windows(load_gguf(tmp_path / "full.gguf")[0]) == [0, 0]


def test_cuda_takes_a_context_past_the_window_and_refuses_before_loading_weights(tmp_path):
    """The CUDA kernels attend inside the window (tests/kernels_sim/test_window_attention_sim.py):
    a context past it is not refused; make_backend refuses this tiny shape's dims before any CUDA
    import (so this runs on CPU)."""
    from metrale.models.assemble import make_backend
    from metrale.settings import compose
    c = hf_model_config({**CFG, "model_type": "mistral", "sliding_window": 32})
    with pytest.raises(ValueError, match="hidden_size to be a multiple of 64"):
        make_backend("cuda", compose(["device=cpu", "scheduler.max_model_len=128"]), c, None)


# ---------------------------------------------------------------------------- DeepSeek routing

def without(cfg: dict, *keys: str) -> dict:
    return {k: v for k, v in cfg.items() if k not in keys}


def test_deepseek_v3_routing_defaults_are_transformers():
    c = deepseek_model_config(without(tiny_deepseek_hf_config(), "scoring_func", "topk_method"))
    assert (c.scoring_func, c.topk_method) == ("sigmoid", "noaux_tc")
    bare = deepseek_model_config(without(tiny_deepseek_hf_config(), "scoring_func", "topk_method", "n_group",
                                         "topk_group", "norm_topk_prob", "routed_scaling_factor",
                                         "first_k_dense_replace", "n_shared_experts"))
    assert (bare.n_group, bare.topk_group, bare.norm_topk_prob, bare.routed_scaling_factor) == (8, 4, True, 2.5)
    assert (bare.first_k_dense_replace, bare.n_shared_experts) == (3, 1)


def test_deepseek_v2_routing_defaults_are_transformers():
    c = deepseek_model_config(without(tiny_deepseek_hf_config(model_type="deepseek_v2"), "scoring_func",
                                      "topk_method", "norm_topk_prob", "routed_scaling_factor"))
    assert (c.scoring_func, c.topk_method, c.norm_topk_prob, c.routed_scaling_factor) == \
        ("softmax", "greedy", False, 1.0)


def test_explicit_deepseek_routing_keys_are_kept():
    c = deepseek_model_config(tiny_deepseek_hf_config(scoring_func="softmax", topk_method="greedy"))
    assert (c.scoring_func, c.topk_method) == ("softmax", "greedy")


# ---------------------------------------------------------------------------- tokenizer vs vocabulary

def test_tokenizer_with_more_ids_than_the_vocabulary_is_refused(tmp_path):
    from tokenizers import Tokenizer
    write_hf_dir(tmp_path / "m", hf_weights(np.random.default_rng(0)))
    tok = Tokenizer.from_file(str(tmp_path / "m" / "tokenizer.json"))
    tok.add_special_tokens(["<extra_0>", "<extra_1>"])          # ids 64, 65 of a 64-row model
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    with pytest.raises(ValueError, match="tokenizer has 66 ids.*vocabulary has 64"):
        Engine(model=str(tmp_path / "m"), device="cpu")


def test_tokenizer_that_fits_loads_and_prompt_ids_past_the_vocabulary_are_refused(tmp_path):
    """As many ids as rows loads (fewer, a padded vocabulary, too); a prompt id >= vocab_size is
    refused per request."""
    from metrale.sampling.params import InvalidRequestError
    write_hf_dir(tmp_path / "m", hf_weights(np.random.default_rng(0)))
    assert json.loads((tmp_path / "m" / "config.json").read_text())["vocab_size"] == 64
    eng = Engine(model=str(tmp_path / "m"), device="cpu")
    assert eng.tokenizer.vocab_size == 64
    with pytest.raises(InvalidRequestError, match="token ids must lie in"):
        eng.add_request(np.array([3, 64], np.int32))
