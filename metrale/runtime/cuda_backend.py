"""CUDA backend: the Llama forward as Numba kernels, memory from one pool, decode as CUDA graphs.

Memory: one cuMemAlloc at start holds the weights (bf16 bits as uint16, norms f32), the
activation buffers (sized for the largest step), the step metadata, and the paged KV pool,
which takes what is left of `cache.gpu_memory_utilization * total` after the rest.
Steps: the host packs the ragged metadata into one pinned buffer and copies it with one
transfer; decode-only steps are padded to a ladder size and replayed from a CUDA graph
captured on first use (its eager warm-up run is that step's result); other steps launch eagerly.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda
from numba.cuda.cudadrv.driver import device_memset

from kernels_numba import (activation, argmax, attention, convert, embedding, flash_decode, flash_prefill, gemm, pdl,
                           qkv, rmsnorm)
from kernels_numba.bf16 import to_bf16_bits
from kernels_numba.random_init import fill_normal_bf16
from metrale.models.config import ModelConfig, refuse_window_beyond
from metrale.models.llama import llama_forward
from metrale.models.checkpoint import WeightStream
from metrale.models.rope import model_rope, model_rotary_dim
from metrale.runtime.batch import ForwardBatch, Segment, build_batch
from metrale.runtime.cuda import CudaGraph, DevicePool, Event, Stream, cu, free_device_memory, kv_pool_bytes
from metrale.runtime.cuda.buckets import MAX_MIXED_GRAPHS, mixed_bucket, padding, token_ladder

log = logging.getLogger("metrale.cuda")

GRAPH_RESERVE = 512 << 20       # memory left outside the pool for graphs, contexts, workspaces
MIN_GRAPH_CONTEXT = 512         # context buckets of decode graphs: powers of two from here
BLAS_SMALL_MATRIX = 1 << 22     # weight elements below which cuBLASLt waits for BLAS_SMALL_MIN_ROWS
BLAS_SMALL_MIN_ROWS = 64
FUSE_MAX_K = 2048               # decode fusion (norm / silu*mul in the GEMV prologue) up to this K


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
    block_tables come last so a step copies only the prefix it uses, in one cuMemcpyHtoDAsync
    (Numba's copy_to_device costs tens of microseconds of Python per call)."""

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
        width = batch.block_tables.shape[1]
        grid[:S, :width] = batch.block_tables
        grid[:S, width:] = 0
        grid[S:] = 0
        end = t + g.seqs * mb
        cu("cuMemcpyHtoDAsync", _ptr(self.device), self.host.ctypes.data, end * 4, stream.handle)


def _ptr(array) -> int:
    return array.__cuda_array_interface__["data"][0]


class CudaOps:
    """Ops of llama_forward as kernel launches on one stream, over fixed buffers (graph-safe)."""

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
        """One token row, decode fusion on, the plain llama ops: each GEMV that adds into the
        residual also sums the squares of the new residual (gemm.gemv ss_out, one atomic a block)
        and the next RMSNorm becomes the consumer GEMV's rmsnorm_ss prologue: no norm launch and
        no per-block reduction, whatever K (the in-GEMV reduction lost on K = 4096)."""
        return (self.g.tokens == 1 and self.b.fuse_decode and self.b.carry_norm_sums and type(self) is CudaOps
                and "norm_ss" in self.b.act)

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

    def rms_norm(self, x, weight):
        out = self._buf("normed_rows" if _ptr(x) == self.rows_ptr else "h", x.shape[0])
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
            self.b.blas_linear(x, weight, residual, None, accumulate=True)
        else:
            gemm.linear_residual(x, weight, residual, stream=self.s, skinny_max_t=self.b.skinny_max_t)
        return residual

    def _residual_gemv(self, x, weight, residual, **gemv_args):
        """residual += the one-row GEMV of x (gemm.gemv with gemv_args: a prologue, prefetch); with
        carried norm sums on and the step's residual as the target, its epilogue also sums the
        squares of the new residual for the next norm (self._resid_ss)."""
        ss = self._take_ss() if self._carry_norm() and _ptr(residual) == _ptr(self.b.act["residual"]) else None
        gemm.gemv(x, weight, residual, accumulate=True, stream=self.s, ss_out=ss, **gemv_args)
        self._resid_ss = ss
        return residual

    def qkv_to_cache(self, qkv_out, layer, q_norm, k_norm):
        q = self._buf("q")
        qkv.qkv_rope_store(qkv_out, self.positions, self.b.cos, self.b.sin, self.slot_mapping, q,
                           self.b.k_cache[layer], self.b.v_cache[layer], interleaved=self.cfg.rope_interleaved,
                           q_norm=q_norm, k_norm=k_norm, eps=self.cfg.rms_norm_eps, stream=self.s)
        return q

    def norm_qkv_to_cache(self, x, norm_weight, weight, bias, layer, q_norm, k_norm):
        """qkv_to_cache(norm_linear(x, ...), ...). At one row without q/k norms, RoPE and the K/V
        store are the QKV GEMV's epilogue (gemm.gemv rope: a warp streams one rotation pair's two
        rows): no qkv buffer, one launch a layer fewer."""
        if not (x.shape[0] == 1 and self.b.fuse_decode and q_norm is None and not self.b.blas_takes(1, weight)):
            return self.qkv_to_cache(self.norm_linear(x, norm_weight, weight, bias), layer, q_norm, k_norm)
        q2, eps = self.b.view("q", 1, (1, self.cfg.q_size)), self.cfg.rms_norm_eps
        rope = (self.positions, self.b.cos, self.b.sin, self.slot_mapping, self.b.k_cache[layer], self.b.v_cache[layer])
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
        scale = 1.0 / math.sqrt(self.cfg.head_dim)
        kc, vc = self.b.k_cache64[layer], self.b.v_cache64[layer]
        if self.g.max_query_len >= self.b.prefill_min_tokens:
            prefill = flash_prefill.flash_prefill_attention if self.b.flash_prefill else attention.prefill_attention
            prefill(q, kc, vc, self.block_tables, self.seq_query_start, self.positions, scale,
                    out, max_query_len=self.g.max_query_len, stream=self.s)
        else:
            self._decode_attention(q, layer, out)
        return self.b.view("attn", self.g.tokens, (self.g.tokens, self.cfg.q_size))

    def _decode_attention(self, q, layer, out) -> None:
        """out: float32 [T, Hq, hd], or (tensor-core kernel only) uint16 room for T x q_size bf16."""
        decode = flash_decode.flash_decode_attention if self.b.flash_decode else attention.paged_attention
        decode(q, self.b.k_cache64[layer], self.b.v_cache64[layer], self.block_tables, self.token_seq, self.positions,
               1.0 / math.sqrt(self.cfg.head_dim), out, scratch=self.b.attn_scratch, max_context=self.g.max_context,
               stream=self.s)

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
        self.b.blas_linear(None, weight, residual, None, accumulate=True, rows=T)
        return residual

    def silu_mul(self, gate_up):
        out = self._buf("act")
        activation.silu_mul(gate_up, out, stream=self.s)
        return out

    def _fused(self, rows: int, weight) -> bool:
        """One token row, fusion on, a narrow input (K <= FUSE_MAX_K), and the Numba GEMV (not
        cuBLASLt) runs this product. Wide inputs lose: every block of the GEMV redoes the
        prologue over all K (H200: Llama-3-8B's qkv/gate_up/down went 17/58/33 -> 21/62/63 us,
        while a separate norm or silu launch costs ~3 us)."""
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
            self.b.blas_linear(None, weight, residual, None, accumulate=True, rows=rows)
            return residual
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


class CudaBackend:
    name = "cuda"

    def __init__(self, config: ModelConfig, weights: WeightStream | None, *, cfg, random_seed: int = 0):
        self.config = c = config
        self.block_size = int(cfg.cache.block_size)
        levers = cfg.levers
        self._views: dict = {}
        # the streaming path's own table (gemm.skinny_cfg) still sends shapes it loses on to the tiled GEMM
        self.skinny_max_t = max(gemm.FMA_MAX_T, int(levers.gemv_max_rows))
        self.prefill_min_tokens = int(levers.prefill_attention_min_tokens)
        if levers.prefill_attention_kernel not in ("mma", "fma"):
            raise ValueError(f"levers.prefill_attention_kernel must be mma or fma, not '{levers.prefill_attention_kernel}'")
        self.flash_prefill = levers.prefill_attention_kernel == "mma"
        if levers.decode_attention_kernel not in ("mma", "fma"):
            raise ValueError(f"levers.decode_attention_kernel must be mma or fma, not '{levers.decode_attention_kernel}'")
        self.flash_decode = levers.decode_attention_kernel == "mma"
        self._init_decode_fusion(levers)
        # PDL is process-wide (it wraps Numba's launcher); the last backend built decides
        self.pdl = pdl.enable(bool(getattr(levers, "pdl", True)))
        self.use_graphs = bool(levers.cuda_graphs)
        # the host a step ahead (engine: levers.overlap) needs the feeding embedding of the dense forward
        self.overlap = bool(levers.overlap) and type(self)._run is CudaBackend._run
        self.supports_overlap = self.overlap
        self.graph_sizes = sorted(int(s) for s in levers.graph_batch_sizes)
        # prefill and mixed steps replayed from bucketed graphs: the dense forward only (the hybrid
        # and MLA families keep per-step state or context-sized launches in those steps)
        self.mixed_graphs = (self.use_graphs and bool(getattr(levers, "mixed_graphs", False))
                             and type(self)._run is CudaBackend._run)
        self.max_model_len = min(c.max_position, cfg.scheduler.max_model_len or c.max_position)
        refuse_window_beyond(c, self.max_model_len)   # no windowed kernels: full attention is exact only inside it
        self.max_seqs = int(cfg.scheduler.max_num_seqs)
        self.max_tokens = max(int(cfg.scheduler.max_num_batched_tokens), self.graph_sizes[-1] if self.graph_sizes else 1)
        self.max_rows = max(self.max_seqs, self.graph_sizes[-1] if self.graph_sizes else 1)
        self.max_seqs = max(self.max_seqs, self.max_rows)
        self.max_blocks = -(-self.max_model_len // self.block_size)
        for name, dim in self._gemm_dims():
            if dim % 64:
                raise ValueError(f"the CUDA backend needs {name} to be a multiple of 64, got {dim}")
        self.stream = Stream()
        cuda.select_device(0)
        self.blas, self.blas_min_rows = None, int(levers.cublaslt_min_rows)
        self.use_blas = self._want_cublaslt(str(levers.gemm_library))

        weight_bytes = self._weight_bytes()
        self.pdl_trigger = self._pdl_trigger(str(getattr(levers, "pdl_trigger", "auto")), weight_bytes)
        act_bytes = self._activation_bytes()
        free, total = free_device_memory()
        kv_bytes = kv_pool_bytes(free, total, float(cfg.cache.gpu_memory_utilization),
                                 reserved=weight_bytes + act_bytes + GRAPH_RESERVE)
        per_block = self._kv_block_bytes()
        num_blocks = int(cfg.cache.num_blocks or kv_bytes // per_block)
        if num_blocks < 1:
            raise RuntimeError(f"no device memory left for the KV cache: {free / 2**30:.1f} GiB free of "
                               f"{total / 2**30:.1f}, weights need {weight_bytes / 2**30:.1f} GiB")
        self.num_blocks = num_blocks
        self.pool = DevicePool(weight_bytes + act_bytes + num_blocks * per_block + (4 << 20),
                               {"weights": weight_bytes, "activations": act_bytes, "kv": None})
        self.weights = self._load_weights(weights, random_seed)
        self._alloc_activations()
        self._alloc_kv_cache(num_blocks)
        if self.use_blas:
            from metrale.runtime.cuda.cublaslt import CublasLt
            ws = self.act["blas_workspace"]
            self.blas = CublasLt(_ptr(ws), ws.nbytes, autotune=int(getattr(levers, "cublaslt_autotune", 0)),
                                 autotune_rows=set(self.graph_sizes) if self.use_graphs else None,
                                 split_k=bool(getattr(levers, "cublaslt_split_k", True)))
        self.graphs: dict[Geometry, CudaGraph] = {}
        self.mixed_ladder = token_ladder(self.max_tokens)
        self._mixed_lru: dict[Geometry, None] = {}      # mixed geometries in self.graphs, oldest first
        self.mixed_stats = {"captures": 0, "replays": 0, "evictions": 0, "eager_steps": 0}
        self._argmax_host = cuda.pinned_array(self.max_rows, dtype=np.int32)
        self._ahead = [PendingTokens(cuda.pinned_array(self.max_rows, dtype=np.int32), Event(timing=False))
                       for _ in range(2)]     # launch_greedy's results, used in turn
        cuda.synchronize()
        if self.use_graphs:
            self._capture_ladder()

    def _pdl_trigger(self, choice: str, weight_bytes: int) -> str:
        """levers.pdl_trigger -> the trigger mode kernels compiled from now on carry (pdl.set_trigger):
        early, late or exit. auto: early for models of at least PDL_EARLY_MIN_BYTES of weights, else
        late (H200, graph replay at batch 1: early wins on Llama-3-8B, 4,557 vs late 4,674 us;
        late wins on Llama-3.2-1B, 1,018 vs early 1,076 / exit 1,058, and on SmolLM2-135M, 694 vs
        911 / 780; docs/performance.md, Session 6)."""
        if choice not in ("auto", "early", "late", "exit"):
            raise ValueError(f"levers.pdl_trigger must be auto, early, late or exit, not '{choice}'")
        mode = choice if choice != "auto" else ("early" if weight_bytes >= PDL_EARLY_MIN_BYTES else "late")
        pdl.set_trigger(mode)
        return mode

    # ------------------------------------------------------------------ hooks of model families
    def _gemm_dims(self) -> list[tuple[str, int]]:
        """(name, size) of the dimensions the GEMM kernels need as multiples of 64."""
        c = self.config
        return [("hidden_size", c.hidden_size), ("intermediate_size", c.intermediate_size),
                ("q+k+v size", c.q_size + 2 * c.kv_size), ("vocab_size", c.vocab_size)]

    def _kv_block_bytes(self) -> int:
        """Device bytes of one cache block over the attention layers (K and V here; MLA: the latent
        rows); hybrid models' recurrent layers keep no KV."""
        c = self.config
        return 2 * c.num_kv_layers * self.block_size * c.kv_size * 2

    def _alloc_kv_cache(self, num_blocks: int) -> None:
        c = self.config
        shape = (c.num_kv_layers, num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        self.k_cache = self.pool.alloc("kv", shape, np.uint16)
        self.v_cache = self.pool.alloc("kv", shape, np.uint16)
        # Zero the pool once: graph padding rows read block 0, which must hold finite values.
        device_memset(self.k_cache, 0, self.k_cache.nbytes)
        device_memset(self.v_cache, 0, self.v_cache.nbytes)
        self.k_cache64 = self.k_cache.view(np.uint64)
        self.v_cache64 = self.v_cache.view(np.uint64)

    def _rope_host_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """float32 cos/sin [max_model_len, rotary dims / 2] of the model's RoPE, its scaling included."""
        return model_rope(self.config).tables(self.max_model_len)

    def _capture_ladder(self) -> None:
        """Capture the decode graph of every ladder size at the first context bucket now (this also
        compiles every decode kernel): a run's first steps, and the speculation gate's first timings
        of verify steps, then replay instead of paying for a capture. Warm-up tokens write block 0,
        which no sequence owns yet."""
        import sys
        from tqdm.auto import tqdm
        sizes = [s for s in self.graph_sizes if s <= min(self.max_tokens, self.max_rows)]
        log.info("compiling kernels and capturing %d decode graphs (batch %s)", len(sizes), sizes)
        for size in tqdm(sizes, desc="CUDA graphs", unit="graph", leave=False, disable=not sys.stderr.isatty()):
            segs = [Segment(np.zeros(1, np.int32), 0, np.zeros(1, np.int32)) for _ in range(size)]
            self.forward_greedy(build_batch(segs, self.block_size))

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
        BLAS_SMALL_MATRIX elements, from BLAS_SMALL_MIN_ROWS rows on smaller ones (measured on the
        H200, docs/gemm.md: on SmolLM2's 0.2-1.8 MB matrices the Numba streaming kernels win by
        1-2 us up to 32-64 rows; on Llama-3-8B's cuBLASLt ties or wins from 2 rows)."""
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
        them (CudaOps.norm_linear / silu_mul_linear_residual)."""
        self.fuse_decode = bool(getattr(levers, "fuse_decode", True))
        self.prefetch_o_proj = bool(getattr(levers, "prefetch_o_proj", True))
        gemm.GEMV_FORCE.update(warps=int(getattr(levers, "gemv_warps", 0)), unroll=int(getattr(levers, "gemv_unroll", 0)))
        self.carry_norm_sums = bool(getattr(levers, "carry_norm_sums", False))

    # ------------------------------------------------------------------ memory plan
    def _weight_bytes(self) -> int:
        c = self.config
        n = c.num_parameters() * 2 + (2 * c.num_layers + 1) * c.hidden_size * 4
        n += c.num_layers * (2 * c.head_dim * 4 + (c.q_size + 2 * c.kv_size) * 4)   # qk norms, biases
        return n + 256 * (12 * c.num_layers + 8)                                       # alignment

    def _activation_plan(self) -> dict[str, tuple[tuple[int, ...], type]]:
        c, T, R = self.config, self.max_tokens, self.max_rows
        plan = {"residual": ((T, c.hidden_size), np.float32), "h": ((T, c.hidden_size), np.float32),
                "q": ((T, c.num_heads, c.head_dim), np.float32), "attn": ((T, c.num_heads, c.head_dim), np.float32),
                "act": ((T, c.intermediate_size), np.float32), "rows": ((R, c.hidden_size), np.float32),
                "normed_rows": ((R, c.hidden_size), np.float32), "argmax": ((R,), np.int32),
                "argmax_work": ((argmax.argmax_work_size(R),), np.uint64)}
        for n in {c.q_size + 2 * c.kv_size, c.hidden_size, 2 * c.intermediate_size}:
            plan[f"out{n}"] = ((T, n), np.float32)
        plan[f"out{c.vocab_size}"] = ((R, c.vocab_size), np.float32)
        scratch = attention.paged_attention_scratch_shape(T, c.num_heads, c.num_kv_heads, c.head_dim,
                                                          self.max_model_len)
        plan["attn_scratch"] = (scratch, np.float32)
        if self.use_blas:
            from metrale.runtime.cuda.cublaslt import WORKSPACE_BYTES
            widest = max(c.hidden_size, c.intermediate_size, c.q_size)
            plan["x_bf16"] = ((T, widest), np.uint16)
            plan["blas_workspace"] = ((WORKSPACE_BYTES,), np.uint8)
        plan["norm_ss"] = ((2 * c.num_layers + 2,), np.uint64)    # carried RMSNorm sums, fixed point (gemm.SS_SCALE)
        half = model_rotary_dim(c) // 2                          # partial RoPE: the rotated dims only
        plan["cos"] = ((self.max_model_len, half), np.float32)
        plan["sin"] = ((self.max_model_len, half), np.float32)
        return plan

    def _activation_bytes(self) -> int:
        n = sum(math.prod(shape) * np.dtype(dt).itemsize + 256 for shape, dt in self._activation_plan().values())
        meta = 4 * (8 * self.max_tokens + 4 * self.max_seqs + self.max_rows + self.max_seqs * self.max_blocks) + 4096
        return n + meta

    def _alloc_activations(self) -> None:
        self.act = {name: self.pool.alloc("activations", shape, dt) for name, (shape, dt) in self._activation_plan().items()}
        self.attn_scratch = self.act["attn_scratch"]
        if "argmax_work" in self.act:                      # argmax_rows keeps it zero between launches
            self.act["argmax_work"].copy_to_device(np.zeros(self.act["argmax_work"].shape, np.uint64))
        cos, sin = self._rope_host_tables()
        self.act["cos"].copy_to_device(np.ascontiguousarray(cos, np.float32))
        self.act["sin"].copy_to_device(np.ascontiguousarray(sin, np.float32))
        self.cos, self.sin = self.act["cos"], self.act["sin"]
        self.meta = MetaBuffers(self.pool, self.max_tokens, self.max_seqs, self.max_rows, self.max_blocks)

    def _load_weights(self, weights: WeightStream | None, seed: int) -> dict:
        arena = self.pool["weights"]
        out = {}
        if weights is None:
            return self._random_weights(seed)
        for name, array in weights:
            if array.ndim == 2:
                out[name] = arena.upload(to_bf16_bits(array))
            else:
                out[name] = arena.upload(np.ascontiguousarray(array, dtype=np.float32))
        return out

    def _random_weights(self, seed: int) -> dict:
        c, arena = self.config, self.pool["weights"]
        out = {}

        def mat(name: str, rows: int, cols: int, std: float):
            a = arena.alloc((rows, cols), np.uint16)
            fill_normal_bf16(a.reshape(rows * cols), seed + len(out), std)
            out[name] = a

        def vec(name: str, n: int):
            out[name] = arena.upload((1.0 + 0.05 * np.random.default_rng(seed + len(out)).standard_normal(n)).astype(np.float32))

        mat("embed", c.vocab_size, c.hidden_size, 0.5)
        for i in range(c.num_layers):
            p = f"layers.{i}."
            vec(p + "attn_norm", c.hidden_size)
            mat(p + "qkv", c.q_size + 2 * c.kv_size, c.hidden_size, c.hidden_size ** -0.5)
            mat(p + "o", c.hidden_size, c.q_size, c.q_size ** -0.5)
            vec(p + "mlp_norm", c.hidden_size)
            mat(p + "gate_up", 2 * c.intermediate_size, c.hidden_size, c.hidden_size ** -0.5)
            mat(p + "down", c.hidden_size, c.intermediate_size, c.intermediate_size ** -0.5)
            if c.qk_norm:
                vec(p + "q_norm", c.head_dim)
                vec(p + "k_norm", c.head_dim)
        vec("final_norm", c.hidden_size)
        if not c.tie_word_embeddings:
            mat("lm_head", c.vocab_size, c.hidden_size, c.hidden_size ** -0.5)
        return out

    # ------------------------------------------------------------------ forward
    def _geometry(self, batch: ForwardBatch, num_layers: int | None = None) -> tuple[Geometry, bool]:
        T, S, R = batch.num_tokens, batch.num_seqs, len(batch.logits_indices)
        if T > self.max_tokens or S > self.max_seqs or R > self.max_rows:
            raise ValueError(f"step of {T} tokens / {S} seqs / {R} logits rows exceeds the CUDA buffers "
                             f"({self.max_tokens} / {self.max_seqs} / {self.max_rows})")
        max_ctx = int(batch.context_lens.max())
        # Decode steps, and verify blocks (a few tokens per sequence, logits for every row) mixed
        # with decode rows, run the same token-level kernels: pad to a ladder size and replay the
        # decode graph of that size (padding tokens are one-token sequences writing nowhere).
        graphed = (self.use_graphs and batch.max_query_len < max(2, self.prefill_min_tokens) and R == T and self.graph_sizes
                   and T <= self.graph_sizes[-1])
        if graphed:
            size = next(s for s in self.graph_sizes if s >= T)
            bucket = max(MIN_GRAPH_CONTEXT, 1 << (max_ctx - 1).bit_length())
            return Geometry(size, size, size, min(bucket, self.max_model_len), 1, num_layers), True
        if self.mixed_graphs and batch.max_query_len >= self.prefill_min_tokens:
            b = mixed_bucket(T, S, R, batch.max_query_len, ladder=self.mixed_ladder, max_seqs=self.max_seqs,
                             max_rows=self.max_rows, prefill_min_tokens=self.prefill_min_tokens)
            if b is not None:   # the prefill attention path reads no context length: max_context 0
                return Geometry(b[0], b[1], b[2], 0, b[3], num_layers, mixed=True), True
            self.mixed_stats["eager_steps"] += 1
        return Geometry(T, S, R, max_ctx, batch.max_query_len, num_layers), False

    def _upload(self, batch: ForwardBatch, g: Geometry, token_src: np.ndarray | None = None) -> None:
        self.meta.upload(batch, g, self.stream, token_src)

    def _run(self, g: Geometry) -> None:
        logits = llama_forward(CudaOps(self, g), self.weights, self.config, g.num_layers)
        argmax.argmax_rows(logits, self.act["argmax"][:g.rows], self.act["argmax_work"], stream=self.stream.numba)

    def _execute(self, batch: ForwardBatch, num_layers: int | None = None,
                 token_src: np.ndarray | None = None) -> Geometry:
        g, graphed = self._geometry(batch, num_layers)
        self._upload(batch, g, token_src)
        if not graphed:
            self._run(g)
        elif g in self.graphs:
            self.graphs[g].replay()
            if g.mixed:
                self._mixed_used(g, captured=False)
        else:  # first use: the warm-up run computes this step, then the graph is captured
            self.graphs[g] = CudaGraph.capture(self.stream, lambda: self._run(g), warmup=1)
            if g.mixed:
                self._mixed_used(g, captured=True)
        return g

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
        """The weights as float32 host arrays (bf16 matrices widened): to build a NumPy oracle
        that computes with exactly the weights this backend holds."""
        from kernels_numba.bf16 import from_bf16_bits
        for name, array in self.weights.items():
            host = array.copy_to_host()
            yield name, from_bf16_bits(host) if host.dtype == np.uint16 else host

    def kv_tokens_that_fit(self, utilization: float = 0.9) -> int:
        """KV tokens the pool would hold at this utilization (without allocating them)."""
        _, total = free_device_memory()
        c = self.config
        left = utilization * total - self.pool.nbytes + self.num_blocks * self._kv_block_bytes()
        return int(max(0, left - GRAPH_RESERVE) // c.kv_bytes_per_token(2))

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
                "mixed_graphs": len(self._mixed_lru), **{f"mixed_{k}": v for k, v in self.mixed_stats.items()}}
