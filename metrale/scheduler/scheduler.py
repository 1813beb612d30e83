"""Scheduler: picks each step's work under a token budget and the KV pool.

One step = a list of (sequence, number of tokens to compute). Running sequences go first
(decode rows and unfinished prefill chunks, oldest first), then waiting sequences are admitted
while budget, sequence slots and blocks remain. A prefill chunk that does not finish the prompt
ends on a block boundary. When blocks run out, the newest running sequence not yet in the step
is preempted (vLLM's policy; it may be the one growing): requeued for recompute (default) or
finished with an error (levers.preempt_mode). So the oldest running sequence always advances and
preemption cannot livelock: no sequence outgrows the pool (Engine.context_len caps it).
The scheduler never touches device memory.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from typing import TYPE_CHECKING, Callable, Mapping

from metrale.cache.block_manager import BlockManager
from metrale.outputs import error_reason
from metrale.scheduler.sequence import Sequence, Status

if TYPE_CHECKING:
    from metrale.request import RequestState
    from metrale.runner import StepOutput

log = logging.getLogger("metrale.scheduler")

PREEMPTED_ERROR = "error: preempted: KV cache exhausted"


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int                                  # includes the draft tokens of a verify block
    draft: list[int] = field(default_factory=list)   # speculative tokens verified in this step

    @property
    def needs_logits(self) -> bool:
        """True when this chunk reaches the end of the known tokens: a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens - len(self.draft) == self.seq.num_tokens


@dataclass
class Advanced:
    """A sampled sequence after postprocess: its finish reason (None: it goes on) and how many
    tokens it took."""
    state: "RequestState"
    reason: str | None
    appended: int


