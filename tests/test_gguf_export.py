"""bench/gguf_export.py writes GGUFs that load back to the same model, and bench/llamacpp.py turns
llama.cpp's output into records.

A tiny model goes through export -> our loader and must give the same logits; an HF-layout model
(half-split RoPE) comes back in llama.cpp's permuted layout with the same logits; the random BF16
writer makes a loadable model with a padded tokenizer; the SmolLM2 BF16 export decodes the same
greedy tokens as its Q4_1 original. The llama.cpp output samples below were printed by the CPU
build of llama.cpp (llama-cpp-python 0.3.36's vendored copy) on this machine.
"""
from dataclasses import replace

import gguf
import numpy as np
import pytest

from conftest import scratch_blocks

from bench import gguf_export as ge
from bench import llamacpp as lc
from metrale.models.config import ModelConfig
from metrale.models.checkpoint import load_gguf, load_hf_dir, random_weights
from metrale.models.tokenizer import Tokenizer, bytes_to_unicode, read_gguf_fields
from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.numpy_backend import NumpyBackend

TINY = ModelConfig("llama", vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, rope_interleaved=True, tie_word_embeddings=False, eos_token_ids=(257,),
                   name="tiny")
IDS = [3, 17, 42, 5, 9, 11, 60, 2, 33, 7]


