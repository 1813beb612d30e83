"""Device state pool of hybrid (Gated DeltaNet) models: the CUDA twin of models/hybrid.py's
HostStatePool, with the same interface the engine and cache/state_slots.py use (`num_slots`,
`num_checkpoints`, `max_trail`, `snapshot_base`, `reserve`, `copy_state`, `replay`,
`take_staged`, `store_snapshot`, `nbytes`, `bytes_per_state`).

Memory: a sub-arena of the backend's activations region (budgeted up front from the config, so
the KV pool never takes it), carved by `reserve` into
  conv [ids, L, conv_dim, K-1] and ssm [ids, L, nv, dk, dv] f32, ids = slots | checkpoints |
  snapshots | staging (states staged at snapshot boundaries inside prefill segments), so one id's
  state is two contiguous blocks (a copy is two cuMemcpyDtoDAsync);
  trail_x [L, checkpoints, max_trail, conv_dim] and trail_ba [L, checkpoints, max_trail, 2nv];
  step metadata (slots, trail ids, split passes) and replay metadata (a ring), int32.
Per-layer views (conv[:, l], ssm[:, l], ...) are made once per layout, so a captured decode
graph keeps valid pointers; a `reserve` that changes the layout calls `on_realloc` (the backend
drops its graphs).
Streams: everything runs on the backend's stream except checkpoint copies (slot -> checkpoint
before a verify block), which go on a second stream: it waits for the main stream's work queued
so far (an event), and the main stream waits for it (another event) before the next operation
that reads or writes a state (the next forward, a replay, a snapshot copy). The copies overlap
the host's batch building, the metadata upload and other streams' work (a draft model's forward);
not the verify forward, which overwrites the slot the copy reads.
Token counters (host, per id) make a segment that does not continue its slot an error, as on
the NumPy backend. A segment with slot -1 is skipped by the kernels: allowed only for one-token
segments at position 0 (the backend's graph warm-up); the engine gives every segment a slot.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kernels_numba.gdn import causal_conv1d, gdn_recurrent, state_norm_clamp
from metrale.cache.kinds import CacheKind
from metrale.models.config import ModelConfig
from metrale.options import StateOptions

from .errors import cu
from .pool import Arena, align_up
from .stream import Event, Stream

REPLAY_RING = 64          # replay metadata entries before the ring wraps (the stream is synced then)


def _ptr(array) -> int:
    return array.__cuda_array_interface__["data"][0]


@dataclass
class Reservation:
    """The id and trail layout of a pool: what `reserve` sets."""
    num_checkpoints: int = 0
    max_trail: int = 16
    num_snapshots: int = 0
    snapshot_every: int = 0
    num_staging: int = 0


def staging_for(max_tokens: int, snapshot_every: int) -> int:
    """Staging states a step may fill: one per snapshot boundary in its prefill tokens, plus a few
    for boundaries that segments reach unaligned. Boundaries past this are not staged (fewer
    snapshots, never a wrong one)."""
    return max_tokens // snapshot_every + 4 if snapshot_every > 0 else 0


def state_floats(config: ModelConfig) -> tuple[int, int]:
    """(conv, ssm) float32 counts of one id's state over all GDN layers."""
    c, L = config, config.num_state_layers
    return (L * c.linear_conv_dim * (c.linear_conv_kernel_dim - 1),
            L * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim)


def pool_bytes(config: ModelConfig, num_slots: int, r: Reservation, max_seqs: int, max_tokens: int) -> int:
    """Device bytes of a pool of this layout (what `reserve` carves; the backend budgets it)."""
    c, L = config, config.num_state_layers
    conv, ssm = state_floats(c)
    ids = num_slots + r.num_checkpoints + r.num_snapshots + r.num_staging
    trail = L * r.num_checkpoints * r.max_trail * (c.linear_conv_dim + 2 * c.linear_num_value_heads)
    scratch = r.max_trail * (c.linear_conv_dim + c.linear_value_dim)
    meta = _meta_ints(max_seqs, max_tokens, r) + REPLAY_RING * (3 + r.max_trail + 32)
    return 4 * (ids * (conv + ssm) + trail + scratch + 2 * meta) + 16 * 256


