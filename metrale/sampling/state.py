"""SamplingState: what one request's sampling remembers between steps.

- its Philox key (the seed; a random one when the request has none) and step counter: the draw of
  step s depends only on (seed, s, the row's logits), never on the rest of the batch;
- the penalty window: the tokens after the last tool-call END token (prompt and output; the whole
  sequence when the tokenizer has no such token). repetition_penalty applies to every token of the
  window, presence/frequency to the generated tokens of the window (their counts);
- the grammar matcher (llguidance), not applied and not advanced inside a <think>...</think> span
  (one that the prompt leaves open, or one opened by the first generated token: the think-start
  token is allowed through the grammar mask at step 0);
- the first-token policy: `require_tool_call` forces the tool-call START token as the first token
  of the answer (the first token outside a think span);
- the logprobs of the generated tokens ({token id: logprob} per step) and their cumulative sum.

`fork()` gives the state as it would be after more tokens without touching this one (speculative
decoding samples each verified position from a fork advanced by the draft tokens before it).
"""
from __future__ import annotations

import copy
import secrets
from dataclasses import dataclass

import numpy as np

from kernels_numba.sampling_ref import adj_word
from metrale.sampling.params import SamplingParams

TOOL_CALL_TOKENS = (("<tool_call>", "</tool_call>"), ("<|tool_call_start|>", "<|tool_call_end|>"),
                    ("<|python_tag|>", "<|eom_id|>"))
THINK_TOKENS = (("<think>", "</think>"), ("<|begin_of_thought|>", "<|end_of_thought|>"))


@dataclass(frozen=True)
class SpecialTokens:
    tool_call_start_token_id: int | None = None
    tool_call_end_token_id: int | None = None
    think_start_token_id: int | None = None
    think_end_token_id: int | None = None


def special_tokens(tokenizer) -> SpecialTokens:
    """Single-token tool-call and think markers of a tokenizer (None where it has none)."""
    cached = getattr(tokenizer, "_metrale_special_tokens", None)
    if isinstance(cached, SpecialTokens):
        return cached
    lookup = getattr(tokenizer, "token_to_id", None) or getattr(getattr(tokenizer, "backend", None), "token_to_id", None)

    def pair(options):
        if lookup is None:
            return None, None
        for a, b in options:
            ia, ib = lookup(a), lookup(b)
            if ia is not None and ib is not None:
                return int(ia), int(ib)
        return None, None

    found = SpecialTokens(*pair(TOOL_CALL_TOKENS), *pair(THINK_TOKENS))
    try:
        tokenizer._metrale_special_tokens = found
    except AttributeError:
        pass
    return found


def seed_key(seed: int | None) -> tuple[int, int]:
    """64-bit Philox key (lo, hi) of a seed; None draws a random one."""
    s = secrets.randbits(64) if seed is None else int(seed) % (1 << 64)
    return s & 0xFFFFFFFF, s >> 32


def _last_index(ids: list[int], token: int | None) -> int:
    if token is None:
        return -1
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1


