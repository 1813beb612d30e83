"""Drafters propose tokens for speculative decoding; the engine verifies them in the ragged forward.

A Draft is a list of proposed tokens with a confidence per token (in [0, 1]); drafts are cut at
the first token under `levers.spec_min_confidence`. Drafters never own KV: the n-gram drafter
reads token lists, the model drafters run forwards whose KV lives in their backend's pool,
indexed by the target's block tables.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from metrale.scheduler.sequence import Sequence


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    probs: list[np.ndarray] | None = None    # the drafter's distribution per token (rejection sampling)

    def cut(self, k: int, min_confidence: float = 0.0) -> "Draft":
        n = min(k, len(self.tokens))
        for i in range(n):
            if self.confidences[i] < min_confidence:
                n = i
                break
        return Draft(self.tokens[:n], self.confidences[:n], None if self.probs is None else self.probs[:n])


class Drafter(Protocol):
    name: str

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """One draft of at most ks[i] tokens for each sequence (which is decoding: one token
        of it, the last, is not in the KV cache yet)."""

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was preempted: drop anything kept for it."""


class NgramDrafter:
    """Prompt lookup: the longest suffix (max_n down to min_n tokens) of prompt + output that
    occurred earlier proposes the tokens that followed its latest earlier occurrence."""

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram drafter needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [self._one(np.asarray(s.token_ids, dtype=np.int64), k) for s, k in zip(seqs, ks)]

    def _one(self, toks: np.ndarray, k: int) -> Draft:
        """Candidates are the earlier positions j holding the last token; each one's match length
        grows backwards while toks[j - d] == toks[L - 1 - d] (d < max_n): one pass over the
        candidates per d instead of a sliding-window comparison per n (this runs per drafting
        sequence and step)."""
        L = len(toks)
        j = np.flatnonzero(toks[:L - 1] == toks[L - 1])      # a match ends at j, before the last token
        if not j.size:
            return Draft()
        n = np.ones(j.size, dtype=np.int64)
        alive = np.ones(j.size, dtype=bool)
        for d in range(1, self.max_n):
            alive &= j >= d
            if not alive.any():
                break
            alive &= toks[np.maximum(j - d, 0)] == toks[L - 1 - d]
            n += alive
        best = int(n.max())
        if best < self.min_n:
            return Draft()
        start = int(j[np.flatnonzero(n == best)[-1]]) + 1     # the token after the latest longest match
        follow = toks[start:start + k].tolist()
        conf = best / self.max_n                             # longer matches are more trustworthy
        return Draft([int(t) for t in follow], [conf] * len(follow))

    def release(self, seq: Sequence) -> None:
        pass