def _meta_ints(max_seqs: int, max_tokens: int, r: Reservation) -> int:
    passes = max_tokens // r.snapshot_every + 2 if r.snapshot_every > 0 else 0
    return 2 * align_up(max_seqs, 32) + passes * align_up(4 * max_seqs + 1, 32)


@dataclass
class Pass:
    """One run of the GDN kernels over (part of) the step: entries (seq_query_start, state_slots)
    and the states to stage after it, (slot, staging id). A step runs one pass over its own
    metadata unless prefix caching splits prefill segments at snapshot boundaries."""
    seq_query_start: object
    state_slots: object
    stage: list[tuple[int, int]] = field(default_factory=list)


def split_passes(starts: np.ndarray, positions: np.ndarray, slots: np.ndarray, checkpoints: np.ndarray,
                 every: int) -> list[list[tuple[int, int]]]:
    """Per segment, its pieces as flat token ranges [(a, b), ...]: split at every multiple of
    `every` positions inside prefill segments (not verify blocks, not one-token rows), as
    HostStatePool.gated_delta_net does; one piece otherwise. Pass k runs every segment's piece k."""
    out = []
    for s in range(len(slots)):
        a, b = int(starts[s]), int(starts[s + 1])
        start, n = int(positions[a]) if b > a else 0, b - a
        if every <= 0 or checkpoints[s] >= 0 or slots[s] < 0 or n < 2 or (start + n) // every == start // every:
            out.append([(a, b)])
            continue
        cuts = list(range((start // every + 1) * every, start + n + 1, every))
        if cuts[-1] < start + n:
            cuts.append(start + n)
        lo, pieces = start, []
        for hi in cuts:
            pieces.append((a + lo - start, a + hi - start))
            lo = hi
        out.append(pieces)
    return out


def pass_arrays(pieces: list[list[tuple[int, int]]], slots: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(seq_query_start [2S+1], state_slots [2S]) of pass k: entry 2s is segment s's piece k (or
    an empty entry, slot -1), entry 2s+1 the gap up to the next entry (slot -1)."""
    S = len(pieces)
    starts = np.zeros(2 * S + 1, np.int32)
    out_slots = np.full(2 * S, -1, np.int32)
    for s, segment in enumerate(pieces):
        if k < len(segment):
            a, b = segment[k]
            out_slots[2 * s] = slots[s]
        else:
            a = b = segment[-1][1]
        starts[2 * s], starts[2 * s + 1] = a, b
    starts[2 * S] = starts[2 * S - 1]
    return starts, out_slots


class DeviceStatePool(CacheKind):
    """The CUDA backend's STATE cache kind (metrale.cache.kinds): fixed_bytes is the budget of the
    pool the engine will reserve, carved from the activations region by allocate."""
    paged = False

    @classmethod
    def fixed_bytes(cls, backend) -> int:
        return cls._budget(backend, backend.num_state_slots)[0] + 4096     # + the sub-arena's alignment

    @classmethod
    def _budget(cls, backend, n: int) -> tuple[int, Reservation]:
        return budget(backend.config, backend.cfg, n, backend.max_seqs, backend.max_tokens, backend.block_size)

    @classmethod
    def allocate(cls, backend, n: int) -> "DeviceStatePool":
        """n slots in a sub-arena of the activations region, reserved up front for the checkpoints and
        snapshots the engine will ask for; a later re-carve drops the backend's graphs."""
        nbytes, r = cls._budget(backend, n)
        arena = Arena("states", backend.pool["activations"].reserve(nbytes), nbytes, backend.pool._make_array)
        pool = cls(backend.config, backend.weights, arena, backend.stream, num_slots=n, max_seqs=backend.max_seqs,
                   max_tokens=backend.max_tokens, state_norm_bound=StateOptions.of(backend.cfg).norm_bound)
        pool.reserve(num_checkpoints=r.num_checkpoints, max_trail=r.max_trail, num_snapshots=r.num_snapshots,
                     snapshot_every=r.snapshot_every)
        pool.on_realloc = backend.drop_graphs
        return pool

    def __init__(self, config: ModelConfig, weights: dict, arena: Arena, stream: Stream, *, num_slots: int,
                 max_seqs: int, max_tokens: int, chunk: int = 64, state_norm_bound: float = 0.0):
        if num_slots < 1:
            raise ValueError(f"need num_slots >= 1, got {num_slots}")
        self.config, self.arena, self.stream = config, arena, stream
        self.num_slots, self.max_seqs, self.max_tokens = num_slots, max_seqs, max_tokens
        self.chunk, self.state_norm_bound = chunk, float(state_norm_bound)
        self.copy_stream = Stream()
        self._main_mark, self._copies_done = Event(timing=False), Event(timing=False)
        self._copies_pending = False
        self.on_realloc: Callable[[], None] | None = None
        linear = [i for i in range(config.num_layers) if config.is_linear_layer(i)]
        self.layer_weights = [tuple(weights[f"layers.{i}.{n}"] for n in ("lin_conv", "lin_a_log", "lin_dt_bias"))
                              for i in linear]
        self.r: Reservation | None = None
        self.staged: dict[tuple[int, int], int] = {}
        self.passes: list[Pass] = []
        self.reserve(num_checkpoints=0)

    # ------------------------------------------------------------------ layout
    @property
    def num_checkpoints(self) -> int:
        return self.r.num_checkpoints

    @property
    def max_trail(self) -> int:
        return self.r.max_trail

    @property
    def num_snapshots(self) -> int:
        return self.r.num_snapshots

    @property
    def snapshot_every(self) -> int:
        return self.r.snapshot_every

    @property
    def snapshot_base(self) -> int:
        return self.num_slots + self.r.num_checkpoints

    @property
    def staging_base(self) -> int:
        return self.snapshot_base + self.r.num_snapshots

    @property
    def nbytes(self) -> int:
        return self.arena.used

    @property
    def bytes_per_state(self) -> int:
        return 4 * sum(state_floats(self.config))

    def reserve(self, *, num_checkpoints: int | None = None, max_trail: int | None = None,
                num_snapshots: int | None = None, snapshot_every: int | None = None) -> None:
        """HostStatePool.reserve: resize the checkpoint and snapshot parts. A request equal to the
        current layout does nothing; another one re-carves the arena (slot states are kept) and
        calls on_realloc, since captured graphs hold the old pointers."""
        old = self.r
        r = Reservation(num_checkpoints=old.num_checkpoints if old and num_checkpoints is None else int(num_checkpoints or 0),
                        max_trail=old.max_trail if old and max_trail is None else int(max_trail or 16),
                        num_snapshots=old.num_snapshots if old and num_snapshots is None else int(num_snapshots or 0),
                        snapshot_every=old.snapshot_every if old and snapshot_every is None else int(snapshot_every or 0))
        if r.num_checkpoints < 0 or r.num_snapshots < 0 or r.max_trail < 1:
            raise ValueError(f"need num_checkpoints >= 0, num_snapshots >= 0, max_trail >= 1; got "
                             f"{r.num_checkpoints}, {r.num_snapshots}, {r.max_trail}")
        r.num_staging = staging_for(self.max_tokens, r.snapshot_every) if r.num_snapshots else 0
        if r == old:
            return
        need = pool_bytes(self.config, self.num_slots, r, self.max_seqs, self.max_tokens)
        if need > self.arena.capacity:
            raise MemoryError(f"the recurrent-state pool needs {need / 2**20:.1f} MiB for {self.num_slots} slots, "
                              f"{r.num_checkpoints} checkpoints x {r.max_trail} trail tokens, {r.num_snapshots} "
                              f"snapshots and {r.num_staging} staging states; the backend budgeted "
                              f"{self.arena.capacity / 2**20:.1f} MiB from the config (lower state.snapshots "
                              "or scheduler.max_num_seqs)")
        kept = self.tokens[:self.num_slots].copy() if old else np.zeros(self.num_slots, np.int64)
        if old is not None:   # keep the slots' states: copy them out, re-carve, copy them back
            self.join()
            saved = [a[:self.num_slots].copy_to_host(stream=self.stream.numba) for a in (self.conv, self.ssm)]
            self.stream.synchronize()
        self.r = r
        self._carve()
        if old is not None:
            self.conv[:self.num_slots].copy_to_device(saved[0], stream=self.stream.numba)
            self.ssm[:self.num_slots].copy_to_device(saved[1], stream=self.stream.numba)
            self.stream.synchronize()
        self.tokens = np.zeros(self.staging_base + r.num_staging, np.int64)
        self.tokens[:self.num_slots] = kept
        self.trail_len = np.zeros(r.num_checkpoints, np.int64)
        self.staged = {}
        if old is not None and self.on_realloc is not None:
            self.on_realloc()

    def _carve(self) -> None:
        c, r, L, a = self.config, self.r, self.config.num_state_layers, self.arena
        a.reset()
        ids = self.staging_base + r.num_staging
        nv, cd = c.linear_num_value_heads, c.linear_conv_dim
        self.conv = a.alloc((ids, L, cd, c.linear_conv_kernel_dim - 1), np.float32)
        self.ssm = a.alloc((ids, L, nv, c.linear_key_head_dim, c.linear_value_head_dim), np.float32)
        self.trail_x = a.alloc((L, r.num_checkpoints, r.max_trail, cd), np.float32)
        self.trail_ba = a.alloc((L, r.num_checkpoints, r.max_trail, 2 * nv), np.float32)
        self.scratch_conv = a.alloc((r.max_trail, cd), np.float32)
        self.scratch_o = a.alloc((r.max_trail, c.linear_value_dim), np.float32)
        n_meta = _meta_ints(self.max_seqs, self.max_tokens, r)
        self.meta = a.alloc(n_meta, np.int32)
        from numba import cuda
        self.meta_host = cuda.pinned_array(n_meta, dtype=np.int32)
        ring = 3 + r.max_trail + 32
        self.replay_meta = a.alloc((REPLAY_RING, ring), np.int32)
        self.replay_host = cuda.pinned_array((REPLAY_RING, ring), dtype=np.int32)
        self._ring = 0
        self.conv_layers = [self.conv[:, i] for i in range(L)]
        self.ssm_layers = [self.ssm[:, i] for i in range(L)]
        self.trail_x_layers = [self.trail_x[i] for i in range(L)]
        self.trail_ba_layers = [self.trail_ba[i] for i in range(L)]
        m = align_up(self.max_seqs, 32)
        self.slots_dev, self.trail_ids_dev = self.meta[:m], self.meta[m:2 * m]

    # ------------------------------------------------------------------ streams
    def join(self) -> None:
        """The main stream waits for the checkpoint copies issued so far."""
        if self._copies_pending:
            self._copies_done.record(self.copy_stream)
            self.stream.wait_event(self._copies_done)
            self._copies_pending = False

    def _copy_id(self, src: int, dst: int, stream: Stream) -> None:
        for a in (self.conv, self.ssm):
            cu("cuMemcpyDtoDAsync", _ptr(a[dst]), _ptr(a[src]), a[src].nbytes, stream.handle)

    def copy_state(self, src: int, dst: int) -> None:
        ids = self.staging_base + self.r.num_staging
        if not (0 <= src < ids and 0 <= dst < ids):
            raise ValueError(f"state ids {src} -> {dst} outside 0..{ids - 1}")
        if self.num_slots <= dst < self.snapshot_base:      # a checkpoint before a verify block
            if not self._copies_pending:
                self._main_mark.record(self.stream)
                self.copy_stream.wait_event(self._main_mark)
                self._copies_pending = True
            self._copy_id(src, dst, self.copy_stream)
            self.trail_len[dst - self.num_slots] = 0
        else:
            self.join()
            self._copy_id(src, dst, self.stream)
        self.tokens[dst] = self.tokens[src]

    def copy_layer(self, layer: int, src: int, dst: int) -> None:
        """One GDN layer's state src -> dst on the main stream (staging inside a forward)."""
        for a in (self.conv_layers[layer], self.ssm_layers[layer]):
            cu("cuMemcpyDtoDAsync", _ptr(a[dst]), _ptr(a[src]), a[src].nbytes, self.stream.handle)

    def take_staged(self) -> dict[tuple[int, int], int]:
        staged, self.staged = self.staged, {}
        return staged

    def store_snapshot(self, staged_id: int, snapshot: int) -> None:
        if not self.snapshot_base <= snapshot < self.staging_base:
            raise ValueError(f"{snapshot} is not a snapshot id")
        self.copy_state(int(staged_id), snapshot)

    # ------------------------------------------------------------------ forward
    def before_forward(self, batch, seqs: int, graphed: bool) -> None:
        """Check and advance the token counters, lay out the GDN metadata of the step (slots and
        trail ids padded to `seqs` with -1; split passes when prefix caching stages snapshots),
        upload it on the main stream, and order the main stream after the checkpoint copies."""
        S, starts, pos = batch.num_seqs, batch.seq_query_start, batch.positions
        slots = batch.state_slots if batch.state_slots is not None else np.full(S, -1, np.int32)
        ckpts = batch.state_checkpoints if batch.state_checkpoints is not None else np.full(S, -1, np.int32)
        trail_ids = np.full(seqs, -1, np.int32)
        for s in range(S):
            a, b = int(starts[s]), int(starts[s + 1])
            slot, start, n, ck = int(slots[s]), int(pos[a]), b - a, int(ckpts[s])
            if slot < 0:
                if n == 1 and start == 0:
                    continue
                raise ValueError("every segment of a hybrid model's batch needs a state slot (Segment.state_slot)")
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"state slot {slot} outside 0..{self.num_slots - 1}")
            if start and self.tokens[slot] != start:
                raise ValueError(f"state slot {slot} holds {int(self.tokens[slot])} tokens but the segment starts at "
                                 f"position {start} (a missed rollback, or prefix caching without a state snapshot)")
            if ck >= 0:
                ci = ck - self.num_slots
                if not 0 <= ci < self.r.num_checkpoints or n > self.r.max_trail or n >= self.chunk:
                    raise ValueError(f"checkpoint {ck} cannot record a block of {n} tokens (ids {self.num_slots}.."
                                     f"{self.snapshot_base - 1}, at most {min(self.r.max_trail, self.chunk - 1)} tokens)")
                if self.tokens[ck] != start:
                    raise ValueError(f"checkpoint {ck} holds {int(self.tokens[ck])} tokens, the block starts at {start}")
                trail_ids[s], self.trail_len[ci] = ci, n
            self.tokens[slot] = start + n
        host, m = self.meta_host, align_up(self.max_seqs, 32)
        host[:S] = slots
        host[S:seqs] = -1
        host[m:m + seqs] = trail_ids
        used = m + seqs
        self.passes, self.staged = [], {}
        pieces = split_passes(starts, pos, slots, ckpts, 0 if graphed else self.r.snapshot_every)
        if max(len(p) for p in pieces) > 1:
            used = self._lay_out_passes(pieces, slots, pos, 2 * m)
        self.join()
        cu("cuMemcpyHtoDAsync", _ptr(self.meta), host.ctypes.data, used * 4, self.stream.handle)

    def _lay_out_passes(self, pieces, slots: np.ndarray, positions: np.ndarray, offset: int) -> int:
        """Write each pass's metadata after the step's own; stage the state after every piece
        that ends on a snapshot boundary (while staging ids last). Returns the ints used."""
        every, stride = self.r.snapshot_every, align_up(4 * self.max_seqs + 1, 32)
        free = list(range(self.staging_base, self.staging_base + self.r.num_staging))
        for k in range(max(len(p) for p in pieces)):
            sqs, sl = pass_arrays(pieces, slots, k)
            o = offset + k * stride
            S2 = len(sl)
            self.meta_host[o:o + S2 + 1] = sqs
            self.meta_host[o + S2 + 1:o + 2 * S2 + 1] = sl
            stage = []
            for s, segment in enumerate(pieces):
                if k < len(segment) and len(segment) > 1:
                    a, b = segment[k]
                    end = int(positions[a]) + b - a
                    if end % every == 0 and free:
                        sid = free.pop(0)
                        stage.append((int(slots[s]), sid))
                        self.staged[(int(slots[s]), end)] = sid
                        self.tokens[sid] = end
            self.passes.append(Pass(self.meta[o:o + S2 + 1], self.meta[o + S2 + 1:o + 2 * S2 + 1], stage))
        return offset + len(self.passes) * stride

    def step_slots(self, seqs: int):
        """The device views of the step's slots and trail ids (graph-safe: fixed addresses)."""
        return self.slots_dev[:seqs], self.trail_ids_dev[:seqs]

    # ------------------------------------------------------------------ rollback
    def replay(self, slot: int, ckpt: int, num_tokens: int) -> None:
        """Fold the first num_tokens recorded tokens of ckpt's trail into slot (which holds the
        checkpointed state): conv + recurrent delta rule per GDN layer, outputs discarded."""
        ci = ckpt - self.num_slots
        if not 0 <= ci < self.r.num_checkpoints or num_tokens > self.trail_len[ci]:
            raise ValueError(f"checkpoint {ckpt} recorded {int(self.trail_len[ci]) if 0 <= ci < len(self.trail_len) else 0} "
                             f"tokens, cannot replay {num_tokens}")
        if num_tokens <= 0:
            return
        self.join()
        if self._ring == REPLAY_RING:         # the ring's host rows may still be in flight
            self.stream.synchronize()
            self._ring = 0
        row, start, n = self._ring, int(self.tokens[slot]), num_tokens
        self._ring += 1
        h = self.replay_host[row]
        h[0], h[1], h[2] = 0, n, slot
        h[3:3 + n] = np.arange(start, start + n, dtype=np.int32)
        cu("cuMemcpyHtoDAsync", _ptr(self.replay_meta[row]), h.ctypes.data, (3 + n) * 4, self.stream.handle)
        d = self.replay_meta[row]
        sqs, sl, positions = d[0:2], d[2:3], d[3:3 + n]
        s = self.stream.numba
        for layer, (conv_w, a_log, dt_bias) in enumerate(self.layer_weights):
            causal_conv1d(self.trail_x[layer, ci, :n], conv_w, self.conv_layers[layer], sqs, sl, positions,
                          self.scratch_conv[:n], stream=s)
            gdn_recurrent(self.scratch_conv[:n], self.trail_ba[layer, ci, :n], a_log, dt_bias, self.ssm_layers[layer],
                          sqs, sl, positions, self.scratch_o[:n], stream=s)
            if self.state_norm_bound > 0:
                state_norm_clamp(self.ssm_layers[layer], sl, self.state_norm_bound, stream=s)
        self.tokens[slot] = start + n

    def memory(self) -> dict:
        return {"state_pool_bytes": self.nbytes, "state_bytes_per_slot": self.bytes_per_state,
                "state_ids": self.staging_base + self.r.num_staging}


def budget(config: ModelConfig, cfg, num_slots: int, max_seqs: int, max_tokens: int, block_size: int) -> tuple[int, Reservation]:
    """(bytes, layout) of the pool the engine will reserve for this config: checkpoints when a
    drafter is configured, snapshots when prefix caching is on (Engine.__init__ does the same
    arithmetic; a larger request later fails with a message)."""
    spec_k = int(cfg.spec.num_drafts) if str(cfg.spec.method) not in ("none", "", "None") else 0
    snaps = StateOptions.of(cfg).snapshots if cfg.levers.prefix_caching else 0
    every = block_size * max(1, math.ceil(64 / block_size)) if snaps else 0
    r = Reservation(num_checkpoints=num_slots if spec_k else 0, max_trail=max(16, spec_k + 1),
                    num_snapshots=snaps, snapshot_every=every)
    r.num_staging = staging_for(max_tokens, every) if snaps else 0
    return pool_bytes(config, num_slots, r, max_seqs, max_tokens), r
