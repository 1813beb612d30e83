"""The DFlash block drafter on the device (docs/dflash.md, "On the device"): the drafter a CUDA target
gets for spec.method=dflash. Its drafts are those of the NumPy drafter (metrale/spec/dflash.py, the
reference) computed with the target's own kernels; no hidden row, logit or K/V leaves the device:
a forward's context pass copies in its positions and slots, a proposal its metadata and block
tables, and out come the draft ids and confidences.

- The target keeps the residual after the drafter's target layers for every token of every full
  forward in a device buffer (CudaBackend.keep_layer_rows, runtime/cuda/layer_rows.py), turned on
  when the engine asks the drafter for its tap (`DeviceLayerTap`).
- The context pass (`DFlashCudaModel.write_context`), right after each target forward on the same
  stream: feat = rms_norm(fc @ concat(rows), hidden_norm), then per drafter layer the K/V
  projections of feat, RoPE, stored at the forward's slots in the drafter's paged pool (the
  target's block geometry and tables). This is the NumPy drafter's eager `write_context`: the
  device projects every forward's positions (a few small products a token) instead of storing
  the rows and catching up lazily.
- The block pass (`draft`): all drafting sequences' blocks [last, MASK x (L-1)] in one forward of
  the drafter's layers (llama_forward with the target's ops class, `DFlashCudaOps` in front:
  `embed` writes the MASK rows, attention reads keys 0..start + L - 1 of a table that ends in
  scratch blocks; metrale/spec/dflash_plan.py), the target's final norm and LM head on rows
  1..L-1 of each block, argmax and its softmax probability on the device.
- Shared with the target (no copies): embedding, final norm, LM head, stream, cuBLASLt handle,
  RoPE tables, quantized-weight scratch. Its own: its layers (bf16 matrices, float32 norms), fc,
  activations, metadata (two sets: block pass, context pass) and K/V pool.

Graphs: with the target's cuda_graphs on, a proposal is one CUDA graph per (batch bucket of the
target's ladder, context bucket), and the context pass one per token bucket, captured after an
eager first run. Passes past the ladder (prefill chunks, more sequences) run eagerly.
"""
from __future__ import annotations

import logging
import math

import numpy as np

from metrale.spec.device_pass import (AttnPosOps, DevicePasses, HeadDoesNotFit, PassMeta, activation_plan,
                                      device_head_possible, norm_product, pass_backend_class, product,
                                      target_ops_class)
from metrale.spec.dflash import LAYER, DFlashDrafter, DrafterFile, drafter_file
from metrale.spec.dflash_plan import BlockPlan, plan_blocks, scratch_blocks
from metrale.spec.drafter import Draft

log = logging.getLogger("metrale.spec")

OPTIONAL = ("qkv_bias", "q_norm", "k_norm")
FIELDS = ("token_ids", "positions", "slot_mapping", "token_seq", "seq_query_start", "context_lens",
          "logits_indices", "token_src", "attn_pos", "mask_src", "mask_dst", "copy_src", "copy_dst")
BLOCK, CONTEXT = 0, 1            # the metadata sets
CONTEXT_CHUNK = 2048             # tokens of one context pass (a longer forward runs several)


class DFlashCudaOps(AttnPosOps):
    """CudaOps of the drafter's layers (composed before the target's ops class): `embed` gathers
    the token rows, then writes the MASK embedding over rows mask_dst (every block row but the
    first); attention reads keys 0..attn_pos (device_pass.AttnPosOps). The rest is the target's."""

    def embed(self, weight):
        from kernels_numba.mtp_head import copy_rows
        x = super().embed(weight)
        T, m = self.g.tokens, self.b.meta
        copy_rows(self.b.head_weights["mask_embed"], m.view("mask_src", T), x, m.view("mask_dst", T), stream=self.s)
        return x


