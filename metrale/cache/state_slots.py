"""State slots of hybrid models: one conv + recurrent state per running sequence, beside the KV
blocks, and checkpoints of those states for speculative rollback.

Owns slot and checkpoint ids only; the backend owns the memory (its `states`, the STATE cache
kind: HostStatePool or the CUDA DeviceStatePool) and does the copies and replays this manager asks for. Ids 0..num_slots-1
are sequence slots, num_slots..num_slots+num_checkpoints-1 checkpoints.
Invariants: a sequence holds at most one slot; every checkpoint belongs to one live slot and is
released with it; a slot's state is meaningful only for the tokens its owner has computed (a
segment starting at position 0 ignores the slot's old contents, so a fresh slot needs no zeroing).
Partial acceptance of a verify block: the forward records the block's inputs into the
checkpoint taken before it, and `restore(slot, ckpt, n)` copies the checkpoint back and replays
the first n recorded tokens (docs/hybrid.md says why this and not per-position states).
"""
from __future__ import annotations

from collections import deque
from typing import Hashable, Protocol


class StateStore(Protocol):
    num_slots: int
    num_checkpoints: int

    def copy_state(self, src: int, dst: int) -> None: ...
    def replay(self, slot: int, ckpt: int, num_tokens: int) -> None: ...


class StateSlots:
    def __init__(self, num_slots: int, num_checkpoints: int = 0, store: StateStore | None = None):
        if num_slots < 1 or num_checkpoints < 0:
            raise ValueError(f"need num_slots >= 1 and num_checkpoints >= 0, got {num_slots}, {num_checkpoints}")
        self.num_slots, self.num_checkpoints, self.store = num_slots, num_checkpoints, store
        self.free_slots: deque[int] = deque(range(num_slots))
        self.free_checkpoints: deque[int] = deque(range(num_slots, num_slots + num_checkpoints))
        self.owner_slot: dict[Hashable, int] = {}
        self.checkpoint_slot: dict[int, int] = {}     # checkpoint id -> the slot it was taken of

    @classmethod
    def for_store(cls, store: StateStore) -> "StateSlots":
        return cls(store.num_slots, store.num_checkpoints, store)

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def slot(self, owner: Hashable) -> int:
        """The owner's slot, or -1."""
        return self.owner_slot.get(owner, -1)

    def allocate(self, owner: Hashable) -> int | None:
        """A slot for owner (its existing one if it has one); None when all are taken."""
        if owner in self.owner_slot:
            return self.owner_slot[owner]
        if not self.free_slots:
            return None
        slot = self.free_slots.popleft()
        self.owner_slot[owner] = slot
        return slot

    def free(self, owner: Hashable) -> None:
        """On finish or preemption; releases the slot's checkpoints too. Unknown owners are ignored."""
        slot = self.owner_slot.pop(owner, None)
        if slot is None:
            return
        for ckpt in [c for c, s in self.checkpoint_slot.items() if s == slot]:
            self.release(ckpt)
        self.free_slots.appendleft(slot)

    def checkpoint(self, slot: int) -> int | None:
        """Copy slot's state into a free checkpoint; None when none is free (verify without drafts)."""
        self._check_slot(slot)
        if not self.free_checkpoints:
            return None
        ckpt = self.free_checkpoints.popleft()
        self.checkpoint_slot[ckpt] = slot
        if self.store is not None:
            self.store.copy_state(slot, ckpt)
        return ckpt

    def restore(self, slot: int, ckpt: int, num_tokens: int = 0) -> None:
        """Put the checkpointed state back into slot, then fold in the first num_tokens tokens of
        the verify block recorded after the checkpoint. The checkpoint stays valid."""
        if self.checkpoint_slot.get(ckpt) != slot:
            raise ValueError(f"checkpoint {ckpt} was not taken of slot {slot}")
        if self.store is not None:
            self.store.copy_state(ckpt, slot)
            if num_tokens:
                self.store.replay(slot, ckpt, num_tokens)

    def release(self, ckpt: int) -> None:
        if self.checkpoint_slot.pop(ckpt, None) is None:
            raise ValueError(f"checkpoint {ckpt} is not held")
        self.free_checkpoints.appendleft(ckpt)

    def rollback(self, slot: int, ckpt: int, num_tokens: int) -> None:
        """After a verify block: keep the state after its first num_tokens tokens, drop the checkpoint."""
        self.restore(slot, ckpt, num_tokens)
        self.release(ckpt)

    def _check_slot(self, slot: int) -> None:
        if slot not in self.owner_slot.values():
            raise ValueError(f"state slot {slot} is not allocated")

    def check_no_leaks(self, live: list[Hashable]) -> None:
        """Assert that the held slots are exactly the live owners' (tests and debugging)."""
        assert set(self.owner_slot) == set(live), "state slots held by owners that are not live (or missing)"
        held = set(self.owner_slot.values())
        assert len(held) == len(self.owner_slot) and held.isdisjoint(self.free_slots)
        assert len(held) + len(self.free_slots) == self.num_slots, "state slots leaked"
        assert set(self.checkpoint_slot.values()) <= held, "checkpoints of freed slots"
        assert len(self.checkpoint_slot) + len(self.free_checkpoints) == self.num_checkpoints, "checkpoints leaked"