@dataclass
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)   # finished by abort-mode preemption

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled) or bool(self.preempted)


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 no_mix: bool = False, preempt_mode: str = "recompute"):
        if preempt_mode not in ("recompute", "abort"):
            raise ValueError(f"levers.preempt_mode must be 'recompute' or 'abort', not '{preempt_mode}'")
        if max_num_batched_tokens < blocks.block_size:
            raise ValueError(f"scheduler.max_num_batched_tokens ({max_num_batched_tokens}) must be at "
                             f"least the KV block size ({blocks.block_size})")
        self.blocks = blocks
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.no_mix, self.preempt_mode = no_mix, preempt_mode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.preempt_listeners: list = []     # called with each preempted sequence (drafter caches)
        # after a verify block: (seq, num_tokens before it, draft length, drafts accepted)
        self.on_verified: Callable[[Sequence, int, int, int], None] | None = None
        self._warned_preempt = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_uncomputed, budget)
        if n < seq.num_uncomputed:   # not the last chunk: end on a block boundary
            end = (seq.num_computed_tokens + n) // self.blocks.block_size * self.blocks.block_size
            n = max(end - seq.num_computed_tokens, 0)
        return n

    def _preempt(self, victim: Sequence, plan: StepPlan) -> None:
        self.running.remove(victim)
        self.blocks.release(victim)
        for listener in self.preempt_listeners:
            listener(victim)
        self.num_preemptions += 1
        victim.num_preemptions += 1
        if not self._warned_preempt:
            log.warning("KV cache exhausted: preempting (%s); raise cache.num_blocks or lower "
                        "scheduler.max_num_seqs to avoid it", self.preempt_mode)
            self._warned_preempt = True
        if self.preempt_mode == "abort":
            victim.status, victim.finish_reason = Status.FINISHED, PREEMPTED_ERROR
            plan.preempted.append(victim)
        else:
            victim.status = Status.WAITING
            self.waiting.appendleft(victim)

    def schedule(self) -> StepPlan:
        """This step's work. With levers.no_mix a step is all prefill (running chunks, then
        admissions) or, when no prefill can run (no chunk fits, no sequence slot or blocks for a
        waiting one), all decode: decodes are never held back by prefills that cannot start."""
        if not self.no_mix:
            return self._schedule(decodes=True, prefills=True)
        plan = self._schedule(decodes=False, prefills=True)
        if plan.scheduled:
            return plan
        decode = self._schedule(decodes=True, prefills=False)
        decode.preempted[:0] = plan.preempted
        return decode

    def _schedule(self, *, decodes: bool, prefills: bool) -> StepPlan:
        plan = StepPlan()
        budget = self.budget
        gone: set[int] = set()                 # ids preempted in this loop (a set: `in self.running` was O(B))
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if id(seq) in gone:                # preempted earlier in this loop
                continue
            is_decode = seq.num_uncomputed == 1
            if not (decodes if is_decode else prefills) or budget == 0:
                continue
            draft = seq.draft_tokens[:budget - 1] if is_decode else []
            n = 1 + len(draft) if is_decode else self._chunk(seq, budget)
            if n == 0:
                continue
            if draft and not self.blocks.grow(seq, seq.num_computed_tokens + n):
                draft, n = [], 1                     # drop the draft before preempting anyone
            while not self.blocks.grow(seq, seq.num_computed_tokens + n):
                scheduled = {id(s.seq) for s in plan.scheduled}
                victims = [s for s in self.running if id(s) not in scheduled] or [seq]
                victim = max(victims, key=lambda s: s.arrival)
                self._preempt(victim, plan)
                gone.add(id(victim))
                if victim is seq:
                    break
            if id(seq) not in gone:
                plan.scheduled.append(ScheduledSeq(seq, n, draft))
                budget -= n
        while prefills and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if id(seq) in gone:            # preempted in this step: readmitting it would only thrash
                break
            if not seq.block_table:
                self.blocks.allocate_prefix(seq)
            n = self._chunk(seq, budget)
            if n == 0 or not self.blocks.grow(seq, seq.num_computed_tokens + n):
                self.blocks.release(seq)   # give back prefix hits; looked up again next step
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return plan

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)

    # ------------------------------------------------------------------ after a step
    def postprocess(self, out: "StepOutput", requests: Mapping[str, "RequestState"]) -> list[Advanced]:
        """Every sequence update after a step: computed counts, committed (and, after a verify
        block, trimmed) blocks, tokens appended with their stop checks, finishing. A row whose
        draw failed, or whose update raises, ends with its error alone. Rows of sequences that
        ended meanwhile (aborted while a step ran ahead) are dropped."""
        for s in out.computed:
            s.seq.num_computed_tokens += s.num_tokens
            self.blocks.commit_full_blocks(s.seq)
        advanced = []
        for s, drawn in zip(out.sampled, out.drawn):
            state = requests.get(s.seq.request_id)
            if state is None or state.seq is not s.seq or s.seq.is_finished:
                continue
            if isinstance(drawn, Exception):     # its draw failed (logged there)
                self.finish(s.seq, error_reason(drawn))
                advanced.append(Advanced(state, s.seq.finish_reason, 0))
                continue
            try:
                advanced.append(self._advance(s, state, drawn, out.verifying))
            except Exception as exc:             # its stop check or detokenizing failed
                log.exception("request %s failed", s.seq.request_id)
                self.finish(s.seq, error_reason(exc))
                advanced.append(Advanced(state, s.seq.finish_reason, 0))
        return advanced

    def _advance(self, s: ScheduledSeq, state: "RequestState", drawn: list, verifying: bool) -> Advanced:
        seq, draft = s.seq, s.draft
        if draft:      # a verify block: K/V is right for the accepted drafts only
            before = seq.num_tokens
            seq.num_computed_tokens += s.num_tokens - len(draft) + len(drawn) - 1
        else:
            seq.num_computed_tokens += s.num_tokens
        reason, appended = None, 0
        for d in drawn:
            state.sampling.accept(*d)
            reason = state.append(int(d.token))
            appended += 1
            if reason is not None:
                break
        if draft and self.on_verified is not None:
            self.on_verified(seq, before, len(draft), len(drawn) - 1)
        self.blocks.commit_full_blocks(seq)     # before finishing: a prompt that ends at once is cached too
        if reason is not None:
            self.finish(seq, reason)
        elif draft:
            self.blocks.trim(seq)
        return Advanced(state, reason, appended)
