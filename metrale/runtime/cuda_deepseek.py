"""The DeepSeek-V2/V3 family (MLA + MoE) on the CUDA backend: its part (MlaCuda: weight layout,
buffers, the expert-parallel exchange) and its ops (MlaCudaOps, a CudaOps mixin: mla_attention,
moe_residual). Its LATENT cache kind is runtime/cuda/pages.py's DeviceLatentPages.

MLA per layer (absorbed form for every row, decode and prefill alike):
  q = q_b(rmsnorm(q_a(h)))  or q(h)              [T, H, nope + rope]
  kv = kv_a(h)                                   [T, r + rope] = c | k_pe
  c_kv = rmsnorm(kv[:, :r]); RoPE (interleaved pairs, YaRN tables x mscale) on q's and kv's rope
  slices in one launch; store_latent(c_kv, k_pe) into the paged bf16 latent cache
  q_abs = [W_UK^T q_nope | q_pe] (head_linear)   [T, H, r + rope]
  mla_decode over the latent rows (positions 0..pos of the token's segment: a prefill chunk reads
  the earlier chunks' latents from the cache), out_lat [T, H, r]; out = W_UV out_lat (head_linear)
kv_b is split at load into w_uk_t [H, r, nope] (W_UK transposed per head) and w_uv [H, v, r].

MoE per layer: router GEMM (rows padded to a multiple of 64 at load; the logits view keeps the
first E columns), `moe.route`, `moe.moe_experts` (permutation + grouped GEMMs + weighted
un-permutation added into the residual), shared experts as a dense SwiGLU added into the
residual. With expert parallelism (CudaBackend(ep=...), metrale.parallel.ExpertParallel over an
Nccl4pyCommunicator) the routed part exchanges token rows with the other ranks (host sync for the
counts: eager only, the backend turns CUDA graphs off).

CUDA graphs: every launch reads fixed buffers; mla_decode's split is fixed by the geometry's
max_context (the graph's context bucket) and the MoE GEMM grids by the schedule capacity of T*K
slots, so a captured decode step replays for any routing and any context up to its bucket.
"""
from __future__ import annotations

import numpy as np

from kernels_numba import argmax, mla, rmsnorm
from kernels_numba.bf16 import to_bf16_bits
from kernels_numba.rope import rope_inplace
from metrale.models.config import ModelConfig
from metrale.models.deepseek import deepseek_softmax_scale
from metrale.runtime.cuda_dense import CudaPart
from metrale.runtime.cuda_moe import (MoeCudaOps, MoeParallel, moe_layer_layout, moe_plan, moe_workspace,  # noqa: F401
                                      pad_router, padded, shared_size)


# ------------------------------------------------------------------------------- weights

def prepare_weights(items, config: ModelConfig):
    """Canonical DeepSeek weights (float host arrays) -> the CUDA layout: matrices and stacked
    experts as bf16 bits, vectors float32, kv_b split per head into w_uk_t [H, r, nope] and
    w_uv [H, v, r], the router zero-padded to a multiple of 64 rows."""
    c = config
    h, nope, v, r = c.num_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
    for name, a in items:
        a = np.asarray(a, np.float32)
        if name.endswith(".kv_b"):
            w = a.reshape(h, nope + v, r)
            yield name[:-len("kv_b")] + "w_uk_t", to_bf16_bits(np.ascontiguousarray(w[:, :nope].transpose(0, 2, 1)))
            yield name[:-len("kv_b")] + "w_uv", to_bf16_bits(np.ascontiguousarray(w[:, nope:]))
        elif name.endswith(".router"):
            yield name, pad_router(a)
        elif a.ndim >= 2:
            yield name, to_bf16_bits(a)
        else:
            yield name, np.ascontiguousarray(a)


