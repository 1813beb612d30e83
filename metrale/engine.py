"""Engine: the public API. NumPy in, NumPy out; knows nothing of kernels.

    engine = Engine(model="smollm2-135m", device="auto", levers={"no_mix": False})
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    for delta in engine.stream("Hello", SamplingParams(max_tokens=32)): print(delta.text, end="")

Every request ends with an output: finished normally ('stop' / 'length'), aborted ('abort'),
or with 'error: <why>'. Requests that cannot run are refused by add_request with an
InvalidRequestError that names the field.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Iterable, Iterator, Sequence as Seq

import numpy as np

from metrale.cache.block_manager import BlockManager
from metrale.models.config import ModelConfig
from metrale.outputs import RequestOutput, StreamDelta
from metrale.request import RequestState
from metrale.runtime.batch import Segment, build_batch
from metrale.sampling.params import InvalidRequestError, SamplingParams
from metrale.sampling.sampler import Sampler, filter_probs
from metrale.scheduler.scheduler import Scheduler
from metrale.scheduler.sequence import Sequence
from metrale.settings import compose, to_overrides
from metrale.spec.speculator import Speculator, make_speculator

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
            from metrale.models.load import load_model
            parts = load_model(cfg)
        self.model_config, self.tokenizer, self.backend = parts
        self.load_seconds = time.perf_counter() - t0
        self.config: ModelConfig = self.model_config
        bs = self.backend.block_size
        self.blocks = BlockManager(self.backend.num_blocks, bs, cfg.levers.prefix_caching)
        self.max_model_len = min(self.model_config.max_position,
                                 cfg.scheduler.max_model_len or self.model_config.max_position)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=cfg.scheduler.max_num_seqs,
                                   max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
                                   no_mix=cfg.levers.no_mix, preempt_mode=cfg.levers.preempt_mode)
        self.eos_ids = tuple(self.tokenizer.eos_token_ids or self.model_config.eos_token_ids)
        self.requests: dict[str, RequestState] = {}
        self.min_p_floor = self.model_config.min_p_floor if cfg.levers.min_p_floor else 0.0
        self.sampler = Sampler(self.backend, self.model_config.vocab_size, self.min_p_floor)
        self.speculator = make_speculator(cfg, self.backend, self.model_config, self._load_draft_backend)
        if self.speculator is not None:
            self.scheduler.preempt_listeners.append(self.speculator.release)
        self.stats = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0}
        self._collect: dict[str, RequestOutput | None] = {}   # outputs generate() waits for

    def _load_draft_backend(self, model: str):
        from metrale.models.load import load_draft_backend
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
        params = params or self.default_params()
        params.validate(self.model_config.vocab_size)
        if params.n != 1:
            raise InvalidRequestError("n: only n=1 is supported so far")
        ids = self.encode_prompt(prompt, chat=chat, system=self.cfg.system if chat else None)
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt: {len(ids)} tokens do not fit the context of "
                                      f"{self.max_model_len} tokens")
        need = len(ids) + (params.max_tokens or 1)
        if min(need, self.max_model_len) > capacity:
            raise InvalidRequestError(f"prompt + max_tokens: {need} tokens exceed the whole KV cache "
                                      f"({capacity} tokens); lower max_tokens or enlarge the cache")
        if request_id is not None and request_id in self.requests:
            raise InvalidRequestError(f"request_id: '{request_id}' is already running")
        seq = Sequence(ids, params, request_id=request_id or "",
                       prompt=prompt if isinstance(prompt, str) else None)
        self.requests[seq.request_id] = RequestState(seq, self.tokenizer, self.eos_ids, self.max_model_len)
        self.scheduler.add(seq)
        self.stats["prompt_tokens"] += len(ids)
        return seq.request_id

    def abort(self, request_id: str) -> StreamDelta | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.finish(state.seq, "abort")
        return state.delta("abort")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---------------------------------------------------------------------- step
    def step(self) -> list[StreamDelta]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.requests, self.blocks)
        plan = self.scheduler.schedule()
        deltas = [self._finish_delta(seq.request_id, seq.finish_reason) for seq in plan.preempted]
        if not plan.scheduled:
            return deltas
        sampling = [s for s in plan.scheduled if s.needs_logits]
        states = [self.requests[s.seq.request_id] for s in sampling]
        if any(s.draft for s in sampling) and not all(Speculator.eligible(st) for st in states):
            for s in sampling:            # a row that needs the full pipeline: verify nothing this step
                s.num_tokens -= len(s.draft)
                s.draft = []
        segments = [Segment(np.asarray(s.seq.token_ids[s.seq.num_computed_tokens:
                                                       s.seq.num_computed_tokens + s.num_tokens - len(s.draft)]
                                       + s.draft, dtype=np.int32),
                            s.seq.num_computed_tokens, np.asarray(s.seq.block_table, dtype=np.int32),
                            "all" if s.draft else ("last" if s.needs_logits else "none"))
                    for s in plan.scheduled]
        batch = build_batch(segments, self.blocks.block_size)
        try:
            if any(s.draft for s in sampling):
                emitted = self._forward_and_verify(batch, sampling, states)
            else:
                emitted = [[int(t)] for t in self._forward_and_sample(batch, states)]
        except Exception as exc:  # a failed step ends its requests with the reason, never silently
            log.exception("forward failed")
            for s in plan.scheduled:
                self.scheduler.finish(s.seq, f"error: {type(exc).__name__}: {exc}")
                deltas.append(self._finish_delta(s.seq.request_id, s.seq.finish_reason))
            return deltas
        self.stats["steps"] += 1
        for s in plan.scheduled:
            if not s.needs_logits:
                s.seq.num_computed_tokens += s.num_tokens
                self.blocks.commit_full_blocks(s.seq)
        for s, state, tokens in zip(sampling, states, emitted):
            seq = s.seq
            before = seq.num_tokens
            # K/V is right for the chunk's real tokens and for the drafts that were accepted
            seq.num_computed_tokens += s.num_tokens - len(s.draft) + (len(tokens) - 1 if s.draft else 0)
            reason = None
            for token in tokens:
                reason = state.append(int(token))
                self.stats["generated_tokens"] += 1
                if reason is not None:
                    break
            if s.draft:
                self.speculator.committed(seq, before, len(s.draft), len(tokens) - 1)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                deltas.append(self._finish_delta(seq.request_id, reason))
                continue
            self.blocks.commit_full_blocks(seq)
            if s.draft:
                self.blocks.trim(seq)
            deltas.append(state.delta(None))
        return deltas

    def _forward_and_verify(self, batch, sampling, states: list[RequestState]) -> list[list[int]]:
        """A step with verify blocks (every sampling row is history-independent, see
        Speculator.eligible): each block's rows become its emitted tokens, other rows one token."""
        greedy = all(st.params.greedy for st in states)
        rows = self.backend.forward_greedy(batch) if greedy else np.asarray(self.backend.forward(batch))
        out, r = [], 0
        for s, st in zip(sampling, states):
            n = 1 + len(s.draft)
            block = rows[r:r + n]
            r += n
            if s.draft:
                tokens = self.speculator.accept(s.seq, st, None if greedy else block, block if greedy else None,
                                                s.draft, lambda row, p=st.params: filter_probs(row, p, self.min_p_floor))
            elif greedy:
                tokens = [int(block[0])]
            else:
                probs = filter_probs(block[0], st.params, self.min_p_floor)
                tokens = [int(self.speculator.rng(st).choice(probs.size, p=probs))]
            for t in tokens:
                st.sampling.accept(int(t))
            out.append(tokens)
        return out

    def _finish_delta(self, request_id: str, reason: str | None) -> StreamDelta:
        state = self.requests.pop(request_id)
        if self.speculator is not None:
            self.speculator.release(state.seq)
        delta = state.delta(reason or "abort")
        if request_id in self._collect:
            self._collect[request_id] = state.output()
        return delta

    def _forward_and_sample(self, batch, states: list[RequestState]) -> np.ndarray:
        """One forward, then the sampling pipeline (metrale/sampling/sampler.py). Grammar bitmasks
        are computed on the CPU while the forward runs; all-greedy plain steps take the argmax path."""
        if not states:
            self.backend.forward(batch)
            return np.zeros(0, dtype=np.int32)
        if self.sampler.plain_greedy(states):
            return self.sampler.accept_greedy(states, self.backend.forward_greedy(batch))
        self.sampler.start_masks(states)
        try:
            logits = self.sampler.forward(self.backend, batch, states)
        finally:
            masks = self.sampler.finish_masks()
        return self.sampler.sample(logits, states, masks)

    # ------------------------------------------------------------ convenience API
    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, chat: bool = False, use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, np.ndarray) and prompts.ndim == 1):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or self.default_params()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"params: {len(params)} SamplingParams for {len(prompts)} prompts")
        for sp in params:
            sp.validate(self.model_config.vocab_size)   # refuse the batch before any request starts
        ids = [self.add_request(p, sp, chat=chat) for p, sp in zip(prompts, params)]
        self._collect.update({i: None for i in ids})
        bar = _progress(len(ids), use_tqdm)
        try:
            while any(self._collect[i] is None for i in ids):
                for delta in self.step():
                    if delta.finished and bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for i in ids:
                if i in self.requests:
                    self.abort(i)
        return [self._collect.pop(i) for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, chat: bool = False) -> Iterator[StreamDelta]:
        rid = self.add_request(prompt, params, chat=chat)
        try:
            while True:
                for delta in self.step():
                    if delta.request_id == rid:
                        yield delta
                        if delta.finished:
                            return
        finally:
            if rid in self.requests:
                self.abort(rid)

    async def astream(self, prompt: Prompt, params: SamplingParams | None = None, *,
                      chat: bool = False) -> AsyncIterator[StreamDelta]:
        for delta in self.stream(prompt, params, chat=chat):
            yield delta
            await asyncio.sleep(0)

    def memory_report(self) -> dict:
        return self.backend.memory_report()


def _progress(total: int, enabled: bool):
    if not enabled or total < 2:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="generate", unit="req", leave=False)
