"""Paged KV block manager with a prefix cache.

Owns block ids only (the backend owns the memory). Full blocks are identified by a chained
hash (hash of the previous block's hash and this block's tokens), so equal prefixes map to
the same blocks. Reference counts track sharing; a block whose count falls to zero stays
cached on an LRU free list until it is reused for something else.
Invariant: a shared (cached) block is never written: prefix reuse stops before the block
holding a sequence's last prompt token.
Every block table also lives as a row of `table` (an int32 array, padded with 0), changed here
with the list at each allocation and release: a step's [seqs, blocks] tables are one gather
(`tables_of`), not a Python walk over every block of every sequence.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from metrale.scheduler.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}                            # hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cache_hits = 0          # tokens served from the prefix cache
        # hybrid models: hashes of the matched leading blocks -> how many of them a sequence can
        # resume after (the last with a recurrent-state snapshot: cache/snapshots.py); None: all
        self.resume_filter = None
        self.table = np.zeros((16, 16), np.int32)      # row seq.table_row = seq.block_table, 0-padded
        self._free_rows: list[int] = list(range(15, -1, -1))

    # ------------------------------------------------------------------ the table rows
    def _append(self, seq: Sequence, block: int) -> None:
        if seq.table_row < 0:
            if not self._free_rows:
                n = self.table.shape[0]
                self.table = np.concatenate([self.table, np.zeros_like(self.table)])
                self._free_rows = list(range(2 * n - 1, n - 1, -1))
            seq.table_row = self._free_rows.pop()
        i = len(seq.block_table)
        if i >= self.table.shape[1]:
            self.table = np.concatenate([self.table, np.zeros_like(self.table)], axis=1)
        self.table[seq.table_row, i] = block
        seq.block_table.append(block)

    def tables_of(self, seqs: list[Sequence]) -> np.ndarray:
        """[len(seqs), most blocks among them] int32: their block tables, 0-padded."""
        rows = np.fromiter((s.table_row for s in seqs), dtype=np.int64, count=len(seqs))
        width = max(max(len(s.block_table) for s in seqs), 1)
        return self.table[rows, :width]

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.hash_of[block]
        if old is not None:  # evict: this cached block now holds other tokens
            if self.cached.get(old) == block:
                del self.cached[old]
            self.hash_of[block] = None
        self.ref_count[block] = 1
        return block

    @staticmethod
    def chain_hash(prev: int | None, tokens: list[int]) -> int:
        return hash((prev, tuple(tokens)))

    def allocate_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks matching seq's leading full blocks; returns tokens reused."""
        assert not seq.block_table, "allocate_prefix on a sequence that already holds blocks"
        if not self.prefix_caching:
            return 0
        tokens, bs = seq.token_ids, self.block_size
        prev = None
        matched: list[tuple[int, int]] = []
        for i in range((len(tokens) - 1) // bs):   # never the block holding the last token
            h = self.chain_hash(prev, tokens[i * bs:(i + 1) * bs])
            block = self.cached.get(h)
            if block is None:
                break
            matched.append((h, block))
            prev = h
        if self.resume_filter is not None and matched:
            matched = matched[:self.resume_filter([h for h, _ in matched])]
        for h, block in matched:
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1
            self._append(seq, block)
            seq.block_hashes.append(h)
        reused = len(seq.block_table) * bs
        seq.num_computed_tokens = reused
        self.cache_hits += reused
        return reused

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Ensure seq's table covers num_tokens positions; False (and no change) if blocks run out."""
        if not self.can_grow(seq, num_tokens):
            return False
        while len(seq.block_table) < self.blocks_needed(num_tokens):
            self._append(seq, self._take_free())
        return True

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's tokens (those a rejected draft used)."""
        keep = self.blocks_needed(seq.num_tokens)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self.table[seq.table_row, len(seq.block_table)] = 0
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None
                self.free.move_to_end(block, last=False)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that the computed tokens have filled, so later prompts can share them."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        if full <= len(seq.block_hashes):        # the common decode step: no block filled (O(1))
            return
        prev = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), full):
            h = self.chain_hash(prev, seq.token_slice(i * bs, (i + 1) * bs))
            block = seq.block_table[i]
            if h not in self.cached:
                self.cached[h] = block
                self.hash_of[block] = h
            seq.block_hashes.append(h)
            prev = h

    def release(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, f"block {block} released twice"
            if self.ref_count[block] == 0:
                self.free[block] = None
                if self.hash_of[block] is None:     # nothing worth keeping: reuse it first
                    self.free.move_to_end(block, last=False)
        if seq.table_row >= 0:
            self.table[seq.table_row, :len(seq.block_table)] = 0
            self._free_rows.append(seq.table_row)
            seq.table_row = -1
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0

    def check_no_leaks(self, live: list[Sequence]) -> None:
        """Assert that reference counts equal the live sequences' holdings (tests and debugging)."""
        expected = [0] * self.num_blocks
        for seq in live:
            for b in seq.block_table:
                expected[b] += 1
        assert expected == self.ref_count, "block reference counts do not match live sequences"
        holding = [seq for seq in live if seq.block_table]
        for seq in holding:                       # each live table's row holds it, 0-padded
            row = self.table[seq.table_row]
            assert seq.table_row >= 0 and row[:len(seq.block_table)].tolist() == seq.block_table, seq.request_id
            assert not row[len(seq.block_table):].any(), seq.request_id
        assert len(self._free_rows) == self.table.shape[0] - len(holding) and not self.table[self._free_rows].any()
        assert all((self.ref_count[b] == 0) == (b in self.free) for b in range(self.num_blocks))
