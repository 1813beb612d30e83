"""Hybrid (Gated DeltaNet + attention, Qwen3-Next style) models on the CUDA backend:
HybridCudaOps (the two ops llama_forward adds for hybrid layers) and HybridCudaBackend
(CudaBackend with the KV cache for attention layers only, partial RoPE tables, f32 conv
weights, and a device state pool, metrale/runtime/cuda/state_pool.py).

A GDN layer per step: lin_in GEMM (norm fused at one row) -> [record the verify blocks' raw
inputs into their checkpoints' trails] -> per pass: causal_conv1d, gdn_recurrent (segments
shorter than the pool's chunk, 64) and gdn_chunked (the others, only when the geometry has such
segments), state_norm_clamp (levers.state_norm_bound > 0), staging copies -> rms_norm_gated ->
the o GEMM with the residual. Attention layers: qkv_rope_store rotates the first rotary_dim dims
(the cos/sin tables are [max_pos, rot/2]) and attn_output_gate multiplies by sigmoid(gate).
CUDA graphs: decode and verify steps replay like dense ones: every launch reads fixed buffers,
the slots and trail ids come from the pool's device metadata, uploaded before the replay. A
step is split into several passes only when prefix caching stages snapshots inside prefill
segments, which only eager steps do.
"""
from __future__ import annotations

import logging

import numpy as np
from numba.cuda.cudadrv.driver import device_memset

from kernels_numba import argmax
from kernels_numba.bf16 import to_bf16_bits
from kernels_numba.flash_prefill import flash_config
from kernels_numba.gdn import (causal_conv1d, gdn_chunked, gdn_recurrent, record_trail, rms_norm_gated,
                               sigmoid_mul, state_norm_clamp)
from kernels_numba.random_init import fill_normal_bf16
from metrale.models.config import ModelConfig
from metrale.models.llama import llama_forward
from metrale.models.checkpoint import WeightStream
from metrale.runtime.batch import ForwardBatch
from metrale.runtime.cuda import Arena
from metrale.runtime.cuda.state_pool import DeviceStatePool, budget
from metrale.runtime.cuda_backend import CudaBackend, CudaOps, Geometry

log = logging.getLogger("metrale.cuda")

F32_WEIGHTS = (".lin_conv",)      # 2-D weights the kernels read as float32 (not a GEMM operand)


class HybridCudaOps(CudaOps):
    def sigmoid_mul(self, x, gate):
        out = self._buf("gate_out")
        sigmoid_mul(x, gate, out, stream=self.s)
        return out

    def gated_delta_net(self, proj, layer, conv_w, a_log, dt_bias, norm_w):
        c, st, s, T = self.cfg, self.b.states, self.s, self.g.tokens
        cd, vd, nv = c.linear_conv_dim, c.linear_value_dim, c.linear_num_value_heads
        x, z, gate_in = proj[:, :cd], proj[:, cd:cd + vd], proj[:, cd + vd:cd + vd + 2 * nv]
        conv_out, o, out = self._buf("gdn_conv"), self._buf("gdn_o"), self._buf("gdn_out")
        slots, trail_ids = st.step_slots(self.g.seqs)
        conv_state, ssm_state = st.conv_layers[layer], st.ssm_layers[layer]
        if st.num_checkpoints:
            record_trail(proj, self.seq_query_start, trail_ids, cd + vd, st.trail_x_layers[layer],
                         st.trail_ba_layers[layer], stream=s)
        passes = st.passes or [None]
        for p in passes:
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


def check_hybrid_shapes(c: ModelConfig) -> list[tuple[str, int]]:
    """The hybrid GEMM dimensions that must be multiples of 64 (the input projection's rows, the
    o projection's input, the attention gate's rows)."""
    dims = [("linear_proj_size (q|k|v|z|b|a rows)", c.linear_proj_size), ("linear value dim", c.linear_value_dim)]
    if c.attn_output_gate:
        dims.append(("q size (attention output gate)", c.q_size))
    return dims


