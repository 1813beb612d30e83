"""The hybrid family (Gated DeltaNet + attention, Qwen3-Next style) on the CUDA backend: its part
(HybridCuda: the dense layout plus GDN weights, buffers and shape checks; its STATE cache is the
device state pool, runtime/cuda/state_pool.py) and its ops (GdnCudaOps, a CudaOps mixin).

A GDN layer per step: lin_in GEMM (norm fused at one row) -> [record the verify blocks' raw
inputs into their checkpoints' trails] -> per pass: causal_conv1d, gdn_recurrent (segments
shorter than the pool's chunk, 64) and gdn_chunked (the others, only when the geometry has such
segments), state_norm_clamp (state.norm_bound > 0), staging copies -> rms_norm_gated ->
the o GEMM with the residual. Attention layers: qkv_rope_store rotates the first rotary_dim dims
(the cos/sin tables are [max_pos, rot/2]) and attn_output_gate multiplies by sigmoid(gate).
CUDA graphs: decode and verify steps replay like dense ones (every launch reads fixed buffers; the
slots and trail ids come from the pool's device metadata, uploaded before the replay). A step is
split into several passes only when prefix caching stages snapshots inside prefill segments,
which only eager steps do.
"""
from __future__ import annotations

import numpy as np
from numba.cuda.cudadrv.driver import device_memset

from kernels_numba.gdn import (causal_conv1d, gdn_chunked, gdn_recurrent, record_trail, rms_norm_gated,
                               sigmoid_mul, state_norm_clamp)
from metrale.runtime.cuda_dense import DenseCuda

GDN_BUFFERS = ("gdn_conv", "gdn_o", "gdn_out", "gate_out")


class GdnCudaOps:
    """CudaOps mixin: the attention output gate and the Gated DeltaNet mixer over `b.states`."""

    def sigmoid_mul(self, x, gate):
        out = self._buf("gate_out")
        sigmoid_mul(x, gate, out, stream=self.s)
        return out

    def gated_delta_net(self, proj, layer, conv_w, a_log, dt_bias, norm_w):
        c, st, s = self.cfg, self.b.states, self.s
        cd, vd, nv = c.linear_conv_dim, c.linear_value_dim, c.linear_num_value_heads
        x, gate_in = proj[:, :cd], proj[:, cd + vd:cd + vd + 2 * nv]
        z = proj[:, cd:cd + vd]
        conv_out, o, out = self._buf("gdn_conv"), self._buf("gdn_o"), self._buf("gdn_out")
        slots, trail_ids = st.step_slots(self.g.seqs)
        conv_state, ssm_state = st.conv_layers[layer], st.ssm_layers[layer]
        if st.num_checkpoints:
            record_trail(proj, self.seq_query_start, trail_ids, cd + vd, st.trail_x_layers[layer],
                         st.trail_ba_layers[layer], stream=s)
        for p in st.passes or [None]:
            sqs, sl = (self.seq_query_start, slots) if p is None else (p.seq_query_start, p.state_slots)
            causal_conv1d(x, conv_w, conv_state, sqs, sl, self.positions, conv_out, stream=s)
            gdn_recurrent(conv_out, gate_in, a_log, dt_bias, ssm_state, sqs, sl, self.positions, o,
                          max_len=st.chunk - 1, stream=s)
            if self.g.max_query_len >= st.chunk:
                gdn_chunked(conv_out, gate_in, a_log, dt_bias, ssm_state, sqs, sl, self.positions, o,
                            min_len=st.chunk, stream=s)
            if st.state_norm_bound > 0:
                state_norm_clamp(ssm_state, sl, st.state_norm_bound, stream=s)
            for slot, sid in ([] if p is None else p.stage):
                st.copy_layer(layer, slot, sid)
        rms_norm_gated(o, z, norm_w, c.rms_norm_eps, out, stream=s)
        return out


