"""What the device drafters (the MTP head, metrale/spec/mtp_cuda.py; DFlash, metrale/spec/dflash_cuda.py)
share: a small model run by the target's own CudaOps class over a proxy backend, its step metadata
in one pinned mirror copied in per pass, its results copied out, and its passes captured as CUDA
graphs keyed by the caller.

Pieces:
- `pass_backend_class()`: the proxy CudaOps reads as its backend: the target's stream, cuBLASLt
  handle, kernel choices, RoPE tables and quantized-weight scratch; the drafter's config,
  activations, metadata, K/V pages and weights.
- `PassMeta`: int32 fields [sets, fields, n + 1] then block tables [table_rows, max_blocks], one
  pinned host mirror and one device copy; `SetMeta` is one set as CudaOps reads a backend's meta.
- `AttnPosOps`: a CudaOps mixin whose attention reads keys 0..attn_pos[t] of each row's table
  (the target's decode kernels, context lengths decoupled from the RoPE positions).
- `product` / `norm_product`: out (+)= [rms_norm](x) @ W.T by the same rules CudaOps uses.
- `DevicePasses`: the base of a device drafter's model (transfers, graph buckets, capture).
"""
from __future__ import annotations

import logging
import math

import numpy as np

log = logging.getLogger("metrale.spec")

FREE_MARGIN = 256 << 20          # device memory left free after a drafter's allocations


class HeadDoesNotFit(RuntimeError):
    """A device drafter's K/V pool and buffers do not fit beside the target."""


def device_head_possible(backend) -> bool:
    """The CUDA backend of a dense model without expert or tensor parallelism (a device drafter's
    layers are dense layers run by its CudaOps)."""
    family = getattr(backend, "family", None)
    return (getattr(backend, "name", "") == "cuda" and family is not None and family.name == "dense"
            and getattr(backend, "ep", None) is None and getattr(backend, "tp", None) is None
            and getattr(backend, "kv", None) is not None)


def target_ops_class(target) -> type:
    """The target's CudaOps class without its layer-row copies (a drafter's own layers run it)."""
    return getattr(target, "plain_ops_class", None) or target.ops_class


# ---------------------------------------------------------------------------- ops helpers
def product(ops, x, weight, out, accumulate: bool = False) -> None:
    """out (+)= x @ weight.T: cuBLASLt where the backend gives it these rows, else the Numba GEMM."""
    from kernels_numba import gemm
    b = ops.b
    if b.blas_takes(x.shape[0], weight):
        b.blas_linear(x, weight, out, None, accumulate=accumulate)
    elif accumulate:
        gemm.linear_residual(x, weight, out, stream=ops.s, skinny_max_t=b.skinny_max_t)
    else:
        gemm.linear(x, weight, out, stream=ops.s, skinny_max_t=b.skinny_max_t)


def norm_product(ops, x, norm_w, weight, out, normed, accumulate: bool = False) -> None:
    """out (+)= rms_norm(x, norm_w) @ weight.T; at one row the norm is the GEMV's prologue, else it
    goes through `normed` (a buffer of x's shape)."""
    from kernels_numba import gemm, rmsnorm
    eps = ops.cfg.rms_norm_eps
    if ops._fused(x.shape[0], weight):
        gemm.gemv(x, weight, out, prologue="rmsnorm", norm_w=norm_w, eps=eps, accumulate=accumulate, stream=ops.s)
        return
    rmsnorm.rms_norm(x, norm_w, eps, normed, stream=ops.s)
    product(ops, normed, weight, out, accumulate)


class AttnPosOps:
    """CudaOps mixin: a row's attention reads keys 0..attn_pos[t] of its sequence's table with the
    target's decode kernels (RoPE still rotates by `positions`); meta carries an attn_pos field."""

    def __init__(self, backend, g):
        super().__init__(backend, g)
        self.attn_pos = backend.meta.view("attn_pos", g.tokens)

    def attention(self, q, layer):
        out = self._buf("attn")
        self._decode_attention(q, layer, out)
        return self.b.view("attn", self.g.tokens, (self.g.tokens, self.cfg.q_size))

    def _decode_attention(self, q, layer, out) -> None:
        from kernels_numba import attention, flash_decode
        decode = flash_decode.flash_decode_attention if self.b.flash_decode else attention.paged_attention
        decode(q, self.b.kv.k64[layer], self.b.kv.v64[layer], self.block_tables, self.token_seq, self.attn_pos,
               self._scale(), out, scratch=self.b.attn_scratch, max_context=self.g.max_context, stream=self.s)


