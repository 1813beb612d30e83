"""Tensor parallelism for the dense family (parallel.tensor=N), Megatron layout, on the NumPy
backend through the Communicator interface (comm.py); docs/parallel.md has the flow and what the
CUDA side needs.

Rank r of N holds (TensorParallel.ranges):
  qkv      column-parallel: its query heads H/N, its KV heads K/N (K >= N) or the one KV head its
           query heads read (K < N, N % K == 0: each KV head replicated on N/K ranks); rows
           [q_r | k_r | v_r] (and the same slice of qkv_bias); q_norm / k_norm replicated
  o        row-parallel: the columns of its query heads; partial sums all-reduced
  gate_up  column-parallel: rows [gate_r | up_r] of its F/N slice of the intermediate size
  down     row-parallel: the columns of that slice; partial sums all-reduced
  embed    vocab-parallel: rows [r*ceil(V/N), ...) (a token outside the slice embeds as 0), then
           an all-reduce; lm_head (or the tied embed slice): that slice of the logits
  norms    replicated
The residual stream is replicated: every rank adds the same all-reduced sum to the same residual.
A rank's backend is a NumpyBackend of the local config (H/N heads, its KV heads, F/N): the common
NumpyOps run unchanged; TpNumpyOps overrides only embed and linear_residual (the two places where
the partial sums meet). The logits stay sliced on their rank until TPRank gathers them to rank 0
(sampling) or reduces them to one (max, index) pair a row and rank (greedy).

Weights are read shard by shard: hf_shard_stream reads only the rank's slices of each tensor out
of the safetensors files (safe_open(...).get_slice), so no rank ever holds a whole matrix;
shard_stream slices a canonical stream tensor by tensor (GGUF, random presets: one whole tensor
at a time passes through the host before it is cut).

Steps: rank 0 runs the Engine (scheduler, sampling) over TpLeader, a Backend whose forward
broadcasts the step (one int32 array: the mode word, then a StepPlan whose work[0] is the batch
every rank runs) and runs rank 0's share; ranks > 0 run TPRank.follow until STOP. launch_tp runs
that as one process per rank (metrale.parallel.launch), joined by QueueCommunicator. device=cuda:
each rank a TpCudaBackend on its own GPU (metrale/runtime/cuda_tp.py, parallel/tp_cuda.py), the
partial sums all-reduced on the device (NCCL), the step plans still through the queues.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
import time

import numpy as np

from metrale.models.checkpoint import WeightStream
from metrale.models.config import ModelConfig
from metrale.models.families import family_named
from metrale.parallel.comm import Communicator, all_reduce, broadcast, gather
from metrale.parallel.plan import Command, StepPlan, decode_plan, encode_plan
from metrale.runtime.backend import Backend
from metrale.runtime.batch import ForwardBatch, Segment, build_batch
from metrale.runtime.numpy_backend import NumpyBackend, NumpyOps

# the first word of a TP step message: what rank 0 wants back from the LM-head slices
LOGITS, GREEDY, GREEDY_HIDDEN = 0, 1, 2


def check_tensor_parallel(config: ModelConfig, world: int) -> None:
    """Refuse a tensor-parallel size the model does not split into (one line naming the numbers)."""
    if world < 1:
        raise ValueError(f"parallel.tensor must be >= 1, got {world}")
    if config.is_mla or config.is_hybrid or config.is_moe:
        raise ValueError(f"parallel.tensor={world}: tensor parallelism runs the dense family only so far "
                         f"({config.name or config.architecture} is not dense)")
    h, k, f = config.num_heads, config.num_kv_heads, config.intermediate_size
    if h % world:
        raise ValueError(f"parallel.tensor={world} does not divide the {h} attention heads")
    if k % world and world % k:
        raise ValueError(f"parallel.tensor={world} neither divides the {k} KV heads nor is a multiple of them")
    if f % world:
        raise ValueError(f"parallel.tensor={world} does not divide the intermediate size {f}")


@dataclass(frozen=True)
class Ranges:
    """Rank r's slices: [lo, hi) of query heads, KV heads, intermediate units and vocabulary ids."""
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int]


