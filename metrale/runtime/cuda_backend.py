"""CUDA backend: a model family's forward as Numba kernels, memory from one pool, decode as CUDA graphs.

One backend for every family: the family value (metrale.models.families) gives the forward and
its CUDA part (runtime/cuda_<family>.py: weight layout, activation plan, extra ops as CudaOps
mixins); the backend owns memory planning, streams, graphs and weight upload.
Memory: one cuMemAlloc at start holds the weights (bf16 bits as uint16, norms f32), the
activation buffers (sized for the largest step; slot caches such as the hybrid state pool inside
them), the step metadata, and the paged caches (K/V or MLA latents, runtime/cuda/pages.py), which
take what is left of `cache.gpu_memory_utilization * total` after the rest.
Steps: the host packs the ragged metadata into one pinned buffer and copies it with one
transfer; decode-only steps are padded to a ladder size and replayed from a CUDA graph
captured on first use (its eager warm-up run is that step's result); other steps launch eagerly.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
from numba import cuda

from kernels_numba import (activation, argmax, attention, convert, embedding, flash_decode, flash_prefill, gemm, pdl,
                           precompile, qkv, rmsnorm)
from kernels_numba.bf16 import from_bf16_bits
from kernels_numba.random_init import fill_normal_bf16
from metrale.models.checkpoint import WeightStream
from metrale.models.config import ModelConfig
from metrale.models.families import KV, LATENT, STATE, Family, compose_ops, family_for, resolve
from metrale.models.fp8 import FP8_E4M3
from metrale.models.rope import model_rope
from metrale.runtime.backend import Backend
from metrale.runtime.batch import ForwardBatch, Segment, build_batch
from metrale.runtime.cuda import CudaGraph, DevicePool, Event, Stream, cu, free_device_memory, kv_pool_bytes
from metrale.runtime.cuda.buckets import MAX_MIXED_GRAPHS, holds, mixed_bucket, padding, token_ladder

log = logging.getLogger("metrale.cuda")

GRAPH_RESERVE = 512 << 20       # memory left outside the pool for graphs, contexts, workspaces
MIN_GRAPH_CONTEXT = 512         # context buckets of decode graphs: powers of two from here
BLAS_SMALL_MATRIX = 1 << 22     # weight elements below which cuBLASLt waits for BLAS_SMALL_MIN_ROWS
BLAS_SMALL_MIN_ROWS = 64
FUSE_MAX_K = 2048               # decode fusion (norm / silu*mul in the GEMV prologue) up to this K
# the cache kinds this backend keeps (metrale.cache.kinds' interface), imported on use
DEVICE_CACHES = {KV: "metrale.runtime.cuda.pages:DeviceKvPages", LATENT: "metrale.runtime.cuda.pages:DeviceLatentPages",
                 STATE: "metrale.runtime.cuda.state_pool:DeviceStatePool"}


@dataclass(frozen=True)
class Geometry:
    """Sizes of one launch sequence; a captured graph is keyed by its geometry."""
    tokens: int
    seqs: int
    rows: int
    max_context: int
    max_query_len: int
    num_layers: int | None = None     # fewer than the model's: the self-speculative drafter
    mixed: bool = False               # a bucketed prefill/mixed step (levers.mixed_graphs; buckets.py)


class PendingTokens:
    """A launched greedy step's sampled ids: `tokens()` waits for its event and copies them out."""

    def __init__(self, host: np.ndarray, event) -> None:
        self.host, self.event, self.rows = host, event, 0

    def tokens(self) -> np.ndarray:
        self.event.synchronize()
        return self.host[:self.rows].copy()


