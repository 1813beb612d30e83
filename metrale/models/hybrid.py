"""Hybrid models (Qwen3-Next style): some layers full attention, the others Gated DeltaNet.

Owns: the hybrid family value (FAMILY), reading a hybrid config.json ("qwen3_next", or the small
custom "metrale_hybrid") into a ModelConfig, mapping its tensors onto canonical names, random
weights for tests, and the NumPy side of its cache kind and ops (HostStatePool, GdnNumpyOps). The
forward itself is models/llama.py; its CUDA part runtime/cuda_hybrid.py; the math
kernels_numba/gdn_ref.py (references; gdn.py the kernels). docs/hybrid.md has the design: state slots,
checkpoints and rollback.

Canonical names of a linear-attention layer i (attention layers keep llama's names, plus
`attn_gate` [q_size, d] when config.attn_output_gate):
  layers.{i}.lin_in [proj, d] rows q | k | v | z | b | a (config.linear_proj_size rows)
  layers.{i}.lin_conv [conv_dim, K], .lin_a_log [nv], .lin_dt_bias [nv], .lin_norm [dv],
  layers.{i}.o [d, nv*dv] (the output projection), plus attn_norm, mlp_norm, gate_up, down.
Qwen3-Next's zero-centred RMSNorm weights (x * (1 + w)) are stored as 1 + w, so every norm is
the plain rmsnorm(x) * w (its gated output norm is already plain).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from kernels_numba.gdn_ref import gdn_segment_ref, rms_norm_gated_ref, state_norm_clamp_ref
from metrale.cache.kinds import CacheKind
from metrale.models.config import ModelConfig
from metrale.models.families import KV, STATE, Family
from metrale.models.llama import llama_forward
from metrale.models.moe import MoeNumpyOps, check_expert_weights, qwen_moe_fields, qwen_moe_stream
from metrale.models.rope import hf_rope_settings

HYBRID_TYPES = ("qwen3_next", "metrale_hybrid")
LINEAR, FULL = "linear_attention", "full_attention"


# ----------------------------------------------------------------------------------- config

def hybrid_model_config(cfg: dict, name: str = "") -> ModelConfig:
    arch = str(cfg["model_type"])
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = [LINEAR if (i + 1) % interval else FULL for i in range(n)]
    if len(types) != n or set(types) - {LINEAR, FULL}:
        raise ValueError(f"layer_types must list {n} entries of '{LINEAR}' / '{FULL}', got {types}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hybrid models support hidden_act 'silu' only, not '{cfg['hidden_act']}'")
    moe = qwen_moe_fields(cfg, n, arch)       # {} without MoE layers (models/moe.py: FAMILY_MOE runs them)
    rope = cfg.get("rope_parameters") or {}
    theta, scaling = hf_rope_settings(cfg, name or arch)
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor"))
    partial = float(partial if partial is not None else (0.25 if arch == "qwen3_next" else 1.0))
    eos = cfg.get("eos_token_id")
    qwen = arch == "qwen3_next"
    return ModelConfig(
        architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]), num_layers=n, num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", heads)), head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position=int(cfg.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)), qk_norm=qwen or bool(cfg.get("qk_norm", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        name=name, extra={"rope_scaling": scaling, "norm_offset": qwen},
        layer_types=tuple(types),
        linear_num_key_heads=int(cfg["linear_num_key_heads"]),
        linear_num_value_heads=int(cfg["linear_num_value_heads"]),
        linear_key_head_dim=int(cfg["linear_key_head_dim"]),
        linear_value_head_dim=int(cfg["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
        rotary_dim=int(head_dim * partial) if partial < 1.0 else 0,
        attn_output_gate=qwen or bool(cfg.get("attn_output_gate", False)),
        **moe,
    )


# ---------------------------------------------------------------------------------- weights

def hybrid_weight_stream(config: ModelConfig, get: Callable[[str], np.ndarray], has: Callable[[str], bool]):
    """Canonical (name, array) pairs from a Hugging Face hybrid checkpoint (get/has by tensor name)."""
    offset = bool(config.extra.get("norm_offset"))

    def norm(key: str) -> np.ndarray:   # 1 + w in float64, so a float64 backend gets it exactly
        w = get(key)
        return w.astype(np.float64) + 1.0 if offset else w

    nk, nv, dk, dv = (config.linear_num_key_heads, config.linear_num_value_heads,
                      config.linear_key_head_dim, config.linear_value_head_dim)
    yield "embed", get("model.embed_tokens.weight")
    for i in range(config.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        yield o + "attn_norm", norm(p + "input_layernorm.weight")
        if config.is_linear_layer(i):
            a = p + "linear_attn."
            if has(a + "in_proj_qkvz.weight"):      # Qwen3-Next: rows grouped by key head
                qkvz = get(a + "in_proj_qkvz.weight").reshape(nk, 2 * dk + 2 * (nv // nk) * dv, -1)
                ba = get(a + "in_proj_ba.weight").reshape(nk, 2 * (nv // nk), -1)
                r = nv // nk
                q, k = qkvz[:, :dk], qkvz[:, dk:2 * dk]
                v, z = qkvz[:, 2 * dk:2 * dk + r * dv], qkvz[:, 2 * dk + r * dv:]
                parts = [q, k, v, z, ba[:, :r], ba[:, r:]]
                rows = np.concatenate([x.reshape(-1, x.shape[-1]) for x in parts])
            else:                                    # split projections, already flat q|k|v
                rows = np.concatenate([get(a + f"in_proj_{x}.weight") for x in ("qkv", "z", "b", "a")])
            yield o + "lin_in", rows
            yield o + "lin_conv", get(a + "conv1d.weight").reshape(config.linear_conv_dim, -1)
            yield o + "lin_a_log", get(a + "A_log")
            yield o + "lin_dt_bias", get(a + "dt_bias")
            yield o + "lin_norm", get(a + "norm.weight")
            yield o + "o", get(a + "out_proj.weight")
        else:
            s = p + "self_attn."
            q = get(s + "q_proj.weight")
            if config.attn_output_gate:              # rows per head: query (hd) | gate (hd)
                q = q.reshape(config.num_heads, 2, config.head_dim, -1)
                q, gate = q[:, 0].reshape(config.q_size, -1), q[:, 1].reshape(config.q_size, -1)
                yield o + "attn_gate", gate
            yield o + "qkv", np.concatenate([q, get(s + "k_proj.weight"), get(s + "v_proj.weight")])
            if has(s + "q_proj.bias"):
                qb = get(s + "q_proj.bias")
                if config.attn_output_gate:
                    qb = qb.reshape(config.num_heads, 2, config.head_dim)[:, 0].reshape(-1)
                yield o + "qkv_bias", np.concatenate([qb, get(s + "k_proj.bias"), get(s + "v_proj.bias")])
            if config.qk_norm:
                yield o + "q_norm", norm(s + "q_norm.weight")
                yield o + "k_norm", norm(s + "k_norm.weight")
            yield o + "o", get(s + "o_proj.weight")
        yield o + "mlp_norm", norm(p + "post_attention_layernorm.weight")
        if config.is_moe_layer(i):
            yield from qwen_moe_stream(config, i, get, has)
            continue
        yield o + "gate_up", np.concatenate([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        yield o + "down", get(p + "mlp.down_proj.weight")
    yield "final_norm", norm("model.norm.weight")
    if not config.tie_word_embeddings:
        yield "lm_head", get("lm_head.weight")


def random_hf_hybrid_tensors(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random Hugging Face-named float32 tensors of a (small) hybrid config, for tests and presets.
    Layout follows config.architecture: qwen3_next packs in_proj_qkvz / in_proj_ba per key head."""
    rng = np.random.default_rng(seed)
    d, f = config.hidden_size, config.intermediate_size
    nk, nv, dk, dv = (config.linear_num_key_heads, config.linear_num_value_heads,
                      config.linear_key_head_dim, config.linear_value_head_dim)
    qwen = config.architecture == "qwen3_next"

    def normal(*shape: int, fan_in: int = 1, scale: float = 1.0) -> np.ndarray:
        return (scale * rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    def norm(n: int) -> np.ndarray:     # Qwen3-Next stores w for x * (1 + w)
        return normal(n, scale=0.1) + (0.0 if qwen else 1.0)

    t = {"model.embed_tokens.weight": normal(config.vocab_size, d, scale=0.5), "model.norm.weight": norm(d)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"], t[p + "post_attention_layernorm.weight"] = norm(d), norm(d)
        if config.is_linear_layer(i):
            a = p + "linear_attn."
            if qwen:
                t[a + "in_proj_qkvz.weight"] = normal(2 * config.linear_key_dim + 2 * config.linear_value_dim, d, fan_in=d)
                t[a + "in_proj_ba.weight"] = normal(2 * nv, d, fan_in=d)
            else:
                t[a + "in_proj_qkv.weight"] = normal(config.linear_conv_dim, d, fan_in=d)
                t[a + "in_proj_z.weight"] = normal(config.linear_value_dim, d, fan_in=d)
                t[a + "in_proj_b.weight"], t[a + "in_proj_a.weight"] = normal(nv, d, fan_in=d), normal(nv, d, fan_in=d)
            t[a + "conv1d.weight"] = normal(config.linear_conv_dim, 1, config.linear_conv_kernel_dim, scale=0.5)
            t[a + "A_log"] = np.log(rng.uniform(0.5, 8.0, nv)).astype(np.float32)
            t[a + "dt_bias"] = normal(nv, scale=0.5)
            t[a + "norm.weight"] = 1.0 + normal(dv, scale=0.1)
            t[a + "out_proj.weight"] = normal(d, config.linear_value_dim, fan_in=config.linear_value_dim)
        else:
            s = p + "self_attn."
            t[s + "q_proj.weight"] = normal(config.q_size * (2 if config.attn_output_gate else 1), d, fan_in=d)
            t[s + "k_proj.weight"] = normal(config.kv_size, d, fan_in=d)
            t[s + "v_proj.weight"] = normal(config.kv_size, d, fan_in=d)
            t[s + "o_proj.weight"] = normal(d, config.q_size, fan_in=config.q_size)
            if config.qk_norm:
                t[s + "q_norm.weight"], t[s + "k_norm.weight"] = norm(config.head_dim), norm(config.head_dim)
        t[p + "mlp.gate_proj.weight"] = normal(f, d, fan_in=d)
        t[p + "mlp.up_proj.weight"] = normal(f, d, fan_in=d)
        t[p + "mlp.down_proj.weight"] = normal(d, f, fan_in=f)
    if not config.tie_word_embeddings:
        t["lm_head.weight"] = normal(config.vocab_size, d, fan_in=d)
    return t


def random_hybrid_weights(config: ModelConfig, seed: int = 0):
    """Canonical random weights of a hybrid config (what checkpoint.random_weights yields for one)."""
    t = random_hf_hybrid_tensors(config, seed)
    return hybrid_weight_stream(config, t.__getitem__, t.__contains__)


# ----------------------------------------------------------------------- host state pool

class HostStatePool(CacheKind):
    """The NumPy backend's STATE cache kind, per-sequence state: conv state [layers, ids, conv_dim, K-1] and
    recurrent state [layers, ids, nv, dk, dv] of every linear-attention layer. Ids 0..num_slots-1
    are sequence slots, num_slots.. checkpoints (cache/state_slots.py hands both out).
    `tokens[layer, id]` counts the tokens folded into a state, so a segment that does not continue
    its slot (a prefix-cache hit, a missed rollback) is an error rather than silent garbage.
    A checkpoint also holds a trail: the raw inputs (pre-conv q|k|v, b, a) of the verify block run
    right after it, so a partial acceptance is restored by replaying the accepted tokens.
    Segments at least `chunk` tokens long run the chunked form, others (and every recorded
    verify block, so replay is bit-exact) the recurrent one. state_norm_bound > 0 scales each
    head's recurrent state down to that Frobenius norm at the end of every segment."""

    def __init__(self, config: ModelConfig, weights: dict, num_slots: int, num_checkpoints: int,
                 dtype=np.float32, *, max_trail: int = 16, chunk: int = 64, state_norm_bound: float = 0.0):
        if num_slots < 1 or num_checkpoints < 0:
            raise ValueError(f"need num_slots >= 1 and num_checkpoints >= 0, got {num_slots}, {num_checkpoints}")
        c = config
        self.config, self.num_slots, self.num_checkpoints = c, num_slots, num_checkpoints
        self.max_trail, self.chunk, self.state_norm_bound = max_trail, chunk, float(state_norm_bound)
        L, ids, nv = c.num_state_layers, num_slots + num_checkpoints, c.linear_num_value_heads
        self.conv = np.zeros((L, ids, c.linear_conv_dim, c.linear_conv_kernel_dim - 1), dtype)
        self.ssm = np.zeros((L, ids, nv, c.linear_key_head_dim, c.linear_value_head_dim), dtype)
        self.tokens = np.zeros((L, ids), np.int64)
        self.trail_x = np.zeros((L, num_checkpoints, max_trail, c.linear_conv_dim), dtype)
        self.trail_ba = np.zeros((L, num_checkpoints, max_trail, 2 * nv), dtype)
        self.trail_len = np.zeros((L, num_checkpoints), np.int64)
        self.num_snapshots = 0          # prefix-cache snapshots: ids after the checkpoints (reserve())
        self.snapshot_every = 0         # tokens: stage the state at these boundaries inside segments (0: off)
        self.staged: dict[tuple[int, int], list] = {}   # (slot, position) -> per-layer (conv, ssm) copies
        linear = [i for i in range(c.num_layers) if c.is_linear_layer(i)]
        self._layer_weights = [tuple(weights[f"layers.{i}.{n}"] for n in ("lin_conv", "lin_a_log", "lin_dt_bias"))
                               for i in linear]

    paged = False

    @classmethod
    def allocate(cls, backend, n: int) -> "HostStatePool":
        """n sequence slots (and the backend's num_state_checkpoints) over the backend's weights."""
        return cls(backend.config, backend.weights, n, backend.num_state_checkpoints, backend.dtype,
                   state_norm_bound=backend.state_norm_bound)

    def memory(self) -> dict:
        return {"state_pool_bytes": self.nbytes}

    @property
    def snapshot_base(self) -> int:
        """The first snapshot id (snapshots follow the slots and the checkpoints)."""
        return self.num_slots + self.num_checkpoints

    def reserve(self, *, num_checkpoints: int | None = None, max_trail: int | None = None,
                num_snapshots: int | None = None, snapshot_every: int | None = None) -> None:
        """Resize the checkpoint and snapshot parts of the pool (the engine calls this once, before
        any forward: speculative decoding needs checkpoints, prefix caching snapshots). Slot
        contents are kept; checkpoint trails and snapshots start empty."""
        c, L = self.config, self.conv.shape[0]
        ck = self.num_checkpoints if num_checkpoints is None else int(num_checkpoints)
        trail = self.max_trail if max_trail is None else int(max_trail)
        snaps = self.num_snapshots if num_snapshots is None else int(num_snapshots)
        if ck < 0 or snaps < 0 or trail < 1:
            raise ValueError(f"need num_checkpoints >= 0, num_snapshots >= 0, max_trail >= 1; got {ck}, {snaps}, {trail}")
        ids, S, nv, dt = self.num_slots + ck + snaps, self.num_slots, c.linear_num_value_heads, self.conv.dtype
        conv = np.zeros((L, ids) + self.conv.shape[2:], dt)
        ssm = np.zeros((L, ids) + self.ssm.shape[2:], dt)
        tokens = np.zeros((L, ids), np.int64)
        conv[:, :S], ssm[:, :S], tokens[:, :S] = self.conv[:, :S], self.ssm[:, :S], self.tokens[:, :S]
        self.conv, self.ssm, self.tokens = conv, ssm, tokens
        self.num_checkpoints, self.max_trail, self.num_snapshots = ck, trail, snaps
        self.trail_x = np.zeros((L, ck, trail, c.linear_conv_dim), dt)
        self.trail_ba = np.zeros((L, ck, trail, 2 * nv), dt)
        self.trail_len = np.zeros((L, ck), np.int64)
        if snapshot_every is not None:
            self.snapshot_every = int(snapshot_every)
        self.staged = {}

    def take_staged(self) -> dict[tuple[int, int], list]:
        """The states staged at snapshot boundaries by the last forward, {(slot, position): per-layer
        (conv, ssm)}; the caller keeps what it wants (store_snapshot) and the rest is dropped."""
        staged, self.staged = self.staged, {}
        return staged

    def store_snapshot(self, states: list, snapshot: int) -> None:
        """Write a staged state (take_staged's value) into snapshot id `snapshot`."""
        if not self.snapshot_base <= snapshot < self.snapshot_base + self.num_snapshots:
            raise ValueError(f"{snapshot} is not a snapshot id")
        if len(states) != self.conv.shape[0] or any(st is None for st in states):
            raise ValueError("a staged state must cover every linear-attention layer")
        for layer, (conv, ssm, tokens) in enumerate(states):
            self.conv[layer, snapshot], self.ssm[layer, snapshot] = conv, ssm
            self.tokens[layer, snapshot] = tokens

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes + self.trail_x.nbytes + self.trail_ba.nbytes

    @property
    def bytes_per_state(self) -> int:
        return (self.conv[:, 0].nbytes + self.ssm[:, 0].nbytes) if self.conv.shape[1] else 0

    def copy_state(self, src: int, dst: int) -> None:
        self.conv[:, dst] = self.conv[:, src]
        self.ssm[:, dst] = self.ssm[:, src]
        self.tokens[:, dst] = self.tokens[:, src]
        if self.num_slots <= dst < self.snapshot_base:   # a fresh checkpoint records no block yet
            self.trail_len[:, dst - self.num_slots] = 0

    def replay(self, slot: int, ckpt: int, num_tokens: int) -> None:
        """Fold the first num_tokens recorded tokens of ckpt's trail into slot (which must hold
        the checkpointed state)."""
        ci = ckpt - self.num_slots
        if num_tokens > self.trail_len[:, ci].min():
            raise ValueError(f"checkpoint {ckpt} recorded {int(self.trail_len[:, ci].min())} tokens, "
                             f"cannot replay {num_tokens}")
        nv = self.config.linear_num_value_heads
        for layer in range(self.conv.shape[0]):
            ba = self.trail_ba[layer, ci, :num_tokens]
            self._run(layer, slot, self.tokens[layer, slot], self.trail_x[layer, ci, :num_tokens],
                      ba[:, :nv], ba[:, nv:], *self._layer_weights[layer], chunked=False)

    def _run(self, layer, slot, start, x, b, a, conv_w, a_log, dt_bias, chunked: bool):
        c = self.config
        if start == 0:
            conv0, ssm0 = np.zeros_like(self.conv[layer, slot]), np.zeros_like(self.ssm[layer, slot])
        elif self.tokens[layer, slot] != start:
            raise ValueError(f"state slot {slot} holds {int(self.tokens[layer, slot])} tokens but the segment "
                             f"starts at position {start} (a missed rollback, or prefix caching without a "
                             "state snapshot)")
        else:
            conv0, ssm0 = self.conv[layer, slot], self.ssm[layer, slot]
        o, conv1, ssm1 = gdn_segment_ref(x, b, a, conv_w, a_log, dt_bias, conv0, ssm0, c.linear_num_key_heads,
                                         c.linear_key_head_dim, chunk=self.chunk if chunked else None)
        if self.state_norm_bound > 0:
            ssm1 = state_norm_clamp_ref(ssm1, self.state_norm_bound)
        self.conv[layer, slot], self.ssm[layer, slot] = conv1, ssm1
        self.tokens[layer, slot] = start + x.shape[0]
        return o

    def gated_delta_net(self, batch, proj, layer, conv_w, a_log, dt_bias, norm_w, eps: float) -> np.ndarray:
        """The Ops.gated_delta_net of the NumPy backend: proj [T, linear_proj_size] -> [T, nv*dv]."""
        c = self.config
        cd, vd, nv, dv = c.linear_conv_dim, c.linear_value_dim, c.linear_num_value_heads, c.linear_value_head_dim
        slots, ckpts = batch.state_slots, batch.state_checkpoints
        if layer == 0:
            self.staged = {}         # a new forward: the last one's stage was taken or is stale
        if slots is None or (slots < 0).any():
            raise ValueError("every segment of a hybrid model's batch needs a state slot (Segment.state_slot)")
        out = np.empty((proj.shape[0], nv, dv), proj.dtype)
        for s in range(batch.num_seqs):
            a, b = int(batch.seq_query_start[s]), int(batch.seq_query_start[s + 1])
            slot, start, n = int(slots[s]), int(batch.positions[a]), b - a
            x, gb, ga = proj[a:b, :cd], proj[a:b, cd + vd:cd + vd + nv], proj[a:b, cd + vd + nv:]
            ck = -1 if ckpts is None else int(ckpts[s])
            if ck >= 0:
                ci = ck - self.num_slots
                if not 0 <= ci < self.num_checkpoints or n > self.max_trail:
                    raise ValueError(f"checkpoint {ck} cannot record a block of {n} tokens "
                                     f"(ids {self.num_slots}..{self.num_slots + self.num_checkpoints - 1}, "
                                     f"at most {self.max_trail} tokens)")
                if self.tokens[layer, ck] != start:
                    raise ValueError(f"checkpoint {ck} holds {int(self.tokens[layer, ck])} tokens, the block starts "
                                     f"at {start}")
                self.trail_x[layer, ci, :n], self.trail_len[layer, ci] = x, n
                self.trail_ba[layer, ci, :n, :nv], self.trail_ba[layer, ci, :n, nv:] = gb, ga
            every = self.snapshot_every
            if ck >= 0 or every <= 0 or n < 2 or (start + n) // every == start // every:
                out[a:b] = self._run(layer, slot, start, x, gb, ga, conv_w, a_log, dt_bias,
                                     chunked=ck < 0 and n >= self.chunk)
                continue
            # prefix caching: split the segment at each snapshot boundary and stage the state there
            cuts = list(range((start // every + 1) * every, start + n + 1, every))
            lo = start
            for hi in cuts + ([start + n] if cuts[-1] < start + n else []):
                i, j = lo - start, hi - start
                out[a + i:a + j] = self._run(layer, slot, lo, x[i:j], gb[i:j], ga[i:j], conv_w, a_log, dt_bias,
                                             chunked=j - i >= self.chunk)
                if hi % every == 0:
                    per_layer = self.staged.setdefault((slot, hi), [None] * self.conv.shape[0])
                    per_layer[layer] = (self.conv[layer, slot].copy(), self.ssm[layer, slot].copy(), hi)
                lo = hi
        z = proj[:, cd:cd + vd].reshape(-1, nv, dv)
        return rms_norm_gated_ref(out, z, norm_w, eps).reshape(-1, vd)


class GdnNumpyOps:
    """The ops a hybrid forward adds, as a NumpyOps mixin: the attention output gate and the Gated
    DeltaNet mixer over the backend's state pool."""

    def sigmoid_mul(self, x, gate):
        return x / (1.0 + np.exp(-gate))

    def gated_delta_net(self, proj, layer, conv, a_log, dt_bias, norm):
        return self.b.states.gated_delta_net(self.batch, proj, layer, conv, a_log, dt_bias, norm, self.cfg.rms_norm_eps)


FAMILY = Family(
    name="hybrid",
    matches=lambda c: c.is_hybrid and not c.is_moe,
    forward=llama_forward,
    caches=(KV, STATE),
    random_weights=random_hybrid_weights,
    numpy_ops=(GdnNumpyOps,),
    cuda="metrale.runtime.cuda_hybrid:HybridCuda",
    layer_prefix=False,      # the first layers' recurrent states would advance with draft tokens
)


# Qwen3-Next with its MoE layers (models/moe.py's block)
FAMILY_MOE = Family(
    name="hybrid_moe",
    matches=lambda c: c.is_hybrid and c.is_moe,
    forward=llama_forward,
    caches=(KV, STATE),
    random_weights=None,
    numpy_ops=(GdnNumpyOps, MoeNumpyOps),
    cuda="metrale.runtime.cuda_moe:HybridMoeCuda",
    layer_prefix=False,
    check_weights=check_expert_weights,
)
