"""SamplingParams with vLLM's field names; validated when a request is added."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


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
        if not self.temperature >= 0.0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not (isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1)):
            bad("top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        for tid in list((self.logit_bias or {}).keys()) + list(self.stop_token_ids or []):
            if not isinstance(tid, int) or not 0 <= tid < vocab_size:
                bad("logit_bias/stop_token_ids", f"token id {tid!r} is outside the vocabulary [0, {vocab_size})")
        if any(not s for s in self.stop_strings):
            bad("stop", "stop strings must be non-empty")
        if self.n < 1 or (self.best_of is not None and self.best_of < self.n):
            bad("n/best_of", f"need 1 <= n <= best_of, got n={self.n}, best_of={self.best_of}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