class MetaBuffers:
    """The step metadata: one pinned host buffer, one device buffer, int32 views at fixed offsets.
    block_tables come last: a step copies the fields in one cuMemcpyHtoDAsync and the columns of
    the tables it uses in one cuMemcpy2DAsync (Numba's copy_to_device costs tens of microseconds
    of Python per call)."""

    FIELDS = ("token_ids", "positions", "slot_mapping", "token_seq", "seq_query_start", "context_lens",
              "logits_indices", "token_src")

    def __init__(self, pool: DevicePool, max_tokens: int, max_seqs: int, max_rows: int, max_blocks: int):
        sizes = {"token_ids": max_tokens, "positions": max_tokens, "slot_mapping": max_tokens,
                 "token_seq": max_tokens, "seq_query_start": max_seqs + 1, "context_lens": max_seqs,
                 "logits_indices": max_rows, "token_src": max_tokens}
        self.offsets, off = {}, 0
        for name in self.FIELDS:
            self.offsets[name] = off
            off += -(-sizes[name] // 32) * 32
        self.table_offset = off
        self.max_blocks = max_blocks
        total = off + max_seqs * max_blocks
        # two pinned staging buffers, used in turn: with the host a step ahead, step N+1's metadata
        # is written while step N's copy may still wait on the stream
        self.hosts = [cuda.pinned_array(total, dtype=np.int32) for _ in range(2)]
        self.host = self.hosts[0]
        self.device = pool.alloc("activations", total, np.int32)
        self.arange = np.arange(max_tokens + max_seqs + max_rows + 2, dtype=np.int32)
        self._views: dict = {}      # (name, n) -> device view: a Numba slice costs tens of microseconds

    def view(self, name: str, n: int):
        v = self._views.get((name, n))
        if v is None:
            o = self.offsets[name]
            v = self._views[(name, n)] = self.device[o:o + n]
        return v

    def tables(self, seqs: int):
        v = self._views.get(("tables", seqs))
        if v is None:
            t = self.table_offset
            v = self._views[("tables", seqs)] = self.device[t:t + seqs * self.max_blocks].reshape(seqs, self.max_blocks)
        return v

    def _put(self, name: str, values: np.ndarray, size: int, pad) -> None:
        o, n = self.offsets[name], len(values)
        self.host[o:o + n] = values
        if size > n:
            self.host[o + n:o + size] = pad if np.isscalar(pad) else pad[:size - n]

    def upload(self, batch: ForwardBatch, g: Geometry, stream: Stream, token_src: np.ndarray | None = None) -> None:
        """Write the batch padded to geometry g (padding tokens: slot -1, position 0, in padding
        segments of one token, or of up to g.max_query_len tokens in a mixed geometry; buckets.padding).
        token_src[t] >= 0: token t is the previous step's sampled row token_src[t] (embedding_feed)."""
        self.host = self.hosts[1] if self.host is self.hosts[0] else self.hosts[0]
        T, S, R = batch.num_tokens, batch.num_seqs, len(batch.logits_indices)
        self._put("token_src", token_src if token_src is not None else np.zeros(0, np.int32), g.tokens, -1)
        self._put("token_ids", batch.token_ids, g.tokens, 0)
        self._put("positions", batch.positions, g.tokens, 0)
        self._put("slot_mapping", batch.slot_mapping, g.tokens, -1)
        # decode padding sequences hold one padding token each; with verify blocks (T > S) there are
        # more padding sequences than padding tokens: the extra ones start (and end) at g.tokens, empty
        token_seq, seq_start, rows = padding(T, S, R, g.tokens, g.seqs, g.rows, g.max_query_len if g.mixed else 1)
        self._put("token_seq", batch.token_seq, g.tokens, token_seq)
        self._put("seq_query_start", batch.seq_query_start, g.seqs + 1, seq_start)
        self._put("context_lens", batch.context_lens, g.seqs, 1)
        self._put("logits_indices", batch.logits_indices, g.rows, rows)
        t, mb = self.table_offset, self.max_blocks
        grid = self.host[t:t + g.seqs * mb].reshape(g.seqs, mb)
        width = max(1, batch.block_tables.shape[1])
        grid[:S, :batch.block_tables.shape[1]] = batch.block_tables
        grid[S:, :width] = 0                       # padding sequences read block 0
        cu("cuMemcpyHtoDAsync", _ptr(self.device), self.host.ctypes.data, t * 4, stream.handle)
        # the tables' first `width` columns only: no kernel reads a column past a step's context
        # (docs/performance.md, "The block-table copy")
        copy_rows_htod(_ptr(self.device) + 4 * t, self.host.ctypes.data + 4 * t, 4 * mb, 4 * width, g.seqs,
                       stream.handle)


def _ptr(array) -> int:
    return array.__cuda_array_interface__["data"][0]


_COPY_2D: list = []


def copy_rows_htod(dst: int, src: int, pitch: int, width: int, rows: int, stream_handle) -> None:
    """cuMemcpy2DAsync of `rows` rows of `width` bytes, both sides `pitch` bytes apart: pinned
    host `src` to device `dst` on the stream (one descriptor, reused: its fields cost ~1 us each)."""
    from metrale.runtime.cuda.errors import driver
    drv = driver()
    if not _COPY_2D:
        c = drv.CUDA_MEMCPY2D()
        c.srcMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_HOST
        c.dstMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
        _COPY_2D.append(c)
    c = _COPY_2D[0]
    c.srcHost, c.srcPitch, c.dstDevice, c.dstPitch = src, pitch, dst, pitch
    c.WidthInBytes, c.Height = width, rows
    cu("cuMemcpy2DAsync", c, stream_handle)


class CudaOps:
    """The Ops of a forward (models/llama.py) as kernel launches on one stream, over fixed buffers
    (graph-safe); a family's extra ops are mixins composed onto it (CudaPart.ops)."""
    accumulate = True        # products into the residual add to it (a tensor-parallel rank > 0 overwrites)

    def __init__(self, backend: "CudaBackend", g: Geometry):
        self.b, self.g, self.s = backend, g, backend.stream.numba
        self.cfg = backend.config
        m = backend.meta
        self.token_ids, self.positions = m.view("token_ids", g.tokens), m.view("positions", g.tokens)
        self.slot_mapping, self.token_seq = m.view("slot_mapping", g.tokens), m.view("token_seq", g.tokens)
        self.seq_query_start = m.view("seq_query_start", g.seqs + 1)
        self.logits_indices = m.view("logits_indices", g.rows)
        self.token_src = m.view("token_src", g.tokens)
        self.block_tables = m.tables(g.seqs)
        self._ss_used = 0            # norm_ss slots taken this step (carried RMSNorm sums)
        self._resid_ss = None        # the slot holding sum(residual^2), while it is current
        self.rows_ptr = _ptr(backend.act["rows"])

    def dense_layers(self, residual, count: int, w: dict):
        return None          # layer by layer (the decode graphs capture them)

    def _buf(self, name: str, n: int | None = None):
        return self.b.view(name, n if n is not None else self.g.tokens)

    def embed(self, weight):
        out = self._buf("residual")
        if self.b.overlap:      # fed rows take their token from the last step's argmax (host a step ahead)
            embedding.embedding_feed(weight, self.token_ids, self.token_src, self.b.act["argmax"], out, stream=self.s)
        else:
            embedding.embedding_gather(weight, self.token_ids, out, stream=self.s)
        self._resid_ss = None
        if self._carry_norm():       # the step's sums start at zero (a memset node in the graph)
            ss = self.b.act["norm_ss"]
            cu("cuMemsetD32Async", _ptr(ss), 0, 2 * ss.shape[0], self.b.stream.handle)   # uint64 slots
        return out

    def _carry_norm(self) -> bool:
        """One token row, decode fusion on, a family whose op sequence allows it (b.carry_norm_sums):
        each GEMV that adds into the residual also sums the squares of the new residual (gemm.gemv
        ss_out, one atomic a block) and the next RMSNorm becomes the consumer GEMV's rmsnorm_ss
        prologue: no norm launch and no per-block reduction, whatever K."""
        return self.g.tokens == 1 and self.b.fuse_decode and self.b.carry_norm_sums and "norm_ss" in self.b.act

    def _take_ss(self):
        i = self._ss_used
        self._ss_used += 1
        return self.b.act["norm_ss"][i:i + 1]

    def _carried_ss(self, x, weight):
        """The carried sum of squares for norm(x), when x is the residual it belongs to (or, at one
        token row, its gathered copy) and the Numba GEMV runs the product; else None."""
        if self._resid_ss is None or self.b.blas_takes(1, weight) or x.shape[0] != 1:
            return None
        if _ptr(x) in (_ptr(self.b.act["residual"]), _ptr(self.b.act["rows"])):
            return self._resid_ss
        return None

    def _norm_out(self, x):
        """The buffer rms_norm(x) writes."""
        return self._buf("normed_rows" if _ptr(x) == self.rows_ptr else "h", x.shape[0])

    def rms_norm(self, x, weight):
        out = self._norm_out(x)
        rmsnorm.rms_norm(x, weight, self.cfg.rms_norm_eps, out, stream=self.s)
        return out

    def linear(self, x, weight, bias=None):
        out = self.b.view(f"out{weight.shape[0]}", x.shape[0])
        if self.b.blas_takes(x.shape[0], weight):
            self.b.blas_linear(x, weight, out, bias, accumulate=False)
        else:
            gemm.linear(x, weight, out, bias, stream=self.s, skinny_max_t=self.b.skinny_max_t)
        return out

    def linear_residual(self, x, weight, residual, prefetch: bool = False):
        """residual += x @ weight.T. prefetch (one row, the Numba GEMV): each block pulls its weight
        rows into L2 before its PDL wait (the o_proj after decode attention, levers.prefetch_o_proj)."""
        if x.shape[0] == 1 and not self.b.blas_takes(1, weight) and (prefetch or self._carry_norm()):
            return self._residual_gemv(x, weight, residual, prefetch=prefetch)
        self._resid_ss = None
        if self.b.blas_takes(x.shape[0], weight):
            self.b.blas_linear(x, weight, residual, None, accumulate=self.accumulate)
        elif self.accumulate:
            gemm.linear_residual(x, weight, residual, stream=self.s, skinny_max_t=self.b.skinny_max_t)
        else:
            gemm.linear(x, weight, residual, stream=self.s, skinny_max_t=self.b.skinny_max_t)
        return self._residual_done(residual)

    def _residual_gemv(self, x, weight, residual, **gemv_args):
        """residual += the one-row GEMV of x (gemm.gemv with gemv_args: a prologue, prefetch); with
        carried norm sums on and the step's residual as the target, its epilogue also sums the
        squares of the new residual for the next norm (self._resid_ss)."""
        ss = self._take_ss() if self._carry_norm() and _ptr(residual) == _ptr(self.b.act["residual"]) else None
        gemm.gemv(x, weight, residual, accumulate=self.accumulate, stream=self.s, ss_out=ss, **gemv_args)
        self._resid_ss = ss
        return self._residual_done(residual)

    def _residual_done(self, residual):
        """After a product into the residual (tensor parallelism: the all-reduce of the partial sums)."""
        return residual

    def _rope(self, layer: int) -> tuple:
        """The (cos, sin) tables layer rotates with (one RoPE for every layer; Gemma's differ by type)."""
        return self.b.cos, self.b.sin

    def _scale(self) -> float:
        """The attention scores' scale: query_pre_attn_scalar ** -0.5 where the config has one."""
        return 1.0 / math.sqrt(self.cfg.query_pre_attn_scalar or self.cfg.head_dim)

    def qkv_to_cache(self, qkv_out, layer, q_norm, k_norm):
        q = self._buf("q")
        cos, sin = self._rope(layer)
        qkv.qkv_rope_store(qkv_out, self.positions, cos, sin, self.slot_mapping, q,
                           self.b.kv.k[layer], self.b.kv.v[layer], interleaved=self.cfg.rope_interleaved,
                           q_norm=q_norm, k_norm=k_norm, eps=self.cfg.rms_norm_eps, stream=self.s)
        return q

    def norm_qkv_to_cache(self, x, norm_weight, weight, bias, layer, q_norm, k_norm):
        """qkv_to_cache(norm_linear(x, ...), ...). At one row without q/k norms, RoPE and the K/V
        store are the QKV GEMV's epilogue (gemm.gemv rope: a warp streams one rotation pair's two
        rows): no qkv buffer, one launch a layer fewer."""
        if not (x.shape[0] == 1 and self.b.fuse_decode and q_norm is None and not self.b.blas_takes(1, weight)):
            return self.qkv_to_cache(self.norm_linear(x, norm_weight, weight, bias), layer, q_norm, k_norm)
        q2, eps = self.b.view("q", 1, (1, self.cfg.q_size)), self.cfg.rms_norm_eps
        rope = (self.positions, *self._rope(layer), self.slot_mapping, self.b.kv.k[layer], self.b.kv.v[layer])
        kw = dict(bias=bias, stream=self.s, rope=rope, interleaved=self.cfg.rope_interleaved)
        ss = self._carried_ss(x, weight)
        if ss is not None:                                  # the residual GEMV left sum(x^2) in ss
            gemm.gemv(x, weight, q2, prologue="rmsnorm_ss", norm_w=norm_weight, eps=eps, ss_in=ss, **kw)
        elif self._fused(1, weight):
            gemm.gemv(x, weight, q2, prologue="rmsnorm", norm_w=norm_weight, eps=eps, **kw)
        else:
            gemm.gemv(self.rms_norm(x, norm_weight), weight, q2, **kw)
        return self._buf("q")

    def attention(self, q, layer):
        out = self._buf("attn")
        scale = self._scale()
        kc, vc = self.b.kv.k64[layer], self.b.kv.v64[layer]
        if self.g.max_query_len >= self.b.prefill_min_tokens:
            prefill = flash_prefill.flash_prefill_attention if self.b.flash_prefill else attention.prefill_attention
            prefill(q, kc, vc, self.block_tables, self.seq_query_start, self.positions, scale,
                    out, max_query_len=self.g.max_query_len, stream=self.s, window=self.cfg.layer_window(layer))
        else:
            self._decode_attention(q, layer, out)
        return self.b.view("attn", self.g.tokens, (self.g.tokens, self.cfg.q_size))

    def _decode_attention(self, q, layer, out) -> None:
        """out: float32 [T, Hq, hd], or (tensor-core kernel only) uint16 room for T x q_size bf16."""
        decode = flash_decode.flash_decode_attention if self.b.flash_decode else attention.paged_attention
        decode(q, self.b.kv.k64[layer], self.b.kv.v64[layer], self.block_tables, self.token_seq, self.positions,
               self._scale(), out, scratch=self.b.attn_scratch, max_context=self.g.max_context,
               stream=self.s, window=self.cfg.layer_window(layer))

    def attention_linear_residual(self, q, layer, weight, residual):
        """residual += attention(q) @ weight.T. When cuBLASLt runs the product of a decode step, the
        tensor-core decode attention (or its split-K merge) writes the bf16 staging input itself:
        no float32 output, no conversion launch (one kernel a layer fewer)."""
        T = self.g.tokens
        if not (self.b.flash_decode and self.g.max_query_len < self.b.prefill_min_tokens and self.b.blas_takes(T, weight)):
            return self.linear_residual(self.attention(q, layer), weight, residual,
                                        prefetch=self.b.prefetch_o_proj and T == 1 and self.b.fuse_decode)
        self._decode_attention(q, layer, self.b.blas_input((T, self.cfg.q_size)))
        self._resid_ss = None
        self.b.blas_linear(None, weight, residual, None, accumulate=self.accumulate, rows=T)
        return self._residual_done(residual)

    def silu_mul(self, gate_up):
        out = self._buf("act")
        activation.silu_mul(gate_up, out, stream=self.s)
        return out

    def _fused(self, rows: int, weight) -> bool:
        """One token row, fusion on, a narrow input (K <= FUSE_MAX_K), and the Numba GEMV (not
        cuBLASLt) runs this product. Wide inputs lose: every block of the GEMV redoes the prologue
        over all K (docs/architecture.md, "Decisions and why")."""
        return (rows == 1 and self.b.fuse_decode and weight.shape[1] <= FUSE_MAX_K
                and not self.b.blas_takes(1, weight))

    def norm_linear(self, x, norm_weight, weight, bias=None):
        """linear(rms_norm(x, norm_weight), weight, bias); at one row the norm is the GEMV's
        prologue (gemm.gemv, prologue 'rmsnorm'): no norm launch, no normed buffer."""
        if self.b.blas_takes(x.shape[0], weight):      # cuBLASLt: the norm writes its bf16 input
            out = self.b.view(f"out{weight.shape[0]}", x.shape[0])
            rmsnorm.rms_norm_bf16(x, norm_weight, self.cfg.rms_norm_eps, self.b.blas_input(x.shape), stream=self.s)
            self.b.blas_linear(None, weight, out, bias, accumulate=False, rows=x.shape[0])
            return out
        ss = self._carried_ss(x, weight)
        if ss is not None:                              # the residual GEMV left sum(x^2) in ss
            out = self.b.view(f"out{weight.shape[0]}", 1)
            gemm.gemv(x, weight, out, prologue="rmsnorm_ss", norm_w=norm_weight, eps=self.cfg.rms_norm_eps,
                      bias=bias, stream=self.s, ss_in=ss)
            return out
        if not self._fused(x.shape[0], weight):
            return self.linear(self.rms_norm(x, norm_weight), weight, bias)
        out = self.b.view(f"out{weight.shape[0]}", 1)
        gemm.gemv(x, weight, out, prologue="rmsnorm", norm_w=norm_weight, eps=self.cfg.rms_norm_eps,
                  bias=bias, stream=self.s)
        return out

    def silu_mul_linear_residual(self, gate_up, weight, residual):
        """residual += silu_mul(gate_up) @ weight.T; at one row silu*mul is the GEMV's prologue."""
        rows = gate_up.shape[0]
        if self.b.blas_takes(rows, weight):             # cuBLASLt: silu*mul writes its bf16 input
            activation.silu_mul_bf16(gate_up, self.b.blas_input((rows, weight.shape[1])), stream=self.s)
            self.b.blas_linear(None, weight, residual, None, accumulate=self.accumulate, rows=rows)
            return self._residual_done(residual)
        if not self._fused(rows, weight):
            return self.linear_residual(self.silu_mul(gate_up), weight, residual)
        return self._residual_gemv(gate_up, weight, residual, prologue="silu_mul")

    def mlp_residual(self, residual, norm_weight, gate_up, down):
        """residual += silu_mul(norm(residual) @ gate_up.T) @ down.T. At one row, when down's input
        is too wide for the silu*mul prologue (K > FUSE_MAX_K: every block would redo it), silu*mul
        is the gate_up GEMV's epilogue instead (gemm.gemv glu: a warp takes a gate row and its up
        row): one launch fewer. Else the norm_linear / silu_mul_linear_residual pair."""
        one_row = (residual.shape[0] == 1 and self.b.fuse_decode and not self.b.blas_takes(1, gate_up)
                   and not self.b.blas_takes(1, down))
        if not one_row or self._fused(1, down):
            return self.silu_mul_linear_residual(self.norm_linear(residual, norm_weight, gate_up), down, residual)
        act, eps = self.b.view("act", 1), self.cfg.rms_norm_eps
        ss = self._carried_ss(residual, gate_up)
        if ss is not None:                                  # the residual GEMV left sum(x^2) in ss
            gemm.gemv(residual, gate_up, act, prologue="rmsnorm_ss", norm_w=norm_weight, eps=eps, ss_in=ss,
                      stream=self.s, glu=True)
        elif self._fused(1, gate_up):
            gemm.gemv(residual, gate_up, act, prologue="rmsnorm", norm_w=norm_weight, eps=eps, stream=self.s, glu=True)
        else:
            gemm.gemv(self.rms_norm(residual, norm_weight), gate_up, act, stream=self.s, glu=True)
        return self.linear_residual(act, down, residual)

    def logits_rows(self, x):
        out = self._buf("rows", self.g.rows)
        qkv.gather_rows(x, self.logits_indices, out, stream=self.s)
        return out


PDL_EARLY_MIN_BYTES = 8 << 30   # levers.pdl_trigger=auto: early triggers from this much weight, late below
MAX_CACHED_VIEWS = 8192         # activation views CudaBackend.view keeps (cleared past this)


class CudaBackend(Backend):
    """The one CUDA backend: memory planning, streams, graphs and weight upload for every model
    family; what differs it asks the family's CUDA part (self.part, runtime/cuda_dense.py)."""
    name = "cuda"
    dtype = np.dtype(np.float32)     # logits and hidden rows (weights and caches are bf16)
    tp = None                        # tensor parallelism (runtime/cuda_tp.py: TpCudaBackend sets it)
    layer_rows = None                # runtime/cuda/layer_rows.LayerRows while a DFlash drafter taps layers

    def __init__(self, config: ModelConfig, weights: WeightStream | None, *, cfg, random_seed: int = 0,
                 family: Family | None = None, ep=None, quantized: dict | None = None):
        """weights: canonical (name, float array) pairs, or None for random weights made on the device.
        ep: expert parallelism (metrale.parallel.ExpertParallel; MoE families): this rank's experts
        only, CUDA graphs off (the exchange syncs with the host). quantized: the parts of the
        matrices that stream as QuantizedTensor or FP8Tensor (QuantizedStream.parts), kept in their
        blocks / FP8 bytes with levers.weights=native, dequantized to bf16 at load with bf16."""
        self.config = c = config
        self.cfg, self.ep = cfg, ep
        self.family = family or family_for(config)
        self.part = self.family.cuda_part()(self)
        self.block_size = int(cfg.cache.block_size)
        levers = cfg.levers
        self._views: dict = {}
        # the streaming path's own table (gemm.skinny_cfg) still sends shapes it loses on to the tiled GEMM
        self.skinny_max_t = max(gemm.FMA_MAX_T, int(levers.gemv_max_rows))
        self.prefill_min_tokens = int(levers.prefill_attention_min_tokens)
        self.flash_prefill = _choice("prefill_attention_kernel", levers.prefill_attention_kernel, ("mma", "fma")) == "mma"
        self.flash_decode = _choice("decode_attention_kernel", levers.decode_attention_kernel, ("mma", "fma")) == "mma"
        self.use_graphs = bool(levers.cuda_graphs) and ep is None and self._can_capture()
        self.sampling_split = bool(levers.sampling_split)
        self.overlap = bool(levers.overlap) and self.part.feeds_tokens     # the host a step ahead (engine)
        self.supports_overlap = self.overlap
        self.graph_sizes = sorted(int(s) for s in levers.graph_batch_sizes)
        self.mixed_graphs = self.use_graphs and bool(levers.mixed_graphs) and self.part.mixed_graphs
        self._init_decode_fusion(levers)
        self.native = _choice("weights", levers.weights, ("native", "bf16")) == "native"
        self.quantized = dict(quantized or {}) if self.native else {}
        self.quant_mma_rows = int(levers.quant_mma_rows)
        self.max_model_len = min(c.max_position, cfg.scheduler.max_model_len or c.max_position)
        self.max_seqs = self.num_state_slots = int(cfg.scheduler.max_num_seqs)
        self.max_tokens = max(int(cfg.scheduler.max_num_batched_tokens), self.graph_sizes[-1] if self.graph_sizes else 1)
        self.max_rows = max(self.max_seqs, self.graph_sizes[-1] if self.graph_sizes else 1)
        self.max_seqs = max(self.max_seqs, self.max_rows)
        self.max_blocks = -(-self.max_model_len // self.block_size)
        self._check_config()                           # before any device memory
        self.cache_kinds = {kind: resolve(DEVICE_CACHES[kind]) for kind in self.family.caches}
        self.ops_class = compose_ops(CudaOps, self.part.ops)
        self.quant_scratch_elems = self._init_quantized()
        # PDL is process-wide (it wraps Numba's launcher); the last backend built decides
        self.pdl = pdl.enable(bool(levers.pdl))
        self.stream = Stream()
        cuda.select_device(0)
        self.blas, self.blas_min_rows = None, int(levers.cublaslt_min_rows)
        self.use_blas = self._want_cublaslt(str(levers.gemm_library))
        self._plan_memory(levers, weights, random_seed)
        if self.use_blas:
            from metrale.runtime.cuda.cublaslt import CublasLt
            ws = self.act["blas_workspace"]
            self.blas = CublasLt(_ptr(ws), ws.nbytes, autotune=int(levers.cublaslt_autotune),
                                 autotune_rows=set(self.graph_sizes) if self.use_graphs else None,
                                 split_k=bool(levers.cublaslt_split_k),
                                 tune_cache=bool(levers.cublaslt_tune_cache))
        self.graphs: dict[Geometry, CudaGraph] = {}
        self.mixed_ladder = token_ladder(self.max_tokens)
        self._mixed_lru: dict[Geometry, None] = {}      # mixed geometries in self.graphs, oldest first
        self._mixed_seen: set[Geometry] = set()         # mixed geometries run once (eagerly): captured next time
        self._mixed_compiled = False                    # warm_mixed compiled every mixed bucket's kernels
        self._mixed_capture_failed: set[Geometry] = set()  # buckets captured after a warm-up run
        self.mixed_stats = {"captures": 0, "replays": 0, "evictions": 0, "eager_steps": 0}
        self._argmax_host = cuda.pinned_array(self.max_rows, dtype=np.int32)
        self._ahead = [PendingTokens(cuda.pinned_array(self.max_rows, dtype=np.int32), Event(timing=False))
                       for _ in range(2)]     # launch_greedy's results, used in turn
        cuda.synchronize()
        self.compile_stats: dict | None = None          # what _precompile did (None: nothing to do)
        try:
            warm_mixed = self.mixed_graphs and bool(levers.warm_mixed) and self.states is None
            self._precompile(int(levers.compile_workers), warm_mixed)
            if self.use_graphs:
                self._capture_ladder()
            if warm_mixed:
                self._warm_mixed()
                self._mixed_compiled = True
        except BaseException:         # free the device memory and graphs now, not in a finalizer at exit
            self.close()
            raise

    @classmethod
    def from_config(cls, cfg, config: ModelConfig, weights, family: Family) -> "CudaBackend":
        """The CUDA backend of a composed config; `weights` a zero-argument stream factory or None."""
        from metrale.models.quantized import QuantizedStream
        quantized = weights.parts if isinstance(weights, QuantizedStream) else None
        return cls(config, weights() if weights is not None else None, cfg=cfg, random_seed=int(cfg.seed), family=family,
                   quantized=quantized)

    def _init_quantized(self) -> int:
        """levers.weights=native with quantized matrices: their ops go through QuantOps, carried
        norm sums are off (the quant GEMV has no such epilogue); returns the many-rows scratch's
        bf16 elements (runtime/cuda/quant.py plan_scratch)."""
        if not self.quantized:
            return 0
        from metrale.runtime.cuda import quant
        if not self.part.quantized_weights:
            raise ValueError(f"levers.weights=native: the {self.family.name} family's CUDA part has no quantized "
                             "road; use levers.weights=bf16")
        self.ops_class = compose_ops(CudaOps, (quant.QuantOps, *self.part.ops))
        self.carry_norm_sums = False
        shapes = {n: (sum(p[1] for p in ps), ps[0][2]) for n, ps in self.quantized.items()}
        return quant.plan_scratch(shapes, self.max_tokens, self.max_rows)

    def _check_config(self) -> None:
        """What the kernels cannot run, refused before the device is touched."""
        tensor = int(self.cfg.parallel.tensor) if "parallel" in self.cfg else 1
        expert = int(self.cfg.parallel.get("expert", 1)) if "parallel" in self.cfg else 1
        if expert > 1:
            raise ValueError(f"parallel.expert={expert}: expert parallelism through the Engine runs on the NumPy "
                             "backend so far (docs/parallel.md); on CUDA, bench/ep_bench.py's ep_generate")
        if tensor > 1 and self.tp is None:
            raise ValueError(f"parallel.tensor={tensor}: this builds one unsplit CUDA backend; tensor-parallel ranks "
                             "are built by metrale.parallel.tp (Engine / python -m metrale with parallel.tensor)")
        self.part.check()
        for name, dim in self.part.gemm_dims():
            if dim % 64:
                raise ValueError(f"the CUDA backend needs {name} to be a multiple of 64, got {dim}")
        if self.flash_prefill and KV in self.family.caches:
            try:                 # e.g. 256-dim heads: the mma prefill's tiles exceed 48 KB of shared memory
                flash_prefill.flash_config(self.config.head_dim)
            except ValueError as exc:
                log.info("prefill attention: the FP32 kernel (%s)", exc)
                self.flash_prefill = False

    def _plan_memory(self, levers, weights: WeightStream | None, seed: int) -> None:
        """One pool: weights, activations (with the slot caches' pools), then the paged caches in
        what is left of cache.gpu_memory_utilization * total (or cache.num_blocks blocks)."""
        weight_bytes = self.part.weight_bytes() + self._quantized_bytes_delta()
        self.pdl_trigger = self._pdl_trigger(str(levers.pdl_trigger), weight_bytes)
        act_bytes = self._activation_bytes() + sum(k.fixed_bytes(self) for k in self.cache_kinds.values())
        free, total = free_device_memory()
        kv_bytes = kv_pool_bytes(free, total, float(self.cfg.cache.gpu_memory_utilization),
                                 reserved=weight_bytes + act_bytes + GRAPH_RESERVE)
        per_block = self._kv_block_bytes()
        num_blocks = self._agree_num_blocks(int(self.cfg.cache.num_blocks or kv_bytes // per_block))
        if num_blocks < 1:
            raise RuntimeError(f"no device memory left for the KV cache: {free / 2**30:.1f} GiB free of "
                               f"{total / 2**30:.1f}, weights need {weight_bytes / 2**30:.1f} GiB")
        self.num_blocks = num_blocks
        self.pool = DevicePool(weight_bytes + act_bytes + num_blocks * per_block + (4 << 20),
                               {"weights": weight_bytes, "activations": act_bytes, "kv": None})
        self.weights = self._load_weights(weights, seed)
        if self.family.check_weights is not None:
            self.family.check_weights(self.config, self.weights, self.ep)
        self._alloc_activations()
        self.caches = {kind: k.allocate(self, num_blocks if k.paged else self.num_state_slots)
                       for kind, k in self.cache_kinds.items()}
        self.kv = next((cache for cache in self.caches.values() if cache.paged), None)   # the block tables index it
        self.states = self.caches.get(STATE)

    def _quantized_bytes_delta(self) -> int:
        """Device bytes the native blocks of self.quantized take minus their bf16 bytes (negative)."""
        from metrale.runtime.cuda.quant import device_bytes_bound
        return sum(device_bytes_bound(ps) - 2 * sum(p[1] for p in ps) * ps[0][2] for ps in self.quantized.values())

    def _pdl_trigger(self, choice: str, weight_bytes: int) -> str:
        """levers.pdl_trigger -> the trigger mode kernels compiled from now on carry (pdl.set_trigger):
        early, late or exit; auto: early from PDL_EARLY_MIN_BYTES of weights, else late (the
        measured crossover: docs/levers.md, pdl_trigger)."""
        if choice not in ("auto", "early", "late", "exit"):
            raise ValueError(f"levers.pdl_trigger must be auto, early, late or exit, not '{choice}'")
        mode = choice if choice != "auto" else ("early" if weight_bytes >= PDL_EARLY_MIN_BYTES else "late")
        pdl.set_trigger(mode)
        return mode

    def _kv_block_bytes(self) -> int:
        """Device bytes of one cache block over the paged kinds (K/V, or MLA's latent rows)."""
        return sum(k.block_bytes(self) for k in self.cache_kinds.values())

    def _rope_host_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """float32 cos/sin [max_model_len, rotary dims / 2] of the model's RoPE, its scaling included."""
        return model_rope(self.config).tables(self.max_model_len)

    def _ladder_batches(self) -> list[ForwardBatch]:
        """A one-token-a-sequence step per decode graph size. Warm-up tokens write block 0, which no
        sequence owns yet."""
        sizes = [s for s in self.graph_sizes if s <= min(self.max_tokens, self.max_rows)]
        return [build_batch([Segment(np.zeros(1, np.int32), 0, np.zeros(1, np.int32)) for _ in range(size)],
                            self.block_size) for size in sizes]

    def _warmup_batches(self, warm_mixed: bool) -> list[ForwardBatch]:
        return (self._ladder_batches() if self.use_graphs else []) + (self.warm_mixed_batches() if warm_mixed else [])

    def _precompile(self, workers: int, warm_mixed: bool) -> None:
        """A start whose kernels are not all in the disk cache: a recording run of the warm-up
        steps finds them (no kernel runs) and `workers` processes compile them at once
        (kernels_numba/precompile.py), which installs them here and in the disk cache; the warm-up
        after it compiles none. A marker in the cache skips the recording run on later starts of the
        same model and levers."""
        if workers <= 0 or not self.part.parallel_compile or self.quantized or not precompile.available():
            return
        marker = precompile.marker(repr(self.config), str(self.cfg.levers), self.max_tokens, self.max_seqs,
                                   self.max_rows, self.max_model_len, self.block_size)
        if marker.exists():
            return
        t0 = time.perf_counter()
        try:
            with precompile.recording() as pending:
                for batch in self._warmup_batches(warm_mixed):
                    g, _ = self._geometry(batch)
                    self.meta.upload(batch, g, self.stream)
                    self._run(g)
            self.stream.synchronize()
        except Exception as exc:   # noqa: BLE001 - the warm-up after it compiles in-process, as with 0 workers
            log.warning("the recording run for parallel compiles failed (%s); compiling in this process", exc)
            return
        stats = {"recorded_s": round(time.perf_counter() - t0, 3), "pending": len(pending)}
        if pending:
            log.info("compiling %d kernels in %d processes", len(pending), min(workers, len(pending)))
            stats.update(precompile.compile_in_workers(pending, workers))
            if stats["failed"]:
                log.warning("%d kernels did not compile in a worker (they compile on first use): %s",
                            len(stats["failed"]), stats["failed"][0])
        if not stats.get("failed"):
            marker.touch()
        self.compile_stats = stats

    def _capture_ladder(self) -> None:
        """Capture the decode graph of every ladder size at the first context bucket now (this also
        compiles every decode kernel): a run's first steps, and the speculation gate's first timings
        of verify steps, then replay instead of paying for a capture."""
        import sys
        from tqdm.auto import tqdm
        batches = self._ladder_batches()
        log.info("compiling kernels and capturing %d decode graphs (batch %s)", len(batches),
                 [b.num_tokens for b in batches])
        for batch in tqdm(batches, desc="CUDA graphs", unit="graph", leave=False, disable=not sys.stderr.isatty()):
            self.forward_greedy(batch)

    def warm_mixed_batches(self) -> list[ForwardBatch]:
        """A step per mixed bucket pair (token bucket i, rows bucket i): prefill segments long
        enough for the prefill attention kernel (none longer than max_model_len), then one-token
        segments for the rows, so every GEMM variant a token or rows bucket selects is compiled.
        Tokens write block 0, which no sequence owns yet."""
        seg = min(self.max_model_len, self.max_blocks * self.block_size)
        if seg < self.prefill_min_tokens:
            return []                                   # no step reaches the prefill attention kernel
        rows_ladder = [r for r in self.graph_sizes if r <= self.max_rows] or [1]
        tokens_ladder = [t for t in self.mixed_ladder if t >= self.prefill_min_tokens]
        batches = []
        for i in range(max(len(tokens_ladder), len(rows_ladder))):
            tokens = tokens_ladder[min(i, len(tokens_ladder) - 1)]
            rows = min(rows_ladder[min(i, len(rows_ladder) - 1)], self.max_seqs)
            long = max(1, -(-(tokens - rows) // (seg - 1)))     # prefill segments of at most seg tokens
            if long >= rows:                                    # all prefill: no one-token rows
                long = rows = max(1, -(-tokens // seg))
            prefill = tokens - (rows - long)
            if long > self.max_seqs or -(-prefill // long) < self.prefill_min_tokens:
                continue
            sizes = [prefill // long + (j < prefill % long) for j in range(long)]
            segs = [Segment(np.zeros(n, np.int32), 0, np.zeros(-(-n // self.block_size), np.int32), "last") for n in sizes]
            segs += [Segment(np.zeros(1, np.int32), 0, np.zeros(1, np.int32), "last") for _ in range(rows - long)]
            batches.append(build_batch(segs, self.block_size))
        return batches

    def _warm_mixed(self) -> None:
        import sys
        from tqdm.auto import tqdm
        batches = self.warm_mixed_batches()
        log.info("compiling the kernels of %d mixed-step buckets", len(batches))
        for batch in tqdm(batches, desc="mixed-step kernels", unit="bucket", leave=False, disable=not sys.stderr.isatty()):
            self.forward_greedy(batch)

    @property
    def plain_ops_class(self) -> type:
        """ops_class without the layer-row copies (a drafter's own layers run this one)."""
        return self.__dict__.get("_plain_ops_class", self.ops_class)

    def keep_layer_rows(self, rows) -> None:
        """From now on every forward also copies the residual after the layers of `rows` (a
        runtime/cuda/layer_rows.LayerRows: a DFlash drafter's context) for every token into its
        buffer; None stops it. The captured graphs are dropped and the decode ladder re-captured
        (with or without the copies)."""
        from metrale.runtime.cuda.layer_rows import LayerRowsOps
        base = self.plain_ops_class
        self._plain_ops_class = base
        self.layer_rows = rows
        self.ops_class = base if rows is None else compose_ops(base, (LayerRowsOps,))
        self.drop_graphs()
        if self.use_graphs:
            self._capture_ladder()

    def drop_graphs(self) -> None:
        """Captured graphs hold old pointers once a cache moves (the state pool's re-carve): they
        are re-captured on use."""
        self.stream.synchronize()
        for graph in self.graphs.values():
            graph.close()
        self.graphs.clear()
        self._mixed_lru.clear()

    # ------------------------------------------------------------------ cuBLASLt
    @staticmethod
    def _want_cublaslt(choice: str) -> bool:
        if choice not in ("auto", "numba", "cublaslt"):
            raise ValueError(f"levers.gemm_library must be auto, numba or cublaslt, not '{choice}'")
        if choice == "numba":
            return False
        from metrale.runtime.cuda.cublaslt import available
        ok, why = available()
        if not ok and choice == "cublaslt":
            raise RuntimeError(f"levers.gemm_library=cublaslt but cuBLASLt does not load ({why}); "
                               "install nvmath-python (pip install 'metrale[cuda]') or use gemm_library=numba")
        log.info("many-row linear layers: %s", why if ok else f"Numba kernels (cuBLASLt unavailable: {why})")
        return ok

    def blas_takes(self, rows: int, weight) -> bool:
        """cuBLASLt runs this product: from cublaslt_min_rows rows on matrices of at least
        BLAS_SMALL_MATRIX elements, from BLAS_SMALL_MIN_ROWS rows on smaller ones (the measured
        crossover: docs/gemm.md)."""
        if self.blas is None or rows < self.blas_min_rows:
            return False
        return rows >= BLAS_SMALL_MIN_ROWS or weight.shape[0] * weight.shape[1] >= BLAS_SMALL_MATRIX

    def blas_input(self, shape: tuple[int, int]):
        """The bf16 staging buffer of cuBLASLt's x, as room for shape[0] * shape[1] values."""
        n = shape[0] * shape[1]
        return self._cached(("x_bf16", n), lambda: self.act["x_bf16"].reshape(-1)[:n])

    def view(self, name: str, n: int, shape: tuple[int, ...] | None = None):
        """self.act[name][:n] (reshaped to `shape` when given), cached per (name, n, shape): a
        Numba slice or reshape costs tens of microseconds of Python, an eager step takes hundreds."""
        return self._cached((name, n, shape), lambda: self.act[name][:n] if shape is None
                            else self.act[name][:n].reshape(*shape))

    def _cached(self, key: tuple, make):
        """The view cached under key, made by make() on first use (cleared past MAX_CACHED_VIEWS)."""
        v = self._views.get(key)
        if v is None:
            if len(self._views) > MAX_CACHED_VIEWS:
                self._views.clear()
            v = self._views[key] = make()
        return v

    def blas_linear(self, x, weight, out, bias, accumulate: bool, rows: int | None = None) -> None:
        """out (+)= x @ bf16(weight).T (+ bias) through cuBLASLt: x is rounded to bf16 first into
        the staging buffer; x None: a producer already wrote `rows` rows there (blas_input)."""
        K = weight.shape[1]
        T = x.shape[0] if x is not None else rows
        xb = self.blas_input((T, K))
        if x is not None:
            convert.x_to_bf16(x, xb, stream=self.stream.numba)
        self.blas.linear(_ptr(xb), _ptr(weight), _ptr(out), T, weight.shape[0], K,
                         bias_ptr=_ptr(bias) if bias is not None else 0, accumulate=accumulate,
                         stream=self.stream.ptr)

    def _init_decode_fusion(self, levers) -> None:
        """levers.fuse_decode: one-row steps run RMSNorm and silu*mul inside the GEMV that reads
        them (CudaOps.norm_linear / silu_mul_linear_residual); carried norm sums where the family's
        op sequence allows them."""
        self.fuse_decode = bool(levers.fuse_decode)
        self.prefetch_o_proj = bool(levers.prefetch_o_proj)
        gemm.GEMV_FORCE.update(warps=int(levers.gemv_warps), unroll=int(levers.gemv_unroll))
        self.carry_norm_sums = bool(levers.carry_norm_sums) and self.part.carries_norm_sums

    # ------------------------------------------------------------------ memory
    def _activation_bytes(self) -> int:
        n = sum(math.prod(shape) * np.dtype(dt).itemsize + 256 for shape, dt in self.part.activation_plan().values())
        meta = 4 * (8 * self.max_tokens + 4 * self.max_seqs + self.max_rows + self.max_seqs * self.max_blocks) + 4096
        scratch = 2 * self.quant_scratch_elems + 256 if self.quant_scratch_elems else 0   # bf16 weights: none
        return n + meta + scratch

    def _alloc_activations(self) -> None:
        self.act = {name: self.pool.alloc("activations", shape, dt)
                    for name, (shape, dt) in self.part.activation_plan().items()}
        self.attn_scratch = self.act["attn_scratch"]
        self.act["argmax_work"].copy_to_device(np.zeros(self.act["argmax_work"].shape, np.uint64))  # argmax_rows keeps it 0
        cos, sin = self._rope_host_tables()
        self.act["cos"].copy_to_device(np.ascontiguousarray(cos, np.float32))
        self.act["sin"].copy_to_device(np.ascontiguousarray(sin, np.float32))
        self.cos, self.sin = self.act["cos"], self.act["sin"]
        self.meta = MetaBuffers(self.pool, self.max_tokens, self.max_seqs, self.max_rows, self.max_blocks)
        self.quant_scratch = (self.pool.alloc("activations", self.quant_scratch_elems, np.uint16)
                              if self.quant_scratch_elems else None)
        self.part.after_activations()

    def quant_scratch_view(self, n: int, k: int):
        """The many-rows scratch as a bf16 [n, k] image (QuantOps' bf16 road)."""
        return self._cached(("quant_scratch", n, k), lambda: self.quant_scratch[:n * k].reshape(n, k))

    def _load_weights(self, weights: WeightStream | None, seed: int) -> dict:
        if weights is None:
            return self._random_weights(seed)
        from metrale.models.fp8 import FP8Tensor
        from metrale.models.quantized import kept
        from metrale.runtime.cuda.quant import upload_fp8_tensor, upload_quantized
        arena, out = self.pool["weights"], {}
        if not self.native:      # levers.weights=bf16: blocks and FP8 bytes dequantized here, uploaded as bf16
            weights = ((n, a.dequantize() if kept(a) else a) for n, a in weights)
        for name, array in self.part.prepare(weights):
            if not kept(array):
                out[name] = arena.upload(array)
            elif name in self.quantized and isinstance(array, FP8Tensor):
                out[name] = upload_fp8_tensor(array, arena=arena)
            elif name in self.quantized:
                # levers.quant_mma_rows = 1: linear Q4_K weights in the tensor-core GEMV's own layout
                out[name] = upload_quantized(array, arena=arena, fragments=self.quant_mma_rows == 1 and name != "embed")
            else:
                raise ValueError(f"weight {name} streams quantized but was not announced (pass its parts as "
                                 "quantized=, e.g. through metrale.models.quantized.QuantizedStream)")
        return out

    def _random_weights(self, seed: int) -> dict:
        """The family's random layout (CudaPart.random_layout), matrices filled on the device."""
        arena, out = self.pool["weights"], {}
        for name, (shape, init) in self.part.random_layout(seed).items():
            if isinstance(init, np.ndarray):
                out[name] = arena.upload(np.ascontiguousarray(init, np.float32))
            elif isinstance(init, str):          # "norm" ~ 1 or "bias" ~ 0
                noise = 0.05 * np.random.default_rng(seed + len(out)).standard_normal(shape)
                out[name] = arena.upload(((1.0 if init == "norm" else 0.0) + noise).astype(np.float32))
            else:
                a = arena.alloc(shape, np.uint16)
                fill_normal_bf16(a.reshape(math.prod(shape)), seed + len(out), float(init))
                out[name] = a
        return out

    # ------------------------------------------------------------------ forward
    def _geometry(self, batch: ForwardBatch, num_layers: int | None = None) -> tuple[Geometry, bool]:
        T, S, R = batch.num_tokens, batch.num_seqs, len(batch.logits_indices)
        if num_layers is not None and num_layers < self.config.num_layers and not self.family.layer_prefix:
            raise ValueError(f"a {self.family.name} model runs all its layers (a layer-prefix forward would "
                             "advance only some layers' recurrent states)")
        if T > self.max_tokens or S > self.max_seqs or R > self.max_rows:
            raise ValueError(f"step of {T} tokens / {S} seqs / {R} logits rows exceeds the CUDA buffers "
                             f"({self.max_tokens} / {self.max_seqs} / {self.max_rows})")
        max_ctx = int(batch.context_lens.max())
        # Decode steps, verify blocks (a few tokens per sequence, logits for every row), and with
        # mixed graphs prefills shorter than the prefill attention kernel's minimum (alone or beside
        # decode rows: logits for some rows) run the same token-level kernels: pad to a ladder size
        # and replay the decode graph of that size (padding tokens are one-token sequences writing nowhere).
        graphed = (self.use_graphs and batch.max_query_len < max(2, self.prefill_min_tokens)
                   and (R == T or self.mixed_graphs) and self.graph_sizes and T <= self.graph_sizes[-1])
        if graphed:
            size = next(s for s in self.graph_sizes if s >= T)
            return Geometry(size, size, size, self.context_bucket(max_ctx), 1, num_layers), True
        # prefill / mixed steps (any segment of several tokens the decode graphs did not take: short
        # ones too, beyond the decode ladder): a bucket whose query length is at least the prefill
        # attention kernel's minimum, so its forward runs that kernel for every segment
        if self.mixed_graphs and batch.max_query_len >= 2:
            b = mixed_bucket(T, S, R, batch.max_query_len, ladder=self.mixed_ladder, max_seqs=self.max_seqs,
                             max_rows=self.max_rows, prefill_min_tokens=self.prefill_min_tokens)
            if b is not None:   # the prefill attention path reads no context length: max_context 0
                g = Geometry(b[0], b[1], b[2], 0, b[3], num_layers, mixed=True)
                return (g if g in self.graphs else self._captured_holder(g, T, S, R, batch.max_query_len) or g), True
            self.mixed_stats["eager_steps"] += 1
        return Geometry(T, S, R, max_ctx, batch.max_query_len, num_layers), False

    def _captured_holder(self, g: Geometry, T: int, S: int, R: int, max_query_len: int) -> Geometry | None:
        """The smallest captured mixed bucket of g's token bucket that holds the step (more
        sequences, rows or query length only: their padding is cheap), so that a bucket seen
        for the first time replays a graph instead of capturing one; None if there is none."""
        own = (g.tokens, g.seqs, g.rows, g.max_query_len)
        fits = [h for h in self._mixed_lru if h.num_layers == g.num_layers
                and holds((h.tokens, h.seqs, h.rows, h.max_query_len), own, T, S, R, max_query_len)]
        return min(fits, key=lambda h: (h.seqs, h.rows, h.max_query_len), default=None)

    def _run(self, g: Geometry) -> None:
        logits = self.family.forward(self.ops_class(self, g), self.weights, self.config, g.num_layers)
        self._pick_greedy(logits, g.rows)

    def _pick_greedy(self, logits, rows: int) -> None:
        """The step's greedy ids into act["argmax"][:rows] (every step: the decode graphs hold it)."""
        argmax.argmax_rows(logits, self.act["argmax"][:rows], self.act["argmax_work"], stream=self.stream.numba)

    def _can_capture(self) -> bool:
        """Whether the steps may be captured as CUDA graphs (tensor parallelism: its collectives)."""
        return True

    def _agree_num_blocks(self, num_blocks: int) -> int:
        """The KV blocks this backend takes (tensor parallelism: the same on every rank)."""
        return num_blocks

    def _execute(self, batch: ForwardBatch, num_layers: int | None = None,
                 token_src: np.ndarray | None = None) -> Geometry:
        g, graphed = self._geometry(batch, num_layers)
        for cache in self.caches.values():           # per-step cache metadata (state slots) before the replay
            cache.before_forward(batch, g.seqs, graphed)
        self.meta.upload(batch, g, self.stream, token_src)
        if not graphed:
            self._run(g)
        elif g in self.graphs:
            self.graphs[g].replay()
            if g.mixed:
                self._mixed_used(g, captured=False)
        elif g.mixed:
            self._first_mixed_step(g)
        else:
            self._capture_after_warmup(g)
        return g

    def _capture_after_warmup(self, g: Geometry) -> None:
        """First use of a geometry: an eager warm-up run computes the step, then its graph is captured."""
        self.graphs[g] = CudaGraph.capture(self.stream, lambda: self._run(g), warmup=1)
        if g.mixed:
            self._mixed_used(g, captured=True)

    def _first_mixed_step(self, g: Geometry) -> None:
        """A mixed bucket not captured yet. Once its kernels are compiled (warm_mixed at start-up,
        or an eager step of the bucket before), it is captured with no eager warm-up and replayed:
        its first step costs one capture, and every later one a replay. Before that it runs
        eagerly. A capture that fails (something compiled or allocated inside it) runs the step
        eagerly, and the bucket's next step is captured after an eager warm-up run, as decode
        steps are."""
        if g in self._mixed_capture_failed:
            return self._capture_after_warmup(g)
        if g in self._mixed_seen or self._mixed_compiled:
            try:
                graph = CudaGraph.capture(self.stream, lambda: self._run(g), warmup=0)
            except Exception as exc:   # noqa: BLE001 - the eager run below computes the step
                if not self._mixed_capture_failed:
                    log.warning("a mixed-step graph capture with no warm-up run failed (%s); that bucket "
                                "runs eagerly once more", exc)
                self._mixed_capture_failed.add(g)
            else:
                self.graphs[g] = graph
                graph.replay()
                self._mixed_used(g, captured=True)
                return
        self._mixed_seen.add(g)
        self.mixed_stats["eager_steps"] += 1
        self._run(g)

    def _mixed_used(self, g: Geometry, captured: bool) -> None:
        """LRU of the mixed graphs: past MAX_MIXED_GRAPHS the least recently used is destroyed
        (a graph still in flight is freed when it completes)."""
        self.mixed_stats["captures" if captured else "replays"] += 1
        self._mixed_lru.pop(g, None)
        self._mixed_lru[g] = None
        while len(self._mixed_lru) > MAX_MIXED_GRAPHS:
            old = next(iter(self._mixed_lru))
            del self._mixed_lru[old]
            graph = self.graphs.pop(old, None)
            if graph is not None:
                graph.close()
                self.mixed_stats["evictions"] += 1

    def context_bucket(self, max_ctx: int) -> int:
        """The context length a decode graph is captured for: a power of two >= max_ctx (at least
        MIN_GRAPH_CONTEXT), at most max_model_len."""
        return min(max(MIN_GRAPH_CONTEXT, 1 << (max_ctx - 1).bit_length()), self.max_model_len)

    def _fetch(self, array, host: np.ndarray) -> np.ndarray:
        cu("cuMemcpyDtoHAsync", host.ctypes.data, _ptr(array), host.nbytes, self.stream.handle)
        self.stream.synchronize()
        return host

    def forward_device(self, batch: ForwardBatch, num_layers: int | None = None):
        """Runs the step; returns its logits on the device, [R, V] float32, not copied to the host:
        a view of the backend's buffer, valid until the next step, written on `self.stream` (work
        queued on that stream after this call sees them)."""
        self._execute(batch, num_layers)
        return self.act[f"out{self.config.vocab_size}"][:len(batch.logits_indices)]

    def forward(self, batch: ForwardBatch, num_layers: int | None = None, return_hidden: bool = False):
        self._execute(batch, num_layers)
        R = len(batch.logits_indices)
        logits = self._fetch(self.act[f"out{self.config.vocab_size}"], np.empty((R, self.config.vocab_size), np.float32))
        if return_hidden:   # the rows before the final norm (gathered by logits_rows)
            return logits, self._fetch(self.act["rows"], np.empty((R, self.config.hidden_size), np.float32))
        return logits

    def forward_greedy(self, batch: ForwardBatch, num_layers: int | None = None) -> np.ndarray:
        self._execute(batch, num_layers)
        R = len(batch.logits_indices)
        return self._fetch(self.act["argmax"], self._argmax_host[:R]).copy()

    def launch_greedy(self, batch: ForwardBatch, prev: "PendingTokens | None" = None,
                      token_src: np.ndarray | None = None) -> "PendingTokens":
        """forward_greedy without waiting: the step is queued and its argmax copied to pinned memory
        behind an event. token_src[t] >= 0 feeds token t from row token_src[t] of `prev`, which
        must be the step launched just before (its ids are still in the argmax buffer)."""
        if token_src is not None and not self.overlap:
            raise RuntimeError("launch_greedy with fed tokens needs levers.overlap (the embedding that feeds them)")
        self._execute(batch, token_src=token_src)
        R = len(batch.logits_indices)
        slot = self._ahead[1] if prev is self._ahead[0] else self._ahead[0]
        cu("cuMemcpyDtoHAsync", slot.host.ctypes.data, _ptr(self.act["argmax"]), R * 4, self.stream.handle)
        slot.event.record(self.stream)
        slot.rows = R
        return slot

    def launch_logits(self, batch: ForwardBatch, prev=None, token_src: np.ndarray | None = None):
        """forward_device with fed tokens: the device logits of a sampled step queued ahead; the
        sampler copies its drawn tokens into feed_buffer for the step after it."""
        if token_src is not None and not self.overlap:
            raise RuntimeError("launch_logits with fed tokens needs levers.overlap (the embedding that feeds them)")
        self._execute(batch, token_src=token_src)
        return self.act[f"out{self.config.vocab_size}"][:len(batch.logits_indices)]

    @property
    def feed_buffer(self):
        return self.act["argmax"]

    def hidden_rows(self, rows: int) -> np.ndarray:
        """The last forward's hidden rows before the final norm, [rows, hidden], to the host."""
        return self._fetch(self.act["rows"], np.empty((rows, self.config.hidden_size), np.float32))

    def forward_greedy_hidden(self, batch: ForwardBatch) -> tuple[np.ndarray, np.ndarray]:
        """forward_greedy plus the hidden rows before the final norm (an MTP drafter's input):
        the argmax stays on the device, so a greedy step copies R ids and R x hidden floats."""
        self._execute(batch)
        R = len(batch.logits_indices)
        ids = self._fetch(self.act["argmax"], self._argmax_host[:R]).copy()
        return ids, self.hidden_rows(R)

    def export_weights(self) -> WeightStream:
        """The canonical weights as float32 host arrays (bf16 matrices widened, the family's device
        layout undone): a NumPy oracle then computes with exactly the weights this backend holds."""
        host = ((name, _host_float(array)) for name, array in self.weights.items())
        yield from self.part.export(host)

    def kv_tokens_that_fit(self, utilization: float = 0.9) -> int:
        """KV tokens the pool would hold at this utilization (without allocating them)."""
        _, total = free_device_memory()
        per_block = self._kv_block_bytes()
        left = utilization * total - self.pool.nbytes + self.num_blocks * per_block
        return int(max(0, left - GRAPH_RESERVE) // (per_block // self.block_size))

    def idle_step(self, num_layers: int | None = None) -> None:
        if self.ep is not None:
            self.part.idle_step(num_layers)

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.close()
        self.graphs.clear()
        self._mixed_lru.clear()
        if self.blas is not None:
            self.blas.close()
            self.blas = None
        self.pool.close()

    def memory_report(self) -> dict:
        free, total = free_device_memory()
        usage = self.pool.usage()
        return {"weights_bytes": usage["weights"].used, "activation_bytes": usage["activations"].used,
                "kv_pool_bytes": usage["kv"].used, "kv_pool_tokens": self.num_blocks * self.block_size,
                "device_used_bytes": total - free, "device_total_bytes": total, "graphs": len(self.graphs),
                "mixed_graphs": len(self._mixed_lru), **{f"mixed_{k}": v for k, v in self.mixed_stats.items()},
                "weights_native": len(self.quantized), "quant_scratch_bytes": 2 * self.quant_scratch_elems,
                "weights_fp8": sum(ps[0][0] == FP8_E4M3 for ps in self.quantized.values()),
                **{k: v for cache in self.caches.values() for k, v in cache.memory().items()}}


def _widened(host: np.ndarray) -> np.ndarray:
    return from_bf16_bits(host) if host.dtype == np.uint16 else host


def _host_float(array) -> np.ndarray:
    """A device weight as float32 on the host: a quantized or FP8 one through its checkpoint value's
    dequantization."""
    from metrale.runtime.cuda.quant import DeviceFP8, DeviceQuantized
    if isinstance(array, (DeviceQuantized, DeviceFP8)):
        return array.host.dequantize()
    return _widened(array.copy_to_host())


def _choice(name: str, value, allowed: tuple[str, ...]) -> str:
    value = str(value)
    if value not in allowed:
        raise ValueError(f"levers.{name} must be {' or '.join(allowed)}, not '{value}'")
    return value
