"""NumPy backend: the CPU runtime and the oracle of the CUDA backend, for every model family.

Arithmetic in float32 (or float64 with levers.numpy_dtype=float64 for exact comparisons). The
family value (metrale.models.families) gives the forward, the extra ops and the cache kinds; the
Ops class is chosen in one place (NumpyBackend.ops_class, or the ops_class argument).
"""
from __future__ import annotations

import numpy as np

from metrale.models.checkpoint import WeightStream
from metrale.models.config import ModelConfig
from metrale.models.quantized import QuantizedTensor, kept
from metrale.models.families import KV, LATENT, STATE, Family, compose_ops, family_for, resolve
from metrale.models.rope import model_rope
from metrale.options import StateOptions
from metrale.runtime.backend import Backend
from metrale.runtime.batch import ForwardBatch


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """x [T, H, hd]; cos/sin [T, rot/2]: the first rot dims rotate, the rest pass (partial RoPE)."""
    if 2 * cos.shape[-1] < x.shape[-1]:
        rot = 2 * cos.shape[-1]
        return np.concatenate([apply_rope(x[..., :rot], cos, sin, interleaved), x[..., rot:]], axis=-1)
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def attention_mask(positions: np.ndarray, ctx: int, window: int = 0) -> np.ndarray:
    """bool [n, ctx]: True where the query at positions[i] must not see key j (j > p, or
    j <= p - window when window > 0: transformers' sliding_window_overlay)."""
    keys, p = np.arange(ctx)[None, :], np.asarray(positions)[:, None]
    masked = keys > p
    return masked | (keys <= p - window) if window else masked


