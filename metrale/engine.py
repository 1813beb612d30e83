"""Engine: the public API. NumPy in, NumPy out; knows nothing of kernels.

    engine = Engine(model="smollm2-135m", device="auto", levers={"no_mix": False})
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    for delta in engine.stream("Hello", SamplingParams(max_tokens=32)): print(delta.text, end="")

Every request ends with an output: finished normally ('stop' / 'length'), aborted ('abort'),
or with 'error: <why>'. Requests that cannot run are refused by add_request with an
InvalidRequestError that names the field. A request with n > 1 or best_of > 1 runs one child
sequence per candidate (sampling/fanout.py) and returns its n completions in `outputs`; its
stream deltas carry their completion's `index` (docs/sampling.md, "n > 1 and best_of").
"""
from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import logging
import time
import uuid
from typing import Any, AsyncIterator, Iterable, Iterator, Sequence as Seq

import numpy as np

from metrale.cache.block_manager import BlockManager
from metrale.models.config import ModelConfig
from metrale.outputs import RequestOutput, StreamDelta
from metrale.overlap import AheadLoop
from metrale.request import RequestState
from metrale.runtime.batch import Segment, build_batch
from metrale.sampling import fanout
from metrale.sampling.params import InvalidRequestError, SamplingParams
from metrale.sampling.sampler import Drawn, Sampler
from metrale.scheduler.scheduler import ScheduledSeq, Scheduler
from metrale.scheduler.sequence import Sequence
from metrale.settings import compose, to_overrides
from metrale.spec.speculator import make_speculator

log = logging.getLogger("metrale")

Prompt = str | list[int] | np.ndarray


@dataclasses.dataclass
class _Group:
    """A request with n > 1 or best_of > 1: one child request per candidate (`f"{id}-{j}"`)."""
    request_id: str
    params: SamplingParams
    children: list[str]
    hidden: bool                                   # best_of > n: candidates are not streamed
    outputs: dict[str, RequestOutput] = dataclasses.field(default_factory=dict)   # finished children