class TensorParallel:
    """One rank's view of tensor parallelism: its slices, its local model config and its collectives
    (through comm; comm None: sharding only, e.g. to load or count a rank's weights)."""

    def __init__(self, config: ModelConfig, world: int, rank: int, comm: Communicator | None = None):
        check_tensor_parallel(config, world)
        if comm is not None and (comm.world_size, comm.rank) != (world, rank):
            raise ValueError(f"rank {rank} of {world}, but the communicator is rank {comm.rank} of {comm.world_size}")
        self.config, self.world, self.rank, self.comm = config, world, rank, comm
        h, k, f, v = config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size
        hq = h // world
        if k % world == 0:
            hk = k // world
            kv0 = rank * hk
        else:                       # fewer KV heads than ranks: N/K ranks share (replicate) one
            hk, kv0 = 1, rank * k // world
        vs = -(-v // world)
        self.ranges = Ranges((rank * hq, rank * hq + hq), (kv0, kv0 + hk), (rank * f // world, (rank + 1) * f // world),
                             (min(rank * vs, v), min(rank * vs + vs, v)))
        self.local_config = dataclasses.replace(config, num_heads=hq, num_kv_heads=hk, intermediate_size=f // world)
        self.reduces = 0            # all-reduces run (tests count them: 2 a layer + 1 for the embedding)

    @classmethod
    def of(cls, config: ModelConfig, comm: Communicator) -> "TensorParallel":
        return cls(config, comm.world_size, comm.rank, comm)

    @property
    def vocab_range(self) -> tuple[int, int]:
        return self.ranges.vocab

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        self.reduces += 1
        return x if self.world == 1 else all_reduce(self.comm, x)

    # ---------------------------------------------------------------- weight slices
    def row_pieces(self, name: str) -> list[tuple[int, int]] | None:
        """Canonical tensor `name`'s rows this rank keeps (pieces of a row-stacked tensor), or None
        when it is sliced by columns or replicated (col_range)."""
        c, r = self.config, self.ranges
        kind = name.rsplit(".", 1)[-1]
        hd = c.head_dim
        if kind in ("qkv", "qkv_bias"):
            (q0, q1), (k0, k1) = r.q_heads, r.kv_heads
            return [(q0 * hd, q1 * hd), (c.q_size + k0 * hd, c.q_size + k1 * hd),
                    (c.q_size + c.kv_size + k0 * hd, c.q_size + c.kv_size + k1 * hd)]
        if kind == "gate_up":
            (f0, f1), f = r.ffn, c.intermediate_size
            return [(f0, f1), (f + f0, f + f1)]
        if name in ("embed", "lm_head"):
            return [r.vocab]
        return None

    def col_range(self, name: str) -> tuple[int, int] | None:
        """The columns of a row-parallel matrix this rank keeps (None: not one)."""
        kind = name.rsplit(".", 1)[-1]
        if kind == "o":
            q0, q1 = self.ranges.q_heads
            return q0 * self.config.head_dim, q1 * self.config.head_dim
        if kind == "down":
            return self.ranges.ffn
        return None

    def shard(self, name: str, full: np.ndarray) -> np.ndarray:
        """This rank's part of canonical tensor `name` given whole (shard_stream's path)."""
        rows = self.row_pieces(name)
        if rows is not None:
            return np.concatenate([full[a:b] for a, b in rows])
        cols = self.col_range(name)
        return np.ascontiguousarray(full[:, cols[0]:cols[1]]) if cols is not None else full


def shard_stream(stream: WeightStream, tp: TensorParallel) -> WeightStream:
    """A canonical stream cut to this rank's slices, one tensor at a time (each tensor passes
    whole through the host before it is cut: for GGUF files and random presets)."""
    for name, a in stream:
        if not isinstance(a, np.ndarray):      # a GGUF block tensor: expanded, then cut
            a = np.asarray(a.dequantize(), np.float32)
        yield name, tp.shard(name, a)
        del a


class SliceReader:
    """Reads slices of tensors out of a directory's safetensors files without the rest (their
    bytes are memory-mapped; only the sliced ranges are copied), counting what it returned."""

    def __init__(self, path: Path):
        from metrale.models.checkpoint import _safetensors_index
        self.path = Path(path)
        self.where, _ = _safetensors_index(self.path)
        self.bytes_read = 0
        self.largest_share = 0.0    # the largest part of one matrix returned by a read (1.0: a whole one)

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def read(self, key: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> np.ndarray:
        from safetensors import safe_open
        if key not in self.where:
            raise ValueError(f"{self.path}: tensor '{key}' missing")
        with safe_open(str(self.where[key]), framework="numpy") as st:
            s = st.get_slice(key)
            shape = s.get_shape()
            if rows is not None:
                a = s[rows[0]:rows[1]]
            elif cols is not None:
                a = s[:, cols[0]:cols[1]]
            else:
                a = s[:]
        a = np.ascontiguousarray(np.asarray(a, dtype=np.float32))
        self.bytes_read += a.nbytes
        if len(shape) == 2:
            self.largest_share = max(self.largest_share, a.size / (shape[0] * shape[1]))
        return a


def hf_shard_stream(reader: SliceReader, config: ModelConfig, tp: TensorParallel) -> WeightStream:
    """The canonical stream of a dense HF directory (checkpoint.load_hf_dir's names and layout),
    each tensor read as this rank's slices only."""
    c, r = config, tp.ranges
    hd = c.head_dim
    q_rows = (r.q_heads[0] * hd, r.q_heads[1] * hd)
    kv_rows = (r.kv_heads[0] * hd, r.kv_heads[1] * hd)
    yield "embed", reader.read("model.embed_tokens.weight", rows=r.vocab)
    for i in range(c.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        yield q + "attn_norm", reader.read(p + "input_layernorm.weight")
        yield q + "qkv", np.concatenate([reader.read(a + "q_proj.weight", rows=q_rows),
                                         reader.read(a + "k_proj.weight", rows=kv_rows),
                                         reader.read(a + "v_proj.weight", rows=kv_rows)])
        if a + "q_proj.bias" in reader:
            yield q + "qkv_bias", np.concatenate([reader.read(a + "q_proj.bias", rows=q_rows),
                                                  reader.read(a + "k_proj.bias", rows=kv_rows),
                                                  reader.read(a + "v_proj.bias", rows=kv_rows)])
        if c.qk_norm:
            yield q + "q_norm", reader.read(a + "q_norm.weight")
            yield q + "k_norm", reader.read(a + "k_norm.weight")
        yield q + "o", reader.read(a + "o_proj.weight", cols=q_rows)
        yield q + "mlp_norm", reader.read(p + "post_attention_layernorm.weight")
        yield q + "gate_up", np.concatenate([reader.read(p + "mlp.gate_proj.weight", rows=r.ffn),
                                             reader.read(p + "mlp.up_proj.weight", rows=r.ffn)])
        yield q + "down", reader.read(p + "mlp.down_proj.weight", cols=r.ffn)
    yield "final_norm", reader.read("model.norm.weight")
    if not c.tie_word_embeddings:
        yield "lm_head", reader.read("lm_head.weight", rows=r.vocab)


# ----------------------------------------------------------------------- a rank's forward

class TpNumpyOps(NumpyOps):
    """NumpyOps of one tensor-parallel rank: the vocab-parallel embedding and the row-parallel
    products (o, down) end in an all-reduce; every other op runs on the local shapes unchanged."""

    def embed(self, weight):
        lo, hi = self.b.tp.vocab_range
        ids = self.batch.token_ids
        mine = (ids >= lo) & (ids < hi)
        out = np.zeros((ids.shape[0], weight.shape[1]), weight.dtype)
        out[mine] = weight[ids[mine] - lo]
        return self.b.tp.all_reduce(out)

    def linear_residual(self, x, weight, residual):
        return residual + self.b.tp.all_reduce(x @ weight.T)


class TpNumpyBackend(NumpyBackend):
    """One rank's NumpyBackend: the local config (its heads and FFN slice), its weight shards, its
    KV heads' cache. forward returns this rank's vocab slice of the logits (TPRank joins them)."""

    def __init__(self, tp: TensorParallel, weights: WeightStream | dict, **kw):
        self.tp, self.full_config = tp, tp.config
        super().__init__(tp.local_config, weights, family=family_named("dense"), ops_class=TpNumpyOps, **kw)


def greedy_pairs(logits: np.ndarray, lo: int) -> np.ndarray:
    """[R, 2] float64 (max value, global index of its first occurrence) of a vocab slice's rows."""
    out = np.empty((logits.shape[0], 2), np.float64)
    if logits.shape[1] == 0:
        out[:, 0], out[:, 1] = -np.inf, lo
        return out
    idx = np.argmax(logits, axis=-1)
    out[:, 0] = logits[np.arange(logits.shape[0]), idx]
    out[:, 1] = idx + lo
    return out


def pick_greedy(pairs: list[np.ndarray]) -> np.ndarray:
    """The global argmax of each row from every rank's (value, index) pairs (ranks in vocab
    order; ties go to the lowest rank, which holds the lowest index: np.argmax's choice)."""
    vals = np.stack([p[:, 0] for p in pairs])
    idx = np.stack([p[:, 1] for p in pairs])
    best = np.argmax(vals, axis=0)
    return idx[best, np.arange(vals.shape[1])].astype(np.int32)


def batch_segments(batch: ForwardBatch) -> list[Segment]:
    """The segments of a batch (the inverse of build_batch for dense models), to put in a plan."""
    bs, want = batch.block_size, np.zeros(batch.num_tokens, bool)
    want[batch.logits_indices] = True
    segments = []
    for s in range(batch.num_seqs):
        a, b = int(batch.seq_query_start[s]), int(batch.seq_query_start[s + 1])
        rows = want[a:b]
        if not rows.any():
            mode = "none"
        elif rows.all():
            mode = "all" if b - a > 1 else "last"
        elif rows[-1] and rows.sum() == 1:
            mode = "last"
        else:
            raise ValueError(f"segment {s}: logits rows {np.flatnonzero(rows).tolist()} are not none, last or all")
        blocks = -(-int(batch.context_lens[s]) // bs)
        segments.append(Segment(batch.token_ids[a:b].copy(), int(batch.positions[a]),
                                batch.block_tables[s, :blocks].copy(), mode))
    return segments


class TPRank:
    """One rank's step loop (tensor- or expert-parallel: every rank runs the step's whole batch).
    Per step every rank enters the same collectives in the same order: broadcast(message), then
    TP: 2 all-reduces a layer + 1 (embedding) and gather(logits slices or greedy pairs) to rank 0;
    EP: one all-reduce a MoE layer (rank 0's logits are whole)."""

    def __init__(self, comm: Communicator, backend: TpNumpyBackend):
        self.comm, self.backend = comm, backend
        self.steps = 0

    @property
    def experts_only(self) -> bool:
        """An expert-parallel rank: its backend is the whole model but experts (no vocab slice)."""
        return getattr(self.backend, "tp", None) is None

    def execute(self, mode: int, batch: ForwardBatch, num_layers: int | None):
        """This rank's share of a step; rank 0 gets (full logits | token ids, hidden rows)."""
        self.steps += 1
        if mode != LOGITS and getattr(self.backend, "picks_greedy", False):
            return self._device_greedy(mode, batch, num_layers)
        local, hidden = self.backend.forward(batch, num_layers, return_hidden=True)
        if self.experts_only:                   # every rank has the whole logits
            if self.comm.rank:
                return None, None
            return (local if mode == LOGITS else np.argmax(local, axis=-1).astype(np.int32)), hidden
        lo = self.backend.tp.vocab_range[0]
        if mode == LOGITS:       # rows of different widths: gathered as columns
            parts = gather(self.comm, np.ascontiguousarray(local.T))
            return (None if parts is None else np.ascontiguousarray(np.concatenate(parts).T)), hidden
        parts = gather(self.comm, greedy_pairs(local, lo))
        return (None if parts is None else pick_greedy(parts)), hidden

    def _device_greedy(self, mode: int, batch: ForwardBatch, num_layers: int | None):
        """A greedy step on a backend that picks across ranks itself (the CUDA ranks: an all_gather
        of (max, index) pairs on the device): rank 0 reads its ids, the others read nothing."""
        if self.comm.rank:
            self.backend.follow_step(batch, num_layers)
            return None, None
        ids = self.backend.forward_greedy(batch, num_layers)
        return ids, (self.backend.hidden_rows(len(ids)) if mode == GREEDY_HIDDEN else None)

    def lead(self, mode: int, batch: ForwardBatch, num_layers: int | None = None):
        """Rank 0: broadcast the step, run it, return (logits | ids, hidden rows)."""
        plan = StepPlan(self.steps, Command.FORWARD, [batch_segments(batch)], num_layers or 0)
        broadcast(self.comm, np.concatenate([np.array([mode], np.int32), encode_plan(plan)]))
        return self.execute(mode, batch, num_layers)

    def stop(self) -> None:
        plan = StepPlan(self.steps, Command.STOP, [[]])
        broadcast(self.comm, np.concatenate([np.array([LOGITS], np.int32), encode_plan(plan)]))

    def follow(self) -> int:
        """Ranks > 0: run the broadcast steps until STOP; returns the number of steps run. Between
        steps a follower waits for rank 0's next plan without a time limit while the process that
        started it lives (an idle server or notebook Engine sends none for minutes; the host
        communicator's timeout would otherwise end the follower, and the next step with it)."""
        wait = getattr(self.comm, "wait_for", None)
        while True:
            if wait is not None:
                wait(0, _parent_alive)
            words = broadcast(self.comm, None)
            mode, plan = int(words[0]), decode_plan(words[1:])
            if plan.command == Command.STOP:
                return self.steps
            self.execute(mode, build_batch(plan.work[0], self.backend.block_size), plan.num_layers or None)


def _parent_alive() -> bool:
    """Whether the process that started this one still runs (local_leader's followers: the leader
    itself; metrale.parallel.launch's ranks: the supervisor, which ends them all when one fails)."""
    import multiprocessing
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


class TpLeader(Backend):
    """Rank 0's Backend for the Engine: each forward is a tensor-parallel step over all ranks
    (the scheduler, sampling and detokenizing stay on rank 0). close() stops the followers."""

    name = "cpu"

    def __init__(self, rank: TPRank, followers: list | None = None):
        if rank.comm.rank != 0:
            raise ValueError(f"the leader is rank 0, not rank {rank.comm.rank}")
        b = rank.backend
        self.rank, self.shard = rank, b
        self.followers = list(followers or ())        # processes this leader started (local_leader)
        self.config, self.family = getattr(b, "full_config", b.config), b.family
        self.block_size, self.num_blocks, self.weights, self.dtype = b.block_size, b.num_blocks, b.weights, b.dtype
        self.max_rows, self.max_tokens = b.max_rows, b.max_tokens       # the CUDA ranks' step buffers
        self.name = "cuda-tp" if b.name == "cuda" else "cpu"          # sampling stays on the host (full logits)
        self.stopped = False

    def forward(self, batch, num_layers=None, return_hidden=False):
        logits, hidden = self.rank.lead(LOGITS, batch, num_layers)
        return (logits, hidden) if return_hidden else logits

    def forward_greedy(self, batch, num_layers=None):
        return self.rank.lead(GREEDY, batch, num_layers)[0]

    def forward_greedy_hidden(self, batch):
        ids, hidden = self.rank.lead(GREEDY_HIDDEN, batch, None)
        return ids, np.asarray(hidden)

    def hidden_rows(self, rows):
        return self.shard.hidden_rows(rows)

    def kv_tokens_that_fit(self, utilization=0.9):
        return self.num_blocks * self.block_size

    def export_weights(self):
        raise NotImplementedError("a tensor- or expert-parallel leader holds only rank 0's shards (drafters that "
                                  "copy the target's weights do not run with parallel.tensor / expert > 1 yet)")

    def memory_report(self):
        kind = "expert_parallel" if self.rank.experts_only else "tensor_parallel"
        return {**self.shard.memory_report(), kind: self.rank.comm.world_size}

    def close(self):
        if not self.stopped:
            self.stopped = True
            self.rank.stop()
            self.rank.comm.finish()      # the followers get STOP even if this process exits next
            self.shard.close()           # CUDA: its graphs, device memory and collectives
        for proc in self.followers:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()


# ----------------------------------------------------------------------- building a rank

def parallel_world(cfg) -> int:
    """The ranks of parallel.tensor / parallel.expert (one of them > 1 at most; 1: no ranks)."""
    from omegaconf import OmegaConf
    tensor = int(OmegaConf.select(cfg, "parallel.tensor", default=1))
    expert = int(OmegaConf.select(cfg, "parallel.expert", default=1))
    if tensor > 1 and expert > 1:
        raise ValueError(f"parallel.tensor={tensor} with parallel.expert={expert}: one kind of ranks at a time")
    return max(tensor, expert)


def expert_slice(stream: WeightStream, ep) -> WeightStream:
    """A MoE stream with only this rank's experts (the stacked experts_* tensors cut to its range)."""
    lo, hi = ep.expert_range
    for name, a in stream:
        yield name, (a[lo:hi] if name.endswith((".experts_gate_up", ".experts_down")) else a)


def load_expert_rank(cfg, comm: Communicator):
    """(config, tokenizer, TPRank) of one expert-parallel rank: the whole model but 1/N of the
    routed experts, every step's batch run in full (models/moe.py: reduce_local)."""
    from metrale.models.assemble import read_model
    from metrale.models.families import family_for
    from metrale.models.registry import resolve_model
    from metrale.parallel.ep import ExpertParallel
    from metrale.runtime.select import resolve_device
    if resolve_device(cfg.device) != "cpu":
        raise ValueError("parallel.expert > 1 runs on device=cpu only so far (the CUDA side: docs/parallel.md)")
    config, tokenizer, weights = read_model(resolve_model(cfg.model))
    if config.is_hybrid:
        raise ValueError(f"parallel.expert={comm.world_size}: hybrid models (recurrent state) do not run on "
                         "several ranks yet")
    if not config.n_routed_experts:
        raise ValueError(f"parallel.expert={comm.world_size}: {config.name or config.architecture} has no routed "
                         "experts (a MoE family: Qwen3-MoE, DeepSeek-V2/V3, Qwen3-Next MoE)")
    ep = ExpertParallel(comm, config.n_routed_experts, replicated=True)
    family = family_for(config)
    full = weights if weights is not None else (lambda: family.random_weights(config, int(cfg.seed)))
    backend = NumpyBackend.from_config(cfg, config, lambda: expert_slice(full(), ep), family, ep=ep)
    return config, tokenizer, TPRank(comm, backend)


def load_rank(cfg, comm: Communicator, unique_id: bytes | None = None):
    """(full config, tokenizer, TPRank) of one rank for a composed config (cfg.model: an HF
    directory is read shard by shard; a GGUF file or a random preset is cut tensor by tensor).
    device=cuda: a TpCudaBackend (parallel/tp_cuda.py), over NCCL when rank 0 handed out
    `unique_id`, else host-staged through comm. parallel.expert > 1: load_expert_rank."""
    world, kind = parallel_world(cfg), "expert" if int(cfg.parallel.expert) > 1 else "tensor"
    if world != comm.world_size:
        raise ValueError(f"parallel.{kind}={world} but {comm.world_size} ranks were started")
    if kind == "expert":
        return load_expert_rank(cfg, comm)
    from metrale.models.assemble import read_model
    from metrale.models.checkpoint import random_weights
    from metrale.models.registry import resolve_model
    from metrale.runtime.select import resolve_device
    device = resolve_device(cfg.device)
    source = resolve_model(cfg.model)
    config, tokenizer, weights = read_model(source)
    reader = SliceReader(source.path) if source.kind == "hf" else None    # an HF directory: read shard by shard
    tp = TensorParallel.of(config, comm)
    if reader is not None:
        stream = hf_shard_stream(reader, config, tp)
    elif weights is not None:
        stream = shard_stream(weights(), tp)
    else:                       # a random preset: the CUDA ranks fill their local shapes on the device
        stream = None if device == "cuda" else shard_stream(random_weights(config, int(cfg.seed)), tp)
    if device == "cuda":
        from metrale.parallel.tp_cuda import cuda_rank_backend
        backend = cuda_rank_backend(cfg, tp, stream, comm, unique_id)
        backend.bytes_read = reader.bytes_read if reader is not None else None
        return config, tokenizer, TPRank(comm, backend)
    bs = int(cfg.cache.block_size)
    backend = TpNumpyBackend(tp, stream, num_blocks=int(cfg.cache.num_blocks or max(1, cfg.cache.cpu_kv_tokens // bs)),
                             block_size=bs, dtype=cfg.levers.numpy_dtype)
    backend.bytes_read = reader.bytes_read if reader is not None else None
    return config, tokenizer, TPRank(comm, backend)


def tp_engine(cfg, comm: Communicator, unique_id: bytes | None = None):
    """Rank 0: an Engine over TpLeader (call engine.backend.close() at the end to stop the
    followers). Ranks > 0: run until rank 0 stops them; returns the steps run."""
    from metrale.engine import Engine
    config, tokenizer, rank = load_rank(cfg, comm, unique_id)
    if comm.rank != 0:
        return _follow(rank)
    return Engine(cfg=cfg, parts=(config, tokenizer, TpLeader(rank)))


def _follow(rank: TPRank) -> int:
    """A follower's life after loading: rank 0's steps until STOP, then its backend freed (CUDA:
    graphs, device memory, its NCCL communicator)."""
    try:
        return rank.follow()
    finally:
        rank.backend.close()


def local_leader(cfg) -> tuple[ModelConfig, object, "TpLeader"]:
    """parallel.tensor=N or parallel.expert=N inside the caller's process (Engine(...), serve): rank 0 here, ranks
    1..N-1 spawned as follower processes joined by queues. device=cuda: rank r on the r-th visible
    GPU (the follower started with CUDA_VISIBLE_DEVICES set to it), the device collectives over
    NCCL (the unique id made here). The leader's close() stops them; they are daemons, so they
    also end with this process. A rank that fails to load here stops the followers before the
    error propagates."""
    import multiprocessing as mp
    from metrale.parallel.comm import QueueCommunicator
    from metrale.runtime.select import resolve_device
    world = parallel_world(cfg)
    cuda_ranks = int(cfg.parallel.tensor) > 1 and resolve_device(cfg.device) == "cuda"
    uid, devices = None, None
    if cuda_ranks:
        from metrale.parallel.nccl import nccl_unique_id
        from metrale.parallel.tp_cuda import rank_devices
        devices, uid = rank_devices(world), nccl_unique_id()
    ctx = mp.get_context("spawn")
    boxes = [ctx.Queue() for _ in range(world)]
    followers = [ctx.Process(target=_follower_main, args=(r, cfg, boxes, uid), daemon=True, name=f"metrale-tp-rank{r}")
                 for r in range(1, world)]
    for r, proc in enumerate(followers, start=1):
        _start_on(proc, None if devices is None else devices[r])
    try:
        config, tokenizer, rank = load_rank(cfg, QueueCommunicator(0, boxes), uid)
    except BaseException:
        for proc in followers:
            proc.terminate()
        raise
    return config, tokenizer, TpLeader(rank, followers)


def _start_on(proc, device: str | None) -> None:
    """Start a spawned process with CUDA_VISIBLE_DEVICES = device (None: this process's own)."""
    import os
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device is not None:              # the child is exec'd with this environment
        os.environ["CUDA_VISIBLE_DEVICES"] = device
    try:
        proc.start()
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible


def _follower_main(rank: int, cfg, boxes, unique_id: bytes | None = None) -> None:
    """local_leader's follower: load this rank's shards, run rank 0's steps until STOP."""
    from metrale.parallel.comm import QueueCommunicator
    _, _, me = load_rank(cfg, QueueCommunicator(rank, boxes), unique_id)
    _follow(me)


def _rank_main(rank, world, uid, report, overrides, boxes, prompts, params, chat=False):
    """launch target: one rank of a CPU tensor-parallel run (QueueCommunicator over `boxes`)."""
    from metrale.parallel.comm import QueueCommunicator
    from metrale.settings import compose
    cfg = compose(list(overrides))
    comm = QueueCommunicator(rank, boxes)
    got = tp_engine(cfg, comm, uid)
    if rank != 0:
        report("followed", steps=got)
        return
    report("ready", memory=got.memory_report())
    try:
        outs = got.generate(prompts, params, chat=chat, use_tqdm=False)
        report("outputs", token_ids=[o.token_ids.tolist() for o in outs], text=[o.text for o in outs])
    finally:
        got.backend.close()


def launch_tp(overrides: list[str], prompts: list, params=None, timeout: float = 600.0, chat: bool = False):
    """Run `prompts` through a tensor-parallel Engine of parallel.tensor processes (one per rank,
    metrale.parallel.launch; the step plans through queues; device=cuda: one GPU a rank, the
    collectives over NCCL). Returns (rank 0's outputs message, Report)."""
    import multiprocessing as mp
    from metrale.parallel.launch import launch
    from metrale.runtime.select import resolve_device
    from metrale.settings import compose
    cfg = compose(list(overrides))
    world = parallel_world(cfg)
    on_gpus = int(cfg.parallel.tensor) > 1 and resolve_device(cfg.device) == "cuda"
    make_id = None
    if on_gpus:
        from metrale.parallel.nccl import nccl_unique_id
        from metrale.parallel.tp_cuda import rank_devices
        rank_devices(world)             # refused here, in one line, with too few GPUs
        make_id = nccl_unique_id
    ctx = mp.get_context("spawn")
    boxes = [ctx.Queue() for _ in range(world)]
    report = launch(world, _rank_main, (list(overrides), boxes, prompts, params, chat), pin_devices=on_gpus,
                    make_id=make_id, timeout=timeout)
    return report.of("outputs").get(0), report


def main(argv: list[str] | None = None) -> int:
    """python -m metrale <settings> parallel.tensor=N (or python -m metrale.parallel.tp ...): generate
    cfg.prompt on N ranks (CPU, or one GPU each with device=cuda), one process each."""
    import sys
    from metrale.engine import Engine
    from metrale.settings import compose
    overrides = list(sys.argv[1:] if argv is None else argv)
    cfg = compose(overrides)
    t0 = time.perf_counter()
    out, report = launch_tp(overrides, [cfg.prompt], Engine.params_from_config(cfg), chat=bool(cfg.chat))
    if not report.ok:
        print("\n".join(report.problems), file=sys.stderr)
        return 1
    print(out["text"][0])
    n = len(out["token_ids"][0])
    kind = "GPU" if str(cfg.device) == "cuda" else "CPU"
    print(f"[metrale] {n} tokens on {parallel_world(cfg)} {kind} ranks in {time.perf_counter() - t0:.2f} s "
          "(start-up included)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