def llama_header(w, *, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, vocab: int, context: int) -> None:
    """A tiny llama GGUF's hyperparameters and byte tokenizer, written to GGUFWriter w."""
    for key, value in (("embedding_length", hidden), ("feed_forward_length", ffn), ("block_count", layers),
                       ("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
                       ("context_length", context), ("vocab_size", vocab)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, (value, vtype, sub) in byte_tokenizer(258).items():
        if not (isinstance(value, list) and not value):
            w.add_key_value(key, value, vtype, sub)


def byte_tokenizer(n: int = 258) -> dict:
    """A minimal GPT-2 style tokenizer: byte tokens, one merge (when n >= 258) and an end-of-text
    control token, n tokens in all."""
    T = gguf.GGUFValueType  # noqa: N806
    merges = ["Ġ t"] if n >= 258 else []
    tokens = [bytes_to_unicode()[b] for b in range(n - 1 - len(merges))] + [m.replace(" ", "") for m in merges]
    tokens.append("<|endoftext|>")
    return {"tokenizer.ggml.model": ("gpt2", T.STRING, None),
            "tokenizer.ggml.pre": ("default", T.STRING, None),
            "tokenizer.ggml.tokens": (tokens, T.ARRAY, T.STRING),
            "tokenizer.ggml.token_type": ([1] * (n - 1) + [3], T.ARRAY, T.INT32),
            "tokenizer.ggml.merges": (merges, T.ARRAY, T.STRING),
            "tokenizer.ggml.eos_token_id": (n - 1, T.UINT32, None)}


def logits(config, stream, ids=IDS) -> np.ndarray:
    be = NumpyBackend(config, stream, num_blocks=16, block_size=8, dtype="float64")
    return be.forward(build_batch([Segment(np.asarray(ids, np.int32), 0, np.arange(4, dtype=np.int32), "all")], 8))


def export(tmp_path, config, weights, dtype, name="m.gguf"):
    path = tmp_path / name
    stream = (t for n, a in weights for t in ge.to_gguf_tensors(n, a, config))
    ge.write_gguf(path, config, stream, ge.pad_vocab(byte_tokenizer(), config.vocab_size), dtype)
    return path


@pytest.mark.parametrize("dtype", [ge.F32, ge.BF16])
def test_tiny_model_round_trips(tmp_path, dtype):
    weights = list(random_weights(TINY, seed=3))
    if dtype == ge.BF16:   # values bf16 holds exactly, so the round trip is exact
        weights = [(n, a if a.ndim == 1 else (ge.bf16_bits(a).astype(np.uint32) << 16).view(np.float32))
                   for n, a in weights]
    path = export(tmp_path, TINY, weights, dtype)
    config, fields, stream = load_gguf(path)
    assert (config.vocab_size, config.num_kv_heads, config.head_dim, config.tie_word_embeddings) == (300, 2, 8, False)
    assert config.rope_interleaved
    back = dict(stream())
    for name, a in weights:
        np.testing.assert_array_equal(back[name], a, err_msg=name)
    # the config comes back too, eps as the float32 GGUF stores it
    assert replace(config, name="") == replace(TINY, name="", rms_norm_eps=config.rms_norm_eps)
    assert config.rms_norm_eps == pytest.approx(TINY.rms_norm_eps, rel=1e-7)
    np.testing.assert_array_equal(logits(config, iter(weights)), logits(config, iter(back.items())))
    np.testing.assert_allclose(logits(TINY, iter(weights)), logits(config, iter(back.items())), rtol=1e-8, atol=1e-9)
    assert len(fields["tokenizer.ggml.tokens"]) == 300


def test_hf_layout_is_permuted_for_llama_cpp(tmp_path):
    """A half-split (HF) model is written with Q/K permuted; loaded back it is interleaved and
    computes the same logits."""
    from test_loaders import CFG, hf_weights, write_hf_dir
    write_hf_dir(tmp_path / "hf", hf_weights(np.random.default_rng(0)))
    hf_cfg, _, hf_stream = load_hf_dir(tmp_path / "hf")
    assert not hf_cfg.rope_interleaved
    info = ge.export_model(str(tmp_path / "hf"), tmp_path / "hf.gguf", ge.F32, fields=byte_tokenizer(CFG["vocab_size"]))
    assert info["vocab_size"] == CFG["vocab_size"]
    gg_cfg, _, gg_stream = load_gguf(tmp_path / "hf.gguf")
    assert gg_cfg.rope_interleaved
    np.testing.assert_allclose(logits(hf_cfg, hf_stream()), logits(gg_cfg, gg_stream()), rtol=1e-9, atol=1e-9)


def test_random_bf16_gguf_loads_with_padded_tokenizer(tmp_path):
    tiny = replace(TINY, vocab_size=1000, tie_word_embeddings=True)
    info = ge.write_random_gguf(tmp_path / "r.gguf", tiny, byte_tokenizer(), seed=1)
    assert info["vocab_size"] == 1000
    config, fields, stream = load_gguf(tmp_path / "r.gguf")
    assert config.vocab_size == 1000 and config.tie_word_embeddings
    w = dict(stream())
    assert w["layers.0.qkv"].shape == (tiny.q_size + 2 * tiny.kv_size, 32) and "lm_head" not in w
    std = w["layers.1.gate_up"].std()
    assert 0.7 / np.sqrt(32) < std < 1.3 / np.sqrt(32)
    assert np.isfinite(logits(config, iter(w.items()))).all()
    tok = Tokenizer.from_gguf(fields)
    assert fields["tokenizer.ggml.tokens"][-1] == "[PAD999]" and fields["tokenizer.ggml.token_type"][-1] == 5
    assert tok.decode(tok.encode("hi there")) == "hi there"


def test_writer_rejects_a_short_tokenizer_and_a_short_stream(tmp_path):
    with pytest.raises(ValueError, match="pad_vocab"):
        ge.write_gguf(tmp_path / "a.gguf", TINY, iter(()), byte_tokenizer())
    with pytest.raises(ValueError, match="ended early"):
        ge.write_gguf(tmp_path / "b.gguf", TINY, iter(()), ge.pad_vocab(byte_tokenizer(), 300))


def test_tokenizer_fields_survive_a_json_round_trip(tmp_path):
    f = ge.pad_vocab(byte_tokenizer(), 260)
    ge.save_fields(f, tmp_path / "t.json.gz")
    back = ge.load_fields(tmp_path / "t.json.gz")
    assert back["tokenizer.ggml.tokens"][0] == f["tokenizer.ggml.tokens"][0]
    assert int(back["tokenizer.ggml.eos_token_id"][1]) == int(f["tokenizer.ggml.eos_token_id"][1])


@pytest.mark.slow
def test_smollm2_bf16_export_decodes_like_q4_1(tmp_path, smollm2):
    """BF16 holds the dequantized Q4_1/Q8_0 weights to within bf16 rounding: logits agree closely
    and greedy decoding picks the same tokens."""
    from metrale import Engine, SamplingParams
    from metrale.models.registry import resolve_model
    src = resolve_model("smollm2-135m").path
    info = ge.export_model("smollm2-135m", tmp_path / "smol-bf16.gguf")
    assert info["bytes"] < 0.6 * 270e6 * 2
    fields = read_gguf_fields(gguf.GGUFReader(str(tmp_path / "smol-bf16.gguf")))
    orig = read_gguf_fields(gguf.GGUFReader(str(src)))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        assert fields[key] == orig[key]
    assert fields["general.file_type"] == 32
    bf16 = Engine(model=str(tmp_path / "smol-bf16.gguf"), device="cpu", levers={"cpu_kernels": "numpy"})   # as smollm2
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "def fib(n):"]
    a = smollm2.generate(prompts, params, use_tqdm=False)
    b = bf16.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.token_ids, y.token_ids)
    ids = np.asarray(smollm2.tokenizer.encode(prompts[0]), np.int32)
    with scratch_blocks(smollm2, len(ids)) as blocks:     # not behind the shared engine's prefix cache
        batch = build_batch([Segment(ids, 0, blocks, "all")], smollm2.backend.block_size)
        la, lb = smollm2.backend.forward(batch), bf16.backend.forward(batch)
    assert np.abs(la - lb).max() < 0.02 * np.abs(la).max()   # bf16 rounding of Q4_1/Q8_0 values (0.16 of 27)


# ---------------------------------------------------------------------------- llama.cpp output

