"""The Llama/Qwen-family decoder forward, written once against the Ops interface.

Each backend supplies Ops bound to one ForwardBatch (ops.begin(batch) uploads its metadata);
the model never sees devices, streams or KV layouts. Dense Llama, Qwen2 (qkv bias) and Qwen3
(per-head q/k norm) share this code path.
"""
from __future__ import annotations

from typing import Any, Protocol

from metrale.models.config import ModelConfig

Tensor = Any  # an ndarray on the host or a device array; only the backend's Ops look inside


class Ops(Protocol):
    def embed(self, weight: Tensor) -> Tensor: ...
    def add_rms_norm(self, x: Tensor, residual: Tensor | None, weight: Tensor) -> tuple[Tensor, Tensor]: ...
    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor: ...
    def qkv_to_cache(self, qkv: Tensor, layer: int, q_norm: Tensor | None, k_norm: Tensor | None) -> Tensor: ...
    def attention(self, q: Tensor, layer: int) -> Tensor: ...
    def silu_mul(self, gate_up: Tensor) -> Tensor: ...
    def logits_rows(self, x: Tensor) -> Tensor: ...


def llama_forward(ops: Ops, w: dict[str, Tensor], config: ModelConfig) -> Tensor:
    """Runs the batch bound to `ops`; returns the final-normed hidden rows that need logits,
    projected by the LM head: [R, vocab]."""
    x = ops.embed(w["embed"])
    residual = None
    for i in range(config.num_layers):
        p = f"layers.{i}."
        h, residual = ops.add_rms_norm(x, residual, w[p + "attn_norm"])
        qkv = ops.linear(h, w[p + "qkv"], w.get(p + "qkv_bias"))
        q = ops.qkv_to_cache(qkv, i, w.get(p + "q_norm"), w.get(p + "k_norm"))
        x = ops.linear(ops.attention(q, i), w[p + "o"])
        h, residual = ops.add_rms_norm(x, residual, w[p + "mlp_norm"])
        x = ops.linear(ops.silu_mul(ops.linear(h, w[p + "gate_up"])), w[p + "down"])
    h, _ = ops.add_rms_norm(x, residual, w["final_norm"])
    return ops.linear(ops.logits_rows(h), w.get("lm_head", w["embed"]))
