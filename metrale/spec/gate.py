"""Adaptive speculation: per sequence, draft only while it pays, and re-probe after a pause.

A verify block of 1 + k tokens costs about (1 + (verify_cost + draft_cost) * k) plain decode
steps (verify_cost: an extra row of the target's forward, cheap on a memory-bound GPU, dearer on
a CPU; draft_cost: the drafter's own work per token, e.g. its share of the target's layers) and
yields accepted + 1 tokens. With an exponential average `ema` of accepted tokens per verify, the
expected gain is (ema + 1) / (1 + (verify_cost + draft_cost) * k); below 1 the sequence is
suspended for `probe_interval` steps (doubling while probes keep losing), then tries again. The draft count follows ema (one more than is usually accepted). A batch of
more than `max_batch` decoding sequences turns speculation off for the step: verify rows then
cost as much as real rows.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

log = logging.getLogger("metrale.spec")


@dataclass
class SeqSpecStats:
    ema: float
    suspended_until: int = 0
    proposed: int = 0
    accepted: int = 0
    verifies: int = 0
    backoff: int = 1          # the next suspension lasts probe_interval * backoff steps


class AdaptiveGate:
    def __init__(self, num_drafts: int, *, verify_cost: float = 0.1, draft_cost: float = 0.0,
                 probe_interval: int = 16, max_batch: int = 64, ema_decay: float = 0.7):
        self.num_drafts, self.verify_cost, self.draft_cost = num_drafts, verify_cost, draft_cost
        self.probe_interval, self.max_batch, self.decay = probe_interval, max_batch, ema_decay
        self.stats: dict[str, SeqSpecStats] = {}
        self.step = 0
        self._warned_batch = False

    def begin_step(self, num_decoding: int) -> bool:
        """False when the batch is too large for speculation to pay (logged once)."""
        self.step += 1
        if num_decoding > self.max_batch:
            if not self._warned_batch:
                log.info("speculation off while more than %d sequences decode (levers.spec_max_batch)",
                         self.max_batch)
                self._warned_batch = True
            return False
        return True

    def _stats(self, request_id: str) -> SeqSpecStats:
        return self.stats.setdefault(request_id, SeqSpecStats(ema=1.0))

    def drafts_for(self, request_id: str) -> int:
        st = self._stats(request_id)
        if self.step < st.suspended_until:
            return 0
        return max(1, min(self.num_drafts, math.ceil(st.ema) + 1))

    def update(self, request_id: str, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        st = self._stats(request_id)
        st.proposed += proposed
        st.accepted += accepted
        st.verifies += 1
        st.ema = self.decay * st.ema + (1 - self.decay) * accepted
        gain = (st.ema + 1) / (1 + (self.verify_cost + self.draft_cost) * proposed)
        if gain < 1.0:
            # suspend; each losing probe in a row doubles the pause (at most 16x), so a sequence
            # that never gains costs a few verifies per 16 * probe_interval steps
            st.suspended_until = self.step + self.probe_interval * st.backoff
            st.backoff = min(16, st.backoff * 2)
            st.ema = 0.5                                   # the probe starts mildly doubtful
        elif accepted:
            st.backoff = 1

    def release(self, request_id: str) -> None:
        self.stats.pop(request_id, None)

    def acceptance(self) -> float:
        p = sum(s.proposed for s in self.stats.values())
        return sum(s.accepted for s in self.stats.values()) / p if p else 0.0
