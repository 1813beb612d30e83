"""Gemma 3 (text): the gemma3 family value (FAMILY), its forward against Ops, the ops it adds to
NumPy's (GemmaNumpyOps), and reading its config.json / GGUF metadata into a ModelConfig.

What differs from the Llama layer (models/llama.py), as transformers' Gemma3ForCausalLM computes it:
- embeddings scaled by sqrt(hidden_size) on the way in (the tied LM head reads them unscaled);
- sandwich norms: RMSNorm before and after both the attention and the MLP block, the "after" one
  on the block's output before the residual add;
- every RMSNorm is x * (1 + w): the loaders store 1 + w (GGUF files already hold it), so the
  forward's norms are the plain rmsnorm(x) * w;
- per-head q/k RMSNorm before RoPE; scores scaled by query_pre_attn_scalar ** -0.5 (not head_dim);
- layer types: sliding layers attend to a window (config.sliding_layers, config.sliding_window)
  and rotate with their own RoPE (local_rope_theta, extra["local_rope_scaling"]); full layers use
  the model's RoPE (rope_theta, extra["rope_scaling"]);
- GELU (tanh approximation) gating in the MLP; optional final logit softcapping.

Canonical names: llama's (embed, final_norm, lm_head when untied; layers.{i}.attn_norm, qkv, q_norm,
k_norm, o, mlp_norm (pre-feedforward), gate_up, down) plus layers.{i}.post_attn_norm and
layers.{i}.post_mlp_norm.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Protocol

import numpy as np

from metrale.models.config import ModelConfig
from metrale.models.families import KV, Family
from metrale.models.llama import Ops
from metrale.models.rope import build_rope, check_rope_scaling, hf_rope_settings

GEMMA3_TYPES = ("gemma3_text", "gemma3")
SLIDING, FULL = "sliding_attention", "full_attention"
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
Tensor = Any


# ----------------------------------------------------------------------------------- config

def gemma3_text_config(cfg: dict) -> dict:
    """The text part of a Gemma 3 config.json: gemma3_text as is, or a multimodal gemma3's text_config."""
    if cfg.get("model_type") == "gemma3":
        if not isinstance(cfg.get("text_config"), dict):
            raise ValueError("a gemma3 config.json without text_config is not supported")
        text = cfg["text_config"]
        return {**text, "model_type": "gemma3_text",
                "tie_word_embeddings": cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True))}
    return cfg


def _gemma3_layer_types(cfg: dict, n: int) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:    # transformers 4 files: every pattern-th layer is global (Gemma3TextConfig's default 6)
        pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if len(types) != n or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types must list {n} entries of '{SLIDING}' / '{FULL}', got {types}")
    return list(types)


def _gemma3_rope(cfg: dict, where: str) -> tuple[tuple[float, dict | None], tuple[float, dict | None]]:
    """((theta, scaling) of full layers, (theta, scaling) of sliding layers) in either layout:
    transformers 5's rope_parameters keyed by layer type, or the older rope_theta (global),
    rope_local_base_freq (local) and rope_scaling (global layers only), with Gemma3TextConfig's
    defaults 1e6 / 1e4."""
    block = cfg.get("rope_parameters") or {}
    if block and (FULL in block or SLIDING in block):
        full, local = dict(block.get(FULL) or {}), dict(block.get(SLIDING) or {})
    else:
        full, local = dict(block), {}
    if cfg.get("rope_scaling"):
        full.update(cfg["rope_scaling"])
    full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    return (hf_rope_settings({"rope_parameters": full}, f"{where} (full_attention)"),
            hf_rope_settings({"rope_parameters": local}, f"{where} (sliding_attention)"))


def gemma3_model_config(cfg: dict, name: str = "") -> ModelConfig:
    """ModelConfig of a Gemma 3 config.json (gemma3_text, or gemma3's text_config), absent keys at
    Gemma3TextConfig's defaults. Refuses what the forward does not compute: attention logit
    softcapping (Gemma 2), bidirectional attention, another activation."""
    cfg = gemma3_text_config(cfg)
    where = name or "gemma3"
    act = cfg.get("hidden_activation", cfg.get("hidden_act")) or "gelu_pytorch_tanh"
    if act not in GELU_TANH:
        raise ValueError(f"{where}: hidden_activation '{act}' is not supported (Gemma 3: gelu_pytorch_tanh)")
    if cfg.get("attn_logit_softcapping"):
        raise ValueError(f"{where}: attn_logit_softcapping is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{where}: use_bidirectional_attention is not supported (decoder-only models)")
    n = int(cfg.get("num_hidden_layers", 26))
    types = _gemma3_layer_types(cfg, n)
    window = cfg.get("sliding_window", 4096)
    (theta, scaling), (local_theta, local_scaling) = _gemma3_rope(cfg, where)
    heads = int(cfg.get("num_attention_heads", 8))
    hidden = int(cfg.get("hidden_size", 2304))
    eos = cfg.get("eos_token_id", 1)
    cap = cfg.get("final_logit_softcapping")
    return ModelConfig(
        architecture="gemma3", vocab_size=int(cfg.get("vocab_size", 262_208)), hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size", 9216)), num_layers=n, num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", 4)), head_dim=int(cfg.get("head_dim") or 256),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        max_position=int(cfg.get("max_position_embeddings", 131_072)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_bias=bool(cfg.get("attention_bias", False)), qk_norm=True,
        bos_token_id=cfg.get("bos_token_id", 2),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        name=name, extra={"rope_scaling": scaling, "local_rope_scaling": local_scaling},
        sliding_window=int(window or 0), sliding_layers=tuple(t == SLIDING for t in types),
        local_rope_theta=local_theta, query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=float(cap or 0.0), embed_scale=math.sqrt(hidden), hidden_act="gelu_tanh",
    )


