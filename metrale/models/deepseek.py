"""DeepSeek-V2/V3 decoder: multi-head latent attention (MLA) + mixture of experts, written once
against the DeepseekOps interface; its family value (FAMILY) and its NumPy ops (MlaNumpyOps).

A layer: norm, MLA (q [via q_lora], kv_a -> latent c + k_pe, store the latent row, attention over
the paged latent cache), o(+res), norm, then a dense SwiGLU MLP (layers < first_k_dense_replace)
or MoE (router, top-k experts, shared experts) added into the residual.

The latent cache (cache kind LATENT) holds Dk = kv_lora_rank + qk_rope_head_dim values per token
and layer in blocks of the KV block size, addressed by the batch's block tables and slot mapping
like the KV cache. Attention per segment takes the naive form (K/V decompressed per head from the
cached latents: cheaper when many query tokens share one context) or the absorbed form (q_nope
absorbed through W_UK into the latent space, scores against the latent rows, output up-projected
through W_UV: the decode form); the NumPy backend's `mla_mode` = auto (naive for multi-token
segments) | naive | absorbed. Both read the cache, so a chunk attends to the latents of earlier
chunks and chunked prefill equals one-shot.

Expert parallelism: with `ep` (metrale.parallel.ExpertParallel) a backend holds only its rank's
experts (weights experts_* of [E_local, ...]) and the routed part of every MoE layer goes through
ep.dispatch_combine; every rank must then run the same layers each step (Backend.idle_step when
it has no tokens). Also here: tiny random DeepSeek checkpoints for tests and benchmarks.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from metrale.models.config import ModelConfig
from metrale.models.families import LATENT, Family
from metrale.models.llama import Ops
# the MoE block is models/moe.py's (re-exported: tests and the CUDA part import these names from here)
from metrale.models.moe import (MoeNumpyOps, check_expert_weights, expert_mlp, local_experts,  # noqa: F401
                                route_config)
from metrale.models.rope import rope_type, yarn_mscale
from metrale.runtime.numpy_backend import apply_rope

Tensor = Any


class DeepseekOps(Ops, Protocol):
    def mla_attention(self, h: Tensor, layer: int, w: dict, prefix: str) -> Tensor: ...
    def moe_residual(self, h: Tensor, layer: int, w: dict, prefix: str, residual: Tensor) -> Tensor: ...


def deepseek_forward(ops: DeepseekOps, w: dict[str, Tensor], config: ModelConfig, num_layers: int | None = None,
                     return_hidden: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Runs the batch bound to `ops`; returns logits [R, vocab] of the rows that need them (and,
    with return_hidden, those rows' hidden states before the final norm)."""
    residual = ops.embed(w["embed"])
    for i in range(config.num_layers if num_layers is None else num_layers):
        p = f"layers.{i}."
        h = ops.rms_norm(residual, w[p + "attn_norm"])
        residual = ops.linear_residual(ops.mla_attention(h, i, w, p), w[p + "o"], residual)
        h = ops.rms_norm(residual, w[p + "mlp_norm"])
        if config.is_moe_layer(i):
            residual = ops.moe_residual(h, i, w, p, residual)
        else:
            residual = ops.linear_residual(ops.silu_mul(ops.linear(h, w[p + "gate_up"])), w[p + "down"], residual)
    rows = ops.logits_rows(residual)
    logits = ops.linear(ops.rms_norm(rows, w["final_norm"]), w.get("lm_head", w["embed"]))
    return (logits, rows) if return_hidden else logits


# ------------------------------------------------------------------------------- softmax scale

