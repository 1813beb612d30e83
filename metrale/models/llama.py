"""The Llama/Qwen-family decoder forward, written once against the Ops interface, and the dense
family value (FAMILY).

Each backend supplies Ops bound to one ForwardBatch; the model never sees devices, streams or
KV layouts. Dense Llama, Qwen2 (qkv bias), Qwen3 (per-head q/k norm), Mistral and Qwen3-MoE (a MoE
layer's MLP is ops.moe_residual, models/moe.py) share this code path, and so do hybrid models (models/hybrid.py, docs/hybrid.md): a layer whose
config.layer_types entry is "linear_attention" mixes tokens with a Gated DeltaNet
(ops.gated_delta_net) instead of paged attention; attention layers index the KV cache by their
rank among the attention layers (config.kv_layer).
Fused ops carry what a backend may fuse: the residual is updated by the o and down products
themselves (linear_residual), each RMSNorm is part of the product that reads it (norm_linear), as
silu*mul is of the down product (silu_mul_linear_residual); norm+qkv+rope+store is one call
(norm_qkv_to_cache), attention+o(+res) one (attention_linear_residual), the MLP block one
(mlp_residual). The NumPy backend runs each as its composition; the CUDA backend fuses at one
token row (levers.fuse_decode).
"""
from __future__ import annotations

from typing import Any, Protocol

from metrale.models.checkpoint import random_weights
from metrale.models.config import ModelConfig
from metrale.models.families import KV, Family

Tensor = Any  # an ndarray on the host or a device array; only the backend's Ops look inside


class Ops(Protocol):
    def embed(self, weight: Tensor) -> Tensor: ...
    # the first `count` layers at once where the backend can (all plain dense layers), else None
    def dense_layers(self, residual: Tensor, count: int, w: dict[str, Tensor]) -> Tensor | None: ...
    def rms_norm(self, x: Tensor, weight: Tensor) -> Tensor: ...
    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor: ...
    def linear_residual(self, x: Tensor, weight: Tensor, residual: Tensor) -> Tensor: ...
    def qkv_to_cache(self, qkv: Tensor, layer: int, q_norm: Tensor | None, k_norm: Tensor | None) -> Tensor: ...
    # fused: qkv_to_cache(norm_linear(x, norm_weight, weight, bias), layer, q_norm, k_norm)
    def norm_qkv_to_cache(self, x: Tensor, norm_weight: Tensor, weight: Tensor, bias: Tensor | None, layer: int,
                          q_norm: Tensor | None, k_norm: Tensor | None) -> Tensor: ...
    def attention(self, q: Tensor, layer: int) -> Tensor: ...
    def silu_mul(self, gate_up: Tensor) -> Tensor: ...
    # fused: linear(rms_norm(x, norm_weight), weight, bias); linear_residual(silu_mul(gate_up), weight, residual)
    def norm_linear(self, x: Tensor, norm_weight: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor: ...
    def silu_mul_linear_residual(self, gate_up: Tensor, weight: Tensor, residual: Tensor) -> Tensor: ...
    # fused: linear_residual(attention(q, layer), weight, residual)
    def attention_linear_residual(self, q: Tensor, layer: int, weight: Tensor, residual: Tensor) -> Tensor: ...
    # fused: silu_mul_linear_residual(norm_linear(residual, norm_weight, gate_up), down, residual)
    def mlp_residual(self, residual: Tensor, norm_weight: Tensor, gate_up: Tensor, down: Tensor) -> Tensor: ...
    def logits_rows(self, x: Tensor) -> Tensor: ...
    # hybrid models only (models/hybrid.py: GdnNumpyOps; runtime/cuda_hybrid.py: GdnCudaOps)
    def sigmoid_mul(self, x: Tensor, gate: Tensor) -> Tensor: ...
    def gated_delta_net(self, proj: Tensor, layer: int, conv: Tensor, a_log: Tensor, dt_bias: Tensor,
                        norm: Tensor) -> Tensor: ...
    # MoE layers only (models/moe.py: MoeNumpyOps): residual + the routed and shared experts of h
    def moe_residual(self, h: Tensor, layer: int, w: dict, prefix: str, residual: Tensor) -> Tensor: ...


def llama_forward(ops: Ops, w: dict[str, Tensor], config: ModelConfig, num_layers: int | None = None,
                  return_hidden: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Runs the batch bound to `ops`; returns logits [R, vocab] for the rows that need them
    (and, with return_hidden, those rows' last hidden states before the final norm: what MTP
    heads read). num_layers < config.num_layers runs the first layers only, then the final norm
    and LM head: the self-speculative (layer-skip) drafter."""
    residual = ops.embed(w["embed"])
    count = config.num_layers if num_layers is None else num_layers
    fused = ops.dense_layers(residual, count, w)
    if fused is not None:
        residual, count = fused, 0
    for i in range(count):
        p = f"layers.{i}."
        norm = w[p + "attn_norm"]
        if config.is_linear_layer(i):
            mixed = ops.gated_delta_net(ops.norm_linear(residual, norm, w[p + "lin_in"]), config.state_layer(i),
                                        w[p + "lin_conv"], w[p + "lin_a_log"], w[p + "lin_dt_bias"], w[p + "lin_norm"])
        else:
            kv = config.kv_layer(i)
            q = ops.norm_qkv_to_cache(residual, norm, w[p + "qkv"], w.get(p + "qkv_bias"), kv,
                                      w.get(p + "q_norm"), w.get(p + "k_norm"))
            if p + "attn_gate" not in w:
                residual = ops.attention_linear_residual(q, kv, w[p + "o"], residual)
                mixed = None
            else:                      # the residual is unchanged since the qkv product: same norm
                mixed = ops.sigmoid_mul(ops.attention(q, kv), ops.norm_linear(residual, norm, w[p + "attn_gate"]))
        if mixed is not None:
            residual = ops.linear_residual(mixed, w[p + "o"], residual)
        if config.is_moe_layer(i):     # Qwen3-MoE / Qwen3-Next MoE layers (models/moe.py)
            residual = ops.moe_residual(ops.rms_norm(residual, w[p + "mlp_norm"]), i, w, p, residual)
        else:
            residual = ops.mlp_residual(residual, w[p + "mlp_norm"], w[p + "gate_up"], w[p + "down"])
    rows = ops.logits_rows(residual)
    logits = ops.norm_linear(rows, w["final_norm"], w.get("lm_head", w["embed"]))
    return (logits, rows) if return_hidden else logits


FAMILY = Family(
    name="dense",
    matches=lambda c: not (c.is_mla or c.is_hybrid or c.is_moe),
    forward=llama_forward,
    caches=(KV,),
    random_weights=random_weights,
    cuda="metrale.runtime.cuda_dense:DenseCuda",
)