def pass_backend_class():
    from metrale.runtime.cuda_backend import CudaBackend

    class PassBackend:
        """What CudaOps reads of a backend, for a drafter's model: the target's stream, cuBLASLt
        handle, kernel choices, RoPE tables and quantized-weight scratch; the drafter's own config,
        activations, metadata (`meta`, set per pass), K/V pages and weights (`head_weights`), and
        the hidden rows and fed ids a pass reads (`hidden`, `feed`)."""
        view = CudaBackend.view
        _cached = CudaBackend._cached
        blas_takes = CudaBackend.blas_takes
        blas_input = CudaBackend.blas_input
        blas_linear = CudaBackend.blas_linear
        quant_scratch_view = CudaBackend.quant_scratch_view
        SHARED = ("stream", "blas", "blas_min_rows", "fuse_decode", "prefetch_o_proj", "flash_decode",
                  "flash_prefill", "prefill_min_tokens", "skinny_max_t", "cos", "sin", "quant_scratch",
                  "quant_mma_rows", "max_model_len", "block_size")

        def __init__(self, target, config, act, kv, head_weights):
            for name in self.SHARED:
                setattr(self, name, getattr(target, name, None))
            self.config, self.act, self.kv, self.head_weights = config, act, kv, head_weights
            self.attn_scratch = act["attn_scratch"]
            self.carry_norm_sums = self.overlap = False
            self._views: dict = {}
            self.meta = self.hidden = self.feed = None

    return PassBackend


def activation_plan(target, config, tokens: int, rows: int) -> dict:
    """The dense layer's buffers at `tokens` rows (`rows` logits rows), without the target's own
    RoPE tables and cuBLASLt workspace (shared), and without out{vocab} (sized by the caller)."""
    from metrale.runtime.cuda_dense import DenseCuda
    c = config
    ns = type("Plan", (), dict(config=c, max_tokens=tokens, max_rows=rows, max_model_len=target.max_model_len,
                               use_blas=getattr(target, "blas", None) is not None))()
    plan = DenseCuda(ns).activation_plan()
    for name in ("cos", "sin", "blas_workspace"):
        plan.pop(name, None)
    if c.vocab_size not in (c.q_size + 2 * c.kv_size, c.hidden_size, 2 * c.intermediate_size):   # not a layer's buffer too
        plan.pop(f"out{c.vocab_size}")
    return plan


# ---------------------------------------------------------------------------- metadata
class PassMeta:
    """A drafter's step metadata: int32 fields [sets, len(fields), n + 1] then the tables
    [table_rows, max_blocks], one pinned host mirror and its device copy."""

    def __init__(self, sets: int, n: int, max_blocks: int, fields: tuple[str, ...], table_rows: int | None = None):
        from numba import cuda
        self.FIELDS = tuple(fields)
        self.sets, self.n, self.max_blocks = sets, n, max_blocks
        self.stride = len(self.FIELDS) * (n + 1)
        self.table_offset = sets * self.stride
        total = self.table_offset + (n if table_rows is None else table_rows) * max_blocks
        self.host = cuda.pinned_array(total, dtype=np.int32)
        self.host[:] = 0
        self.device = None
        self._views: dict = {}
        self.sets_view = [SetMeta(self, j) for j in range(sets)]

    def upload_all(self) -> None:
        """The whole mirror to a new device copy (once, after the host fields are initialized)."""
        from numba import cuda
        self.device = cuda.to_device(self.host)
        self._views.clear()

    def fields(self) -> np.ndarray:
        return self.host[:self.table_offset].reshape(self.sets, len(self.FIELDS), self.n + 1)

    def view(self, j: int, name: str, n: int):
        key = (j, name, n)
        v = self._views.get(key)
        if v is None:
            o = j * self.stride + self.FIELDS.index(name) * (self.n + 1)
            v = self._views[key] = self.device[o:o + n]
        return v

    def tables(self, seqs: int):
        key = ("tables", seqs)
        v = self._views.get(key)
        if v is None:
            t = self.table_offset
            v = self._views[key] = self.device[t:t + seqs * self.max_blocks].reshape(seqs, self.max_blocks)
        return v


class SetMeta:
    """One set of a PassMeta as CudaOps reads a backend's meta (view(name, n), tables(seqs))."""

    def __init__(self, meta: PassMeta, j: int):
        self.meta, self.j = meta, j

    def view(self, name: str, n: int):
        return self.meta.view(self.j, name, n)

    def tables(self, seqs: int):
        return self.meta.tables(seqs)


