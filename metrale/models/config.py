"""ModelConfig: the one description of a decoder-only model, whatever file it came from.

GGUF metadata and Hugging Face config.json both map onto it; backends and the scheduler read
only this. Invariant: head_dim * num_heads need not equal hidden_size (Qwen3 style), so every
shape is derived from the explicit fields below.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    architecture: str            # "llama" | "qwen2" | "qwen3" | ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # GGUF files written by llama.cpp permute Q/K rows so that RoPE rotates adjacent pairs
    # (x[2i], x[2i+1]); Hugging Face checkpoints rotate halves (x[i], x[i + head_dim/2]).
    rope_interleaved: bool = False
    max_position: int = 8192
    tie_word_embeddings: bool = True
    attention_bias: bool = False     # Qwen2 has q/k/v biases
    qk_norm: bool = False            # Qwen3 normalizes q and k per head before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    min_p_floor: float = 0.0         # per-model floor for min_p (sampling issue)
    name: str = ""
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    # Hybrid models (Qwen3-Next style; docs/hybrid.md). layer_types[i] is "full_attention" or
    # "linear_attention" (Gated DeltaNet); () means every layer is full attention.
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    rotary_dim: int = 0              # partial RoPE: rotate the first rotary_dim dims; 0 = head_dim
    attn_output_gate: bool = False   # Qwen3-Next: attention output * sigmoid(gate projection)
    # Sliding-window attention (Mistral, Qwen2/3 with use_sliding_window): a query at position p
    # sees keys in (p - sliding_window, p]. sliding_layers[i] says whether layer i has the window
    # (() = every layer); 0 = full attention everywhere.
    sliding_window: int = 0
    sliding_layers: tuple[bool, ...] = ()
    # ---- Gemma 3 (models/gemma.py); the defaults mean "not used"
    local_rope_theta: float = 0.0          # sliding layers' RoPE base (0: the model's RoPE on every layer)
    query_pre_attn_scalar: float = 0.0     # scores scaled by its ** -0.5 (0: head_dim)
    final_logit_softcapping: float = 0.0   # logits = cap * tanh(logits / cap) (0: none)
    embed_scale: float = 1.0               # embeddings multiplied on the way in (Gemma: sqrt(hidden))
    hidden_act: str = "silu"               # the MLP's gate activation: silu | gelu_tanh
    # ---- DeepSeek-V2/V3 (docs/deepseek.md); all optional, the defaults mean "not used"
    # MLA: kv_lora_rank > 0 turns it on; the latent cache holds kv_lora_rank + qk_rope_head_dim
    # values per token and layer (num_kv_heads = 1, head_dim = qk_nope_head_dim + qk_rope_head_dim).
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE: n_routed_experts > 0 turns it on for layers >= first_k_dense_replace (every
    # moe_layer_freq-th); the others are dense MLPs of intermediate_size.
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    # Qwen-style MoE (models/moe.py): moe_layers[i] says whether layer i is MoE (() = the
    # first_k_dense_replace / moe_layer_freq rule above); the shared expert's width when it is not
    # n_shared_experts * moe_intermediate_size, and whether sigmoid(h @ shared_gate) scales it.
    moe_layers: tuple[bool, ...] = ()
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    scoring_func: str = "softmax"            # softmax | sigmoid
    topk_method: str = "greedy"              # greedy | group_limited_greedy | noaux_tc
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window}")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers")
        if self.moe_layers and len(self.moe_layers) != self.num_layers:
            raise ValueError(f"moe_layers has {len(self.moe_layers)} entries for {self.num_layers} layers")
        if self.sliding_window and self.is_hybrid:   # kv_layer(i) != i there; no hybrid family has a window
            raise ValueError("sliding_window is not supported in hybrid (Gated DeltaNet) models")

    def layer_window(self, layer: int) -> int:
        """The attention window of layer `layer` (0 = full causal attention)."""
        if not self.sliding_window or (self.sliding_layers and not self.sliding_layers[layer]):
            return 0
        return self.sliding_window

    @property
    def has_sliding_window(self) -> bool:
        return any(self.layer_window(i) for i in range(self.num_layers))

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    @property
    def latent_dim(self) -> int:
        """Values per token and layer in the MLA latent cache: compressed KV + the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        if self.moe_layers:
            return self.is_moe and self.moe_layers[layer]
        return (self.is_moe and layer >= self.first_k_dense_replace
                and (layer - self.first_k_dense_replace) % self.moe_layer_freq == 0)

    @property
    def is_hybrid(self) -> bool:
        return "linear_attention" in self.layer_types

    def is_linear_layer(self, i: int) -> bool:
        return bool(self.layer_types) and self.layer_types[i] == "linear_attention"

    def kv_layer(self, i: int) -> int:
        """Index of layer i among the full-attention layers (its slice of the KV cache)."""
        if not self.is_hybrid:
            return i
        return sum(1 for t in self.layer_types[:i] if t != "linear_attention")

    def state_layer(self, i: int) -> int:
        """Index of layer i among the linear-attention layers (its slice of the state pool)."""
        return sum(1 for t in self.layer_types[:i] if t == "linear_attention")

    @property
    def num_state_layers(self) -> int:
        return sum(1 for t in self.layer_types if t == "linear_attention")

    @property
    def num_kv_layers(self) -> int:
        return self.num_layers - self.num_state_layers

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the short convolution: q | k | v of a Gated DeltaNet layer."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def linear_proj_size(self) -> int:
        """Rows of a Gated DeltaNet input projection: q | k | v | z | b | a."""
        return self.linear_conv_dim + self.linear_value_dim + 2 * self.linear_num_value_heads

    def state_bytes_per_slot(self, dtype_bytes: int = 4) -> int:
        """Conv state + recurrent state of one sequence over all linear-attention layers."""
        per_layer = (self.linear_conv_dim * (self.linear_conv_kernel_dim - 1)
                     + self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim)
        return self.num_state_layers * per_layer * dtype_bytes

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        head = 0 if self.tie_word_embeddings else v * d
        if not (self.is_mla or self.is_moe or self.is_hybrid or self.attn_output_gate):
            per_layer = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f + 2 * d
            if self.architecture == "gemma3":         # post-attention / post-MLP norms, q/k norms
                per_layer += 2 * d + 2 * self.head_dim
            return v * d + self.num_layers * per_layer + d + head
        total = v * d + d + head
        for i in range(self.num_layers):
            if self.is_linear_layer(i):
                total += (d * self.linear_proj_size + self.linear_conv_dim * self.linear_conv_kernel_dim
                          + 2 * self.linear_num_value_heads + self.linear_value_head_dim + self.linear_value_dim * d)
            elif self.is_mla:
                h, qk = self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
                ql = self.q_lora_rank
                total += (d * ql + ql + ql * h * qk) if ql else d * h * qk
                total += d * self.latent_dim + self.kv_lora_rank
                total += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim) + h * self.v_head_dim * d
            else:
                total += d * (self.q_size + 2 * self.kv_size) + self.q_size * d * (2 if self.attn_output_gate else 1)
            if self.is_moe_layer(i):
                fm, e = self.moe_intermediate_size, self.n_routed_experts
                shared = 3 * d * (self.shared_intermediate_size or self.n_shared_experts * fm)
                total += e * 3 * d * fm + shared + e * d + (e if self.topk_method == "noaux_tc" else 0)
                total += d if self.shared_expert_gate else 0
            else:
                total += 3 * d * f
            total += 2 * d
        return total

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        if self.is_mla:
            return self.num_layers * self.latent_dim * dtype_bytes
        return 2 * self.num_kv_layers * self.kv_size * dtype_bytes
