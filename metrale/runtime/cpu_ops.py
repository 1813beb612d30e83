"""The fast CPU Ops (levers.cpu_kernels=numba): NumpyOps whose products, RMSNorms, silu*mul, RoPE +
K/V writes and attention run as Numba CPU kernels (kernels_numba/cpu_quant.py, cpu_layers.py; a
dense layer's three fused steps cpu_dense.py),
reading weights as the loader left them: QuantizedTensor (a GGUF file's blocks, never expanded)
or float32 arrays. The NumPy backend's own arithmetic (NumpyOps) stays the reference: every
kernel is tested against it, and levers.cpu_kernels=numpy selects it.

Invariants: activations are float32 C-contiguous; a weight's kernel form (CpuMatrix: views of its
parts as block records) is made once per backend and kept beside it; Numba's thread count is set
per forward from levers.cpu_threads (Numba's setting is per calling thread).
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import sys
import threading
import time

import numpy as np

from kernels_numba import cpu_dense as D
from kernels_numba import cpu_layers as L
from kernels_numba import cpu_quant as Q
from kernels_numba import cpu_x16 as X
from metrale.models.quantized import QuantizedTensor
from metrale.runtime.numpy_backend import NumpyOps

log = logging.getLogger("metrale")

_KIND = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q8_0": "q8_0",
         "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}


_NONE = np.zeros(0, np.float32)      # "no norm" (norm weights reach the kernels as writable copies)
_NO_RESIDUAL = np.zeros((0, 0), np.float32)


class CpuMatrix:
    """A weight [rows, cols] as the kernels read it: its parts as block records, grouped by kind
    (one kernel call a kind), with each part's first output row. With `x16` (the 8-bit-activation
    road), parts of a cpu_x16 kind are regrouped 16 rows at a time instead (kind "<kind>x16"; the
    same bytes, read by X.matmul_x16_into; rows() reads them back)."""

    def __init__(self, weight, x16: bool = False):
        if isinstance(weight, QuantizedTensor):
            parts, col = [], 0
            for p in weight.parts:
                kind = _KIND[p.ggml_type.name]
                if x16 and X.repackable(kind, p.rows):
                    # the file's pages leave RSS as they are copied (read back from the file if asked)
                    parts.append((X.repack_x16(p.data, kind, done=release_file_pages), col))
                else:
                    parts.append((Q.as_blocks(p.data, kind), col))
                col += p.rows
            self.shape = weight.shape
        else:
            w = np.ascontiguousarray(weight, dtype=np.float32)
            parts, self.shape = [(Q.as_blocks(w, "f32"), 0)], w.shape
        self.parts = tuple(parts)
        self.kinds = tuple(sorted({_kind(b) for b, _ in parts}))
        self.groups = []          # (parts tuple, count, first output columns, kind): one kernel call each
        for kind in self.kinds:
            mine = [(b, c) for b, c in parts if _kind(b) == kind]
            for i in range(0, len(mine), Q.MAX_PARTS):
                some = mine[i:i + Q.MAX_PARTS]
                cols = np.zeros(Q.MAX_PARTS, np.int64)
                cols[:len(some)] = [c for _, c in some]
                self.groups.append((Q.pad_parts([b for b, _ in some]), len(some), cols, kind))

    def matmul(self, x: np.ndarray, norm: np.ndarray | None = None, eps: float = 0.0,
               residual: np.ndarray | None = None, q8: bool = False) -> np.ndarray:
        """x [T, cols] float32 C-contiguous -> [T, rows] = (residual +) x' @ W.T, x' = x or, given a
        read-only float32 norm weight [cols], RMSNorm(x) (computed once, inside the first kernel).
        q8: block kinds that have it take the 8-bit-activation kernel (Q.matmul_q8_into)."""
        T = x.shape[0]
        out = np.empty((T, self.shape[0]), np.float32)
        if not T:
            return out
        res = _NO_RESIDUAL if residual is None else residual
        normed = x if norm is None else np.empty_like(x)
        xq = xs = None
        for i, (blocks, count, col0s, kind) in enumerate(self.groups):
            src, nw = (x, _NONE if norm is None else norm) if i == 0 else (normed if norm is not None else x, _NONE)
            if kind.endswith("x16"):
                X.matmul_x16_into(blocks, count, col0s, src, nw, eps, normed, np.empty(x.shape, np.int8),
                                  np.empty(X.scales_shape(T, x.shape[1]), np.float32), res, out)
            elif q8 and kind in Q.Q8_KINDS:
                if xq is None:
                    xq = np.empty(x.shape, np.int8)
                    xs = np.empty(Q.q8_scales_shape(T, x.shape[1]), np.float32)
                Q.matmul_q8_into(blocks, count, col0s, src, nw, eps, normed, xq, xs, res, out)
            else:
                Q.matmul_into(blocks, count, col0s, src, nw, eps, normed, res, out)
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 [len(ids), cols]: the rows ids (an embedding lookup), decoded."""
        ids = np.asarray(ids, np.int64)
        out = np.empty((ids.shape[0], self.shape[1]), np.float32)
        for blocks, col0 in self.parts:
            rows = blocks.shape[0] * (X.GROUP if _kind(blocks).endswith("x16") else 1)
            mine = (ids >= col0) & (ids < col0 + rows)
            if not mine.any():
                continue
            if _kind(blocks).endswith("x16"):
                kind = _kind(blocks)[:-3]
                mine_ids = ids[mine] - col0
                part = np.empty((mine_ids.shape[0], self.shape[1]), np.float32)
                Q.decode_rows(Q.as_blocks(X.unpack_rows(blocks, kind, mine_ids), kind),
                              np.arange(mine_ids.shape[0]), part)
            elif mine.all():
                Q.decode_rows(blocks, ids - col0, out)
                continue
            else:
                part = np.empty((int(mine.sum()), self.shape[1]), np.float32)
                Q.decode_rows(blocks, ids[mine] - col0, part)
            out[mine] = part
        return out


