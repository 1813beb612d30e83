"""The Gemma 3 family on the CUDA backend: its part (GemmaCuda: the dense layout plus the two post
norms a layer, the sliding layers' RoPE tables) and its ops (GemmaCudaOps, a CudaOps mixin: the
ops gemma3_forward adds to the Llama ones, models/gemma.py).

Per layer: norm -> QKV GEMM -> per-head q/k RMSNorm + RoPE (the layer type's tables) + K/V store
-> attention scaled by query_pre_attn_scalar ** -0.5 -> o GEMM -> residual += RMSNorm(o)
(rms_norm_into_residual) -> norm -> gate_up GEMM -> gelu_tanh(gate) * up -> down GEMM -> residual
+= RMSNorm(down); the logits optionally softcapped. The norms' weights are stored as 1 + w by the loaders. Sliding layers run full
attention, which is exact while the context fits the window (the backend refuses a max_model_len
past it, as for Mistral). The dense op sequence's fusions (carried norm sums, mixed-step graphs,
quantized weights, the host a step ahead) are off: they were written for the Llama layer.
"""
from __future__ import annotations

import numpy as np

from kernels_numba import activation, rmsnorm
from metrale.models.gemma import local_rope
from metrale.models.rope import model_rotary_dim
from metrale.runtime.cuda_dense import DenseCuda


class GemmaCudaOps:
    """CudaOps mixin: the scaled embedding, the norm after a block, GeGLU, logit softcapping,
    per-layer-type RoPE."""

    def embed_scaled(self, weight, scale: float):
        out = self.embed(weight)
        rmsnorm.scale_rows(out, scale, stream=self.s)
        return out

    def norm_residual(self, x, norm_weight, residual):
        rmsnorm.rms_norm_into_residual(x, norm_weight, self.cfg.rms_norm_eps, residual, stream=self.s)
        return residual

    def gelu_tanh_mul(self, gate_up):
        out = self._buf("act")
        activation.gelu_tanh_mul(gate_up, out, stream=self.s)
        return out

    def softcap(self, x, cap: float):
        activation.softcap(x, cap, stream=self.s)
        return x

    def _rope(self, layer: int) -> tuple:
        if self.cfg.sliding_layers and self.cfg.sliding_layers[layer] and "cos_local" in self.b.act:
            return self.b.act["cos_local"], self.b.act["sin_local"]
        return self.b.cos, self.b.sin


class GemmaCuda(DenseCuda):
    ops = (GemmaCudaOps,)
    feeds_tokens = True            # embed_scaled is CudaOps.embed (which feeds) + a scale
    carries_norm_sums = mixed_graphs = quantized_weights = False

    def weight_bytes(self) -> int:
        c = self.config
        return super().weight_bytes() + c.num_layers * 2 * (c.hidden_size * 4 + 256) + (1 << 20)

    def activation_plan(self) -> dict[str, tuple[tuple[int, ...], type]]:
        plan = super().activation_plan()
        if self.config.local_rope_theta and any(self.config.sliding_layers):
            half = model_rotary_dim(self.config) // 2
            plan["cos_local"] = ((self.b.max_model_len, half), np.float32)
            plan["sin_local"] = ((self.b.max_model_len, half), np.float32)
        return plan

    def after_activations(self) -> None:
        if "cos_local" in self.b.act:
            cos, sin = local_rope(self.config).tables(self.b.max_model_len)
            self.b.act["cos_local"].copy_to_device(np.ascontiguousarray(cos, np.float32))
            self.b.act["sin_local"].copy_to_device(np.ascontiguousarray(sin, np.float32))

    def random_layout(self, seed: int) -> dict[str, tuple[tuple[int, ...], object]]:
        d, out = self.config.hidden_size, {}
        for name, entry in super().random_layout(seed).items():
            out[name] = entry
            if name.endswith(".o"):
                out[name[:-1] + "post_attn_norm"] = ((d,), "norm")
            elif name.endswith(".down"):
                out[name[:-4] + "post_mlp_norm"] = ((d,), "norm")
        return out
