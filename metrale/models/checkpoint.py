"""Checkpoint reading: GGUF (via the `gguf` package) and Hugging Face safetensors directories.

Both produce a ModelConfig and a stream of (canonical name, float32 array) pairs, one tensor at a
time so peak host memory stays near one layer. Canonical names:
  embed, final_norm, lm_head (absent when tied),
  layers.{i}.attn_norm, .qkv (rows q|k|v), .qkv_bias, .q_norm, .k_norm, .o,
  layers.{i}.mlp_norm, .gate_up (rows gate|up), .down
Linear weights are [out_features, in_features]. FP8 e4m3 safetensors weights (models/fp8.py) are
dequantized with their scales, or, on load_hf_dir(keep_fp8=True), stream as FP8Tensor.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from metrale.models.config import ModelConfig
from metrale.models.fp8 import (FP8_E4M3, SCALE_SUFFIXES, FP8Tensor, Fp8Scheme, SafetensorsBytes, fp8_scheme,
                                member_grid, stacked_grid)
from metrale.models.rope import check_rope_scaling, hf_rope_settings, model_rope, yarn_mscale

WeightStream = Iterator[tuple[str, np.ndarray]]


# ----------------------------------------------------------------------------------------- GGUF

def _gguf_reader(path: Path):
    from metrale.models.gguf_file import GGUFFile     # gguf.GGUFReader's interface, ~80x faster to open
    try:
        return GGUFFile(path)
    except Exception as exc:  # a truncated or foreign file
        raise ValueError(f"cannot read GGUF file {path}: {exc}") from exc


def gguf_model_config(fields: dict, name: str = "") -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3"):
        raise ValueError(f"unsupported GGUF architecture '{arch}' (supported: llama, qwen2, qwen3, qwen3moe, gemma3)")
    g = lambda key, default=None: fields.get(f"{arch}.{key}", default)  # noqa: E731
    hidden = int(g("embedding_length"))
    heads = int(g("attention.head_count"))
    head_dim = int(g("attention.key_length", 0) or g("rope.dimension_count", 0) or hidden // heads)
    vocab = int(g("vocab_size", 0) or len(fields.get("tokenizer.ggml.tokens", [])))
    eos = fields.get("tokenizer.ggml.eos_token_id")
    config = ModelConfig(
        architecture=arch, vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")), num_layers=int(g("block_count")),
        num_heads=heads, num_kv_heads=int(g("attention.head_count_kv", heads)), head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        extra={"rope_scaling": gguf_rope_scaling(fields, arch, name or str(fields.get("general.name", "")))},
        # llama.cpp's converter permutes Q/K of llama models for its adjacent-pair RoPE;
        # qwen2/qwen3 GGUFs keep the half-split (NEOX) layout.
        rope_interleaved=(arch == "llama"),
        max_position=int(g("context_length", 8192)),
        tie_word_embeddings=True,  # corrected by load_gguf when output.weight exists
        qk_norm=arch in ("qwen3", "qwen3moe"), attention_bias=(arch == "qwen2"),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        name=name or str(fields.get("general.name", "")),
        # llama.cpp's key for a window on every layer (Mistral-style); absent: full attention
        sliding_window=int(g("attention.sliding_window", 0) or 0),
    )
    if arch == "gemma3":
        from metrale.models.gemma import gemma3_gguf_config
        return gemma3_gguf_config(fields, config)
    if arch == "qwen3moe":        # as llama.cpp runs it: every layer MoE, softmax top-k renormalized
        e, k = int(g("expert_count", 0) or 0), int(g("expert_used_count", 0) or 0)
        if not (e and k):
            raise ValueError(f"{config.name}: a qwen3moe GGUF needs expert_count and expert_used_count")
        config = _replace(config, n_routed_experts=e, num_experts_per_tok=k,
                          moe_intermediate_size=int(g("expert_feed_forward_length", 0) or config.intermediate_size // k),
                          moe_layers=(True,) * config.num_layers, scoring_func="softmax", topk_method="greedy",
                          norm_topk_prob=True)
    return config


def gguf_rope_scaling(fields: dict, arch: str, where: str = "") -> dict | None:
    """The HF rope_scaling dict of llama.cpp's `<arch>.rope.scaling.*` keys (type none | linear | yarn,
    factor, original_context_length, yarn_beta_fast/slow, attn_factor) or the older
    `<arch>.rope.scale_linear`. As in llama.cpp, a factor without a type is linear, and attn_factor
    multiplies YaRN's own 0.1 ln(factor) + 1."""
    g = lambda key: fields.get(f"{arch}.rope.{key}")  # noqa: E731
    kind, factor = g("scaling.type"), g("scaling.factor") or g("scale_linear")
    if kind is None:
        kind = "linear" if factor and float(factor) != 1.0 else "none"
    kind = str(kind)
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        return check_rope_scaling({"rope_type": kind}, where)       # raises, naming the type
    scaling: dict = {"rope_type": kind, "factor": float(factor if factor is not None else 1.0)}
    if kind == "yarn":
        if g("scaling.original_context_length"):
            scaling["original_max_position_embeddings"] = int(g("scaling.original_context_length"))
        for key, hf_key in (("scaling.yarn_beta_fast", "beta_fast"), ("scaling.yarn_beta_slow", "beta_slow")):
            if g(key) is not None:
                scaling[hf_key] = float(g(key))
        attn = g("scaling.attn_factor") or g("scaling.yarn_attn_factor")
        if attn is not None and float(attn) != 1.0:
            scaling["attention_factor"] = float(attn) * yarn_mscale(scaling["factor"])
    return check_rope_scaling(scaling, where)


