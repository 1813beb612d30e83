"""Weight loading: GGUF (via the `gguf` package) and Hugging Face safetensors directories.

Both produce a ModelConfig and a stream of (canonical name, float32 array) pairs, one tensor at a
time so peak host memory stays near one layer. Canonical names:
  embed, final_norm, lm_head (absent when tied),
  layers.{i}.attn_norm, .qkv (rows q|k|v), .qkv_bias, .q_norm, .k_norm, .o,
  layers.{i}.mlp_norm, .gate_up (rows gate|up), .down
Linear weights are [out_features, in_features].
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from metrale.models.config import ModelConfig

WeightStream = Iterator[tuple[str, np.ndarray]]


# ----------------------------------------------------------------------------------------- GGUF

def _gguf_reader(path: Path):
    import gguf
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # a truncated or foreign file
        raise ValueError(f"cannot read GGUF file {path}: {exc}") from exc


def gguf_model_config(fields: dict, name: str = "") -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"unsupported GGUF architecture '{arch}' (supported: llama, qwen2, qwen3)")
    g = lambda key, default=None: fields.get(f"{arch}.{key}", default)  # noqa: E731
    hidden = int(g("embedding_length"))
    heads = int(g("attention.head_count"))
    head_dim = int(g("attention.key_length", 0) or g("rope.dimension_count", 0) or hidden // heads)
    vocab = int(g("vocab_size", 0) or len(fields.get("tokenizer.ggml.tokens", [])))
    eos = fields.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")), num_layers=int(g("block_count")),
        num_heads=heads, num_kv_heads=int(g("attention.head_count_kv", heads)), head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        # llama.cpp's converter permutes Q/K of llama models for its adjacent-pair RoPE;
        # qwen2/qwen3 GGUFs keep the half-split (NEOX) layout.
        rope_interleaved=(arch == "llama"),
        max_position=int(g("context_length", 8192)),
        tie_word_embeddings=True,  # corrected by load_gguf when output.weight exists
        qk_norm=(arch == "qwen3"), attention_bias=(arch == "qwen2"),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        name=name or str(fields.get("general.name", "")),
    )


_GGUF_LAYER = {"attn_norm": "attn_norm", "attn_output": "o", "ffn_norm": "mlp_norm",
               "ffn_down": "down", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}


def _dequantize(tensor) -> np.ndarray:
    import gguf
    rows = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.ascontiguousarray(rows, dtype=np.float32).reshape(tuple(int(n) for n in reversed(tensor.shape)))


def load_gguf(path: Path) -> tuple[ModelConfig, dict, Callable[[], WeightStream]]:
    """Returns (config, metadata fields, a function that streams the weights)."""
    from metrale.models.tokenizer import read_gguf_fields
    reader = _gguf_reader(path)
    fields = read_gguf_fields(reader)
    config = gguf_model_config(fields, name=path.stem)
    tensors = {t.name: t for t in reader.tensors}
    if "output.weight" in tensors:
        config = _replace(config, tie_word_embeddings=False)
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: no token_embd.weight tensor")

    def stream() -> WeightStream:
        yield "embed", _dequantize(tensors["token_embd.weight"])
        for i in range(config.num_layers):
            p = f"blk.{i}."
            for suffix, name in _GGUF_LAYER.items():
                if p + suffix + ".weight" in tensors:
                    yield f"layers.{i}.{name}", _dequantize(tensors[p + suffix + ".weight"])
            yield f"layers.{i}.qkv", np.concatenate(
                [_dequantize(tensors[p + f"attn_{x}.weight"]) for x in "qkv"])
            if p + "attn_q.bias" in tensors:
                yield f"layers.{i}.qkv_bias", np.concatenate(
                    [_dequantize(tensors[p + f"attn_{x}.bias"]) for x in "qkv"])
            yield f"layers.{i}.gate_up", np.concatenate(
                [_dequantize(tensors[p + "ffn_gate.weight"]), _dequantize(tensors[p + "ffn_up.weight"])])
        yield "final_norm", _dequantize(tensors["output_norm.weight"])
        if not config.tie_word_embeddings:
            yield "lm_head", _dequantize(tensors["output.weight"])

    return config, fields, stream


def _replace(config: ModelConfig, **changes) -> ModelConfig:
    from dataclasses import replace
    return replace(config, **changes)


# ------------------------------------------------------------------------ Hugging Face directory

def hf_model_config(cfg: dict, name: str = "") -> ModelConfig:
    arch = str(cfg.get("model_type", "llama"))
    if arch not in ("llama", "qwen2", "qwen3", "mistral"):
        raise ValueError(f"unsupported model_type '{arch}' (supported: llama, qwen2, qwen3, mistral)")
    heads = int(cfg["num_attention_heads"])
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelConfig(
        architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_interleaved=False, max_position=int(cfg.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")), qk_norm=(arch == "qwen3"),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids, name=name,
        extra={"rope_scaling": cfg.get("rope_scaling")},
    )


def load_hf_dir(path: Path) -> tuple[ModelConfig, dict, Callable[[], WeightStream]]:
    from safetensors import safe_open
    cfg = json.loads((path / "config.json").read_text())
    config = hf_model_config(cfg, name=path.name)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="numpy") as st:
            where.update({k: f for k in st.keys()})
    if "lm_head.weight" not in where and not config.tie_word_embeddings:
        config = _replace(config, tie_word_embeddings=True)

    def get(key: str) -> np.ndarray:
        if key not in where:
            raise ValueError(f"{path}: tensor '{key}' missing")
        with safe_open(str(where[key]), framework="numpy") as st:
            return _to_f32(st.get_tensor(key))

    def stream() -> WeightStream:
        yield "embed", get("model.embed_tokens.weight")
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            yield f"layers.{i}.attn_norm", get(p + "input_layernorm.weight")
            yield f"layers.{i}.qkv", np.concatenate([get(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
            if p + "self_attn.q_proj.bias" in where:
                yield f"layers.{i}.qkv_bias", np.concatenate([get(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
            if config.qk_norm:
                yield f"layers.{i}.q_norm", get(p + "self_attn.q_norm.weight")
                yield f"layers.{i}.k_norm", get(p + "self_attn.k_norm.weight")
            yield f"layers.{i}.o", get(p + "self_attn.o_proj.weight")
            yield f"layers.{i}.mlp_norm", get(p + "post_attention_layernorm.weight")
            yield f"layers.{i}.gate_up", np.concatenate(
                [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
            yield f"layers.{i}.down", get(p + "mlp.down_proj.weight")
        yield "final_norm", get("model.norm.weight")
        if not config.tie_word_embeddings:
            yield "lm_head", get("lm_head.weight")

    return config, cfg, stream


def _to_f32(a: np.ndarray) -> np.ndarray:
    # safetensors' numpy API returns bf16 tensors as ml_dtypes.bfloat16 arrays
    return np.asarray(a, dtype=np.float32)


# ------------------------------------------------------------------------------ random weights

def random_model_config(preset: dict, name: str) -> ModelConfig:
    keys = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim", "rope_theta", "tie_word_embeddings", "max_position")
    return ModelConfig(**{k: preset[k] for k in keys if k in preset}, name=name)


def random_weights(config: ModelConfig, seed: int = 0) -> WeightStream:
    """Host-side random weights with sane scales (the CUDA backend builds its own on the device)."""
    rng = np.random.default_rng(seed)
    d, f = config.hidden_size, config.intermediate_size

    def normal(*shape: int, fan_in: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)).astype(np.float32)

    yield "embed", normal(config.vocab_size, d, fan_in=1) * 0.5
    for i in range(config.num_layers):
        yield f"layers.{i}.attn_norm", 1.0 + 0.1 * rng.standard_normal(d, dtype=np.float32)
        yield f"layers.{i}.qkv", normal(config.q_size + 2 * config.kv_size, d, fan_in=d)
        if config.attention_bias:
            yield f"layers.{i}.qkv_bias", 0.1 * rng.standard_normal(config.q_size + 2 * config.kv_size, dtype=np.float32)
        if config.qk_norm:
            yield f"layers.{i}.q_norm", 1.0 + 0.1 * rng.standard_normal(config.head_dim, dtype=np.float32)
            yield f"layers.{i}.k_norm", 1.0 + 0.1 * rng.standard_normal(config.head_dim, dtype=np.float32)
        yield f"layers.{i}.o", normal(d, config.q_size, fan_in=config.q_size)
        yield f"layers.{i}.mlp_norm", 1.0 + 0.1 * rng.standard_normal(d, dtype=np.float32)
        yield f"layers.{i}.gate_up", normal(2 * f, d, fan_in=d)
        yield f"layers.{i}.down", normal(d, f, fan_in=f)
    yield "final_norm", np.ones(d, dtype=np.float32)
    if not config.tie_word_embeddings:
        yield "lm_head", normal(config.vocab_size, d, fan_in=d)
