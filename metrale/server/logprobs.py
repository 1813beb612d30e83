"""Engine logprobs -> the OpenAI shapes.

The engine gives, per generated token, `{token id: logprob}`: the sampled token plus the top k
(k + 1 entries when the sampled token is not among the top k). Chat wants
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [k x {"token", "logprob", "bytes"}]}]}`;
completions want `{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}`.
A token's text is its own decoding (`tokenizer.decode([id])`), or `token_id:<id>` for a tokenizer
without `decode`. JSON has no -inf: logprobs below -9999 (and a missing one) are written as -9999.
"""
from __future__ import annotations

import math
from typing import Any

FLOOR = -9999.0


def clean(lp: float | None) -> float:
    return FLOOR if lp is None or not math.isfinite(lp) or lp < FLOOR else float(lp)


class TokenText:
    """Token id -> its text, cached per server."""

    def __init__(self, tokenizer):
        decode = getattr(tokenizer, "decode", None)
        self._decode = decode
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = f"token_id:{token_id}"
            if self._decode is not None:
                try:
                    text = self._decode([token_id], skip_special_tokens=False)
                except TypeError:
                    text = self._decode([token_id])
            if len(self._cache) < 1 << 18:
                self._cache[token_id] = text
        return text


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: (-kv[1], kv[0]))[:k]


def chat_content(token_ids, entries: list[dict[int, float]], k: int, text: TokenText) -> list[dict[str, Any]]:
    """The `logprobs.content` items of these tokens (k = top_logprobs)."""
    items = []
    for tok, entry in zip(token_ids, entries):
        tok = int(tok)
        s = text(tok)
        items.append({"token": s, "logprob": clean(entry.get(tok)), "bytes": list(s.encode("utf-8")),
                      "top_logprobs": [{"token": (t := text(i)), "logprob": clean(lp), "bytes": list(t.encode("utf-8"))}
                                       for i, lp in _top(entry, k)]})
    return items


class CompletionLogprobs:
    """The legacy completions `logprobs` object of one choice, built up delta by delta."""

    def __init__(self, text: TokenText, offset: int = 0):
        self.text, self.offset = text, offset
        self.reset()

    def reset(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top_logprobs: list[dict[str, float]] = []
        self.text_offset: list[int] = []

    def add(self, token_ids, entries: list[dict[int, float]]) -> None:
        for tok, entry in zip(token_ids, entries):
            tok = int(tok)
            s = self.text(tok)
            self.tokens.append(s)
            self.token_logprobs.append(clean(entry.get(tok)))
            self.top_logprobs.append({self.text(i): clean(lp) for i, lp in _top(entry, len(entry))})
            self.text_offset.append(self.offset)
            self.offset += len(s)

    def take(self) -> dict[str, list]:
        """What was added since the last take (streaming: each chunk carries its own tokens)."""
        out = self.body()
        self.reset()
        return out

    def body(self) -> dict[str, list]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}