LLAMA_BENCH_JSON = """[
  {
    "build_commit": "unknown", "build_number": 0, "cpu_info": "x86", "gpu_info": "", "backends": "CPU",
    "model_filename": "m.gguf", "model_type": "llama ?B BF16", "n_prompt": 64, "n_gen": 0, "n_depth": 0,
    "flash_attn": -1, "avg_ns": 10, "stddev_ns": 1, "avg_ts": 5120.5, "stddev_ts": 12.5, "samples_ts": [5000, 5241]
  },
  {
    "build_commit": "unknown", "build_number": 0, "cpu_info": "x86", "gpu_info": "", "backends": "CPU",
    "model_filename": "m.gguf", "model_type": "llama ?B BF16", "n_prompt": 0, "n_gen": 16, "n_depth": 0,
    "flash_attn": -1, "avg_ns": 10, "stddev_ns": 1, "avg_ts": 812.25, "stddev_ts": 3.0, "samples_ts": [810, 814]
  }
]
"""

LLAMA_BENCH_MD = """| model                          |       size |     params | backend    | threads |            test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | ------: | --------------: | -------------------: |
| llama ?B BF16                  |   3.25 MiB |     1.63 M | CPU        |       2 |            pp64 |      5120.50 ± 12.50 |
| llama ?B BF16                  |   3.25 MiB |     1.63 M | CPU        |       2 |            tg16 |        812.25 ± 3.00 |
"""

BATCHED_JSONL = """main: n_kv_max = 1024
{"n_kv_max": 1024, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": 0, "n_threads": 2, "n_threads_batch": 2, "pp": 16, "tg": 16, "pl": 2, "n_kv": 64, "t_pp": 0.01, "speed_pp": 3200.0, "t_tg": 0.05, "speed_tg": 640.0, "t": 0.06, "speed": 1066.7}
{"n_kv_max": 1024, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": 0, "n_threads": 2, "n_threads_batch": 2, "pp": 16, "tg": 16, "pl": 4, "n_kv": 128, "t_pp": 0.02, "speed_pp": 3200.0, "t_tg": 0.08, "speed_tg": 800.0, "t": 0.1, "speed": 1280.0}
"""

BATCHED_MD = """|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |     16 |    2 |     64 |    0.010 |  3200.00 |    0.050 |   640.00 |    0.060 |  1066.67 |
|    16 |     16 |    4 |    128 |    0.020 |  3200.00 |    0.080 |   800.00 |    0.100 |  1280.00 |
"""


def test_llama_bench_output_parses_as_json_and_markdown():
    noisy = "load_backend: loaded CPU backend [x]\n" + LLAMA_BENCH_JSON + "\nllama_perf [done]\n"
    for text in (noisy, LLAMA_BENCH_MD):
        rows = lc.parse_llama_bench(text)
        assert [(r["n_prompt"], r["n_gen"]) for r in rows] == [(64, 0), (0, 16)]
        assert rows[0]["avg_ts"] == pytest.approx(5120.5) and rows[1]["stddev_ts"] == pytest.approx(3.0)


def test_batched_bench_output_parses_as_jsonl_and_markdown():
    for text in (BATCHED_JSONL, BATCHED_MD):
        rows = lc.parse_batched_bench(text)
        assert [int(r["pl"]) for r in rows] == [2, 4]
        assert [r["speed_tg"] for r in rows] == pytest.approx([640.0, 800.0])


def test_records_pair_metrale_with_llama_cpp(tmp_path):
    met = {"device": "cpu", "load_s": 0.1,
           "params": {"pp": [64], "tg": 16, "npl": [2, 4], "npp": 16, "ntg": 16},
           "tg": {"batch": 1, "context": 8, "tok_s": 406.0},
           "pp": [{"tokens": 64, "tok_s": 10241.0, "tflops": 0.01}],
           "batched": [{"batch": 2, "context": 24, "tok_s": 320.0}, {"batch": 4, "context": 24, "tok_s": 1600.0}]}
    raw = {"tiny": {"metrale": met, "llamacpp": {"bench": {"rows": lc.parse_llama_bench(LLAMA_BENCH_JSON)},
                                                 "batched": {"rows": lc.parse_batched_bench(BATCHED_JSONL)}}}}
    recs = lc.report(raw, tmp_path, "CPU", "test")
    by = {r["figure"]: r for r in recs}
    assert set(by) == {"tiny decode B=1 tg16", "tiny prefill pp64", "tiny decode B=2 (npp 16, ntg 16)",
                       "tiny decode B=4 (npp 16, ntg 16)"}
    assert by["tiny decode B=1 tg16"]["ratio_to_peer"] == pytest.approx(0.5, rel=1e-3)
    assert by["tiny prefill pp64"]["ratio_to_peer"] == pytest.approx(2.0, rel=1e-3)
    assert by["tiny decode B=4 (npp 16, ntg 16)"]["ratio_to_peer"] == pytest.approx(2.0)
    assert all(r["peer_name"] == "llama.cpp CUDA" and r["benchmark"] == "llamacpp" for r in recs)
    assert (tmp_path / "llamacpp.json").exists() and (tmp_path / "llamacpp_table.md").exists()
