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
from metrale.cache.recurrent import RecurrentStates
from metrale.groups import FanoutGroups
from metrale.models.config import ModelConfig
from metrale.options import SchedulerOptions, SpecOptions, StateOptions
from metrale.outputs import RequestOutput, StreamDelta, error_reason
from metrale.overlap import AheadLoop
from metrale.request import RequestState
from metrale.runner import ModelRunner, StepFailed, StepOutput
from metrale.sampling import fanout
from metrale.sampling.params import InvalidRequestError, SamplingParams
from metrale.sampling.sampler import Sampler
from metrale.scheduler.scheduler import ScheduledSeq, Scheduler
from metrale.scheduler.sequence import Sequence
from metrale.settings import compose, to_overrides
from metrale.spec.speculator import make_speculator

log = logging.getLogger("metrale")

Prompt = str | list[int] | np.ndarray


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
        self.runner: ModelRunner | None = None
        self.model_config, self.tokenizer, self.backend = parts
        self.load_seconds = time.perf_counter() - t0
        self.config: ModelConfig = self.model_config
        bs = self.backend.block_size
        hybrid = self.model_config.is_hybrid
        sched, state, spec = SchedulerOptions.of(cfg), StateOptions.of(cfg), SpecOptions.of(cfg)
        self._states = self.backend.states                  # hybrid models: the recurrent-state pool
        num_snapshots = state.snapshots if self._states is not None else 0
        prefix_caching = cfg.levers.prefix_caching and (not hybrid or num_snapshots > 0)
        if hybrid and cfg.levers.prefix_caching and not prefix_caching:
            log.info("prefix caching is off for this hybrid model: no recurrent-state snapshots "
                     "(state.snapshots=0)")
        self.blocks = BlockManager(self.backend.num_blocks, bs, prefix_caching)
        self.max_model_len = min(self.model_config.max_position, sched.max_model_len or self.model_config.max_position,
                                 getattr(self.backend, "max_model_len", None) or self.model_config.max_position)
        # the most tokens one sequence can hold: max_tokens=None ends with 'length' here, as vLLM's
        # runs to max_model_len (which vLLM refuses to set above what the KV pool holds)
        self.context_len = min(self.max_model_len, self.blocks.num_blocks * bs)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=sched.max_num_seqs,
                                   max_num_batched_tokens=sched.max_num_batched_tokens,
                                   no_mix=sched.no_mix, preempt_mode=sched.preempt_mode)
        self.eos_ids = tuple(self.tokenizer.eos_token_ids or self.model_config.eos_token_ids)
        self.requests: dict[str, RequestState] = {}
        self.min_p_floor = self.model_config.min_p_floor if cfg.levers.min_p_floor else 0.0
        self.sampler = Sampler(self.backend, self.model_config.vocab_size, self.min_p_floor)
        if hybrid:
            _refuse_hybrid_spec(spec.method)
        self.speculator = make_speculator(spec, self.backend, self.model_config, self._load_draft_backend)
        self.recurrent: RecurrentStates | None = None    # hybrid models: state slots, checkpoints, snapshots
        if self._states is not None:
            self.recurrent = RecurrentStates(
                self._states, self.blocks, max_num_seqs=sched.max_num_seqs,
                spec_k=spec.num_drafts if self.speculator is not None else 0,
                num_snapshots=num_snapshots, prefix_caching=prefix_caching)
            self.scheduler.preempt_listeners.append(self.recurrent.free)
        if self.speculator is not None:
            self.scheduler.preempt_listeners.append(self.speculator.release)
            self.scheduler.on_verified = self.speculator.committed
            if self.speculator.needs_hidden:   # MTP: forwards keep hidden rows
                self.backend = self.speculator.drafter.tap(self.backend)
        self.runner = ModelRunner(self.backend, self.sampler, self.speculator, self.recurrent, self.blocks)
        self.stats = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0}
        self._collect: dict[str, RequestOutput | None] = {}   # outputs generate() waits for
        self._text_at_end = False     # new requests detokenize at their end (inside generate())
        self.groups = FanoutGroups()                          # requests with n > 1 / best_of > 1
        self._driver = None                                   # metrale/driver.py EngineLoop, while one runs
        self._driver_lock = threading.Lock()
        # levers.overlap: plain greedy decode runs a step ahead (metrale/overlap.py); backends say
        # whether they can feed a step's ids to the next on the device
        self.ahead = AheadLoop(self) if cfg.levers.overlap and self.backend.supports_overlap else None

    @property
    def backend(self):
        return self._backend

    @backend.setter
    def backend(self, backend) -> None:
        """The runner's backend too (tests wrap it to inject failures)."""
        self._backend = backend
        if self.runner is not None:
            self.runner.backend = backend

    @property
    def step_log(self) -> list | None:
        """Set to [] to log (tokens, KV tokens read) per forward (bench/run_all.py)."""
        return self.runner.step_log

    @step_log.setter
    def step_log(self, value: list | None) -> None:
        self.runner.step_log = value

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
        if chat and self.tokenizer.chat_stop_strings:     # a transcript template's next turn ends the reply
            params = dataclasses.replace(params, stop=params.stop_strings + [
                s for s in self.tokenizer.chat_stop_strings if s not in params.stop_strings])
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
        states = [self._add_sequence(ids, child, cid, text, queue=j == 0)
                  for j, (cid, child) in enumerate(zip(children, fanout.expand(params)))]
        self.groups.open(rid, params, children, states)
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
        if request_id is not None and (request_id in self.requests or request_id in self.groups):
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
        group = self.groups.get(request_id)
        deltas = []
        for cid in group.children if group is not None else [request_id]:
            state = self.requests.get(cid)
            if state is not None:
                self.scheduler.finish(state.seq, "abort")
                deltas.append(self._finish_delta(cid, "abort"))
        return self.groups.route(deltas)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def is_running(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self.groups

    def request_ids(self) -> list[str]:
        """The ids of the requests still running, as add_request returned them."""
        child = self.groups.child_ids()
        return [r for r in self.requests if r not in child] + list(self.groups.groups)

    def prompt_token_ids(self, request_id: str) -> list[int]:
        group = self.groups.get(request_id)
        return self.requests[group.children[0] if group else request_id].seq.prompt_token_ids

    def poll(self) -> list[StreamDelta]:
        """One step, as requests see it: step() gives a delta per sequence that advanced; here the
        candidates of best_of > n requests are dropped, and when the last of them ends the n
        selected completions come whole (one delta each, `index` 0..n-1). stream(), generate()
        and the server use this."""
        return self.groups.route(self.step())

    # ---------------------------------------------------------------------- step
    def step(self) -> list[StreamDelta]:
        """Schedules and runs one step. A failure inside it ends only the requests that cause it
        (the 'error: <why>' finish reason): a draw that fails is retried row by row on the same
        logits; a forward that fails is re-run on halves of the step's sequences until the failing
        ones stand alone (dense models; a hybrid model's recurrent states advance in the forward,
        so there the whole step's requests end). The others produce their tokens normally."""
        if self.ahead is not None and self.ahead.inflight is not None:
            return self._deltas(self.ahead.advance())     # queued before this one was read
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.requests, self.blocks)
        plan = self.scheduler.schedule()
        deltas = [self._finish_delta(seq.request_id, seq.finish_reason) for seq in plan.preempted]
        if plan.scheduled:
            deltas += self._run_isolating(plan.scheduled)
        return deltas

    def _run_isolating(self, scheduled: list[ScheduledSeq]) -> list[StreamDelta]:
        """_run, bisecting the sequences on a failed step until the failing ones are alone."""
        try:
            return self._run(scheduled)
        except StepFailed as failed:
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
        """prepare -> execute (or launch ahead) -> postprocess. Raises StepFailed, with no
        sequence advanced, when the step fails."""
        step = self.runner.prepare(scheduled, self.requests)
        if self.ahead is not None and not step.verifying and self.ahead.eligible(scheduled, step.states):
            try:
                out = self.ahead.start(step)
            except Exception as exc:             # the launch failed: nothing advanced
                log.exception("forward failed")
                raise StepFailed(error_reason(exc), rerunnable=True) from exc
            return self._deltas(out)
        return self._deltas(self.runner.execute(step))

    def _deltas(self, out: StepOutput | None) -> list[StreamDelta]:
        """Postprocess a step's output; a delta per sampled sequence (finished or not)."""
        if out is None:
            return []
        self.stats["steps"] += 1
        deltas = []
        for a in self.scheduler.postprocess(out, self.requests):
            self.stats["generated_tokens"] += a.appended
            st = a.state
            if a.reason is not None:
                deltas.append(self._finish_delta(st.seq.request_id, a.reason))
            elif not (st.output_only and st.group is None and st.on_first_delta is None):
                deltas.append(self._delta(st))     # (generate()'s own requests: read whole at their end)
        return deltas

    def _delta(self, state: RequestState) -> StreamDelta:
        """A running request's delta; a failure building it (detokenizing) ends that request alone."""
        try:
            return state.delta(None)
        except Exception as exc:
            log.exception("request %s failed", state.seq.request_id)
            reason = error_reason(exc)
            self.scheduler.finish(state.seq, reason)
            return self._finish_delta(state.seq.request_id, reason)

    def _finish_delta(self, request_id: str, reason: str | None) -> StreamDelta:
        state = self.requests.pop(request_id)
        if self.speculator is not None:
            self.speculator.release(state.seq)
        if self.recurrent is not None:
            self.recurrent.free(state.seq)
        delta = state.delta(reason or "abort")
        if state.group is not None and state.group in self.groups:
            parent = self.groups.child_finished(state.group, request_id, state.output())
            if parent is not None and state.group in self._collect:
                self._collect[state.group] = parent
        elif request_id in self._collect:
            self._collect[request_id] = state.output()
        return delta

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


def _progress(total: int, enabled: bool):
    if not enabled or total < 2:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="generate", unit="req", leave=False)
