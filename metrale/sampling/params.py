"""SamplingParams with vLLM's field names; validated when a request is added.

Beyond vLLM: `require_tool_call` (the first answer token is the tokenizer's tool-call START token).
Structured output: at most one of json_schema (dict or JSON text), regex, grammar (Lark, llguidance
dialect) and choice (a list of strings); validate() compiles it and refuses it with llguidance's
message when it cannot be compiled.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np


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
    json_schema: Optional[dict | str] = None
    regex: Optional[str] = None
    grammar: Optional[str] = None
    choice: Optional[list[str]] = None
    require_tool_call: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def validate(self, vocab_size: int) -> None:
        def bad(name: str, why: str) -> None:
            raise InvalidRequestError(f"{name}: {why}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature < float("inf")):
            bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1)):
            bad("top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            bad("logit_bias", f"must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
        for name, ids in (("logit_bias", (self.logit_bias or {}).keys()), ("stop_token_ids", self.stop_token_ids or [])):
            for tid in ids:
                if isinstance(tid, bool) or not isinstance(tid, (int, np.integer)) or not 0 <= tid < vocab_size:
                    bad(name, f"token id {tid!r} is outside the vocabulary [0, {vocab_size})")
        for tid, bias in (self.logit_bias or {}).items():
            if not (isinstance(bias, (int, float)) and -100.0 <= bias <= 100.0):
                bad("logit_bias", f"bias of token {tid} must be a number in [-100, 100], got {bias!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if any(not s for s in self.stop_strings):
            bad("stop", "stop strings must be non-empty")
        if self.n < 1 or (self.best_of is not None and self.best_of < self.n):
            bad("n/best_of", f"need 1 <= n <= best_of, got n={self.n}, best_of={self.best_of}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 20):
                bad(name, f"must be an integer in [0, 20], got {k!r}")
        structured = [n for n in ("json_schema", "regex", "grammar", "choice") if getattr(self, n) is not None]
        if len(structured) > 1:
            bad("/".join(structured), "give at most one kind of structured output")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            bad("choice", "must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                bad(name, "must be a string")
        if structured:
            from metrale.sampling.grammar import check_grammar
            check_grammar(self)
