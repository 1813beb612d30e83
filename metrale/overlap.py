"""The host a step ahead of the device (levers.overlap).

While the device runs decode step N, the engine queues step N+1: each row's next input token is
step N's sampled id, fed on the device (`Backend.launch_greedy(token_src=...)`, the CUDA
embedding reads it from the argmax buffer), and the host knows everything else about the row in
advance (its position, its next KV slot). Only then does it wait for step N's ids and run the
stop checks, streaming and finishing a step late. A row that finished at step N has one extra
token computed at N+1: it is never emitted, and its KV write lands past the sequence's committed
blocks (a freed block is reused only by later steps of the same stream).

Decode steps whose rows the device alone can draw run ahead: plain greedy rows (the argmax) and
sampled rows whose sampling reads nothing the last token changes but the penalty counts
(temperature, top-k/p, min-p, a logit bias, repetition / presence / frequency penalties;
`SamplingState.device_only`), drawn by the device pipeline with the seeded draw counter one step
further, their tokens copied where the next embedding reads them. A penalized row's counts are
packed one token short: the pipeline counts the pending token itself, read from the step before's
drawn tokens (`Sampler.launch_ahead(prev=...)`). Not ahead: verify blocks, recurrent state,
grammars, logprobs, a min_tokens ban, anything waiting for admission. Any other step first reads the
one in flight and runs synchronously. With speculation, steps run ahead while no sequence has a
draft (the speculator is asked each step, on the tokens the host has); a draft found sends the loop
back to a synchronous step, which proposes it and verifies it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from metrale.runner import StepOutput
from metrale.runtime.batch import build_decode_batch
from metrale.sampling.sampler import Drawn
from metrale.scheduler.scheduler import ScheduledSeq
from metrale.scheduler.sequence import Sequence


@dataclass
class Inflight:
    """A launched decode step whose ids the host has not read yet."""
    seqs: list[Sequence]
    handle: object                     # Backend.launch_greedy's result, or a SampledStep


class SampledStep:
    """A launched step of device-sampled rows: its Drawn (and ids) once read."""

    def __init__(self, sampler, handle) -> None:
        self.sampler, self.handle, self._drawn = sampler, handle, None

    def drawn(self) -> list[Drawn]:
        if self._drawn is None:
            self._drawn = self.sampler.ahead_drawn(self.handle)
        return self._drawn

    def tokens(self) -> np.ndarray:
        return np.fromiter((d.token for d in self.drawn()), dtype=np.int32)


class AheadLoop:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.inflight: Inflight | None = None
        self.steps_ahead = 0           # steps queued before the previous one was read (stats)

    # ------------------------------------------------------------------ eligibility
    def eligible(self, scheduled, states) -> bool:
        """A step of decode rows (ScheduledSeqs) the device alone can draw, that can start running ahead."""
        e = self.engine
        return ((e.speculator is None or e.speculator.runs_ahead) and e.recurrent is None and not e.scheduler.waiting
                and len(states) == len(scheduled) and all(s.num_tokens == 1 and not s.draft for s in scheduled)
                and e.sampler.can_run_ahead(states))

    def _next_rows(self, cur: Inflight) -> list[tuple[int, Sequence, int]] | None:
        """(row in cur, sequence, its tokens now: the position its next row computes) of the step
        after cur, or None when it cannot run ahead: a
        sequence that goes on but needs the host first (not plain greedy any more), a request
        waiting for admission, or a block that cannot be had (every row runs ahead or none)."""
        e = self.engine
        if e.scheduler.waiting:
            return None
        rows, requests, sampler, context_len = [], e.requests, e.sampler, e.context_len
        for i, seq in enumerate(cur.seqs):
            state = requests.get(seq.request_id)
            if seq.is_finished or state is None:
                continue                      # it ended at cur: no row after it
            n = seq.num_tokens
            max_tokens = seq.params.max_tokens
            if (max_tokens is not None and len(seq.output_token_ids) + 1 >= max_tokens) or n + 1 >= context_len:
                continue                      # the token cur computes ends it by length
            if not (state.always_device_drawn or sampler.can_run_ahead([state])):
                return None
            rows.append((i, seq, n))
        if not rows:
            return None
        grow, bs = e.blocks.grow, e.blocks.block_size
        if not all(len(s.block_table) * bs > n or grow(s, n + 1) for _, s, n in rows):
            return None
        return rows

    # ------------------------------------------------------------------ the loop
    def start(self, step) -> StepOutput:
        """Launches a prepared decode step (runner.prepare's), then advances (the speculator, if
        any, proposed nothing for it on the same tokens a check now would see)."""
        self.inflight = Inflight([s.seq for s in step.scheduled], self._launch_rows(step.batch, step.states, None, None, 0))
        return self.advance(ask_speculator=False)

    def advance(self, ask_speculator: bool = True) -> StepOutput:
        """Queues the next step if it can run ahead, then reads the one in flight: its output for
        Scheduler.postprocess, which drops rows of sequences that ended meanwhile. With a
        speculator, each step queued ahead first asks it (Speculator.lets_ahead): a sequence with
        a draft sends the loop back to a synchronous step."""
        cur = self.inflight
        nxt = None
        rows = self._next_rows(cur)
        spec = self.engine.speculator
        if spec is not None and ask_speculator:
            live = [s for s in cur.seqs if not s.is_finished and s.request_id in self.engine.requests]
            if not spec.lets_ahead(live, self.engine.requests):
                rows = None
        if rows is not None:
            nxt = self._launch(rows, cur)
            self.steps_ahead += 1
        handle = cur.handle
        drawn = handle.drawn() if isinstance(handle, SampledStep) else [Drawn(int(t)) for t in handle.tokens()]
        self.inflight = nxt
        return StepOutput([], [ScheduledSeq(seq, 1) for seq in cur.seqs], [[d] for d in drawn])

    def _launch(self, rows: list[tuple[int, Sequence, int]], cur: Inflight) -> Inflight:
        """The step after `cur`: each row's input is its sequence's pending token (at position
        num_tokens, not yet known to the host), fed from cur's row."""
        e = self.engine
        src, seqs, positions = zip(*rows)
        seqs = list(seqs)
        batch = build_decode_batch(np.array(positions, np.int32), e.blocks.tables_of(seqs), e.blocks.block_size)
        if e.step_log is not None:
            e.step_log.append((len(rows), int(batch.context_lens.sum())))
        requests = e.requests
        states = [requests[s.request_id] for s in seqs]
        return Inflight(seqs, self._launch_rows(batch, states, cur.handle, np.array(src, np.int32), 1))

    def _launch_rows(self, batch, states, prev, token_src, step_ahead: int):
        """The argmax step when every row is plain greedy, else the logits and the device pipeline
        (step_ahead 1: the rows' last token, prev's row token_src, is not accepted yet)."""
        e = self.engine
        backend = e.runner.backend
        if e.sampler.plain_greedy(states):
            return backend.launch_greedy(batch, prev, token_src)
        logits = backend.launch_logits(batch, prev, token_src)
        drawn_before = prev.handle if isinstance(prev, SampledStep) else None    # penalized rows count its tokens
        return SampledStep(e.sampler, e.sampler.launch_ahead(logits, states, step_ahead, backend.feed_buffer,
                                                             drawn_before, token_src))