_GGUF_LAYER = {"attn_norm": "attn_norm", "attn_output": "o", "ffn_norm": "mlp_norm",
               "ffn_down": "down", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
               # Gemma's sandwich norms (llama.cpp stores every Gemma norm as 1 + w already)
               "post_attention_norm": "post_attn_norm", "post_ffw_norm": "post_mlp_norm"}


def _dequantize(tensor) -> np.ndarray:
    import gguf
    rows = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.ascontiguousarray(rows, dtype=np.float32).reshape(tuple(int(n) for n in reversed(tensor.shape)))


def load_gguf(path: Path, keep_quantized: bool = False) -> tuple[ModelConfig, dict, Callable[[], WeightStream]]:
    """Returns (config, metadata fields, a function that streams the weights). keep_quantized:
    matrices of a block type (Q4_0 ... Q6_K) stream as QuantizedTensor, the file's blocks left in
    its memory map (qkv and gate_up as row-stacked parts, whose types may differ), and everything
    else (norms, biases, dense F32/F16/BF16 tensors, a stack with a dense member) as float32."""
    from metrale.models.tokenizer import read_gguf_fields
    reader = _gguf_reader(path)
    fields = read_gguf_fields(reader)
    config = gguf_model_config(fields, name=path.stem)
    tensors = {t.name: t for t in reader.tensors}
    if "output.weight" in tensors:
        config = _replace(config, tie_word_embeddings=False)
    if "rope_freqs.weight" in tensors:       # Llama-3.x: llama3 scaling as per-frequency divisors
        factors = _dequantize(tensors["rope_freqs.weight"]).astype(np.float64).reshape(-1)
        config = _replace(config, extra={**config.extra, "rope_freq_factors": factors})
        model_rope(config)                   # refuses a factor count that does not fit the rotary dim
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: no token_embd.weight tensor")

    def matrix(*names: str):
        ts = [tensors[n] for n in names]
        if keep_quantized and all(_is_block_type(t) for t in ts):
            from metrale.models.quantized import QuantizedTensor, from_gguf_tensor
            return QuantizedTensor.stack([from_gguf_tensor(t) for t in ts])
        return np.concatenate([_dequantize(t) for t in ts]) if len(ts) > 1 else _dequantize(ts[0])

    def stream() -> WeightStream:
        yield "embed", matrix("token_embd.weight")
        for i in range(config.num_layers):
            p = f"blk.{i}."
            for suffix, name in _GGUF_LAYER.items():
                if p + suffix + ".weight" in tensors:
                    yield f"layers.{i}.{name}", matrix(p + suffix + ".weight")
            yield f"layers.{i}.qkv", matrix(*(p + f"attn_{x}.weight" for x in "qkv"))
            if p + "attn_q.bias" in tensors:
                yield f"layers.{i}.qkv_bias", np.concatenate(
                    [_dequantize(tensors[p + f"attn_{x}.bias"]) for x in "qkv"])
            if p + "ffn_gate_inp.weight" in tensors:     # a MoE layer (qwen3moe): router and stacked experts
                yield f"layers.{i}.router", _dequantize(tensors[p + "ffn_gate_inp.weight"])
                yield f"layers.{i}.experts_gate_up", np.concatenate(
                    [_dequantize(tensors[p + f"ffn_{x}_exps.weight"]) for x in ("gate", "up")], axis=1)
                yield f"layers.{i}.experts_down", _dequantize(tensors[p + "ffn_down_exps.weight"])
                continue
            yield f"layers.{i}.gate_up", matrix(p + "ffn_gate.weight", p + "ffn_up.weight")
        yield "final_norm", _dequantize(tensors["output_norm.weight"])
        if not config.tie_word_embeddings:
            yield "lm_head", matrix("output.weight")

    if not keep_quantized:
        return config, fields, stream
    from metrale.models.quantized import QuantizedStream
    return config, fields, QuantizedStream(stream, _quantized_parts(tensors, config))


