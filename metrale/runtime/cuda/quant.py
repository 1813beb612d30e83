"""Quantized weights on the device: the API the CUDA backend calls for a GGUF weight kept in its
block types (metrale.models.quantized.QuantizedTensor) instead of dequantized to bf16 at load.

  upload_quantized(tensor, stream) -> DeviceQuantized     repacked once (kernels_numba.quant_layout)
  quant_linear(x, dq, out, rows, stream, residual=None)   out[:rows] = x[:rows] @ W.T (+ residual)
  quant_embedding(ids, dq, out, stream)                   out[t] = W[ids[t]] (a quantized token_embd)
  upload_fp8(weight, scale, block) -> DeviceFP8           an FP8 e4m3 checkpoint weight and its scales
  fp8_linear(x, d, out, rows, stream, residual=None)      the same two paths for FP8 (kernels_numba.quant_fp8)

quant_linear picks the kernel by the number of rows: up to GEMV_MAX_ROWS (and what one launch's
shared memory holds, quant_gemv.max_rows) the GEMV that dequantizes in registers
(kernels_numba.quant_gemv), one launch a part and at most 8 rows a launch; above, the many-rows
path: every part dequantized into a bf16 scratch [N, K] (kernels_numba.quant_dequant), then the
bf16 GEMM (kernels_numba.gemm.linear; the backend may call its cuBLASLt plan on the scratch instead:
`dequantize_into`). The scratch is the caller's (`scratch`, uint16 >= N K elements, one for all
layers: `scratch_elems`), so a launch allocates nothing and can be captured in a CUDA graph; without
one a scratch is allocated (eager use only).

Row-stacked parts (the fused qkv of a Q4_K_M file: Q4_K q, k above Q6_K v) each write their own
output columns [row0, row0 + rows). x and out are float32, C-contiguous, 16-byte aligned rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda

from kernels_numba import gemm, quant_dequant, quant_fp8, quant_gemv
from kernels_numba.quant_layout import NAMES, PLANES, TYPES

__all__ = ["DevicePart", "DeviceQuantized", "upload_quantized", "quant_linear", "quant_embedding",
           "dequantize_into", "scratch_elems", "GEMV_MAX_ROWS", "DeviceFP8", "upload_fp8", "fp8_linear"]

GEMV_MAX_ROWS = quant_gemv.MAX_T


@dataclass(frozen=True)
class DevicePart:
    """One block type's rows [row0, row0 + rows) of the weight: its planes on the device (absent
    planes are a 1 x 16 filler the kernels never read) and the bytes they hold."""
    qtype: int
    rows: int
    cols: int
    row0: int
    planes: dict
    nbytes: int


@dataclass(frozen=True)
class DeviceQuantized:
    parts: tuple[DevicePart, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.rows for p in self.parts), self.parts[0].cols

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(NAMES[p.qtype] for p in self.parts)


def upload_quantized(tensor, stream=0) -> DeviceQuantized:
    """A QuantizedTensor (or anything with .parts of ggml_type / rows / cols / data) repacked and
    copied to the device. The copies are queued on `stream`; the host planes are kept alive by the
    returned value's device arrays only until the copies complete (synchronize before freeing)."""
    filler = cuda.to_device(np.zeros((1, 16), np.uint8), stream=stream)
    quant_dequant.ids_filler()              # made now, not at a first launch inside a capture
    parts, row0 = [], 0
    for p in tensor.parts:
        qtype = int(p.ggml_type)
        if qtype not in TYPES:
            raise ValueError(f"no CUDA kernels for ggml type {qtype}")
        host = p.repack() if hasattr(p, "repack") else _repack(qtype, p.data, p.cols)
        planes = {k: (filler if host[k] is None else cuda.to_device(host[k], stream=stream)) for k in PLANES}
        nbytes = sum(v.nbytes for v in host.values() if v is not None)
        parts.append(DevicePart(qtype, int(p.rows), int(p.cols), row0, planes, nbytes))
        row0 += int(p.rows)
    return DeviceQuantized(tuple(parts))


def _repack(qtype, data, cols):
    from kernels_numba.quant_layout import repack
    return repack(qtype, np.asarray(data), cols)


def scratch_elems(dq: DeviceQuantized) -> int:
    """uint16 elements of the many-rows path's bf16 scratch for this weight."""
    n, k = dq.shape
    return n * k


def dequantize_into(dq: DeviceQuantized, scratch, stream=0):
    """Every part of dq dequantized to bf16 into scratch (uint16, >= N K elements; flat or 2-D);
    returns the [N, K] view the bf16 GEMMs read."""
    n, k = dq.shape
    w = scratch.reshape(scratch.size)[:n * k].reshape(n, k) if scratch.ndim != 2 or tuple(scratch.shape) != (n, k) \
        else scratch
    for p in dq.parts:
        quant_dequant.dequant_bf16(p.planes, w, p.qtype, n_off=p.row0, stream=stream)
    return w


def _ptr(a) -> int:
    cai = getattr(a, "__cuda_array_interface__", None)
    return cai["data"][0] if cai else a._ary.__array_interface__["data"][0]    # the simulator's arrays


