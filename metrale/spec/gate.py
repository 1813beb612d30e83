"""Adaptive speculation: per sequence, draft only while it pays, and re-probe after a pause.

The cost model, in plain decode steps of the current batch (per sequence):
  a verify block with k drafts costs  1 + F + (v + d) k + D  and yields  1 + acc(alpha, k)  tokens,
  acc(alpha, k) = alpha + alpha^2 + ... + alpha^k (drafts stop at the first rejection), where
  - v: one verified draft row; F: a fixed cost of verifying at all. Constant per token (v =
    verify_cost, F = 0) unless a row model is given (CPU, NumPy/OpenBLAS: a forward of M >= 2 rows
    costs step_fixed + row_cost * M one-row steps while one row costs 1, because a 2-row GEMM costs
    ~2.5 one-row GEMVs): at batch 1, F = step_fixed + row_cost - 1 and v = row_cost; at batch B >= 2,
    F = 0 and v = row_cost * B / (step_fixed + row_cost * B);
  - d, D: the drafter's own cost per draft token and per proposal (model drafters);
  - alpha: the sequence's per-token acceptance, from pseudo-counts that start at the drafter's prior
    (optimistic for n-gram, whose drafts come from a match; pessimistic for model drafters). The
    counts are a Beta posterior: hits of trials, standard deviation sqrt(alpha (1 - alpha) / (trials + 1)).
The gate exploits on a lower confidence bound and explores through budgeted probes: the draft
count maximizes the expected gain (1 + acc) / cost at alpha_low = alpha - caution x that standard
deviation (the prior alone, 2 pseudo-tokens, is far from certain: n-gram's 0.8 acts as 0.57; a
sequence's own verifies narrow it). A sequence whose best gain at alpha_low is under min_gain
(>= 1: a margin for the cost model's error) drafts only as a probe, and probes are budgeted: the cost model's loss of a probe that
accepts nothing (cost - 1 steps) may add up to at most probe_budget x the tokens the request may
decode (elapsed + max_tokens left); a verify after which even the mean alpha loses suspends the
sequence for probe_interval steps (doubling while probes keep losing). A batch size at which no
draft count could pay even with every draft accepted does not speculate at all (logged once). A
batch of more than `max_batch` decoding sequences turns speculation off for the step.

Shadow drafts (`shadow`, for drafters whose drafting is free: n-gram): a sequence the gate would
not verify for still gets a draft, kept on the host and never verified; the tokens the sequence
then emits say how much of it a verify would have accepted (the greedy match; for a sampled row the
chance that the sampled token is the draft token is p(draft), the acceptance of rejection sampling
with a one-hot draft), and `observe_shadow` counts that as evidence like a verify. So a free
drafter never probes: it verifies only once its own shadow evidence (or earlier verifies) says a
verify gains at alpha_low, and a sequence suspended after a losing verify resumes on shadow
evidence instead of a timer. The probe budget and the suspension apply to dear drafters only.

A guard on top, because the constant cost model is only a prior: a batch-level gate measured on the running engine: the wall time between steps (begin_step to
  begin_step, so drafting, forward and acceptance all count) is averaged per batch-size bucket for
  plain steps and for steps with verify blocks, with the tokens the latter emitted per sequence.
  When speculation's measured rate, (1 + accepted per sequence) / t_spec, falls below plain
  decoding's, 1 / t_plain, times 1 + measure_margin (t_plain less the speculator's own host time
  in those steps: its gate calls, shadows and index upkeep are paid while it speculates, not by a
  run without it) (after measure_min_steps verify steps), speculation pauses for the whole batch for probe_interval steps (doubling
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


PRIOR_WEIGHT = 2.0            # pseudo-tokens of the drafter's prior in a sequence's acceptance estimate
SHADOW_MAX_WAIT = 16          # most steps between a sequence's shadow drafts while they miss
UPKEEP_WINDOW = 32            # steady steps the measured gate weighs upkeep against accepted drafts over


@dataclass
class SeqSpecStats:
    hits: float                # accepted draft tokens (exponentially decayed, prior included)
    trials: float              # verified draft positions: accepted + the first rejection
    suspended_until: int = 0
    proposed: int = 0
    accepted: int = 0
    verifies: int = 0
    backoff: int = 1          # the next suspension lasts probe_interval * backoff steps
    first_step: int = 0       # the step the gate first saw the sequence
    probe_loss: float = 0.0   # cost-model steps spent on probes (verifies expected to lose)
    probing: bool = False     # the current draft is a probe
    shadows: int = 0          # shadow drafts resolved (never verified; see observe_shadow)
    shadow_accepted: int = 0  # their tokens a verify would have accepted
    shadow_after: int = 0     # the step from which the next shadow may start (wants_shadow)
    shadow_backoff: int = 1   # steps to wait after the next missed shadow (doubles per miss, at most 16)

    @property
    def alpha(self) -> float:
        return self.hits / self.trials if self.trials > 0 else 0.0

    def alpha_low(self, caution: float) -> float:
        """alpha less `caution` standard deviations of its Beta(hits, trials - hits) posterior."""
        a = self.alpha
        return max(0.0, a - caution * math.sqrt(a * (1.0 - a) / (self.trials + 1.0))) if caution > 0 else a


@dataclass
class BucketTiming:
    """Measured step times of one batch-size bucket (seconds, exponential averages)."""
    plain_s: float | None = None
    spec_s: float | None = None
    spec_tokens: float = 1.0          # tokens emitted per decoding sequence in a verify step
    spec_steps: int = 0
    spec_rows: float = 0.0            # draft rows verified in a verify step (all sequences together)
    paused_until: int = 0
    backoff: int = 1
    probing: bool = False             # the next verify step is a probe after a pause
    plain_overhead_s: float = 0.0     # the speculator's own host time inside those plain steps
    win_steps: int = 0                # the upkeep window (UPKEEP_WINDOW steady steps, every kind):
    win_accepted: float = 0.0         #   draft tokens accepted per sequence, summed
    win_host_s: float = 0.0           #   the speculator's host time, summed
    win_s: float = 0.0                #   the steps' time, summed

    def rate_ratio(self) -> float | None:
        """Speculation's measured rate over plain decoding's (None until both are measured). Plain
        decoding's step is the measured plain step less the speculator's own host work in it (its
        gate calls, shadows, index upkeep): what a run without a speculator would take."""
        if self.plain_s is None or self.spec_s is None:
            return None
        plain = max(self.plain_s - self.plain_overhead_s, 0.25 * self.plain_s)
        return (self.spec_tokens / self.spec_s) * plain


def _bucket(n: int) -> int:
    return n if n <= 4 else 1 << (n - 1).bit_length()


class AdaptiveGate:
    def __init__(self, num_drafts: int, *, verify_cost: float = 0.1, draft_cost: float = 0.0,
                 draft_fixed: float = 0.0, step_fixed: float = 0.0, row_cost: float = 0.0,
                 prior_acceptance: float = 0.8, probe_budget: float | None = None, min_gain: float = 1.0,
                 caution: float = 0.0, probe_interval: int = 16, max_batch: int = 64, ema_decay: float = 0.7,
                 measure: bool = True, measure_margin: float = 0.0, measure_min_steps: int = 2,
                 shadow: bool = False, clock=time.perf_counter):
        """verify_cost: v per draft token (constant model); step_fixed > 0 selects the row model
        (step_fixed, row_cost: see the module doc) instead; draft_cost / draft_fixed: the drafter's
        cost per token / per proposal; prior_acceptance: a new sequence's per-token acceptance;
        probe_budget: the share of a request's tokens that probes may lose (None: no budget);
        min_gain: the expected gain a draft needs (above 1: a margin for the model's error);
        caution: standard deviations of the acceptance estimate below its mean that drafting decisions
        act on (0: the mean). measure_margin: the measured gate keeps speculating only while its rate
        beats plain decoding's by this share (step times are noisy: a break-even speculation is a
        gamble either way); measure_min_steps: verify steps a bucket (or a probe) needs before it
        decides."""
        self.num_drafts, self.verify_cost, self.draft_cost = num_drafts, verify_cost, draft_cost
        self.draft_fixed, self.step_fixed, self.row_cost = draft_fixed, step_fixed, row_cost
        self.prior, self.probe_budget = min(max(prior_acceptance, 0.0), 1.0), probe_budget
        self.probe_interval, self.max_batch, self.decay = probe_interval, max_batch, ema_decay
        self.min_gain, self.caution = max(1.0, min_gain), max(0.0, caution)
        self.shadow = bool(shadow) and draft_cost <= 0 and draft_fixed <= 0
        self.stats: dict[str, SeqSpecStats] = {}
        self.step = 0
        self.batch = 1                            # decoding sequences of the current step
        self._warned_batch = False
        self._warned_never: set[int] = set()
        self._pays: dict[int, bool] = {}           # can_pay per batch size (the costs are constants)
        self._cost_cache: dict[tuple[int, bool], list[float]] = {}   # _block_costs per (batch, drafting)
        self.measure, self.clock = measure, clock
        self.measure_margin, self.measure_min_steps = max(0.0, measure_margin), max(1, int(measure_min_steps))
        self.timing: dict[int, BucketTiming] = {}
        self._t: float | None = None              # when the current step began
        self._n = 0                               # its decoding sequences
        self._verified = False                    # whether it verified drafts
        self._accepted = 0                        # draft tokens it accepted
        self._drafted = 0                         # draft rows it verified
        self._host_s = 0.0                        # the speculator's host time in it (add_host_time)
        self._active = False                      # whether the measured gate let it speculate
        self._warned_measured = False

    def begin_step(self, num_decoding: int) -> bool:
        """False when speculation does not pay for this step's batch: too large a batch (logged
        once), a batch size at which no draft count can gain even with every draft accepted (logged
        once per size; checked once per step, so a drafter that can never pay costs no per-sequence
        work), or a measured loss at this batch size (see the module doc)."""
        self.step += 1
        self.batch = max(1, num_decoding)
        if self.measure:
            self._time_step(num_decoding)
        if num_decoding and not self._batch_pays():
            return False
        if num_decoding > self.max_batch:
            if not self._warned_batch:
                log.info("speculation off while more than %d sequences decode (spec.gate.max_batch)",
                         self.max_batch)
                self._warned_batch = True
            return False
        if self.measure and num_decoding:
            self._active = self._measured_go(self.timing.setdefault(_bucket(num_decoding), BucketTiming()))
            return self._active
        return True

    def _time_step(self, num_decoding: int) -> None:
        now = self.clock()
        if self._t is not None and self._n and self._n == num_decoding:
            b = self.timing.setdefault(_bucket(self._n), BucketTiming())
            dt = now - self._t
            if self._active:                      # the upkeep window counts speculating steps only
                b.win_steps += 1
                b.win_accepted += self._accepted / self._n
                b.win_host_s += self._host_s
                b.win_s += dt
            if self._verified:
                tokens = 1.0 + self._accepted / self._n
                if b.spec_steps == 0 or b.probing:       # a probe measures afresh: things may have changed
                    b.spec_s, b.spec_tokens, b.spec_rows, b.probing = dt, tokens, float(self._drafted), False
                else:
                    b.spec_s = self._avg(b.spec_s, dt)
                    b.spec_tokens = self._ema(b.spec_tokens, tokens)
                    b.spec_rows = self._ema(b.spec_rows, self._drafted)
                b.spec_steps += 1
            else:
                b.plain_overhead_s = self._host_s if b.plain_s is None else self._ema(b.plain_overhead_s, self._host_s)
                b.plain_s = self._avg(b.plain_s, dt)
        self._t, self._n, self._verified, self._accepted, self._drafted = now, num_decoding, False, 0, 0
        self._host_s, self._active = 0.0, False

    def add_host_time(self, seconds: float) -> None:
        """The speculator's own host work this step (Speculator.propose): in a plain step it is what
        speculating costs without a verify, so rate_ratio takes it off the plain step time."""
        self._host_s += seconds

    def _ema(self, old: float, x: float) -> float:
        return self.decay * old + (1 - self.decay) * x

    def _avg(self, old: float | None, x: float) -> float:
        """A step time's average: the first sample as is, later ones clipped at 4x (idle gaps)."""
        return x if old is None else self._ema(old, min(x, 4.0 * old))

    def _measured_go(self, b: BucketTiming) -> bool:
        if self.step < b.paused_until:
            return False
        if b.spec_s is not None and b.plain_s is None:
            return False                          # measure a plain step of this size first
        ratio = b.rate_ratio()
        win = 1.0 + self.measure_margin
        upkeep = self._upkeep_loses(b, win)         # None between the window's decisions
        if not upkeep and (ratio is None or b.spec_steps < self.measure_min_steps or ratio >= win):
            if upkeep is False and (ratio is None or ratio >= win):
                b.backoff = 1                         # a whole window that paid its way
            return True
        if not self._warned_measured:
            log.info("speculation paused: %s at batch %d", "its upkeep outweighs its accepted drafts"
                     if upkeep else f"measured {ratio:.2f}x of plain decode's rate", self._n)
            self._warned_measured = True
        b.paused_until = self.step + self.probe_interval * b.backoff
        b.backoff = min(16, b.backoff * 2)
        b.spec_steps = 1                          # the probe after the pause decides again
        b.probing = True
        return False

    @staticmethod
    def _upkeep_loses(b: BucketTiming, win: float) -> bool | None:
        """Over the last UPKEEP_WINDOW steady steps (then the window restarts): whether the draft
        tokens accepted per sequence and step, g, fall short of the share of time the speculator's
        own host work took, h (times the margin). Speculating wins iff (1 + g) / (t + h t) > 1 / t,
        i.e. g > h, whatever the verifies cost (rate_ratio weighs those): this catches the steps
        with no verify at all, where a sequence that rarely drafts (open chat) still pays the gate,
        its shadows and the n-gram index every step (H200, SmolLM2 B=1: ~3% of a 1.2 ms step)."""
        if b.win_steps < UPKEEP_WINDOW:
            return None
        g, h = b.win_accepted / b.win_steps, (b.win_host_s / b.win_s if b.win_s > 0 else 0.0)
        b.win_steps, b.win_accepted, b.win_host_s, b.win_s = 0, 0.0, 0.0, 0.0
        return g < h * win

    def _stats(self, request_id: str) -> SeqSpecStats:
        st = self.stats.get(request_id)
        if st is None:
            st = self.stats[request_id] = SeqSpecStats(hits=self.prior * PRIOR_WEIGHT, trials=PRIOR_WEIGHT,
                                                       first_step=self.step)
        return st

    # ------------------------------------------------------------------ the cost model
    def costs(self, batch: int | None = None) -> tuple[float, float]:
        """(F, v) at this batch size: the fixed cost of verifying and the cost per verified draft
        row, in plain decode steps per sequence (module doc)."""
        b = self.batch if batch is None else max(1, batch)
        if self.step_fixed <= 0:
            return 0.0, self.verify_cost
        if b == 1:
            return max(0.0, self.step_fixed + self.row_cost - 1.0), self.row_cost
        return 0.0, self.row_cost * b / (self.step_fixed + self.row_cost * b)

    def block_cost(self, k: int, batch: int | None = None, drafting: bool = True) -> float:
        """Plain steps a verify block with k drafts costs (drafting=False: the drafter's work is
        already done)."""
        f, v = self.costs(batch)
        c = 1.0 + f + v * k
        if drafting:
            c += self.draft_cost * k + self.draft_fixed
        return c

    def _block_costs(self, batch: int | None, drafting: bool, measured: bool = False) -> list[float]:
        """[block_cost(k) for k = 0..num_drafts] at this batch size, cached (this runs several times
        per sequence and step). measured: a draft row costs at least what the measured gate saw
        (measured_row_cost), so a sequence's verify decision prices its rows at what the whole
        batch pays for them."""
        b = self.batch if batch is None else max(1, batch)
        vm = round(self.measured_row_cost(b), 3) if measured else 0.0
        key = (b, drafting, vm)
        c = self._cost_cache.get(key)
        if c is None:
            if len(self._cost_cache) > 256:
                self._cost_cache.clear()
            extra = max(0.0, vm - self.costs(b)[1])       # the measured price above the constant
            c = self._cost_cache[key] = [self.block_cost(k, b, drafting) + extra * k for k in range(self.num_drafts + 1)]
        return c

    def measured_row_cost(self, batch: int) -> float:
        """Plain steps per sequence that one verified draft row costs, from the measured step times
        of this batch size's bucket (0 until measured): a verify step's extra time over a plain step,
        shared by the draft rows it verified, and paid by all `batch` sequences that wait for it.
        On the GPU a verify step can cost more than the per-row constant (a larger graph of the
        ladder, host-side drafting and acceptance): 1-gram n-gram drafts at open chat B=32 were
        verified at a measured 0.96x."""
        if not self.measure:
            return 0.0
        t = self.timing.get(_bucket(batch))
        if (t is None or t.plain_s is None or t.spec_s is None or t.spec_rows <= 0
                or t.spec_steps < self.measure_min_steps):
            return 0.0
        return max(0.0, t.spec_s / t.plain_s - 1.0) * batch / t.spec_rows

    @staticmethod
    def expected_accepted(alpha: float, k: int) -> float:
        return sum(alpha ** j for j in range(1, k + 1))

    def best_drafts(self, alpha: float, batch: int | None = None) -> tuple[int, float]:
        """(k, expected gain) of the draft count with the best expected gain at acceptance alpha."""
        best_k, best_g = 1, -1.0
        cost = self._block_costs(batch, True)
        p, acc = 1.0, 0.0
        for k in range(1, self.num_drafts + 1):
            p *= alpha
            acc += p                                    # expected_accepted(alpha, k)
            g = (1.0 + acc) / cost[k]
            if g > best_g + 1e-12:
                best_k, best_g = k, g
        return best_k, best_g

    def can_pay(self, batch: int | None = None) -> bool:
        """Whether some draft count gains at this batch size with every draft accepted."""
        b = self.batch if batch is None else max(1, batch)
        pays = self._pays.get(b)
        if pays is None:
            pays = self._pays[b] = self.best_drafts(1.0, b)[1] >= 1.0
        return pays

    def _batch_pays(self) -> bool:
        """can_pay at the current batch, logging (once per batch size) when it cannot."""
        if self.can_pay():
            return True
        if self.batch not in self._warned_never:
            self._warned_never.add(self.batch)
            log.info("speculation off at batch %d: no draft count gains even if every draft is accepted "
                     "(cost model: %.2f + %.2f per draft token)", self.batch, *self._cost_line())
        return False

    def worth_verifying(self, n: int, batch: int | None = None) -> bool:
        """After drafting: whether a draft of n tokens could gain at all if verified (the drafting
        is paid already). False for short drafts at batch 1 on the CPU row model, where the first
        verify row costs most of a step more."""
        return n > 0 and (1.0 + n) / self.block_cost(n, batch, drafting=False) >= 1.0

    def verify_length(self, request_id: str, confidences: list[float], batch: int | None = None) -> int:
        """How much of a proposed draft to verify (the drafting is paid already): the prefix with the
        best expected gain, token i accepted with probability min(alpha_low, confidence_i) (n-gram:
        match length / max_n; model drafters: their softmax probability); 0 when no prefix is
        expected to gain. A probe while even the mean alpha loses is verified in full when it could
        gain at all (it is there to measure alpha); a probe in the uncertain zone (the mean gains,
        alpha_low does not) is there to test the mean: its prefix is chosen at the mean alpha, so a
        draft its own confidences reject (a 1-gram match) is not verified to test it. drafts_for
        applies this same rule (`_verified_prefix`) to a draft of full confidence before it lets a
        sequence draft, so only the draft's own confidences can make a paid-for draft go unverified."""
        st = self.stats.get(request_id)
        n = self._verified_prefix(st, confidences, batch, st is not None and st.probing)
        if n == 0 and confidences and st is not None and (self.draft_cost > 0 or self.draft_fixed > 0):
            # a paid-for draft its own confidences reject: count it as a miss (as a verify that
            # accepts nothing would), so a dear drafter does not keep drafting to drop
            self._evidence(st, len(confidences), 0)
            self._suspend_if_losing(st)
        return n

    def _verified_prefix(self, st: SeqSpecStats | None, confidences: list[float], batch: int | None,
                         probing: bool) -> int:
        """The rule of verify_length, without side effects (drafts_for asks it before drafting)."""
        n = len(confidences)
        if st is None or (probing and self.best_drafts(st.alpha, batch)[1] < self.min_gain):
            return n if self.worth_verifying(n, batch) else 0
        alpha = st.alpha if probing else st.alpha_low(self.caution)
        p, acc, best, best_n = 1.0, 0.0, self.min_gain - 1e-12, 0
        cost = self._block_costs(batch, False, measured=True) if n <= self.num_drafts else None
        for j, c in enumerate(confidences, 1):
            p *= min(alpha, max(0.0, float(c)))
            acc += p
            g = (1.0 + acc) / (cost[j] if cost is not None else self.block_cost(j, batch, drafting=False))
            if g > best:
                best, best_n = g, j
        return best_n

    def _suspend_if_losing(self, st: SeqSpecStats) -> bool:
        """Suspend when even the mean acceptance loses (between that and a gain at alpha_low, drafts
        are budgeted probes)."""
        if self.best_drafts(st.alpha)[1] >= self.min_gain:
            return False
        # suspend; each losing verify in a row doubles the pause (at most 16x)
        st.suspended_until = self.step + self.probe_interval * st.backoff
        st.backoff = min(16, st.backoff * 2)
        return True

    # ------------------------------------------------------------------ per sequence
    def drafts_for(self, request_id: str, left: int | None = None) -> int:
        """Draft tokens for this sequence this step (0: none). left: tokens the request may still
        decode (the probe budget's horizon; None: probes are not budgeted). A count is given only
        when verify_length's rule would verify a draft of that length at full confidence (the same
        test, `_verified_prefix`): a drafter is never asked for a draft the gate would drop whatever
        it says, so it pays no catch-up or drafting for nothing."""
        st = self._stats(request_id)
        st.probing = False
        if not self._batch_pays() or (self.step < st.suspended_until and not self.shadow):
            return 0
        k, gain = self.best_drafts(st.alpha_low(self.caution))
        probing = gain < self.min_gain
        if probing and self.shadow:
            return 0                              # the Speculator shadows it instead (free evidence)
        k = self._verified_prefix(st, [1.0] * k, None, probing)
        if k == 0:
            return 0
        if not probing:
            return k
        # a probe: not expected to gain at alpha_low; budgeted against the request's length
        if self.probe_budget is not None and left is not None:
            loss = self.block_cost(k) - 1.0
            horizon = (self.step - st.first_step) + left
            if st.probe_loss + loss > self.probe_budget * horizon:
                return 0
        st.probing = True
        return k

    def _cost_line(self) -> tuple[float, float]:
        f, v = self.costs()
        return 1.0 + f + self.draft_fixed, v + self.draft_cost

    def update(self, request_id: str, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self._verified = True
        self._accepted += accepted
        self._drafted += proposed
        st = self._stats(request_id)
        st.proposed += proposed
        st.accepted += accepted
        st.verifies += 1
        self._evidence(st, proposed, accepted)
        if st.probing:
            st.probe_loss += max(0.0, self.block_cost(proposed) - (1.0 + accepted))
            st.probing = False
        if not self._suspend_if_losing(st) and accepted:
            st.backoff = 1

    def _evidence(self, st: SeqSpecStats, proposed: int, accepted: int) -> None:
        """A draft of `proposed` tokens of which the first `accepted` were (or would have been)
        accepted: the decayed Beta counts take the hits and the trials (accepted + the first miss)."""
        st.hits = self.decay * st.hits + accepted
        st.trials = self.decay * st.trials + accepted + (1 if accepted < proposed else 0)

    def wants_shadow(self, request_id: str) -> bool:
        """Whether a sequence drafts_for refused should get a shadow this step: after a missed
        shadow the next waits 1, 2, 4 .. SHADOW_MAX_WAIT steps (a hit resets), so a sequence whose
        drafts keep missing (open chat) costs a lookup every 16 steps, not every step (H200,
        SmolLM2 batch 1: a lookup and its bookkeeping every step were ~3% of a 1.2 ms step)."""
        st = self.stats.get(request_id)
        return st is None or self.step >= st.shadow_after

    def observe_shadow(self, request_id: str, proposed: int, accepted: int) -> None:
        """A shadow draft of `proposed` tokens resolved: the sequence emitted its first `accepted`
        tokens (and then another, unless all matched). The same evidence as a verify with that
        outcome, at no cost: no step timing, no probe loss, no suspension."""
        if proposed <= 0:
            return
        st = self._stats(request_id)
        st.shadows += 1
        st.shadow_accepted += accepted
        if accepted:
            st.shadow_backoff = 1
        else:                                 # misses space the next shadows out: bounded host work
            st.shadow_after = self.step + st.shadow_backoff
            st.shadow_backoff = min(SHADOW_MAX_WAIT, 2 * st.shadow_backoff)
        self._evidence(st, proposed, accepted)

    def release(self, request_id: str) -> None:
        self.stats.pop(request_id, None)

    def acceptance(self) -> float:
        p = sum(s.proposed for s in self.stats.values())
        return sum(s.accepted for s in self.stats.values()) / p if p else 0.0
