"""The model runner: one scheduled step -> StepOutput.

`prepare` builds the step's ForwardBatch (segments, recurrent-state slots and verify checkpoints);
`execute` runs the forward, then every sampling row through one road: the device argmax when all
rows are plain greedy, else the sampling pipeline (metrale/sampling/sampler.py); verify blocks are
then accepted by the speculator. The runner never advances a sequence: Scheduler.postprocess does.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from metrale.cache.block_manager import BlockManager
from metrale.cache.recurrent import RecurrentStates
from metrale.outputs import error_reason
from metrale.runtime.batch import ForwardBatch, Segment, build_batch, build_decode_batch
from metrale.sampling.sampler import Drawn, Sampler
from metrale.scheduler.scheduler import ScheduledSeq

log = logging.getLogger("metrale")


@dataclass
class StepOutput:
    """What one step produced: per sampled row, its drawn tokens (a verify block: the accepted
    drafts and one more) or the exception its draw raised; rows that only computed KV get none."""
    computed: list[ScheduledSeq]                  # prefill chunks that sample nothing
    sampled: list[ScheduledSeq]
    drawn: list[list[Drawn] | Exception]
    verifying: bool = False


@dataclass
class PreparedStep:
    scheduled: list[ScheduledSeq]
    sampled: list[ScheduledSeq]
    states: list                                  # RequestState of each sampled row
    batch: ForwardBatch
    checkpoints: dict[int, tuple[int, int]] = field(default_factory=dict)   # id(seq) -> (slot, ckpt)

    @property
    def verifying(self) -> bool:
        return any(s.draft for s in self.sampled)


class StepFailed(Exception):
    """A step failed before any sequence advanced; rerunnable: its sequences may run again apart
    (dense KV is rewritten with the same values; recurrent states would advance twice)."""

    def __init__(self, reason: str, rerunnable: bool):
        super().__init__(reason)
        self.reason, self.rerunnable = reason, rerunnable


class ModelRunner:
    def __init__(self, backend, sampler: Sampler, speculator, recurrent: RecurrentStates | None, blocks: BlockManager):
        self.backend, self.sampler, self.speculator = backend, sampler, speculator
        self.recurrent, self.blocks, self.block_size = recurrent, blocks, blocks.block_size
        self.step_log: list | None = None     # set to [] to log (tokens, KV tokens read) per forward

    def prepare(self, scheduled: list[ScheduledSeq], requests) -> PreparedStep:
        """The step's batch. Raises StepFailed (not rerunnable) when a state slot or checkpoint
        cannot be had; nothing is held then."""
        sampled = [s for s in scheduled if s.needs_logits]       # read once: the sequences change later
        step = PreparedStep(scheduled, sampled, [requests[s.seq.request_id] for s in sampled], None)
        if self.recurrent is None and len(sampled) == len(scheduled) and all(s.num_tokens == 1 and not s.draft
                                                                           for s in scheduled):
            step.batch = self._decode_batch(scheduled)    # every row one token that samples: vectorized
            if self.step_log is not None:
                self.step_log.append((len(scheduled), int(step.batch.context_lens.sum())))
            return step
        segments = []
        try:
            for s in scheduled:
                slot, ckpt = self._state_slot(s, step.checkpoints)
                first = s.seq.num_computed_tokens
                tokens = s.seq.token_slice(first, first + s.num_tokens - len(s.draft)) + s.draft
                rows = "all" if s.draft else ("last" if s.needs_logits else "none")
                segments.append(Segment(np.asarray(tokens, dtype=np.int32), first,
                                        np.asarray(s.seq.block_table, dtype=np.int32), rows,
                                        state_slot=slot, state_checkpoint=ckpt))
        except Exception as exc:
            log.exception("building the step failed")
            self.release_checkpoints(step)
            raise StepFailed(error_reason(exc), rerunnable=False) from exc
        step.batch = build_batch(segments, self.block_size)
        if self.step_log is not None:         # bench/run_all.py: the KV+weight bandwidth bound
            self.step_log.append((len(step.batch.token_ids), sum(g.start_pos + len(g.token_ids) for g in segments)))
        return step

    def _decode_batch(self, scheduled: list[ScheduledSeq]) -> ForwardBatch:
        positions = np.fromiter((s.seq.num_computed_tokens for s in scheduled), dtype=np.int32, count=len(scheduled))
        batch = build_decode_batch(positions, self.blocks.tables_of([s.seq for s in scheduled]), self.block_size)
        batch.token_ids[:] = [s.seq.token_slice(p, p + 1)[0] for s, p in zip(scheduled, positions.tolist())]
        return batch

    def _state_slot(self, s: ScheduledSeq, checkpoints: dict) -> tuple[int, int]:
        if self.recurrent is None:
            return -1, -1
        slot = self.recurrent.slot_for(s.seq)
        if not s.draft:
            return slot, -1
        ckpt = self.recurrent.checkpoint(s.seq, slot)
        checkpoints[id(s.seq)] = (slot, ckpt)
        return slot, ckpt

    def release_checkpoints(self, step: PreparedStep) -> None:
        for _, ckpt in step.checkpoints.values():
            self.recurrent.release(ckpt)

    def execute(self, step: PreparedStep) -> StepOutput:
        """Forward, sampling and verify. Raises StepFailed when they fail (nothing advanced)."""
        try:
            drawn = self._forward_and_draw(step)
        except Exception as exc:
            log.exception("forward failed")
            self.release_checkpoints(step)
            raise StepFailed(error_reason(exc), rerunnable=self.recurrent is None) from exc
        if self.speculator is not None and self.speculator.needs_hidden:
            self.speculator.drafter.observe(step.sampled, [[] if isinstance(d, Exception) else [t.token for t in d]
                                                           for d in drawn], self.backend.take_hidden())
        if step.checkpoints:     # hybrid verify blocks: keep the recurrent state after the accepted tokens
            for s, d in zip(step.sampled, drawn):
                if id(s.seq) in step.checkpoints:
                    slot, ckpt = step.checkpoints[id(s.seq)]
                    accepted = len(d) - 1 if not isinstance(d, Exception) else 0
                    self.recurrent.settle(slot, ckpt, len(s.draft), accepted)
        if self.recurrent is not None:
            self.recurrent.take_snapshots(step.scheduled)
        computed = [s for s in step.scheduled if not s.needs_logits]
        return StepOutput(computed, step.sampled, drawn, step.verifying)

    def _forward_and_draw(self, step: PreparedStep) -> list[list[Drawn] | Exception]:
        """Per sampling row its drawn tokens: one for a plain row, the accepted ones of a verify
        block (speculator.accept_blocks: row j of a block is sampled as plain decoding would sample
        it after the block's first j drafts)."""
        batch, states = step.batch, step.states
        if not states:
            self.backend.forward(batch)
            return []
        rows = self.speculator.rows(step.sampled, states) if step.verifying else states
        drawn, distribution = self._draw(batch, rows, per_row_retry=not step.verifying)
        if step.verifying:
            return self.speculator.accept_blocks(step.sampled, rows, drawn, distribution)
        return [d if isinstance(d, Exception) else [d] for d in drawn]

    def _draw(self, batch: ForwardBatch, rows, per_row_retry: bool):
        """One forward and a Drawn per logits row (or the exception its draw raised, when
        per_row_retry), and the row distribution a verify needs (None for greedy)."""
        if self.sampler.plain_greedy(rows):
            return [Drawn(int(t)) for t in self.backend.forward_greedy(batch)], None
        self.sampler.start_masks(rows)
        try:
            logits = self.sampler.forward(self.backend, batch, rows)
        finally:
            masks = self.sampler.finish_masks()
        try:
            drawn, packed = self.sampler.draw(logits, rows, masks)
        except Exception:
            if not per_row_retry:
                raise
            return [self._draw_row(logits, masks, r, st) for r, st in enumerate(rows)], None   # alone, same logits
        return drawn, (lambda r: self.sampler.row_distribution(logits, packed, r))

    def _draw_row(self, logits, masks, r: int, state) -> Drawn | Exception:
        try:
            row_mask = masks[r:r + 1] if masks is not None else None
            return self.sampler.draw(logits[r:r + 1], [state], row_mask)[0][0]
        except Exception as exc:
            log.exception("sampling request %s failed", state.seq.request_id)
            return exc