def _quantized_parts(tensors: dict, config: ModelConfig) -> dict:
    """name -> ((ggml type, rows, cols), ...) of the matrices load_gguf's stream yields as
    QuantizedTensor (read from the header: no tensor data touched)."""
    names = {"embed": ("token_embd.weight",)}
    for i in range(config.num_layers):
        p = f"blk.{i}."
        for suffix, name in _GGUF_LAYER.items():
            names[f"layers.{i}.{name}"] = (p + suffix + ".weight",)
        names[f"layers.{i}.qkv"] = tuple(p + f"attn_{x}.weight" for x in "qkv")
        names[f"layers.{i}.gate_up"] = (p + "ffn_gate.weight", p + "ffn_up.weight")
    if not config.tie_word_embeddings:
        names["lm_head"] = ("output.weight",)
    out = {}
    for name, ts in names.items():
        if all(t in tensors for t in ts) and all(_is_block_type(tensors[t]) for t in ts):
            out[name] = tuple((int(tensors[t].tensor_type), int(np.prod(tensors[t].shape[1:])), int(tensors[t].shape[0]))
                              for t in ts)
    return out


def _is_block_type(tensor) -> bool:
    from metrale.models.quantized import BLOCK_TYPES
    return int(tensor.tensor_type) in {int(t) for t in BLOCK_TYPES} and len(tensor.shape) == 2


def _replace(config: ModelConfig, **changes) -> ModelConfig:
    from dataclasses import replace
    return replace(config, **changes)


# ------------------------------------------------------------------------ Hugging Face directory

