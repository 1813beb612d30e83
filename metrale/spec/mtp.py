"""MTP drafter: a multi-token-prediction head (DeepSeek-V3 / Qwen3-Next style) on the target's
hidden states.

The head at position p reads the target's last hidden state h_p (before the final norm) and the
embedding of the next token x_{p+1}, and predicts x_{p+2}:

    x   = eh_proj @ concat(rms_norm(embed[x_{p+1}], enorm), rms_norm(h_p, hnorm))     2D -> D
    x  += attention(x)  and  x += swiglu_mlp(x)                  one decoder block, own KV cache
    logits = lm_head(final_norm(x))                              the target's, shared

Draft j+1 feeds the head's own output for draft j in place of the target's hidden state.

Draft vocabulary (EAGLE-3's d2t): a head file may carry `d2t`, the sorted target ids the draft's
LM head is restricted to (the most frequent tokens of the training corpus); the draft's logits are
then rows embed[d2t] of the shared LM head, and its argmax maps back through d2t. The target's
verify is untouched, so greedy output stays exact; a token outside d2t is simply never drafted.

KV and hidden bookkeeping. The head's K/V lives in its own pool indexed by the target's block
tables (like ModelDrafter). The head only sees positions from the first hidden row the engine
handed it (the prefill's last row), so its attention runs over a window [lo, p] of positions
whose K/V it computed from the target's hidden rows. After every step the engine hands the
hidden rows of each sampled sequence up to its last emitted token (`observe`): one row for a
prefill or a plain decode, accepted + 1 rows for a verify block. The next `propose` recomputes
the head's K/V for those rows from the true hidden states (overwriting what the draft chain
wrote there) in ONE batched forward that also gives draft 1 of every sequence; later rounds feed
one row per sequence. A sequence without hidden rows (e.g. after a missed step) drafts nothing
and restarts its window at the next rows it gets.

Engine hook: `HiddenTap` wraps the target backend so that every forward also keeps its hidden
rows; Engine.step passes them with the step's sampling rows to `MtpDrafter.observe`.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from metrale.cache.kinds import HostKvPages
from metrale.models.config import ModelConfig
from metrale.models.rope import model_rope
from metrale.runtime.batch import ForwardBatch, Segment, build_batch
from metrale.runtime.numpy_backend import NumpyOps
from metrale.scheduler.sequence import Sequence
from metrale.spec import assets
from metrale.spec.drafter import Draft

log = logging.getLogger("metrale.spec")

DEFAULT_HEADS = assets.bundled("mtp")
BLOCK = ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down")       # the block's weights (q/k norms optional)
HEAD = ("enorm", "hnorm", "eh_proj") + BLOCK
MAX_PENDING = 512          # hidden rows kept per sequence while it does not draft; older ones restart the window


# ---------------------------------------------------------------------------- the head
class MtpOps(NumpyOps):
    """NumpyOps for the head: `embed` builds the fused MTP input from the batch's tokens and the
    hidden rows; attention reads only the window [lo, position] of each segment."""

    def __init__(self, head: "MtpHead", batch: ForwardBatch, hidden: np.ndarray, lo: np.ndarray):
        super().__init__(head, batch)
        self.hidden, self.lo = hidden, lo

    def embed(self, weight):
        w = self.b.weights
        e = self.rms_norm(weight[self.batch.token_ids], w["enorm"])
        h = self.rms_norm(self.hidden, w["hnorm"])
        return np.concatenate([e, h], axis=-1) @ w["eh_proj"].T

    def attention(self, q, layer):
        c, bt = self.cfg, self.batch
        out = np.empty_like(q)
        for s in range(bt.num_seqs):
            a, b, ctx, lo = bt.seq_query_start[s], bt.seq_query_start[s + 1], bt.context_lens[s], int(self.lo[s])
            k, v = self.cached_kv(layer, s, ctx)
            out[a:b] = self.attend(q[a:b], k[lo:], v[lo:], np.arange(lo, ctx)[None, :] > bt.positions[a:b][:, None])
        return out.reshape(q.shape[0], c.q_size)


class MtpHead:
    """The head's weights (its own plus the target's embedding, final norm and LM head) and its
    paged KV pool: num_blocks x block_size positions, the target's block ids."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], *, num_blocks: int,
                 block_size: int, dtype=np.float32, d2t: np.ndarray | None = None):
        missing = [n for n in HEAD + ("embed", "final_norm") if n not in weights]
        if missing:
            raise ValueError(f"MTP head: missing weights {', '.join(missing)}")
        self.config = dataclasses.replace(config, num_layers=1)
        self.rope = model_rope(self.config)
        self.block_size, self.num_blocks, self.dtype = block_size, num_blocks, np.dtype(dtype)
        self.weights = {n: np.ascontiguousarray(a, dtype=self.dtype) for n, a in weights.items()}
        self.kv = HostKvPages(1, num_blocks, block_size, config.num_kv_heads, config.head_dim, self.dtype)
        # the draft vocabulary (EAGLE-3's d2t): draft logits over these target ids only
        self.d2t = None if d2t is None else check_d2t(d2t, config.vocab_size)
        self.draft_lm_head = None if self.d2t is None else \
            np.ascontiguousarray(self.weights.get("lm_head", self.weights["embed"])[self.d2t])

    @property
    def draft_vocab_size(self) -> int:
        return self.config.vocab_size if self.d2t is None else len(self.d2t)

    def target_ids(self, idx: np.ndarray) -> np.ndarray:
        """Ids of the target's vocabulary for argmax indices of `forward`'s logits."""
        idx = np.asarray(idx)
        return idx.astype(np.int32) if self.d2t is None else self.d2t[idx]

    def rope_for(self, batch: ForwardBatch):
        return self.rope.cos_sin(batch.positions)

    def forward(self, batch: ForwardBatch, hidden: np.ndarray, lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """hidden [T, D]: one row per token of the batch; lo [S]: each segment's window start.
        Returns (logits, output hidden rows) for the batch's logits rows. With a draft vocabulary
        the logits are over its ids only ([R, len(d2t)]; `target_ids` maps an index back)."""
        w = self.weights
        with np.errstate(over="ignore"):
            ops = MtpOps(self, batch, np.asarray(hidden, dtype=self.dtype), lo)
            x = ops.embed(w["embed"])
            h = ops.rms_norm(x, w["attn_norm"])
            q = ops.qkv_to_cache(ops.linear(h, w["qkv"], w.get("qkv_bias")), 0, w.get("q_norm"), w.get("k_norm"))
            x = ops.linear_residual(ops.attention(q, 0), w["o"], x)
            h = ops.rms_norm(x, w["mlp_norm"])
            x = ops.linear_residual(ops.silu_mul(ops.linear(h, w["gate_up"])), w["down"], x)
            rows = ops.logits_rows(x)
            lm_head = w.get("lm_head", w["embed"]) if self.draft_lm_head is None else self.draft_lm_head
            logits = ops.linear(ops.rms_norm(rows, w["final_norm"]), lm_head)
        return logits, rows


def check_d2t(d2t: np.ndarray, vocab_size: int) -> np.ndarray:
    """A draft vocabulary as int32: 1-D, strictly ascending target ids in [0, vocab_size)."""
    d = np.asarray(d2t)
    if d.ndim != 1 or len(d) == 0 or not np.issubdtype(d.dtype, np.integer):
        raise ValueError(f"MTP head: d2t must be a non-empty 1-D integer array, got {d.dtype} {d.shape}")
    if d[0] < 0 or d[-1] >= vocab_size or np.any(np.diff(d) <= 0):
        raise ValueError(f"MTP head: d2t must be strictly ascending ids in [0, {vocab_size})")
    return np.ascontiguousarray(d, dtype=np.int32)


def read_head(path: str | Path, model_config: ModelConfig) -> tuple[dict[str, np.ndarray], np.ndarray | None, dict]:
    """A head file (tools/train_mtp.py writes them) checked against the target's shapes: its block's
    tensors, its draft vocabulary (`d2t`, checked; None when the file has none) and its metadata."""
    tensors, meta = assets.read_safetensors(path)
    d2t = tensors.pop("d2t", None)
    D, V = model_config.hidden_size, model_config.vocab_size
    if int(meta.get("hidden_size", D)) != D or int(meta.get("vocab_size", V)) != V:
        raise ValueError(f"MTP head {path} was made for hidden {meta.get('hidden_size')} / vocab "
                         f"{meta.get('vocab_size')}, the target has {D} / {V}")
    if tensors.get("eh_proj") is None or tensors["eh_proj"].shape != (D, 2 * D):
        raise ValueError(f"MTP head {path}: eh_proj must be [{D}, {2 * D}]")
    missing = [n for n in ("enorm", "hnorm") + BLOCK if n not in tensors]
    if missing:
        raise ValueError(f"MTP head {path}: missing weights {', '.join(missing)}")
    return tensors, None if d2t is None else check_d2t(d2t, V), meta


def load_head(path: str | Path, model_config: ModelConfig, target_weights: dict[str, np.ndarray], *,
              num_blocks: int, block_size: int, dtype=np.float32, draft_vocab: bool = True) -> MtpHead:
    """The NumPy head of a head file; its `d2t`, if any, is the draft vocabulary (used unless
    draft_vocab is False)."""
    tensors, d2t, meta = read_head(path, model_config)
    config = model_config
    if "rope_interleaved" in meta:        # the head's Q/K row layout, whatever the target was loaded from
        config = dataclasses.replace(config, rope_interleaved=meta["rope_interleaved"] == "true")
    shared = {n: target_weights[n] for n in ("embed", "final_norm", "lm_head") if n in target_weights}
    return MtpHead(config, {**tensors, **shared}, num_blocks=num_blocks, block_size=block_size, dtype=dtype,
                   d2t=d2t if draft_vocab else None)


# ---------------------------------------------------------------------------- the engine hook
class HiddenTap:
    """The target backend, whose forwards also keep the hidden rows of their logits rows
    (backend.forward(..., return_hidden=True)); everything else passes through. With `layers` and
    `on_layers` set (DFlash), each forward also hands the residual stream after those layers, for
    every token of the batch, to on_layers(batch, rows) (NumPy backend)."""

    def __init__(self, backend, layers: tuple[int, ...] = (), on_layers=None):
        self.inner, self.hidden = backend, None
        self.layers, self.on_layers = tuple(layers), on_layers

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, batch, num_layers=None, return_hidden=False):
        if self.on_layers is None or num_layers is not None:
            logits, hidden = self.inner.forward(batch, num_layers, return_hidden=True)
        else:
            (logits, hidden), rows = forward_with_layer_rows(self.inner, batch, self.layers)
            self.on_layers(batch, rows)
        self.hidden = np.asarray(hidden)
        return (logits, hidden) if return_hidden else logits

    def forward_greedy(self, batch, num_layers=None):
        if self.on_layers is None and num_layers is None:
            # CUDA: argmax on the device, only the hidden rows come to the host (not [R, V] logits)
            ids, self.hidden = self.inner.forward_greedy_hidden(batch)
            return ids
        return np.argmax(np.asarray(self.forward(batch, num_layers)), axis=-1).astype(np.int32)

    def forward_device(self, batch, num_layers=None):
        """The device-logits path (sampled rows on CUDA): logits stay on the device, the hidden
        rows come to the host."""
        logits = self.inner.forward_device(batch, num_layers)
        self.hidden = self.inner.hidden_rows(len(batch.logits_indices))
        return logits

    def take_hidden(self) -> np.ndarray | None:
        hidden, self.hidden = self.hidden, None
        return hidden