class Engine:
    def __init__(self, model: str | None = None, device: str | None = None, *,
                 levers: dict | None = None, spec: dict | None = None,
                 overrides: list[str] | None = None, cfg: Any = None, parts: tuple | None = None,
                 **settings: Any):
        """parts=(model_config, tokenizer, backend) skips loading (tests use a fake backend)."""
        if cfg is None:
            given = dict(settings)
            for key, value in (("model", model), ("device", device), ("levers", levers), ("spec", spec)):
                if value is not None:
                    given[key] = value
            cfg = compose(to_overrides(given) + list(overrides or []))
        self.cfg = cfg
        t0 = time.perf_counter()
        if parts is None:
            from metrale.models.assemble import load_model
            parts = load_model(cfg)
        self.model_config, self.tokenizer, self.backend = parts
        self.load_seconds = time.perf_counter() - t0
        self.config: ModelConfig = self.model_config
        bs = self.backend.block_size
        hybrid = self.model_config.is_hybrid
        self._states = getattr(self.backend, "states", None)   # hybrid models: the recurrent-state pool
        num_snapshots = max(int(cfg.levers.state_snapshots), 0) if self._states is not None else 0
        prefix_caching = cfg.levers.prefix_caching and (not hybrid or num_snapshots > 0)
        if hybrid and cfg.levers.prefix_caching and not prefix_caching:
            log.info("prefix caching is off for this hybrid model: no recurrent-state snapshots "
                     "(levers.state_snapshots=0)")
        self.blocks = BlockManager(self.backend.num_blocks, bs, prefix_caching)
        self.max_model_len = min(self.model_config.max_position,
                                 cfg.scheduler.max_model_len or self.model_config.max_position)
        # the most tokens one sequence can hold: max_tokens=None ends with 'length' here, as vLLM's
        # runs to max_model_len (which vLLM refuses to set above what the KV pool holds)
        self.context_len = min(self.max_model_len, self.blocks.num_blocks * bs)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=cfg.scheduler.max_num_seqs,
                                   max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
                                   no_mix=cfg.levers.no_mix, preempt_mode=cfg.levers.preempt_mode)
        self.eos_ids = tuple(self.tokenizer.eos_token_ids or self.model_config.eos_token_ids)
        self.requests: dict[str, RequestState] = {}
        self.min_p_floor = self.model_config.min_p_floor if cfg.levers.min_p_floor else 0.0
        self.sampler = Sampler(self.backend, self.model_config.vocab_size, self.min_p_floor)
        if hybrid:
            _refuse_hybrid_spec(cfg.spec.method)
        self.speculator = make_speculator(cfg, self.backend, self.model_config, self._load_draft_backend)
        if hybrid and self.speculator is not None:
            draft_config = getattr(getattr(self.speculator.drafter, "backend", None), "config", None)
            if draft_config is not None and draft_config.is_hybrid:
                raise ValueError("spec.draft_model: a hybrid (Gated DeltaNet) draft model is not supported: its "
                                 "own recurrent states would need slots and rollback in the drafter; use a dense "
                                 "draft model of the same vocabulary (docs/hybrid.md)")
        self.state_slots = None        # hybrid models: a recurrent-state slot per running sequence
        self.snapshots = None          # hybrid models with prefix caching: recurrent-state snapshots
        if self._states is not None:
            from metrale.cache.state_slots import StateSlots
            spec_k = cfg.spec.num_drafts if self.speculator is not None else 0
            self._states.reserve(num_checkpoints=cfg.scheduler.max_num_seqs if spec_k else 0,
                                 max_trail=max(self._states.max_trail, spec_k + 1),
                                 num_snapshots=num_snapshots if prefix_caching else 0,
                                 snapshot_every=_snapshot_every(bs) if prefix_caching else 0)
            self.state_slots = StateSlots.for_store(self._states)
            self.scheduler.preempt_listeners.append(self.state_slots.free)
            if prefix_caching:
                from metrale.cache.snapshots import SnapshotCache
                self.snapshots = SnapshotCache(num_snapshots, self._states.snapshot_base)
                self.blocks.resume_filter = self.snapshots.resume_blocks
        if self.speculator is not None:
            self.scheduler.preempt_listeners.append(self.speculator.release)
            if self.speculator.needs_hidden:   # MTP: forwards keep hidden rows
                self.backend = self.speculator.drafter.tap(self.backend)
        self.stats = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0}
        self.step_log: list | None = None     # set to [] to log (tokens, KV tokens read) per forward
        self._collect: dict[str, RequestOutput | None] = {}   # outputs generate() waits for
        self._text_at_end = False     # new requests detokenize at their end (inside generate())
        self._groups: dict[str, _Group] = {}                  # requests with n > 1 / best_of > 1
        self._hidden: set[str] = set()                        # best_of candidates whose deltas poll() drops
        self._outbox: list[StreamDelta] = []                  # completions of finished best_of groups
        self._driver = None                                   # metrale/driver.py EngineLoop, while one runs
        self._driver_lock = threading.Lock()
        # levers.overlap: plain greedy decode runs a step ahead (metrale/overlap.py); backends say
        # whether they can feed a step's ids to the next on the device
        self.ahead = AheadLoop(self) if cfg.levers.overlap and getattr(self.backend, "supports_overlap", False) else None

    def _load_draft_backend(self, model: str):
        from metrale.models.assemble import load_draft_backend
        return load_draft_backend(self.cfg, model, num_blocks=self.backend.num_blocks,
                                  vocab_size=self.model_config.vocab_size)

    # ------------------------------------------------------------------ requests
    def default_params(self) -> SamplingParams:
        return self.params_from_config(self.cfg)

    @staticmethod
    def params_from_config(cfg) -> SamplingParams:
        s = cfg.sampling
        return SamplingParams(max_tokens=cfg.max_tokens, temperature=s.temperature, top_k=s.top_k,
                              top_p=s.top_p, min_p=s.min_p, repetition_penalty=s.repetition_penalty,
                              presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                              min_tokens=s.min_tokens, seed=s.seed, ignore_eos=s.ignore_eos)

    def encode_prompt(self, prompt: Prompt, chat: bool = False, system: str | None = None) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InvalidRequestError("prompt: is empty")
            if chat:
                messages = ([{"role": "system", "content": system}] if system else []) + \
                    [{"role": "user", "content": prompt}]
                prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise InvalidRequestError("prompt: token ids must be a non-empty 1-D integer array")
        if ids.min() < 0 or ids.max() >= self.model_config.vocab_size:
            raise InvalidRequestError(f"prompt: token ids must lie in [0, {self.model_config.vocab_size})")
        return [int(t) for t in ids]

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, *,
                    request_id: str | None = None, chat: bool = False) -> str:
        """Queues a request; returns its id. n > 1 / best_of > 1 runs best_of (default n) child
        requests `f"{id}-{j}"` with seeds derived from params.seed (sampling/fanout.py); the
        first computes the prompt and the others start once it has, reusing its KV blocks.
        max_tokens=None generates up to the context: `context_len`, the smaller of max_model_len
        and the KV pool's tokens (then 'length'), so one sequence never needs more than the pool."""
        params = params or self.default_params()
        params.validate(self.model_config.vocab_size)
        k = params.best_of or params.n
        if k > self.scheduler.max_num_seqs:
            raise InvalidRequestError(f"n/best_of: {k} sequences exceed scheduler.max_num_seqs "
                                      f"({self.scheduler.max_num_seqs})")
        ids = self.encode_prompt(prompt, chat=chat, system=self.cfg.system if chat else None)
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt: {len(ids)} tokens do not fit the context of "
                                      f"{self.max_model_len} tokens")
        need = len(ids) + (params.max_tokens or 1)
        if min(need, self.max_model_len) > capacity:
            raise InvalidRequestError(f"prompt + max_tokens: {need} tokens exceed the whole KV cache "
                                      f"({capacity} tokens); lower max_tokens or enlarge the cache")
        text = prompt if isinstance(prompt, str) else None
        if k == 1:
            self._check_free_id(request_id)
            self.stats["prompt_tokens"] += len(ids)
            return self._add_sequence(ids, params, request_id or "", text).seq.request_id
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        children = [f"{rid}-{j}" for j in range(k)]
        for cid in [rid] + children:
            self._check_free_id(cid)
        self.stats["prompt_tokens"] += len(ids)       # one prompt, computed once (then shared)
        group = self._groups[rid] = _Group(rid, params, children, hidden=k > params.n)
        states = [self._add_sequence(ids, child, cid, text, queue=j == 0)
                  for j, (cid, child) in enumerate(zip(children, fanout.expand(params)))]
        for j, st in enumerate(states):
            st.group, st.index = rid, j
            if group.hidden:
                self._hidden.add(st.public_id)     # its own id: poll() drops its deltas
            else:
                st.public_id = rid
        siblings = [st.seq for st in states[1:]]
        if self.blocks.prefix_caching and (len(ids) - 1) // self.blocks.block_size > 0:
            states[0].on_first_delta = lambda: self._start(siblings)
        else:                  # no full block to share: nothing to wait for
            self._start(siblings)
        return rid

    def _start(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.add(seq)

    def _check_free_id(self, request_id: str | None) -> None:
        if request_id is not None and (request_id in self.requests or request_id in self._groups):
            raise InvalidRequestError(f"request_id: '{request_id}' is already running")

    def _add_sequence(self, ids: list[int], params: SamplingParams, request_id: str, prompt: str | None,
                      queue: bool = True) -> RequestState:
        seq = Sequence(list(ids), params, request_id=request_id, prompt=prompt)
        state = self.requests[seq.request_id] = RequestState(seq, self.tokenizer, self.eos_ids, self.context_len,
                                                             text_at_end=self._text_at_end)
        if queue:
            self.scheduler.add(seq)
        return state

    def abort(self, request_id: str) -> StreamDelta | None:
        """Aborts a request (every completion of one with n > 1); returns the finished delta of its
        first unfinished completion, None if it is not running. abort_completions gives them all."""
        deltas = self.abort_completions(request_id)
        return deltas[0] if deltas else None

    def abort_completions(self, request_id: str) -> list[StreamDelta]:
        """Aborts a request; one finished delta per completion that was still running (best_of > n:
        the n best candidates so far, whole)."""
        group = self._groups.get(request_id)
        deltas = []
        for cid in group.children if group is not None else [request_id]:
            state = self.requests.get(cid)
            if state is not None:
                self.scheduler.finish(state.seq, "abort")
                deltas.append(self._finish_delta(cid, "abort"))
        return self._route(deltas)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def is_running(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self._groups

    def request_ids(self) -> list[str]:
        """The ids of the requests still running, as add_request returned them."""
        child = {c for g in self._groups.values() for c in g.children}
        return [r for r in self.requests if r not in child] + list(self._groups)

    def prompt_token_ids(self, request_id: str) -> list[int]:
        group = self._groups.get(request_id)
        return self.requests[group.children[0] if group else request_id].seq.prompt_token_ids

    def poll(self) -> list[StreamDelta]:
        """One step, as requests see it: step() gives a delta per sequence that advanced; here the
        candidates of best_of > n requests are dropped, and when the last of them ends the n
        selected completions come whole (one delta each, `index` 0..n-1). stream(), generate()
        and the server use this."""
        return self._route(self.step())

    def _route(self, deltas: list[StreamDelta]) -> list[StreamDelta]:
        out = []
        for d in deltas:
            if d.request_id in self._hidden:
                if d.finished:
                    self._hidden.discard(d.request_id)
                continue
            out.append(d)
        if self._outbox:
            out.extend(self._outbox)
            self._outbox = []
        return out

    # ---------------------------------------------------------------------- step
    def step(self) -> list[StreamDelta]:
        """Schedules and runs one step. A failure inside it ends only the requests that cause it
        (the 'error: <why>' finish reason): a draw that fails is retried row by row on the same
        logits; a forward that fails is re-run on halves of the step's sequences until the failing
        ones stand alone (dense models; a hybrid model's recurrent states advance in the forward,
        so there the whole step's requests end). The others produce their tokens normally."""
        if self.ahead is not None and self.ahead.inflight is not None:
            return self.ahead.advance()          # the next step was queued before this one was read
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.requests, self.blocks)
        plan = self.scheduler.schedule()
        deltas = [self._finish_delta(seq.request_id, seq.finish_reason) for seq in plan.preempted]
        if plan.scheduled:
            deltas += self._run_isolating(plan.scheduled)
        return deltas

    def _run_isolating(self, scheduled: list[ScheduledSeq]) -> list[StreamDelta]:
        """_run, bisecting the sequences on a failed forward until the failing ones are alone."""
        try:
            return self._run(scheduled)
        except _StepFailed as failed:
            log.error("a step of %d sequences failed: %s", len(scheduled), failed.reason)
            if len(scheduled) == 1 or not failed.rerunnable:
                return self._fail(scheduled, failed.reason)
            mid = len(scheduled) // 2
            return self._run_isolating(scheduled[:mid]) + self._run_isolating(scheduled[mid:])

    def _fail(self, scheduled: list[ScheduledSeq], reason: str) -> list[StreamDelta]:
        deltas = []
        for s in scheduled:
            if s.seq.request_id in self.requests:
                self.scheduler.finish(s.seq, reason)
                deltas.append(self._finish_delta(s.seq.request_id, reason))
        return deltas

    def _run(self, scheduled: list[ScheduledSeq]) -> list[StreamDelta]:
        """One forward over `scheduled`, then sampling and postprocessing. Raises _StepFailed (with
        no sequence advanced) when the forward fails; a row whose draw or postprocessing fails ends
        with its error and the others go on."""
        deltas: list[StreamDelta] = []
        logits = [s.needs_logits for s in scheduled]       # read once: the sequences change below
        sampling = [s for s, lg in zip(scheduled, logits) if lg]
        states = [self.requests[s.seq.request_id] for s in sampling]
        segments, checkpoints = [], {}
        try:
            for s, lg in zip(scheduled, logits):
                slot = self._state_slot(s.seq)
                ckpt = self._checkpoint(s.seq, slot) if s.draft and slot >= 0 else -1
                if ckpt >= 0:
                    checkpoints[id(s.seq)] = (slot, ckpt)
                first = s.seq.num_computed_tokens
                segments.append(Segment(np.asarray(s.seq.token_slice(first, first + s.num_tokens - len(s.draft))
                                                   + s.draft, dtype=np.int32),
                                        s.seq.num_computed_tokens, np.asarray(s.seq.block_table, dtype=np.int32),
                                        "all" if s.draft else ("last" if lg else "none"),
                                        state_slot=slot, state_checkpoint=ckpt))
        except Exception as exc:   # no state slot / checkpoint left: end the step's requests with the reason
            log.exception("building the step failed")
            for slot, ckpt in checkpoints.values():
                self.state_slots.release(ckpt)
            return self._fail(scheduled, _error_reason(exc))
        batch = build_batch(segments, self.blocks.block_size)
        if self.step_log is not None:         # bench/run_all.py: the KV+weight bandwidth bound
            self.step_log.append((len(batch.token_ids), sum(g.start_pos + len(g.token_ids) for g in segments)))
        verifying = any(s.draft for s in sampling)
        if self.ahead is not None and not verifying and self.ahead.eligible(scheduled, states):
            try:
                return self.ahead.start([s.seq for s in scheduled], batch)
            except Exception as exc:             # the launch failed: nothing advanced
                log.exception("forward failed")
                raise _StepFailed(_error_reason(exc), rerunnable=True) from exc
        try:
            if verifying:
                emitted = self._forward_and_verify(batch, sampling, states)
            else:
                emitted = self._forward_and_sample(batch, states)
        except Exception as exc:  # nothing advanced yet: the caller re-runs the sequences apart
            log.exception("forward failed")
            for slot, ckpt in checkpoints.values():
                self.state_slots.release(ckpt)
            raise _StepFailed(_error_reason(exc), rerunnable=self.state_slots is None) from exc
        if self.speculator is not None and self.speculator.needs_hidden:
            self.speculator.drafter.observe(sampling, [[] if isinstance(t, Exception) else t for t in emitted],
                                            self.backend.take_hidden())
        if checkpoints:     # hybrid verify blocks: keep the recurrent state after the accepted tokens
            for s, tokens in zip(sampling, emitted):
                if id(s.seq) in checkpoints:
                    slot, ckpt = checkpoints[id(s.seq)]
                    accepted = len(tokens) - 1 if not isinstance(tokens, Exception) else 0
                    if accepted == len(s.draft):
                        self.state_slots.release(ckpt)
                    else:
                        self.state_slots.rollback(slot, ckpt, 1 + accepted)
        if self.snapshots is not None:
            self._take_snapshots(scheduled)
        self.stats["steps"] += 1
        for s, lg in zip(scheduled, logits):
            if not lg:
                s.seq.num_computed_tokens += s.num_tokens
                self.blocks.commit_full_blocks(s.seq)
        for s, state, tokens in zip(sampling, states, emitted):
            if isinstance(tokens, Exception):       # its draw failed (logged there): it alone ends
                deltas += self._fail([s], _error_reason(tokens))
                continue
            deltas += self._commit(s, state, tokens, verifying)
        return deltas

    def _commit(self, s: ScheduledSeq, state: RequestState, tokens: list, verifying: bool) -> list[StreamDelta]:
        """_postprocess, where a failure (its stop check, detokenizing) ends that request alone."""
        try:
            return [self._postprocess(s, state, tokens, verifying)]
        except Exception as exc:
            log.exception("request %s failed", s.seq.request_id)
            return self._fail([s], _error_reason(exc))

    def _postprocess(self, s: ScheduledSeq, state: RequestState, tokens: list, verifying: bool) -> StreamDelta:
        """Advances one sampled sequence by its emitted tokens; its delta (finished or not)."""
        seq = s.seq
        before = seq.num_tokens
        # K/V is right for the chunk's real tokens and for the drafts that were accepted
        seq.num_computed_tokens += s.num_tokens - len(s.draft) + (len(tokens) - 1 if s.draft else 0)
        reason = None
        for token in tokens:
            if verifying:     # drawn, not yet accepted: advance sampling as plain decoding would
                state.sampling.accept(*token)
                token = token.token
            reason = state.append(int(token))
            self.stats["generated_tokens"] += 1
            if reason is not None:
                break
        if s.draft:
            self.speculator.committed(seq, before, len(s.draft), len(tokens) - 1)
        self.blocks.commit_full_blocks(seq)     # before finishing: a prompt that ends at once is cached too
        if reason is not None:
            self.scheduler.finish(seq, reason)
            return self._finish_delta(seq.request_id, reason)
        if s.draft:
            self.blocks.trim(seq)
        return state.delta(None)

    def _forward_and_verify(self, batch, sampling, states: list[RequestState]) -> list[list[Drawn]]:
        """A step with verify blocks (metrale/spec/speculator.py): row j of a block is sampled as
        plain decoding would sample it after the block's first j drafts (penalties, bias, min_tokens,
        grammar mask, forced tokens, logprobs, the seeded draw of that step); each block emits its
        accepted tokens, other rows one token. SamplingStates are advanced by the caller."""
        rows = self.speculator.rows(sampling, states)
        if self.sampler.plain_greedy(rows):
            drawn = [Drawn(int(t)) for t in self.backend.forward_greedy(batch)]
            return self.speculator.accept_blocks(sampling, rows, drawn)
        self.sampler.start_masks(rows)
        try:
            logits = self.sampler.forward(self.backend, batch, rows)
        finally:
            masks = self.sampler.finish_masks()
        drawn, packed = self.sampler.draw(logits, rows, masks)
        return self.speculator.accept_blocks(sampling, rows, drawn,
                                             lambda r: self.sampler.row_distribution(logits, packed, r))

    def _state_slot(self, seq: Sequence) -> int:
        """The sequence's recurrent-state slot (-1: not a hybrid model). A sequence that gets its
        slot with tokens already computed resumes from a prefix-cache hit: the snapshot of the last
        reused block (BlockManager.resume_filter admitted the hit only up to one) is copied in."""
        if self.state_slots is None:
            return -1
        fresh = self.state_slots.slot(seq) < 0
        slot = self.state_slots.allocate(seq)
        if slot is None:   # slots are sized to max_num_seqs, so a running sequence always has one
            raise RuntimeError("no free recurrent-state slot")
        if fresh and seq.num_computed_tokens > 0:
            nblocks = seq.num_computed_tokens // self.blocks.block_size
            snapshot = self.snapshots.get(seq.block_hashes[nblocks - 1]) if self.snapshots is not None else None
            if snapshot is None:
                raise RuntimeError(f"sequence {seq.request_id} resumes at token {seq.num_computed_tokens} "
                                   "without a recurrent-state snapshot there")
            self._states.copy_state(snapshot, slot)
        return slot

    def _checkpoint(self, seq: Sequence, slot: int) -> int:
        """A checkpoint of slot before a verify block (docs/hybrid.md); there is one per sequence
        slot, so a speculating sequence always finds one."""
        ckpt = self.state_slots.checkpoint(slot)
        if ckpt is None:
            raise RuntimeError(f"no free recurrent-state checkpoint for {seq.request_id}")
        return ckpt

    def _take_snapshots(self, scheduled) -> None:
        """After a forward of a hybrid model with prefix caching: keep the recurrent states at the
        full-block boundaries that prefill segments reached, keyed by the chained hash of the block
        ending there: the state the pool staged at every `snapshot_every` tokens inside a segment,
        and the slot's state when a prefill chunk ends on a block boundary (docs/hybrid.md)."""
        staged = self._states.take_staged()
        bs = self.blocks.block_size
        for s in scheduled:
            seq, slot = s.seq, self.state_slots.slot(s.seq)
            if s.draft or s.num_tokens < 2 or slot < 0:
                continue
            end = seq.num_computed_tokens + s.num_tokens   # before the engine advances the counter
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
                    self._states.copy_state(slot, sid)
                else:
                    self._states.store_snapshot(staged[(slot, p)], sid)

    def _prefix_hash(self, seq: Sequence, nblocks: int) -> int:
        """The chained hash of seq's first nblocks full blocks (the block manager's hash)."""
        bs, toks = self.blocks.block_size, seq.token_ids
        if nblocks <= len(seq.block_hashes):
            return seq.block_hashes[nblocks - 1]
        h = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), nblocks):
            h = self.blocks.chain_hash(h, toks[i * bs:(i + 1) * bs])
        return h

    def _finish_delta(self, request_id: str, reason: str | None) -> StreamDelta:
        state = self.requests.pop(request_id)
        if self.speculator is not None:
            self.speculator.release(state.seq)
        if self.state_slots is not None:
            self.state_slots.free(state.seq)
        delta = state.delta(reason or "abort")
        group = self._groups.get(state.group) if state.group is not None else None
        if group is not None:
            group.outputs[request_id] = state.output()
            if len(group.outputs) == len(group.children):
                self._finish_group(group)
        elif request_id in self._collect:
            self._collect[request_id] = state.output()
        return delta

    def _finish_group(self, group: _Group) -> None:
        del self._groups[group.request_id]
        outs = [group.outputs[c] for c in group.children]
        leader = outs[0]                       # it computed the whole prompt
        chosen = [dataclasses.replace(o, index=i, prompt_logprobs=leader.prompt_logprobs)
                  for i, o in enumerate(fanout.select(outs, group.params))]
        metrics = {"time_to_first_token": min(o.metrics["time_to_first_token"] for o in outs),
                   "latency": max(o.metrics["latency"] for o in outs),
                   "num_preemptions": sum(o.metrics["num_preemptions"] for o in outs),
                   "num_generated_tokens": sum(len(o.token_ids) for o in outs)}
        parent = dataclasses.replace(chosen[0], request_id=group.request_id, metrics=metrics)
        parent.outputs = chosen
        if group.hidden:
            self._outbox.extend(StreamDelta(group.request_id, o.text, o.token_ids, o.finish_reason, o.index,
                                            o.logprobs, o.stop_reason) for o in chosen)
        if group.request_id in self._collect:
            self._collect[group.request_id] = parent

    def _forward_and_sample(self, batch, states: list[RequestState]) -> list[list[int] | Exception]:
        """One forward, then the sampling pipeline (metrale/sampling/sampler.py): per row, its token
        (a list of one) or the exception its draw raised. Grammar bitmasks are computed on the CPU
        while the forward runs; all-greedy plain steps take the argmax path."""
        if not states:
            self.backend.forward(batch)
            return []
        if self.sampler.plain_greedy(states):
            tokens = self.backend.forward_greedy(batch)
            return [self._accept(st, Drawn(int(t))) for st, t in zip(states, tokens)]
        self.sampler.start_masks(states)
        try:
            logits = self.sampler.forward(self.backend, batch, states)
        finally:
            masks = self.sampler.finish_masks()
        try:
            drawn, _ = self.sampler.draw(logits, states, masks)
        except Exception:               # some row cannot be drawn: draw each alone on the same logits
            drawn = [self._draw_row(logits, masks, r, st) for r, st in enumerate(states)]
        return [d if isinstance(d, Exception) else self._accept(st, d) for st, d in zip(states, drawn)]

    def _draw_row(self, logits, masks, r: int, state: RequestState) -> Drawn | Exception:
        try:
            row_mask = masks[r:r + 1] if masks is not None else None
            return self.sampler.draw(logits[r:r + 1], [state], row_mask)[0][0]
        except Exception as exc:
            log.exception("sampling request %s failed", state.seq.request_id)
            return exc

    @staticmethod
    def _accept(state: RequestState, drawn: Drawn) -> list[int] | Exception:
        """Advances the row's SamplingState by its drawn token (once: the draws above advance none)."""
        try:
            state.sampling.accept(*drawn)
        except Exception as exc:
            log.exception("sampling request %s failed", state.seq.request_id)
            return exc
        return [drawn.token]

    # ------------------------------------------------------------ convenience API
    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, chat: bool = False, use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt; with n > 1 its `outputs` holds the n completions."""
        if isinstance(prompts, str) or (isinstance(prompts, np.ndarray) and prompts.ndim == 1):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or self.default_params()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"params: {len(params)} SamplingParams for {len(prompts)} prompts")
        for sp in params:
            sp.validate(self.model_config.vocab_size)   # refuse the batch before any request starts
        if self._driver is not None and self._driver.alive:     # others stream: join the loop thread
            return self._generate_driven(prompts, params, chat)
        ids = []
        self._text_at_end = True      # generate() reads each request's text once, at its end
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.add_request(p, sp, chat=chat))
        except BaseException:
            self._text_at_end = False
            for i in ids:
                self.abort_completions(i)
            raise
        self._collect.update({i: None for i in ids})
        bar = _progress(len(ids), use_tqdm)
        try:
            done = 0
            while done < len(ids):
                self.poll()
                now = sum(self._collect[i] is not None for i in ids)
                if bar is not None and now > done:
                    bar.update(now - done)
                done = now
        finally:
            self._text_at_end = False
            if bar is not None:
                bar.close()
            for i in ids:
                if self.is_running(i):
                    self.abort_completions(i)
        return [self._collect.pop(i) for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, chat: bool = False) -> Iterator[StreamDelta]:
        """Deltas of one request until it ends; with n > 1 they interleave, told apart by `index`
        (best_of > n: the n selected completions come whole at the end). Any number of threads may
        stream from one engine at once: the engine steps on its loop thread (metrale/driver.py)
        while any of them runs, and each gets exactly its own deltas."""
        params = params or self.default_params()
        with self._driven() as loop:
            yield from loop.stream(f"req-{uuid.uuid4().hex[:16]}", prompt, params, chat)

    async def astream(self, prompt: Prompt, params: SamplingParams | None = None, *,
                      chat: bool = False) -> AsyncIterator[StreamDelta]:
        """stream() for asyncio: the engine steps on its loop thread, so the event loop never waits
        for a forward, and concurrent astream()s share its batches."""
        params = params or self.default_params()
        with self._driven() as loop:
            async for delta in loop.astream(f"req-{uuid.uuid4().hex[:16]}", prompt, params, chat):
                yield delta

    def driver(self):
        """The loop thread that steps this engine for concurrent callers (the server holds it for
        its lifetime; library streams hold it while they run). Started on first use."""
        with self._driver_lock:
            return self._driver_locked()

    def _driver_locked(self):
        from metrale.driver import EngineLoop
        d = self._driver
        if d is not None and d.alive and not d.accepting:    # ending: never two threads stepping
            d.join()
        if d is None or not d.alive:
            self._driver = d = EngineLoop(self)
            d.start()
        return d

    @contextlib.contextmanager
    def _driven(self):
        """The loop thread, held by one more library caller; the last one to leave ends it (without
        touching requests), so a later step()/generate() runs inline again."""
        with self._driver_lock:
            loop = self._driver_locked()
            loop.hold()
        try:
            yield loop
        finally:
            with self._driver_lock:
                ended = loop.release()
            if ended:
                loop.join()

    def _generate_driven(self, prompts: list, params: list[SamplingParams], chat: bool) -> list[RequestOutput]:
        """generate() while the loop thread steps the engine: each request submitted to it."""
        with self._driven() as loop:
            ids = [f"req-{uuid.uuid4().hex[:16]}" for _ in prompts]
            self._collect.update({i: None for i in ids})
            try:
                sinks = []
                for rid, p, sp in zip(ids, prompts, params):     # all queued first: one batch
                    sinks.append((queue.SimpleQueue(), sp.n))
                    loop.submit(rid, p, sp, sinks[-1][0], chat)
                for sink, left in sinks:
                    while left:
                        left -= sink.get().finished
            finally:
                for rid in ids:
                    if self._collect.get(rid) is None:
                        loop.abort(rid, wait=True)
            return [self._collect.pop(i) for i in ids]

    def memory_report(self) -> dict:
        return self.backend.memory_report()


class _StepFailed(Exception):
    """A forward failed before any sequence advanced; rerunnable: its sequences may run again apart
    (dense KV is rewritten with the same values; recurrent states would advance twice)."""

    def __init__(self, reason: str, rerunnable: bool):
        super().__init__(reason)
        self.reason, self.rerunnable = reason, rerunnable


def _error_reason(exc: BaseException) -> str:
    return f"error: {type(exc).__name__}: {exc}"


def _refuse_hybrid_spec(method: str) -> None:
    """Drafters that cannot run on a hybrid (Gated DeltaNet) target yet (docs/hybrid.md)."""
    why = {"self": "the layer-prefix drafter would advance the Gated DeltaNet states of the target's "
                   "first layers with draft tokens (those layers would need draft slots of their own)",
           "mtp": "hybrid checkpoints' MTP heads (mtp.* tensors) are not loaded"}
    if method in ("none", "ngram", "draft"):
        return
    raise ValueError(f"spec.method={method} is not supported for hybrid (Gated DeltaNet) models: "
                     f"{why.get(method, 'this drafter is not wired for recurrent-state rollback')}; "
                     "use ngram or draft (a dense draft model) (docs/hybrid.md)")


def _snapshot_every(block_size: int) -> int:
    """Tokens between the recurrent-state snapshots taken inside a prefill segment: whole blocks,
    at least 64 tokens (the chunked GDN form's chunk, so the split costs no speed)."""
    return block_size * max(1, -(-64 // block_size))


def _progress(total: int, enabled: bool):
    if not enabled or total < 2:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="generate", unit="req", leave=False)