def deepseek_softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(qk_nope + qk_rope), times yarn_mscale(factor, mscale_all_dim)^2 when a scaled RoPE
    sets mscale_all_dim (transformers' DeepseekV2/V3 yarn_apply_mscale). The cos/sin side of YaRN is
    metrale.models.rope's attention_factor."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    s = (config.extra or {}).get("rope_scaling") or {}
    all_dim = float(s.get("mscale_all_dim") or 0)
    if rope_type(s) != "default" and all_dim:
        scale *= yarn_mscale(float(s["factor"]), all_dim) ** 2
    return scale


# ------------------------------------------------------------------------------- NumPy ops

class MlaNumpyOps(MoeNumpyOps):
    """The ops deepseek_forward adds, as a NumpyOps mixin: MLA over the backend's latent pages
    (`kv.latent`, `mla_mode`) and the MoE block (models/moe.py: local experts, or the ranks' through `ep`)."""

    def mla_attention(self, h, layer, w, p):
        c, bt, be = self.cfg, self.batch, self.b
        t, nh = h.shape[0], c.num_heads
        nope, rope, r, vd = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.v_head_dim
        if c.q_lora_rank:
            q = self.linear(self.rms_norm(self.linear(h, w[p + "q_a"]), w[p + "q_a_norm"]), w[p + "q_b"])
        else:
            q = self.linear(h, w[p + "q"])
        q = q.reshape(t, nh, nope + rope)
        kv = self.linear(h, w[p + "kv_a"])
        c_kv = self.rms_norm(kv[:, :r], w[p + "kv_a_norm"])
        cos, sin = be.rope_for(bt)
        q_pe = apply_rope(q[..., nope:], cos, sin, True)
        k_pe = apply_rope(kv[:, None, r:], cos, sin, True)[:, 0]
        cache = be.kv.latent[layer]
        flat = cache.reshape(-1, c.latent_dim)
        keep = bt.slot_mapping >= 0
        flat[bt.slot_mapping[keep], :r] = c_kv[keep]
        flat[bt.slot_mapping[keep], r:] = k_pe[keep]
        w_kv_b = w[p + "kv_b"].reshape(nh, nope + vd, r)
        w_uk, w_uv = w_kv_b[:, :nope], w_kv_b[:, nope:]
        out = np.empty((t, nh, vd), h.dtype)
        scale = deepseek_softmax_scale(c)
        for s in range(bt.num_seqs):
            a, b, ctx = bt.seq_query_start[s], bt.seq_query_start[s + 1], bt.context_lens[s]
            blocks = bt.block_tables[s, :-(-ctx // bt.block_size)]
            lat = cache[blocks].reshape(-1, c.latent_dim)[:ctx]
            lat_c, lat_pe = lat[:, :r], lat[:, r:]
            qn, qp = q[a:b, :, :nope], q_pe[a:b]
            naive = be.mla_mode == "naive" or (be.mla_mode == "auto" and b - a > 1)
            if naive:
                k_nope = np.einsum("lr,hnr->hln", lat_c, w_uk)
                scores = np.einsum("qhn,hln->hql", qn, k_nope)
            else:
                q_lat = np.einsum("qhn,hnr->qhr", qn, w_uk)
                scores = np.einsum("qhr,lr->hql", q_lat, lat_c)
            scores = (scores + np.einsum("qhd,ld->hql", qp, lat_pe)) * scale
            scores[:, np.arange(ctx)[None, :] > bt.positions[a:b][:, None]] = -np.inf
            scores -= scores.max(axis=-1, keepdims=True)
            prob = np.exp(scores)
            prob /= prob.sum(axis=-1, keepdims=True)
            if naive:
                out[a:b] = np.einsum("hql,hlv->qhv", prob, np.einsum("lr,hvr->hlv", lat_c, w_uv))
            else:
                out[a:b] = np.einsum("qhr,hvr->qhv", np.einsum("hql,lr->qhr", prob, lat_c), w_uv)
        return out.reshape(t, nh * vd)


FAMILY = Family(
    name="mla",
    matches=lambda c: c.is_mla,
    forward=deepseek_forward,
    caches=(LATENT,),
    numpy_ops=(MlaNumpyOps,),
    cuda="metrale.runtime.cuda_deepseek:MlaCuda",
    check_weights=check_expert_weights,
)


# ------------------------------------------------------------------------------- random models

def tiny_deepseek_hf_config(**overrides) -> dict:
    """A DeepSeek-V3-shaped config.json small enough for CPU tests: MLA with q_lora, YaRN,
    one dense layer then MoE layers with sigmoid noaux_tc group-limited routing + a shared expert."""
    cfg = {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "n_group": 4, "topk_group": 2, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "max_position_embeddings": 128, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def tiny_cuda_deepseek_hf_config(**overrides) -> dict:
    """tiny_deepseek_hf_config with every GEMM dimension a multiple of 64 (the CUDA backend's
    contract): hidden 64, 2 heads of nope 32 + rope 32 (latent 32 + 32), v 32, 8 experts."""
    cfg = tiny_deepseek_hf_config(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
                                  num_attention_heads=2, num_key_value_heads=2, q_lora_rank=64, kv_lora_rank=32,
                                  qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32)
    cfg.update(overrides)
    return cfg


def v2_lite_hf_config(**overrides) -> dict:
    """DeepSeek-V2-Lite's config.json (15.7B parameters, 2.4B active; MLA without q_lora, 64
    routed experts top-6 + 2 shared, softmax greedy routing, YaRN x40): the shape for benchmarks
    with random weights (num_hidden_layers can be cut)."""
    cfg = {
        "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2,
        "n_group": 1, "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax",
        "norm_topk_prob": False, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        "max_position_embeddings": 163840, "tie_word_embeddings": False,
        "bos_token_id": 100000, "eos_token_id": 100001, "torch_dtype": "bfloat16",
    }
    cfg.update(overrides)
    return cfg


def random_hf_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under Hugging Face DeepSeek-V3 tensor names."""
    from metrale.models.checkpoint import deepseek_routing
    rng = np.random.default_rng(seed)
    d, h = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, r, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["kv_lora_rank"], cfg["v_head_dim"]
    fm, e = cfg["moe_intermediate_size"], cfg["n_routed_experts"]

    def lin(n: int, k: int) -> np.ndarray:
        return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def mlp(prefix: str, f: int) -> None:
        t[prefix + "gate_proj.weight"], t[prefix + "up_proj.weight"] = lin(f, d), lin(f, d)
        t[prefix + "down_proj.weight"] = lin(d, f)

    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": (0.5 * rng.standard_normal((cfg["vocab_size"], d))).astype(np.float32)}
    for i in range(cfg["num_hidden_layers"]):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        t[p + "input_layernorm.weight"], t[p + "post_attention_layernorm.weight"] = norm(d), norm(d)
        if cfg.get("q_lora_rank"):
            t[a + "q_a_proj.weight"], t[a + "q_a_layernorm.weight"] = lin(cfg["q_lora_rank"], d), norm(cfg["q_lora_rank"])
            t[a + "q_b_proj.weight"] = lin(h * (nope + rope), cfg["q_lora_rank"])
        else:
            t[a + "q_proj.weight"] = lin(h * (nope + rope), d)
        t[a + "kv_a_proj_with_mqa.weight"], t[a + "kv_a_layernorm.weight"] = lin(r + rope, d), norm(r)
        t[a + "kv_b_proj.weight"], t[a + "o_proj.weight"] = lin(h * (nope + vd), r), lin(d, h * vd)
        if e and i >= cfg.get("first_k_dense_replace", 0) and (i - cfg.get("first_k_dense_replace", 0)) % cfg.get("moe_layer_freq", 1) == 0:
            t[p + "mlp.gate.weight"] = lin(e, d)
            if deepseek_routing(cfg, cfg["model_type"])["topk_method"] == "noaux_tc":
                t[p + "mlp.gate.e_score_correction_bias"] = (0.05 * rng.standard_normal(e)).astype(np.float32)
            for j in range(e):
                mlp(p + f"mlp.experts.{j}.", fm)
            if cfg.get("n_shared_experts"):
                mlp(p + "mlp.shared_experts.", fm * cfg["n_shared_experts"])
        else:
            mlp(p + "mlp.", cfg["intermediate_size"])
    t["model.norm.weight"] = norm(d)
    if not cfg.get("tie_word_embeddings"):
        t["lm_head.weight"] = lin(cfg["vocab_size"], d)
    return t


def write_random_checkpoint(path: Path, cfg: dict, seed: int = 0) -> Path:
    """config.json + model.safetensors of random weights (a directory load_deepseek_dir reads)."""
    from safetensors.numpy import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(random_hf_tensors(cfg, seed), str(path / "model.safetensors"))
    return path


def greedy_generate(backend, prompt: list[int], max_new_tokens: int, chunk: int | None = None,
                    first_block: int = 0) -> list[int]:
    """Greedy decode of one sequence on a backend: prefill in chunks of `chunk` tokens (None =
    one shot), then one token a step. Blocks first_block.. hold the sequence."""
    from metrale.runtime.batch import Segment, build_batch
    bs = backend.block_size
    total = len(prompt) + max_new_tokens
    table = np.arange(first_block, first_block + -(-total // bs), dtype=np.int32)
    if table[-1] >= backend.num_blocks:
        raise ValueError(f"{total} tokens need blocks up to {table[-1]}, the pool has {backend.num_blocks}")
    step = chunk or len(prompt)
    tokens, pos, nxt = list(prompt), 0, None
    while pos < len(prompt):
        piece = np.array(prompt[pos:pos + step], np.int32)
        nxt = int(backend.forward_greedy(build_batch([Segment(piece, pos, table)], bs))[0])
        pos += len(piece)
    out = [nxt]
    while len(out) < max_new_tokens:
        seg = Segment(np.array([out[-1]], np.int32), len(tokens) + len(out) - 1, table)
        out.append(int(backend.forward_greedy(build_batch([seg], bs))[0]))
    return out


def load_deepseek_backend(path: Path, *, num_blocks: int, block_size: int = 16, dtype: str = "float32",
                          mla_mode: str = "auto", ep=None):
    """A NumpyBackend from a DeepSeek checkpoint directory; with `ep`, only that rank's experts load."""
    from metrale.models.checkpoint import load_deepseek_dir
    from metrale.runtime.numpy_backend import NumpyBackend
    config, _, stream = load_deepseek_dir(Path(path), None if ep is None else ep.expert_range)
    return NumpyBackend(config, stream(), num_blocks=num_blocks, block_size=block_size, dtype=dtype,
                        mla_mode=mla_mode, ep=ep)
