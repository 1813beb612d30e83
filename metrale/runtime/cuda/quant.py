"""Quantized weights on the device: the API the CUDA backend calls for a GGUF weight kept in its
block types (metrale.models.quantized.QuantizedTensor) instead of dequantized to bf16 at load.

  upload_quantized(tensor, stream) -> DeviceQuantized     repacked once (kernels_numba.quant_layout)
  quant_linear(x, dq, out, rows, stream, residual=None)   out[:rows] = x[:rows] @ W.T (+ residual)
  quant_embedding(ids, dq, out, stream)                   out[t] = W[ids[t]] (a quantized token_embd)
  upload_fp8(weight, scale, block) -> DeviceFP8           an FP8 e4m3 checkpoint weight and its scales
  fp8_linear(x, d, out, rows, stream, residual=None)      quant_linear on a DeviceFP8 (kernels_numba.quant_fp8)

quant_linear picks the kernel by the number of rows: up to GEMV_MAX_ROWS (and what one launch's
shared memory holds, quant_gemv.max_rows) the GEMV that dequantizes in registers
(kernels_numba.quant_gemv), one launch a part and at most 8 rows a launch; above, the many-rows
path: every part dequantized into a bf16 scratch [N, K] (kernels_numba.quant_dequant), then the
bf16 GEMM (kernels_numba.gemm.linear; the backend may call its cuBLASLt plan on the scratch instead:
`dequantize_into`). The scratch is the caller's (`scratch`, uint16 >= N K elements, one for all
layers: `scratch_elems`), so a launch allocates nothing and can be captured in a CUDA graph; without
one a scratch is allocated (eager use only).

quant_linear, dequantize_into, row_chunks and QuantOps take a DeviceFP8 where they take a
DeviceQuantized: its GEMV (quant_fp8.fp8_gemv, up to quant_fp8.MAX_T rows) in place of the block
types' kernels, its bf16 dequantization (quant_fp8.dequant_bf16) on the same many-rows road.

Row-stacked parts (the fused qkv of a Q4_K_M file: Q4_K q, k above Q6_K v) each write their own
output columns [row0, row0 + rows). x and out are float32, C-contiguous, 16-byte aligned rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numba import cuda

from kernels_numba import gemm, quant_dequant, quant_fp8, quant_gemv, quant_mma
from kernels_numba.quant_layout import NAMES, PLANES, TYPES
from metrale.models.fp8 import FP8_E4M3

__all__ = ["DevicePart", "DeviceQuantized", "upload_quantized", "quant_linear", "quant_embedding",
           "dequantize_into", "scratch_elems", "GEMV_MAX_ROWS", "DeviceFP8", "upload_fp8", "upload_fp8_tensor",
           "fp8_linear", "device_bytes_bound", "SCRATCH_MAX_ELEMS", "plan_scratch", "QuantOps"]

GEMV_MAX_ROWS = quant_gemv.MAX_T
ALIGN = 256                      # the pool's allocation alignment (runtime/cuda/pool.py)
SCRATCH_MAX_ELEMS = 1 << 27      # bf16 values (256 MB) the many-rows scratch holds at most; a larger
                                 # weight (a 128K-vocabulary lm_head) is dequantized a row chunk at a time


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

    @property
    def fragments(self) -> bool:
        """Q4_K in quant_mma's fragment layout (planes 'mq', 'ms'; read by its kernels only)."""
        return "mq" in self.planes


@dataclass(frozen=True)
class DeviceQuantized:
    """A quantized weight on the device: row-stacked parts. host: the QuantizedTensor it came from
    (file bytes in the memory map: export_weights dequantizes it); chunks: row chunks made on use."""
    parts: tuple[DevicePart, ...]
    host: object = field(default=None, compare=False, repr=False)
    chunks: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.rows for p in self.parts), self.parts[0].cols

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(NAMES[p.qtype] for p in self.parts)