def hf_model_config(cfg: dict, name: str = "") -> ModelConfig:
    arch = str(cfg.get("model_type", "llama"))
    from metrale.models.hybrid import HYBRID_TYPES, hybrid_model_config
    if arch in HYBRID_TYPES:
        return hybrid_model_config(cfg, name)
    from metrale.models.gemma import GEMMA3_TYPES, gemma3_model_config
    if arch in GEMMA3_TYPES:
        return gemma3_model_config(cfg, name)
    from metrale.models.moe import QWEN_MOE_TYPES, qwen_moe_fields
    if arch not in ("llama", "qwen2", "qwen3", "mistral") + QWEN_MOE_TYPES:
        raise ValueError(f"unsupported model_type '{arch}' (supported: llama, qwen2, qwen3, mistral, "
                         f"{', '.join(QWEN_MOE_TYPES + HYBRID_TYPES + GEMMA3_TYPES)})")
    heads = int(cfg["num_attention_heads"])
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    theta, rope_scaling = hf_rope_settings(cfg, name or arch)
    window, window_layers = hf_sliding_window(cfg, arch)
    return ModelConfig(
        architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_interleaved=False, max_position=int(cfg.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")), qk_norm=arch in ("qwen3", "qwen3_moe"),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids, name=name,
        extra={"rope_scaling": rope_scaling}, sliding_window=window, sliding_layers=window_layers,
        **(qwen_moe_fields(cfg, int(cfg["num_hidden_layers"]), arch) if arch in QWEN_MOE_TYPES else {}),
    )


def hf_sliding_window(cfg: dict, arch: str) -> tuple[int, tuple[bool, ...]]:
    """(window, per-layer flags) as transformers applies a config.json: Mistral slides every layer
    (sliding_window absent means MistralConfig's default 4096; null means none); Qwen2/Qwen3
    slide only with use_sliding_window, on the layers layer_types marks "sliding_attention" or, without
    layer_types, on layers >= max_window_layers (default 28). Llama has no window."""
    n = int(cfg["num_hidden_layers"])
    if arch == "mistral":
        window = cfg.get("sliding_window", 4096)
        return (int(window), ()) if window else (0, ())
    if arch not in ("qwen2", "qwen3", "qwen3_moe") or not cfg.get("use_sliding_window", False):
        return 0, ()
    window = cfg.get("sliding_window", 4096)
    if not window:
        return 0, ()
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported for {arch}")
        layers = tuple(t == "sliding_attention" for t in types)
    else:
        layers = tuple(i >= int(cfg.get("max_window_layers", 28)) for i in range(n))
    return (int(window), layers) if any(layers) else (0, ())


class SafetensorsDir:
    """The tensors of a directory's *.safetensors: which file holds each, their dtypes and shapes
    (read from the headers), a float32 getter (FP8 weights dequantized with their scales) and the
    FP8 weights as they are stored (metrale/models/fp8.py)."""

    def __init__(self, path: Path, scheme: Fp8Scheme | None = None) -> None:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path}: no *.safetensors files")
        self.path, self.scheme, self.raw = path, scheme, SafetensorsBytes()
        self.where: dict[str, Path] = {}
        self.dtypes: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            for key, meta in self.raw.header(f).items():
                if key != "__metadata__":
                    self.where[key], self.dtypes[key], self.shapes[key] = f, str(meta["dtype"]), tuple(meta["shape"])

    def get(self, key: str) -> np.ndarray:
        """float32 of tensor `key`; an FP8 weight dequantized (e4m3 values times their scales)."""
        from safetensors import safe_open
        if key not in self.where:
            raise ValueError(f"{self.path}: tensor '{key}' missing")
        if self.dtypes[key] == FP8_E4M3:
            return self.fp8(key).dequantize()
        if self.dtypes[key].startswith("F8"):
            raise ValueError(f"{self.path}: tensor '{key}' is {self.dtypes[key]}; FP8 weights are read as e4m3 "
                             f"({FP8_E4M3}) only")
        with safe_open(str(self.where[key]), framework="numpy") as st:
            return _to_f32(st.get_tensor(key))

    def fp8(self, key: str) -> FP8Tensor | None:
        """The FP8 weight `key` as stored (its bytes and scales), or None when it is not FP8."""
        if self.dtypes.get(key) != FP8_E4M3:
            return None
        q = self.raw.get(self.where[key], key)
        if q.ndim != 2:
            raise ValueError(f"{self.path}: FP8 tensor '{key}' of shape {q.shape}: weights are read as matrices")
        return FP8Tensor.of(q, self.get(self._scale_key(key)), self._block())

    def fp8_part(self, keys: tuple[str, ...]) -> tuple[str, int, int, int] | None:
        """(FP8_E4M3, rows, cols, scale values) of the weights `keys` row-stacked, read from the
        headers, when every one is FP8 (what FP8Tensor.stack of their fp8() would hold); else None."""
        if not keys or not all(self.dtypes.get(k) == FP8_E4M3 for k in keys):
            return None
        members, cols = [], 0
        for k in keys:
            rows, cols = self.shapes[k]
            members.append((rows, *member_grid(rows, cols, self.shapes[self._scale_key(k)], self._block())))
        bn, bk = members[0][1:] if len(members) == 1 else stacked_grid(members)
        n = sum(m[0] for m in members)
        return FP8_E4M3, n, cols, -(-n // bn) * -(-cols // bk)

    def _block(self) -> tuple[int, int] | None:
        return self.scheme.block if self.scheme is not None else None

    def _scale_key(self, key: str) -> str:
        """The scale tensor of FP8 weight `key` (<module>.weight_scale_inv or .weight_scale)."""
        if key.endswith(".weight"):
            stem = key[:-len("weight")]
            for suffix in SCALE_SUFFIXES:
                if stem + suffix in self.where:
                    return stem + suffix
        raise ValueError(f"{self.path}: FP8 tensor '{key}' has no scale ({' or '.join(SCALE_SUFFIXES)} beside it)")


def _safetensors_index(path: Path) -> tuple[dict[str, Path], Callable[[str], np.ndarray]]:
    """Which file holds each tensor of a directory's *.safetensors, and a float32 getter."""
    st = SafetensorsDir(path)
    return st.where, st.get


def _hf_matrices(config: ModelConfig, i: int) -> dict[str, tuple[str, ...]]:
    """Canonical name -> the HF tensors it row-stacks, for layer i's linear weights (a dense
    family's layout; MoE layers' experts are the MoE reader's)."""
    p = f"model.layers.{i}."
    out = {f"layers.{i}.qkv": tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv"),
           f"layers.{i}.o": (p + "self_attn.o_proj.weight",)}
    if not config.is_moe_layer(i):
        out[f"layers.{i}.gate_up"] = (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        out[f"layers.{i}.down"] = (p + "mlp.down_proj.weight",)
    return out


def load_hf_dir(path: Path, keep_fp8: bool = False) -> tuple[ModelConfig, dict, Callable[[], WeightStream]]:
    """Returns (config, config.json, a function that streams the weights). FP8 e4m3 weights are
    dequantized to float32 with their scales, or with keep_fp8 (levers.weights=native on CUDA) stream
    as FP8Tensor: the linear matrices of a dense stack whose members are all FP8, announced by the
    returned QuantizedStream (embeddings, norms and the other families' streams stay float32)."""
    cfg = json.loads((path / "config.json").read_text())
    config = hf_model_config(cfg, name=path.name)
    st = SafetensorsDir(path, fp8_scheme(cfg))
    where, get = st.where, st.get
    if "lm_head.weight" not in where and not config.tie_word_embeddings:
        config = _replace(config, tie_word_embeddings=True)
    dense = not (config.is_hybrid or config.architecture == "gemma3")
    head = {} if config.tie_word_embeddings else {"lm_head": ("lm_head.weight",)}
    fp8_parts = {}
    if keep_fp8 and dense:
        for i in range(config.num_layers):
            fp8_parts.update({n: (part,) for n, keys in _hf_matrices(config, i).items()
                              if (part := st.fp8_part(keys)) is not None})
        if (part := st.fp8_part(head.get("lm_head", ()))) is not None:
            fp8_parts["lm_head"] = (part,)

    def matrix(name: str, keys: tuple[str, ...]):
        if name in fp8_parts:                       # kept in its bytes (announced above)
            ts = [st.fp8(k) for k in keys]
            return ts[0] if len(ts) == 1 else FP8Tensor.stack(ts)
        return np.concatenate([get(k) for k in keys]) if len(keys) > 1 else get(keys[0])

    def stream() -> WeightStream:
        if config.is_hybrid:
            from metrale.models.hybrid import hybrid_weight_stream
            yield from hybrid_weight_stream(config, get, where.__contains__)
            return
        if config.architecture == "gemma3":
            from metrale.models.gemma import gemma3_weight_stream
            yield from gemma3_weight_stream(config, get, where.__contains__)
            return
        yield "embed", get("model.embed_tokens.weight")
        for i in range(config.num_layers):
            p, q, m = f"model.layers.{i}.", f"layers.{i}.", _hf_matrices(config, i)
            yield q + "attn_norm", get(p + "input_layernorm.weight")
            yield q + "qkv", matrix(q + "qkv", m[q + "qkv"])
            if p + "self_attn.q_proj.bias" in where:
                yield q + "qkv_bias", np.concatenate([get(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
            if config.qk_norm:
                yield q + "q_norm", get(p + "self_attn.q_norm.weight")
                yield q + "k_norm", get(p + "self_attn.k_norm.weight")
            yield q + "o", matrix(q + "o", m[q + "o"])
            yield q + "mlp_norm", get(p + "post_attention_layernorm.weight")
            if config.is_moe_layer(i):              # Qwen3-MoE (models/moe.py)
                from metrale.models.moe import qwen_moe_stream
                yield from qwen_moe_stream(config, i, get, where.__contains__)
                continue
            yield q + "gate_up", matrix(q + "gate_up", m[q + "gate_up"])
            yield q + "down", matrix(q + "down", m[q + "down"])
        yield "final_norm", get("model.norm.weight")
        for name, keys in head.items():
            yield name, matrix(name, keys)

    if not fp8_parts:
        return config, cfg, stream
    from metrale.models.quantized import QuantizedStream
    return config, cfg, QuantizedStream(stream, fp8_parts)


def _to_f32(a: np.ndarray) -> np.ndarray:
    # safetensors' numpy API returns bf16 tensors as ml_dtypes.bfloat16 arrays
    return np.asarray(a, dtype=np.float32)


# ------------------------------------------------------------------------------ random weights

def random_model_config(preset: dict, name: str) -> ModelConfig:
    if preset.get("model_type") in ("qwen3_next", "metrale_hybrid"):   # hybrid presets: a config.json's fields
        from metrale.models.hybrid import hybrid_model_config
        return hybrid_model_config(preset, name)
    from metrale.models.gemma import GEMMA3_TYPES, gemma3_model_config
    if preset.get("model_type") in GEMMA3_TYPES:                    # Gemma presets: a config.json's fields
        return gemma3_model_config(preset, name)
    keys = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim", "rope_theta", "tie_word_embeddings", "max_position")
    scaling = check_rope_scaling(dict(preset["rope_scaling"]) if preset.get("rope_scaling") else None, name)
    return ModelConfig(**{k: preset[k] for k in keys if k in preset}, name=name, extra={"rope_scaling": scaling})


def random_weights(config: ModelConfig, seed: int = 0) -> WeightStream:
    """Host-side random weights with sane scales (the CUDA backend builds its own on the device)."""
    if config.is_hybrid:
        from metrale.models.hybrid import random_hybrid_weights
        yield from random_hybrid_weights(config, seed)
        return
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


# ------------------------------------------------------------------ DeepSeek-V2/V3 (MLA + MoE)

DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


def is_deepseek_config(cfg: dict) -> bool:
    return str(cfg.get("model_type", "")) in DEEPSEEK_MODEL_TYPES


# transformers' config defaults of the MoE keys (DeepseekV2Config, DeepseekV3Config). V2 routes with
# softmax scores (greedy or group_limited_greedy); V3 always with sigmoid + noaux_tc.
DEEPSEEK_ROUTING_DEFAULTS = {
    "deepseek_v2": dict(n_routed_experts=64, num_experts_per_tok=None, moe_intermediate_size=1407,
                        n_shared_experts=2, first_k_dense_replace=0, scoring_func="softmax",
                        topk_method="greedy", n_group=None, topk_group=None, norm_topk_prob=False,
                        routed_scaling_factor=1.0),
    "deepseek_v3": dict(n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                        n_shared_experts=1, first_k_dense_replace=3, scoring_func="sigmoid",
                        topk_method="noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True,
                        routed_scaling_factor=2.5),
}


def deepseek_routing(cfg: dict, arch: str) -> dict:
    """The MoE keys of a DeepSeek config.json, each absent one at transformers' default. A key given
    as null keeps null (transformers does too); explicit values are honoured, as DeepSeek's own code does."""
    return {k: cfg.get(k, default) for k, default in DEEPSEEK_ROUTING_DEFAULTS[arch].items()}


def deepseek_model_config(cfg: dict, name: str = "") -> ModelConfig:
    """ModelConfig of a DeepSeek-V2/V3-style config.json (docs/deepseek.md). num_kv_heads = 1
    and head_dim = qk_nope + qk_rope: the latent cache is one shared "kv head" per token.
    routed_scaling_factor is applied after normalisation (V3); a V2 config that normalises
    (norm_topk_prob) never scaled, so its factor becomes 1. Absent routing keys take the defaults
    of transformers' DeepseekV2Config / DeepseekV3Config (DEEPSEEK_ROUTING_DEFAULTS): a V3 config
    without scoring_func / topk_method routes with sigmoid scores and noaux_tc group-limited top-k,
    as transformers' DeepseekV3 always does."""
    arch = str(cfg.get("model_type", ""))
    if arch not in DEEPSEEK_MODEL_TYPES:
        raise ValueError(f"not a DeepSeek config: model_type '{arch}' (expected one of {DEEPSEEK_MODEL_TYPES})")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    route = deepseek_routing(cfg, arch)
    norm = bool(route["norm_topk_prob"])
    scaling = float(route["routed_scaling_factor"] or 1.0)
    if arch == "deepseek_v2" and norm:
        scaling = 1.0
    n_routed = int(route["n_routed_experts"] or 0)
    q_lora = cfg.get("q_lora_rank")
    theta, rope_scaling = hf_rope_settings(cfg, name or arch)
    return ModelConfig(
        architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
        num_heads=int(cfg["num_attention_heads"]), num_kv_heads=1, head_dim=nope + rope,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_interleaved=True, max_position=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids, name=name,
        extra={"rope_scaling": rope_scaling},
        q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(cfg["v_head_dim"]),
        n_routed_experts=n_routed, num_experts_per_tok=int(route["num_experts_per_tok"] or 0),
        moe_intermediate_size=int(route["moe_intermediate_size"] or 0),
        n_shared_experts=int(route["n_shared_experts"] or 0),
        first_k_dense_replace=int(route["first_k_dense_replace"] or 0),
        moe_layer_freq=int(cfg.get("moe_layer_freq", 1)),
        scoring_func=str(route["scoring_func"]), topk_method=str(route["topk_method"]),
        n_group=int(route["n_group"] or 1), topk_group=int(route["topk_group"] or 1),
        norm_topk_prob=norm, routed_scaling_factor=scaling,
    )


def load_deepseek_dir(path: Path, expert_range: tuple[int, int] | None = None
                      ) -> tuple[ModelConfig, dict, Callable[[], WeightStream]]:
    """A DeepSeek-V2/V3 safetensors directory (bf16/f32 tensors; FP8 block-scaled ones, as DeepSeek-V3
    ships, dequantized to float32 at load). Canonical names (docs/deepseek.md):
      layers.{i}.attn_norm, .q_a, .q_a_norm, .q_b (or .q without q_lora_rank), .kv_a, .kv_a_norm,
      .kv_b, .o, .mlp_norm; dense layers .gate_up, .down; MoE layers .router [E, D],
      .router_bias [E] (noaux_tc), .experts_gate_up [E', 2F, D], .experts_down [E', D, F] (E' =
      the experts of expert_range, all by default: an expert-parallel rank loads only its own),
      .shared_gate_up, .shared_down. Layers past num_hidden_layers (MTP heads) are skipped."""
    cfg = json.loads((path / "config.json").read_text())
    config = deepseek_model_config(cfg, name=path.name)
    lo, hi = expert_range or (0, config.n_routed_experts)
    if not 0 <= lo <= hi <= config.n_routed_experts:
        raise ValueError(f"expert range {lo}..{hi} outside the {config.n_routed_experts} experts")
    st = SafetensorsDir(path, fp8_scheme(cfg))           # FP8 (DeepSeek-V3's own): dequantized at load
    where, get = st.where, st.get
    if "lm_head.weight" not in where and not config.tie_word_embeddings:
        config = _replace(config, tie_word_embeddings=True)

    def mlp(prefix: str) -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate([get(prefix + "gate_proj.weight"), get(prefix + "up_proj.weight")]), \
            get(prefix + "down_proj.weight")

    def stream() -> WeightStream:
        yield "embed", get("model.embed_tokens.weight")
        for i in range(config.num_layers):
            p, a, q = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"layers.{i}."
            yield q + "attn_norm", get(p + "input_layernorm.weight")
            if config.q_lora_rank:
                yield q + "q_a", get(a + "q_a_proj.weight")
                yield q + "q_a_norm", get(a + "q_a_layernorm.weight")
                yield q + "q_b", get(a + "q_b_proj.weight")
            else:
                yield q + "q", get(a + "q_proj.weight")
            yield q + "kv_a", get(a + "kv_a_proj_with_mqa.weight")
            yield q + "kv_a_norm", get(a + "kv_a_layernorm.weight")
            yield q + "kv_b", get(a + "kv_b_proj.weight")
            yield q + "o", get(a + "o_proj.weight")
            yield q + "mlp_norm", get(p + "post_attention_layernorm.weight")
            if not config.is_moe_layer(i):
                gate_up, down = mlp(p + "mlp.")
                yield q + "gate_up", gate_up
                yield q + "down", down
                continue
            yield q + "router", get(p + "mlp.gate.weight")
            if p + "mlp.gate.e_score_correction_bias" in where:
                yield q + "router_bias", get(p + "mlp.gate.e_score_correction_bias")
            experts = [mlp(p + f"mlp.experts.{e}.") for e in range(lo, hi)]
            yield q + "experts_gate_up", np.stack([g for g, _ in experts]) if experts else \
                np.zeros((0, 2 * config.moe_intermediate_size, config.hidden_size), np.float32)
            yield q + "experts_down", np.stack([d for _, d in experts]) if experts else \
                np.zeros((0, config.hidden_size, config.moe_intermediate_size), np.float32)
            del experts
            if config.n_shared_experts:
                gate_up, down = mlp(p + "mlp.shared_experts.")
                yield q + "shared_gate_up", gate_up
                yield q + "shared_down", down
        yield "final_norm", get("model.norm.weight")
        if not config.tie_word_embeddings:
            yield "lm_head", get("lm_head.weight")

    return config, cfg, stream
