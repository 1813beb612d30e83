"""The MoE router's NumPy reference and its settings (RouteConfig), apart from the CUDA kernels of
kernels_numba/moe.py (which re-exports them) so that the host side (metrale/models/moe.py) reads them
without importing numba.cuda (~40 MB resident on a CPU-only process)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RouteConfig:
    num_experts: int
    top_k: int
    scoring: str = "softmax"          # softmax | sigmoid
    method: str = "greedy"            # greedy | group_limited_greedy | noaux_tc
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"moe: scoring '{self.scoring}' (valid: softmax, sigmoid)")
        if self.method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"moe: topk_method '{self.method}' (valid: greedy, group_limited_greedy, noaux_tc)")
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group or self.n_group > 64:
            raise ValueError(f"moe: {self.num_experts} experts, n_group {self.n_group}, topk_group {self.topk_group}")
        if self.grouped and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"moe: top_k {self.top_k} exceeds the experts of {self.topk_group} groups")
        if self.method == "noaux_tc" and self.grouped and self.num_experts // self.n_group < 2:
            raise ValueError("moe: noaux_tc group scores need at least 2 experts per group")

    @property
    def grouped(self) -> bool:
        return self.method != "greedy" and self.n_group > 1


def route_ref(logits, cfg: RouteConfig, bias=None) -> tuple[np.ndarray, np.ndarray]:
    """(topk_ids int32 [T, K], topk_weights float64 [T, K]) in descending choice order."""
    x = np.asarray(logits, np.float64)
    if cfg.scoring == "softmax":
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        scores = e / e.sum(axis=-1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-x))
    choice = scores + (np.asarray(bias, np.float64) if bias is not None else 0.0)
    t = x.shape[0]
    if cfg.grouped:
        g = choice.reshape(t, cfg.n_group, -1)
        gs = g.max(axis=-1) if cfg.method == "group_limited_greedy" else -np.sum(
            np.partition(-g, 1, axis=-1)[..., :2], axis=-1)
        keep = np.argsort(-gs, axis=-1, kind="stable")[:, :cfg.topk_group]
        mask = np.zeros((t, cfg.n_group), bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        choice = np.where(np.repeat(mask, cfg.num_experts // cfg.n_group, axis=-1), choice, -np.inf)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :cfg.top_k].astype(np.int32)
    w = np.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob and cfg.top_k > 1:
        w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
    return ids, w * cfg.routed_scaling_factor