def upload_quantized(tensor, stream=0, arena=None, fragments: bool = False) -> DeviceQuantized:
    """A QuantizedTensor (or anything with .parts of ggml_type / rows / cols / data) repacked and
    copied to the device: into `arena` (a DevicePool region: at most device_bytes_bound(tensor)
    bytes of it) or, without one, fresh device arrays. The copies are queued on `stream`; the host
    planes are kept alive by the returned value's device arrays only until the copies complete
    (synchronize before freeing). fragments: Q4_K parts in quant_mma's fragment layout (for a
    linear weight: its GEMV is then the tensor-core one at every row count; not for an embedding)."""
    put = (lambda a: cuda.to_device(a, stream=stream)) if arena is None else (lambda a: arena.upload(a, stream))
    filler = put(np.zeros((1, 16), np.uint8))
    quant_dequant.ids_filler()              # made now, not at a first launch inside a capture
    parts, row0 = [], 0
    for p in tensor.parts:
        qtype = int(p.ggml_type)
        if qtype not in TYPES:
            raise ValueError(f"no CUDA kernels for ggml type {_type_name(qtype)} (they cover "
                             f"{', '.join(NAMES.values())}); use levers.weights=bf16")
        mma = quant_mma.supports(qtype, int(p.cols))
        if mma:
            quant_mma.x_buffers(int(p.cols))       # made now, not at a first launch inside a capture
        if fragments and mma and qtype == quant_mma.Q4_K:
            host = quant_mma.repack_mq(np.asarray(p.data), int(p.cols))
            planes = {k: put(v) for k, v in host.items()}
        else:
            host = p.repack() if hasattr(p, "repack") else _repack(qtype, p.data, p.cols)
            planes = {k: (filler if host[k] is None else put(host[k])) for k in PLANES}
        nbytes = sum(v.nbytes for v in host.values() if v is not None)
        parts.append(DevicePart(qtype, int(p.rows), int(p.cols), row0, planes, nbytes))
        row0 += int(p.rows)
    return DeviceQuantized(tuple(parts), host=tensor)


def _type_name(qtype: int) -> str:
    try:
        import gguf
        return gguf.GGMLQuantizationType(qtype).name
    except (ImportError, ValueError):
        return str(qtype)