def gemma3_gguf_config(fields: dict, base: ModelConfig) -> ModelConfig:
    """A gemma3 GGUF's config from llama.cpp's keys, on top of the common ones (`base`). As llama.cpp:
    every 6th layer global (or `attention.sliding_window_pattern` when the file has it), the
    sliding layers' RoPE base 10000 (or `rope.freq_base_swa`), no sliding layer without
    `attention.sliding_window`, the score scale 1 / sqrt(head_dim) except for the 27B (62 layers:
    hidden / heads), and no Q/K permutation (NEOX RoPE)."""
    from dataclasses import replace
    g = lambda key, default=None: fields.get(f"gemma3.{key}", default)  # noqa: E731
    n = base.num_layers
    pattern = g("attention.sliding_window_pattern")
    if pattern is None or isinstance(pattern, (int, np.integer)):
        p = int(pattern or 6)
        sliding = tuple(bool((i + 1) % p) for i in range(n))
    else:                                   # a per-layer bool array
        sliding = tuple(bool(x) for x in pattern)
    window = int(g("attention.sliding_window", 0) or 0)
    if not window:                          # llama.cpp: no window, no sliding layers (all global RoPE)
        sliding = ()
    scalar = base.hidden_size / base.num_heads if n == 62 else base.head_dim
    cap = g("final_logit_softcapping")
    return replace(base, rope_interleaved=False, qk_norm=True, attention_bias=False,
                   sliding_window=window, sliding_layers=sliding,
                   local_rope_theta=float(g("rope.freq_base_swa", 10_000.0)), query_pre_attn_scalar=float(scalar),
                   final_logit_softcapping=float(cap or 0.0), embed_scale=math.sqrt(base.hidden_size),
                   hidden_act="gelu_tanh", extra={**base.extra, "local_rope_scaling": None})


# ---------------------------------------------------------------------------------- weights

