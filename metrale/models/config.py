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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + self.num_layers * per_layer + d + head

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes
