"""Tensor parallelism on the CUDA backend, dense family (docs/parallel.md, "The CUDA side").

A rank's backend (TpCudaBackend) is a CudaBackend of the local config (TensorParallel.local_config:
H/N heads, its KV heads, F/N; the vocabulary slice padded to a multiple of 64 for the LM-head
GEMM, its real width kept for the argmax and the returned logits), built from a weight stream of
its shards (hf_shard_stream) or random weights at the local shapes. Its CUDA part (TpDenseCuda)
is the dense one with the TP ops composed in and what cannot hold at TP off:

  TpCudaOps.embed            the vocab slice's rows (ids outside it write 0), then all_reduce
  TpCudaOps row products     o and down: rank 0 adds into the residual as at TP=1, ranks > 0
                             write their partial product over it (CudaOps.accumulate off), then one
                             in-place all_reduce gives every rank residual + the sum of partials
                             (no extra kernel; every path: GEMV, fused prologues, cuBLASLt, tiled)
  greedy                     argmax over the slice -> (value, global index) pairs -> all_gather
                             [N, R, 2] -> the pick kernel writes the global ids into act["argmax"]
                             on every rank
  carried norm sums          off (a residual GEMV's sum of squares would be of its partial)
  tokens fed on the device   off (levers.overlap: the leader's host loop does not run ahead at TP)
  parallel compile           off (its recording run would issue the collectives)

The collectives (metrale/parallel/collectives.py) run on the backend's stream inside _run, so the
decode and mixed graphs capture them (NCCL), or, host-staged (tests, the simulator), graphs are off.
Every rank builds the same graphs in the same order (same settings, same warm-up batches).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterator

import numpy as np

from kernels_numba import argmax, embedding, tp_pick
from metrale.models.checkpoint import WeightStream
from metrale.models.families import family_named
from metrale.parallel.collectives import DeviceCollectives
from metrale.runtime.batch import ForwardBatch
from metrale.runtime.cuda import CudaGraph
from metrale.runtime.cuda_backend import CudaBackend, Geometry
from metrale.runtime.cuda_dense import DenseCuda

log = logging.getLogger("metrale.cuda")

VOCAB_ALIGN = 64        # the LM-head GEMM's N: a multiple of 64


def padded_vocab(rows: int) -> int:
    """Device rows of a vocabulary slice of `rows` ids (at least one GEMM tile)."""
    return max(VOCAB_ALIGN, -(-rows // VOCAB_ALIGN) * VOCAB_ALIGN)


def pad_vocab(stream: WeightStream, rows: int) -> WeightStream:
    """The embed / lm_head slices padded with zero rows to `rows` (the rest passes unchanged)."""
    for name, a in stream:
        if name in ("embed", "lm_head") and a.shape[0] < rows:
            a = np.concatenate([np.asarray(a, np.float32), np.zeros((rows - a.shape[0], a.shape[1]), np.float32)])
        yield name, a


class TpCudaOps:
    """CudaOps mixin of a tensor-parallel rank: the vocab-parallel embedding and the row-parallel
    products end in an all-reduce of the residual (module docstring)."""

    def __init__(self, backend: "TpCudaBackend", g):
        super().__init__(backend, g)
        self.accumulate = backend.tp.rank == 0       # ranks > 0 contribute their partial alone

    def embed(self, weight):
        out = self._buf("residual")
        lo, hi = self.b.tp.vocab_range
        embedding.embedding_gather_slice(weight, self.token_ids, lo, hi, out, stream=self.s)
        self._resid_ss = None
        self.b.collectives.all_reduce(out, self.b.stream)
        return out

    def _residual_done(self, residual):
        self.b.collectives.all_reduce(residual, self.b.stream)
        return residual


class TpDenseCuda(DenseCuda):
    """The dense CUDA part at tensor parallelism: TpCudaOps, the pick buffers, partial-sum-unsafe
    fusions off."""
    ops = (TpCudaOps,)
    carries_norm_sums = feeds_tokens = parallel_compile = quantized_weights = False

    def activation_plan(self) -> dict[str, tuple[tuple[int, ...], type]]:
        plan = super().activation_plan()
        R = self.b.max_rows
        plan["tp_pairs"] = ((R, 2), np.float32)                           # this rank's (max, index) a row
        plan["tp_gathered"] = ((self.b.tp.world * R * 2,), np.float32)    # every rank's, [N, R, 2]
        return plan


class TpCudaBackend(CudaBackend):
    """One tensor-parallel rank's CudaBackend (module docstring). forward returns this rank's
    vocab slice of the logits [R, hi - lo] (TPRank gathers them); forward_greedy the global ids."""
    picks_greedy = True          # forward_greedy's ids are the whole vocabulary's on every rank

    def __init__(self, tp, collectives: DeviceCollectives, weights: WeightStream | None, *, cfg,
                 random_seed: int = 0):
        lo, hi = tp.vocab_range
        self.tp, self.collectives, self.full_config = tp, collectives, tp.config
        self.vocab_lo, self.vocab_width = lo, hi - lo
        config = dataclasses.replace(tp.local_config, vocab_size=padded_vocab(-(-tp.config.vocab_size // tp.world)))
        family = dataclasses.replace(family_named("dense"), cuda=f"{__name__}:TpDenseCuda")
        super().__init__(config, None if weights is None else pad_vocab(weights, config.vocab_size), cfg=cfg,
                         random_seed=random_seed, family=family)

    def _can_capture(self) -> bool:
        return self.collectives.graph_safe

    def _agree_num_blocks(self, num_blocks: int) -> int:
        """The smallest rank's KV blocks: one block table indexes every rank's pages."""
        from metrale.parallel.comm import all_gather
        return int(min(int(p[0]) for p in all_gather(self.tp.comm, np.array([num_blocks], np.int64))))

    def _first_mixed_step(self, g: Geometry) -> None:
        """CudaBackend._first_mixed_step with the capture's outcome agreed by every rank. Its capture
        with no eager warm-up may fail on one rank only (something compiled or allocated inside it);
        that rank would then run the step eagerly while the others replay their graph, but NCCL
        needs a collective to be graph-captured on every rank or on none (and a graph holding
        collectives to be launched by every rank that captured it). So the ranks all_gather whether
        their capture succeeded (host communicator, once a bucket) and, unless all did, every rank
        drops its graph, marks the bucket failed and runs the step eagerly."""
        if g in self._mixed_capture_failed or not (g in self._mixed_seen or self._mixed_compiled):
            return super()._first_mixed_step(g)      # capture after an eager warm-up, or eager: the same everywhere
        graph = None
        try:
            graph = CudaGraph.capture(self.stream, lambda: self._run(g), warmup=0)
        except Exception as exc:   # noqa: BLE001 - agreed below; the eager run computes the step
            log.warning("rank %d: a mixed-step graph capture with no warm-up run failed (%s)", self.tp.rank, exc)
        from metrale.parallel.comm import all_gather
        flags = all_gather(self.tp.comm, np.array([[graph is not None]], np.int32))
        if all(int(f[0, 0]) for f in flags):
            self.graphs[g] = graph
            graph.replay()
            self._mixed_used(g, captured=True)
            return
        if graph is not None:
            graph.close()
        self._mixed_capture_failed.add(g)
        self._mixed_seen.add(g)
        self.mixed_stats["eager_steps"] += 1
        self._run(g)

    def _pick_greedy(self, logits, rows: int) -> None:
        s, width, n = self.stream.numba, self.vocab_width, self.tp.world
        ids = self.view("argmax", rows)
        if width:
            mine = self._cached(("tp_slice", rows), lambda: logits[:, :width])
            argmax.argmax_rows(mine, ids, self.act["argmax_work"], stream=s)
        pairs = self.view("tp_pairs", rows)
        tp_pick.pack_pairs(logits, ids, width, self.vocab_lo, pairs, stream=s)
        gathered = self.view("tp_gathered", n * rows * 2, (n, rows, 2))
        self.collectives.all_gather(pairs, gathered, self.stream)
        tp_pick.pick_pairs(gathered, ids, stream=s)

    def forward(self, batch: ForwardBatch, num_layers: int | None = None, return_hidden: bool = False):
        out = super().forward(batch, num_layers, return_hidden)
        w = self.vocab_width
        return (out[0][:, :w], out[1]) if return_hidden else out[:, :w]

    def follow_step(self, batch: ForwardBatch, num_layers: int | None = None) -> None:
        """A follower's greedy step: run it (its collectives included), read nothing back."""
        self._execute(batch, num_layers)

    def export_weights(self) -> Iterator[tuple[str, np.ndarray]]:
        raise NotImplementedError("a tensor-parallel rank holds only its shards")

    def close(self) -> None:
        super().close()
        self.collectives.close()