# ---------------------------------------------------------------------------- the base
class DevicePasses:
    """The target-facing plumbing of a device drafter's model: `meta` (a PassMeta) is set by the
    subclass; passes are launched through `_launch` (a CUDA graph per key where the target's graphs
    are on), their metadata copied in with `_htod` / `_tables_htod`."""
    kind = "drafter"                 # the name in log lines

    def __init__(self, target):
        from kernels_numba.bf16 import SIMULATOR
        self.sim = SIMULATOR
        self.target = target
        self.block_size = int(target.block_size)
        self.num_blocks = int(target.num_blocks)
        self.stream = target.stream
        self.use_graphs = bool(getattr(target, "use_graphs", False)) and not self.sim
        self.graph_sizes = sorted(getattr(target, "graph_sizes", []) or [])
        self.graphs: dict = {}
        self.meta: PassMeta | None = None

    def _check_memory(self, need: int) -> None:
        if self.sim:
            return
        from metrale.runtime.cuda import free_device_memory
        free, _ = free_device_memory()
        if need + FREE_MARGIN > free:
            raise HeadDoesNotFit(f"its K/V pool and buffers need {need / 2**20:.0f} MiB, {free / 2**20:.0f} MiB "
                                 "are free (lower cache.gpu_memory_utilization or set cache.num_blocks)")

    def _kv_pages(self, shape):
        """Zeroed bf16 K/V pages of `shape` (padding rows read block 0: finite values)."""
        from numba import cuda

        from metrale.runtime.cuda.pages import DeviceKvPages
        if self.sim:
            return DeviceKvPages(cuda.to_device(np.zeros(shape, np.uint16)), cuda.to_device(np.zeros(shape, np.uint16)))
        from numba.cuda.cudadrv.driver import device_memset
        k, v = cuda.device_array(shape, np.uint16), cuda.device_array(shape, np.uint16)
        device_memset(k, 0, k.nbytes)
        device_memset(v, 0, v.nbytes)
        return DeviceKvPages(k, v)

    @staticmethod
    def plan_bytes(plan: dict) -> int:
        return sum(math.prod(s) * np.dtype(t).itemsize for s, t in plan.values())

    # ------------------------------------------------------------------ transfers
    def _htod(self, lo: int, hi: int) -> None:
        """meta host[lo:hi] -> device[lo:hi] on the stream."""
        if hi <= lo:
            return
        if self.sim:
            self.meta.device[lo:hi].copy_to_device(self.meta.host[lo:hi])
            return
        from metrale.runtime.cuda import cu
        from metrale.runtime.cuda_backend import _ptr
        cu("cuMemcpyHtoDAsync", _ptr(self.meta.device) + 4 * lo, self.meta.host.ctypes.data + 4 * lo, 4 * (hi - lo),
           self.stream.handle)

    def _tables_htod(self, rows: int, width: int) -> None:
        m = self.meta
        if self.sim:
            self._htod(m.table_offset, m.table_offset + rows * m.max_blocks)
            return
        from metrale.runtime.cuda_backend import _ptr, copy_rows_htod
        t = 4 * m.table_offset
        copy_rows_htod(_ptr(m.device) + t, m.host.ctypes.data + t, 4 * m.max_blocks, 4 * width, rows, self.stream.handle)

    def _fetch(self, pairs: list) -> None:
        """(device array, pinned host array) pairs: each device array's first host.nbytes bytes
        into its host array, then the stream synchronized."""
        if self.sim:
            for dev, host in pairs:
                host[...] = dev.copy_to_host().reshape(-1)[:host.size].reshape(host.shape)
            return
        from metrale.runtime.cuda import cu
        from metrale.runtime.cuda_backend import _ptr
        for dev, host in pairs:
            cu("cuMemcpyDtoHAsync", host.ctypes.data, _ptr(dev), host.nbytes, self.stream.handle)
        self.stream.synchronize()

    # ------------------------------------------------------------------ graphs
    def _bucket(self, n: int, most: int) -> tuple[int, bool]:
        """(rows, graphed): the graph ladder size that holds n (at most `most`); (n, False) past the
        ladder or without graphs (those passes run eagerly)."""
        if self.use_graphs:
            from metrale.runtime.cuda.graph import pick_size
            s = pick_size(self.graph_sizes, n)
            if s is not None and s <= most:
                return s, True
        return n, False

    def _launch(self, key, fn) -> None:
        """fn's launches: replayed from the graph of `key`, captured after an eager run on first
        use (that run is this call's work); eagerly without graphs, and for a key whose capture
        failed (logged once)."""
        if not self.use_graphs or key is None:
            fn()
            return
        if key in self.graphs:
            graph = self.graphs[key]
            graph.replay() if graph is not None else fn()
            return
        from metrale.runtime.cuda import CudaGraph
        fn()
        try:
            self.graphs[key] = CudaGraph.capture(self.stream, fn, warmup=0)
        except Exception as exc:  # noqa: BLE001 - the eager run above did this call's work
            if not any(g is None for g in self.graphs.values()):
                log.warning("a %s graph capture failed (%s); its passes run eagerly", self.kind, exc)
            self.graphs[key] = None
