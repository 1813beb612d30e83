"""Mixture-of-experts MLP layers without MLA: the Qwen3-MoE family value (FAMILY: the Llama /
Qwen3 attention of models/llama.py, some layers' MLP a routed MoE block), the NumPy MoE ops every
MoE family composes (MoeNumpyOps; DeepSeek's MlaNumpyOps and the hybrid MoE family reuse them),
and reading Qwen-style MoE keys and tensors.

A MoE layer (config.is_moe_layer(i)): router logits h @ router.T, routing by metrale's one router
(kernels_numba.moe_ref.route_ref: Qwen's softmax + top-k, optionally renormalized, is DeepSeek-V2's
`greedy`), the top-k SwiGLU experts' outputs weighted and summed, plus the shared expert(s):
DeepSeek adds them as they are; Qwen2-MoE / Qwen3-Next scale their one shared expert by
sigmoid(h @ shared_gate.T) (config.shared_expert_gate).
Canonical names of a MoE layer's MLP: layers.{i}.router [E, D], .experts_gate_up [E', 2F, D],
.experts_down [E', D, F], optional .router_bias [E] (noaux_tc), .shared_gate_up, .shared_down,
.shared_gate [1, D].
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from kernels_numba.moe_ref import RouteConfig, route_ref
from metrale.models.config import ModelConfig
from metrale.models.families import KV, Family
from metrale.models.llama import llama_forward
from metrale.parallel.ep import combine_slots

QWEN_MOE_TYPES = ("qwen3_moe",)


# ------------------------------------------------------------------------------- NumPy experts

def expert_mlp(rows: np.ndarray, local_ids: np.ndarray, w_gate_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """Unweighted SwiGLU expert outputs [N, D] of rows [N, D], row i through expert local_ids[i]
    (indices into the stacked w_gate_up [E', 2F, D] / w_down [E', D, F])."""
    out = np.zeros((rows.shape[0], w_down.shape[1]), rows.dtype)
    if rows.shape[0] == 0:
        return out
    order = np.argsort(local_ids, kind="stable")
    counts = np.bincount(local_ids, minlength=w_gate_up.shape[0])
    start = 0
    for e, n in enumerate(counts):
        if n:
            idx = order[start:start + n]
            h = rows[idx] @ w_gate_up[e].T
            f = h.shape[1] // 2
            out[idx] = (h[:, :f] / (1.0 + np.exp(-h[:, :f])) * h[:, f:]) @ w_down[e].T
            start += n
    return out


def local_experts(x: np.ndarray, topk_ids: np.ndarray, topk_weights: np.ndarray,
                  w_gate_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """Routed MoE output [T, D] with every expert on this process."""
    k = topk_ids.shape[1]
    rows = np.repeat(x, k, axis=0)
    return combine_slots(expert_mlp(rows, topk_ids.reshape(-1), w_gate_up, w_down), topk_weights)


def route_config(config: ModelConfig) -> RouteConfig:
    return RouteConfig(config.n_routed_experts, config.num_experts_per_tok, config.scoring_func,
                       config.topk_method, config.n_group, config.topk_group, config.norm_topk_prob,
                       config.routed_scaling_factor)


class MoeNumpyOps:
    """The MoE block as a NumpyOps mixin: local experts, or the ranks' through the backend's `ep`."""

    def moe_residual(self, h, layer, w, p, residual):
        """residual + routed experts (local or expert-parallel) + shared experts of one MoE layer."""
        logits = h @ w[p + "router"].T
        ids, weights = route_ref(logits, route_config(self.cfg), w.get(p + "router_bias"))
        weights = weights.astype(h.dtype)
        gu, down = w[p + "experts_gate_up"], w[p + "experts_down"]
        if self.b.ep is None:
            out = local_experts(h, ids, weights, gu, down)
        elif self.b.ep.replicated:          # every rank runs this batch: its experts' share, all-reduced
            out = self.b.ep.reduce_local(h, ids, weights, lambda rows, local: expert_mlp(rows, local, gu, down))
        else:
            out = self.b.ep.dispatch_combine(h, ids, weights, lambda rows, local: expert_mlp(rows, local, gu, down))
        if p + "shared_gate_up" in w:
            sg = h @ w[p + "shared_gate_up"].T
            f = sg.shape[1] // 2
            shared = (sg[:, :f] / (1.0 + np.exp(-sg[:, :f])) * sg[:, f:]) @ w[p + "shared_down"].T
            if p + "shared_gate" in w:           # Qwen: sigmoid(h @ gate) scales the shared expert
                shared = shared / (1.0 + np.exp(-(h @ w[p + "shared_gate"].T)))
            out = out + shared
        return residual + out

    @staticmethod
    def serve_experts(backend, num_layers: int | None = None) -> None:
        """Backend.idle_step of an expert-parallel rank without tokens: its experts serve the other
        ranks' rows in every MoE layer (the collectives of a step must be entered by every rank)."""
        c = backend.config
        d, k = c.hidden_size, c.num_experts_per_tok
        for i in range(c.num_layers if num_layers is None else num_layers):
            if c.is_moe_layer(i):
                p = f"layers.{i}."
                gu, down = backend.weights[p + "experts_gate_up"], backend.weights[p + "experts_down"]
                backend.ep.dispatch_combine(np.zeros((0, d), backend.dtype), np.zeros((0, k), np.int32),
                                            np.zeros((0, k), backend.dtype),
                                            lambda rows, local, gu=gu, down=down: expert_mlp(rows, local, gu, down))


