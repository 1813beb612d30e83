"""The recurrent states of a hybrid (Gated DeltaNet) model, as a step sees them: a state slot per
running sequence, a checkpoint before each verify block (rolled back to the accepted tokens after
it), and with prefix caching snapshots of the states at full-block boundaries (docs/hybrid.md).

Owns ids and bookkeeping (StateSlots, SnapshotCache); the backend's state pool owns the memory.
"""
from __future__ import annotations

import logging

from metrale.cache.block_manager import BlockManager
from metrale.cache.snapshots import SnapshotCache
from metrale.cache.state_slots import StateSlots
from metrale.scheduler.sequence import Sequence

log = logging.getLogger("metrale")


def snapshot_every(block_size: int) -> int:
    """Tokens between the snapshots taken inside a prefill segment: whole blocks, at least 64
    tokens (the chunked GDN form's chunk, so the split costs no speed)."""
    return block_size * max(1, -(-64 // block_size))


class RecurrentStates:
    def __init__(self, pool, blocks: BlockManager, *, max_num_seqs: int, spec_k: int,
                 num_snapshots: int, prefix_caching: bool):
        self.pool, self.blocks = pool, blocks
        bs = blocks.block_size
        pool.reserve(num_checkpoints=max_num_seqs if spec_k else 0,
                     max_trail=max(pool.max_trail, spec_k + 1),
                     num_snapshots=num_snapshots if prefix_caching else 0,
                     snapshot_every=snapshot_every(bs) if prefix_caching else 0)
        self.slots = StateSlots.for_store(pool)
        self.snapshots: SnapshotCache | None = None
        if prefix_caching:
            self.snapshots = SnapshotCache(num_snapshots, pool.snapshot_base)
            blocks.resume_filter = self.snapshots.resume_blocks

    def free(self, seq: Sequence) -> None:
        self.slots.free(seq)

    def slot_for(self, seq: Sequence) -> int:
        """seq's slot. A sequence that gets its slot with tokens already computed resumes from a
        prefix-cache hit: the snapshot of the last reused block (BlockManager.resume_filter
        admitted the hit only up to one) is copied in."""
        fresh = self.slots.slot(seq) < 0
        slot = self.slots.allocate(seq)
        if slot is None:   # slots are sized to max_num_seqs, so a running sequence always has one
            raise RuntimeError("no free recurrent-state slot")
        if fresh and seq.num_computed_tokens > 0:
            nblocks = seq.num_computed_tokens // self.blocks.block_size
            snapshot = self.snapshots.get(seq.block_hashes[nblocks - 1]) if self.snapshots is not None else None
            if snapshot is None:
                raise RuntimeError(f"sequence {seq.request_id} resumes at token {seq.num_computed_tokens} "
                                   "without a recurrent-state snapshot there")
            self.pool.copy_state(snapshot, slot)
        return slot

    def checkpoint(self, seq: Sequence, slot: int) -> int:
        """A checkpoint of slot before a verify block; there is one per sequence slot, so a
        speculating sequence always finds one."""
        ckpt = self.slots.checkpoint(slot)
        if ckpt is None:
            raise RuntimeError(f"no free recurrent-state checkpoint for {seq.request_id}")
        return ckpt

    def release(self, ckpt: int) -> None:
        self.slots.release(ckpt)

    def settle(self, slot: int, ckpt: int, draft_len: int, accepted: int) -> None:
        """After a verify block: keep the state after its accepted tokens."""
        if accepted == draft_len:
            self.slots.release(ckpt)
        else:
            self.slots.rollback(slot, ckpt, 1 + accepted)

    def take_snapshots(self, scheduled) -> None:
        """After a forward with prefix caching: keep the states at the full-block boundaries that
        prefill segments reached, keyed by the chained hash of the block ending there: the state the
        pool staged at every `snapshot_every` tokens inside a segment, and the slot's state when a
        prefill chunk ends on a block boundary. Call before the computed counts advance."""
        if self.snapshots is None:
            return
        staged = self.pool.take_staged()
        bs = self.blocks.block_size
        for s in scheduled:
            seq, slot = s.seq, self.slots.slot(s.seq)
            if s.draft or s.num_tokens < 2 or slot < 0:
                continue
            end = seq.num_computed_tokens + s.num_tokens
            points = sorted(p for (sl, p) in staged if sl == slot)
            if end % bs == 0 and end not in points:
                points.append(end)
            for p in points:
                h = self._prefix_hash(seq, p // bs)
                if h in self.snapshots:
                    continue
                sid = self.snapshots.put(h)
                if sid is None:
                    return
                if p == end and (slot, p) not in staged:
                    self.pool.copy_state(slot, sid)
                else:
                    self.pool.store_snapshot(staged[(slot, p)], sid)

    def _prefix_hash(self, seq: Sequence, nblocks: int) -> int:
        """The chained hash of seq's first nblocks full blocks (the block manager's hash)."""
        bs, toks = self.blocks.block_size, seq.token_ids
        if nblocks <= len(seq.block_hashes):
            return seq.block_hashes[nblocks - 1]
        h = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), nblocks):
            h = self.blocks.chain_hash(h, toks[i * bs:(i + 1) * bs])
        return h

    def check_no_leaks(self, live: list) -> None:
        self.slots.check_no_leaks(live)
        if self.snapshots is not None:
            self.snapshots.check_no_leaks()