def _same(a, b) -> bool:
    return (a is b) or (_ptr(a) == _ptr(b) and tuple(a.shape) == tuple(b.shape))


def quant_linear(x, dq: DeviceQuantized, out, rows: int, stream=0, residual=None, *, bias=None,
                 scratch=None, gemv_max_rows: int | None = None) -> None:
    """out[:rows, :N] = x[:rows] @ W.T (+ bias) (+ residual[:rows]); residual may be out itself
    (the residual stream: out += x @ W.T). x float32 [>= rows, K], out float32 [>= rows, N]."""
    n, k = dq.shape
    assert x.shape[1] == k, f"quant_linear: x has {x.shape[1]} columns, the weight {dq.shape}"
    assert out.shape[1] == n and out.shape[0] >= rows and x.shape[0] >= rows, \
        f"quant_linear: out {tuple(out.shape)} for {rows} rows of {dq.shape}"
    if rows <= 0:
        return
    limit = GEMV_MAX_ROWS if gemv_max_rows is None else gemv_max_rows
    if rows <= limit:
        for p in dq.parts:
            step = quant_gemv.max_rows(p.qtype, k)
            for t0 in range(0, rows, step):
                t = min(step, rows - t0)
                quant_gemv.gemv(x[t0:t0 + t], p.planes, out[t0:t0 + t], t, qtype=p.qtype, n_off=p.row0,
                                bias=bias, residual=None if residual is None else residual[t0:t0 + t],
                                stream=stream)
        return
    if scratch is None:
        scratch = cuda.device_array(n * k, np.uint16, stream=stream)
    w = dequantize_into(dq, scratch, stream)
    xs, os_ = x[:rows], out[:rows]
    s = stream or None
    if residual is None:
        gemm.linear(xs, w, os_, bias, s)
        return
    if not _same(residual[:rows], os_):
        os_.copy_to_device(residual[:rows], stream=stream)
    gemm.linear_residual(xs, w, os_, bias, s)


def quant_embedding(ids, dq: DeviceQuantized, out, stream=0) -> None:
    """out[t, :] = W[ids[t], :] as float32 (zero rows for ids outside [0, N)). ids int32 [T] on the
    device, out float32 [>= T, K]. One part only (a token_embd is one tensor)."""
    if len(dq.parts) != 1:
        raise ValueError(f"quant_embedding: a one-part weight, got parts {dq.types}")
    p = dq.parts[0]
    quant_dequant.gather_rows(p.planes, ids, out, p.qtype, stream=stream)


# ----------------------------------------------------------------------------- FP8 e4m3
@dataclass(frozen=True)
class DeviceFP8:
    """An FP8 e4m3 weight on the device: q uint8 [N, K] (the checkpoint's bytes), S float32 scales
    [ceil(N / bn), ceil(K / bk)] (quant_fp8.scale_grid: per tensor, per channel or per block)."""
    q: object
    S: object
    bn: int
    bk: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def nbytes(self) -> int:
        return int(self.q.size + 4 * self.S.size)


def upload_fp8(weight, scale, block: tuple[int, int] | None = None, stream=0) -> DeviceFP8:
    """weight: float8_e4m3fn [N, K] (or its uint8 bytes); scale: scalar, [N] / [N, 1], or the block
    grid of `block` = quantization_config.weight_block_size (weight_scale_inv multiplies)."""
    q = np.ascontiguousarray(np.asarray(weight).view(np.uint8))
    N, K = q.shape
    S, bn, bk = quant_fp8.scale_grid(scale, N, K, block)
    return DeviceFP8(cuda.to_device(q, stream=stream), cuda.to_device(S, stream=stream), bn, bk)


def fp8_linear(x, d: DeviceFP8, out, rows: int, stream=0, residual=None, *, bias=None, scratch=None,
               gemv_max_rows: int | None = None) -> None:
    """out[:rows] = x[:rows] @ (e4m3(q) S).T (+ bias) (+ residual[:rows], which may be out): the
    FP8 GEMV up to gemv_max_rows (8) rows, else the bf16 dequantization into scratch + the bf16 GEMM."""
    n, k = d.shape
    assert x.shape[1] == k and out.shape[1] == n and out.shape[0] >= rows and x.shape[0] >= rows
    if rows <= 0:
        return
    limit = quant_fp8.MAX_T if gemv_max_rows is None else min(gemv_max_rows, quant_fp8.MAX_T)
    if rows <= limit:
        quant_fp8.fp8_gemv(x, d.q, d.S, out, rows, bn=d.bn, bk=d.bk, bias=bias, residual=residual, stream=stream)
        return
    if scratch is None:
        scratch = cuda.device_array(n * k, np.uint16, stream=stream)
    w = scratch.reshape(scratch.size)[:n * k].reshape(n, k) if tuple(scratch.shape) != (n, k) else scratch
    quant_fp8.dequant_bf16(d.q, d.S, w, bn=d.bn, bk=d.bk, stream=stream)
    xs, os_ = x[:rows], out[:rows]
    if residual is None:
        gemm.linear(xs, w, os_, bias, stream or None)
        return
    if not _same(residual[:rows], os_):
        os_.copy_to_device(residual[:rows], stream=stream)
    gemm.linear_residual(xs, w, os_, bias, stream or None)