def device_bytes_bound(parts) -> int:
    """Arena bytes upload_quantized takes at most for a weight of `parts`, (ggml type, rows, cols)
    triples: the file's bytes (the planes hold exactly those) plus each allocation's alignment; for
    an FP8 weight (FP8_E4M3, rows, cols, scale values) upload_fp8's bytes and scales."""
    from kernels_numba.quant_layout import BLOCK
    if parts and parts[0][0] == FP8_E4M3:
        return sum(rows * cols + 4 * scales + 2 * ALIGN for _, rows, cols, scales in parts)
    n = ALIGN                                                      # the filler
    for qtype, rows, cols in parts:
        if qtype not in BLOCK:
            raise ValueError(f"no CUDA kernels for ggml type {_type_name(qtype)}; use levers.weights=bf16")
        block, nbytes = BLOCK[qtype]
        rows = -(-rows // 16) * 16          # the fragment layout pads to whole tiles
        n += rows * (cols // block) * nbytes + len(PLANES) * ALIGN
    return n


def plan_scratch(shapes, max_tokens: int, max_rows: int, cap: int | None = None) -> int:
    """bf16 elements of the many-rows scratch for quantized weights of `shapes` ({name: (N, K)}): the
    largest N K (at most `cap`, and at least 64 rows of the widest K), or 0 when no step can exceed
    GEMV_MAX_ROWS rows (embed and lm_head see max_rows rows, the rest max_tokens)."""
    need = [n * k for name, (n, k) in shapes.items()
            if (max_rows if name in ("embed", "lm_head") else max_tokens) > GEMV_MAX_ROWS]
    if not need:
        return 0
    cap = SCRATCH_MAX_ELEMS if cap is None else cap
    widest = max(k for _, k in shapes.values())
    return max(min(max(need), cap), 64 * widest)


def _repack(qtype, data, cols):
    from kernels_numba.quant_layout import repack
    return repack(qtype, np.asarray(data), cols)


def scratch_elems(dq: DeviceQuantized) -> int:
    """uint16 elements of the many-rows path's bf16 scratch for this weight."""
    n, k = dq.shape
    return n * k


def dequantize_into(dq: "DeviceQuantized | DeviceFP8", scratch, stream=0):
    """Every part of dq (or a DeviceFP8) dequantized to bf16 into scratch (uint16, >= N K elements;
    flat or 2-D); returns the [N, K] view the bf16 GEMMs read."""
    n, k = dq.shape
    w = scratch.reshape(scratch.size)[:n * k].reshape(n, k) if scratch.ndim != 2 or tuple(scratch.shape) != (n, k) \
        else scratch
    if isinstance(dq, DeviceFP8):
        quant_fp8.dequant_bf16(dq.q, dq.S, w, bn=dq.bn, bk=dq.bk, stream=stream)
        return w
    for p in dq.parts:
        if p.fragments:
            quant_mma.dequant_mq_bf16(p.planes, w, p.rows, n_off=p.row0, stream=stream)
        else:
            quant_dequant.dequant_bf16(p.planes, w, p.qtype, n_off=p.row0, stream=stream)
    return w


def _ptr(a) -> int:
    cai = getattr(a, "__cuda_array_interface__", None)
    return cai["data"][0] if cai else a._ary.__array_interface__["data"][0]    # the simulator's arrays


def _same(a, b) -> bool:
    return (a is b) or (_ptr(a) == _ptr(b) and tuple(a.shape) == tuple(b.shape))


PLANES_MMA_MIN_ROWS = 2     # at one row the planes' tensor-core GEMV loses to dp4a (docs/quant.md)


def _mma_roads(dq: DeviceQuantized, rows: int, mma_rows: int, limit: int) -> tuple[bool, bool]:
    """(any part on a tensor-core GEMV, parts on planes among them) for a product of `rows` rows."""
    few = rows <= min(limit, quant_mma.MAX_T)
    planes_mma = 0 < mma_rows and max(mma_rows, PLANES_MMA_MIN_ROWS) <= rows and few
    if few:
        k = dq.shape[1]
        return any(p.fragments or (planes_mma and quant_mma.supports(p.qtype, k)) for p in dq.parts), planes_mma
    many = rows <= gemv_rows(dq, mma_rows)      # 9 to 64 rows: every part has a kernel of n-tiles
    return many, many


def takes_mma(dq: "DeviceQuantized | DeviceFP8", rows: int, mma_rows: int) -> bool:
    """Whether quant_linear runs this product on the tensor-core GEMV (x quantized by quantize_x, or
    beforehand by norm_quantize_x when it is called with quantized=True); never for FP8."""
    return rows > 0 and not isinstance(dq, DeviceFP8) and _mma_roads(dq, rows, mma_rows, GEMV_MAX_ROWS)[0]


def quant_linear(x, dq: "DeviceQuantized | DeviceFP8", out, rows: int, stream=0, residual=None, *, bias=None,
                 scratch=None, gemv_max_rows: int | None = None, mma_rows: int = 0,
                 quantized: bool = False) -> None:
    """out[:rows, :N] = x[:rows] @ W.T (+ bias) (+ residual[:rows]); residual may be out itself
    (the residual stream: out += x @ W.T). x float32 [>= rows, K], out float32 [>= rows, N].
    mma_rows: from this many rows (up to quant_mma.MAX_T; 0: never), and never below
    PLANES_MMA_MIN_ROWS, parts of a type quant_mma covers run on the tensor-core GEMV (x quantized
    once for all of them); parts in the fragment layout always do; from 9 to 64 rows the tensor-core kernels of n-tiles take the product when
    every part has one (gemv_rows), else the many-rows road. quantized: quant_mma.x_buffers already
    hold x's rows quantized (norm_quantize_x; only where takes_mma says the product goes there).
    A DeviceFP8: its GEMV up to quant_fp8.MAX_T rows (x as it is: float32), else the many-rows road."""
    n, k = dq.shape
    assert x.shape[1] == k, f"quant_linear: x has {x.shape[1]} columns, the weight {dq.shape}"
    assert out.shape[1] == n and out.shape[0] >= rows and x.shape[0] >= rows, \
        f"quant_linear: out {tuple(out.shape)} for {rows} rows of {dq.shape}"
    if rows <= 0:
        return
    limit = GEMV_MAX_ROWS if gemv_max_rows is None else gemv_max_rows
    if isinstance(dq, DeviceFP8):
        assert not quantized, "quant_linear: quantized x for an FP8 weight"
        if rows <= min(limit, quant_fp8.MAX_T):
            quant_fp8.fp8_gemv(x, dq.q, dq.S, out, rows, bn=dq.bn, bk=dq.bk, bias=bias, residual=residual,
                               stream=stream)
            return
        _many_rows(x, dq, out, rows, stream, residual, bias, scratch)
        return
    mma, planes_mma = _mma_roads(dq, rows, mma_rows, limit)
    assert mma or not quantized, "quant_linear: quantized x for a product off the tensor-core GEMV"
    if mma:
        xq, xsc = quant_mma.x_buffers(k)
        if not quantized:
            quant_mma.quantize_x(x, rows, xq, xsc, stream, tiles=quant_mma.n_tiles(rows))
        for p in dq.parts:
            if p.fragments:
                quant_mma.gemv_mq(xq, xsc, p.planes, out, rows, p.rows, n_off=p.row0, bias=bias,
                                  residual=residual, stream=stream)
            elif planes_mma and quant_mma.supports(p.qtype, k):
                quant_mma.gemv(xq, xsc, p.planes, out, rows, qtype=p.qtype, n_off=p.row0, bias=bias,
                               residual=residual, stream=stream)
            else:
                _gemv_part(x, p, out, rows, bias, residual, stream)
        return
    if rows <= limit:
        for p in dq.parts:
            _gemv_part(x, p, out, rows, bias, residual, stream)
        return
    _many_rows(x, dq, out, rows, stream, residual, bias, scratch)


def _many_rows(x, dq, out, rows: int, stream, residual, bias, scratch) -> None:
    """The many-rows road: dq dequantized to bf16 into the scratch (in row chunks when it does not
    fit), each chunk's product a bf16 GEMM into its column window of out."""
    n, k = dq.shape
    if scratch is None:
        scratch = cuda.device_array(n * k, np.uint16, stream=stream)
    xs, os_ = x[:rows], out[:rows]
    s = stream or None
    if residual is not None and not _same(residual[:rows], os_):
        os_.copy_to_device(residual[:rows], stream=stream)
    for n0, sub in row_chunks(dq, scratch.size):
        w = dequantize_into(sub, scratch, stream)
        o = os_ if sub is dq else os_[:, n0:n0 + sub.shape[0]]      # a column window (strided rows)
        b = bias if bias is None or sub is dq else bias[n0:n0 + sub.shape[0]]
        (gemm.linear if residual is None else gemm.linear_residual)(xs, w, o, b, s)


def gemv_rows(dq: "DeviceQuantized | DeviceFP8", mma_rows: int) -> int:
    """Rows up to which a product on dq streams its blocks (GEMV kernels) rather than taking the
    many-rows road: quant_mma.MAX_TILED_T when every part has a tensor-core kernel of n-tiles (the
    fragment layout, Q6_K with the mma on), else GEMV_MAX_ROWS; quant_fp8.MAX_T for FP8."""
    if isinstance(dq, DeviceFP8):
        return quant_fp8.MAX_T
    if mma_rows > 0 and all(p.fragments or (p.qtype == quant_mma.Q6_K and quant_mma.supports(p.qtype, p.cols))
                            for p in dq.parts):
        return quant_mma.MAX_TILED_T
    return GEMV_MAX_ROWS


def _gemv_part(x, p: DevicePart, out, rows: int, bias, residual, stream) -> None:
    """One part through the dp4a GEMV, in launches of at most what its shared memory holds."""
    step = quant_gemv.max_rows(p.qtype, x.shape[1])
    if rows <= step:                # one launch, no slices (each Numba slice costs Python time)
        quant_gemv.gemv(x, p.planes, out, rows, qtype=p.qtype, n_off=p.row0, bias=bias,
                        residual=residual, stream=stream)
        return
    for t0 in range(0, rows, step):
        t = min(step, rows - t0)
        quant_gemv.gemv(x[t0:t0 + t], p.planes, out[t0:t0 + t], t, qtype=p.qtype, n_off=p.row0,
                        bias=bias, residual=None if residual is None else residual[t0:t0 + t], stream=stream)


def row_chunks(dq: "DeviceQuantized | DeviceFP8", max_elems: int) -> tuple:
    """(first row, DeviceQuantized or DeviceFP8) pieces of dq of at most max_elems values each (whole
    multiples of 64 rows: the bf16 GEMM's tiles; of an FP8 weight's row blocks too), cut across
    parts as needed (the planes are row-major, so a piece is plane row slices); ((0, dq),) when dq
    fits. Cached on dq."""
    n, k = dq.shape
    if n * k <= max_elems:
        return ((0, dq),)
    unit = math.lcm(64, dq.bn) if isinstance(dq, DeviceFP8) and dq.bn < n else 64
    step = max_elems // k // unit * unit
    if step < unit:
        raise ValueError(f"quant scratch of {max_elems} values holds fewer than {unit} rows of K={k}")
    got = dq.chunks.get(step)
    if got is None:
        got = dq.chunks[step] = tuple((n0, _rows_of(dq, n0, min(n, n0 + step))) for n0 in range(0, n, step))
    return got


def _rows_of(dq: "DeviceQuantized | DeviceFP8", r0: int, r1: int) -> "DeviceQuantized | DeviceFP8":
    if isinstance(dq, DeviceFP8):       # r0 on a row block's start (row_chunks' unit); one scale row per tensor
        return DeviceFP8(dq.q[r0:r1], dq.S[r0 // dq.bn:-(-r1 // dq.bn)], dq.bn, dq.bk)
    parts = []
    for p in dq.parts:
        a, b = max(r0, p.row0), min(r1, p.row0 + p.rows)
        if a >= b:
            continue
        if p.fragments:                     # planes of 16-row tiles
            if (a - p.row0) % 16:
                raise ValueError(f"a row chunk at row {a - p.row0} of a part in 16-row tiles")
            planes = {name: v[(a - p.row0) // 16:-(-(b - p.row0) // 16)] for name, v in p.planes.items()}
        else:
            planes = {name: (v[a - p.row0:b - p.row0] if v.shape[0] == p.rows else v)   # not the 1-row filler
                      for name, v in p.planes.items()}
        parts.append(DevicePart(p.qtype, b - a, p.cols, a - r0, planes, p.nbytes * (b - a) // p.rows))
    return DeviceQuantized(tuple(parts))


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
    [ceil(N / bn), ceil(K / bk)] (FP8Tensor's grid: per tensor, per channel or per block)."""
    q: object
    S: object
    bn: int
    bk: int
    host: object = field(default=None, compare=False, repr=False)     # the FP8Tensor it came from
    chunks: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def nbytes(self) -> int:
        return int(self.q.size + 4 * self.S.size)


def upload_fp8(weight, scale, block: tuple[int, int] | None = None, stream=0, arena=None) -> DeviceFP8:
    """weight: float8_e4m3fn [N, K] (or its uint8 bytes); scale: scalar, [N] / [N, 1], or the block
    grid of `block` = quantization_config.weight_block_size (weight_scale_inv multiplies): the
    loader's FP8Tensor of them, uploaded."""
    from metrale.models.fp8 import FP8Tensor
    return upload_fp8_tensor(FP8Tensor.of(weight, scale, block), stream=stream, arena=arena)


def upload_fp8_tensor(t, stream=0, arena=None) -> DeviceFP8:
    """A loader's FP8Tensor (metrale.models.fp8) on the device, its scale grid as it is: into `arena`
    (a DevicePool region: device_bytes_bound's bytes) or, without one, fresh device arrays; the
    FP8Tensor stays as `host` (export_weights dequantizes it)."""
    if t.bk % 16:
        raise ValueError(f"fp8 scale blocks of {t.bk} columns: the kernels need a multiple of 16")
    put = (lambda a: cuda.to_device(a, stream=stream)) if arena is None else (lambda a: arena.upload(a, stream))
    return DeviceFP8(put(np.ascontiguousarray(t.q)), put(t.S), t.bn, t.bk, host=t)


def fp8_linear(x, d: DeviceFP8, out, rows: int, stream=0, residual=None, *, bias=None, scratch=None,
               gemv_max_rows: int | None = None) -> None:
    """out[:rows] = x[:rows] @ (e4m3(q) S).T (+ bias) (+ residual[:rows], which may be out): quant_linear's
    FP8 roads, the GEMV up to gemv_max_rows (8) rows, else the bf16 dequantization into scratch (in
    row chunks when it is smaller) + the bf16 GEMM."""
    quant_linear(x, d, out, rows, stream, residual, bias=bias, scratch=scratch, gemv_max_rows=gemv_max_rows)


# ----------------------------------------------------------------------------- the ops of a quantized model
def _quantized(weight) -> bool:
    return isinstance(weight, (DeviceQuantized, DeviceFP8))


class QuantOps:
    """CudaOps for a model whose matrices may be DeviceQuantized or DeviceFP8 (levers.weights=native), composed
    before CudaOps and the family's mixins. Each op with a quantized weight takes one of three roads:
      GEMV    up to GEMV_MAX_ROWS rows: the weight read in its blocks (quant_linear), after a separate
              RMSNorm / silu*mul launch (the quant GEMV has no prologues and no carried norm sums);
      bf16    more rows, the weight fits the backend's scratch (b.quant_scratch): dequantized into
              it, then the op's own bf16 road (cuBLASLt or the Numba GEMMs) on that image;
      chunks  more rows, a larger weight: quant_linear dequantizes and multiplies row chunks
              (Numba GEMMs into column windows of the output).
    Ops with bf16 weights go to super() unchanged. Nothing is allocated (graph-capture safe)."""

    def _bf16(self, weight, rows: int):
        """The weight's bf16 image in the scratch, dequantized now on the stream (the bf16 road), or
        None (the GEMV or the chunks road)."""
        if rows <= gemv_rows(weight, self.b.quant_mma_rows):
            return None
        scratch = self.b.quant_scratch
        assert scratch is not None, "a quantized product of more rows than the scratch was planned for"
        n, k = weight.shape
        if n * k > scratch.size:
            return None
        view = self.b.quant_scratch_view(n, k)
        dequantize_into(weight, view, self.s)
        return view

    def _qlinear(self, x, weight, out, bias=None, residual=None):
        quant_linear(x, weight, out, x.shape[0], self.s, residual=residual, bias=bias, scratch=self.b.quant_scratch,
                     mma_rows=self.b.quant_mma_rows)
        return out

    def embed(self, weight):
        if not isinstance(weight, DeviceQuantized):       # FP8 checkpoints' embeddings load as bf16
            return super().embed(weight)
        out = self._buf("residual")
        if self.b.overlap:      # fed rows take their token from the last step's argmax
            quant_dequant.feed_ids(self.token_ids, self.token_src, self.b.act["argmax"], stream=self.s)
        quant_embedding(self.token_ids, weight, out, self.s)
        self._resid_ss = None
        return out

    def linear(self, x, weight, bias=None):
        if not _quantized(weight):
            return super().linear(x, weight, bias)
        w = self._bf16(weight, x.shape[0])
        if w is not None:
            return super().linear(x, w, bias)
        return self._qlinear(x, weight, self.b.view(f"out{weight.shape[0]}", x.shape[0]), bias)

    def linear_residual(self, x, weight, residual, prefetch: bool = False):
        if not _quantized(weight):
            return super().linear_residual(x, weight, residual, prefetch)
        w = self._bf16(weight, x.shape[0])
        if w is not None:
            return super().linear_residual(x, w, residual)
        self._resid_ss = None
        return self._qlinear(x, weight, residual, residual=residual)

    def norm_linear(self, x, norm_weight, weight, bias=None):
        if not _quantized(weight):
            return super().norm_linear(x, norm_weight, weight, bias)
        rows = x.shape[0]
        w = self._bf16(weight, rows)
        if w is not None:
            return super().norm_linear(x, norm_weight, w, bias)
        if not takes_mma(weight, rows, self.b.quant_mma_rows):
            return self.linear(self.rms_norm(x, norm_weight), weight, bias)
        h = self._norm_out(x)               # the norm and x's quantization in one launch
        xq, xsc = quant_mma.x_buffers(weight.shape[1])
        quant_mma.norm_quantize_x(x, norm_weight, self.cfg.rms_norm_eps, rows, xq, xsc, h, self.s,
                                  tiles=quant_mma.n_tiles(rows))
        out = self.b.view(f"out{weight.shape[0]}", rows)
        quant_linear(h, weight, out, rows, self.s, bias=bias, scratch=self.b.quant_scratch,
                     mma_rows=self.b.quant_mma_rows, quantized=True)
        return out

    def norm_qkv_to_cache(self, x, norm_weight, weight, bias, layer, q_norm, k_norm):
        if not _quantized(weight):
            return super().norm_qkv_to_cache(x, norm_weight, weight, bias, layer, q_norm, k_norm)
        w = self._bf16(weight, x.shape[0])
        if w is not None:
            return super().norm_qkv_to_cache(x, norm_weight, w, bias, layer, q_norm, k_norm)
        return self.qkv_to_cache(self.norm_linear(x, norm_weight, weight, bias), layer, q_norm, k_norm)

    def attention_linear_residual(self, q, layer, weight, residual):
        if not _quantized(weight):
            return super().attention_linear_residual(q, layer, weight, residual)
        w = self._bf16(weight, self.g.tokens)
        if w is not None:
            return super().attention_linear_residual(q, layer, w, residual)
        return self.linear_residual(self.attention(q, layer), weight, residual)

    def silu_mul_linear_residual(self, gate_up, weight, residual):
        if not _quantized(weight):
            return super().silu_mul_linear_residual(gate_up, weight, residual)
        rows = gate_up.shape[0]
        w = self._bf16(weight, rows)
        if w is not None:
            return super().silu_mul_linear_residual(gate_up, w, residual)
        if not takes_mma(weight, rows, self.b.quant_mma_rows):
            return self.linear_residual(self.silu_mul(gate_up), weight, residual)
        act = self._buf("act")              # the activation and x's quantization in one launch
        xq, xsc = quant_mma.x_buffers(weight.shape[1])
        quant_mma.silu_quantize_x(gate_up, rows, xq, xsc, act, self.s, tiles=quant_mma.n_tiles(rows))
        self._resid_ss = None
        quant_linear(act, weight, residual, rows, self.s, residual=residual, scratch=self.b.quant_scratch,
                     mma_rows=self.b.quant_mma_rows, quantized=True)
        return residual

    def mlp_residual(self, residual, norm_weight, gate_up, down):
        if not (_quantized(gate_up) or _quantized(down)):
            return super().mlp_residual(residual, norm_weight, gate_up, down)
        # gate_up's image (if any) is read before down's overwrites the scratch: one stream
        return self.silu_mul_linear_residual(self.norm_linear(residual, norm_weight, gate_up), down, residual)