class _LayerRowOps(NumpyOps):
    """NumpyOps that keep the residual stream after the chosen layers (each layer of llama_forward
    ends with exactly one silu_mul_linear_residual). A subclass, not a wrapper: the tap runs on
    every target forward, so the target's ops keep their plain method lookups."""

    def __init__(self, backend, batch: ForwardBatch, layers: tuple[int, ...]):
        super().__init__(backend, batch)
        self.layers, self.layer, self.rows = set(layers), 0, {}

    def silu_mul_linear_residual(self, gate_up, weight, residual):
        out = super().silu_mul_linear_residual(gate_up, weight, residual)
        if self.layer in self.layers:
            self.rows[self.layer] = out
        self.layer += 1
        return out


def forward_with_layer_rows(backend, batch: ForwardBatch, layers: tuple[int, ...]):
    """((logits, hidden rows), [residual after layer l for every token, l in layers]) of one
    target forward on the NumPy backend."""
    from metrale.runtime.numpy_backend import NumpyBackend
    if not isinstance(backend, NumpyBackend):
        raise ValueError(f"capturing layer rows needs the NumPy backend, not {type(backend).__name__}")
    ops = _LayerRowOps(backend, batch, layers)
    with np.errstate(over="ignore"):
        out = backend.family.forward(ops, backend.weights, backend.config, None, True)
    return out, [ops.rows[i] for i in layers]


