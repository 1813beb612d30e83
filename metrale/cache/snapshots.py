"""Prefix-cache snapshots of hybrid models' recurrent state, keyed by chained block hash.

A Gated DeltaNet layer has no per-token K/V to share: a cached prefix is only usable if the
recurrent state (conv + SSM) after it is known. A snapshot is that state at a full-block boundary,
stored under the chained hash of the block ending there (BlockManager.chain_hash), which names the
whole prefix. Owns snapshot ids and the LRU only; the backend's state pool owns the memory
(HostStatePool: ids snapshot_base..snapshot_base+capacity-1).

Snapshots are copied into a sequence's slot when it resumes (never read in place), so they need
no reference counts: any snapshot can be evicted at any time; the LRU evicts the least recently
stored or used one when a new one needs room. Invariant: every id is either held by exactly one
hash or free.
"""
from __future__ import annotations

from collections import OrderedDict


class SnapshotCache:
    def __init__(self, capacity: int, first_id: int = 0):
        if capacity < 0:
            raise ValueError(f"snapshot capacity must be >= 0, got {capacity}")
        self.capacity, self.first_id = capacity, first_id
        self.lru: OrderedDict[int, int] = OrderedDict()     # hash -> id, least recently used first
        self.free = list(range(first_id + capacity - 1, first_id - 1, -1))
        self.hits = self.stored = self.evicted = 0

    def __len__(self) -> int:
        return len(self.lru)

    def __contains__(self, h: int) -> bool:
        return h in self.lru

    def get(self, h: int) -> int | None:
        """The snapshot id of hash h (marks it used), or None."""
        sid = self.lru.get(h)
        if sid is not None:
            self.lru.move_to_end(h)
            self.hits += 1
        return sid

    def put(self, h: int) -> int | None:
        """An id to write h's snapshot into (evicting the least recently used one if full);
        None when the capacity is 0. Storing a hash already held returns its id."""
        if h in self.lru:
            self.lru.move_to_end(h)
            return self.lru[h]
        if not self.capacity:
            return None
        if self.free:
            sid = self.free.pop()
        else:
            _, sid = self.lru.popitem(last=False)
            self.evicted += 1
        self.lru[h] = sid
        self.stored += 1
        return sid

    def resume_blocks(self, hashes: list[int]) -> int:
        """How many of the leading blocks with these chained hashes a sequence can resume after:
        the last one that has a snapshot (0: none)."""
        for i in range(len(hashes), 0, -1):
            if hashes[i - 1] in self.lru:
                return i
        return 0

    def check_no_leaks(self) -> None:
        ids = list(self.lru.values())
        assert len(set(ids)) == len(ids) and set(ids).isdisjoint(self.free), "snapshot id held twice"
        assert len(ids) + len(self.free) == self.capacity, "snapshot ids leaked"
