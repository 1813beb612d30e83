"""Mixture-of-experts layers on the CUDA backend: the MoE ops every MoE family's CUDA part composes
(MoeCudaOps, a CudaOps mixin: router GEMM, `moe.route`, `moe.moe_experts`, shared experts, the
expert-parallel exchange), their buffers (moe_plan) and the Qwen3-MoE family's part (MoeCuda:
the dense Llama / Qwen3 attention of DenseCuda, some layers' MLP a routed MoE block).

The router's rows are zero-padded to a multiple of 64 at load (the GEMM's tiles); the logits view
keeps the first E columns. CUDA graphs: the MoE GEMM grids are fixed by the schedule capacity of
T*K slots, so a captured decode step replays for any routing (expert parallelism syncs the host
for its counts: eager only, the backend turns graphs off).
"""
from __future__ import annotations

import numpy as np

from kernels_numba import activation, gemm, moe, qkv
from kernels_numba.bf16 import to_bf16_bits
from metrale.models.config import ModelConfig
from metrale.models.moe import route_config
from metrale.runtime.cuda_dense import DenseCuda
from metrale.runtime.cuda_hybrid import GdnCudaOps, HybridCuda

PAD = 64        # GEMM output rows are padded to this (the router's E)


def padded(n: int) -> int:
    return -(-n // PAD) * PAD


class MoeCudaOps:
    """CudaOps mixin: moe_residual over the backend's fixed buffers (the part `b.part` holds the
    routing and the MoE workspace)."""

    def _product(self, x, weight, out, accumulate: bool = False):
        """out (+)= x @ bf16(weight).T into a given buffer (cuBLASLt or the Numba GEMMs)."""
        if self.b.blas_takes(x.shape[0], weight):
            self.b.blas_linear(x, weight, out, None, accumulate=accumulate)
        elif accumulate:
            gemm.linear_residual(x, weight, out, stream=self.s, skinny_max_t=self.b.skinny_max_t)
        else:
            gemm.linear(x, weight, out, stream=self.s, skinny_max_t=self.b.skinny_max_t)
        return out

    def moe_residual(self, h, layer, w, p, residual):
        c, b, s = self.cfg, self.b, self.s
        logits = self._product(h, w[p + "router"], self._buf("moe_router"))[:, :c.n_routed_experts]
        ids, weights = self._buf("moe_topk_ids"), self._buf("moe_topk_w")
        moe.route(logits, b.part.route_cfg, ids, weights, bias=w.get(p + "router_bias"), stream=s)
        gu, down = w[p + "experts_gate_up"], w[p + "experts_down"]
        if b.ep is None:
            moe.moe_experts(h, ids, weights, gu, down, residual, b.part.moe_ws, accumulate=True, stream=s)
        else:
            ep_experts(b, h, ids, weights, gu, down, residual)
        if p + "shared_gate_up" in w:
            sg = self._product(h, w[p + "shared_gate_up"], self._buf("moe_shared_gu"))
            act = self._buf("moe_shared_act")
            activation.silu_mul(sg, act, stream=s)
            if p + "shared_gate" not in w:
                self._product(act, w[p + "shared_down"], residual, accumulate=True)
            else:                    # Qwen: sigmoid(h @ shared_gate) scales the shared expert's rows
                out = self._product(act, w[p + "shared_down"], self._buf("moe_shared_out"))
                gate = self._product(h, w[p + "shared_gate"], self._buf("moe_shared_gate"))
                activation.sigmoid_gate_add(out, gate, residual, stream=s)
        return residual


def moe_plan(config: ModelConfig, max_tokens: int, num_local_experts: int,
             ep_world: int = 0) -> dict[str, tuple[tuple[int, ...], type]]:
    """The MoE buffers of one step of max_tokens rows (moe_*; ep_* with expert parallelism over
    ep_world ranks, 0 = none)."""
    c, T = config, max_tokens
    f32, i32 = np.float32, np.int32
    k, fm = c.num_experts_per_tok, c.moe_intermediate_size
    plan = {"moe_router": ((T, padded(c.n_routed_experts)), f32), "moe_topk_ids": ((T, k), i32),
            "moe_topk_w": ((T, k), f32)}
    if c.n_shared_experts:
        fs = shared_size(c)
        plan["moe_shared_gu"] = ((T, 2 * fs), f32)
        plan["moe_shared_act"] = ((T, fs), f32)
        if c.shared_expert_gate:
            plan["moe_shared_out"] = ((T, c.hidden_size), f32)
            plan["moe_shared_gate"] = ((T, PAD), f32)
    n = max(1, ep_world) * T * k          # expert rows of one layer call (EP: all ranks' slots)
    nb = max(1, -(-n // moe.SLOTS))
    tiles = moe.max_tiles(n, num_local_experts)
    e, d = num_local_experts, c.hidden_size
    plan.update({"moe_counts": ((nb, e), i32), "moe_base": ((nb, e), i32), "moe_offsets": ((e + 1,), i32),
                 "moe_tile_expert": ((tiles,), i32), "moe_tile_row": ((tiles,), i32),
                 "moe_sorted_slot": ((n,), i32), "moe_slot_row": ((n,), i32),
                 "moe_h": ((n, 2 * fm), f32), "moe_a": ((n, fm), f32), "moe_y": ((n, d), f32)})
    if ep_world:
        plan.update({"ep_send": ((T * k, d), f32), "ep_gather": ((T * k,), i32), "ep_slot_row": ((T * k,), i32),
                     "ep_ids": ((n, 1), i32), "ep_ones": ((n, 1), f32), "ep_out": ((n, d), f32)})
    return plan


def shared_size(config: ModelConfig) -> int:
    """The shared experts' intermediate size (Qwen names it, DeepSeek counts experts)."""
    return config.shared_intermediate_size or config.moe_intermediate_size * config.n_shared_experts


def moe_workspace(act: dict) -> moe.MoeWorkspace:
    """The MoE kernels' workspace over an activation plan's moe_* buffers (ep_ones set to 1)."""
    if "ep_ones" in act:
        act["ep_ones"].copy_to_device(np.ones(act["ep_ones"].shape, np.float32))
    return moe.MoeWorkspace(act["moe_counts"], act["moe_base"], act["moe_offsets"], act["moe_tile_expert"],
                            act["moe_tile_row"], act["moe_sorted_slot"], act["moe_slot_row"], act["moe_h"],
                            act["moe_a"], act["moe_y"])


PADDED = (".router", ".shared_gate")     # matrices of few rows, zero rows up to a multiple of 64


def pad_router(a: np.ndarray) -> np.ndarray:
    """A router [E, D] (or the shared expert's gate [1, D]) as bf16 bits, zero rows up to a multiple of 64."""
    pad = np.zeros((padded(a.shape[0]), a.shape[1]), np.float32)
    pad[:a.shape[0]] = a
    return to_bf16_bits(pad)


def moe_layer_layout(config: ModelConfig, p: str, num_local_experts: int) -> dict[str, tuple]:
    """name -> (shape, init) of one MoE layer's MLP in the CUDA layout (CudaPart.random_layout)."""
    c, d, fm = config, config.hidden_size, config.moe_intermediate_size
    out: dict[str, tuple] = {p + "router": ((padded(c.n_routed_experts), d), d ** -0.5)}
    if c.topk_method == "noaux_tc":
        out[p + "router_bias"] = ((c.n_routed_experts,), "bias")
    out[p + "experts_gate_up"] = ((num_local_experts, 2 * fm, d), d ** -0.5)
    out[p + "experts_down"] = ((num_local_experts, d, fm), fm ** -0.5)
    if c.n_shared_experts:
        fs = shared_size(c)
        out[p + "shared_gate_up"] = ((2 * fs, d), d ** -0.5)
        out[p + "shared_down"] = ((d, fs), fs ** -0.5)
        if c.shared_expert_gate:
            out[p + "shared_gate"] = ((PAD, d), d ** -0.5)
    return out


class MoeParallel:
    """A CudaPart mixin for MoE layers (placed before the part it extends): this rank's experts (all
    without expert parallelism), the routing and the MoE workspace (made once the activations
    exist); on a dense-MLP part (DenseCuda, HybridCuda) it swaps each MoE layer's MLP for the MoE
    block in the dims, bytes, buffers and layout."""

    def __init__(self, backend):
        super().__init__(backend)
        c, ep = backend.config, backend.ep
        self.num_local_experts = (ep.num_local if ep is not None else c.n_routed_experts) if c.is_moe else 0
        self.route_cfg = route_config(c) if c.is_moe else None
        self.moe_ws = None

    def gemm_dims(self) -> list[tuple[str, int]]:
        return [d for d in super().gemm_dims() if d[0] != "intermediate_size"] + self.moe_dims()

    def weight_bytes(self) -> int:
        return super().weight_bytes() + moe_bytes_delta(self.config, self.num_local_experts)

    def activation_plan(self) -> dict[str, tuple[tuple[int, ...], type]]:
        return with_shared_staging(super().activation_plan(), self.moe_buffers(), self.config)

    def random_layout(self, seed: int) -> dict[str, tuple[tuple[int, ...], object]]:
        return self.moe_layout(super().random_layout(seed))

    def moe_buffers(self) -> dict[str, tuple[tuple[int, ...], type]]:
        b = self.b
        world = b.ep.comm.world_size if b.ep is not None else 0
        return moe_plan(self.config, b.max_tokens, self.num_local_experts, world) if self.config.is_moe else {}

    def after_activations(self) -> None:
        if self.config.is_moe:
            self.moe_ws = moe_workspace(self.b.act)
        super().after_activations()

    def prepare(self, items):
        """The family's layout, the router and the shared expert's gate padded to 64 rows."""
        for name, array in items:
            if name.endswith(PADDED):
                yield name, pad_router(np.asarray(array, np.float32))
            else:
                yield from super().prepare(((name, array),))

    def export(self, items):
        """The canonical weights from float host arrays of the device layout (the padding dropped)."""
        c = self.config
        for name, host in super().export(items):
            if name.endswith(".router"):
                host = host[:c.n_routed_experts]
            elif name.endswith(".shared_gate"):
                host = host[:1]
            yield name, host

    def moe_dims(self) -> list[tuple[str, int]]:
        """gemm_dims of the MoE layers (the dense MLP's intermediate_size only where a layer has one)."""
        c = self.config
        dims = [("intermediate_size", c.intermediate_size)] if any(not c.is_moe_layer(i) for i in range(c.num_layers)) else []
        dims.append(("moe_intermediate_size", c.moe_intermediate_size))
        if c.n_shared_experts:
            dims.append(("shared expert intermediate size", shared_size(c)))
        return dims

    def moe_layout(self, layout: dict) -> dict:
        """A dense-MLP layout with each MoE layer's gate_up / down replaced by its MoE block."""
        c, out = self.config, {}
        for name, entry in layout.items():
            layer = name.split(".")[1] if name.startswith("layers.") else None
            if layer is not None and c.is_moe_layer(int(layer)) and name.endswith((".gate_up", ".down")):
                if name.endswith(".gate_up"):
                    out.update(moe_layer_layout(c, f"layers.{layer}.", self.num_local_experts))
                continue
            out[name] = entry
        return out

    def idle_step(self, num_layers: int | None) -> None:
        """A rank without tokens this step: serve its experts in every MoE layer."""
        b, c = self.b, self.config
        for i in range(c.num_layers if num_layers is None else num_layers):
            if c.is_moe_layer(i):
                p = f"layers.{i}."
                ep_experts(b, None, None, None, b.weights[p + "experts_gate_up"], b.weights[p + "experts_down"], None)


class MoeCuda(MoeParallel, DenseCuda):
    """The Qwen3-MoE family: DenseCuda's attention and dense layers, MoeCudaOps for the MoE layers.
    The dense op sequence's fusions (carried norm sums, mixed-step graphs, quantized weights, the
    host a step ahead) are off: they were written for a dense MLP in every layer."""
    ops = (MoeCudaOps,)
    carries_norm_sums = feeds_tokens = mixed_graphs = parallel_compile = quantized_weights = False


class HybridMoeCuda(MoeParallel, HybridCuda):
    """Qwen3-Next with MoE layers: HybridCuda's Gated DeltaNet and gated attention, MoeCudaOps for
    the MoE layers (the sigmoid-gated shared expert included)."""
    ops = (GdnCudaOps, MoeCudaOps)


def moe_bytes_delta(c: ModelConfig, num_local_experts: int) -> int:
    """Bytes past the dense parts' count: this rank's experts only, the padded router and gate."""
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_layers))
    n = -moe_layers * (c.n_routed_experts - num_local_experts) * 3 * c.hidden_size * c.moe_intermediate_size * 2
    return n + moe_layers * 2 * PAD * c.hidden_size * 2 + (1 << 20)


def with_shared_staging(plan: dict, moe_buffers: dict, c: ModelConfig) -> dict:
    """A dense plan plus the MoE buffers; cuBLASLt's bf16 input also stages the shared down's."""
    plan.update(moe_buffers)
    if "x_bf16" in plan and c.n_shared_experts:
        (rows, widest), dt = plan["x_bf16"]
        plan["x_bf16"] = ((rows, max(widest, shared_size(c))), dt)
    return plan


# ---------------------------------------------------------------- expert parallelism

def ep_experts(b, h, ids, weights, gu, down, residual) -> None:
    """residual[t] += sum_k w[t, k] * expert(h[t]) with the experts spread over the ranks of `b.ep`:
    token rows go to their experts' ranks (all_to_all_v on device buffers), this rank's experts run
    on what it received, the outputs come back and are summed in k order. ids None: a rank without
    tokens serving the others."""
    ep, a, s = b.ep, b.act, b.stream.numba
    t, k = (0, b.config.num_experts_per_tok) if ids is None else ids.shape
    flat = b._fetch(ids, np.empty((t, k), np.int32)).reshape(-1) if t else np.zeros(0, np.int32)
    dest = ep.owner(flat)
    order = np.argsort(dest, kind="stable").astype(np.int32)
    counts = np.bincount(dest, minlength=ep.comm.world_size).astype(np.int64)
    n = t * k
    send = a["ep_send"][:n]
    if n:
        slot_row = np.empty(n, np.int32)
        slot_row[order] = np.arange(n, dtype=np.int32)
        _copy_host_rows(b, a["ep_gather"][:n], order // k)
        _copy_host_rows(b, a["ep_slot_row"][:n], slot_row)
        qkv.gather_rows(h, a["ep_gather"][:n], send, stream=s)
    b.stream.synchronize()                     # NCCL runs on this stream too, but host inputs are staged
    on_device = bool(getattr(ep.comm, "device_buffers", False))   # else a host communicator (tests)
    rows, recv_counts = ep.comm.all_to_all_v(send if on_device else send.copy_to_host(), counts)
    rids, _ = ep.comm.all_to_all_v(flat[order], counts, recv_counts)
    m = int(recv_counts.sum())
    y = a["ep_out"][:m]                        # not moe_y: moe_experts un-permutes from there
    if m:
        rows = rows if hasattr(rows, "__cuda_array_interface__") else _to_device(rows)
        _copy_host_rows(b, a["ep_ids"][:m], (np.asarray(rids, np.int32) - ep.expert_range[0]).reshape(m, 1))
        moe.moe_experts(rows, a["ep_ids"][:m], a["ep_ones"][:m], gu, down, y, b.part.moe_ws, accumulate=False, stream=s)
        b.stream.synchronize()
    back, _ = ep.comm.all_to_all_v(y if on_device else y.copy_to_host(), recv_counts, counts)
    if n:
        back = back if hasattr(back, "__cuda_array_interface__") else _to_device(back)
        moe.unpermute(back, a["ep_slot_row"][:n], weights, residual, accumulate=True, stream=s)
        b.stream.synchronize()                 # `back` may be freed once this returns


def _copy_host_rows(b, device_array, host: np.ndarray) -> None:
    device_array.copy_to_device(np.ascontiguousarray(host), stream=b.stream.numba)


def _to_device(a: np.ndarray):
    from numba import cuda
    return cuda.to_device(np.ascontiguousarray(a))