# ---------------------------------------------------------------------------- the drafter
def drafts_that_fit(seq: Sequence, k: int, block_size: int) -> int:
    """k, or fewer (at least 1): draft j + 1 writes the head's K/V at position num_tokens - 2 + j,
    which the sequence's block table must hold. A verify proposal's table was grown for its k
    drafts; a shadow's was not (Speculator._start_shadows grows no blocks)."""
    return max(1, min(k, len(seq.block_table) * block_size - seq.num_tokens + 2))


@dataclass
class _Track:
    lo: int                 # window start: the head's K/V is valid on [lo, pos)
    pos: int                # position of rows[0]
    rows: np.ndarray        # target hidden rows whose head K/V is still to (re)compute


class MtpDrafter:
    name = "mtp"
    needs_hidden = True
    lookup_only = False

    def __init__(self, head: MtpHead):
        self.head = head
        self.tracks: dict[str, _Track] = {}

    @classmethod
    def from_config(cls, spec, backend, model_config: ModelConfig) -> "MtpDrafter":
        path = assets.resolve("mtp", getattr(spec, "mtp_head", None), model_config, lever="spec.mtp_head", method="mtp")
        weights = backend.weights
        if not all(isinstance(a, np.ndarray) for a in weights.values()):       # device arrays: to the host
            weights = {n: a for n, a in backend.export_weights() if n in ("embed", "final_norm", "lm_head")}
        head = load_head(path, model_config, weights, num_blocks=backend.num_blocks, block_size=backend.block_size,
                         dtype=backend.dtype, draft_vocab=getattr(spec, "mtp_draft_vocab", True))
        log.info("MTP head %s (draft vocabulary %d)", path, head.draft_vocab_size)
        return cls(head)

    # the engine hands the hidden rows of each step here
    def tap(self, backend) -> HiddenTap:
        return backend if isinstance(backend, HiddenTap) else HiddenTap(backend)

    def observe(self, scheduled, emitted: list[list[int]], hidden: np.ndarray | None) -> None:
        """scheduled: the step's sampling rows (ScheduledSeq, before their tokens are committed);
        emitted: their tokens; hidden: the forward's hidden rows, in the same row order."""
        if hidden is None:
            return
        r = 0
        for s, tokens in zip(scheduled, emitted):
            n = 1 + len(s.draft)
            first = s.seq.num_computed_tokens + s.num_tokens - n      # position of the block's row 0
            self.note(s.seq.request_id, first, hidden[r:r + min(len(tokens), n)])
            r += n

    def note(self, request_id: str, first: int, rows: np.ndarray) -> None:
        """Hidden rows of positions first, first + 1, ... (row j predicts the token at first + j + 1)."""
        if len(rows) == 0:
            return
        rows = np.asarray(rows, dtype=self.head.dtype)
        t = self.tracks.get(request_id)
        if t is not None and t.pos + len(t.rows) == first:
            t.rows = np.concatenate([t.rows, rows]) if len(t.rows) else rows
        else:                                   # first rows, or a gap: the window restarts here
            t = self.tracks[request_id] = _Track(first, first, rows)
        if len(t.rows) > MAX_PENDING:
            t.pos += len(t.rows) - MAX_PENDING
            t.rows, t.lo = t.rows[-MAX_PENDING:], t.pos

    def _ready(self, seq: Sequence) -> bool:
        t = self.tracks.get(seq.request_id)
        return t is not None and len(t.rows) > 0 and t.pos + len(t.rows) == seq.num_tokens - 1

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft() for _ in seqs]
        live = [i for i, k in enumerate(ks) if k > 0 and self._ready(seqs[i])]
        if not live:
            return drafts
        ks = list(ks)
        for i in live:
            ks[i] = drafts_that_fit(seqs[i], ks[i], self.head.block_size)
        tracks = [self.tracks[seqs[i].request_id] for i in live]
        # round 0: the pending rows (head K/V from true hidden states) and draft 1, all sequences at once
        segs = [Segment(np.asarray(seqs[i].token_ids[t.pos + 1:], np.int32), t.pos,
                        np.asarray(seqs[i].block_table, np.int32)) for i, t in zip(live, tracks)]
        hidden = np.concatenate([t.rows for t in tracks])
        lo = np.array([t.lo for t in tracks])
        pos = {i: seqs[i].num_tokens - 2 for i in live}          # position of each row fed last
        for t, i in zip(tracks, live):
            t.pos, t.rows = seqs[i].num_tokens - 1, t.rows[:0]   # K/V valid up to here once this runs
        lo_of = dict(zip(live, lo))
        while True:
            logits, out = self.head.forward(build_batch(segs, self.head.block_size), hidden, lo)
            logits = np.asarray(logits, dtype=np.float64)
            for row, i in enumerate(live):
                x = logits[row] - logits[row].max()
                p = np.exp(x)
                idx = int(np.argmax(x))                 # over the draft vocabulary, if the head has one
                drafts[i].tokens.append(int(self.head.target_ids(idx)))
                drafts[i].confidences.append(float(p[idx] / p.sum()))
            keep = [row for row, i in enumerate(live) if len(drafts[i].tokens) < ks[i]]
            if not keep:
                return drafts
            live = [live[row] for row in keep]
            for i in live:
                pos[i] += 1
            segs = [Segment(np.array([drafts[i].tokens[-1]], np.int32), pos[i], np.asarray(seqs[i].block_table, np.int32))
                    for i in live]
            hidden, lo = out[keep], np.array([lo_of[i] for i in live])

    def release(self, seq: Sequence) -> None:
        self.tracks.pop(seq.request_id, None)