class HybridCudaBackend(CudaBackend):
    """CudaBackend for config.is_hybrid: `states` is a DeviceStatePool with a slot per
    scheduler.max_num_seqs sequence, sized up front for the checkpoints and snapshots the engine
    will reserve (docs/hybrid.md)."""

    def __init__(self, config: ModelConfig, weights: WeightStream | None, *, cfg, random_seed: int = 0):
        if config.linear_key_head_dim > 128 or config.linear_value_head_dim > 128:
            raise ValueError("the CUDA GDN kernels support linear key/value head dims up to 128 "
                             f"(got {config.linear_key_head_dim}, {config.linear_value_head_dim})")
        self._hybrid_cfg = cfg
        self._graphed = False
        self.states: DeviceStatePool | None = None
        super().__init__(config, weights, cfg=cfg, random_seed=random_seed)
        if self.flash_prefill:   # Qwen3-Next's 256-dim heads: the mma prefill's tiles exceed 48 KB of shared memory
            try:
                flash_config(config.head_dim)
            except ValueError as exc:
                log.info("prefill attention: the FP32 kernel (%s)", exc)
                self.flash_prefill = False

    # ------------------------------------------------------------------ hooks
    def _gemm_dims(self) -> list[tuple[str, int]]:
        return super()._gemm_dims() + check_hybrid_shapes(self.config)

    def _weight_bytes(self) -> int:
        c = self.config
        per_gdn = c.linear_conv_dim * c.linear_conv_kernel_dim * 4 + (2 * c.linear_num_value_heads
                                                                      + c.linear_value_head_dim) * 4 + 8 * 256
        return super()._weight_bytes() + c.num_state_layers * per_gdn + (1 << 20)

    def _state_budget(self) -> int:
        cfg = self._hybrid_cfg
        return budget(self.config, cfg, int(cfg.scheduler.max_num_seqs), self.max_seqs, self.max_tokens,
                      self.block_size)[0]

    def _activation_plan(self) -> dict[str, tuple[tuple[int, ...], type]]:
        c, T = self.config, self.max_tokens
        plan = super()._activation_plan()
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

    def _activation_bytes(self) -> int:
        return super()._activation_bytes() + self._state_budget() + 4096

    def _alloc_activations(self) -> None:
        super()._alloc_activations()
        for name in ("gdn_conv", "gdn_o", "gdn_out", "gate_out"):   # rows a step skips stay finite
            device_memset(self.act[name], 0, self.act[name].nbytes)
        cfg, nbytes = self._hybrid_cfg, self._state_budget()
        acts = self.pool["activations"]
        arena = Arena("states", acts.reserve(nbytes), nbytes, self.pool._make_array)
        self.states = DeviceStatePool(self.config, self.weights, arena, self.stream,
                                      num_slots=int(cfg.scheduler.max_num_seqs), max_seqs=self.max_seqs,
                                      max_tokens=self.max_tokens,
                                      state_norm_bound=float(cfg.levers.state_norm_bound))
        _, expected = budget(self.config, cfg, self.states.num_slots, self.max_seqs, self.max_tokens, self.block_size)
        self.states.reserve(num_checkpoints=expected.num_checkpoints, max_trail=expected.max_trail,
                            num_snapshots=expected.num_snapshots, snapshot_every=expected.snapshot_every)
        self.states.on_realloc = self._drop_graphs

    def _drop_graphs(self) -> None:
        """The state pool moved: graphs captured with its old pointers are re-captured on use."""
        self.stream.synchronize()
        for graph in self.graphs.values():
            graph.close()
        self.graphs.clear()

    def _load_weights(self, weights: WeightStream | None, seed: int) -> dict:
        if weights is None:
            return self._random_weights(seed)
        arena, out = self.pool["weights"], {}
        for name, array in weights:
            if array.ndim == 2 and not name.endswith(F32_WEIGHTS):
                out[name] = arena.upload(to_bf16_bits(array))
            else:
                out[name] = arena.upload(np.ascontiguousarray(array, dtype=np.float32))
        return out

    def _random_weights(self, seed: int) -> dict:
        """Random weights of the config's shape, matrices filled on the device (the scales of
        models/hybrid.py's random_hf_hybrid_tensors)."""
        c, arena, out = self.config, self.pool["weights"], {}
        rng = np.random.default_rng(seed)
        d, f = c.hidden_size, c.intermediate_size

        def mat(name: str, rows: int, cols: int, std: float) -> None:
            a = arena.alloc((rows, cols), np.uint16)
            fill_normal_bf16(a.reshape(rows * cols), seed + len(out), std)
            out[name] = a

        def vec(name: str, values: np.ndarray) -> None:
            out[name] = arena.upload(np.ascontiguousarray(values, np.float32))

        def norm(n: int) -> np.ndarray:
            return 1.0 + 0.1 * rng.standard_normal(n)

        mat("embed", c.vocab_size, d, 0.5)
        for i in range(c.num_layers):
            p = f"layers.{i}."
            vec(p + "attn_norm", norm(d))
            if c.is_linear_layer(i):
                nv, vd = c.linear_num_value_heads, c.linear_value_dim
                mat(p + "lin_in", c.linear_proj_size, d, d ** -0.5)
                vec(p + "lin_conv", 0.5 * rng.standard_normal((c.linear_conv_dim, c.linear_conv_kernel_dim)))
                vec(p + "lin_a_log", np.log(rng.uniform(0.5, 8.0, nv)))
                vec(p + "lin_dt_bias", 0.5 * rng.standard_normal(nv))
                vec(p + "lin_norm", norm(c.linear_value_head_dim))
                mat(p + "o", d, vd, vd ** -0.5)
            else:
                mat(p + "qkv", c.q_size + 2 * c.kv_size, d, d ** -0.5)
                if c.attn_output_gate:
                    mat(p + "attn_gate", c.q_size, d, d ** -0.5)
                mat(p + "o", d, c.q_size, c.q_size ** -0.5)
                if c.qk_norm:
                    vec(p + "q_norm", norm(c.head_dim))
                    vec(p + "k_norm", norm(c.head_dim))
            vec(p + "mlp_norm", norm(d))
            mat(p + "gate_up", 2 * f, d, d ** -0.5)
            mat(p + "down", d, f, f ** -0.5)
        vec("final_norm", norm(d))
        if not c.tie_word_embeddings:
            mat("lm_head", c.vocab_size, d, d ** -0.5)
        return out

    # ------------------------------------------------------------------ forward
    def _geometry(self, batch: ForwardBatch, num_layers: int | None = None) -> tuple[Geometry, bool]:
        if num_layers is not None and num_layers < self.config.num_layers:
            raise ValueError("a hybrid model runs all its layers (a layer-prefix forward would advance only "
                             "some layers' recurrent states)")
        g, graphed = super()._geometry(batch, num_layers)
        self._graphed = graphed
        return g, graphed

    def _upload(self, batch: ForwardBatch, g: Geometry, token_src: np.ndarray | None = None) -> None:
        self.states.before_forward(batch, g.seqs, self._graphed)
        super()._upload(batch, g, token_src)

    def _run(self, g: Geometry) -> None:
        logits = llama_forward(HybridCudaOps(self, g), self.weights, self.config, g.num_layers)
        argmax.argmax_rows(logits, self.act["argmax"][:g.rows], self.act["argmax_work"], stream=self.stream.numba)

    def kv_tokens_that_fit(self, utilization: float = 0.9) -> int:
        from metrale.runtime.cuda import free_device_memory
        _, total = free_device_memory()
        left = utilization * total - self.pool.nbytes + self.num_blocks * self._kv_block_bytes()
        return int(max(0, left - (512 << 20)) // self.config.kv_bytes_per_token(2))

    def memory_report(self) -> dict:
        return {**super().memory_report(), **self.states.memory()}


def state_bytes_read_per_step(config: ModelConfig, batch: int) -> int:
    """Bytes of recurrent state one decode step reads (and writes) for `batch` sequences: the
    conv + SSM state of every GDN layer (a bandwidth-bound's third term beside weights and KV)."""
    return batch * config.state_bytes_per_slot(4)
