"""Both weight formats and both RoPE pairings give the same model.

A tiny random Llama is written (a) as a Hugging Face directory (config.json, safetensors,
tokenizer.json) with half-split RoPE, and (b) as a GGUF file whose Q/K rows are permuted the way
llama.cpp's converter does for its adjacent-pair RoPE. Loading either must give the same logits.
"""
import json

import numpy as np
import pytest

from metrale import Engine, SamplingParams
from metrale.models.checkpoint import load_gguf, load_hf_dir
from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.numpy_backend import NumpyBackend

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
           tie_word_embeddings=False, model_type="llama", bos_token_id=1, eos_token_id=2)


def hf_weights(rng) -> dict[str, np.ndarray]:
    d, f, v, hd = 32, 64, 64, 8
    w = {"model.embed_tokens.weight": rng.standard_normal((v, d)), "model.norm.weight": 1 + 0.1 * rng.standard_normal(d),
         "lm_head.weight": rng.standard_normal((v, d)) / 6}
    for i in range(2):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(d)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(d)
        w[p + "self_attn.q_proj.weight"] = rng.standard_normal((4 * hd, d)) / 6
        w[p + "self_attn.k_proj.weight"] = rng.standard_normal((2 * hd, d)) / 6
        w[p + "self_attn.v_proj.weight"] = rng.standard_normal((2 * hd, d)) / 6
        w[p + "self_attn.o_proj.weight"] = rng.standard_normal((d, 4 * hd)) / 6
        w[p + "mlp.gate_proj.weight"] = rng.standard_normal((f, d)) / 6
        w[p + "mlp.up_proj.weight"] = rng.standard_normal((f, d)) / 6
        w[p + "mlp.down_proj.weight"] = rng.standard_normal((d, f)) / 8
    return {k: v.astype(np.float32) for k, v in w.items()}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: half-split rows -> adjacent pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_hf_dir(path, weights) -> None:
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CFG))
    save_file(weights, str(path / "model.safetensors"))
    vocab = {chr(97 + i % 26) + str(i // 26): i for i in range(64)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "c0", "bos_token": "b0"}))


def write_gguf(path, weights, extra=None) -> None:
    """extra(writer), when given, adds metadata or tensors before the file is written."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2); w.add_context_length(128); w.add_embedding_length(32)
    w.add_feed_forward_length(64); w.add_head_count(4); w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5); w.add_rope_freq_base(10000.0); w.add_vocab_size(64)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(64)]); w.add_token_types([1] * 64)
    w.add_token_merges([]); w.add_eos_token_id(2)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(2):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for hf_name, tensor in weights.items():
        if "q_proj" in hf_name:
            tensor = llama_cpp_permute(tensor, 4)
        elif "k_proj" in hf_name:
            tensor = llama_cpp_permute(tensor, 2)
        w.add_tensor(names[hf_name], np.ascontiguousarray(tensor))
    if extra is not None:
        extra(w)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def logits(config, stream, ids) -> np.ndarray:
    be = NumpyBackend(config, stream, num_blocks=16, block_size=8, dtype="float64")
    return be.forward(build_batch([Segment(np.asarray(ids, np.int32), 0, np.arange(4, dtype=np.int32), "all")], 8))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    weights = hf_weights(np.random.default_rng(0))
    write_hf_dir(base / "hf", weights)
    write_gguf(base / "tiny.gguf", weights)
    return base


def test_hf_and_gguf_give_the_same_logits(written):
    ids = [3, 17, 42, 5, 9, 11, 60, 2, 33, 7]
    hf_cfg, _, hf_stream = load_hf_dir(written / "hf")
    gg_cfg, _, gg_stream = load_gguf(written / "tiny.gguf")
    assert not hf_cfg.rope_interleaved and gg_cfg.rope_interleaved
    assert hf_cfg.num_kv_heads == gg_cfg.num_kv_heads == 2 and not gg_cfg.tie_word_embeddings
    a, b = logits(hf_cfg, hf_stream(), ids), logits(gg_cfg, gg_stream(), ids)
    np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)


def test_wrong_pairing_changes_the_logits(written):
    """The permutation matters: the GGUF weights with half-split RoPE give other logits."""
    from dataclasses import replace
    ids = [3, 17, 42, 5, 9, 11]
    hf_cfg, _, hf_stream = load_hf_dir(written / "hf")
    gg_cfg, _, gg_stream = load_gguf(written / "tiny.gguf")
    wrong = logits(replace(gg_cfg, rope_interleaved=False), gg_stream(), ids)
    assert np.abs(wrong - logits(hf_cfg, hf_stream(), ids)).max() > 1e-3


def test_engine_runs_an_hf_directory(written):
    eng = Engine(model=str(written / "hf"), device="cpu")
    out = eng.generate(["a0 b1 c2"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