def gemma3_weight_stream(config: ModelConfig, get: Callable[[str], np.ndarray], has: Callable[[str], bool]):
    """Canonical (name, array) pairs of a Hugging Face Gemma 3 checkpoint; every norm as 1 + w
    (float64, so a float64 backend gets it exactly). Text weights under model. (Gemma3ForCausalLM),
    model.language_model. (transformers 5's Gemma3ForConditionalGeneration) or
    language_model.model. (transformers 4's)."""
    root = next((r for r in ("model.", "model.language_model.", "language_model.model.")
                 if has(r + "embed_tokens.weight")), None)
    if root is None:
        raise ValueError("no Gemma 3 embed_tokens.weight under model., model.language_model. or language_model.model.")

    def norm(key: str) -> np.ndarray:
        return get(key).astype(np.float64) + 1.0

    yield "embed", get(root + "embed_tokens.weight")
    for i in range(config.num_layers):
        p, a, o = f"{root}layers.{i}.", f"{root}layers.{i}.self_attn.", f"layers.{i}."
        yield o + "attn_norm", norm(p + "input_layernorm.weight")
        yield o + "qkv", np.concatenate([get(a + f"{x}_proj.weight") for x in "qkv"])
        if has(a + "q_proj.bias"):
            yield o + "qkv_bias", np.concatenate([get(a + f"{x}_proj.bias") for x in "qkv"])
        yield o + "q_norm", norm(a + "q_norm.weight")
        yield o + "k_norm", norm(a + "k_norm.weight")
        yield o + "o", get(a + "o_proj.weight")
        yield o + "post_attn_norm", norm(p + "post_attention_layernorm.weight")
        yield o + "mlp_norm", norm(p + "pre_feedforward_layernorm.weight")
        yield o + "gate_up", np.concatenate([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        yield o + "down", get(p + "mlp.down_proj.weight")
        yield o + "post_mlp_norm", norm(p + "post_feedforward_layernorm.weight")
    yield "final_norm", norm(root + "norm.weight")
    if not config.tie_word_embeddings:
        yield "lm_head", get("lm_head.weight")


def random_gemma3_weights(config: ModelConfig, seed: int = 0):
    """Llama's random weights plus the two post norms of each layer (around 1, as stored)."""
    from metrale.models.checkpoint import random_weights
    rng = np.random.default_rng(seed + 1)
    for name, a in random_weights(config, seed):
        yield name, a
        if name.endswith(".o"):
            yield name[:-1] + "post_attn_norm", 1.0 + 0.1 * rng.standard_normal(config.hidden_size, dtype=np.float32)
        elif name.endswith(".down"):
            yield name[:-4] + "post_mlp_norm", 1.0 + 0.1 * rng.standard_normal(config.hidden_size, dtype=np.float32)


# ---------------------------------------------------------------------------------- forward

def local_rope(config: ModelConfig):
    """The RoPE of a sliding layer (Gemma 3's local base; without one, the model's RoPE)."""
    from metrale.models.rope import model_rope
    if not config.local_rope_theta:
        return model_rope(config)
    return build_rope(config.head_dim, config.local_rope_theta,
                      check_rope_scaling((config.extra or {}).get("local_rope_scaling")), config.max_position)


class GemmaOps(Ops, Protocol):
    """The ops gemma3_forward adds to models/llama.py's (NumPy: GemmaNumpyOps)."""
    def embed_scaled(self, weight: Tensor, scale: float) -> Tensor: ...
    def norm_residual(self, x: Tensor, norm_weight: Tensor, residual: Tensor) -> Tensor: ...   # res + norm(x)
    def gelu_tanh_mul(self, gate_up: Tensor) -> Tensor: ...
    def softcap(self, x: Tensor, cap: float) -> Tensor: ...


def gemma3_forward(ops: GemmaOps, w: dict, config: ModelConfig, num_layers: int | None = None,
                   return_hidden: bool = False):
    """Gemma 3's decoder over the batch bound to `ops` (the Ops of models/llama.py plus
    GemmaNumpyOps'); returns logits [R, vocab] (and with return_hidden the rows before the final norm)."""
    residual = ops.embed_scaled(w["embed"], config.embed_scale)
    for i in range(config.num_layers if num_layers is None else num_layers):
        p = f"layers.{i}."
        q = ops.norm_qkv_to_cache(residual, w[p + "attn_norm"], w[p + "qkv"], w.get(p + "qkv_bias"), i,
                                  w[p + "q_norm"], w[p + "k_norm"])
        residual = ops.norm_residual(ops.linear(ops.attention(q, i), w[p + "o"]), w[p + "post_attn_norm"], residual)
        h = ops.gelu_tanh_mul(ops.norm_linear(residual, w[p + "mlp_norm"], w[p + "gate_up"]))
        residual = ops.norm_residual(ops.linear(h, w[p + "down"]), w[p + "post_mlp_norm"], residual)
    rows = ops.logits_rows(residual)
    logits = ops.norm_linear(rows, w["final_norm"], w.get("lm_head", w["embed"]))
    if config.final_logit_softcapping:
        logits = ops.softcap(logits, config.final_logit_softcapping)
    return (logits, rows) if return_hidden else logits


class GemmaNumpyOps:
    """The ops gemma3_forward adds to NumpyOps, and its per-layer-type RoPE and score scale."""

    def __init__(self, backend, batch):
        super().__init__(backend, batch)
        c = self.cfg
        self._local = local_rope(c).cos_sin(batch.positions) if any(c.sliding_layers) else None
        # attend() scales scores by head_dim ** -0.5; Gemma's are query_pre_attn_scalar ** -0.5
        self._q_scale = math.sqrt(c.head_dim / c.query_pre_attn_scalar) if c.query_pre_attn_scalar else 1.0
        self._layer = 0

    def embed_scaled(self, weight, scale: float):
        return self.embed(weight) * np.asarray(scale, weight.dtype)

    def norm_residual(self, x, norm_weight, residual):
        return residual + self.rms_norm(x, norm_weight)

    def gelu_tanh_mul(self, gate_up):
        f = gate_up.shape[-1] // 2
        g = gate_up[:, :f]
        return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g * g * g))) * gate_up[:, f:]

    def softcap(self, x, cap: float):
        return np.tanh(x / cap) * cap

    def qkv_to_cache(self, qkv, layer, q_norm, k_norm):
        self._layer = layer                          # split_qkv picks the layer type's RoPE
        q = super().qkv_to_cache(qkv, layer, q_norm, k_norm)
        return q * self._q_scale if self._q_scale != 1.0 else q

    def split_qkv(self, qkv, q_norm, k_norm):
        from metrale.runtime.numpy_backend import apply_rope
        c, T = self.cfg, qkv.shape[0]
        q = qkv[:, :c.q_size].reshape(T, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size:c.q_size + c.kv_size].reshape(T, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size:].reshape(T, c.num_kv_heads, c.head_dim)
        q, k = self.rms_norm(q, q_norm), self.rms_norm(k, k_norm)
        sliding = bool(c.sliding_layers) and c.sliding_layers[self._layer]
        cos, sin = self._local if sliding else self.b.rope_for(self.batch)
        return apply_rope(q, cos, sin, c.rope_interleaved), apply_rope(k, cos, sin, c.rope_interleaved), v


FAMILY = Family(
    name="gemma3",
    matches=lambda c: c.architecture == "gemma3",
    forward=gemma3_forward,
    caches=(KV,),
    random_weights=random_gemma3_weights,
    numpy_ops=(GemmaNumpyOps,),
    cuda="metrale.runtime.cuda_gemma:GemmaCuda",
)