class HybridCuda(DenseCuda):
    ops = (GdnCudaOps,)
    carries_norm_sums = feeds_tokens = mixed_graphs = parallel_compile = False   # written for the dense op sequence only
    f32_weights = (".lin_conv",)     # the conv taps: read as float32 by causal_conv1d

    def check(self) -> None:
        c = self.config
        if c.linear_key_head_dim > 128 or c.linear_value_head_dim > 128:
            raise ValueError("the CUDA GDN kernels support linear key/value head dims up to 128 "
                             f"(got {c.linear_key_head_dim}, {c.linear_value_head_dim})")

    def gemm_dims(self) -> list[tuple[str, int]]:
        c = self.config
        dims = [("linear_proj_size (q|k|v|z|b|a rows)", c.linear_proj_size), ("linear value dim", c.linear_value_dim)]
        if c.attn_output_gate:
            dims.append(("q size (attention output gate)", c.q_size))
        return super().gemm_dims() + dims

    def weight_bytes(self) -> int:
        c = self.config
        per_gdn = c.linear_conv_dim * c.linear_conv_kernel_dim * 4 + (2 * c.linear_num_value_heads
                                                                      + c.linear_value_head_dim) * 4 + 8 * 256
        return super().weight_bytes() + c.num_state_layers * per_gdn + (1 << 20)

    def activation_plan(self) -> dict[str, tuple[tuple[int, ...], type]]:
        c, T = self.config, self.b.max_tokens
        plan = super().activation_plan()
        for n in (c.linear_proj_size, c.q_size):
            plan[f"out{n}"] = ((T, n), np.float32)
        plan["gdn_conv"] = ((T, c.linear_conv_dim), np.float32)
        plan["gdn_o"] = ((T, c.linear_value_dim), np.float32)
        plan["gdn_out"] = ((T, c.linear_value_dim), np.float32)
        plan["gate_out"] = ((T, c.q_size), np.float32)
        if "x_bf16" in plan:     # cuBLASLt's bf16 input also stages the o projection's [T, value_dim]
            (rows, widest), dt = plan["x_bf16"]
            plan["x_bf16"] = ((rows, max(widest, c.linear_value_dim, c.q_size)), dt)
        return plan

    def after_activations(self) -> None:
        for name in GDN_BUFFERS:       # rows a step skips stay finite
            device_memset(self.b.act[name], 0, self.b.act[name].nbytes)

    def random_layout(self, seed: int) -> dict[str, tuple[tuple[int, ...], object]]:
        """The scales of models/hybrid.py's random_hf_hybrid_tensors; vectors drawn here, matrices
        filled on the device."""
        c, rng = self.config, np.random.default_rng(seed)
        d, f = c.hidden_size, c.intermediate_size

        def norm(n: int) -> tuple[tuple[int, ...], np.ndarray]:
            return (n,), 1.0 + 0.1 * rng.standard_normal(n)

        out: dict[str, tuple[tuple[int, ...], object]] = {"embed": ((c.vocab_size, d), 0.5)}
        for i in range(c.num_layers):
            p = f"layers.{i}."
            out[p + "attn_norm"] = norm(d)
            if c.is_linear_layer(i):
                nv, vd = c.linear_num_value_heads, c.linear_value_dim
                conv = (c.linear_conv_dim, c.linear_conv_kernel_dim)
                out[p + "lin_in"] = ((c.linear_proj_size, d), d ** -0.5)
                out[p + "lin_conv"] = (conv, 0.5 * rng.standard_normal(conv))
                out[p + "lin_a_log"] = ((nv,), np.log(rng.uniform(0.5, 8.0, nv)))
                out[p + "lin_dt_bias"] = ((nv,), 0.5 * rng.standard_normal(nv))
                out[p + "lin_norm"] = norm(c.linear_value_head_dim)
                out[p + "o"] = ((d, vd), vd ** -0.5)
            else:
                out[p + "qkv"] = ((c.q_size + 2 * c.kv_size, d), d ** -0.5)
                if c.attn_output_gate:
                    out[p + "attn_gate"] = ((c.q_size, d), d ** -0.5)
                out[p + "o"] = ((d, c.q_size), c.q_size ** -0.5)
                if c.qk_norm:
                    out[p + "q_norm"] = norm(c.head_dim)
                    out[p + "k_norm"] = norm(c.head_dim)
            out[p + "mlp_norm"] = norm(d)
            out[p + "gate_up"] = ((2 * f, d), d ** -0.5)
            out[p + "down"] = ((d, f), f ** -0.5)
        out["final_norm"] = norm(d)
        if not c.tie_word_embeddings:
            out["lm_head"] = ((c.vocab_size, d), d ** -0.5)
        return out
