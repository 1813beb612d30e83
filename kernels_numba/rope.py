"""Rotary position embedding, in place on q [T, Hq, hd] and k [T, Hk, hd].

cos/sin tables are float32 [max_pos, rot/2] (rot = rotary dims, usually head_dim; with
rot < head_dim only the first rot dims rotate), built with every scaling by the engine's one RoPE
module (metrale.models.rope: Rope.tables). Pair i (i < rot/2) is
  interleaved=True  (GGUF / llama.cpp layout): (x[2i], x[2i+1])
  interleaved=False (HF layout, rotate_half):   (x[i], x[i + rot/2])
and becomes (x0*c - x1*s, x1*c + x0*s) with c, s = cos/sin[positions[t], i].
One block per token; threads stride over (head, pair).
"""

from __future__ import annotations

import numpy as np
from numba import cuda
from kernels_numba.jit import kernel as cached_jit

from kernels_numba.ptx import grid_trigger, grid_wait
from kernels_numba.bf16 import SIMULATOR

THREADS = 32 if SIMULATOR else 128


@cuda.jit(device=True)
def _rotate(x, t, h, i, half, interleaved, c, s):
    if interleaved:
        i0 = 2 * i
        i1 = i0 + 1
    else:
        i0 = i
        i1 = i + half
    x0 = x[t, h, i0]
    x1 = x[t, h, i1]
    x[t, h, i0] = x0 * c - x1 * s
    x[t, h, i1] = x1 * c + x0 * s


@cached_jit
def _rope_kernel(q, k, positions, cos, sin, interleaved):
    grid_wait()      # PDL: first, before any read of what an earlier kernel wrote
    grid_trigger()
    t = cuda.blockIdx.x
    pos = positions[t]
    half = cos.shape[1]
    nq = q.shape[1] * half
    nk = k.shape[1] * half
    for j in range(cuda.threadIdx.x, nq + nk, cuda.blockDim.x):
        jj = j if j < nq else j - nq
        h = jj // half
        i = jj - h * half
        c = cos[pos, i]
        s = sin[pos, i]
        if j < nq:
            _rotate(q, t, h, i, half, interleaved, c, s)
        else:
            _rotate(k, t, h, i, half, interleaved, c, s)


def rope_inplace(q, k, positions, cos, sin, interleaved: bool, stream=0) -> None:
    """q: float32 [T, Hq, hd]; k: float32 [T, Hk, hd] (any strides); positions: int32 [T];
    cos, sin: float32 [max_pos, rot/2] (metrale.models.rope.Rope.tables)."""
    if q.shape[0] == 0:
        return
    if 2 * cos.shape[1] > q.shape[2]:
        raise ValueError(f"rope: table width {cos.shape[1]} does not fit head_dim {q.shape[2]}")
    _rope_kernel[q.shape[0], THREADS, stream](q, k, positions, cos, sin, bool(interleaved))


def rope_ref(q, k, positions, cos, sin, interleaved: bool):
    """Returns rotated copies (q, k) as float32."""

    def rot(x):
        x = np.asarray(x, np.float64).copy()
        half = cos.shape[1]
        c = np.asarray(cos, np.float64)[positions][:, None, :]
        s = np.asarray(sin, np.float64)[positions][:, None, :]
        if interleaved:
            x0, x1 = x[..., 0 : 2 * half : 2].copy(), x[..., 1 : 2 * half : 2].copy()
            x[..., 0 : 2 * half : 2] = x0 * c - x1 * s
            x[..., 1 : 2 * half : 2] = x1 * c + x0 * s
        else:
            x0, x1 = x[..., :half].copy(), x[..., half : 2 * half].copy()
            x[..., :half] = x0 * c - x1 * s
            x[..., half : 2 * half] = x1 * c + x0 * s
        return x.astype(np.float32)

    positions = np.asarray(positions)
    return rot(q), rot(k)
