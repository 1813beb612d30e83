"""Gated MLP activations: out = silu(gate) * up (SwiGLU) or gelu_tanh(gate) * up (Gemma's GeGLU),
with gate_up = [gate | up] along the last axis.

Grid (T, ceil(F / threads)); one element per thread; fp32 math.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda
from kernels_numba.jit import kernel as cached_jit

from kernels_numba.ptx import grid_trigger, grid_wait
from kernels_numba.bf16 import SIMULATOR, device_function
from kernels_numba.ptx import pack_bf16x2

THREADS = 32 if SIMULATOR else 256


@device_function
def silu_mul_at(gate_up, t, f, n):
    """silu(gate_up[t, f]) * gate_up[t, f + n]."""
    g = gate_up[t, f]
    return g / (np.float32(1.0) + math.exp(-g)) * gate_up[t, f + n]


@cached_jit
def _silu_mul_kernel(gate_up, out):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    t = cuda.blockIdx.x
    f = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    n = out.shape[1]
    if f < n:
        out[t, f] = silu_mul_at(gate_up, t, f, n)


@cached_jit
def _silu_mul_bf16_kernel(gate_up, out32):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    t = cuda.blockIdx.x
    p = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    n = 2 * out32.shape[1]
    if p < out32.shape[1]:
        f = 2 * p
        out32[t, p] = pack_bf16x2(silu_mul_at(gate_up, t, f, n), silu_mul_at(gate_up, t, f + 1, n))


def silu_mul_bf16(gate_up, out_u16, stream=0) -> None:
    """silu_mul into bf16 bits (room for T*F values, row-major [T, F]; F even): the input of a
    library matmul that takes bf16, without a separate conversion pass."""
    t, f2 = gate_up.shape
    f = f2 // 2
    if t == 0:
        return
    assert f % 2 == 0 and out_u16.size >= t * f
    out32 = out_u16.reshape(out_u16.size)[:t * f].view(np.uint32).reshape(t, f // 2)
    _silu_mul_bf16_kernel[(t, (f // 2 + THREADS - 1) // THREADS), THREADS, stream](gate_up, out32)


def _gated(kernel, name: str, gate_up, out, stream) -> None:
    """One gated activation kernel over [T, 2F] -> [T, F], one element a thread."""
    t, f = out.shape
    if t == 0 or f == 0:
        return
    if gate_up.shape[1] != 2 * f:
        raise ValueError(f"{name}: gate_up {gate_up.shape} does not match out {out.shape}")
    kernel[(t, (f + THREADS - 1) // THREADS), THREADS, stream](gate_up, out)


def silu_mul(gate_up, out, stream=0) -> None:
    """gate_up: float32 [T, 2F]; out: float32 [T, F]."""
    _gated(_silu_mul_kernel, "silu_mul", gate_up, out, stream)


@cached_jit
def _gelu_tanh_mul_kernel(gate_up, out):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    t = cuda.blockIdx.x
    f = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    n = out.shape[1]
    if f < n:
        g = gate_up[t, f]
        inner = np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g * g * g)
        out[t, f] = np.float32(0.5) * g * (np.float32(1.0) + math.tanh(inner)) * gate_up[t, f + n]


def gelu_tanh_mul(gate_up, out, stream=0) -> None:
    """gate_up: float32 [T, 2F]; out: float32 [T, F] = gelu_tanh(gate) * up (GELU's tanh form)."""
    _gated(_gelu_tanh_mul_kernel, "gelu_tanh_mul", gate_up, out, stream)


@cached_jit
def _softcap_kernel(x, cap):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    t = cuda.blockIdx.x
    f = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if f < x.shape[1]:
        x[t, f] = cap * math.tanh(x[t, f] / cap)


def softcap(x, cap: float, stream=0) -> None:
    """x = cap * tanh(x / cap) in place (final logit softcapping). x: float32 [T, N]."""
    t, n = x.shape
    if t and n:
        _softcap_kernel[(t, (n + THREADS - 1) // THREADS), THREADS, stream](x, np.float32(cap))


@cached_jit
def _sigmoid_gate_add_kernel(x, gate, residual):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    t = cuda.blockIdx.x
    f = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if f < x.shape[1]:
        residual[t, f] += x[t, f] / (np.float32(1.0) + math.exp(-gate[t, 0]))


def sigmoid_gate_add(x, gate, residual, stream=0) -> None:
    """residual += x * sigmoid(gate[:, 0]) (a row-gated block output: Qwen's shared expert). x,
    residual: float32 [T, D]; gate: float32 [T, >= 1]."""
    t, n = x.shape
    if t and n:
        _sigmoid_gate_add_kernel[(t, (n + THREADS - 1) // THREADS), THREADS, stream](x, gate, residual)


def gelu_tanh_mul_ref(gate_up: np.ndarray) -> np.ndarray:
    x = np.asarray(gate_up, np.float64)
    f = x.shape[1] // 2
    g, u = x[:, :f], x[:, f:]
    return (0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3))) * u).astype(np.float32)


def silu_mul_ref(gate_up: np.ndarray) -> np.ndarray:
    x = np.asarray(gate_up, np.float64)
    f = x.shape[1] // 2
    g, u = x[:, :f], x[:, f:]
    return (g / (1.0 + np.exp(-g)) * u).astype(np.float32)
