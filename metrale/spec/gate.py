"""Adaptive speculation: per sequence, draft only while it pays, and re-probe after a pause.

A verify block of 1 + k tokens costs about (1 + (verify_cost + draft_cost) * k) plain decode
steps (verify_cost: an extra row of the target's forward, cheap on a memory-bound GPU, dearer on
a CPU; draft_cost: the drafter's own work per token, e.g. its share of the target's layers) and
yields accepted + 1 tokens. With an exponential average `ema` of accepted tokens per verify, the
expected gain is (ema + 1) / (1 + (verify_cost + draft_cost) * k); below 1 the sequence is
suspended for `probe_interval` steps (doubling while probes keep losing), then tries again. The draft count follows ema (one more than is usually accepted). A batch of
more than `max_batch` decoding sequences turns speculation off for the step: verify rows then
cost as much as real rows.

A guard on top, because the constant cost model is only a prior: a batch-level gate measured on the running engine: the wall time between steps (begin_step to
  begin_step, so drafting, forward and acceptance all count) is averaged per batch-size bucket for
  plain steps and for steps with verify blocks, with the tokens the latter emitted per sequence.
  When speculation's measured rate, (1 + accepted per sequence) / t_spec, falls below plain
  decoding's, 1 / t_plain, speculation pauses for the whole batch for probe_interval steps (doubling
  while probes keep losing, at most 16x), then one step probes again. A bucket that has verify
  steps but no plain one runs a plain step to measure it. This catches what a per-token constant
  cannot: a CPU where every verify row costs a real row, or a GPU whose verify steps run eagerly
  while plain decode replays a CUDA graph. Only steady steps count (as many decoding sequences at
  both ends of the interval); a sample above 4x the bucket's average is clipped (idle gaps).
"""
from __future__ import annotations

import logging
import math
import time
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


@dataclass
class BucketTiming:
    """Measured step times of one batch-size bucket (seconds, exponential averages)."""
    plain_s: float | None = None
    spec_s: float | None = None
    spec_tokens: float = 1.0          # tokens emitted per decoding sequence in a verify step
    spec_steps: int = 0
    paused_until: int = 0
    backoff: int = 1
    probing: bool = False             # the next verify step is a probe after a pause

    def rate_ratio(self) -> float | None:
        """Speculation's measured rate over plain decoding's (None until both are measured)."""
        if self.plain_s is None or self.spec_s is None:
            return None
        return (self.spec_tokens / self.spec_s) / (1.0 / self.plain_s)


def _bucket(n: int) -> int:
    return n if n <= 4 else 1 << (n - 1).bit_length()


class AdaptiveGate:
    def __init__(self, num_drafts: int, *, verify_cost: float = 0.1, draft_cost: float = 0.0,
                 probe_interval: int = 16, max_batch: int = 64, ema_decay: float = 0.7,
                 measure: bool = True, clock=time.perf_counter):
        self.num_drafts, self.verify_cost, self.draft_cost = num_drafts, verify_cost, draft_cost
        self.probe_interval, self.max_batch, self.decay = probe_interval, max_batch, ema_decay
        self.stats: dict[str, SeqSpecStats] = {}
        self.step = 0
        self._warned_batch = False
        self.measure, self.clock = measure, clock
        self.timing: dict[int, BucketTiming] = {}
        self._t: float | None = None              # when the current step began
        self._n = 0                               # its decoding sequences
        self._verified = False                    # whether it verified drafts
        self._accepted = 0                        # draft tokens it accepted
        self._warned_measured = False

    def begin_step(self, num_decoding: int) -> bool:
        """False when speculation does not pay for this step's batch: too large a batch (logged
        once) or a measured loss at this batch size (see the module doc)."""
        self.step += 1
        if self.measure:
            self._time_step(num_decoding)
        if num_decoding > self.max_batch:
            if not self._warned_batch:
                log.info("speculation off while more than %d sequences decode (levers.spec_max_batch)",
                         self.max_batch)
                self._warned_batch = True
            return False
        if self.measure and num_decoding:
            return self._measured_go(self.timing.setdefault(_bucket(num_decoding), BucketTiming()))
        return True

    def _time_step(self, num_decoding: int) -> None:
        now = self.clock()
        if self._t is not None and self._n and self._n == num_decoding:
            b = self.timing.setdefault(_bucket(self._n), BucketTiming())
            dt = now - self._t
            if self._verified:
                tokens = 1.0 + self._accepted / self._n
                if b.spec_steps == 0 or b.probing:       # a probe measures afresh: things may have changed
                    b.spec_s, b.spec_tokens, b.probing = dt, tokens, False
                else:
                    b.spec_s = self._avg(b.spec_s, dt)
                    b.spec_tokens = self.decay * b.spec_tokens + (1 - self.decay) * tokens
                b.spec_steps += 1
            else:
                b.plain_s = self._avg(b.plain_s, dt)
        self._t, self._n, self._verified, self._accepted = now, num_decoding, False, 0

    def _avg(self, old: float | None, x: float) -> float:
        if old is None:
            return x
        return self.decay * old + (1 - self.decay) * min(x, 4.0 * old)

    def _measured_go(self, b: BucketTiming) -> bool:
        if self.step < b.paused_until:
            return False
        if b.spec_s is not None and b.plain_s is None:
            return False                          # measure a plain step of this size first
        ratio = b.rate_ratio()
        if ratio is None or b.spec_steps < 2 or ratio >= 1.0:
            if ratio is not None and ratio >= 1.0:
                b.backoff = 1
            return True
        if not self._warned_measured:
            log.info("speculation paused: measured %.2fx of plain decode's rate at batch %d", ratio,
                     self._n)
            self._warned_measured = True
        b.paused_until = self.step + self.probe_interval * b.backoff
        b.backoff = min(16, b.backoff * 2)
        b.spec_steps = 1                          # the probe after the pause decides again
        b.probing = True
        return False

    def _stats(self, request_id: str) -> SeqSpecStats:
        return self.stats.setdefault(request_id, SeqSpecStats(ema=1.0))

    def drafts_for(self, request_id: str) -> int:
        """One more draft than is usually accepted (room for the average to grow), fewer while the
        cost model expects the block to lose: k drafts at ema accepted tokens gain
        (min(ema, k) + 1) / (1 + c k), c the per-token verify + draft cost (CPU self-drafting,
        c ~ 0.8: a probe drafts 1 token instead of 2, so a losing probe costs half as much)."""
        st = self._stats(request_id)
        if self.step < st.suspended_until:
            return 0
        k = max(1, min(self.num_drafts, math.ceil(st.ema) + 1))
        c = self.verify_cost + self.draft_cost
        while k > 1 and (min(st.ema, k) + 1) / (1 + c * k) < 1.0:
            k -= 1
        return k

    def update(self, request_id: str, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self._verified = True
        self._accepted += accepted
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