class NumpyOps:
    """The Ops of a forward (models/llama.py) as NumPy arithmetic over one batch; a family's extra
    ops are mixins composed onto it (Family.numpy_ops). `b` is the backend (or a drafter's model)
    holding weights, `kv` (cache.kinds.HostKvPages) and `rope_for`."""

    def __init__(self, backend: "NumpyBackend", batch: ForwardBatch):
        self.b, self.batch, self.cfg = backend, batch, backend.config

    def embed(self, weight: np.ndarray) -> np.ndarray:
        return weight[self.batch.token_ids]

    def dense_layers(self, residual, count: int, w: dict):
        return None          # layer by layer (CpuOps runs a dense stack in one call)

    def rms_norm(self, x, weight):
        var = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(var + self.cfg.rms_norm_eps) * weight

    def linear(self, x, weight, bias=None):
        y = x @ weight.T
        return y if bias is None else y + bias

    def linear_residual(self, x, weight, residual):
        return residual + x @ weight.T

    def norm_linear(self, x, norm_weight, weight, bias=None):
        return self.linear(self.rms_norm(x, norm_weight), weight, bias)

    def silu_mul_linear_residual(self, gate_up, weight, residual):
        return self.linear_residual(self.silu_mul(gate_up), weight, residual)

    def norm_qkv_to_cache(self, x, norm_weight, weight, bias, layer, q_norm, k_norm):
        return self.qkv_to_cache(self.norm_linear(x, norm_weight, weight, bias), layer, q_norm, k_norm)

    def mlp_residual(self, residual, norm_weight, gate_up, down):
        return self.silu_mul_linear_residual(self.norm_linear(residual, norm_weight, gate_up), down, residual)

    def attention_linear_residual(self, q, layer, weight, residual):
        return self.linear_residual(self.attention(q, layer), weight, residual)

    def split_qkv(self, qkv, q_norm, k_norm):
        """q, k (per-head norms, RoPE at the batch's positions) and v of a fused QKV projection."""
        c, T = self.cfg, qkv.shape[0]
        q = qkv[:, :c.q_size].reshape(T, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size:c.q_size + c.kv_size].reshape(T, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size:].reshape(T, c.num_kv_heads, c.head_dim)
        if q_norm is not None:
            q, k = self.rms_norm(q, q_norm), self.rms_norm(k, k_norm)
        cos, sin = self.b.rope_for(self.batch)
        return apply_rope(q, cos, sin, c.rope_interleaved), apply_rope(k, cos, sin, c.rope_interleaved), v

    def cached_kv(self, layer: int, s: int, end: int):
        """K and V of the batch's sequence s at positions [0, end), from the paged pool."""
        c, bt = self.cfg, self.batch
        blocks = bt.block_tables[s, :-(-end // bt.block_size)]
        k = self.b.kv.k[layer, blocks].reshape(-1, c.num_kv_heads, c.head_dim)[:end]
        v = self.b.kv.v[layer, blocks].reshape(-1, c.num_kv_heads, c.head_dim)[:end]
        return k, v

    def attend(self, q_rows, k, v, masked=None):
        """Softmax attention of query rows [n, Hq, hd] over keys [m, Hk, hd] (GQA); masked: a bool
        [n, m] of the scores to drop. Returns [n, Hq, hd]."""
        c, n = self.cfg, q_rows.shape[0]
        group = c.num_heads // c.num_kv_heads
        qs = q_rows.reshape(n, c.num_kv_heads, group, c.head_dim)
        scores = np.einsum("nkgd,ckd->kgnc", qs, k) * (1.0 / np.sqrt(c.head_dim))
        if masked is not None:
            scores[..., masked] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        return np.einsum("kgnc,ckd->nkgd", p, v).reshape(n, c.num_heads, c.head_dim)

    def qkv_to_cache(self, qkv, layer, q_norm, k_norm):
        c = self.cfg
        q, k, v = self.split_qkv(qkv, q_norm, k_norm)
        flat_k = self.b.kv.k[layer].reshape(-1, c.num_kv_heads, c.head_dim)
        flat_v = self.b.kv.v[layer].reshape(-1, c.num_kv_heads, c.head_dim)
        keep = self.batch.slot_mapping >= 0
        flat_k[self.batch.slot_mapping[keep]] = k[keep]
        flat_v[self.batch.slot_mapping[keep]] = v[keep]
        return q

    def attention(self, q, layer):
        """Causal attention over the cache; a sliding-window layer also drops keys at or before
        p - window (layer = the KV layer, which is the layer itself in every model with a window)."""
        c, bt = self.cfg, self.batch
        window = c.layer_window(layer)
        out = np.empty_like(q)
        for s in range(bt.num_seqs):
            a, b, ctx = bt.seq_query_start[s], bt.seq_query_start[s + 1], bt.context_lens[s]
            k, v = self.cached_kv(layer, s, ctx)
            out[a:b] = self.attend(q[a:b], k, v, attention_mask(bt.positions[a:b], ctx, window))
        return out.reshape(q.shape[0], c.q_size)

    def silu_mul(self, gate_up):
        f = gate_up.shape[-1] // 2
        g = gate_up[:, :f]
        return g / (1.0 + np.exp(-g)) * gate_up[:, f:]

    def logits_rows(self, x):
        return x[self.batch.logits_indices]


# the cache kinds this backend keeps (metrale.cache.kinds), imported on use
HOST_CACHES = {KV: "metrale.cache.kinds:HostKvPages", LATENT: "metrale.cache.kinds:HostLatentPages",
               STATE: "metrale.models.hybrid:HostStatePool"}


class NumpyBackend(Backend):
    name = "cpu"
    ops_class = NumpyOps          # the CPU Ops (or the ops_class argument); an instance holds it
                                  # composed with the family's mixins

    def __init__(self, config: ModelConfig, weights: WeightStream | dict, *, num_blocks: int,
                 block_size: int = 16, dtype: str = "float32", family: Family | None = None,
                 ops_class: type | None = None, num_state_slots: int = 8, num_state_checkpoints: int | None = None,
                 state_norm_bound: float = 0.0, mla_mode: str = "auto", ep=None):
        """num_state_*: a hybrid model's state pool (checkpoints default to one per slot; docs/hybrid.md).
        mla_mode: MLA attention per segment, auto | naive | absorbed (models/deepseek.py). ep: expert
        parallelism (metrale.parallel.ExpertParallel): this rank holds only its experts."""
        if dtype not in ("float32", "float64"):
            raise ValueError(f"levers.numpy_dtype must be float32 or float64, not '{dtype}'")
        if mla_mode not in ("auto", "naive", "absorbed"):
            raise ValueError(f"mla_mode must be auto, naive or absorbed, not '{mla_mode}'")
        self.config, self.block_size, self.num_blocks = config, block_size, num_blocks
        self.dtype, self.mla_mode, self.ep = np.dtype(dtype), mla_mode, ep
        self.family = family or family_for(config)
        self.rope = model_rope(config)
        items = weights.items() if isinstance(weights, dict) else weights
        quantized_ok = getattr(ops_class or type(self).ops_class, "reads_quantized", False)   # else GGUF blocks expand
        # GGUF blocks stay for ops that read them; they and FP8 bytes are dequantized into self.dtype otherwise
        self.weights = {name: a if quantized_ok and isinstance(a, QuantizedTensor) else
                        np.ascontiguousarray(a.dequantize() if kept(a) else a, dtype=self.dtype)
                        for name, a in items}
        if self.family.check_weights is not None:
            self.family.check_weights(config, self.weights, ep)
        self.num_state_slots = num_state_slots
        self.num_state_checkpoints = num_state_slots if num_state_checkpoints is None else num_state_checkpoints
        self.state_norm_bound = float(state_norm_bound)
        self.caches = {}
        for kind in self.family.caches:
            cls = resolve(HOST_CACHES[kind])
            self.caches[kind] = cls.allocate(self, num_blocks if cls.paged else num_state_slots)
        self.kv = next((c for c in self.caches.values() if c.paged), None)   # the cache block tables index
        self.states = self.caches.get(STATE)
        self.ops_class = compose_ops(ops_class or type(self).ops_class, self.family.numpy_ops)
        self.compute = None           # fast CPU path: cpu_ops.ComputeThread (its forwards run there)
        self._hidden: np.ndarray | None = None

    @classmethod
    def from_config(cls, cfg, config: ModelConfig, weights, family: Family, ep=None) -> "NumpyBackend":
        """The CPU backend of a composed config: cache.num_blocks (or cache.cpu_kv_tokens worth of
        blocks), a state slot per sequence that can run; `weights` a zero-argument stream factory, or
        None for the family's random weights; ep: this rank's ExpertParallel (parallel.expert > 1)."""
        from omegaconf import OmegaConf
        for kind in ("tensor", "expert"):
            n = OmegaConf.select(cfg, f"parallel.{kind}", default=1)
            if n > 1 and not (kind == "expert" and ep is not None):   # one rank a process: parallel/tp.py
                raise ValueError(f"parallel.{kind}={n}: Engine / load_model start the ranks "
                                 "(metrale.parallel.tp.local_leader); this entry point builds one unsplit backend")
        block_size = int(cfg.cache.block_size)
        num_blocks = cfg.cache.num_blocks or max(1, cfg.cache.cpu_kv_tokens // block_size)
        if weights is None and family.random_weights is None:
            raise ValueError(f"{config.name or config.architecture}: the {family.name} family has no random "
                             "weights; load a checkpoint")
        stream = weights() if weights is not None else family.random_weights(config, int(cfg.seed))
        from metrale.runtime import cpu_ops
        fast = cpu_ops.uses_cpu_kernels(cfg, family)         # levers.cpu_kernels=numba: the Numba CPU Ops
        backend = cls(config, stream, num_blocks=int(num_blocks), block_size=block_size, dtype=cfg.levers.numpy_dtype,
                      family=family, ops_class=cpu_ops.CpuOps if fast else None,
                      num_state_slots=int(cfg.scheduler.max_num_seqs), num_state_checkpoints=0,
                      state_norm_bound=StateOptions.of(cfg).norm_bound, ep=ep)
        if fast:
            cpu_ops.start(backend, cfg)
        return backend

    def rope_for(self, batch: ForwardBatch) -> tuple[np.ndarray, np.ndarray]:
        return self.rope.cos_sin(batch.positions)

    def forward(self, batch: ForwardBatch, num_layers: int | None = None, return_hidden: bool = False):
        if self.compute is not None:       # the fast CPU path: every forward on its one thread
            return self.compute(self._forward, batch, num_layers, return_hidden)
        return self._forward(batch, num_layers, return_hidden)

    def _forward(self, batch: ForwardBatch, num_layers: int | None, return_hidden: bool):
        if num_layers is not None and num_layers < self.config.num_layers and not self.family.layer_prefix:
            raise ValueError(f"a {self.family.name} model runs all its layers (a layer-prefix forward would "
                             "advance only some layers' recurrent states)")
        with np.errstate(over="ignore"):
            logits, rows = self.family.forward(self.ops_class(self, batch), self.weights, self.config, num_layers, True)
        if self.dtype == np.float32:
            logits = np.asarray(logits, np.float32)
        self._hidden = rows
        return (logits, rows) if return_hidden else logits

    def hidden_rows(self, rows: int) -> np.ndarray:
        return self._hidden[:rows]

    def idle_step(self, num_layers: int | None = None) -> None:
        if self.ep is not None:                  # the MoE mixin serves this rank's experts
            self.ops_class.serve_experts(self, num_layers)

    def memory_report(self) -> dict:
        report = {"weights_bytes": sum(a.nbytes for a in self.weights.values()), "kv_pool_bytes": 0,
                  "state_pool_bytes": 0}
        for cache in self.caches.values():
            report.update(cache.memory())
        return {**report, "kv_pool_tokens": self.num_blocks * self.block_size}