def random_weight_shapes(config: ModelConfig, num_local_experts: int | None = None) -> dict[str, tuple]:
    """name -> (shape, init) of a random DeepSeek model in the CUDA layout (CudaPart.random_layout:
    'norm' a norm vector ~ 1, 'bias' the router's correction bias, a float the std of a matrix)."""
    c = config
    d, h, nope, rope, r, v = c.hidden_size, c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.v_head_dim
    e = c.n_routed_experts if num_local_experts is None else num_local_experts
    out: dict[str, tuple] = {"embed": ((c.vocab_size, d), 0.5)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        out[p + "attn_norm"] = ((d,), "norm")
        if c.q_lora_rank:
            out[p + "q_a"] = ((c.q_lora_rank, d), d ** -0.5)
            out[p + "q_a_norm"] = ((c.q_lora_rank,), "norm")
            out[p + "q_b"] = ((h * (nope + rope), c.q_lora_rank), c.q_lora_rank ** -0.5)
        else:
            out[p + "q"] = ((h * (nope + rope), d), d ** -0.5)
        out[p + "kv_a"] = ((r + rope, d), d ** -0.5)
        out[p + "kv_a_norm"] = ((r,), "norm")
        out[p + "w_uk_t"] = ((h, r, nope), r ** -0.5)
        out[p + "w_uv"] = ((h, v, r), r ** -0.5)
        out[p + "o"] = ((d, h * v), (h * v) ** -0.5)
        out[p + "mlp_norm"] = ((d,), "norm")
        if c.is_moe_layer(i):
            out.update(moe_layer_layout(c, p, e))
        else:
            out[p + "gate_up"] = ((2 * c.intermediate_size, d), d ** -0.5)
            out[p + "down"] = ((d, c.intermediate_size), c.intermediate_size ** -0.5)
    out["final_norm"] = ((d,), "norm")
    if not c.tie_word_embeddings:
        out["lm_head"] = ((c.vocab_size, d), d ** -0.5)
    return out


# ------------------------------------------------------------------------------- ops

class MlaCudaOps(MoeCudaOps):
    """CudaOps mixin: mla_attention over the latent pages (`b.kv`), and MoeCudaOps' moe_residual
    (the part `b.part` holds the routing and the MoE workspace)."""

    def mla_attention(self, h, layer, w, p):
        c, b, s, T = self.cfg, self.b, self.s, self.g.tokens
        H, nope, rope, r, v = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.v_head_dim
        eps = c.rms_norm_eps
        if c.q_lora_rank:
            qa = self._product(h, w[p + "q_a"], self._buf("ds_q_a"))
            qan = self._buf("ds_q_a_n")
            rmsnorm.rms_norm(qa, w[p + "q_a_norm"], eps, qan, stream=s)
            q = self._product(qan, w[p + "q_b"], self._buf("ds_q"))
        else:
            q = self._product(h, w[p + "q"], self._buf("ds_q"))
        kv = self._product(h, w[p + "kv_a"], self._buf("ds_kv"))
        c_kv = self._buf("ds_c_kv")
        rmsnorm.rms_norm(kv[:, :r], w[p + "kv_a_norm"], eps, c_kv, stream=s)
        q3 = q.reshape(T, H, nope + rope)
        kv3 = kv.reshape(T, 1, r + rope)
        rope_inplace(q3[:, :, nope:], kv3[:, :, r:], self.positions, b.cos, b.sin, True, stream=s)
        mla.store_latent(c_kv, kv[:, r:], self.slot_mapping, b.kv.latent[layer], stream=s)
        q_abs = self._buf("ds_q_abs")
        mla.head_linear(q3[:, :, :nope], w[p + "w_uk_t"], q_abs[:, :, :r], stream=s)
        mla.copy_heads(q3[:, :, nope:], q_abs[:, :, r:], stream=s)
        lat = self._buf("ds_lat")
        mla.mla_decode(q_abs, b.kv.latent32[layer], self.block_tables, self.token_seq, self.positions,
                       b.part.softmax_scale, lat, scratch=b.attn_scratch, max_context=self.g.max_context, stream=s)
        out = self._buf("ds_attn")
        mla.head_linear(lat, w[p + "w_uv"], out.reshape(T, H, v), stream=s)
        return out


# ------------------------------------------------------------------------------- the part

def activation_plan(config: ModelConfig, max_tokens: int, max_rows: int, max_model_len: int,
                    num_local_experts: int, ep_world: int = 0) -> dict[str, tuple[tuple[int, ...], type]]:
    """Buffers of one DeepSeek step (float32 unless said), sized for max_tokens rows: the Llama
    ops' own (residual, h, rows, the dense MLP, logits) and the MLA/MoE ones (ds_*, moe_*; ep_*
    with expert parallelism over ep_world ranks, 0 = none)."""
    c, T, R = config, max_tokens, max_rows
    d, H, nope, rope, r, v = c.hidden_size, c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.v_head_dim
    f32, i32 = np.float32, np.int32
    plan = {"residual": ((T, d), f32), "h": ((T, d), f32), "rows": ((R, d), f32), "normed_rows": ((R, d), f32),
            "argmax": ((R,), i32), "argmax_work": ((argmax.argmax_work_size(R),), np.uint64), "act": ((T, c.intermediate_size), f32),
            "ds_q": ((T, H * (nope + rope)), f32), "ds_kv": ((T, r + rope), f32), "ds_c_kv": ((T, r), f32),
            "ds_q_abs": ((T, H, r + rope), f32), "ds_lat": ((T, H, r), f32), "ds_attn": ((T, H * v), f32),
            "cos": ((max_model_len, rope // 2), f32), "sin": ((max_model_len, rope // 2), f32)}
    for n, rows in ((2 * c.intermediate_size, T), (c.vocab_size, R)):   # CudaOps.linear's out{N}
        key = f"out{n}"
        plan[key] = ((max(rows, plan[key][0][0]) if key in plan else rows, n), f32)
    if c.q_lora_rank:
        plan["ds_q_a"] = ((T, c.q_lora_rank), f32)
        plan["ds_q_a_n"] = ((T, c.q_lora_rank), f32)
    plan["attn_scratch"] = (mla.mla_scratch_shape(T, H, r + rope, r, max_model_len), f32)
    if c.is_moe:
        plan.update(moe_plan(c, T, num_local_experts, ep_world))
    return plan


def blas_widest(config: ModelConfig) -> int:
    """The widest K of the products that may go through cuBLASLt (its bf16 staging buffer)."""
    c = config
    ks = [c.hidden_size, c.intermediate_size, c.num_heads * c.v_head_dim, c.q_lora_rank or 0]
    if c.is_moe:
        ks.append(shared_size(c))
    return max(ks)


class MlaCuda(MoeParallel, CudaPart):
    """The MLA family's answers to the CUDA backend; with expert parallelism (`b.ep`) its MoE layers
    hold this rank's experts only."""
    ops = (MlaCudaOps,)

    def __init__(self, backend):
        super().__init__(backend)
        self.softmax_scale = deepseek_softmax_scale(self.config)

    def gemm_dims(self) -> list[tuple[str, int]]:
        c = self.config
        dims = [("hidden_size", c.hidden_size), ("vocab_size", c.vocab_size),
                ("kv_lora_rank + qk_rope_head_dim", c.latent_dim),
                ("num_heads * (qk_nope + qk_rope)", c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)),
                ("num_heads * v_head_dim", c.num_heads * c.v_head_dim)]
        if c.q_lora_rank:
            dims.append(("q_lora_rank", c.q_lora_rank))
        if any(not c.is_moe_layer(i) for i in range(c.num_layers)):
            dims.append(("intermediate_size", c.intermediate_size))
        if c.is_moe:
            dims.append(("moe_intermediate_size", c.moe_intermediate_size))
        return dims

    def weight_bytes(self) -> int:
        c = self.config
        n = c.num_parameters() * 2
        moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_layers))
        if c.is_moe:   # this rank's experts only; the router padded
            n -= moe_layers * (c.n_routed_experts - self.num_local_experts) * 3 * c.hidden_size * c.moe_intermediate_size * 2
            n += moe_layers * (padded(c.n_routed_experts) - c.n_routed_experts) * c.hidden_size * 2
        n += 2 * (c.hidden_size * (2 * c.num_layers + 1) + c.num_layers * ((c.q_lora_rank or 0) + c.kv_lora_rank + c.n_routed_experts))
        return n + 256 * (24 * c.num_layers + 8) + (1 << 20)

    def activation_plan(self) -> dict[str, tuple[tuple[int, ...], type]]:
        b = self.b
        world = b.ep.comm.world_size if b.ep is not None else 0
        plan = activation_plan(self.config, b.max_tokens, b.max_rows, b.max_model_len, self.num_local_experts, world)
        if b.use_blas:
            from metrale.runtime.cuda.cublaslt import WORKSPACE_BYTES
            plan["x_bf16"] = ((b.max_tokens, blas_widest(self.config)), np.uint16)
            plan["blas_workspace"] = ((WORKSPACE_BYTES,), np.uint8)
        return plan

    def prepare(self, items):
        return prepare_weights(items, self.config)

    def export(self, items):
        """The canonical weights from float host arrays of the device layout (kv_b rebuilt from
        w_uk_t and w_uv, the router unpadded)."""
        c, w_uk_t = self.config, {}
        for name, host in items:
            if name.endswith(".w_uk_t"):                  # prepare_weights yields it just before w_uv
                w_uk_t[name[:-len("w_uk_t")]] = host
            elif name.endswith(".w_uv"):
                prefix = name[:-len("w_uv")]
                kv_b = np.concatenate([w_uk_t.pop(prefix).transpose(0, 2, 1), host], axis=1)
                yield prefix + "kv_b", kv_b.reshape(c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), -1)
            elif name.endswith(".router"):
                yield name, host[:c.n_routed_experts]
            else:
                yield name, host

    def random_layout(self, seed: int) -> dict[str, tuple[tuple[int, ...], object]]:
        return random_weight_shapes(self.config, self.num_local_experts)
