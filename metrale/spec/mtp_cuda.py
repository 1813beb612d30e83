"""The MTP head on the device (docs/mtp.md, "The head on the device"): the drafter a CUDA target
gets for spec.method=mtp. Its drafts are those of the NumPy head (metrale/spec/mtp.py, the
reference) computed with the target's own kernels; no hidden row, logit or K/V leaves the device:
a proposal copies in its metadata and block tables, and out its draft ids and confidences.

Pieces:
- `MtpPlanner` (host only, no device): the per-sequence bookkeeping and the metadata of each
  device pass (`ObservePlan`, `DraftPlan`).
- `MtpCudaHead`: the head's block uploaded as a one-layer dense model (bf16 matrices, float32
  norms) run by the target's CudaOps class (`MtpCudaOps` adds two ops), sharing the target's
  stream, cuBLASLt handle, RoPE tables, embedding, final norm and LM head (no copies; a draft
  vocabulary's rows are gathered once into a matrix of their own); its own activations, metadata
  buffers and paged K/V (one layer, the target's block geometry, indexed by the target's tables).
- `DeviceHiddenTap`: the target backend, whose forwards leave their hidden rows where they are
  (`act["rows"]`, gathered by logits_rows) and hand the engine a `DeviceRows` handle.
- `MtpCudaDrafter`: the propose / observe / release contract of `MtpDrafter`.

When the head computes. `observe` runs a K/V-only pass right after the target's step (the fused
input, attn_norm, the QKV product, RoPE and the K/V store: no attention, MLP or LM head) over the
hidden rows each sampled sequence emitted (the NumPy head defers the same K/V to its next
`propose`: identical values, as a position's K/V depends on its own row only), and copies each
sequence's last row into a per-sequence store. `propose` then runs `rounds` one-row-per-sequence
passes of the whole block: round 0 from the stored row (draft 1), round j from round j - 1's output
row and draft token (fed on the device); the argmax, its softmax probability and the d2t mapping
run on the device. The NumPy head's round 0 recomputes K/V at every pending position too, so the
K/V each round reads is the same.

The window [lo, p]. The head's K/V of position p is stored at the virtual position
v = p - (lo mod block_size) of the sequence's own table (v <= p: a block the sequence holds; from
lo's block on, so no prefix-cached block is written), which puts lo at a block start. Attention
then reads keys 0..p - lo through the table shifted by lo // block_size blocks: exactly [lo, p],
with the target's unmodified decode attention kernels (RoPE still rotates by p). A window restart
(a gap in the rows) moves lo, and with it the mapping; K/V stored under the old one is not read.
Difference from the NumPy head: it restarts the window of a sequence that does not draft for
MAX_PENDING (512) steps (a host-memory bound on its pending rows); the device head keeps the
window, as its K/V is computed as the rows arrive.

Graphs: with the target's cuda_graphs on, a proposal is one CUDA graph per (batch bucket of the
target's ladder, rounds, context bucket) and the observe pass one per token bucket, captured on
first use after an eager run (that run gives the result), replayed after.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import numpy as np

from metrale.spec.device_pass import (AttnPosOps, DevicePasses, HeadDoesNotFit, PassMeta, activation_plan,
                                      device_head_possible, norm_product, pass_backend_class, target_ops_class)
from metrale.spec.drafter import Draft
from metrale.spec.mtp import BLOCK, MtpDrafter, check_d2t, drafts_that_fit, read_head

log = logging.getLogger("metrale.spec")

OPTIONAL = ("qkv_bias", "q_norm", "k_norm")
__all__ = ["HeadDoesNotFit", "device_head_possible", "MtpCudaDrafter", "MtpCudaHead", "MtpPlanner"]


# ---------------------------------------------------------------------------- host bookkeeping
@dataclass
class _Track:
    lo: int          # window start: the head's K/V is valid on [lo, next)
    next: int        # one past the last position whose hidden row the head has
    slot: int        # the sequence's row in the last-row store (position next - 1)
    fresh: bool      # rows came since its last draft (the NumPy head's pending rows)


@dataclass
class ObservePlan:
    """The K/V pass over one step's hidden rows: token t is position positions[t], fed the token
    after it (token_ids[t]) and the target's hidden row hidden_src[t]; its K/V goes to slots[t]
    (the virtual position's slot). copy_src[i] -> copy_dst[i]: each sequence's last row into the store."""
    token_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    hidden_src: np.ndarray
    copy_src: np.ndarray
    copy_dst: np.ndarray

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class DraftPlan:
    """`rounds` passes of one row per drafting sequence (b < B): live[b] its index in propose's
    seqs, ks[b] its draft count. Round 0 feeds token_ids and the stored row store_rows[b]; round j
    feeds round j - 1's draft and output row. positions / slots / attn_pos: [rounds, B] (slot -1
    past a sequence's k: nothing stored); tables [B, W]: each table from its window's first block."""
    live: list[int]
    ks: list[int]
    rounds: int
    token_ids: np.ndarray
    store_rows: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    attn_pos: np.ndarray
    tables: np.ndarray

    @property
    def batch(self) -> int:
        return len(self.live)


def virtual_slot(table, position: int, lo: int, block_size: int) -> int:
    """The head's K/V slot of `position` in a window starting at lo (module doc, "The window")."""
    v = position - lo % block_size
    return int(table[v // block_size]) * block_size + v % block_size


class MtpPlanner:
    """The per-sequence tracks (window, last-row store slot) and the metadata of each pass. Pure
    host code: the device head and the tests' NumPy executor run the same plans."""

    def __init__(self, block_size: int, num_slots: int):
        self.block_size = block_size
        self.tracks: dict[str, _Track] = {}          # least recently observed first
        self._free = list(range(num_slots - 1, -1, -1))

    def _slot(self, keep: set) -> int:
        if self._free:
            return self._free.pop()
        # every slot taken (tracks never released): the least recently observed one gives its slot up
        rid = next(r for r in self.tracks if r not in keep)
        return self.tracks.pop(rid).slot

    def observe(self, scheduled, emitted: list[list[int]], num_rows: int) -> ObservePlan | None:
        """scheduled: the step's sampling rows (before their tokens are committed); emitted: their
        tokens; num_rows: hidden rows the step left (logits-row order, as MtpDrafter.observe)."""
        bs = self.block_size
        toks, pos, slots, src, csrc, cdst = [], [], [], [], [], []
        r, seen = 0, set()
        for s, tokens in zip(scheduled, emitted):
            n = 1 + len(s.draft)
            m = min(len(tokens), n, max(0, num_rows - r))
            if m > 0:
                first = s.seq.num_computed_tokens + s.num_tokens - n      # position of the block's row 0
                rid = s.seq.request_id
                seen.add(rid)
                t = self.tracks.pop(rid, None)
                if t is None:
                    t = _Track(first, first, self._slot(seen), False)
                elif t.next != first:              # a gap: the window restarts here
                    t.lo = t.next = first
                self.tracks[rid] = t               # most recently observed last
                table = s.seq.block_table
                for j in range(m):
                    toks.append(tokens[j])
                    pos.append(first + j)
                    slots.append(virtual_slot(table, first + j, t.lo, bs))
                    src.append(r + j)
                t.next, t.fresh = first + m, True
                csrc.append(r + m - 1)
                cdst.append(t.slot)
            r += n
        if not toks:
            return None
        i32 = lambda a: np.asarray(a, np.int32)  # noqa: E731
        return ObservePlan(i32(toks), i32(pos), i32(slots), i32(src), i32(csrc), i32(cdst))

    def ready(self, seq) -> bool:
        t = self.tracks.get(seq.request_id)
        return t is not None and t.fresh and t.next == seq.num_tokens - 1

    def plan_drafts(self, seqs, ks: list[int]) -> DraftPlan | None:
        """The proposal of seqs[i] with ks[i] drafts (those with fresh rows up to their last token)."""
        bs = self.block_size
        live = [i for i, k in enumerate(ks) if k > 0 and self.ready(seqs[i])]
        if not live:
            return None
        kept, rows = [], []
        for i in live:
            seq, t = seqs[i], self.tracks[seqs[i].request_id]
            table = seq.block_table
            p0 = seq.num_tokens - 2                 # position of the row round 0 feeds
            kept.append(drafts_that_fit(seq, ks[i], bs))      # as MtpDrafter: K/V past the table, fewer drafts
            rows.append((seq, t, p0, table))
        rounds, B = max(kept), len(live)
        positions = np.zeros((rounds, B), np.int32)
        slots = np.full((rounds, B), -1, np.int32)
        attn = np.zeros((rounds, B), np.int32)
        tokens = np.zeros(B, np.int32)
        store = np.zeros(B, np.int32)
        width = max(1, max(len(table) - t.lo // bs for _, t, _, table in rows))
        tables = np.zeros((B, width), np.int32)
        for b, ((seq, t, p0, table), k) in enumerate(zip(rows, kept)):
            tokens[b] = seq.token_slice(seq.num_tokens - 1, seq.num_tokens)[0]
            store[b] = t.slot
            shifted = np.asarray(table[t.lo // bs:], np.int32)
            tables[b, :len(shifted)] = shifted
            for j in range(rounds):
                p = p0 + min(j, k - 1)          # rounds past this row's k repeat its last (results unused)
                positions[j, b] = p
                attn[j, b] = p - t.lo
                if j < k:
                    slots[j, b] = virtual_slot(table, p, t.lo, bs)
            t.fresh = False
        return DraftPlan(live, kept, rounds, tokens, store, positions, slots, attn, tables)

    def release(self, request_id: str) -> None:
        t = self.tracks.pop(request_id, None)
        if t is not None:
            self._free.append(t.slot)


# ---------------------------------------------------------------------------- the engine hook
class DeviceRows:
    """The hidden rows (before the final norm) of the target's last forward, still on the device:
    rows [0, n) of `array` (the backend's act["rows"]), valid until its next forward."""

    def __init__(self, backend, n: int):
        self.backend, self.n = backend, n
        self.array = backend.act["rows"]

    def __len__(self) -> int:
        return self.n

    def to_host(self) -> np.ndarray:
        """A host copy (tests, debugging)."""
        return self.backend.hidden_rows(self.n)


class DeviceHiddenTap:
    """The target backend; after each full forward `take_hidden` hands the engine a DeviceRows
    of its logits rows (nothing is copied). Everything else passes through."""

    def __init__(self, backend):
        self.inner, self._rows = backend, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _kept(self, batch, num_layers) -> None:
        self._rows = len(batch.logits_indices) if num_layers is None else None

    def forward(self, batch, num_layers=None, return_hidden=False):
        self._rows = None
        out = self.inner.forward(batch, num_layers, return_hidden=return_hidden)
        self._kept(batch, num_layers)
        return out

    def forward_greedy(self, batch, num_layers=None):
        self._rows = None
        ids = self.inner.forward_greedy(batch, num_layers)
        self._kept(batch, num_layers)
        return ids

    def forward_device(self, batch, num_layers=None):
        self._rows = None
        logits = self.inner.forward_device(batch, num_layers)
        self._kept(batch, num_layers)
        return logits

    def launch_greedy(self, *args, **kwargs):      # a step ahead: its rows are not the next observe's
        self._rows = None
        return self.inner.launch_greedy(*args, **kwargs)

    def launch_logits(self, *args, **kwargs):
        self._rows = None
        return self.inner.launch_logits(*args, **kwargs)

    def take_hidden(self) -> DeviceRows | None:
        n, self._rows = self._rows, None
        return None if n is None else DeviceRows(self.inner, n)


# ---------------------------------------------------------------------------- the drafter
class MtpCudaDrafter:
    """MtpDrafter's contract with the head on the device. `head`: an MtpCudaHead (or anything
    with block_size, num_slots, observe(plan, hidden), draft(plan) -> (ids, conf) [rounds, B])."""
    name = "mtp"
    needs_hidden = True
    lookup_only = False
    on_device = True           # its drafts cost no host work (spec gate: no CUDA_HOST_DRAFT_COST)

    def __init__(self, head):
        self.head = head
        self.planner = MtpPlanner(head.block_size, head.num_slots)

    @classmethod
    def from_config(cls, spec, backend, model_config) -> "MtpCudaDrafter":
        from metrale.spec import assets
        path = assets.resolve("mtp", getattr(spec, "mtp_head", None), model_config, lever="spec.mtp_head", method="mtp")
        head = load_device_head(path, backend, max_drafts=int(spec.num_drafts),
                                draft_vocab=bool(getattr(spec, "mtp_draft_vocab", True)))
        log.info("MTP head %s on the device (draft vocabulary %d)", path, head.vocab)
        return cls(head)

    @property
    def tracks(self) -> dict:
        return self.planner.tracks

    def tap(self, backend):
        return backend if isinstance(backend, DeviceHiddenTap) else DeviceHiddenTap(backend)

    def observe(self, scheduled, emitted: list[list[int]], hidden) -> None:
        if hidden is None:
            return
        plan = self.planner.observe(scheduled, emitted, len(hidden))
        if plan is not None:
            self.head.observe(plan, hidden)

    def propose(self, seqs, ks: list[int]) -> list[Draft]:
        drafts = [Draft() for _ in seqs]
        plan = self.planner.plan_drafts(seqs, ks)
        if plan is None:
            return drafts
        ids, conf = self.head.draft(plan)
        for b, (i, k) in enumerate(zip(plan.live, plan.ks)):
            drafts[i] = Draft([int(x) for x in ids[:k, b]], [float(c) for c in conf[:k, b]])
        return drafts

    def release(self, seq) -> None:
        self.planner.release(seq.request_id)


def mtp_drafter(spec, backend, model_config):
    """spec.method=mtp: the device head on a CUDA target (MtpCudaDrafter), else the NumPy head
    (MtpDrafter); the NumPy head also when the device head's K/V pool does not fit."""
    if device_head_possible(backend):
        try:
            return MtpCudaDrafter.from_config(spec, backend, model_config)
        except HeadDoesNotFit as exc:
            log.warning("the MTP head drafts on the host: %s", exc)
    return MtpDrafter.from_config(spec, backend, model_config)


# ---------------------------------------------------------------------------- the head on the device
def load_device_head(path, target, *, max_drafts: int, draft_vocab: bool = True) -> "MtpCudaHead":
    """A head file (checked as mtp.read_head checks it) on the target's device."""
    tensors, d2t, meta = read_head(path, target.config)
    config = head_config(target.config, meta.get("rope_interleaved"))
    return MtpCudaHead(target, config, tensors, d2t=d2t if draft_vocab else None, max_drafts=max_drafts)


def head_config(target_config, rope_interleaved: str | None = None, num_layers: int = 1):
    """The head's model config: the target's, `num_layers` dense layers, no sliding window (the NumPy
    head's attention reads its whole window), the head file's Q/K row layout."""
    extra = {} if rope_interleaved is None else {"rope_interleaved": rope_interleaved == "true"}
    return dataclasses.replace(target_config, num_layers=num_layers, sliding_window=0, sliding_layers=(),
                               moe_layers=(), layer_types=(), **extra)


class MtpCudaOps(AttnPosOps):
    """CudaOps of the head's one-layer model (composed before the target's ops class): `embed`
    builds eh_proj @ [rms(embed[x], enorm); rms(h, hnorm)] from the token rows and the hidden
    rows (b.hidden[hidden_src]); attention reads each row's window through the shifted tables at
    position attn_pos (module doc). Everything else is the target's op."""

    def __init__(self, backend, g):
        super().__init__(backend, g)
        self.hidden_src = backend.meta.view("hidden_src", g.tokens)

    def embed(self, weight):
        from kernels_numba import embedding, qkv
        from metrale.runtime.cuda.quant import DeviceQuantized, quant_embedding
        b, T = self.b, self.g.tokens
        w = b.head_weights
        x, out = b.view("mtp_x", T), self._buf("residual")
        if isinstance(weight, DeviceQuantized):
            from kernels_numba import quant_dequant
            quant_dequant.feed_ids(self.token_ids, self.token_src, b.feed, stream=self.s)
            quant_embedding(self.token_ids, weight, x, self.s)
        else:
            embedding.embedding_feed(weight, self.token_ids, self.token_src, b.feed, x, stream=self.s)
        n = b.view("mtp_n", T)
        norm_product(self, x, w["enorm"], w["eh_e"], out, n, accumulate=False)
        qkv.gather_rows(b.hidden, self.hidden_src, x, stream=self.s)
        norm_product(self, x, w["hnorm"], w["eh_h"], out, n, accumulate=True)
        self._resid_ss = None
        return out


def _head_meta(sets: int, n: int, max_blocks: int) -> PassMeta:
    """The head's step metadata (device_pass.PassMeta): sets 0..K-1 are the draft rounds, set K the
    observe pass; one token a sequence (token_seq, seq_query_start, logits_indices: the identity)."""
    m = PassMeta(sets, n, max_blocks, MTP_FIELDS)
    f = m.fields()
    f[:, m.FIELDS.index("token_seq"), :] = np.arange(n + 1, dtype=np.int32)
    f[:, m.FIELDS.index("seq_query_start"), :] = np.arange(n + 1, dtype=np.int32)
    f[:, m.FIELDS.index("logits_indices"), :] = np.arange(n + 1, dtype=np.int32)
    f[:, m.FIELDS.index("token_src"), :] = -1
    m.upload_all()
    return m


MTP_FIELDS = ("token_ids", "positions", "slot_mapping", "token_seq", "seq_query_start", "context_lens",
              "logits_indices", "token_src", "attn_pos", "hidden_src", "copy_src", "copy_dst")


class MtpCudaHead(DevicePasses):
    """The head's weights, buffers and K/V on the target's device; `observe` and `draft` run the
    planner's passes (module doc)."""
    kind = "MTP head"

    def __init__(self, target, config, tensors: dict, *, d2t=None, max_drafts: int = 4):
        from numba import cuda

        from kernels_numba.bf16 import to_bf16_bits
        super().__init__(target)
        self.config = c = config
        D = c.hidden_size
        self.max_drafts = max(1, int(max_drafts))
        self.n = n = int(target.max_rows)                 # rows of a pass: one step's rows, or drafting sequences
        self.num_slots = int(getattr(target, "max_seqs", n))
        # the head's block: bf16 matrices, float32 vectors; eh_proj split into its two halves
        host = {name: tensors[name] for name in BLOCK + OPTIONAL if name in tensors}
        eh = np.asarray(tensors["eh_proj"], np.float32)
        host["eh_e"], host["eh_h"] = eh[:, :D], eh[:, D:]
        host["enorm"], host["hnorm"] = tensors["enorm"], tensors["hnorm"]
        up = lambda a: cuda.to_device(np.ascontiguousarray(a))  # noqa: E731
        self.w = {name: up(to_bf16_bits(a) if np.ndim(a) >= 2 else np.asarray(a, np.float32)) for name, a in host.items()}
        # shared with the target: embedding, final norm, LM head (a draft vocabulary: its rows, once)
        tw = target.weights
        self.embed, self.final_norm = tw["embed"], tw["final_norm"]
        self.lm_head = tw.get("lm_head", self.embed)
        self.d2t = None if d2t is None else check_d2t(d2t, c.vocab_size)
        self.vocab = c.vocab_size if self.d2t is None else len(self.d2t)
        out_cols = c.vocab_size
        if self.d2t is not None:
            out_cols = -(-self.vocab // 64) * 64          # the GEMM kernels' multiple of 64 (padding rows repeat row 0)
            self.lm_head = self._draft_lm_head(out_cols)
            self.d2t_dev = up(self.d2t)
        else:
            self.d2t_dev = None
        # activations: the dense plan at N rows, the target's RoPE tables and cuBLASLt workspace
        plan = activation_plan(target, c, n, n)
        plan[f"out{out_cols}"] = ((n, out_cols), np.float32)
        plan["mtp_x"] = ((n, D), np.float32)
        plan["mtp_n"] = ((n, D), np.float32)
        plan["last"] = ((self.num_slots, D), np.float32)
        plan["draft_ids"] = ((self.max_drafts, n), np.int32)
        plan["draft_conf"] = ((self.max_drafts, n), np.float32)
        kv_shape = (1, self.num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        self._check_memory(2 * 2 * math.prod(kv_shape) + self.plan_bytes(plan))
        self.act = {name: cuda.to_device(np.zeros(shape, dt)) for name, (shape, dt) in plan.items()}
        self.kv = self._kv_pages(kv_shape)
        self.meta = _head_meta(self.max_drafts + 1, n, int(target.max_blocks))
        self.proxy = pass_backend_class()(target, c, self.act, self.kv, self.w)
        self.ops_class = type("MtpCudaOps", (MtpCudaOps, target_ops_class(target)), {})
        self.logits_log: list | None = None     # tests: [(round, host logits [B, vocab])] of eager proposals
        pinned = cuda.pinned_array
        self._ids_host = pinned((self.max_drafts, n), dtype=np.int32)
        self._conf_host = pinned((self.max_drafts, n), dtype=np.float32)
        self._observe_copy = None               # event after the observe pass's metadata copy
        # the uploads and K/V memsets above ran on the legacy default stream (a memset, and the DMA
        # of a pageable upload, may still run after they return), which the target's non-blocking
        # stream does not wait for: finish them before any pass reads them (as CudaBackend.__init__)
        cuda.synchronize()

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab

    # ------------------------------------------------------------------ set-up
    def _draft_lm_head(self, rows: int):
        """The draft vocabulary's rows of the target's LM head, bf16 [rows, D]; the rows past
        len(d2t) repeat the first one (argmax and confidence read only the first len(d2t))."""
        from numba import cuda

        from kernels_numba import qkv
        from kernels_numba.bf16 import to_bf16_bits
        idx = np.concatenate([self.d2t, np.full(rows - len(self.d2t), self.d2t[0], np.int32)])
        from metrale.runtime.cuda.quant import DeviceFP8, DeviceQuantized
        if isinstance(self.lm_head, (DeviceQuantized, DeviceFP8)):      # its rows dequantized on the host
            from metrale.runtime.cuda_backend import _host_float
            return cuda.to_device(to_bf16_bits(_host_float(self.lm_head)[idx]))
        out = cuda.device_array((rows, self.lm_head.shape[1]), self.lm_head.dtype)
        idx_dev = cuda.to_device(idx, stream=self.stream.numba)      # on the stream the gather runs on
        qkv.gather_rows(self.lm_head, idx_dev, out, stream=self.stream.numba)
        self.stream.synchronize()
        return out

    # ------------------------------------------------------------------ transfers
    def _fetch_rounds(self, rounds: int) -> tuple[np.ndarray, np.ndarray]:
        ids, conf = self._ids_host[:rounds], self._conf_host[:rounds]
        self._fetch([(self.act["draft_ids"], ids), (self.act["draft_conf"], conf)])
        return ids.copy(), conf.copy()

    # ------------------------------------------------------------------ the block
    def _block(self, ops, full: bool):
        """The head's one decoder layer (llama_forward's op sequence for one layer); full=False
        stops after the K/V store (the observe pass)."""
        w = self.w
        x = ops.embed(self.embed)
        q = ops.norm_qkv_to_cache(x, w["attn_norm"], w["qkv"], w.get("qkv_bias"), 0, w.get("q_norm"), w.get("k_norm"))
        if not full:
            return None
        x = ops.attention_linear_residual(q, 0, w["o"], x)
        x = ops.mlp_residual(x, w["mlp_norm"], w["gate_up"], w["down"])
        rows = ops.logits_rows(x)
        return ops.norm_linear(rows, self.final_norm, self.lm_head)

    def _geometry(self, tokens: int, max_context: int):
        from metrale.runtime.cuda_backend import Geometry
        return Geometry(tokens, tokens, tokens, max_context, 1)

    # ------------------------------------------------------------------ observe: the K/V pass
    def observe(self, plan: ObservePlan, hidden) -> None:
        """The K/V of the plan's rows and each sequence's last row into the store; hidden: the
        target's DeviceRows (its act["rows"])."""
        array = hidden.array if isinstance(hidden, DeviceRows) else hidden
        T = plan.num_tokens
        if T > self.n:
            raise ValueError(f"MTP observe: {T} rows, the head's buffers hold {self.n}")
        Tp, graphed = self._bucket(T, self.n)
        m, K = self.meta, self.max_drafts
        if self._observe_copy is not None:       # the last observe's copy has read the host buffer
            self._observe_copy.synchronize()
        f = m.fields()[K]
        F = m.FIELDS.index
        f[F("token_ids"), :T], f[F("token_ids"), T:Tp] = plan.token_ids, 0
        f[F("positions"), :T], f[F("positions"), T:Tp] = plan.positions, 0
        f[F("slot_mapping"), :T], f[F("slot_mapping"), T:Tp] = plan.slots, -1
        f[F("context_lens"), :Tp] = f[F("positions"), :Tp] + 1
        f[F("hidden_src"), :T], f[F("hidden_src"), T:Tp] = plan.hidden_src, 0
        c = len(plan.copy_src)
        f[F("copy_src"), :c], f[F("copy_src"), c:Tp] = plan.copy_src, 0
        f[F("copy_dst"), :c], f[F("copy_dst"), c:Tp] = plan.copy_dst, -1
        self._htod(K * m.stride, (K + 1) * m.stride)
        if not self.sim:
            from metrale.runtime.cuda import Event
            self._observe_copy = (self._observe_copy or Event(timing=False)).record(self.stream)
        self._launch(("observe", Tp, id(array)) if graphed else None, lambda: self._run_observe(Tp, array))

    def _run_observe(self, Tp: int, rows) -> None:
        from kernels_numba import mtp_head
        px, K = self.proxy, self.max_drafts
        px.meta, px.hidden = self.meta.sets_view[K], rows
        px.feed = px._cached(("feed", 0), lambda: self.act["draft_ids"][0])      # nothing fed (token_src -1)
        self._block(self.ops_class(px, self._geometry(Tp, 0)), full=False)
        mtp_head.copy_rows(rows, self.meta.view(K, "copy_src", Tp), self.act["last"], self.meta.view(K, "copy_dst", Tp),
                           stream=self.stream.numba)

    # ------------------------------------------------------------------ draft: the rounds
    def draft(self, plan: DraftPlan) -> tuple[np.ndarray, np.ndarray]:
        """(draft ids, confidences), [rounds, B]: row j of column b is sequence b's draft j + 1."""
        if plan.rounds > self.max_drafts:
            raise ValueError(f"MTP draft: {plan.rounds} rounds, the head was built for {self.max_drafts}")
        out_ids, out_conf = [], []
        for a in range(0, plan.batch, self.n):      # more drafting sequences than a pass holds: in parts
            ids, conf = self._draft_part(plan, a, min(plan.batch, a + self.n))
            out_ids.append(ids)
            out_conf.append(conf)
        return np.concatenate(out_ids, axis=1), np.concatenate(out_conf, axis=1)

    def _draft_part(self, plan: DraftPlan, a: int, z: int) -> tuple[np.ndarray, np.ndarray]:
        B, R = z - a, plan.rounds
        record = self.logits_log is not None
        Bp, graphed = (B, False) if record else self._bucket(B, self.n)
        ctx = int(plan.attn_pos[:, a:z].max()) + 1
        if graphed:
            ctx = self.target.context_bucket(ctx)
        m = self.meta
        f = m.fields()
        F = m.FIELDS.index
        for j in range(R):
            r = f[j]
            if j == 0:
                r[F("token_ids"), :B], r[F("token_ids"), B:Bp] = plan.token_ids[a:z], 0
                r[F("hidden_src"), :B], r[F("hidden_src"), B:Bp] = plan.store_rows[a:z], 0
                r[F("token_src"), :Bp] = -1
            else:
                r[F("token_ids"), :Bp] = 0
                r[F("hidden_src"), :Bp] = np.arange(Bp, dtype=np.int32)
                r[F("token_src"), :B], r[F("token_src"), B:Bp] = np.arange(B, dtype=np.int32), -1
            r[F("positions"), :B], r[F("positions"), B:Bp] = plan.positions[j, a:z], 0
            r[F("slot_mapping"), :B], r[F("slot_mapping"), B:Bp] = plan.slots[j, a:z], -1
            r[F("attn_pos"), :B], r[F("attn_pos"), B:Bp] = plan.attn_pos[j, a:z], 0
            r[F("context_lens"), :Bp] = r[F("attn_pos"), :Bp] + 1
        tables = m.host[m.table_offset:m.table_offset + Bp * m.max_blocks].reshape(Bp, m.max_blocks)
        width = min(plan.tables.shape[1], m.max_blocks)
        tables[:B, :width] = plan.tables[a:z, :width]
        tables[B:, :width] = 0
        self._htod(0, R * m.stride)
        self._tables_htod(Bp, width)
        self._launch(("draft", Bp, R, ctx) if graphed else None, lambda: self._run_draft(Bp, R, ctx, record))
        ids, conf = self._fetch_rounds(R)
        return ids[:, :B], conf[:, :B]

    def _run_draft(self, Bp: int, R: int, ctx: int, record: bool = False) -> None:
        from kernels_numba import argmax, mtp_head
        px, g, s = self.proxy, self._geometry(Bp, ctx), self.stream.numba
        ids, conf = self.act["draft_ids"], self.act["draft_conf"]
        for j in range(R):
            px.meta = self.meta.sets_view[j]
            px.hidden = self.act["last"] if j == 0 else self.act["rows"]
            px.feed = px._cached(("feed", j), lambda: ids[max(j - 1, 0)])   # round 0 feeds nothing (token_src -1)
            logits = self._block(self.ops_class(px, g), full=True)
            lv = logits if logits.shape[1] == self.vocab else px._cached(("draft_logits", Bp),
                                                                         lambda: logits[:, :self.vocab])
            am = px.view("argmax", Bp)
            argmax.argmax_rows(lv, am, self.act["argmax_work"], stream=s)
            mtp_head.draft_pick(lv, am, self.d2t_dev, px._cached(("ids", j, Bp), lambda: ids[j][:Bp]),
                                px._cached(("conf", j, Bp), lambda: conf[j][:Bp]), stream=s)
            if record:
                self.stream.synchronize()
                self.logits_log.append((j, logits.copy_to_host()[:, :self.vocab]))

