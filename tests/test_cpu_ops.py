"""The fast CPU path end to end: the GGUF loader keeping weights quantized, CpuOps against NumpyOps
on the embedded SmolLM2 (Q4_1 + Q8_0), the lever that selects the path."""
import itertools

import numpy as np
import pytest

from metrale.models.quantized import QuantizedPart, QuantizedTensor


def write_tiny_gguf(path, rng, layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, vocab=96):
    """A tiny llama GGUF of Q4_K_M's mix: Q4_K q/k/gate/up/o, Q6_K v/down, Q8_0 embeddings, f32 norms
    (K-quants as random bytes with sane scales: gguf cannot quantize them)."""
    import gguf
    from test_cpu_quant import random_rows
    T = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.embedding_length", hidden)
    w.add_uint32("llama.feed_forward_length", ffn)
    w.add_uint32("llama.block_count", layers)
    w.add_uint32("llama.attention.head_count", heads)
    w.add_uint32("llama.attention.head_count_kv", kv_heads)
    w.add_uint32("llama.context_length", 256)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32("llama.vocab_size", vocab)
    hd = hidden // heads

    def add(name, kind, rows, cols):
        data = random_rows(kind, rows, cols, rng)
        w.add_tensor(name, data, raw_shape=(rows, data.shape[1]), raw_dtype=T[kind.upper()])

    add("token_embd.weight", "q8_0", vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        for n in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + n + ".weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        add(p + "attn_q.weight", "q4_k", heads * hd, hidden)
        add(p + "attn_k.weight", "q4_k", kv_heads * hd, hidden)
        add(p + "attn_v.weight", "q6_k", kv_heads * hd, hidden)
        add(p + "attn_output.weight", "q4_k", hidden, heads * hd)
        add(p + "ffn_gate.weight", "q4_k", ffn, hidden)
        add(p + "ffn_up.weight", "q4_k", ffn, hidden)
        add(p + "ffn_down.weight", "q6_k", hidden, ffn)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("cpu") / "tiny-q4_k_m.gguf", np.random.default_rng(7))


def test_load_gguf_keeps_block_matrices_quantized(tiny_gguf):
    from metrale.models.checkpoint import load_gguf
    config, _, quant = load_gguf(tiny_gguf, keep_quantized=True)
    _, _, dense = load_gguf(tiny_gguf)
    kinds = {"embed": ["Q8_0"], "qkv": ["Q4_K", "Q4_K", "Q6_K"], "gate_up": ["Q4_K", "Q4_K"], "o": ["Q4_K"],
             "down": ["Q6_K"]}
    names = []
    for (name, q), (name2, d) in zip(quant(), dense(), strict=True):
        assert name == name2
        names.append(name)
        short = name.rsplit(".", 1)[-1]
        if short in kinds:
            assert isinstance(q, QuantizedTensor), name
            assert [p.ggml_type.name for p in q.parts] == kinds[short], name
            np.testing.assert_array_equal(q.dequantize(), d)
        else:
            assert isinstance(q, np.ndarray) and q.dtype == np.float32, name
            np.testing.assert_array_equal(q, d)
    assert "lm_head" not in names and config.tie_word_embeddings