def check_expert_weights(config: ModelConfig, weights: dict, ep) -> None:
    """Each MoE layer holds the experts of this rank (all of them without expert parallelism)."""
    local = config.n_routed_experts if ep is None else ep.num_local
    for i in range(config.num_layers):
        gu = weights.get(f"layers.{i}.experts_gate_up")
        if config.is_moe_layer(i) and (gu is None or gu.shape[0] != local):
            have = None if gu is None else gu.shape[0]
            raise ValueError(f"layer {i}: {have} experts loaded, this rank needs {local}")


# ------------------------------------------------------------------------ Qwen-style MoE keys

def qwen_moe_fields(cfg: dict, n: int, arch: str) -> dict:
    """The ModelConfig MoE fields of a Qwen3-MoE / Qwen3-Next config.json: layer i is MoE when
    num_experts > 0, i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (as
    transformers builds the layers); routing softmax top-k, renormalized with norm_topk_prob
    (transformers' defaults: Qwen3-MoE False, Qwen3-Next True); Qwen3-Next's shared expert is
    sigmoid-gated. Empty when the model has no MoE layer."""
    # transformers 5 writes num_local_experts (its attribute_map name), older files num_experts
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
    mlp_only, step = set(cfg.get("mlp_only_layers") or []), int(cfg.get("decoder_sparse_step", 1) or 1)
    layers = tuple(experts > 0 and i not in mlp_only and (i + 1) % step == 0 for i in range(n))
    if not any(layers):
        return {}
    shared = int(cfg.get("shared_expert_intermediate_size", 0) or 0)
    return dict(n_routed_experts=experts, num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]), moe_layers=layers,
                n_shared_experts=1 if shared else 0, shared_intermediate_size=shared, shared_expert_gate=bool(shared),
                scoring_func="softmax", topk_method="greedy",
                norm_topk_prob=bool(cfg.get("norm_topk_prob", arch == "qwen3_next")))


def qwen_moe_stream(config: ModelConfig, i: int, get: Callable[[str], np.ndarray], has: Callable[[str], bool]):
    """Canonical tensors of MoE layer i's MLP from a Qwen checkpoint: per-expert
    mlp.experts.{e}.{gate,up,down}_proj (what save_pretrained writes) or the fused
    mlp.experts.gate_up_proj [E, 2F, D] / down_proj [E, D, F] of transformers 5's modules."""
    p, o = f"model.layers.{i}.mlp.", f"layers.{i}."
    yield o + "router", get(p + "gate.weight")
    if has(p + "experts.gate_up_proj"):
        yield o + "experts_gate_up", get(p + "experts.gate_up_proj")
        yield o + "experts_down", get(p + "experts.down_proj")
    else:
        e_range = range(config.n_routed_experts)
        yield o + "experts_gate_up", np.stack([np.concatenate([get(p + f"experts.{e}.gate_proj.weight"),
                                                               get(p + f"experts.{e}.up_proj.weight")]) for e in e_range])
        yield o + "experts_down", np.stack([get(p + f"experts.{e}.down_proj.weight") for e in e_range])
    if has(p + "shared_expert.gate_proj.weight"):
        s = p + "shared_expert."
        yield o + "shared_gate_up", np.concatenate([get(s + "gate_proj.weight"), get(s + "up_proj.weight")])
        yield o + "shared_down", get(s + "down_proj.weight")
        if has(p + "shared_expert_gate.weight"):
            yield o + "shared_gate", get(p + "shared_expert_gate.weight")


FAMILY = Family(
    name="moe",
    matches=lambda c: c.is_moe and not (c.is_mla or c.is_hybrid),
    forward=llama_forward,
    caches=(KV,),
    numpy_ops=(MoeNumpyOps,),
    cuda="metrale.runtime.cuda_moe:MoeCuda",
    check_weights=check_expert_weights,
)
