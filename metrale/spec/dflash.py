"""DFlash drafter: a block drafter conditioned on several of the target's hidden layers.

The target's residual stream after a few of its layers (e.g. 3 spread over depth) is captured for
every token of every target forward, concatenated and projected into a context feature per
position (`fc`, then an RMSNorm). Every drafter layer turns those features into K/V with its own
k/v projections: the drafter's attention attends to [context K/V of the sequence's computed
positions] + [its own block tokens], non-causally. One forward over the block

    [last token, MASK x (B-1)]   at positions n-1 .. n+B-2      (n = the sequence's length)

through the drafter's layers (embeddings shared with the target, a learned MASK embedding), then
the target's final norm and LM head (shared, not stored), gives B-1 drafts (argmax of rows 1..B-1)
with their softmax probabilities as confidences. B = spec.num_drafts + 1 for every sequence of a
step; all speculating sequences run in ONE forward (attention loops over sequences, not tokens).

Context bookkeeping is the target KV cache's own discipline, and it is lazy. `HiddenTap`
(metrale/spec/mtp.py) hands the captured layer rows of every target forward to
`DFlashModel.store_rows`, which only copies them into a paged pool of the target's shape
(num_blocks x block_size slots, the target's block ids; n*D values a slot) and marks those slots
stale: no drafter arithmetic while a sequence does not draft (the gate suspends most of them; on
the CPU at batch 1 none drafts). The drafter's context K/V lives in a second pool of the same
slots (one slice per drafter layer); `propose` first projects the stale slots of the positions its
sequences read, all sequences in ONE batched pass (`catch_up`), then runs the block forward. The
drafter reads positions [0, n-1) of a sequence, the ones whose target K/V is computed: exactly the
accepted tokens. Rows written for rejected drafts sit past the sequence's length, are never read,
and are overwritten (and marked stale) when the target computes those positions again (commit =
the length grows by the accepted tokens; rollback = nothing to undo). A slot's staleness is a
property of the slot, not of a sequence, so prefix-cached blocks carry their rows with them and
preempted sequences simply recompute them. `write_context` is the eager variant (projects at once
and marks the slots projected).

The drafter's own layers use the engine's decoder code (`llama_forward` with `DFlashOps`, a NumpyOps
whose embed inserts MASK rows and whose attention reads the context pool + the block), so it runs on
the host in the backend's dtype. The layer capture needs the NumPy target backend.

Weights (tools/train_dflash.py writes them; metadata: target_layers, num_layers, block_size):
    fc [D, n*D], hidden_norm [D], mask_embed [D],
    layers.i.{attn_norm, qkv, o, mlp_norm, gate_up, down} (q_norm / k_norm optional)
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np

from metrale.cache.kinds import HostKvPages
from metrale.models.config import ModelConfig
from metrale.models.llama import llama_forward
from metrale.models.rope import model_rope
from metrale.runtime.batch import ForwardBatch, Segment, build_batch
from metrale.runtime.numpy_backend import NumpyOps, apply_rope
from metrale.scheduler.sequence import Sequence
from metrale.spec import assets
from metrale.spec.drafter import Draft
from metrale.spec.mtp import HiddenTap

log = logging.getLogger("metrale.spec")

DEFAULT_DRAFTERS = assets.bundled("dflash")
LAYER = ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down")
SHARED = ("embed", "final_norm", "lm_head")


def default_target_layers(num_target_layers: int, n: int = 3) -> tuple[int, ...]:
    """n layers spread from the second to the third-last (DFlash's choice)."""
    hi = max(1, num_target_layers - 3)
    return tuple(sorted({int(round(x)) for x in np.linspace(min(1, hi), hi, n)}))


def _norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


class DFlashOps(NumpyOps):
    """NumpyOps for the drafter's block forward: rows after the first of each segment are MASK
    embeddings; K/V of the block stay in the step (nothing is written to the pool); attention of a
    block row reads the segment's context K/V [0, start) from the pool and the whole block."""

    def __init__(self, model: "DFlashModel", batch: ForwardBatch):
        super().__init__(model, batch)
        self.block_kv: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def embed(self, weight):
        bt = self.batch
        x = weight[bt.token_ids]
        x[np.arange(bt.num_tokens) > bt.seq_query_start[bt.token_seq]] = self.b.weights["mask_embed"]
        return x

    def qkv_to_cache(self, qkv, layer, q_norm, k_norm):
        q, k, v = self.split_qkv(qkv, q_norm, k_norm)
        self.block_kv[layer] = (k, v)
        return q

    def attention(self, q, layer):
        c, bt = self.cfg, self.batch
        out = np.empty_like(q)
        bk, bv = self.block_kv[layer]
        for s in range(bt.num_seqs):
            a, b = bt.seq_query_start[s], bt.seq_query_start[s + 1]
            ctx = int(bt.positions[a])                         # context: positions [0, start of the block)
            k, v = self.cached_kv(layer, s, ctx)
            # non-causal: every row sees the context and the whole block
            out[a:b] = self.attend(q[a:b], np.concatenate([k, bk[a:b]]), np.concatenate([v, bv[a:b]]))
        return out.reshape(q.shape[0], c.q_size)


class DFlashModel:
    """The drafter's weights (its own plus the target's embedding, final norm and LM head) and the
    paged pool of its context K/V: [num_layers, num_blocks, block_size, kv heads, head_dim]."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], *, target_layers, num_layers: int,
                 block_size: int, num_blocks: int, pool_block_size: int, dtype=np.float32):
        need = ["fc", "hidden_norm", "mask_embed", "embed", "final_norm"] + \
               [f"layers.{i}.{n}" for i in range(num_layers) for n in LAYER]
        missing = [n for n in need if n not in weights]
        if missing:
            raise ValueError(f"DFlash drafter: missing weights {', '.join(missing)}")
        self.target_layers = tuple(int(i) for i in target_layers)
        D = config.hidden_size
        if weights["fc"].shape != (D, len(self.target_layers) * D):
            raise ValueError(f"DFlash drafter: fc must be [{D}, {len(self.target_layers) * D}] "
                             f"for {len(self.target_layers)} target layers, got {list(weights['fc'].shape)}")
        self.config = dataclasses.replace(config, num_layers=num_layers, layer_types=(), attn_output_gate=False)
        self.rope = model_rope(self.config)
        self.num_layers, self.trained_block_size = num_layers, block_size
        self.block_size, self.num_blocks, self.dtype = pool_block_size, num_blocks, np.dtype(dtype)
        self.weights = {n: np.ascontiguousarray(a, dtype=self.dtype) for n, a in weights.items()}
        self.kv = HostKvPages(num_layers, num_blocks, pool_block_size, config.num_kv_heads, config.head_dim, self.dtype)
        # the target's layer rows per slot (store_rows) and whether the slot's K/V above is their projection
        self.layer_rows = np.zeros((num_blocks * pool_block_size, len(self.target_layers) * D), dtype=self.dtype)
        self.projected = np.zeros(num_blocks * pool_block_size, dtype=bool)
        self.projected_rows = 0           # positions projected so far (catch_up and write_context)

    def rope_for(self, batch: ForwardBatch):
        return self.rope.cos_sin(batch.positions)

    def context_kv(self, rows: list[np.ndarray], positions: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """(k, v) per drafter layer, [T, kv heads, head_dim] each, of the context features of T
        positions: rows[j] is the target's residual after layer target_layers[j]."""
        return self._project(np.concatenate([np.asarray(r, dtype=self.dtype) for r in rows], axis=-1), positions)

    def _project(self, cat: np.ndarray, positions: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        c, w = self.config, self.weights
        feat = _norm(cat @ w["fc"].T, w["hidden_norm"], c.rms_norm_eps)
        cos, sin = self.rope.cos_sin(positions)
        out = []
        for i in range(self.num_layers):
            p = f"layers.{i}."
            kv = feat @ w[p + "qkv"][c.q_size:].T
            k = kv[:, :c.kv_size].reshape(-1, c.num_kv_heads, c.head_dim)
            v = kv[:, c.kv_size:].reshape(-1, c.num_kv_heads, c.head_dim)
            if p + "k_norm" in w:
                k = _norm(k, w[p + "k_norm"], c.rms_norm_eps)
            out.append((apply_rope(k, cos, sin, c.rope_interleaved), v))
        return out

    def store_rows(self, batch: ForwardBatch, rows: list[np.ndarray]) -> None:
        """HiddenTap's sink (lazy): keep the layer rows of every token of a target forward at its
        slot, to be projected when a proposal reads them (catch_up). A copy, no arithmetic."""
        keep = batch.slot_mapping >= 0
        if not keep.any():
            return
        slots = batch.slot_mapping[keep]
        D = self.config.hidden_size
        for j, r in enumerate(rows):
            self.layer_rows[slots, j * D:(j + 1) * D] = r[keep]
        self.projected[slots] = False

    def write_context(self, batch: ForwardBatch, rows: list[np.ndarray]) -> None:
        """The eager sink: the context K/V of every token of a target forward, at its slot, now."""
        keep = batch.slot_mapping >= 0
        if not keep.any():
            return
        slots = batch.slot_mapping[keep]
        with np.errstate(over="ignore"):
            self._write(slots, self.context_kv([r[keep] for r in rows], batch.positions[keep]))

    def _write(self, slots: np.ndarray, kvs) -> None:
        c = self.config
        for i, (k, v) in enumerate(kvs):
            self.kv.k[i].reshape(-1, c.num_kv_heads, c.head_dim)[slots] = k
            self.kv.v[i].reshape(-1, c.num_kv_heads, c.head_dim)[slots] = v
        self.projected[slots] = True
        self.projected_rows += len(slots)

    def catch_up(self, tables: list, lengths: list[int]) -> int:
        """Project the stored rows of the stale slots among positions [0, lengths[s]) of each
        sequence (block table tables[s]), all in one pass; returns how many were projected."""
        bs, slots, positions = self.block_size, [], []
        for table, n in zip(tables, lengths):
            pos = np.arange(n)
            s = np.asarray(table, np.int64)[pos // bs] * bs + pos % bs
            stale = ~self.projected[s]
            if stale.any():
                slots.append(s[stale])
                positions.append(pos[stale])
        if not slots:
            return 0
        slots, first = np.unique(np.concatenate(slots), return_index=True)   # shared prefix blocks: once
        positions = np.concatenate(positions)[first]
        with np.errstate(over="ignore"):
            self._write(slots, self._project(self.layer_rows[slots], positions))
        return len(slots)

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """Logits [T, vocab] of every row of the batch's blocks (segments: [last token, MASK...] at
        positions start.., start = the context length; logits 'all')."""
        with np.errstate(over="ignore"):
            return llama_forward(DFlashOps(self, batch), self.weights, self.config)

    def blocks(self, lasts: list[int], starts: list[int], tables: list[np.ndarray], length: int) -> ForwardBatch:
        """The batch of blocks [last, MASK x (length-1)] (the MASK rows' token ids are unused)."""
        segs = []
        for tok, start, table in zip(lasts, starts, tables):
            need = -(-(start + length) // self.block_size)     # the block's own slots are never written
            table = np.asarray(table, np.int32)
            if len(table) < need:
                table = np.concatenate([table, np.zeros(need - len(table), np.int32)])
            segs.append(Segment(np.array([tok] + [0] * (length - 1), np.int32), start, table, "all"))
        return build_batch(segs, self.block_size)


# ---------------------------------------------------------------------------- files
@dataclasses.dataclass
class DrafterFile:
    """A drafter's own tensors and what its metadata says, checked against the target."""
    tensors: dict[str, np.ndarray]
    config: ModelConfig              # the target's, with the file's Q/K row layout and MLP width
    target_layers: tuple[int, ...]
    num_layers: int
    block_size: int                  # the block length it was trained at


def read_drafter(path: str | Path, model_config: ModelConfig) -> DrafterFile:
    """A drafter file (tools/train_dflash.py writes them) checked against the target's shapes."""
    tensors, meta = assets.read_safetensors(path)
    D, V = model_config.hidden_size, model_config.vocab_size
    if int(meta.get("hidden_size", D)) != D or int(meta.get("vocab_size", V)) != V:
        raise ValueError(f"DFlash drafter {path} was made for hidden {meta.get('hidden_size')} / vocab "
                         f"{meta.get('vocab_size')}, the target has {D} / {V}")
    layers = json.loads(meta.get("target_layers", "null")) or default_target_layers(model_config.num_layers)
    if max(layers) >= model_config.num_layers:
        raise ValueError(f"DFlash drafter {path} taps layers {layers}; the target has {model_config.num_layers}")
    config = model_config
    if "rope_interleaved" in meta:        # the drafter's Q/K row layout, whatever the target was loaded from
        config = dataclasses.replace(config, rope_interleaved=meta["rope_interleaved"] == "true")
    if "intermediate_size" in meta:
        config = dataclasses.replace(config, intermediate_size=int(meta["intermediate_size"]))
    num_layers = int(meta.get("num_layers", 1 + max([int(n.split(".")[1]) for n in tensors if n.startswith("layers.")] or [0])))
    return DrafterFile(tensors, config, tuple(int(i) for i in layers), num_layers, int(meta.get("block_size", 4)))


def load_drafter(path: str | Path, model_config: ModelConfig, target_weights: dict[str, np.ndarray], *,
                 num_blocks: int, pool_block_size: int, dtype=np.float32) -> DFlashModel:
    """The NumPy drafter of a drafter file."""
    f = read_drafter(path, model_config)
    shared = {n: target_weights[n] for n in SHARED if n in target_weights}
    return DFlashModel(f.config, {**f.tensors, **shared}, target_layers=f.target_layers, num_layers=f.num_layers,
                       block_size=f.block_size, num_blocks=num_blocks, pool_block_size=pool_block_size, dtype=dtype)


def random_tensors(model_config: ModelConfig, *, num_layers: int = 1, target_layers=None,
                   seed: int = 0) -> DrafterFile:
    """An untrained drafter's own tensors (tests; `spec.dflash_head=random`)."""
    c, r = model_config, np.random.default_rng(seed)
    D, F = c.hidden_size, c.intermediate_size
    layers = tuple(target_layers or default_target_layers(c.num_layers))
    w = {"fc": r.normal(size=(D, len(layers) * D)) / np.sqrt(len(layers) * D),
         "hidden_norm": 1 + 0.1 * r.normal(size=D), "mask_embed": r.normal(size=D) * 0.05}
    for i in range(num_layers):
        p = f"layers.{i}."
        w.update({p + "attn_norm": 1 + 0.1 * r.normal(size=D), p + "mlp_norm": 1 + 0.1 * r.normal(size=D),
                  p + "qkv": r.normal(size=(c.q_size + 2 * c.kv_size, D)) / np.sqrt(D),
                  p + "o": r.normal(size=(D, c.q_size)) / np.sqrt(c.q_size),
                  p + "gate_up": r.normal(size=(2 * F, D)) / np.sqrt(D), p + "down": r.normal(size=(D, F)) / np.sqrt(F)})
    return DrafterFile(w, c, layers, num_layers, 4)


def random_drafter(model_config: ModelConfig, target_weights: dict[str, np.ndarray], *, num_blocks: int,
                   pool_block_size: int, num_layers: int = 1, target_layers=None, seed: int = 0,
                   dtype=np.float32) -> DFlashModel:
    """An untrained drafter (tests; `spec.dflash_head=random`)."""
    f = random_tensors(model_config, num_layers=num_layers, target_layers=target_layers, seed=seed)
    shared = {n: target_weights[n] for n in SHARED if n in target_weights}
    return DFlashModel(f.config, {**f.tensors, **shared}, target_layers=f.target_layers, num_layers=num_layers,
                       block_size=f.block_size, num_blocks=num_blocks, pool_block_size=pool_block_size, dtype=dtype)


def drafter_file(spec, model_config: ModelConfig) -> tuple[DrafterFile, str]:
    """spec.dflash_head's drafter (`random`: an untrained one) and its name for the log."""
    name = getattr(spec, "dflash_head", None)
    if name == "random":
        return random_tensors(model_config), "random"
    path = assets.resolve("dflash", name, model_config, lever="spec.dflash_head", method="dflash")
    return read_drafter(path, model_config), str(path)


# ---------------------------------------------------------------------------- the drafter
class DFlashDrafter:
    name = "dflash"
    needs_hidden = True
    lookup_only = False

    def __init__(self, model: DFlashModel, num_drafts: int):
        self.model, self.length = model, num_drafts + 1      # the block: last token + num_drafts MASKs

    @classmethod
    def from_config(cls, spec, backend, model_config: ModelConfig) -> "DFlashDrafter":
        from metrale.runtime.numpy_backend import NumpyBackend
        inner = backend.inner if isinstance(backend, HiddenTap) else backend
        if not isinstance(inner, NumpyBackend):
            raise ValueError("spec.method=dflash needs the NumPy backend (device=cpu) or a CUDA backend of a "
                             "dense model without tensor or expert parallelism (metrale/spec/dflash_cuda.py)")
        f, name = drafter_file(spec, model_config)
        shared = {n: inner.weights[n] for n in SHARED if n in inner.weights}
        model = DFlashModel(f.config, {**f.tensors, **shared}, target_layers=f.target_layers, num_layers=f.num_layers,
                            block_size=f.block_size, num_blocks=inner.num_blocks, pool_block_size=inner.block_size,
                            dtype=inner.dtype)
        log.info("DFlash drafter %s (target layers %s, trained block %d)", name, model.target_layers,
                 model.trained_block_size)
        return cls(model, spec.num_drafts)

    def tap(self, backend) -> HiddenTap:
        """The target backend whose every forward keeps its tokens' layer rows (projected lazily)."""
        tap = backend if isinstance(backend, HiddenTap) else HiddenTap(backend)
        tap.layers, tap.on_layers = self.model.target_layers, self.model.store_rows
        return tap

    def observe(self, scheduled, emitted, hidden) -> None:
        """Nothing to do: the tap stored the layer rows of every computed position during the forward."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft() for _ in seqs]
        live = [i for i, k in enumerate(ks) if k > 0 and seqs[i].num_computed_tokens == seqs[i].num_tokens - 1]
        if not live:
            return drafts
        n = self.length
        self.model.catch_up([seqs[i].block_table for i in live], [seqs[i].num_tokens - 1 for i in live])
        batch = self.model.blocks([seqs[i].token_ids[-1] for i in live], [seqs[i].num_tokens - 1 for i in live],
                                  [seqs[i].block_table for i in live], n)
        logits = np.asarray(self.model.forward(batch), dtype=np.float64).reshape(len(live), n, -1)[:, 1:]
        top = logits.argmax(-1)
        mx = logits.max(-1, keepdims=True)
        conf = 1.0 / np.exp(logits - mx).sum(-1)              # softmax probability of the argmax
        for row, i in enumerate(live):
            k = min(ks[i], n - 1)
            drafts[i] = Draft([int(t) for t in top[row, :k]], [float(p) for p in conf[row, :k]])
        return drafts

    def release(self, seq: Sequence) -> None:
        pass