class DFlashCudaModel(DevicePasses):
    """The drafter's weights, buffers, layer-row buffer and K/V pool on the target's device;
    `write_context` and `draft` run its two passes (module doc)."""
    kind = "DFlash drafter"

    def __init__(self, target, f: DrafterFile, *, length: int):
        from numba import cuda

        from kernels_numba.bf16 import to_bf16_bits
        from metrale.runtime.cuda.layer_rows import LayerRows
        from metrale.spec.mtp_cuda import head_config
        super().__init__(target)
        self.config = c = head_config(f.config, num_layers=f.num_layers)
        D, Lyr = c.hidden_size, f.num_layers
        self.target_layers, self.num_layers, self.length = tuple(f.target_layers), Lyr, int(length)
        L = self.length
        if L < 2:
            raise ValueError(f"DFlash: a block of {L} rows has no draft row")
        self.trained_block_size = f.block_size
        # a pass: up to per_pass blocks of L rows, their rows 1..L-1 through the LM head (<= max_rows)
        self.per_pass = max(1, int(target.max_rows) // (L - 1))
        self.tokens, self.rows = self.per_pass * L, self.per_pass * (L - 1)
        self.chunk = min(int(target.max_tokens), CONTEXT_CHUNK)
        self.scratch = scratch_blocks(L, self.block_size)
        self.pool_blocks = self.num_blocks + self.per_pass * self.scratch
        # weights: the layers' bf16 matrices and float32 vectors, fc, hidden_norm, the MASK row
        up = lambda a: cuda.to_device(np.ascontiguousarray(a))  # noqa: E731
        t = f.tensors
        own = {n: t[n] for n in ["fc", "hidden_norm"] + [f"layers.{i}.{n}" for i in range(Lyr) for n in LAYER + OPTIONAL]
               if n in t}
        self.w = {n: up(to_bf16_bits(a) if np.ndim(a) >= 2 else np.asarray(a, np.float32)) for n, a in own.items()}
        self.w["mask_embed"] = up(np.asarray(t["mask_embed"], np.float32).reshape(1, D))
        self.kv_w = [self.w[f"layers.{i}.qkv"][c.q_size:] for i in range(Lyr)]     # the K/V rows of each qkv
        tw = target.weights
        self.fw = {n: a for n, a in self.w.items() if n.startswith("layers.")}      # llama_forward's weights
        self.fw.update({n: tw[n] for n in ("embed", "final_norm", "lm_head") if n in tw})
        # activations: the dense plan at the block pass's size, the context pass's own buffers
        plan = activation_plan(target, c, self.tokens, self.rows)
        plan[f"out{c.vocab_size}"] = ((self.rows, c.vocab_size), np.float32)
        plan["draft_ids"] = ((self.rows,), np.int32)
        plan["draft_conf"] = ((self.rows,), np.float32)
        n = len(self.target_layers)
        plan["ctx_feat"] = ((self.chunk, D), np.float32)
        plan["ctx_n"] = ((self.chunk, D), np.float32)
        plan["ctx_kv"] = ((self.chunk, 2 * c.kv_size), np.float32)
        plan["ctx_q"] = ((self.chunk, 0, c.head_dim), np.float32)      # no query heads: K/V only
        if "x_bf16" in plan:                 # cuBLASLt's bf16 input: the widest product's
            plan["x_bf16"] = ((max(math.prod(plan["x_bf16"][0]), self.chunk * n * D),), np.uint16)
        kv_shape = (Lyr, self.pool_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        weights = sum(a.nbytes for a in self.w.values())
        taps = int(target.max_tokens) * n * D * 4
        self._check_memory(2 * 2 * math.prod(kv_shape) + self.plan_bytes(plan) + weights + taps)
        self.act = {name: cuda.to_device(np.zeros(shape, dt)) for name, (shape, dt) in plan.items()}
        self.kv = self._kv_pages(kv_shape)
        block = self.block_size * c.kv_size // 4              # a block of one layer, in uint64 words
        self.kv_rows = [a.reshape(Lyr * self.pool_blocks, block) for a in (self.kv.k64, self.kv.v64)]   # block copies
        self.taps = LayerRows(self.target_layers, int(target.max_tokens), D)
        self.meta = self._make_meta(max(self.tokens, self.chunk, self.per_pass * Lyr),
                                    int(target.max_blocks) + self.scratch)
        self.proxy = pass_backend_class()(target, c, self.act, self.kv, self.w)
        self.ops_class = type("DFlashCudaOps", (DFlashCudaOps, target_ops_class(target)), {})
        self.logits_log: list | None = None     # tests: host logits [B, L - 1, vocab] of eager proposals
        self._ids_host = cuda.pinned_array(self.rows, dtype=np.int32)
        self._conf_host = cuda.pinned_array(self.rows, dtype=np.float32)
        self._context_copy = None               # event after the last context pass's metadata copy
        # the uploads and memsets above ran on the legacy default stream: finish them before the
        # target's non-blocking stream reads them (as CudaBackend.__init__)
        cuda.synchronize()

    def _make_meta(self, n: int, max_blocks: int) -> PassMeta:
        m = PassMeta(2, n, max_blocks, FIELDS, table_rows=self.per_pass)
        F = m.FIELDS.index
        f = m.fields()
        f[:, F("token_src")] = -1
        f[:, F("mask_dst")] = -1
        f[:, F("copy_src")] = f[:, F("copy_dst")] = -1
        f[CONTEXT, F("slot_mapping")] = -1
        m.upload_all()
        return m

    # ------------------------------------------------------------------ the context pass
    def write_context(self, batch) -> None:
        """The context K/V of every token of the target forward just queued (its layer rows are in
        self.taps), at the batch's slots."""
        T = batch.num_tokens
        for a in range(0, T, self.chunk):
            c = min(self.chunk, T - a)
            Tp, graphed = self._bucket(c, self.chunk) if T <= self.chunk else (c, False)
            m = self.meta
            if self._context_copy is not None:       # the last pass's copy has read the host buffer
                self._context_copy.synchronize()
            f = m.fields()[CONTEXT]
            F = m.FIELDS.index
            f[F("positions"), :c], f[F("positions"), c:Tp] = batch.positions[a:a + c], 0
            f[F("slot_mapping"), :c], f[F("slot_mapping"), c:Tp] = batch.slot_mapping[a:a + c], -1
            self._htod(CONTEXT * m.stride, (CONTEXT + 1) * m.stride)
            if not self.sim:
                from metrale.runtime.cuda import Event
                self._context_copy = (self._context_copy or Event(timing=False)).record(self.stream)
            self._launch(("context", Tp) if graphed else None, lambda a=a, Tp=Tp: self._run_context(a, Tp))

    def _run_context(self, a: int, Tp: int) -> None:
        from kernels_numba import qkv
        from metrale.runtime.cuda_backend import Geometry
        px, c = self.proxy, self.config
        px.meta = self.meta.sets_view[CONTEXT]
        ops = self.ops_class(px, Geometry(Tp, 1, 1, 0, 1))
        feat, normed, kv = px.view("ctx_feat", Tp), px.view("ctx_n", Tp), px.view("ctx_kv", Tp)
        product(ops, self.taps.matrix(a, Tp), self.w["fc"], feat)
        for i in range(self.num_layers):
            norm_product(ops, feat, self.w["hidden_norm"], self.kv_w[i], kv, normed)
            k_norm = self.w.get(f"layers.{i}.k_norm")
            qkv.qkv_rope_store(kv, ops.positions, px.cos, px.sin, ops.slot_mapping, px.view("ctx_q", Tp),
                               self.kv.k[i], self.kv.v[i], interleaved=c.rope_interleaved, q_norm=k_norm,
                               k_norm=k_norm, eps=c.rms_norm_eps, stream=ops.s)

    # ------------------------------------------------------------------ the block pass
    def draft(self, plan: BlockPlan) -> tuple[np.ndarray, np.ndarray]:
        """(draft ids, confidences), [B, L - 1]: row b is plan sequence b's drafts 1..L-1."""
        if plan.length != self.length:
            raise ValueError(f"DFlash draft: blocks of {plan.length} rows, the drafter was built for {self.length}")
        ids, conf = [], []
        for a in range(0, plan.batch, self.per_pass):       # more drafting sequences than a pass holds: in parts
            i, p = self._draft_part(plan, a, min(plan.batch, a + self.per_pass))
            ids.append(i)
            conf.append(p)
        return np.concatenate(ids), np.concatenate(conf)

    def _draft_part(self, plan: BlockPlan, a: int, z: int) -> tuple[np.ndarray, np.ndarray]:
        B, L, Lyr = z - a, self.length, self.num_layers
        record = self.logits_log is not None
        Bp, graphed = (B, False) if record else self._bucket(B, self.per_pass)
        ctx = max(plan.context(b) for b in range(a, z))
        if graphed:
            ctx = self.target.context_bucket(ctx)
        m = self.meta
        f = m.fields()[BLOCK]
        F = m.FIELDS.index
        T, Tp, toks = B * L, Bp * L, slice(a * L, z * L)
        f[F("token_ids"), :T], f[F("token_ids"), T:Tp] = plan.token_ids[toks], 0
        f[F("positions"), :T], f[F("positions"), T:Tp] = plan.positions[toks], 0
        f[F("slot_mapping"), :T], f[F("slot_mapping"), T:Tp] = plan.slots[toks], -1
        f[F("attn_pos"), :T], f[F("attn_pos"), T:Tp] = plan.attn_pos[toks], 0
        t = np.arange(Tp, dtype=np.int32)
        f[F("token_seq"), :Tp] = t // L
        f[F("mask_dst"), :Tp] = np.where(t % L > 0, t, -1)
        f[F("seq_query_start"), :Bp + 1] = np.arange(Bp + 1, dtype=np.int32) * L
        f[F("context_lens"), :Bp] = f[F("attn_pos"), :Tp:L] + 1
        f[F("logits_indices"), :Bp * (L - 1)] = t.reshape(Bp, L)[:, 1:].reshape(-1)
        # the context part of each start's block into its first scratch block, every drafter layer
        src, dst = plan.copy_src[a:z], plan.copy_dst[a:z]
        layer = np.arange(Lyr, dtype=np.int32) * self.pool_blocks
        f[F("copy_src"), :Bp * Lyr] = 0
        f[F("copy_dst"), :Bp * Lyr] = -1
        f[F("copy_src"), :B * Lyr] = (src[:, None] + layer).reshape(-1)
        f[F("copy_dst"), :B * Lyr] = np.where(dst[:, None] >= 0, dst[:, None] + layer, -1).reshape(-1)
        tables = m.host[m.table_offset:m.table_offset + Bp * m.max_blocks].reshape(Bp, m.max_blocks)
        width = min(plan.tables.shape[1], m.max_blocks)
        tables[:B, :width] = plan.tables[a:z, :width]
        tables[B:, :width] = 0
        self._htod(BLOCK * m.stride, (BLOCK + 1) * m.stride)
        self._tables_htod(Bp, width)
        self._launch(("block", Bp, ctx) if graphed else None, lambda: self._run_block(Bp, ctx, record))
        R = B * (L - 1)
        self._fetch([(self.act["draft_ids"], self._ids_host[:R]), (self.act["draft_conf"], self._conf_host[:R])])
        return self._ids_host[:R].reshape(B, L - 1).copy(), self._conf_host[:R].reshape(B, L - 1).copy()

    def _run_block(self, Bp: int, ctx: int, record: bool = False) -> None:
        from kernels_numba import argmax, mtp_head
        from metrale.models.llama import llama_forward
        from metrale.runtime.cuda_backend import Geometry
        px, s, L = self.proxy, self.stream.numba, self.length
        px.meta = self.meta.sets_view[BLOCK]
        n, R = Bp * self.num_layers, Bp * (L - 1)
        for rows in self.kv_rows:
            mtp_head.copy_rows(rows, px.meta.view("copy_src", n), rows, px.meta.view("copy_dst", n), stream=s)
        logits = llama_forward(self.ops_class(px, Geometry(Bp * L, Bp, R, ctx, 1)), self.fw, self.config)
        am = px.view("argmax", R)
        argmax.argmax_rows(logits, am, self.act["argmax_work"], stream=s)
        mtp_head.draft_pick(logits, am, None, px.view("draft_ids", R), px.view("draft_conf", R), stream=s)
        if record:
            self.stream.synchronize()
            self.logits_log.append(logits.copy_to_host().reshape(Bp, L - 1, -1))


# ---------------------------------------------------------------------------- the engine hook
class DeviceLayerTap:
    """The target backend, keeping the drafter's layer rows of every forward on the device; after
    each full forward the drafter's context pass is queued on the target's stream. take_hidden
    hands the engine nothing (DFlash's observe has nothing to do). Everything else passes through."""

    def __init__(self, backend, model: DFlashCudaModel):
        self.inner, self.model = backend, model
        backend.keep_layer_rows(model.taps)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _context(self, batch, num_layers) -> None:
        if num_layers is None and batch.num_tokens:
            self.model.write_context(batch)

    def forward(self, batch, num_layers=None, return_hidden=False):
        out = self.inner.forward(batch, num_layers, return_hidden=return_hidden)
        self._context(batch, num_layers)
        return out

    def forward_greedy(self, batch, num_layers=None):
        ids = self.inner.forward_greedy(batch, num_layers)
        self._context(batch, num_layers)
        return ids

    def forward_device(self, batch, num_layers=None):
        logits = self.inner.forward_device(batch, num_layers)
        self._context(batch, num_layers)
        return logits

    def launch_greedy(self, batch, *args, **kwargs):
        out = self.inner.launch_greedy(batch, *args, **kwargs)
        self._context(batch, None)
        return out

    def launch_logits(self, batch, *args, **kwargs):
        out = self.inner.launch_logits(batch, *args, **kwargs)
        self._context(batch, None)
        return out

    def take_hidden(self) -> None:
        return None


# ---------------------------------------------------------------------------- the drafter
class DFlashCudaDrafter:
    """DFlashDrafter's contract with the drafter on the device. `model`: a DFlashCudaModel (or
    anything with length, block_size, num_blocks, per_pass, max_model_len, draft(plan))."""
    name = "dflash"
    needs_hidden = True
    lookup_only = False
    on_device = True           # its drafts cost no host work (spec gate: no host-draft cost)

    def __init__(self, model, cost_per_draft: float = 0.0):
        self.model, self.length = model, model.length
        self.cost_per_draft = cost_per_draft

    @classmethod
    def from_config(cls, spec, backend, model_config) -> "DFlashCudaDrafter":
        from metrale.spec.speculator import forward_share
        f, name = drafter_file(spec, model_config)
        model = DFlashCudaModel(backend, f, length=int(spec.num_drafts) + 1)
        log.info("DFlash drafter %s on the device (target layers %s, trained block %d)", name, model.target_layers,
                 model.trained_block_size)
        # one block pass a proposal: the drafter's layers and the LM head, read once for every row
        return cls(model, forward_share(model_config, f.num_layers))

    def tap(self, backend) -> DeviceLayerTap:
        return backend if isinstance(backend, DeviceLayerTap) else DeviceLayerTap(backend, self.model)

    def observe(self, scheduled, emitted, hidden) -> None:
        """Nothing to do: the tap's context pass ran after the forward."""

    def plan(self, seqs, ks: list[int]) -> BlockPlan | None:
        m = self.model
        return plan_blocks(seqs, ks, length=self.length, block_size=m.block_size, scratch_base=m.num_blocks,
                           per_pass=m.per_pass, max_model_len=m.target.max_model_len)

    def propose(self, seqs, ks: list[int]) -> list[Draft]:
        drafts = [Draft() for _ in seqs]
        plan = self.plan(seqs, ks)
        if plan is None:
            return drafts
        ids, conf = self.model.draft(plan)
        for b, (i, k) in enumerate(zip(plan.live, plan.ks)):
            drafts[i] = Draft([int(x) for x in ids[b, :k]], [float(p) for p in conf[b, :k]])
        return drafts

    def release(self, seq) -> None:
        pass


def dflash_drafter(spec, backend, model_config):
    """spec.method=dflash: the drafter on the device with a CUDA target of a dense model
    (DFlashCudaDrafter), else the NumPy drafter (DFlashDrafter: the NumPy backend only)."""
    if not device_head_possible(backend):
        return DFlashDrafter.from_config(spec, backend, model_config)
    try:
        return DFlashCudaDrafter.from_config(spec, backend, model_config)
    except HeadDoesNotFit as exc:
        raise ValueError(f"spec.method=dflash: the drafter does not fit on the device: {exc}") from exc

