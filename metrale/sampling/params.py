"""SamplingParams with vLLM's field names; validated when a request is added.

Beyond vLLM: `require_tool_call` (the first answer token is the tokenizer's tool-call START token).
Structured output: at most one of json_schema (dict or JSON text), regex, grammar (Lark, llguidance
dialect) and choice (a list of strings); validate() compiles it and refuses it with llguidance's
message when it cannot be compiled.

Every field is range-checked by `validate` (an InvalidRequestError naming it), so a request that
would overflow or poison a step of the batch it joins is refused before it runs. The bounds:
integers (max_tokens, min_tokens, top_k, n, best_of) fit int32; seeds lie in [-2^63, 2^64)
(taken modulo 2^64); temperature in [0, 1e4]; top_p in (0, 1]; min_p in [0, 1];
repetition_penalty in [0.01, 100] (outside it penalized logits overflow float32);
presence/frequency_penalty in [-2, 2] and logit_bias values in [-100, 100] (OpenAI's and vLLM's
ranges); logprobs and prompt_logprobs in [0, 20]; at most 64 stop strings of at most 1024
characters and 1024 stop token ids. NaN and infinities are refused everywhere.
Documented clamps (no refusal): a temperature below 1e-5 is greedy (vLLM's _SAMPLING_EPS); a top_k
at or above the vocabulary size keeps every token (as top_k=-1).
"""
from __future__ import annotations

from dataclasses import dataclass, field
import math
from typing import Any, NoReturn, Optional

import numpy as np


MAX_INT32 = 2**31 - 1
MAX_TEMPERATURE = 1e4
GREEDY_TEMPERATURE = 1e-5             # below this a temperature samples as greedy (vLLM's _SAMPLING_EPS)
REPETITION_PENALTY_RANGE = (0.01, 100.0)
SEED_RANGE = (-2**63, 2**64 - 1)
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


class InvalidRequestError(ValueError):
    """A request the engine refuses before it runs; the message names the field."""


@dataclass
class SamplingParams:
    max_tokens: Optional[int] = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[int, float]] = None
    min_tokens: int = 0
    stop: Optional[list[str] | str] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    seed: Optional[int] = None
    n: int = 1
    best_of: Optional[int] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    detokenize: bool = True              # False: no text (tokens only; stop strings need text)
    json_schema: Optional[dict | str] = None
    regex: Optional[str] = None
    grammar: Optional[str] = None
    choice: Optional[list[str]] = None
    require_tool_call: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def validate(self, vocab_size: int) -> None:
        """Refuses any field out of its range with an InvalidRequestError naming it (the bounds are
        the module's constants; see the module docstring for the two documented clamps)."""
        _check_int("max_tokens", self.max_tokens, 1, MAX_INT32, optional=True)
        _check_real("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if not (_is_int(self.top_k) and (self.top_k == -1 or 1 <= self.top_k <= MAX_INT32)):
            _bad("top_k", f"must be -1 (off) or an integer in [1, {MAX_INT32}], got {self.top_k!r}")
        _check_real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_real("min_p", self.min_p, 0.0, 1.0)
        _check_real("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_real(name, getattr(self, name), -2.0, 2.0)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens if self.max_tokens is not None else MAX_INT32,
                   upper_name="max_tokens" if self.max_tokens is not None else None)
        self._validate_logit_bias(vocab_size)
        self._validate_stops(vocab_size)
        if self.seed is not None:
            _check_int("seed", self.seed, SEED_RANGE[0], SEED_RANGE[1])
        if not (_is_int(self.n) and 1 <= self.n <= MAX_INT32 and (self.best_of is None or (
                _is_int(self.best_of) and self.n <= self.best_of <= MAX_INT32))):
            _bad("n/best_of", f"need integers 1 <= n <= best_of <= {MAX_INT32}, got n={self.n!r}, "
                              f"best_of={self.best_of!r}")
        for name in ("logprobs", "prompt_logprobs"):
            _check_int(name, getattr(self, name), 0, MAX_LOGPROBS, optional=True)
        for name in ("ignore_eos", "skip_special_tokens", "require_tool_call"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                _bad(name, f"must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.extra, dict):
            _bad("extra", f"must be a dict, got {type(self.extra).__name__}")
        self._validate_structured()

    def _validate_logit_bias(self, vocab_size: int) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            _bad("logit_bias", f"must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
        for tid, bias in self.logit_bias.items():
            _check_token_id("logit_bias", tid, vocab_size)
            if not (_is_real(bias) and -100.0 <= bias <= 100.0):
                _bad("logit_bias", f"bias of token {tid} must be a number in [-100, 100], got {bias!r}")

    def _validate_stops(self, vocab_size: int) -> None:
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            _bad("stop", f"must be a string or a list of strings, got {type(self.stop).__name__}")
        stops = self.stop_strings
        if len(stops) > MAX_STOP_STRINGS:
            _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        for s in stops:
            if not isinstance(s, str) or not s:
                _bad("stop", f"stop strings must be non-empty strings, got {s!r}"[:200])
            if len(s) > MAX_STOP_STRING_CHARS:
                _bad("stop", f"a stop string has at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}")
        if stops and not self.detokenize:
            _bad("stop", "stop strings are matched in the text: they need detokenize=True")
        if self.stop_token_ids is None:
            return
        if not isinstance(self.stop_token_ids, (list, tuple, set, frozenset, np.ndarray)):
            _bad("stop_token_ids", f"must be a list of token ids, got {type(self.stop_token_ids).__name__}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(self.stop_token_ids)}")
        for tid in self.stop_token_ids:
            _check_token_id("stop_token_ids", tid, vocab_size)

    def _validate_structured(self) -> None:
        structured = [n for n in ("json_schema", "regex", "grammar", "choice") if getattr(self, n) is not None]
        if len(structured) > 1:
            _bad("/".join(structured), "give at most one kind of structured output")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            _bad("choice", "must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                _bad(name, "must be a string")
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, str)):
            _bad("json_schema", f"must be a dict or JSON text, got {type(self.json_schema).__name__}")
        if structured:
            from metrale.sampling.grammar import check_grammar
            try:
                check_grammar(self)
            except RecursionError:
                _bad(structured[0], "is nested too deeply")


def _bad(name: str, why: str) -> NoReturn:
    raise InvalidRequestError(f"{name}: {why}")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value: Any) -> bool:
    """A finite int or float (not a bool, not NaN or infinite)."""
    return (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
            and math.isfinite(value))


def _check_int(name: str, value: Any, low: int, high: int, *, optional: bool = False,
               upper_name: str | None = None) -> None:
    if value is None and optional:
        return
    if not (_is_int(value) and low <= value <= high):
        top = upper_name or str(high)
        _bad(name, f"must be an integer in [{low}, {top}], got {value!r}")


def _check_real(name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> None:
    ok = _is_real(value) and (low < value if low_open else low <= value) and value <= high
    if not ok:
        _bad(name, f"must be a finite number in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}")


def _check_token_id(name: str, tid: Any, vocab_size: int) -> None:
    if not (_is_int(tid) and 0 <= tid < vocab_size):
        _bad(name, f"token id {tid!r} is outside the vocabulary [0, {vocab_size})")
