"""Drafters propose tokens for speculative decoding; the engine verifies them in the ragged forward.

A Draft is a list of proposed tokens with a confidence per token (in [0, 1]); drafts are cut at
the first token under `spec.gate.min_confidence`. Drafters never own KV: the n-gram drafter
reads token lists, the model drafters run forwards whose KV lives in their backend's pool,
indexed by the target's block tables.
"""
from __future__ import annotations

import weakref
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
    lookup_only: bool     # drafting is a host lookup (no forward): the engine may ask it while a step runs ahead

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """One draft of at most ks[i] tokens for each sequence (which is decoding: one token
        of it, the last, is not in the KV cache yet)."""

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was preempted: drop anything kept for it."""


SHORT_EXTEND = 16      # _NgramIndex.extend: up to this many new n-gram ends in a Python loop


class _NgramIndex:
    """One sequence's n-grams: tables[n][the n tokens ending at e] = the latest such e, for every
    e before the last token (an n-gram is entered when the token after it arrives)."""

    __slots__ = ("toks", "tables")

    def __init__(self, max_n: int):
        self.toks: list[int] = []
        self.tables: list[dict] = [{} for _ in range(max_n + 1)]

    def extend(self, new: list[int]) -> None:
        """Append tokens; enter the n-grams that now end before the last token: those ending at the
        old last position up to the new second-to-last (built with zip over slices: a prompt is
        indexed at C speed, ~0.1 us an entry, not one Python loop turn per n-gram)."""
        toks = self.toks
        e0 = max(len(toks) - 1, 0)
        toks.extend(new)
        e1 = len(toks) - 2
        if e1 - e0 < SHORT_EXTEND:                # a step's few tokens: a plain loop (zip's setup
            tables = self.tables                  # costs ~7 us a call)
            m = len(tables) - 1
            for e in range(e0, e1 + 1):
                if e + 1 >= m:                    # one list slice, the shorter n-grams its tuple's tails
                    key = tuple(toks[e - m + 1:e + 1])
                    for n in range(1, m + 1):
                        tables[n][key[m - n:]] = e
                else:
                    for n in range(1, e + 2):
                        tables[n][tuple(toks[e - n + 1:e + 1])] = e
            return
        for n in range(1, len(self.tables)):
            s = max(e0, n - 1)                    # the first end position with a full n-gram
            if s > e1:
                continue
            b, cnt = s - n + 1, e1 - s + 1
            grams = zip(*(toks[b + i:b + i + cnt] for i in range(n)))
            self.tables[n].update(zip(grams, range(s, e1 + 1)))   # later ends overwrite: latest wins


class NgramDrafter:
    """Prompt lookup: the longest suffix (max_n down to min_n tokens) of prompt + output that
    occurred earlier proposes the tokens that followed its latest earlier occurrence.

    Each sequence keeps an index of its n-grams (latest end position per n-gram, per n), grown by
    the tokens appended since the last call: a proposal is max_n dictionary lookups instead of a
    scan of the whole history (the scan plus the history's conversion to an array cost ~10-30 us a
    sequence and step on the CPU: ~0.3-1 ms a step at batch 32, against a 2.3 ms SmolLM2 step on
    the H200). tests/test_spec_units.py holds the definition it is checked against."""

    name = "ngram"
    lookup_only = True

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram drafter needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._index: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [self._lookup(self._synced(s), k) for s, k in zip(seqs, ks)]

    def _synced(self, seq: Sequence) -> _NgramIndex:
        """The sequence's index with every token of prompt + output entered (tokens only ever
        append; a shorter or different history rebuilds it)."""
        idx = self._index.get(seq)
        L = seq.num_tokens
        n = 0 if idx is None else len(idx.toks)
        if idx is None or n > L or (n and idx.toks[-1] != seq.token_slice(n - 1, n)[0]):
            idx = self._index[seq] = _NgramIndex(self.max_n)
            n = 0
        if n < L:
            idx.extend(seq.token_slice(n, L))
        return idx

    def _lookup(self, idx: _NgramIndex, k: int) -> Draft:
        toks, L = idx.toks, len(idx.toks)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            e = idx.tables[n].get(tuple(toks[L - n:]))
            if e is not None:
                follow = toks[e + 1:e + 1 + k]
                return Draft(follow, [n / self.max_n] * len(follow))
        return Draft()

    def release(self, seq: Sequence) -> None:
        self._index.pop(seq, None)