class SamplingState:
    def __init__(self, params: SamplingParams, prompt_ids: list[int], tokenizer, eos_ids=()):
        self.params = params
        self.eos_ids = tuple(int(t) for t in eos_ids)
        self.special = special_tokens(tokenizer)
        self.seed_lo, self.seed_hi = seed_key(params.seed)
        self.step = 0
        sp = self.special
        cut = _last_index(prompt_ids, sp.tool_call_end_token_id)
        self.window_prompt = np.unique(np.asarray(prompt_ids[cut + 1:], dtype=np.int32))
        self.counts: dict[int, int] = {}
        self.in_think = (sp.think_start_token_id is not None
                         and _last_index(prompt_ids, sp.think_start_token_id) > _last_index(prompt_ids, sp.think_end_token_id))
        self.answer_started = False
        self.grammar = None
        from metrale.sampling.grammar import GrammarState, new_matcher
        matcher = new_matcher(params, tokenizer, eos_ids)
        if matcher is not None:
            self.grammar = GrammarState(matcher, int(tokenizer.vocab_size))
        self.want_logprobs = params.logprobs is not None
        self.logprobs: list[dict[int, float]] | None = [] if self.want_logprobs else None
        self.cumulative_logprob = 0.0 if self.want_logprobs else None
        self.prompt_ids = prompt_ids
        self.wants_prompt_logprobs = params.prompt_logprobs is not None
        self.prompt_logprobs: list[dict[int, float] | None] | None = None

    # ------------------------------------------------------------ per-step questions
    @property
    def penalized(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    def forced_token(self) -> int | None:
        """The token this step must be: EOS once the grammar matcher failed (a token it refused got
        through), the tool-call START token as the first answer token under require_tool_call."""
        if self.grammar is not None and self.grammar.failed and self.eos_ids:
            return self.eos_ids[0]
        if (self.params.require_tool_call and not self.answer_started and not self.in_think
                and self.special.tool_call_start_token_id is not None):
            return self.special.tool_call_start_token_id
        return None

    def grammar_active(self) -> bool:
        return self.grammar is not None and not self.in_think and not self.grammar.failed

    def needs_mask(self) -> bool:
        return self.forced_token() is not None or self.grammar_active()

    def plain_greedy(self, eos_masked: bool) -> bool:
        """Argmax of the raw logits is this step's token (the batched fast path)."""
        p = self.params
        return (p.greedy and not self.penalized and not p.logit_bias and not eos_masked
                and not self.want_logprobs and not self.wants_prompt_logprobs and not self.needs_mask())

    def device_only(self, eos_masked: bool) -> bool:
        """The device pipeline alone draws this row's next tokens: nothing it reads changes with the
        tokens drawn but the penalty counts, which the pipeline brings up to date itself with the
        one token not yet accepted (kernels_numba/sampling.py, pending tokens); no min_tokens ban,
        grammar, forced token or logprobs. So a step may be queued before the last one's token is
        read (metrale/overlap.py)."""
        p = self.params
        return (not eos_masked and self.grammar is None and not p.require_tool_call
                and not self.want_logprobs and not self.wants_prompt_logprobs)

    def adjustments(self, banned: set[int] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token ids, adj_rep words, additive terms) of this row's sparse adjustments: a word holds
        the repetition flag and the token's count in the window (sampling_ref.adj_word; the device
        subtracts frequency * count + presence), an additive term the logit_bias or -inf for a ban."""
        p = self.params
        add: dict[int, float] = {}
        rep: dict[int, int] = {}
        if self.penalized:
            flag = int(p.repetition_penalty != 1.0)
            if flag:
                for t in self.window_prompt.tolist():
                    rep[t] = 1
                    add[t] = 0.0
            for t, c in self.counts.items():
                rep[t] = adj_word(flag, c)
                add[t] = 0.0
        for t, b in (p.logit_bias or {}).items():
            add[int(t)] = add.get(int(t), 0.0) + float(b)
            rep.setdefault(int(t), 0)
        for t in banned or ():
            add[int(t)] = -np.inf
            rep.setdefault(int(t), 0)
        if not add:
            return _EMPTY_I, _EMPTY_I, _EMPTY_F
        toks = np.fromiter(add.keys(), dtype=np.int32, count=len(add))
        return (toks, np.fromiter((rep[t] for t in add), dtype=np.int32, count=len(add)),
                np.fromiter(add.values(), dtype=np.float32, count=len(add)))

    def window_end(self) -> int:
        """The token that empties the penalty window (the tool-call END token), -1 if none."""
        t = self.special.tool_call_end_token_id
        return -1 if t is None else int(t)

    def fork(self) -> "SamplingState":
        """A look-ahead copy: accept() on it leaves this state as it is (penalty counts copied, the
        grammar matcher copied on its first token, no logprobs recorded, no prompt logprobs)."""
        f = copy.copy(self)
        f.counts = dict(self.counts) if self.penalized else {}
        f.grammar = self.grammar.fork() if self.grammar is not None else None
        f.logprobs = f.cumulative_logprob = None
        f.wants_prompt_logprobs = False
        return f

    # ------------------------------------------------------------ after sampling
    def accept(self, token: int, logprob: float | None = None, top: dict[int, float] | None = None,
               forced: bool = False) -> None:
        sp = self.special
        self.step += 1
        if token == sp.think_start_token_id and self.step == 1 and not self.in_think:
            self.in_think = True
        elif self.in_think:
            if token == sp.think_end_token_id:
                self.in_think = False
        else:
            if self.grammar is not None and not forced and not self.grammar.failed:
                self.grammar.consume(token)
            self.answer_started = True
        if token == sp.tool_call_end_token_id:
            self.counts.clear()
            self.window_prompt = _EMPTY_I
        else:
            self.counts[token] = self.counts.get(token, 0) + 1
        if self.logprobs is not None:
            entry = dict(top or {})
            if logprob is not None:
                entry[int(token)] = float(logprob)
                self.cumulative_logprob += float(logprob)
            self.logprobs.append(entry)

    def set_prompt_logprobs(self, rows: np.ndarray, first: int) -> None:
        """rows[j] = raw logits at prompt position first + j (predicting prompt token first + j + 1).
        Positions before `first` (prefix-cached or computed in an earlier chunk) get None."""
        from kernels_numba.sampling import logprob_stats_ref
        k = int(self.params.prompt_logprobs)
        out: list[dict[int, float] | None] = [None] * len(self.prompt_ids)
        for j in range(rows.shape[0]):
            q = first + j + 1
            lse, ids, vals = logprob_stats_ref(rows[j], k)
            entry = dict(zip(ids.tolist(), vals.tolist()))
            entry[int(self.prompt_ids[q])] = float(rows[j, self.prompt_ids[q]] - lse)
            out[q] = entry
        self.prompt_logprobs = out
        self.wants_prompt_logprobs = False

    def output_fields(self) -> dict:
        out = {}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
            out["cumulative_logprob"] = self.cumulative_logprob
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs
        return out


_EMPTY_I = np.zeros(0, dtype=np.int32)
_EMPTY_F = np.zeros(0, dtype=np.float32)