def _kind(blocks: np.ndarray) -> str:
    name = list(blocks.dtype.fields)[0]
    return name if name.endswith("x16") else Q.kind_of(blocks.dtype)


def cpu_matrix(backend, weight) -> CpuMatrix:
    """The kernel form of one of backend's weights, made on first use and kept on the backend
    (regrouped 16 rows at a time on the 8-bit-activation road)."""
    cache = backend.__dict__.setdefault("_cpu_matrices", {})
    hit = cache.get(id(weight))
    if hit is None or hit[0] is not weight:
        hit = cache[id(weight)] = (weight, CpuMatrix(weight, x16=getattr(backend, "cpu_activations", "f32") == "q8"))
    return hit[1]


def cpu_vector(backend, weight) -> np.ndarray:
    """A norm weight as the kernels read it: a float32 contiguous writable copy (one kernel signature
    whether the loader copied it or left it in the file's read-only map), kept on the backend."""
    cache = backend.__dict__.setdefault("_cpu_vectors", {})
    hit = cache.get(id(weight))
    if hit is None or hit[0] is not weight:
        hit = cache[id(weight)] = (weight, np.array(weight, dtype=np.float32, order="C"))
    return hit[1]


def _f32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


class CpuOps(NumpyOps):
    reads_quantized = True      # the backend may hand it QuantizedTensor weights
    fused_layer = True          # a layer's three steps as one Numba call each (False: their composition;
                                # tests/test_cpu_dense.py and bench/cpu_decode.py --fused compare them)

    def __init__(self, backend, batch):
        super().__init__(backend, batch)
        threads = int(getattr(backend, "cpu_threads", 0) or 0)
        if threads:
            import numba
            threads = min(threads, numba.config.NUMBA_NUM_THREADS)
            if numba.get_num_threads() != threads:        # set_num_threads costs ~1 ms
                numba.set_num_threads(threads)
        self._cos_sin = None
        self._attn_parallel = None
        self._q8 = getattr(backend, "cpu_activations", "f32") == "q8"

    def _m(self, weight) -> CpuMatrix:
        return cpu_matrix(self.b, weight)

    def embed(self, weight):
        if isinstance(weight, np.ndarray):
            return weight[self.batch.token_ids]
        return self._m(weight).rows(self.batch.token_ids)

    def rms_norm(self, x, weight):
        if x.ndim != 2:
            return super().rms_norm(x, weight)
        x = _f32(x)
        out = np.empty_like(x)
        L.rms_norm(x, cpu_vector(self.b, weight), float(self.cfg.rms_norm_eps), out)
        return out

    def linear(self, x, weight, bias=None):
        y = self._m(weight).matmul(_f32(x), q8=self._q8)
        return y if bias is None else y + bias

    def linear_residual(self, x, weight, residual):
        return self._m(weight).matmul(_f32(x), residual=_f32(residual), q8=self._q8)

    def norm_linear(self, x, norm_weight, weight, bias=None):
        y = self._m(weight).matmul(_f32(x), norm=cpu_vector(self.b, norm_weight), eps=float(self.cfg.rms_norm_eps),
                                   q8=self._q8)
        return y if bias is None else y + bias

    def silu_mul(self, gate_up):
        gate_up = _f32(gate_up)
        out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
        L.silu_mul(gate_up, out)
        return out

    def _rope_tables(self):
        if self._cos_sin is None:
            cos, sin = self.b.rope_for(self.batch)
            self._cos_sin = _f32(cos), _f32(sin)
        return self._cos_sin

    def _kv(self, layer: int):
        kv = getattr(self.b, "kv", None)
        return (kv.k[layer], kv.v[layer]) if kv is not None else (self.b.k_cache[layer], self.b.v_cache[layer])

    def qkv_to_cache(self, qkv, layer, q_norm, k_norm):
        c = self.cfg
        k, v = self._kv(layer)
        cos, sin = self._rope_tables()
        q = np.empty((qkv.shape[0], c.num_heads, c.head_dim), np.float32)
        L.rope_to_cache(_f32(qkv), cos, sin, bool(c.rope_interleaved),
                        _NONE if q_norm is None else cpu_vector(self.b, q_norm),
                        _NONE if k_norm is None else cpu_vector(self.b, k_norm),
                        float(c.rms_norm_eps), self.batch.slot_mapping,
                        k.reshape(-1, c.num_kv_heads, c.head_dim), v.reshape(-1, c.num_kv_heads, c.head_dim), q)
        return q

    def attention(self, q, layer):
        c, bt = self.cfg, self.batch
        k, v = self._kv(layer)
        out = np.empty((q.shape[0], c.num_heads, c.head_dim), np.float32)
        L.paged_attention(_f32(q).reshape(out.shape), k, v, bt.block_tables, bt.seq_query_start, bt.positions,
                          int(c.layer_window(layer)), float(1.0 / np.sqrt(c.head_dim)), out)
        return out.reshape(q.shape[0], c.q_size)

    # -- a layer's three fused steps, one Numba call each (kernels_numba/cpu_dense.py), for weights
    #    of one kind group; the composition above otherwise

    def _one_group(self, weight):
        if not self.fused_layer:
            return None
        m = self._m(weight)
        return m.groups[0] if len(m.groups) == 1 else None

    def _road(self, *groups):
        return D.Q8 if self._q8 and all(g[3] in Q.Q8_KINDS or g[3].endswith("x16") for g in groups) else D.F32

    def norm_qkv_to_cache(self, x, norm_weight, weight, bias, layer, q_norm, k_norm):
        g = self._one_group(weight)
        if g is None:
            return super().norm_qkv_to_cache(x, norm_weight, weight, bias, layer, q_norm, k_norm)
        c = self.cfg
        k, v = self._kv(layer)
        cos, sin = self._rope_tables()
        q = np.empty((x.shape[0], c.num_heads, c.head_dim), np.float32)
        vec = lambda w: _NONE if w is None else cpu_vector(self.b, w)  # noqa: E731
        D.attn_in(_f32(x), vec(norm_weight), float(c.rms_norm_eps), g[0], g[1], g[2], vec(bias), cos, sin,
                  bool(c.rope_interleaved), vec(q_norm), vec(k_norm), self.batch.slot_mapping,
                  k.reshape(-1, c.num_kv_heads, c.head_dim), v.reshape(-1, c.num_kv_heads, c.head_dim), q,
                  self._road(g))
        return q

    def attention_linear_residual(self, q, layer, weight, residual):
        g = self._one_group(weight)
        if g is None:
            return super().attention_linear_residual(q, layer, weight, residual)
        c, bt = self.cfg, self.batch
        k, v = self._kv(layer)
        if self._attn_parallel is None:
            pairs = int(bt.context_lens.max()) * bt.num_tokens * c.num_heads
            self._attn_parallel = pairs >= L.PARALLEL_MIN_SCORES
        return D.attn_out(_f32(q).reshape(q.shape[0], c.num_heads, c.head_dim), k, v, bt.block_tables,
                          bt.seq_query_start, bt.positions, int(c.layer_window(layer)), float(1.0 / np.sqrt(c.head_dim)),
                          self._attn_parallel, g[0], g[1], g[2], _f32(residual), self._road(g))

    def dense_layers(self, residual, count: int, w: dict):
        """The first `count` layers in one Numba call (cpu_dense.layers) when every one of them is a
        plain dense layer of one signature and this class's layer ops are CpuOps's own (a subclass
        that changes one, as tensor parallelism would, keeps the per-layer road); else None."""
        for name in ("norm_qkv_to_cache", "attention_linear_residual", "mlp_residual"):
            if getattr(type(self), name) is not getattr(CpuOps, name):
                return None
        stack = self._layer_stack(w)
        if stack is None:
            return None
        c, bt = self.cfg, self.batch
        k_pool, v_pool = self._pools()
        if self._attn_parallel is None:
            pairs = int(bt.context_lens.max()) * bt.num_tokens * c.num_heads
            self._attn_parallel = pairs >= L.PARALLEL_MIN_SCORES
        cos, sin = self._rope_tables()
        return D.layers(_f32(residual), stack, count, int(c.num_heads), float(c.rms_norm_eps), cos, sin,
                        bool(c.rope_interleaved), bt.slot_mapping, k_pool, v_pool, bt.block_tables, bt.seq_query_start,
                        bt.positions, float(1.0 / np.sqrt(c.head_dim)), self._attn_parallel, self._stack_road)

    def _pools(self):
        return self.b.kv.k, self.b.kv.v

    def _layer_stack(self, w: dict):
        """cpu_dense.layers' per-layer tuples for all layers (one type whatever count runs), made
        once a backend; None when a layer is not plain dense (linear attention, an attention gate,
        MoE, several kinds in one matrix) or the layers' kinds differ (a tuple indexed at run time
        needs one type)."""
        cache = self.b.__dict__.setdefault("_layer_stacks", {})
        if self._q8 not in cache:
            cache[self._q8] = self._build_stack(w)
        stack, self._stack_road = cache[self._q8] if cache[self._q8] is not None else (None, None)
        return stack

    def _build_stack(self, w: dict):
        c = self.cfg
        if self.b.kv is None or not self.fused_layer or c.is_hybrid:
            return None
        vec = lambda name: _NONE if w.get(name) is None else cpu_vector(self.b, w[name])  # noqa: E731
        stack, kinds = [], set()
        for i in range(c.num_layers):
            p = f"layers.{i}."
            if c.is_moe_layer(i) or c.kv_layer(i) != i or p + "attn_gate" in w:
                return None
            groups = [self._one_group(w[p + n]) for n in ("qkv", "o", "gate_up", "down")]
            if any(g is None for g in groups):
                return None
            kinds.add(tuple(g[3] for g in groups))
            qkv, o, gu, dn = groups
            stack.append((vec(p + "attn_norm"), *qkv[:3], vec(p + "qkv_bias"), vec(p + "q_norm"), vec(p + "k_norm"),
                          *o[:3], vec(p + "mlp_norm"), *gu[:3], self._m(w[p + "gate_up"]).shape[0] // 2, *dn[:3],
                          int(c.layer_window(i))))
        if len(kinds) != 1:
            return None
        return tuple(stack), self._road(*groups)

    def mlp_residual(self, residual, norm_weight, gate_up, down):
        g1, g2 = self._one_group(gate_up), self._one_group(down)
        if g1 is None or g2 is None:
            return super().mlp_residual(residual, norm_weight, gate_up, down)
        return D.mlp(_f32(residual), cpu_vector(self.b, norm_weight), float(self.cfg.rms_norm_eps), g1[0], g1[1], g1[2],
                     self._m(gate_up).shape[0] // 2, g2[0], g2[1], g2[2], self._road(g1, g2))


# ------------------------------------------------------------------------------ the CPU runtime

def uses_cpu_kernels(cfg, family=None) -> bool:
    """Whether a composed config runs the fast CPU path: levers.cpu_kernels=numba, float32, and a
    family whose forward needs no ops beyond the common ones (dense Llama / Qwen2 / Qwen3 / Mistral;
    the others run NumpyOps, quantized weights expanded to float32)."""
    return (str(cfg.levers.cpu_kernels) == "numba" and str(cfg.levers.numpy_dtype) == "float32"
            and (family is None or not family.numpy_ops))


def start(backend, cfg) -> None:
    """Readies a NumpyBackend that runs CpuOps: Numba's threads (levers.cpu_threads), 4 KiB pages
    for the KV pool (NumPy asks for huge pages on large arrays, which turns each layer's first
    K/V write into 2 MiB of resident memory), and every kernel compiled or loaded (warm_up)."""
    backend.cpu_threads = int(cfg.levers.cpu_threads)
    backend.cpu_activations = str(cfg.levers.cpu_activations)
    if backend.cpu_activations == "auto":
        backend.cpu_activations = "q8" if has_q8() else "f32"
    elif backend.cpu_activations == "q8" and not has_q8():
        log.warning("levers.cpu_activations=q8 needs AVX2 or AVX-512 VNNI, which this CPU lacks: float32 activations")
        backend.cpu_activations = "f32"
    for cache in getattr(backend, "caches", {}).values():
        for a in vars(cache).values():
            if isinstance(a, np.ndarray) and a.nbytes >= 1 << 21:
                small_pages(a)
    backend.compute = compute_thread()
    backend.compute(warm_up, backend)


class ComputeThread:
    """The one thread that runs the fast CPU path's forwards (Numba's OpenMP regions) for the whole
    process. OpenMP keeps a worker pool per calling thread; a second one (the engine's loop thread
    beside the main thread) makes the workers sleep between regions (docs/cpu.md). Callers wait on a future (the GIL is free meanwhile); errors re-raise in the caller."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="metrale-cpu", daemon=True)
        self._thread.start()

    def __call__(self, fn, *args):
        if threading.current_thread() is self._thread:
            return fn(*args)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, args, done))
        return done.result()

    def _run(self) -> None:
        while True:
            fn, args, done = self._jobs.get()
            try:
                done.set_result(fn(*args))
            except BaseException as exc:     # the caller's to handle (a bad batch ends its own requests)
                done.set_exception(exc)


_COMPUTE: ComputeThread | None = None
_COMPUTE_LOCK = threading.Lock()


def compute_thread() -> ComputeThread:
    global _COMPUTE
    with _COMPUTE_LOCK:
        if _COMPUTE is None:
            _COMPUTE = ComputeThread()
        return _COMPUTE


def has_q8() -> bool:
    """Whether the q8 kernels' integer dot products run here (AVX-512 VNNI, or AVX2's pmaddubsw)."""
    from kernels_numba.cpu_quant import int8_dot
    return int8_dot() is not None


def release_file_pages(a: np.ndarray) -> None:
    """Drops an array's resident pages from this process (madvise MADV_DONTNEED) when it is a view
    of a file mapping (the GGUF file's np.memmap): they leave RSS and come back from the file on the
    next read. Anonymous memory is left alone (DONTNEED would zero it). Linux; elsewhere nothing."""
    import ctypes
    import mmap
    base, mapped = a, False
    while base is not None and not mapped:
        mapped = isinstance(base, (np.memmap, mmap.mmap))
        base = getattr(base, "base", None)
    if not mapped or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    start = -(-a.ctypes.data // page) * page                  # whole pages only: a neighbour keeps its own
    end = (a.ctypes.data + a.nbytes) // page * page
    if end > start:
        ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                                                  mmap.MADV_DONTNEED)


def small_pages(a: np.ndarray) -> None:
    """madvise(MADV_NOHUGEPAGE) over an array not yet touched (Linux; elsewhere nothing)."""
    import ctypes
    import mmap
    if not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return
    page = mmap.PAGESIZE
    start = a.ctypes.data // page * page
    end = a.ctypes.data + a.nbytes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_NOHUGEPAGE)


# ------------------------------------------------------------------------------ compile once

def warm_up(backend, stream=sys.stderr) -> float:
    """Runs every kernel the backend's weights need once, on tiny inputs, so that Numba compiles
    (first start) or loads them from its disk cache (later starts) now rather than inside the first
    request. Says one line on `stream` per kernel it has to compile. Returns the seconds taken.
    Callees load before their callers (a cached caller loaded first crashed: docs/cpu.md); where
    the whole-stack call runs the layers, the per-layer fused calls are not loaded (resident code)."""
    from numba.core import event
    t0 = time.perf_counter()
    listener = _compile_log(stream)
    q8 = getattr(backend, "cpu_activations", "") == "q8"
    with event.install_listener("numba:compile", listener):
        seen = set()
        for w in backend.weights.values():
            if not (isinstance(w, QuantizedTensor) or (isinstance(w, np.ndarray) and w.ndim == 2)):
                continue
            m = cpu_matrix(backend, w)
            if m.kinds in seen:
                continue
            seen.add(m.kinds)
            listener.label = f"products on {'/'.join(m.kinds)} weights"
            m.matmul(np.zeros((1, m.shape[1]), np.float32), q8=q8)
            m.rows(np.zeros(1, np.int64))
        listener.label = "norms, RoPE and attention"
        L.warm()
        listener.label = "fused layers"
        _warm_layers(backend)
    return time.perf_counter() - t0


def _warm_layers(backend) -> bool:
    """One token through the whole-stack call (CpuOps.dense_layers) where the model has one, else
    through each distinct layer signature's three fused calls (their types: the kinds of qkv, o,
    gate_up, down), against a one-block scratch cache instead of the backend's. Only what runs is
    loaded: each compiled call holds its own copy of the products (tens of MB of code resident)."""
    from metrale.runtime.batch import Segment, build_batch
    c, w = backend.config, backend.weights
    if not CpuOps.fused_layer or "layers.0.qkv" not in w:
        return False
    scratch = np.zeros((2, 1, backend.block_size, c.num_kv_heads, c.head_dim), np.float32)
    ops = CpuOps(backend, build_batch([Segment(np.zeros(1, np.int32), 0, np.zeros(1, np.int32))], backend.block_size))
    ops._kv = lambda layer: (scratch[0], scratch[1])
    ops._pools = lambda: (scratch[:1], scratch[1:])
    x = np.zeros((1, c.hidden_size), np.float32)
    if ops.dense_layers(x, 1, w) is not None:
        return True
    seen = set()
    for i in range(c.num_layers):
        p = f"layers.{i}."
        names = (p + "qkv", p + "o", p + "gate_up", p + "down")
        if any(n not in w for n in names):
            continue
        sig = tuple(cpu_matrix(backend, w[n]).kinds for n in names)
        if sig in seen:
            continue
        seen.add(sig)
        q = ops.norm_qkv_to_cache(x, w[p + "attn_norm"], w[p + "qkv"], w.get(p + "qkv_bias"), 0,
                                  w.get(p + "q_norm"), w.get(p + "k_norm"))
        ops.attention_linear_residual(q, 0, w[p + "o"], x)
        ops.mlp_residual(x, w[p + "mlp_norm"], w[p + "gate_up"], w[p + "down"])
    return False


def _compile_log(stream):
    from numba.core.event import Listener

    class CompileLog(Listener):
        """One line on `stream` when a kernel family starts compiling (a disk-cache load is silent)."""

        def __init__(self):
            self.label, self._said = "", set()

        def on_start(self, ev):
            if self.label not in self._said:
                self._said.add(self.label)
                print(f"metrale: compiling CPU kernels ({self.label}); cached for later starts",
                      file=stream, flush=True)

        def on_end(self, ev):
            pass

    return CompileLog()
