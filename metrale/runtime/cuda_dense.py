"""A model family's CUDA part: what the one CudaBackend asks a family (CudaPart, the interface and
its defaults), and the dense family's (DenseCuda: Llama / Qwen2 / Qwen3 / Mistral, whose ops are
CudaOps itself). A family names its part in its value (Family.cuda); the backend builds it once.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from kernels_numba import argmax, attention
from kernels_numba.bf16 import to_bf16_bits
from metrale.models.rope import model_rotary_dim


class CudaPart:
    """The family-specific answers of a CudaBackend (`b`). Flags say which backend features the
    family's op sequence allows; the methods size and fill its weights and activations."""
    ops: tuple[type, ...] = ()     # CudaOps mixins with the ops the family's forward adds
    carries_norm_sums = False      # each residual GEMV may carry sum(x^2) to the next norm (levers.carry_norm_sums)
    feeds_tokens = False           # the host may run a step ahead, inputs fed on the device (levers.overlap)
    mixed_graphs = False           # prefill / mixed steps may replay from bucketed graphs (levers.mixed_graphs)
    f32_weights: tuple[str, ...] = ()   # name suffixes of matrices kept float32 (not GEMM operands)
    quantized_weights = False      # its ops take DeviceQuantized / DeviceFP8 matrices (levers.weights=native)
    parallel_compile = False       # its forward reads nothing back to the host, so a recording run finds
                                   # its kernels for levers.compile_workers

    def __init__(self, backend):
        self.b, self.config = backend, backend.config

    def check(self) -> None:
        """Refuse what the kernels cannot run, before any device memory is taken."""

    def gemm_dims(self) -> list[tuple[str, int]]:
        """(name, size) of the dimensions the GEMM kernels need as multiples of 64."""
        raise NotImplementedError

    def weight_bytes(self) -> int:
        raise NotImplementedError

    def activation_plan(self) -> dict[str, tuple[tuple[int, ...], type]]:
        """name -> (shape, dtype) of every activation buffer its ops use, sized for the largest step."""
        raise NotImplementedError

    def after_activations(self) -> None:
        """Initialize buffers or workspaces once the activations are allocated."""

    def prepare(self, items) -> Iterator[tuple[str, np.ndarray]]:
        """Canonical (name, float array) pairs -> the device layout: matrices as bf16 bits, the rest float32."""
        from metrale.models.quantized import kept
        for name, array in items:
            if kept(array):          # uploaded in its blocks / FP8 bytes by the backend
                yield name, array
            elif array.ndim >= 2 and not name.endswith(self.f32_weights):
                yield name, to_bf16_bits(array)
            else:
                yield name, np.ascontiguousarray(array, dtype=np.float32)

    def export(self, items) -> Iterator[tuple[str, np.ndarray]]:
        """prepare's inverse on float host arrays (the device layout -> canonical names)."""
        yield from items

    def random_layout(self, seed: int) -> dict[str, tuple[tuple[int, ...], object]]:
        """name -> (shape, init) of random weights in the device layout, filled by the backend in this
        order (entry i seeded with seed + i):
        init a float: bf16 normal of that std (filled on the device); "norm": 1 + 0.05 N(0, 1);
        "bias": 0.05 N(0, 1); an ndarray: that value."""
        raise NotImplementedError

    def idle_step(self, num_layers: int | None) -> None:
        """Backend.idle_step with expert parallelism (the MoE families)."""


class DenseCuda(CudaPart):
    carries_norm_sums = feeds_tokens = mixed_graphs = quantized_weights = parallel_compile = True

    def gemm_dims(self) -> list[tuple[str, int]]:
        c = self.config
        return [("hidden_size", c.hidden_size), ("intermediate_size", c.intermediate_size),
                ("q+k+v size", c.q_size + 2 * c.kv_size), ("vocab_size", c.vocab_size)]

    def weight_bytes(self) -> int:
        c = self.config
        n = c.num_parameters() * 2 + (2 * c.num_layers + 1) * c.hidden_size * 4
        n += c.num_layers * (2 * c.head_dim * 4 + (c.q_size + 2 * c.kv_size) * 4)   # qk norms, biases
        return n + 256 * (12 * c.num_layers + 8)                                       # alignment

    def activation_plan(self) -> dict[str, tuple[tuple[int, ...], type]]:
        b, c = self.b, self.config
        T, R = b.max_tokens, b.max_rows
        plan = {"residual": ((T, c.hidden_size), np.float32), "h": ((T, c.hidden_size), np.float32),
                "q": ((T, c.num_heads, c.head_dim), np.float32), "attn": ((T, c.num_heads, c.head_dim), np.float32),
                "act": ((T, c.intermediate_size), np.float32), "rows": ((R, c.hidden_size), np.float32),
                "normed_rows": ((R, c.hidden_size), np.float32), "argmax": ((R,), np.int32),
                "argmax_work": ((argmax.argmax_work_size(R),), np.uint64)}
        for n in {c.q_size + 2 * c.kv_size, c.hidden_size, 2 * c.intermediate_size}:
            plan[f"out{n}"] = ((T, n), np.float32)
        v = f"out{c.vocab_size}"        # the LM head's rows; a vocabulary equal to another width shares its buffer
        plan[v] = ((max(R, plan[v][0][0]) if v in plan else R, c.vocab_size), np.float32)
        scratch = attention.paged_attention_scratch_shape(T, c.num_heads, c.num_kv_heads, c.head_dim, b.max_model_len)
        plan["attn_scratch"] = (scratch, np.float32)
        if b.use_blas:
            from metrale.runtime.cuda.cublaslt import WORKSPACE_BYTES
            widest = max(c.hidden_size, c.intermediate_size, c.q_size)
            plan["x_bf16"] = ((T, widest), np.uint16)
            plan["blas_workspace"] = ((WORKSPACE_BYTES,), np.uint8)
        plan["norm_ss"] = ((2 * c.num_layers + 2,), np.uint64)    # carried RMSNorm sums, fixed point (gemm.SS_SCALE)
        half = model_rotary_dim(c) // 2                          # partial RoPE: the rotated dims only
        plan["cos"] = ((b.max_model_len, half), np.float32)
        plan["sin"] = ((b.max_model_len, half), np.float32)
        return plan

    def random_layout(self, seed: int) -> dict[str, tuple[tuple[int, ...], object]]:
        c, d = self.config, self.config.hidden_size
        out: dict[str, tuple[tuple[int, ...], object]] = {"embed": ((c.vocab_size, d), 0.5)}
        for i in range(c.num_layers):
            p = f"layers.{i}."
            out[p + "attn_norm"] = ((d,), "norm")
            out[p + "qkv"] = ((c.q_size + 2 * c.kv_size, d), d ** -0.5)
            out[p + "o"] = ((d, c.q_size), c.q_size ** -0.5)
            out[p + "mlp_norm"] = ((d,), "norm")
            out[p + "gate_up"] = ((2 * c.intermediate_size, d), d ** -0.5)
            out[p + "down"] = ((d, c.intermediate_size), c.intermediate_size ** -0.5)
            if c.qk_norm:
                out[p + "q_norm"] = ((c.head_dim,), "norm")
                out[p + "k_norm"] = ((c.head_dim,), "norm")
        out["final_norm"] = ((d,), "norm")
        if not c.tie_word_embeddings:
            out["lm_head"] = ((c.vocab_size, d), d ** -0.5)
        return out
